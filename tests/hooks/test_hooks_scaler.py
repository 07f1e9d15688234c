"""Error feedback under AMP loss scaling (``register(..., scaler=)`` / ``state.attach_scaler``).

With a power-of-two loss scale ``S`` every multiplication by ``S`` or ``1/S`` is exact, so a run
under ``torch.amp.GradScaler`` whose scale changes (grown every 2 steps, halved by an overflow
step) must end bitwise equal to the same run without scaling: the same parameters and the same
hook state (residuals, velocities), which the hook keeps in unscaled units.  Without the hook
undoing ``S`` its residuals are off by the ratio of two steps' scales and the runs part.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import test_ddp_host_reads as host_reads
from bitwise import tensors_in
from distributed import run
from nets import MLP3, fsdp_shard, small_net

import commpress
from commpress.hooks.common import loss_scales

STEPS = 8
INF_AT = 4            # rank 0's gradient gets an inf: every rank skips the step, the scale halves
READ_AT = 6           # a steady-state step run under the host-read spy
INIT_SCALE = 2.0**10


def _batch(rank, step, d):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, d, generator=g), torch.randint(0, 8, (16,), generator=g)


def _state_tensors(state):
    """Every tensor of the hook's state_dict (residuals, velocities, ...), in a fixed order."""
    return tensors_in(state.state_dict())


def _scaler(scaled):
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=2) if scaled else None


def _train(rank, model, state, inf_param, d, scaler):
    """STEPS SGD steps; with ``scaler`` under it (growth every 2 steps), else skipping the steps
    whose gradients are not finite by hand.  At INF_AT rank 0's gradient of ``inf_param`` gets an
    inf (``None``: its input does; FSDP2 runs no hook of a sharded parameter in the backward).
    Returns (params, state tensors, scales, reads)."""
    assert state.scaler is scaler
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inject = {"on": False}

    def poison(g):
        if inject["on"] and rank == 0:
            g = g.clone()
            g.view(-1)[3] = float("inf")
        return g

    if inf_param is not None:
        inf_param.register_hook(poison)
    scales, reads = [], None
    for step in range(STEPS):
        inject["on"] = step == INF_AT
        x, y = _batch(rank, step, d)
        if inject["on"] and rank == 0 and inf_param is None:
            x[0, 3] = float("inf")
        spy = host_reads.HostReads() if step == READ_AT else None
        if spy is not None:
            spy.__enter__()
        try:
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(x), y)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        finally:
            if spy is not None:
                spy.__exit__(None, None, None)
                reads = spy.calls
        if scaler is not None:
            scales.append(scaler.get_scale())
            scaler.step(opt)
            scaler.update()
        elif all(bool(torch.isfinite(_local(p.grad)).all()) for p in model.parameters()):
            opt.step()
    params = [_local(p).detach().clone() for p in model.parameters()]
    return params, _state_tensors(state), scales, reads


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _compare(scaled, plain):
    (p1, s1, scales, reads), (p2, s2, _, _) = scaled, plain
    return {"params": _same(p1, p2), "state": _same(s1, s2), "n_state": len(s1), "scales": scales,
            "finite": all(bool(torch.isfinite(p).all()) for p in p1), "reads": reads}


# ------------------------------------------------------------------------------- DDP
DDP_CASES = {
    "topk": ({"ratio": 0.01, "density_warmup": 0}, {}),
    "blockquant4": ({"bits": 4, "error_feedback": True}, {}),
    "topk-momentum": ({"ratio": 0.01, "density_warmup": 0, "momentum": 0.9}, {}),
    "topk-inline-attached-late": ({"ratio": 0.01, "density_warmup": 0}, {"overlap": False, "late": True}),
}


def _ddp_worker(rank, world):
    os.environ["COMMPRESS_BACKEND"] = "torch"   # the reference ops: no numba JIT in a fresh rank
    out = {}
    for case, (params, opts) in DDP_CASES.items():
        name = case.split("-")[0].rstrip("4")
        late = opts.get("late", False)
        runs = []
        for scaled in (True, False):
            torch.manual_seed(0)
            model = DDP(MLP3(), bucket_cap_mb=0.01)
            scaler = _scaler(scaled)
            state = commpress.ddp.register(model, name, min_numel=256, overlap=opts.get("overlap", True),
                                           scaler=None if late else scaler, **params)
            if late:   # attached after binding: the frozen configuration follows
                state.attach_scaler(scaler)
            runs.append(_train(rank, model, state, model.module.fc2.weight, 32, scaler))
            state.close()
        out[case] = _compare(*runs)
    return out


@pytest.mark.timeout(120)
def test_ddp_error_feedback_is_independent_of_the_loss_scale():
    for rank_out in run(_ddp_worker, 2, timeout=110):
        for case, got in rank_out.items():
            assert got["finite"], case
            # the scale grew, was halved by the overflow step and grew again
            assert got["scales"] == [2**10, 2**10, 2**11, 2**11, 2**12, 2**11, 2**11, 2**12], case
            assert got["n_state"] > 0, case
            assert got["params"] and got["state"], case
            assert got["reads"] == [], (case, got["reads"])


# ------------------------------------------------------------------------------ FSDP2
def _fsdp_worker(rank, world):
    runs = []
    for scaled in (True, False):
        model = fsdp_shard(small_net(), world)
        scaler = _scaler(scaled)
        state = commpress.fsdp.register(model, "topk", ratio=0.05, density_warmup=0, scaler=scaler)
        runs.append(_train(rank, model, state, None, 32, scaler))
    return _compare(*runs)


@pytest.mark.timeout(120)
def test_fsdp_error_feedback_is_independent_of_the_loss_scale():
    for got in run(_fsdp_worker, 2, timeout=110):
        assert got["finite"]
        assert got["scales"] == [2**10, 2**10, 2**11, 2**11, 2**12, 2**11, 2**11, 2**12]
        assert got["n_state"] > 0
        assert got["params"] and got["state"]
        assert got["reads"] == [], got["reads"]


# ------------------------------------------------------------------------------ the argument
def test_scaler_argument_is_checked():
    with pytest.raises(TypeError, match="scaler"):
        commpress.ddp.DDPState("topk", ratio=0.01, scaler=2.0**16)
    state = commpress.ddp.DDPState("topk", ratio=0.01)
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler"):
        state.attach_scaler("amp")
    scaler = torch.amp.GradScaler("cpu")
    state.attach_scaler(scaler)
    assert state.scaler is scaler
    state.attach_scaler(None)
    assert state.scaler is None
    from commpress.hooks.fsdp import FSDPState

    with pytest.raises(TypeError, match="scaler"):
        FSDPState("topk", ratio=0.01, scaler=object())


def test_loss_scales_read_on_the_device():
    cpu = torch.device("cpu")
    assert loss_scales(None, cpu) is None
    assert loss_scales(torch.amp.GradScaler("cpu", enabled=False), cpu) is None
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**7)
    assert loss_scales(scaler, cpu) is None           # nothing scaled yet: no scale tensor
    scaler.scale(torch.ones(()))
    s, inv = loss_scales(scaler, cpu)
    assert s.shape == () and s.dtype == torch.float32 and float(s) == 2.0**7 and float(inv) == 2.0**-7
    scaler.update(2.0**3)                             # the step's own copy: later changes leave it
    assert float(s) == 2.0**7
