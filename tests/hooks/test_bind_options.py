"""``commpress.ddp.register``'s typed options on 2 ranks: ``auto=AutoSpec(...)``, ``momentum``,
``join_buckets`` as keywords of their own; none of them warns."""

from __future__ import annotations

import warnings

import pytest
import torch

from distributed import run
from test_ddp import batch, fast_ops, loss_of, make_ddp

import commpress
from commpress.auto.runtime import AutoSpec


def _typed(rank, world):
    fast_ops()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        out = []
        for kind, kw in (("auto", dict(auto=AutoSpec(candidates=[("topk", 0.05)], check_every=1), min_numel=256)),
                         ("topk", dict(ratio=0.05, momentum=0.5, momentum_masking=True, join_buckets=True))):
            model = make_ddp(seed=6)
            state = commpress.ddp.register(model, kind, overlap=False, **kw)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(3):
                opt.zero_grad()
                loss_of(model, *batch(rank, step, seed=3)).backward()
                opt.step()
            cfg = state.config()
            out.append((state.step, cfg["compressor"], cfg["momentum"], cfg.get("join_buckets"),
                        torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()))
            state.close()
    return out


@pytest.mark.timeout(120)
def test_register_with_typed_options_trains_without_warnings():
    res = run(_typed, 2, timeout=100)
    for (a_step, a_name, _, _, _), (t_step, t_name, momentum, joins, _) in res:
        assert a_step == t_step == 3
        assert a_name == "auto" and t_name == "topk" and momentum == 0.5 and joins is True
    for i in range(2):
        assert (res[0][i][-1] == res[1][i][-1]).all()     # replicas agree
