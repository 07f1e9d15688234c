"""fp8 and mx: torch's float8 rounding, error bounds, OCP MX scales, unbiased stochastic rounding,
non-finite blocks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import commpress

F8 = {"e4m3": (torch.float8_e4m3fn, 3, -6, 448.0), "e5m2": (torch.float8_e5m2, 2, -14, 57344.0)}
MX = {"fp8_e4m3": (3, -6, 448.0, 8, 8), "fp6_e2m3": (3, 0, 7.5, 2, 6), "fp4_e2m1": (1, 0, 6.0, 2, 4)}


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-entry absmax of its block (fp32)."""
    n = x.numel()
    nb = -(-n // block)
    pad = torch.zeros(nb * block)
    pad[:n] = x.float().abs()
    return pad.reshape(nb, block).amax(1).repeat_interleave(block)[:n]


def _grid_step(a: torch.Tensor, m_bits: int, emin: int) -> torch.Tensor:
    """Spacing of the minifloat grid around ``a >= 0`` (float64)."""
    e = torch.floor(torch.log2(a.double().clamp(min=1e-300))).clamp(min=emin)
    return torch.pow(2.0, e - m_bits)


def _data(n, seed, spread=6.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * spread)


@pytest.mark.parametrize("fmt", list(F8))
@pytest.mark.parametrize("block", [1, 5, 128, 10**6])
def test_fp8_nearest_is_torchs_float8_cast(fmt, block):
    """Round to nearest even is exactly torch's own fp32 -> float8 conversion of x / s."""
    dtype, _, _, fmax = F8[fmt]
    x = _data(3001, block)
    x[::50] = 0.0
    x[1::77] = -0.0
    c = commpress.get("fp8", format=fmt, block=block)
    p = c.compress(x)
    assert p.tensors[0].dtype == dtype
    amax = _blocks(x, block)
    fm = torch.tensor(fmax)
    y = x * torch.where(amax > 0, fm / amax, torch.zeros_like(amax))
    assert torch.equal(p.tensors[0].view(torch.uint8), y.clamp(-fmax, fmax).to(dtype).view(torch.uint8))
    assert torch.equal(c.decompress(p), y.clamp(-fmax, fmax).to(dtype).float() * (amax / fm))


@settings(max_examples=40)
@given(n=st.integers(0, 600), block=st.integers(1, 300), seed=st.integers(0, 10**6),
       fmt=st.sampled_from(list(F8)), stochastic=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_fp8_error_bound(n, block, seed, fmt, stochastic, dtype):
    _, m_bits, emin, fmax = F8[fmt]
    x = _data(n, seed, 2.0).to(dtype)
    c = commpress.get("fp8", format=fmt, block=block, stochastic=stochastic)
    y = c.decompress(c.compress(x, generator=torch.Generator().manual_seed(seed))).double()
    xd = x.double()
    s = _blocks(x, block).double() / fmax
    step = _grid_step(xd.abs() / torch.where(s > 0, s, 1), m_bits, emin) * s
    # half a step (nearest) or a whole step (stochastic), fp32 arithmetic, output rounding to dtype
    out_ulp = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
    bound = step * (1.0 if stochastic else 0.5) * (1 + 1e-5) + xd.abs() * (out_ulp + 1e-6) + 1e-30
    assert ((y - xd).abs() <= bound).all()


@settings(max_examples=40)
@given(n=st.integers(0, 400), seed=st.integers(0, 10**6), element=st.sampled_from(list(MX)),
       stochastic=st.booleans())
def test_mx_scales_clipping_and_error_bound(n, seed, element, stochastic):
    """E8M0 byte = floor(log2 max|x|) - emax + 127; entries saturate at max * 2**X; the rest
    are within half a grid step (a whole one with stochastic rounding)."""
    m_bits, emin, emax_val, emax, bits = MX[element]
    x = _data(n, seed, 3.0)
    c = commpress.get("mx", element=element, stochastic=stochastic)
    p = c.compress(x, generator=torch.Generator().manual_seed(seed))
    packed, scales = p.tensors
    assert packed.dtype == scales.dtype == torch.uint8
    assert packed.numel() == math.ceil(n * bits / 8) and scales.numel() == math.ceil(n / 32)
    for b in range(scales.numel()):
        amax = x[32 * b:32 * b + 32].abs().max().item()
        want = 0 if amax == 0 else max(math.frexp(amax)[1] - 1 - emax, -127) + 127
        assert scales[b].item() == want
    y = c.decompress(p).double()
    xd = x.double()
    X = torch.pow(2.0, scales.double() - 127).repeat_interleave(32)[:n]
    target = xd.clamp(-emax_val * X, emax_val * X)
    step = _grid_step(target.abs() / X, m_bits, emin) * X
    bound = step * (1.0 if stochastic else 0.5) * (1 + 1e-6) + 1e-300
    assert ((y - target).abs() <= bound).all()
    assert (y.abs() <= emax_val * X).all()


def test_mx_fp4_values_are_the_ocp_grid():
    x = torch.tensor([0.0, 0.24, 0.26, 0.74, 0.76, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 7.9] + [0.0] * 20)
    c = commpress.get("mx", element="fp4_e2m1")
    p = c.compress(x)
    assert p.tensors[1].item() == 127 + 2 - 2  # floor(log2 7.9) = 2, emax = 2 -> X = 0
    want = [0.0, 0.0, 0.5, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0]  # ties to even, saturating
    assert c.decompress(p)[:12].tolist() == want
    assert c.decompress(c.compress(-x))[:12].tolist() == [-v for v in want]


# Unbiasedness: BASE (L entries, whole blocks) tiled TILES times gives TILES independent
# draws per entry in one call (the noise is a counter-based hash of the element index);
# TRIALS calls with different generator seeds on top.  Bound: 5 sigma of the exact variance.
L, TILES, TRIALS = 64, 200, 4
BASE = torch.randn(L, generator=torch.Generator().manual_seed(7)) * torch.logspace(-2, 1, L)


def _check_unbiased(c, target, step_of):
    x = BASE.repeat(TILES)
    total = torch.zeros(L, dtype=torch.float64)
    for t in range(TRIALS):
        p = c.compress(x, key="u", generator=torch.Generator().manual_seed(100 + t))
        total += c.decompress(p).double().reshape(TILES, L).sum(0)
    draws = TILES * TRIALS
    step = step_of(target)
    r = target.abs() / step
    f = r - torch.floor(r)
    sigma = torch.sqrt(step**2 * f * (1 - f) / draws)
    err = (total / draws - target).abs()
    assert (err <= 5 * sigma + 1e-6 * target.abs().max()).all(), (err / (5 * sigma)).max()
    assert (f > 0).any()  # really stochastic


@pytest.mark.parametrize("fmt", list(F8))
def test_stochastic_fp8_is_unbiased(fmt):
    _, m_bits, emin, fmax = F8[fmt]
    block = 16
    c = commpress.get("fp8", format=fmt, block=block, stochastic=True)
    amax = _blocks(BASE, block)
    fm = torch.tensor(fmax)
    s = (amax / fm).double()
    y = (BASE * (fm / amax)).double()  # what gets rounded, as the compressor computes it
    _check_unbiased(c, y * s, lambda t: _grid_step(t.abs() / s, m_bits, emin) * s)


@pytest.mark.parametrize("element", list(MX))
def test_stochastic_mx_is_unbiased_below_the_clip(element):
    m_bits, emin, emax_val, emax, _ = MX[element]
    c = commpress.get("mx", element=element, stochastic=True)
    amax = _blocks(BASE, 32).double()
    X = torch.pow(2.0, torch.floor(torch.log2(amax)) - emax)
    target = BASE.double().clamp(-emax_val * X, emax_val * X)  # OCP scales clip the top binade
    _check_unbiased(c, target, lambda t: _grid_step(t.abs() / X, m_bits, emin) * X)
    assert c.unbiased is False


@pytest.mark.parametrize("name,params", [("fp8", {"block": 32}), ("fp8", {"format": "e5m2", "block": 32}),
                                         ("mx", {}), ("mx", {"element": "fp4_e2m1", "stochastic": True})])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_entry_poisons_only_its_block(name, params, bad):
    c = commpress.get(name, **params)
    x = torch.randn(100, generator=torch.Generator().manual_seed(3))
    x[40] = bad
    y = c.decompress(c.compress(x, generator=torch.Generator().manual_seed(0)))
    assert torch.isnan(y[32:64]).all()
    assert torch.isfinite(y[:32]).all() and torch.isfinite(y[64:]).all()
    if name == "mx":
        assert c.compress(x).tensors[1][1].item() == 255


@pytest.mark.parametrize("name,params", [("fp8", {}), ("fp8", {"format": "e5m2"}), ("mx", {}),
                                         ("mx", {"element": "fp6_e2m3"}), ("mx", {"element": "fp4_e2m1"})])
def test_zeros_empty_and_tiny(name, params):
    c = commpress.get(name, **params)
    for x in (torch.zeros(77), torch.zeros(0), torch.zeros(3, 0, 2), torch.full((40,), 1e-40)):
        y = c.decompress(c.compress(x))
        assert y.shape == x.shape
        if x.numel() and x.abs().max() == 0:
            assert torch.equal(y, x)
    # subnormal fp32 blocks keep their sign and stay close
    x = torch.full((32,), 3e-39)
    y = c.decompress(c.compress(x))
    assert (y > 0).all()


@pytest.mark.parametrize("fmt", list(F8))
def test_fp8_every_tie_goes_to_even(fmt):
    """Every midpoint between neighbouring float8 values (block max = the format's max, so
    the scale is 1) rounds like torch's cast: to the even code."""
    dtype, _, _, fmax = F8[fmt]
    vals = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    pos = torch.unique(vals[torch.isfinite(vals) & (vals >= 0) & (vals <= fmax)])
    mid = (pos[1:] + pos[:-1]) / 2
    x = torch.cat([torch.tensor([fmax]), mid, -mid])
    c = commpress.get("fp8", format=fmt, block=x.numel())
    p = c.compress(x)
    assert p.tensors[1].item() == 1.0
    assert torch.equal(p.tensors[0].view(torch.uint8), x.to(dtype).view(torch.uint8))


def _allreduce_worker(rank, world):
    torch.set_num_threads(1)
    from commpress.collectives import allreduce

    x = torch.randn(1001, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    out = {}
    for name, params in (("fp8", {}), ("fp8", {"format": "e5m2", "stochastic": True}), ("mx", {}),
                         ("mx", {"element": "fp4_e2m1"})):
        for alg in ("two_phase", "gather_all"):
            y = allreduce(x, commpress.get(name, **params), algorithm=alg, key="w",
                          generator=torch.Generator().manual_seed(10 + rank))
            out[f"{name}{params}{alg}"] = y
    return out, x


@pytest.mark.parametrize("world", [2, 3])
def test_gather_collectives_carry_float8_and_mx(world):
    """The two-phase and gather-all allreduces move float8 / packed MX payloads; every rank
    ends with the same bits, close to the exact sum."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from distributed import run

    res = run(_allreduce_worker, world)
    exact = sum(r[1] for r in res)
    for k, y in res[0][0].items():
        assert all(torch.equal(y, r[0][k]) for r in res), k
        tol = 0.25 if "fp4" in k else 0.15
        assert (y - exact).norm() <= tol * exact.norm(), k
