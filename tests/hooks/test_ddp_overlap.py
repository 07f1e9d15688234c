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


def dropped_worker(rank, world, spec):
    name, params, takeover = spec
    import gc
    import threading
    import weakref

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Linear(96, 8)), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9 if takeover else 0.0)
    state = commpress.ddp.register(model, name, overlap=True, min_numel=256,
                                   **({"optimizer": opt} if takeover else {}), **params)
    for step in range(4):
        g = torch.Generator().manual_seed(100 * step + rank)
        opt.zero_grad()
        model(torch.randn(8, 32, generator=g)).square().mean().backward()
        opt.step()
    worker = [t for t in threading.enumerate() if t.name == "commpress-ddp"]
    model_ref, state_ref = weakref.ref(model), weakref.ref(state)
    overlapped = state.overlap
    del model, state, opt
    gc.collect()
    for t in worker:
        t.join(timeout=10)
    return overlapped, len(worker), model_ref() is None, state_ref() is None, [t.is_alive() for t in worker]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("spec", [("topk", {"ratio": 0.05}, False), ("auto", {}, False),
                                  ("topk", {"ratio": 0.05}, True)], ids=["topk", "auto", "topk-optimizer"])
def test_a_state_dropped_without_close_frees_the_model_and_stops_its_worker(spec):
    """Dropping the model (and the state with it) without close() releases both and stops the
    overlap worker: nothing the worker thread holds keeps the state, or the model, alive."""
    for overlapped, workers, model_freed, state_freed, alive in run(dropped_worker, 2, spec, timeout=80):
        assert overlapped and workers == 1
        assert model_freed and state_freed
        assert alive == [False]
