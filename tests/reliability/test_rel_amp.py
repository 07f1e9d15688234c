"""Mixed precision: an overflow step stays visible and leaves error feedback alone.

``torch.autocast("cpu", bfloat16)`` + ``torch.amp.GradScaler("cpu")``.  At one step
rank 0's batch is scaled by 1e38, so its forward overflows and its gradients are
inf/NaN.  On *every* rank the synchronized gradient must hold a NaN/inf (so every
rank's scaler skips the step: parameters unchanged, scale lowered) and the hook's
whole state (error-feedback residuals, owner-side residuals, generators) must be
bitwise what it was before the step; the next step is finite and trains again.
Gradients reach the hooks as fp32 (DDP, fp32 params), bf16 (DDP, bf16 params;
FSDP2 with ``reduce_dtype=bf16``) and fp16 (FSDP2 with ``reduce_dtype=fp16``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import commpress
from bitwise import tensors_in
from distributed import run
from faults import torch_kernels
from relmodels import batch, make_ddp, make_fsdp

pytestmark = pytest.mark.reliability

OVERFLOW_AT, STEPS = 3, 5


def _state_tensors(state):
    sd = state.state_dict()
    return tensors_in({"codec": sd["codec"], "extra": sd["extra"]})


def _local_params(model):
    return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in model.parameters()]


def _full_grads(model):
    return [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]


def _amp(rank, world, kind, name, params, dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch_kernels()
    if kind == "ddp":
        model = make_ddp()
        if dtype != torch.float32:
            from torch.nn.parallel import DistributedDataParallel as DDP
            model = DDP(model.module.to(dtype), bucket_cap_mb=0.001)
        state = commpress.ddp.register(model, name, warmup_steps=1, min_numel=256, **params)
    else:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=dtype)
        model = make_fsdp(world, mp_policy=mp)
        state = commpress.fsdp.register(model, name, **params)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    out = {}
    for i in range(STEPS):
        x, y = batch(rank, i)
        if i == OVERFLOW_AT and rank == 0:
            x = x * 1e38
        before = _state_tensors(state)
        p_before = _local_params(model)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        grads = _full_grads(model)
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        after = _state_tensors(state)
        untouched = len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        moved = not all(torch.equal(a, b) for a, b in zip(p_before, _local_params(model)))
        if i == OVERFLOW_AT:
            out["overflow"] = {"finite": finite, "state_untouched": untouched, "n_state": len(before),
                               "params_moved": moved, "scale_dropped": scaler.get_scale() < scale,
                               "grad_dtypes": sorted({str(g.dtype) for g in grads})}
        elif i == OVERFLOW_AT + 1:
            out["next"] = {"finite": finite, "state_changed": not untouched, "params_moved": moved}
    return out


CASES = {
    # the steady state of topk (no density warm-up): at its first stage, 25%, "auto" sends the whole
    # gradient in bf16, whose rounding residual is zero for these bf16-exact autocast gradients
    "ddp-topk-fp32": ("ddp", "topk", {"ratio": 0.05, "density_warmup": 0}, torch.float32),
    "ddp-blockquant-bf16": ("ddp", "blockquant", {"bits": 4, "error_feedback": True}, torch.bfloat16),
    "fsdp-topk-bf16": ("fsdp", "topk", {"ratio": 0.05}, torch.bfloat16),
    "fsdp-blockquant-fp16": ("fsdp", "blockquant", {"bits": 4, "error_feedback": True}, torch.float16),
}


def _all_cases(rank, world):
    return {case: _amp(rank, world, *args) for case, args in CASES.items()}


@pytest.fixture(scope="module")
def amp_results():
    """All cases in one 2-rank run (one process start-up)."""
    per_rank = run(_all_cases, 2, timeout=200, pg_timeout=60)
    return {case: [r[case] for r in per_rank] for case in CASES}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_overflow_step_is_non_finite_on_every_rank_and_skipped(amp_results, case):
    for rank, out in enumerate(amp_results[case]):
        ov, nx = out["overflow"], out["next"]
        assert not ov["finite"], (case, rank, ov)               # NaN/inf reached every rank
        assert not ov["params_moved"] and ov["scale_dropped"], (case, rank, ov)   # scaler skipped
        assert nx["finite"] and nx["params_moved"], (case, rank, nx)            # training goes on


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_overflow_step_leaves_error_feedback_state_untouched(amp_results, case):
    for rank, out in enumerate(amp_results[case]):
        ov, nx = out["overflow"], out["next"]
        assert ov["n_state"] > 0 and ov["state_untouched"], (case, rank, ov)
        assert nx["state_changed"], (case, rank, nx)       # error feedback is live again
