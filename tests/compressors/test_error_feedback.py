"""ErrorFeedback: mass conservation, fast path = generic path, non-finite input, state."""

from __future__ import annotations

import io

import pytest
import torch
from compressor_cases import CASES, DTYPES, IDS, build, make, same

import commpress
from commpress.compressors._sparse import SparseCompressor


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mass_is_conserved(case, dtype):
    ef = commpress.ErrorFeedback(make(*case))
    key = ("bucket", 0)
    for step in range(3):
        x = build((24, 18), dtype, "transposed" if step == 1 else "contiguous", step)
        before = ef.residual(key)
        before = torch.zeros(x.shape) if before is None else before.clone()
        payload = ef.compress(x, step=step, key=key, generator=torch.Generator().manual_seed(step))
        out = ef.decompress(payload)
        assert out.shape == x.shape and out.dtype == x.dtype
        after = ef.residual(key)
        assert after.dtype == torch.float32 and after.shape == x.shape
        lhs = out.float() + after
        rhs = x.float() + before
        if isinstance(ef.compressor, SparseCompressor):
            assert torch.equal(lhs, rhs)
        else:
            torch.testing.assert_close(lhs, rhs, rtol=1e-6, atol=1e-6 * rhs.abs().max().item())


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("topk", "threshold", "dgc")])
def test_sparse_fast_path_equals_generic_path(case):
    fast = commpress.ErrorFeedback(make(*case))
    for step in range(4):
        x = build((50, 40), torch.float32, "contiguous", step)
        before = fast.residual("k")
        c = x if before is None else x + before
        expected_payload = make(*case).compress(c, step=step, key="k")
        expected_residual = c - make(*case).decompress(expected_payload)
        p = fast.compress(x, step=step, key="k")
        assert all(torch.equal(a, b) for a, b in zip(p.tensors, expected_payload.tensors))
        assert torch.equal(fast.residual("k"), expected_residual)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_non_finite_input_reaches_the_payload_and_leaves_the_residual(case):
    ef = commpress.ErrorFeedback(make(*case))
    x = build((30, 20), torch.float32, "contiguous", 0)
    ef.compress(x, key=1, generator=torch.Generator().manual_seed(0))
    before = ef.residual(1).clone()
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[2, 3] = bad
        out = ef.decompress(ef.compress(y, key=1, generator=torch.Generator().manual_seed(1)))
        assert not torch.isfinite(out).all()
        assert torch.equal(ef.residual(1), before)


def test_residual_buffer_is_allocated_once_and_beta_scales_it():
    ef = commpress.ErrorFeedback(commpress.get("topk", ratio=0.1), beta=0.5)
    ef.compress(torch.randn(100), key="a")
    buf = ef.residual("a")
    r0 = buf.clone()
    x = torch.randn(100)
    torch.testing.assert_close(ef.compensate(x, "a"), x + 0.5 * r0, rtol=0, atol=0)
    ptrs = {buf.data_ptr(), ef._pending["a"].data_ptr()}  # live and pending: swapped on commit (CPU)
    for _ in range(3):
        ef.compress(torch.randn(100), key="a")
        assert {ef.residual("a").data_ptr(), ef._pending["a"].data_ptr()} == ptrs
    assert ef.compensate(torch.randn(100, dtype=torch.float16), "a").dtype == torch.float32
    assert ef.residual("other") is None


def test_update_skips_non_finite():
    ef = commpress.ErrorFeedback(commpress.get("identity"))
    c = torch.ones(5)
    ef.update(0, c, torch.zeros(5))
    ef.update(0, c * float("inf"), torch.zeros(5))
    ef.update(0, c, torch.full((5,), float("nan")))
    assert torch.equal(ef.residual(0), torch.ones(5))


def test_wraps_attributes_and_rejects_bad_arguments():
    ef = commpress.ErrorFeedback(commpress.get("qsgd"))
    assert ef.aggregation == "gather" and ef.unbiased is False
    assert isinstance(ef, commpress.Compressor)
    with pytest.raises(ValueError, match="beta"):
        commpress.ErrorFeedback(commpress.get("qsgd"), beta=1.5)
    with pytest.raises(TypeError, match="compressor"):
        commpress.ErrorFeedback("topk")
    with pytest.raises(TypeError, match="float64"):
        ef.compress(torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("name,params", [("topk", {"ratio": 0.2}), ("powersgd", {"rank": 1}),
                                         ("signsgd", {})])
def test_state_dict_round_trip_is_bitwise(name, params):
    ef = commpress.ErrorFeedback(commpress.get(name, **params))
    keys = [0, "layer", ("bucket", 3), (2, ("x", 1.5))]
    for step in range(2):
        for i, k in enumerate(keys):
            ef.compress(torch.randn(12 + i, 10), step=step, key=k)
    buf = io.BytesIO()
    torch.save(ef.state_dict(), buf)
    buf.seek(0)
    restored = commpress.ErrorFeedback(commpress.get(name, **params))
    restored.load_state_dict(torch.load(buf, weights_only=True))
    for k in keys:
        assert torch.equal(restored.residual(k), ef.residual(k))
    # a restart loses nothing: both continue identically
    for k in keys:
        x = torch.randn(12 + keys.index(k), 10)
        a, b = ef.compress(x, key=k), restored.compress(x, key=k)
        assert all(same(s, t) for s, t in zip(a.tensors, b.tensors))
        assert torch.equal(restored.residual(k), ef.residual(k))
    ef.reset()
    assert ef.residual(0) is None


def test_unsaveable_key_is_a_type_error():
    ef = commpress.ErrorFeedback(commpress.get("topk", ratio=0.5))
    ef.compress(torch.randn(4), key=object())
    with pytest.raises(TypeError, match="weights_only"):
        ef.state_dict()


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_send_whole_is_the_compensation_and_empties_the_residual(momentum, scale):
    """send_whole writes what compensate returns (the input's scale included) and leaves a
    zero residual; with masking, a zero velocity."""
    import commpress

    def fresh():
        ef = commpress.ErrorFeedback(commpress.get("topk", ratio=0.1, density_warmup=0), momentum=momentum)
        ef.compress(torch.randn(1000, generator=torch.Generator().manual_seed(1)), key="k")  # a residual
        return ef

    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    a, b = fresh(), fresh()
    want = a.compensate(x, "k", scale=scale).clone()
    out = torch.empty(1000)
    bad = b.send_whole(x, "k", out, scale=scale)
    assert not bool(bad) and torch.equal(out, want)
    assert torch.count_nonzero(b.residual("k")) == 0
    if momentum:
        assert torch.count_nonzero(b.velocity("k")) == 0      # masking: every coordinate was sent


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
def test_send_whole_narrower_keeps_the_rounding_error(momentum, wire):
    """Into a bf16/fp16 message: the message is the compensation rounded, the residual is
    exactly what the rounding dropped (message + residual == compensation, bitwise)."""
    import commpress

    def fresh():
        ef = commpress.ErrorFeedback(commpress.get("topk", ratio=0.1, density_warmup=0), momentum=momentum)
        ef.compress(torch.randn(1000, generator=torch.Generator().manual_seed(1)), key="k")
        return ef

    x = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    a, b = fresh(), fresh()
    want = a.compensate(x, "k").clone()
    out = torch.empty(1000, dtype=wire)
    bad = b.send_whole(x, "k", out)
    assert not bool(bad) and torch.equal(out, want.to(wire))
    r = b.residual("k")
    assert torch.count_nonzero(r) > 0
    assert torch.equal(out.float() + r, want)
    with pytest.raises(TypeError, match="out must be"):
        b.send_whole(x, "k", torch.empty(1000, dtype=torch.int32))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_whole_sends_every_coordinate_in_the_codec_and_keeps_its_error(momentum, dtype):
    """compress_whole: the codec's payload of the whole compensation (momentum correction
    included); the residual is the compensation less the decoded payload; with masking the
    velocity is zero (every coordinate was sent), without it kept."""
    import commpress

    def fresh(masking=True):
        ef = commpress.ErrorFeedback(commpress.get("topk", ratio=0.1, density_warmup=0), momentum=momentum,
                                     masking=masking)
        ef.compress(torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(dtype), key="k")
        return ef

    codec = commpress.get("blockquant", bits=4)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(2)).to(dtype)
    a, b, c = fresh(), fresh(), fresh(masking=False)
    want = a.compensate(x, "k").clone()
    p = b.compress_whole(x, codec, key="k")
    c.compress_whole(x, codec, key="k")
    # encoded from the input's dtype (with momentum correction from the fp32 velocity), as compress does
    sent = codec.compress_fixed(want if momentum else want.to(dtype))
    assert all(torch.equal(u, v) for u, v in zip(p.tensors, sent.tensors)) and not bool(p.nonfinite)
    assert torch.equal(b.residual("k"), want - codec.decompress(sent).float())
    if momentum:
        assert torch.count_nonzero(b.velocity("k")) == 0 and torch.count_nonzero(c.velocity("k")) > 0
    for bad in (commpress.get("topk", ratio=0.5), commpress.get("blockquant", bits=4, stochastic=True)):
        with pytest.raises(TypeError, match="deterministic gather"):
            b.compress_whole(x, bad, key="k")


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_blockquant_fused_feedback_is_the_separate_passes(monkeypatch, momentum, scale):
    """blockquant's one-pass error feedback (compensate, quantize, residual) gives bitwise the
    payload and residual of compensating, quantizing and decoding in turn; a NaN keeps the
    residual as it was on both paths."""
    import commpress
    from commpress.compressors.blockquant import BlockQuant

    def run(fused):
        if not fused:
            monkeypatch.setattr(BlockQuant, "fuses_feedback", lambda self, t, fixed=True: False)
        ef = commpress.ErrorFeedback(commpress.get("blockquant", bits=4, block=64), momentum=momentum)
        seen = []
        for step in range(4):
            x = torch.randn(1000, generator=torch.Generator().manual_seed(step))
            if step == 2:
                x[5] = float("nan")
            p = ef.compress_fixed(x, key="k", step=step, scale=scale)
            seen.append((p.tensors, bool(p.nonfinite), ef.residual("k").clone()))
        monkeypatch.undo()
        return seen

    def bits(t):  # NaN scales compare by their bits
        return t.view(torch.int32) if t.dtype == torch.float32 else t

    for (ta, ba, ra), (tb, bb, rb) in zip(run(True), run(False)):
        assert all(torch.equal(bits(u), bits(v)) for u, v in zip(ta, tb)) and ba == bb
        assert torch.equal(ra, rb)
