"""The DDP comm hook under ``torch.compile``: the same gradients as without it, and no Dynamo
warning of its own (``"auto"`` stamps the forward's start and end on the host clock)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run

import commpress


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))


def _train(rank: int, compressor: str, compiled: bool, steps: int, kw: dict):
    """``steps`` SGD steps of a DDP model with ``compressor``'s hook, compiled (Dynamo, eager
    backend: the traced graph runs the same kernels) or not; the parameters, the hook's step
    count, the Dynamo warnings and graph-break reasons seen."""
    import torch._dynamo as dynamo

    dynamo.reset()
    dynamo.utils.counters.clear()
    ddp = DDP(_net())
    state = commpress.ddp.register(ddp, compressor, **kw)
    model = torch.compile(ddp, backend="eager") if compiled else ddp
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(steps):
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    breaks = list(dynamo.utils.counters["graph_break"])
    params = [p.detach().clone() for p in ddp.parameters()]
    choices = state.stats.as_dict().get("auto")
    state.close()
    return params, state.step, [str(w.message) for w in seen], breaks, choices


def _compiled_vs_eager(rank, world, compressor, steps, kw):
    eager = _train(rank, compressor, False, steps, kw)
    compiled = _train(rank, compressor, True, steps, kw)
    return eager, compiled


@pytest.mark.timeout(180)
@pytest.mark.parametrize("compressor,kw", [
    ("topk", {"ratio": 0.05}),
    ("blockquant", {"bits": 4}),
], ids=["topk-ef", "blockquant"])
def test_a_compiled_model_gets_the_same_gradients(compressor, kw):
    """torch.compile changes nothing the hook sees: bitwise the same parameters after the warm-up
    and several compressed steps, on every rank."""
    res = run(_compiled_vs_eager, 2, compressor, 8, kw, timeout=150)
    for (p_eager, step_e, _, _, _), (p_comp, step_c, _, breaks, _) in res:
        assert step_e == step_c == 8
        assert breaks, "the model was not compiled"   # DDP's own graph breaks: Dynamo traced it
        for a, b in zip(p_eager, p_comp):
            assert torch.equal(a, b)
    for a, b in zip(res[0][1][0], res[1][1][0]):
        assert torch.equal(a, b)


@pytest.mark.timeout(180)
def test_auto_under_compile_warns_nothing_and_still_times_the_step():
    """``"auto"``'s forward hooks read the host clock: Dynamo must skip them (no warning, no
    perf_counter graph break) and they must still run, so the check points decide."""
    res = run(_compiled_vs_eager, 2, "auto", 8, {}, timeout=150)
    for (p_eager, _, _, _, _), (p_comp, step, seen, breaks, choices) in res:
        assert step == 8
        assert not [w for w in seen if "perf_counter" in w or "commpress" in w], seen
        assert not [b for b in breaks if "perf_counter" in b], breaks
        assert choices, "auto reported no choice"
        for a, b in zip(p_eager, p_comp):
            assert torch.equal(a, b)
