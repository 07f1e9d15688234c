"""The numba backend matches the torch reference on ~1e6-element inputs (default chunking)."""

from __future__ import annotations

import pytest
import torch

from commpress.ops import reference as R

nb = pytest.importorskip("commpress.ops.numba_backend")

from opcheck import assert_bitwise, messy_large, run_selection  # noqa: E402


N_LARGE = 1_000_003


@pytest.fixture(scope="module")
def large():
    return messy_large(N_LARGE)


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
