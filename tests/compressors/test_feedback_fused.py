"""topk's error feedback in one pass (``TopK.compress_feedback`` ->
``ops.topk_compact_feedback``) and the input scale folded into it
(``ErrorFeedback.compress(..., scale=)``, the DDP hook's ``1/P``).

* the fused path is bitwise the compensate-then-select path (payload, residual, verdict),
  on the numba and the torch backend, NaN/inf steps included;
* ``compress(tensor, scale=s)`` is bitwise ``tensor * s`` compressed the old way, for
  s = 1/2, 1/4 (and 1/3 where the path rounds the product on its own), with and without
  momentum correction;
* the residual is exactly ``x*s + beta*r`` minus what was sent;
* qsgd, terngrad, signsgd and fp16 with fused error feedback are bitwise the separate passes.
"""

from __future__ import annotations

import pytest
import torch

import commpress
from commpress.compressors.cast import FP16
from commpress.compressors.dgc import DGC
from commpress.compressors.qsgd import QSGD
from commpress.compressors.signsgd import SignSGD
from commpress.compressors.terngrad import TernGrad
from commpress.compressors.topk import TopK


class UnfusedTopK(TopK):
    """topk through the generic sparse error-feedback path (compensate, then select)."""

    fused_feedback = False


class UnfusedDGC(DGC):
    """dgc through the generic sparse error-feedback path."""

    fused_feedback = False


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float32:
        return t.contiguous().view(torch.int32)
    return t.contiguous().view(torch.int16) if t.dtype in (torch.float16, torch.bfloat16) else t


def _same(a, b, what: str) -> None:
    assert bool(a.nonfinite) == bool(b.nonfinite), what
    for ta, tb in zip(a.tensors, b.tensors):
        assert ta.dtype == tb.dtype and torch.equal(_bits(ta), _bits(tb)), what


def _steps(n: int = 3000, steps: int = 4, poison_at: int = 2):
    g = torch.Generator().manual_seed(7)
    for step in range(steps):
        x = torch.randn(n, generator=g) * (1 + step)
        x[::97] = 0.0
        x[5::211] = -0.0
        if step == poison_at:
            x[123] = float("nan")
        yield step, x


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("kinds", [(TopK, UnfusedTopK, 0.02), (DGC, UnfusedDGC, 0.01)], ids=["topk", "dgc"])
def test_fused_equals_compensate_then_select(backend, kinds, monkeypatch):
    if backend == "numba":
        pytest.importorskip("commpress.ops.numba_backend")
    monkeypatch.setenv("COMMPRESS_BACKEND", backend)
    fast_cls, slow_cls, ratio = kinds
    fused = commpress.ErrorFeedback(fast_cls(ratio, density_warmup=0))
    slow = commpress.ErrorFeedback(slow_cls(ratio, density_warmup=0))
    assert fused.compressor.fuses_feedback(torch.ones(3)) and not slow.compressor.fuses_feedback(torch.ones(3))
    for step, x in _steps(n=20000 if fast_cls is DGC else 3000):
        for fixed in (True, False):
            key = ("k", fixed)
            run = "compress_fixed" if fixed else "compress"
            a = getattr(fused, run)(x, step=step, key=key)
            b = getattr(slow, run)(x, step=step, key=key)
            _same(a, b, f"{backend} step {step} {run}")
            assert bool(a.nonfinite) == (step == 2)
            assert torch.equal(_bits(fused.residual(key)), _bits(slow.residual(key)))


def test_fused_numba_equals_fused_torch_with_beta_and_scale(monkeypatch):
    pytest.importorskip("commpress.ops.numba_backend")
    runs = {}
    for backend in ("numba", "torch"):
        monkeypatch.setenv("COMMPRESS_BACKEND", backend)
        ef = commpress.ErrorFeedback(TopK(0.05, density_warmup=0), beta=0.7)
        out = []
        for step, x in _steps():
            p = ef.compress_fixed(x, step=step, key="k", scale=1 / 3)
            out.append((p, ef.residual("k").clone()))
        runs[backend] = out
    for (pa, ra), (pb, rb) in zip(runs["numba"], runs["torch"]):
        _same(pa, pb, "numba vs torch")
        assert torch.equal(_bits(ra), _bits(rb))


@pytest.mark.parametrize("compressor,scales", [
    (lambda: TopK(0.02, density_warmup=0), (0.5, 0.25, 1 / 3)),          # fused: any scale
    (lambda: UnfusedTopK(0.02, density_warmup=0), (0.5, 0.25, 1 / 3)),   # generic sparse path
    (lambda: DGC(0.02, density_warmup=0), (0.5, 0.25, 1 / 3)),          # fused (fixed wire)
    (lambda: UnfusedDGC(0.02, density_warmup=0), (0.5, 0.25)),
])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_scale_is_bitwise_the_multiplied_input(compressor, scales, momentum):
    for s in scales:
        folded = commpress.ErrorFeedback(compressor(), momentum=momentum)
        before = commpress.ErrorFeedback(compressor(), momentum=momentum)
        for step, x in _steps(poison_at=-1):
            a = folded.compress_fixed(x, step=step, key="k", scale=s)
            b = before.compress_fixed(x.clone().mul_(s), step=step, key="k")  # the hook's old mul_
            _same(a, b, f"scale {s} step {step} momentum {momentum}")
            assert torch.equal(_bits(folded.residual("k")), _bits(before.residual("k")))


def test_scale_is_an_argument_of_one_call():
    ef = commpress.ErrorFeedback(TopK(0.5, density_warmup=0))
    ref = commpress.ErrorFeedback(TopK(0.5, density_warmup=0))
    x = torch.randn(64, generator=torch.Generator().manual_seed(1))
    _same(ef.compress(x, key="a", scale=0.5), ref.compress(x * 0.5, key="a"), "the call is scaled")
    _same(ef.compress(x, key="a"), ref.compress(x, key="a"), "the next one is not")
    _same(ef.compress(x.half(), key="h", scale=0.5), ref.compress(x.half() * 0.5, key="h"), "fp16: multiplied first")
    for bad in (float("nan"), float("inf"), True, "0.5"):
        with pytest.raises(ValueError, match="scale must be a finite number"):
            ef.compress(x, key="a", scale=bad)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("make,n", [(lambda: TopK(0.03, density_warmup=0), 3000),
                                    (lambda: DGC(0.01, density_warmup=0), 20000)], ids=["topk", "dgc"])
def test_fused_residual_is_exactly_what_was_not_sent(make, n, backend, monkeypatch):
    """dgc's fixed wire sends the capacity's largest entries at or above its sampled threshold:
    the slots below it are put back into the residual (``restore_below``) and sent as padding."""
    if backend == "numba":
        pytest.importorskip("commpress.ops.numba_backend")
    monkeypatch.setenv("COMMPRESS_BACKEND", backend)
    ef = commpress.ErrorFeedback(make())
    padded = 0
    for step, x in _steps(n=n, poison_at=-1):
        r = ef.residual("k")
        r = torch.zeros_like(x) if r is None else r.clone()
        p = ef.compress_fixed(x, step=step, key="k", scale=0.25)
        sent = ef.decompress(p)
        assert torch.equal(sent + ef.residual("k"), x * 0.25 + r)
        idx = p.tensors[0].long()
        real = idx[idx < n]
        padded += int((idx >= n).sum())
        assert int((ef.residual("k")[real] != 0).sum()) == 0
    assert padded > 0 or isinstance(ef.compressor, TopK)   # dgc put slots back below its threshold


class UnfusedQSGD(QSGD):
    fused_feedback = False


class UnfusedTernGrad(TernGrad):
    fused_feedback = False


class UnfusedSignSGD(SignSGD):
    fused_feedback = False


class UnfusedFP16(FP16):
    fused_feedback = False


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("kinds", [(lambda: QSGD(), lambda: UnfusedQSGD()),
                                   (lambda: QSGD(levels=3, bucket=100), lambda: UnfusedQSGD(levels=3, bucket=100)),
                                   (lambda: TernGrad(), lambda: UnfusedTernGrad()),
                                   (lambda: SignSGD(chunk=64), lambda: UnfusedSignSGD(chunk=64)),
                                   (lambda: FP16(), lambda: UnfusedFP16())],
                         ids=["qsgd", "qsgd-3-100", "terngrad", "signsgd", "fp16"])
def test_fused_quantizers_equal_compensate_compress_decode(backend, kinds, monkeypatch):
    """qsgd and terngrad compensate, code and keep the residual in one kernel (numba), signsgd too,
    fp16 casts in place: the payload (its noise from the same generator, a ``torch.Generator`` or
    the collectives' int seed), the residual and the verdict are bitwise the separate passes',
    NaN steps included (the residual then keeps its value)."""
    if backend == "numba":
        pytest.importorskip("commpress.ops.numba_backend")
    monkeypatch.setenv("COMMPRESS_BACKEND", backend)
    fast_make, slow_make = kinds
    for seeds in ("generator", "int"):
        fused = commpress.ErrorFeedback(fast_make())
        slow = commpress.ErrorFeedback(slow_make())
        assert fused.compressor.fuses_feedback(torch.ones(3)) and not slow.compressor.fuses_feedback(torch.ones(3))
        ga, gb = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
        for step, x in _steps(n=1500):
            noise = (ga, gb) if seeds == "generator" else (1000 + step, 1000 + step)
            a = fused.compress_fixed(x, step=step, key="k", generator=noise[0])
            b = slow.compress_fixed(x, step=step, key="k", generator=noise[1])
            _same(a, b, f"{backend} {seeds} step {step}")
            assert bool(a.nonfinite) == (step == 2)
            assert torch.equal(_bits(fused.residual("k")), _bits(slow.residual("k"))), f"step {step}"


def test_fp16_feedback_saturates_and_keeps_the_rest():
    """fp16 under error feedback sends a finite value beyond ±65504 as ±65504 (a plain cast would
    send inf) and the residual keeps the difference; inf still goes out as inf."""
    ef = commpress.ErrorFeedback(FP16())
    x = torch.tensor([1e5, -7e4, 1.0, 65519.0, 65520.0])
    p = ef.compress(x, key="k")
    assert p.tensors[0].tolist() == [65504.0, -65504.0, 1.0, 65504.0, 65504.0] and not bool(p.nonfinite)
    assert torch.equal(ef.residual("k"), x - p.tensors[0].float())
    bad = ef.compress(torch.tensor([float("inf"), 1.0, 0.0, 0.0, 0.0]), key="k")
    assert bad.tensors[0][0].item() == float("inf") and bool(bad.nonfinite)
    assert torch.equal(ef.residual("k"), x - p.tensors[0].float())   # kept
