"""Shared helpers for the ops parity tests: bitwise comparison and input strategies."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from commpress.ops import reference

SPECIALS = [0.0, -0.0, 1.0, -1.0, 0.5, -2.0, float("inf"), float("-inf"), float("nan"), 1e-45, 3.4e38]


def assert_bitwise(a, b, what: str = "result") -> None:
    """``a`` and ``b`` (tensors or tuples of tensors) are equal bit for bit.

    Floats compare by bit pattern (so -0.0 != 0.0); any NaN equals any NaN
    (NaN payloads may legitimately differ between operand orders on x86).
    """
    if isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b), f"{what}: {type(a)} vs {type(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{what}[{i}]")
        return
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), what
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} vs {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.is_floating_point():
        nan = torch.isnan(a) & torch.isnan(b)
        wide = {torch.float64: torch.int64, torch.float32: torch.int32}.get(a.dtype, torch.int16)
        same = a.contiguous().view(wide) == b.contiguous().view(wide)
        bad = ~(same | nan)
        assert not bool(bad.any()), (
            f"{what}: {int(bad.sum())} of {a.numel()} differ, first at "
            f"{int(bad.nonzero()[0])}: {a[bad][:5].tolist()} vs {b[bad][:5].tolist()}")
    else:
        assert torch.equal(a, b), f"{what}: {a[:20].tolist()} vs {b[:20].tolist()}"


def f32_arrays(min_size: int = 0, max_size: int = 300):
    """fp32 numpy arrays mixing arbitrary floats with specials (ties, NaN, inf, -0.0)."""
    elems = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True),
                      st.sampled_from(SPECIALS),
                      st.integers(-3, 3).map(float))
    return hnp.arrays(np.float32, st.integers(min_size, max_size), elements=elems)


def tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a, copy=True))


def messy_large(n: int, seed: int = 0) -> torch.Tensor:
    """A large fp32 tensor with ties, NaN, inf and -0.0 scattered in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    x[:: 997] = torch.round(x[:: 997] * 4) / 4  # ties
    x[5::100003] = float("nan")
    x[7::200003] = float("-inf")
    x[11::50021] = -0.0
    return x


def _residual_cases(x: torch.Tensor):
    """(name, residual for reference, residual for numba) for each residual mode."""
    yield "none", None, None
    yield "separate", torch.full_like(x, 7.0), torch.full_like(x, 7.0)
    yield "inplace", "x", "x"


def run_selection(backend, op, x, arg, dtype=torch.float32):
    """``backend.op`` equals the reference on ``x`` for each residual mode (none, separate, in place)."""
    for name, r_ref, r_nb in _residual_cases(x):
        xr, xn = x.to(dtype).clone(), x.to(dtype).clone()
        rr = xr if r_ref == "x" else (None if r_ref is None else r_ref.to(dtype))
        rn = xn if r_nb == "x" else (None if r_nb is None else r_nb.to(dtype))
        want = getattr(reference, op)(xr, arg, rr)
        got = getattr(backend, op)(xn, arg, rn)
        assert_bitwise(got, want, f"{op}/{name}")
        if rr is not None:
            assert_bitwise(rn, rr, f"{op}/{name} residual")
            assert_bitwise(xn, xr, f"{op}/{name} input")


def norm_extremes(seed: int = 0) -> torch.Tensor:
    """700 finite fp32 entries whose buckets' sums of squares overflow (up to ~1.6e38 per entry),
    underflow (down to subnormals), are zero, or mix both: QSGD's norm rescue and the level
    multiplier's pre-scale (reference.bucket_norms, reference.level_multiplier)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(700, generator=g).clamp(-1.9, 1.9)
    x = r.clone()
    x[:100] *= 2.0 ** 100
    x[100:200] *= 2.0 ** 126
    x[200:300] *= 2.0 ** -100
    x[300:400] *= 2.0 ** -140
    x[400:450] = 0.0
    x[450:] *= torch.pow(2.0, torch.randint(-149, 127, (250,), generator=g).float())
    x[460] = 3.4e38
    return x
