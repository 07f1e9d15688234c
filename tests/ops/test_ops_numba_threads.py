"""numba kernels split their chunks over commpress's own small pool, and only when asked:
the same bits at any thread count, no thread in a one-thread rank process, numba's pool never."""

import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("numba")

from commpress.ops import _numba_kernels as K  # noqa: E402
from commpress.ops import numba_backend as NB  # noqa: E402


def _run_all(x):
    r = torch.zeros_like(x)
    idx = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(4))[: x.numel() // 9]
    out = torch.zeros_like(x)
    return (NB.topk_compact(x, 3000, residual=r), r, NB.block_quantize(x, 4, 128, True, 5),
            NB.qsgd_quantize(x, 7, 512, 3), NB.hash_partition(idx, 3), NB.counter_bits(9, 77, 300_001),
            NB.scatter_add_(out, idx, torch.ones(idx.numel())), NB.sign_pack(x, 1024))


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_any_thread_count_gives_the_one_thread_bits(threads):
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(3))
    with K.serial_kernels():
        assert K.in_serial_mode() and K.kernel_threads() == 1
        want = _run_all(x)
    with K.use_threads(threads):
        assert not K.in_serial_mode() and K.kernel_threads() == threads
        got = _run_all(x)
    assert K.kernel_threads() == 1
    assert K.pool_started()
    flat = lambda t: [a for v in t for a in (flat(v) if isinstance(v, tuple) else [v])]  # noqa: E731
    for i, (a, b) in enumerate(zip(flat(want), flat(got), strict=True)):
        assert torch.equal(a, b), i


def test_run_split_covers_every_unit_once_and_raises_a_workers_error():
    seen = []
    with K.use_threads(3):
        K.run_split(1000, lambda a, b: seen.append((a, b)), align=64)
        assert sorted(seen)[0][0] == 0 and sorted(seen)[-1][1] == 1000
        assert sum(b - a for a, b in seen) == 1000 and all(a % 64 == 0 for a, _ in seen)

        def fail_late(a, b):
            if a > 0:
                raise ValueError("worker")

        with pytest.raises(ValueError, match="worker"):
            K.run_split(1000, fail_late)


def test_one_torch_thread_starts_no_thread_and_never_numbas_pool():
    code = textwrap.dedent("""
        import threading
        import torch
        torch.set_num_threads(1)
        from commpress import ops
        from commpress.ops import _numba_kernels as K
        import numba.np.ufunc.parallel as P
        x = torch.randn(1 << 19)
        r = torch.zeros_like(x)
        ops.topk_compact(x, 5000, residual=r)
        packed, scales = ops.block_quantize(x, 8, 256)
        ops.block_dequantize(packed, scales, 8, 256, x.numel())
        ops.scatter_add_(torch.zeros(1 << 19), torch.arange(0, 1 << 19, 7, dtype=torch.int32),
                         torch.ones(len(range(0, 1 << 19, 7))))
        print("numba pool", P._is_initialized, "kernel pool", K.pool_started(),
              "threads", threading.active_count())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "numba pool False kernel pool False threads 1" in out.stdout


def test_a_forked_child_gets_a_working_pool():
    """The pool's threads do not survive a fork: the child must start its own, not wait forever."""
    code = textwrap.dedent("""
        import os
        import torch
        torch.set_num_threads(2)
        from commpress import ops
        from commpress.ops import _numba_kernels as K
        x = torch.randn(1 << 20)  # large enough to be split over 2 threads
        want = ops.block_quantize(x, 4, 128)
        assert K.pool_started()
        pid = os.fork()
        if pid == 0:
            got = ops.block_quantize(x, 4, 128)
            os._exit(0 if all(torch.equal(a, b) for a, b in zip(got, want)) else 3)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "child 0" in out.stdout
