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


def _mean_and_bound(c, x, trials, variance):
    """Mean decode over ``trials`` seeds and the per-entry 5-sigma bound from ``variance``."""
    total = torch.zeros(x.numel(), dtype=torch.float64)
    for t in range(trials):
        p = c.compress(x, step=t, key="u", generator=torch.Generator().manual_seed(1000 + t))
        total += c.decompress(p).double().reshape(-1)
    mean = total / trials
    bound = 5 * torch.sqrt(variance / trials) + 1e-6 * x.double().abs().max()
    return mean, bound


def _frac_variance(y: torch.Tensor) -> torch.Tensor:
    f = y - torch.floor(y)
    return f * (1 - f)


X = torch.randn(300, generator=torch.Generator().manual_seed(42)) * torch.linspace(0.1, 3, 300)


def test_qsgd_is_unbiased():
    levels = 3
    c = commpress.get("qsgd", levels=levels)
    xd = X.double()
    norm = xd.norm()
    var = (norm / levels) ** 2 * _frac_variance(xd.abs() / norm * levels)
    mean, bound = _mean_and_bound(c, X, 400, var)
    assert ((mean - xd).abs() <= bound).all()
    assert (mean - xd).abs().max() > 0  # really stochastic


def test_terngrad_is_unbiased():
    c = commpress.get("terngrad")
    xd = X.double()
    s = xd.abs().max()
    var = xd.abs() * (s - xd.abs())
    mean, bound = _mean_and_bound(c, X, 400, var)
    assert ((mean - xd).abs() <= bound).all()


@pytest.mark.parametrize("bits", [2, 4])
def test_stochastic_blockquant_is_unbiased(bits):
    block = 32
    c = commpress.get("blockquant", bits=bits, block=block, stochastic=True)
    xd = X.double()
    qmax = 2 ** (bits - 1) - 1
    padded = torch.zeros(-(-300 // block) * block, dtype=torch.float64)
    padded[:300] = xd.abs()
    scale = padded.reshape(-1, block).amax(1).repeat_interleave(block)[:300]
    var = (scale / qmax) ** 2 * _frac_variance(xd.abs() / scale * qmax)
    mean, bound = _mean_and_bound(c, X, 400, var)
    assert ((mean - xd).abs() <= bound).all()


def test_randomk_is_unbiased():
    ratio = 0.25
    c = commpress.get("randomk", ratio=ratio, seed=5)
    xd = X.double()
    k = round(ratio * 300)
    var = xd**2 * (300 / k - 1)
    mean, bound = _mean_and_bound(c, X, 250, var)
    assert ((mean - xd).abs() <= bound).all()


@pytest.mark.parametrize("levels", [1, 2, 7, 127])
def test_qsgd_bits_and_levels(levels):
    c = commpress.get("qsgd", levels=levels)
    assert c.bits == math.ceil(math.log2(2 * levels + 1))
    x = torch.randn(1000, generator=torch.Generator().manual_seed(levels))
    y = c.decompress(c.compress(x))
    norm = x.double().norm()
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
