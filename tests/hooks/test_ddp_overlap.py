"""overlap=True (worker thread, own group) and overlap=False (inline) train bitwise alike."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run

import commpress


def _train(rank, name, params, overlap, steps=6):
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Linear(96, 64), nn.ReLU(), nn.Linear(64, 8)),
                bucket_cap_mb=0.01)
    state = commpress.ddp.register(model, name, overlap=overlap, min_numel=256, **params)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    assert state.overlap == overlap
    state.close()
    return [p.detach().clone() for p in model.parameters()], state.residuals_by_param()


def overlap_worker(rank, world, cases):
    out = {}
    for name, params in cases:
        a, ra = _train(rank, name, params, True)
        b, rb = _train(rank, name, params, False)
        out[name] = (all(torch.equal(x, y) for x, y in zip(a, b)),
                     ra.keys() == rb.keys() and all(torch.equal(ra[k], rb[k]) for k in ra), len(ra))
    return out


@pytest.mark.timeout(150)
def test_overlap_and_inline_train_bitwise_alike():
    cases = [("topk", {"ratio": 0.05}), ("blockquant", {"bits": 4, "stochastic": True, "error_feedback": True}),
             ("powersgd", {"rank": 2})]
    for rank_out in run(overlap_worker, 2, cases, timeout=140):
        for name, (same_params, same_residuals, n_residuals) in rank_out.items():
            assert same_params and same_residuals and n_residuals > 0, name
