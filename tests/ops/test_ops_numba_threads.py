"""numba kernels never start their thread pool in a one-thread rank process (no spinning)."""

import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("numba")

from commpress.ops import _numba_kernels as K  # noqa: E402
from commpress.ops import numba_backend as NB  # noqa: E402


def test_serial_twin_matches_parallel_build():
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(3))
    r1, r2 = torch.zeros_like(x), torch.zeros_like(x)
    with K.serial_kernels():
        assert K.in_serial_mode()
        i1, v1 = NB.topk_compact(x, 3000, residual=r1)
        p1, s1 = NB.block_quantize(x, 4, 128)
    assert not K.in_serial_mode()
    i2, v2 = NB.topk_compact(x, 3000, residual=r2)
    p2, s2 = NB.block_quantize(x, 4, 128)
    assert torch.equal(i1, i2) and torch.equal(v1, v2) and torch.equal(r1, r2)
    assert torch.equal(p1, p2) and torch.equal(s1, s2)


def test_one_torch_thread_never_launches_numba_pool():
    code = textwrap.dedent("""
        import torch
        torch.set_num_threads(1)
        from commpress import ops
        import numba.np.ufunc.parallel as P
        x = torch.randn(1 << 19)
        r = torch.zeros_like(x)
        ops.topk_compact(x, 5000, residual=r)
        packed, scales = ops.block_quantize(x, 8, 256)
        ops.block_dequantize(packed, scales, 8, 256, x.numel())
        ops.scatter_add_(torch.zeros(1 << 19), torch.arange(0, 1 << 19, 7, dtype=torch.int32),
                         torch.ones(len(range(0, 1 << 19, 7))))
        print("launched", P._is_initialized)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "launched False" in out.stdout
