"""The CUDA backend (CuPy kernels) matches the torch reference bit for bit (needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from commpress.ops import reference as R

from opcheck import assert_bitwise, messy_large  # noqa: E402

pytestmark = pytest.mark.gpu

SIZES = [0, 1, 7, 1000, 65537, 1_000_003]


@pytest.fixture(scope="module")
def cb():
    from commpress.ops import cuda_backend

    if not cuda_backend.available():
        pytest.skip("cuda backend not available")
    return cuda_backend


def _x(n: int) -> torch.Tensor:
    if n < 20:
        return torch.tensor([float("nan"), -0.0, 1.0, -1.0, float("inf"), 0.5, -2.0] * 3)[:n]
    return messy_large(n, seed=n)


def _cuda(t):
    if isinstance(t, (tuple, list)):
        return type(t)(_cuda(v) for v in t)
    return t.cuda() if isinstance(t, torch.Tensor) else t


def _cpu(t):
    if isinstance(t, (tuple, list)):
        return type(t)(_cpu(v) for v in t)
    return t.cpu() if isinstance(t, torch.Tensor) else t


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op,arg", [("threshold_compact", 1.5), ("topk_compact", 0.01), ("topk_compact", 0.3)])
@pytest.mark.parametrize("res", ["none", "separate", "inplace"])
def test_selection(cb, n, op, arg, res):
    x = _x(n)
    if op == "topk_compact":
        arg = max(1, int(arg * n))
    xr, xg = x.clone(), x.cuda()
    rr = rg = None
    if res == "separate":
        rr, rg = torch.zeros_like(x), torch.zeros_like(xg)
    elif res == "inplace":
        rr, rg = xr, xg
    want = getattr(R, op)(xr, arg, rr)
    got = getattr(cb, op)(xg, arg, rg)
    assert_bitwise(_cpu(got), want, op)
    if rr is not None:
        assert_bitwise(rg.cpu(), rr, f"{op} residual")


@pytest.mark.parametrize("n", SIZES)
def test_quantize_dequantize(cb, n):
    x = _x(n)
    for bits, block, sto in ((8, 256, False), (4, 64, True), (3, 7, True), (1, 5, False)):
        want = R.block_quantize(x, bits, block, sto, 77)
        got = cb.block_quantize(x.cuda(), bits, block, sto, 77)
        assert_bitwise(_cpu(got), want, f"quantize {bits}")
        base = torch.randn(n)
        for acc in (False, True):
            o_ref, o_gpu = base.clone(), base.cuda()
            R.block_dequantize(*want, bits, block, n, o_ref, acc)
            cb.block_dequantize(*_cuda(want), bits, block, n, o_gpu, acc)
            assert_bitwise(o_gpu.cpu(), o_ref, f"dequantize {bits} acc={acc}")


@pytest.mark.parametrize("n", SIZES)
def test_sign(cb, n):
    x = _x(n)
    for chunk in (1, 37, 1024, max(n, 1)):
        want = R.sign_pack(x, chunk)
        assert_bitwise(_cpu(cb.sign_pack(x.cuda(), chunk)), want, f"sign_pack {chunk}")
        base = torch.randn(n)
        o_ref, o_gpu = base.clone(), base.cuda()
        R.sign_unpack(*want, chunk, n, o_ref, True)
        cb.sign_unpack(*_cuda(want), chunk, n, o_gpu, True)
        assert_bitwise(o_gpu.cpu(), o_ref, f"sign_unpack {chunk}")


@pytest.mark.parametrize("n", SIZES)
def test_rng_hash_bits_scatter(cb, n):
    for seed, start in ((0, 0), (2**64 - 1, 2**32 - 5), (12345, 99)):
        assert_bitwise(cb.counter_bits(seed, start, n, "cuda").cpu(), R.counter_bits(seed, start, n))
        assert_bitwise(cb.counter_uniform(seed, start, n, "cuda").cpu(), R.counter_uniform(seed, start, n))
    idx = torch.randperm(max(n, 1))[: n // 3]
    assert_bitwise(cb.hash_owner(idx.cuda(), 5).cpu(), R.hash_owner(idx, 5))
    for bits in (1, 3, 4, 8):
        codes = torch.randint(0, 256, (n,), dtype=torch.uint8)
        packed = R.pack_bits(codes, bits)
        assert_bitwise(cb.pack_bits(codes.cuda(), bits).cpu(), packed, f"pack {bits}")
        assert_bitwise(cb.unpack_bits(packed.cuda(), bits, n).cpu(), R.unpack_bits(packed, bits, n))
    out = torch.randn(max(n, 1))
    vals = torch.randn(idx.numel())
    want = R.scatter_add_(out.clone(), idx, vals)
    assert_bitwise(cb.scatter_add_(out.cuda(), idx.cuda(), vals.cuda()).cpu(), want, "scatter_add_")


def test_runs_on_current_stream(cb):
    x = _x(1_000_003).cuda()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        p, sc = cb.block_quantize(x, 8, 256)
        out = torch.zeros_like(x)
        cb.block_dequantize(p, sc, 8, 256, x.numel(), out, True)
    s.synchronize()
    want = R.block_dequantize(*R.block_quantize(x.cpu(), 8, 256), 8, 256, x.numel())
    assert_bitwise(out.cpu(), want)


def test_dispatch_picks_cuda(cb):
    import commpress.ops as ops

    x = _x(1000).cuda()
    assert ops.resolve("topk_compact", x.device) is cb.topk_compact
    assert_bitwise(_cpu(ops.topk_compact(x, 10)), R.topk_compact(x.cpu(), 10))
    assert_bitwise(ops.counter_uniform(3, 0, 100, device=x.device).cpu(), R.counter_uniform(3, 0, 100))
