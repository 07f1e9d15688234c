"""A resume at P >= 3 is bitwise although DDP lays its buckets out anew: the first step after a
restart runs DDP's initial buckets, the uninterrupted run its rebuilt ones, and a ring all_reduce's
sum order depends on where an element sits in its message.  The dense parts that do not ride in a
unit's message are summed together in the model's order at the step's end (``Step._sum_deferred``)."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run
from nets import train_step as _step

import commpress


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512),
                         nn.ReLU(), nn.Linear(512, 8))


def _worker(rank, world, name, params):
    def make():
        model = DDP(_net(), bucket_cap_mb=0.5)   # several buckets, laid out anew after the first step
        return model, torch.optim.SGD(model.parameters(), lr=0.05)

    model, opt = make()
    state = commpress.ddp.register(model, name, **params)
    for s in range(3):
        _step(model, opt, rank, s)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, buf)
    for s in range(3, 6):
        _step(model, opt, rank, s)
    state.close()
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    model2, opt2 = make()
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    state2 = commpress.ddp.register(model2, name, **params)
    state2.load_state_dict(ckpt["hook"])
    for s in range(3, 6):
        _step(model2, opt2, rank, s)
    state2.close()
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    return same, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,params", [("topk", {"ratio": 0.1}), ("powersgd", {"rank": 2})])
def test_a_resume_at_three_ranks_is_bitwise(name, params):
    out = run(_worker, 3, name, params, timeout=110)
    assert all(same for same, _ in out), [same for same, _ in out]
    assert all(torch.equal(out[0][1], o[1]) for o in out)   # replicas identical
