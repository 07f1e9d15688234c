"""Parity of the lean residual stores' encoders (commpress.ops.lean): numba against the torch reference."""

from __future__ import annotations

import pytest
import torch

from commpress import ops
from commpress.storage import INT4_BLOCK, INT8_BLOCK

pytestmark = pytest.mark.skipif("numba" not in ops.available_backends(), reason="numba not installed")


def _inputs():
    g = torch.Generator().manual_seed(3)
    yield "randn", torch.randn(1000, generator=g) * 3
    yield "one", torch.tensor([0.3])
    yield "tail", torch.randn(INT8_BLOCK + 5, generator=g)
    yield "zeros", torch.zeros(2 * INT8_BLOCK)
    yield "subnormal", torch.full((300,), 1e-40) * torch.randn(300, generator=g).sign()
    yield "huge", torch.randn(300, generator=g) * 3e38
    x = torch.randn(400, generator=g)
    x[5], x[200], x[301] = float("nan"), float("inf"), -float("inf")
    yield "nonfinite", x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8) if t.element_size() == 1 \
        else t.view(torch.int16)


@pytest.mark.parametrize("name,x", list(_inputs()))
def test_int8_block_encode_numba_is_bitwise_the_reference(name, x):
    n = x.numel()
    blocks = -(-n // INT8_BLOCK)
    noise = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    out = []
    for backend in ("torch", "numba"):
        codes = torch.full((blocks * INT8_BLOCK,), 99, dtype=torch.int8)
        scales = torch.empty(blocks)
        ops.int8_block_encode(x, noise, codes, scales, INT8_BLOCK, backend=backend)
        out.append((codes, scales))
    (c0, s0), (c1, s1) = out
    assert torch.equal(c0, c1) and torch.equal(_bits(s0), _bits(s1))
    if name == "randn":   # within a code of the value
        y = (c0.float().view(blocks, INT8_BLOCK) * s0[:, None]).view(-1)[:n]
        assert bool(((y - x).abs() <= s0.repeat_interleave(INT8_BLOCK)[:n] * 1.0001).all())


@pytest.mark.parametrize("name,x", list(_inputs()))
def test_bf16_stochastic_encode_numba_is_bitwise_the_reference(name, x):
    noise = torch.randint(-2 ** 15, 2 ** 15, (x.numel(),), dtype=torch.int16, generator=torch.Generator().manual_seed(2))
    out = []
    for backend in ("torch", "numba"):
        codes = torch.empty(x.numel(), dtype=torch.bfloat16)
        ops.bf16_stochastic_encode(x, noise, codes, backend=backend)
        out.append(codes)
    assert torch.equal(_bits(out[0]), _bits(out[1]))


PRE = [1.0, 0.5, 1 / 3]   # the hooks' 1/P folded into the add (rounded on its own, as a mul_ before it)


@pytest.mark.parametrize("pre", PRE)
@pytest.mark.parametrize("n", [1, INT8_BLOCK - 1, INT8_BLOCK, 3 * INT8_BLOCK + 7, (1 << 20) + 300])
def test_int8_block_add_numba_is_bitwise_the_reference(n, pre):
    g = torch.Generator().manual_seed(n)
    blocks = -(-n // INT8_BLOCK)
    codes = torch.randint(-127, 128, (blocks * INT8_BLOCK,), dtype=torch.int8, generator=g)
    scales = torch.rand(blocks, generator=g) * 0.01
    dst = torch.randn(n, generator=g)
    dst[0] = -0.0
    want = dst * pre + (codes.float().view(blocks, INT8_BLOCK) * scales[:, None]).view(-1)[:n]
    out = [ops.int8_block_add(dst.clone(), codes, scales, INT8_BLOCK, pre, backend=b) for b in ("torch", "numba")]
    assert torch.equal(_bits(out[0]), _bits(out[1])) and torch.equal(_bits(out[0]), _bits(want))


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """The int4 store's codes + 8 in element order: byte j of a block holds elements j and j + 32."""
    half = codes.view(-1, INT4_BLOCK // 2)
    return torch.stack((half & 15, half >> 4), 1).reshape(-1)


@pytest.mark.parametrize("name,x", list(_inputs()) + [("odd", torch.randn(3 * INT4_BLOCK + 7)),
                                                      ("short-tail", torch.randn(INT4_BLOCK + 40)),
                                                      ("subnormal-block", torch.full((INT4_BLOCK,), 3e-39))])
def test_int4_block_encode_numba_is_bitwise_the_reference(name, x):
    n = x.numel()
    blocks = -(-n // INT4_BLOCK)
    noise = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    out = []
    for backend in ("torch", "numba"):
        codes = torch.full((blocks * INT4_BLOCK // 2,), 99, dtype=torch.uint8)
        scales = torch.empty(blocks)
        ops.int4_block_encode(x, noise, codes, scales, INT4_BLOCK, backend=backend)
        out.append((codes, scales))
    (c0, s0), (c1, s1) = out
    assert torch.equal(c0, c1) and torch.equal(_bits(s0), _bits(s1))
    nib = _nibbles(c0)
    assert bool((nib >= 1).all()) and bool((nib[n:] == 8).all())   # codes in [-7, 7], padding zero
    y = ((nib.float() - 8).view(blocks, INT4_BLOCK) * s0[:, None]).view(-1)[:n]
    bad = ~torch.isfinite(s0).repeat_interleave(INT4_BLOCK)[:n]
    if name in ("randn", "odd"):   # within a code of the value
        assert bool(((y - x).abs() <= s0.repeat_interleave(INT4_BLOCK)[:n] * 1.0001).all())
    if name == "nonfinite":   # a block with a NaN/inf stores zero codes (the commit keeps the old value)
        assert bool(bad.any()) and bool((nib[:n][bad] == 8).all())
    if name == "subnormal-block":   # below fp32's smallest normal scale: zero
        assert bool((y == 0).all())


@pytest.mark.parametrize("n", [1, 2, INT4_BLOCK // 2 + 3, INT4_BLOCK - 1, INT4_BLOCK, 3 * INT4_BLOCK + 7,
                               (1 << 20) + 301])
@pytest.mark.parametrize("pre", PRE)
def test_int4_block_add_numba_is_bitwise_the_reference(n, pre):
    g = torch.Generator().manual_seed(n)
    blocks = -(-n // INT4_BLOCK)
    codes = torch.randint(0, 256, (blocks * INT4_BLOCK // 2,), dtype=torch.uint8, generator=g)
    scales = torch.rand(blocks, generator=g) * 0.01
    dst = torch.randn(n, generator=g)
    nib = _nibbles(codes)
    want = dst * pre + ((nib.float() - 8).view(blocks, INT4_BLOCK) * scales[:, None]).view(-1)[:n]
    out = [ops.int4_block_add(dst.clone(), codes, scales, INT4_BLOCK, pre, backend=b) for b in ("torch", "numba")]
    assert torch.equal(_bits(out[0]), _bits(out[1])) and torch.equal(_bits(out[0]), _bits(want))


@pytest.mark.parametrize("seed,n", [(0, 1), (7, 5), (2 ** 40 + 3, 4096), (2 ** 63 - 1, (1 << 20) * 4 + 13)])
def test_noise_bytes_numba_is_bitwise_the_reference(seed, n):
    a = ops.noise_bytes(seed, n, device="cpu", backend="torch")
    b = ops.noise_bytes(seed, n, device="cpu", backend="numba")
    assert a.dtype == b.dtype == torch.uint8 and a.numel() == b.numel() == n and torch.equal(a, b)


def test_noise_bytes_are_uniform_and_depend_on_the_seed():
    a = ops.noise_bytes(3, 1 << 16, device="cpu").long()
    counts = torch.bincount(a, minlength=256).double()
    expected = a.numel() / 256
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 400   # 255 degrees of freedom: p < 1e-6 above this
    assert not torch.equal(ops.noise_bytes(4, 1 << 16, device="cpu").long(), a)


@pytest.mark.parametrize("storage", ["int8", "int4"])
@pytest.mark.parametrize("lo,hi", [(0, 1), (0, 100), (128, 700), (0, (1 << 20) + 77), (256, 256)])
def test_block_decode_numba_is_bitwise_the_reference(storage, lo, hi):
    block = INT8_BLOCK if storage == "int8" else INT4_BLOCK
    n = max(hi, 1)
    blocks = -(-n // block)
    g = torch.Generator().manual_seed(hi)
    if storage == "int8":
        codes = torch.randint(-127, 128, (blocks * block,), dtype=torch.int8, generator=g)
    else:
        codes = torch.randint(0, 256, (blocks * block // 2,), dtype=torch.uint8, generator=g)
    scales = torch.rand(blocks, generator=g)
    op = ops.int8_block_decode if storage == "int8" else ops.int4_block_decode
    out = [op(codes, scales, lo, hi, torch.full((hi - lo,), 7.0), block, backend=b) for b in ("torch", "numba")]
    assert torch.equal(_bits(out[0]), _bits(out[1]))
    if storage == "int4" and hi > lo:   # against the layout written out by hand
        want = ((_nibbles(codes).float() - 8).view(blocks, block) * scales[:, None]).view(-1)[lo:hi]
        assert torch.equal(_bits(out[0]), _bits(want))


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_a_short_store_is_refused_not_written_past(backend):
    """The kernels index without bounds checks: a ``codes`` buffer sized for the elements instead of
    the blocks (the tail's padding) raises ``ValueError`` naming the op, on both backends."""
    n = 3 * INT8_BLOCK + 7
    x, noise = torch.randn(n), torch.zeros(n, dtype=torch.uint8)
    blocks = -(-n // INT8_BLOCK)
    with pytest.raises(ValueError, match="int8_block_encode: codes must hold"):
        ops.int8_block_encode(x, noise, torch.empty(n, dtype=torch.int8), torch.empty(blocks), INT8_BLOCK,
                              backend=backend)
    with pytest.raises(ValueError, match="int8_block_encode: noise"):
        ops.int8_block_encode(x, noise[:5], torch.empty(blocks * INT8_BLOCK, dtype=torch.int8), torch.empty(blocks),
                              INT8_BLOCK, backend=backend)
    with pytest.raises(ValueError, match="int4_block_add: .*need"):
        ops.int4_block_add(torch.randn(n), torch.empty(INT4_BLOCK, dtype=torch.uint8), torch.empty(2),
                           INT4_BLOCK, backend=backend)
    with pytest.raises(ValueError, match="int8_block_decode: span"):
        ops.int8_block_decode(torch.empty(blocks * INT8_BLOCK, dtype=torch.int8), torch.empty(blocks), 0,
                              blocks * INT8_BLOCK + 1, torch.empty(blocks * INT8_BLOCK + 1), INT8_BLOCK,
                              backend=backend)
