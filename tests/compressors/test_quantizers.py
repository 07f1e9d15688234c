"""qsgd, terngrad, signsgd, blockquant (and randomk): error bounds and unbiasedness."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import commpress


@settings(max_examples=30)
@given(n=st.integers(0, 700), bits=st.sampled_from([2, 4, 8]), block=st.integers(1, 300),
       seed=st.integers(0, 1000), dtype=st.sampled_from([torch.float32, torch.float16,
                                                         torch.bfloat16]))
def test_blockquant_nearest_error_is_at_most_half_a_step(n, bits, block, seed, dtype):
    x = (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    c = commpress.get("blockquant", bits=bits, block=block)
    y = c.decompress(c.compress(x))
    xf = x.double()
    nblocks = -(-n // block)
    absmax = torch.zeros(nblocks * block, dtype=torch.float64)
    absmax[:n] = xf.abs()
    step = (absmax.reshape(nblocks, block).amax(1) / (2 ** (bits - 1) - 1)).repeat_interleave(block)[:n]
    # half a step, plus fp32 arithmetic and the rounding of the output to dtype
    out_ulp = xf.abs() * {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    assert ((y.double() - xf).abs() <= step / 2 * (1 + 1e-5) + out_ulp + 1e-30).all()


@settings(max_examples=30)
@given(n=st.integers(0, 500), chunk=st.integers(1, 100), seed=st.integers(0, 1000))
def test_signsgd_decodes_to_sign_times_chunk_mean(n, chunk, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    x[::7] = 0.0
    c = commpress.get("signsgd", chunk=chunk)
    y = c.decompress(c.compress(x))
    for start in range(0, n, chunk):
        part = x[start:start + chunk]
        mean = part.double().abs().mean()
        sign = torch.where(part < 0, -1.0, 1.0).double()
        torch.testing.assert_close(y[start:start + chunk].double(), sign * mean,
                                   rtol=1e-5, atol=1e-7)


# Unbiasedness: X (one bucket/block of L entries) is tiled TILES times, so a single
# compress call gives TILES independent draws per entry (the noise is a counter-based
# hash of the element index); TRIALS calls with different generator seeds on top.
L, TILES, TRIALS = 60, 200, 4
BASE = torch.randn(L, generator=torch.Generator().manual_seed(42)) * torch.linspace(0.1, 3, L)
X = BASE.repeat(TILES)


def _check_unbiased(c, variance):
    """Mean decode per entry of BASE within 5 sigma of the entry (sigma from ``variance``)."""
    total = torch.zeros(L, dtype=torch.float64)
    for t in range(TRIALS):
        p = c.compress(X, step=t, key="u", generator=torch.Generator().manual_seed(1000 + t))
        total += c.decompress(p).double().reshape(TILES, L).sum(0)
    draws = TILES * TRIALS
    mean = total / draws
    var = variance.reshape(TILES, L).mean(0)
    bound = 5 * torch.sqrt(var / draws) + 1e-6 * BASE.double().abs().max()
    err = (mean - BASE.double()).abs()
    assert (err <= bound).all(), (err / bound).max()
    assert err.max() > 0  # really stochastic


def _frac_variance(y: torch.Tensor) -> torch.Tensor:
    f = y - torch.floor(y)
    return f * (1 - f)


@pytest.mark.parametrize("bucket", [L, 10**9])
def test_qsgd_is_unbiased(bucket):
    levels = 3
    c = commpress.get("qsgd", levels=levels, bucket=bucket)
    xd = X.double()
    norm = xd.reshape(-1, min(bucket, xd.numel())).norm(dim=1)
    norm = norm.repeat_interleave(min(bucket, xd.numel()))
    _check_unbiased(c, (norm / levels) ** 2 * _frac_variance(xd.abs() / norm * levels))


def test_terngrad_is_unbiased():
    xd = X.double()
    s = xd.abs().max()
    _check_unbiased(commpress.get("terngrad"), xd.abs() * (s - xd.abs()))


@pytest.mark.parametrize("bits", [2, 4])
def test_stochastic_blockquant_is_unbiased(bits):
    c = commpress.get("blockquant", bits=bits, block=L, stochastic=True)
    xd = X.double()
    qmax = 2 ** (bits - 1) - 1
    scale = xd.reshape(-1, L).abs().amax(1).repeat_interleave(L)
    _check_unbiased(c, (scale / qmax) ** 2 * _frac_variance(xd.abs() / scale * qmax))


def test_randomk_is_unbiased():
    # within one call the k-subset is drawn without replacement: the copies of an entry
    # are negatively correlated, so the binomial variance used here is an upper bound
    ratio = 0.25
    c = commpress.get("randomk", ratio=ratio, seed=5)
    xd = X.double()
    n = xd.numel()
    k = round(ratio * n)
    _check_unbiased(c, xd**2 * (n / k - 1))


@pytest.mark.parametrize("levels", [1, 2, 7, 127])
def test_qsgd_bits_and_levels(levels):
    c = commpress.get("qsgd", levels=levels, bucket=100)
    assert c.bits == math.ceil(math.log2(2 * levels + 1))
    x = torch.randn(1000, generator=torch.Generator().manual_seed(levels))
    y = c.decompress(c.compress(x))
    norm = x.double().reshape(10, 100).norm(dim=1).repeat_interleave(100)
    # every decoded value is a multiple of norm/levels, no larger than the norm
    q = y.double() / (norm / levels)
    torch.testing.assert_close(q, torch.round(q), atol=1e-3, rtol=0)
    assert (q.abs() <= levels + 1e-3).all()
    assert ((y == 0) | (torch.sign(y) == torch.sign(x))).all()


def test_quantizers_handle_all_zero_input():
    x = torch.zeros(100)
    for name in ("qsgd", "terngrad", "signsgd", "blockquant"):
        c = commpress.get(name)
        assert torch.equal(c.decompress(c.compress(x)), x), name


@pytest.mark.parametrize("name,scale", [("qsgd", 2.0**100), ("qsgd", 1.5e38), ("qsgd", 2.0**-100),
                                        ("qsgd", 2.0**-140), ("terngrad", 1.5e38), ("terngrad", 2.0**-140)])
def test_level_quantizers_on_huge_and_tiny_finite_input(name, scale):
    """A finite input whose squares overflow fp32 (|x| > ~1.8e19) or underflow still gives a finite
    payload that decodes unbiased within 5 sigma, every value a multiple of ``s/levels`` no larger
    than the payload's scale ``s >= max|x|`` of its bucket (an L2 norm that would exceed the fp32
    range saturates at its maximum)."""
    levels = 3 if name == "qsgd" else 1
    c = commpress.get(name, levels=levels, bucket=L) if name == "qsgd" else commpress.get(name)
    x = (X.double() * (scale / BASE.abs().max().item())).float()  # max|x| = scale (rounded to fp32)
    assert torch.isfinite(x).all()
    total = torch.zeros(L, dtype=torch.float64)
    for t in range(TRIALS):
        p = c.compress(x, step=t, key="u", generator=torch.Generator().manual_seed(1000 + t))
        s = p.tensors[1].double()
        assert torch.isfinite(s).all(), s
        y = c.decompress(p)
        assert torch.isfinite(y).all()
        total += y.double().reshape(TILES, L).sum(0)
    s = s.repeat_interleave(L) if name == "qsgd" else s.expand(x.numel())
    assert (s >= x.double().abs()).all()
    if name == "qsgd" and scale < 1e30:  # an unsaturated norm is the L2 norm (rounded to fp32)
        torch.testing.assert_close(s, x.double().reshape(-1, L).norm(dim=1).repeat_interleave(L),
                                   rtol=1e-6, atol=2.0**-149)
    xd = x.double()
    if scale < 2.0**-126:  # subnormal steps s/levels are rounded to subnormals: looser
        return
    q = y.double() / (s / levels)
    torch.testing.assert_close(q, torch.round(q), atol=1e-3, rtol=0)
    assert (q.abs() <= levels + 1e-3).all()
    mean = total / (TILES * TRIALS)
    var = ((s / levels) ** 2 * _frac_variance(xd.abs() / s * levels)).reshape(TILES, L).mean(0)
    err = (mean - xd[:L]).abs()
    assert (err <= 5 * torch.sqrt(var / (TILES * TRIALS)) + 1e-6 * xd.abs().max()).all()
