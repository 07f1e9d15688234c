"""The DDP comm hook with ``torch.compile``: the same gradients as without it, and no Dynamo
warning of its own (``"auto"`` stamps the forward's start and end on the host clock).

Two ways to compile: the module inside DDP (``DDP(torch.compile(net))``: the graphs are the
module's, DDP and the hook run around them), and DDP itself (``torch.compile(DDP(net))``: on gloo /
CPU, torch 2.13, Dynamo skips DDP's forward and captures no graph, but it traces the DDP module's
forward hooks, which is where ``"auto"``'s host-clock stamps used to make it warn)."""

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


def _train(rank: int, compressor: str, compile_: str, steps: int, kw: dict):
    """``steps`` SGD steps of a DDP model with ``compressor``'s hook; ``compile_``: ``"no"``,
    ``"inner"`` (the module, compiled by a backend that runs the captured graph as it is: the same
    kernels, so the same bits) or ``"outer"`` (DDP itself).  Returns the parameters, the hook's
    step count, the graphs captured, the warnings and the Dynamo graph-break reasons."""
    import torch._dynamo as dynamo

    dynamo.reset()
    dynamo.utils.counters.clear()
    graphs: list[int] = []

    def backend(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    net = _net()
    ddp = DDP(torch.compile(net, backend=backend) if compile_ == "inner" else net)
    state = commpress.ddp.register(ddp, compressor, **kw)
    model = torch.compile(ddp, backend=backend) if compile_ == "outer" else ddp
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
    return params, state.step, len(graphs), [str(w.message) for w in seen], breaks, choices


def _eager_and_compiled(rank, world, compressor, modes, steps, kw):
    return [_train(rank, compressor, mode, steps, kw) for mode in ("no", *modes)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("compressor,kw", [
    # fp32 residuals: the default int8 store's rounding noise is seeded by each unit's key, which
    # names its parameters, and torch.compile renames them (``_orig_mod.``): other noise, other bits
    ("topk", {"ratio": 0.05, "residual_storage": "fp32"}),
    ("blockquant", {"bits": 4, "residual_storage": "fp32"}),
], ids=["topk-ef", "blockquant"])
def test_a_compiled_module_gets_the_same_gradients(compressor, kw):
    """A module compiled inside DDP: bitwise the same parameters after the warm-up and several
    compressed steps, on every rank, and the compiler did capture its graphs."""
    res = run(_eager_and_compiled, 2, compressor, ("inner",), 8, kw, timeout=150)
    for eager, compiled in res:
        assert eager[1] == compiled[1] == 8
        assert eager[2] == 0 and compiled[2] >= 1, "nothing was compiled"
        for a, b in zip(eager[0], compiled[0]):
            assert torch.equal(a, b)
    for a, b in zip(res[0][1][0], res[1][1][0]):
        assert torch.equal(a, b)


@pytest.mark.timeout(180)
def test_auto_with_compile_warns_nothing_and_still_decides():
    """``"auto"``'s forward hooks read the host clock: where Dynamo traces them (DDP compiled) it must
    skip them (no warning, no perf_counter graph break) and they must still run, so ``"auto"``
    decides and every rank ends with the same parameters.  (Not compared with the uncompiled run:
    ``"auto"``'s plan follows wall-clock measurements, which differ between any two runs.)"""
    res = run(_eager_and_compiled, 2, "auto", ("inner", "outer"), 8, {}, timeout=150)
    for _, inner, outer in res:
        for params, step, _, seen, breaks, choices in (inner, outer):
            assert step == 8
            assert not [w for w in seen if "perf_counter" in w or "commpress" in w], seen
            assert not [b for b in breaks if "perf_counter" in b], breaks
            assert choices, "auto reported no choice"
        assert inner[2] >= 1, "nothing was compiled"
        assert outer[4], "Dynamo did not trace DDP's forward"   # its own graph breaks: it looked
    for run_index in (1, 2):   # inner, outer: the replicas agree
        for a, b in zip(res[0][run_index][0], res[1][run_index][0]):
            assert torch.equal(a, b)
