"""The numba backend matches the torch reference on ~1e6-element inputs (default chunking, 2 threads)."""

from __future__ import annotations

import pytest
import torch

from commpress.ops import reference as R

nb = pytest.importorskip("commpress.ops.numba_backend")
from commpress.ops import _numba_kernels as K  # noqa: E402

from opcheck import assert_bitwise, messy_large, run_selection  # noqa: E402


N_LARGE = 1_000_003


@pytest.fixture(scope="module")
def large():
    return messy_large(N_LARGE)


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    """Every call's chunks split over two threads (the calling one and the kernels' pool)."""
    with K.use_threads(2):
        yield


def test_large_selection(large):
    run_selection(nb, "threshold_compact", large, 2.5)
    run_selection(nb, "topk_compact", large, N_LARGE // 100)
    run_selection(nb, "topk_compact", large, 3)


def test_large_quantize(large):
    for bits, block, sto in ((8, 256, False), (4, 100, True), (2, 4096, True)):
        want = R.block_quantize(large, bits, block, sto, 11)
        assert_bitwise(nb.block_quantize(large, bits, block, sto, 11), want, f"q{bits}")
        out_ref, out_nb = large.clone(), large.clone()
        R.block_dequantize(*want, bits, block, N_LARGE, out_ref, True)
        nb.block_dequantize(*want, bits, block, N_LARGE, out_nb, True)
        assert_bitwise(out_nb, out_ref, f"dq{bits}")


def test_large_misc(large):
    for chunk in (1000, N_LARGE):
        assert_bitwise(nb.sign_pack(large, chunk), R.sign_pack(large, chunk), f"sign {chunk}")
    assert_bitwise(nb.counter_uniform(5, 2**32 - 10, N_LARGE), R.counter_uniform(5, 2**32 - 10, N_LARGE))
    idx = torch.randperm(N_LARGE, generator=torch.Generator().manual_seed(1))[: N_LARGE // 10]
    assert_bitwise(nb.hash_partition(idx, 4), R.hash_partition(idx, 4))
    bm = R.bitmap_encode(idx, N_LARGE)
    assert_bitwise(nb.bitmap_encode(idx, N_LARGE), bm)
    assert_bitwise(nb.bitmap_decode(bm, N_LARGE), R.bitmap_decode(bm, N_LARGE))
    out_ref, out_nb = large.clone(), large.clone()
    vals = torch.randn(idx.numel(), generator=torch.Generator().manual_seed(2))
    assert_bitwise(nb.scatter_add_(out_nb, idx, vals), R.scatter_add_(out_ref, idx, vals))


def test_large_minifloat_level_and_sign_feedback(large):
    for fmt, block, sto in (("e4m3", 128, False), ("e5m2", 1000, True)):
        want = R.fp8_quantize(large, fmt, block, sto, 5)
        assert_bitwise(nb.fp8_quantize(large, fmt, block, sto, 5), want, f"fp8 {fmt}")
        assert_bitwise(nb.fp8_dequantize(*want, fmt, block, N_LARGE), R.fp8_dequantize(*want, fmt, block, N_LARGE))
    for element, sto in (("fp8_e4m3", True), ("fp6_e2m3", False), ("fp4_e2m1", True)):
        want = R.mx_quantize(large, element, sto, 6)
        assert_bitwise(nb.mx_quantize(large, element, sto, 6), want, f"mx {element}")
        assert_bitwise(nb.mx_dequantize(*want, element, N_LARGE), R.mx_dequantize(*want, element, N_LARGE))
    for bucket, levels in ((512, 7), (N_LARGE, 1)):
        norms = R.bucket_norms(large, bucket)
        assert_bitwise(nb.bucket_norms(large, bucket), norms, "norms")
        packed = R.level_quantize(large, norms, bucket, levels, 7)
        assert_bitwise(nb.level_quantize(large, norms, bucket, levels, 7), packed, f"levels {levels}")
        assert_bitwise(nb.qsgd_quantize(large, levels, bucket, 7), (packed, norms), "fused qsgd")
        assert_bitwise(nb.level_dequantize(packed, norms, bucket, levels, N_LARGE),
                       R.level_dequantize(packed, norms, bucket, levels, N_LARGE))
    finite = torch.nan_to_num(large, nan=0.0, posinf=1.0, neginf=-1.0)
    r = torch.randn(N_LARGE, generator=torch.Generator().manual_seed(3))
    o_ref, o_nb = torch.empty(N_LARGE), torch.empty(N_LARGE)
    want = R.sign_pack_feedback(finite, r, 0.5, 1024, o_ref)
    assert bool(want[2])
    assert_bitwise(nb.sign_pack_feedback(finite, r, 0.5, 1024, o_nb), want, "sign feedback")
    assert_bitwise(o_nb, o_ref, "sign feedback residual")
