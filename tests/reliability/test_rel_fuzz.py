"""Input fuzzing: a hypothesis state machine drives compress / error feedback / checkpoint /
restore / step sequences over every compressor with hostile tensors, checking the contracts
after every step.

Tensors: fp32 / fp16 / bf16 (supported) and fp64 / int32 / int64 (must raise ``TypeError``
naming the dtype), shapes from empty to a few hundred elements, contiguous or not
(transposed, strided), magnitudes from 1e-30 to 1e30, with NaN, +-Inf, -0.0 and subnormals
sprinkled in.

Contracts checked after each rule:

* compress/decompress: the payload describes the input (shape, dtype, numel), ``nbytes``
  is the wire tensors' size, the round trip has the input's shape and dtype, identity is
  exact;
* error feedback, finite compensated input: ``sent + residual_after == x + residual_before``
  (fp32, to rounding); a non-finite input or payload leaves the residual bitwise untouched;
* unsupported dtype: ``TypeError`` naming the dtype, residual untouched;
* checkpoint → ``torch.save`` → ``torch.load(weights_only=True)`` → restore gives bitwise
  the saved residuals, and a restored copy compresses bitwise like the original.

Runs on the pure-torch kernels (the numba ones are proven bitwise equal in ``tests/ops``).
"""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

import commpress

pytestmark = pytest.mark.reliability

COMPRESSORS = [
    ("identity", {}), ("fp16", {}), ("bf16", {}),
    ("topk", {"ratio": 0.1}), ("randomk", {"ratio": 0.2}), ("threshold", {"threshold": 0.5}),
    ("dgc", {"ratio": 0.1}),
    ("qsgd", {"levels": 7}), ("terngrad", {}), ("signsgd", {"chunk": 64}),
    ("blockquant", {"bits": 4, "block": 64}), ("blockquant", {"bits": 8, "stochastic": True}),
    ("powersgd", {"rank": 2}),
]
SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)
DTYPES = SUPPORTED + (torch.float64, torch.int32, torch.int64)
SHAPES = [(0,), (1,), (7,), (64,), (300,), (0, 5), (3, 1), (16, 20), (5, 33)]
MAGNITUDES = [1e-30, 1e-8, 1.0, 1e4, 1e30]
SPECIALS = ["nan", "inf", "-inf", "-0.0", "subnormal"]
EXAMPLES, STEPS = 150, 15
#: what the suite ran (read by the report / README figures)
COUNTS = {"cases": 0, "rules": 0, "conservation": 0, "non_finite": 0, "bad_dtype": 0,
          "restores": 0, "restore_compare": 0}


@st.composite
def tensors(draw):
    """A hostile tensor, built from drawn parameters by a seeded torch.Generator."""
    dtype = draw(st.sampled_from(SUPPORTED * 3 + DTYPES[3:]))
    shape = draw(st.sampled_from(SHAPES))
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    magnitude = draw(st.sampled_from(MAGNITUDES))
    specials = draw(st.lists(st.sampled_from(SPECIALS), max_size=3))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if layout == "strided":                      # every other element of a twice-as-long tensor
        base_shape = shape[:-1] + (2 * shape[-1],)
    elif layout == "transposed" and len(shape) == 2:
        base_shape = shape[::-1]
    else:
        base_shape = shape
    if dtype.is_floating_point:
        x = (torch.randn(base_shape, generator=g, dtype=torch.float64) * magnitude).to(dtype)
        flat = x.view(-1)
        for s in specials:
            if flat.numel() == 0:
                break
            i = int(torch.randint(0, flat.numel(), (1,), generator=g))
            flat[i] = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "-0.0": -0.0,
                       "subnormal": torch.finfo(dtype).tiny / 4}[s]
    else:
        x = torch.randint(-100, 100, base_shape, generator=g, dtype=dtype)
    if layout == "strided":
        x = x[..., ::2]
    elif layout == "transposed" and len(shape) == 2:
        x = x.t()
    assert tuple(x.shape) == shape
    return x


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as a flat integer tensor (NaN == NaN, -0.0 != 0.0)."""
    f = t.detach().reshape(-1).contiguous().clone()
    if not f.is_floating_point():
        return f
    return f.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[f.element_size()])


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


class CompressorMachine(RuleBasedStateMachine):
    """One compressor, its ErrorFeedback wrapper and a list of checkpoints."""

    def __init__(self):
        super().__init__()
        self.step = 0
        self.checkpoints: list[tuple[bytes, dict]] = []
        COUNTS["cases"] += 1

    @initialize(which=st.sampled_from(range(len(COMPRESSORS))))
    def build(self, which):
        self.name, self.params = COMPRESSORS[which]
        self.comp = commpress.get(self.name, **self.params)
        self.ef = commpress.ErrorFeedback(commpress.get(self.name, **self.params))
        self.gen = torch.Generator().manual_seed(which)

    def _unsupported(self, fn, x):
        COUNTS["bad_dtype"] += 1
        with pytest.raises(TypeError, match=str(x.dtype).replace("torch.", "")):
            fn()

    # ------------------------------------------------------------------ rules
    @rule(x=tensors(), key=st.sampled_from([0, "a"]))
    def compress_round_trip(self, x, key):
        COUNTS["rules"] += 1
        call = lambda: self.comp.compress(x, step=self.step, key=key, generator=self.gen)  # noqa: E731
        if x.dtype not in SUPPORTED:
            self._unsupported(call, x)
            return
        original = x.clone()
        p = call()
        assert torch.equal(bits(x), bits(original)), "compress modified its input"
        assert p.shape == x.shape and p.dtype == x.dtype and p.numel == x.numel()
        assert p.nbytes == sum(t.numel() * t.element_size() for t in p.tensors)
        y = self.comp.decompress(p)
        assert y.shape == x.shape and y.dtype == x.dtype
        if self.name == "identity":
            assert torch.equal(bits(y), bits(x))

    @rule(x=tensors(), key=st.sampled_from([0, "a"]))
    def error_feedback_step(self, x, key):
        COUNTS["rules"] += 1
        r = self.ef.residual(key)
        before = None if r is None else r.clone()
        call = lambda: self.ef.compress(x, step=self.step, key=key, generator=self.gen)  # noqa: E731
        if x.dtype not in SUPPORTED:
            self._unsupported(call, x)
            after = self.ef.residual(key)
            assert (before is None and after is None) or torch.equal(bits(before), bits(after))  # NaN == NaN
            return
        c = x.float() if x.dtype != torch.float32 else x.clone()
        if before is not None and before.numel() == x.numel():
            c = c + self.ef.beta * before.view(x.shape)
        p = call()
        sent = self.ef.decompress(p)
        assert sent.shape == x.shape and sent.dtype == x.dtype
        after = self.ef.residual(key)
        if _finite(c) and _finite(c.to(x.dtype)) and _finite(sent):
            assert after is not None and after.dtype == torch.float32 and after.numel() == x.numel()
            COUNTS["conservation"] += 1
            total = sent.float() + after.view(x.shape)
            scale = c.abs() + sent.float().abs()
            assert bool(((total - c).abs() <= 1e-5 * scale + 1e-30).all()), \
                f"{self.name}: sent + residual != compensated input"
        if not _finite(x):
            COUNTS["non_finite"] += 1
            # the payload carries the NaN/inf (so GradScaler sees it) ...
            assert not _finite(sent), f"{self.name}: a non-finite input decoded to a finite tensor"
            # ... and a non-finite gradient never reaches the residual (a key seen for the
            # first time keeps the zero residual it starts with: the decision is made on the
            # device, so the buffer exists either way)
            fresh = before is None or before.numel() != x.numel()
            start = torch.zeros(x.shape) if fresh else before
            assert after is None or torch.equal(bits(start.view(-1)), bits(after.view(-1))), \
                f"{self.name}: residual changed by a non-finite input"

    @rule()
    def checkpoint(self):
        COUNTS["rules"] += 1
        buf = io.BytesIO()
        torch.save(self.ef.state_dict(), buf)
        snap = {k: v.clone() for k, v in self.ef._residuals.items()}
        self.checkpoints.append((buf.getvalue(), snap))

    @precondition(lambda self: self.checkpoints)
    @rule(data=st.data())
    def restore(self, data):
        COUNTS["rules"] += 1
        COUNTS["restores"] += 1
        blob, snap = data.draw(st.sampled_from(self.checkpoints))
        self.ef.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))
        got = self.ef._residuals
        assert got.keys() == snap.keys()
        assert all(torch.equal(got[k], snap[k]) for k in snap)
        # a second restore of the same file compresses bitwise like this one
        twin = commpress.ErrorFeedback(commpress.get(self.name, **self.params))
        twin.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))
        if self.ef.deterministic:
            COUNTS["restore_compare"] += 1
            x = torch.randn(64, generator=torch.Generator().manual_seed(self.step))
            key = next(iter(snap), 0)
            a = self.ef.compress(x, step=self.step, key=key)
            b = twin.compress(x, step=self.step, key=key)
            assert len(a.tensors) == len(b.tensors)
            assert all(torch.equal(u, v) for u, v in zip(a.tensors, b.tensors))
            assert torch.equal(self.ef.residual(key), twin.residual(key))

    @rule()
    def next_step(self):
        self.step += 1

    @invariant()
    def residuals_are_fp32(self):
        for r in getattr(self, "ef", commpress.ErrorFeedback(commpress.get("identity")))._residuals.values():
            assert r.dtype == torch.float32


@pytest.mark.timeout(150)
def test_fuzz_compress_feedback_checkpoint_restore(monkeypatch):
    monkeypatch.setenv("COMMPRESS_BACKEND", "torch")
    run_state_machine_as_test(CompressorMachine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.filter_too_much]))
    print("fuzz figures:", COUNTS)
    assert COUNTS["cases"] >= EXAMPLES
    assert min(COUNTS["conservation"], COUNTS["non_finite"], COUNTS["bad_dtype"], COUNTS["restore_compare"]) > 0
