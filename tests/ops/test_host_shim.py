"""The host shim (kernels/host/cuda_shim.h) that runs kernels/*.cu on CPU in CI: its barriers hold
in both of its modes (fibers, the default, and std::threads, what TSan checks); the fibers run the
threads between two barriers in an order that changes, so a kernel that depends on one order (a
missing barrier) is not passed by luck; a block whose threads wait at a barrier some never reach
is reported (fibers; the threads build hangs there).  A small C++ program with its own kernels,
built with g++.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

from cuda_targets import HOST_DIR

PROGRAM = r"""
#include "cuda_shim.h"
#include <cstdio>

__global__ void neighbours(int* a, int* out) {
    __shared__ int s[256];
    s[threadIdx.x] = (int)(blockIdx.x * 1000 + threadIdx.x);
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
    __syncthreads();
    (void)a;
}

__global__ void warp_sum(int* out) {
    int v = (int)threadIdx.x;
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    out[threadIdx.x] = v;
}

// The order in which the threads pass each of three phases (between barriers).
__global__ void order(unsigned* counter, int* seen) {
    for (int phase = 0; phase < 3; ++phase) {
        unsigned at = atomicAdd(&counter[phase], 1u);
        seen[phase * blockDim.x + at] = (int)threadIdx.x;
        __syncthreads();
    }
}

// Thread 0 leaves before the barrier the others wait at: a deadlock on a GPU too.
__global__ void early_return(int* out) {
    if (threadIdx.x == 0) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}

int main() {
    const int T = 64, G = 3;
    std::vector<int> out(T * G, -1);
    cuhost::launch(G, T, [&] { neighbours(nullptr, out.data()); });
    int bad = 0;
    for (int b = 0; b < G; ++b)
        for (int t = 0; t < T; ++t) bad += out[b * T + t] != b * 1000 + (t + 1) % T;
    std::printf("neighbours_bad %d\n", bad);
    std::vector<int> sums(T, -1);
    cuhost::launch(1, T, [&] { warp_sum(sums.data()); });
    bad = 0;
    for (int t = 0; t < T; ++t) bad += sums[t] != (t < 32 ? 496 : 32 * 32 + 496);
    std::printf("warp_sum_bad %d\n", bad);
    for (int launch = 0; launch < 2; ++launch) {
        unsigned counter[3] = {0, 0, 0};
        std::vector<int> seen(3 * T, -1);
        cuhost::launch(1, T, [&] { order(counter, seen.data()); });
        for (int phase = 0; phase < 3; ++phase) {
            std::printf("order");
            for (int i = 0; i < T; ++i) std::printf(" %d", seen[phase * T + i]);
            std::printf("\n");
        }
    }
#ifndef CUHOST_THREADS
    std::vector<int> ones(T, 0);
    bool ok = cuhost::launch(2, T, [&] { early_return(ones.data()); });
    std::printf("early_return_ok %d\n", (int)ok);
    std::fill(out.begin(), out.end(), -1);   // the next launch runs as usual
    ok = cuhost::launch(G, T, [&] { neighbours(nullptr, out.data()); });
    bad = 0;
    for (int b = 0; b < G; ++b)
        for (int t = 0; t < T; ++t) bad += out[b * T + t] != b * 1000 + (t + 1) % T;
    std::printf("after_deadlock %d %d\n", (int)ok, bad);
#endif
    return 0;
}
"""


def _run(tmp_path, *flags: str) -> list[str]:
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler: run kernels/host_check.sh (installs g++)")
    src = tmp_path / "shim_check.cpp"
    src.write_text(PROGRAM)
    exe = tmp_path / ("shim_check" + "".join(flags).replace("-", "_"))
    subprocess.run([cxx, "-std=c++17", "-O1", "-pthread", "-Wall", "-Werror", "-Wno-unused-function",
                    "-I", str(HOST_DIR), *flags, "-o", str(exe), str(src)], check=True)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=60).stdout.splitlines()


@pytest.mark.parametrize("flags", [(), ("-DCUHOST_THREADS",)], ids=["fibers", "threads"])
def test_barriers_and_shuffles_hold(tmp_path, flags):
    lines = _run(tmp_path, *flags)
    assert "neighbours_bad 0" in lines and "warp_sum_bad 0" in lines, lines
    orders = [list(map(int, ln.split()[1:])) for ln in lines if ln.startswith("order")]
    assert len(orders) == 6 and all(sorted(o) == list(range(64)) for o in orders)   # every thread, once


def test_fibers_report_a_deadlock_and_run_the_next_launch(tmp_path):
    lines = _run(tmp_path)
    assert "early_return_ok 0" in lines and "after_deadlock 1 0" in lines, lines


def test_a_deadlocked_kernel_raises_through_the_launcher():
    """What the wrapper makes of the library's -3 (the kernels in kernels/*.cu never deadlock:
    a stand-in library that reports one)."""
    from commpress.ops import cuda_backend

    class Lib:
        def cuhost_signature(self, name):
            return b""

        def cuhost_launch(self, *args):
            return -3

    launcher = cuda_backend.HostLauncher.__new__(cuda_backend.HostLauncher)
    launcher.lib, launcher.launches = Lib(), []
    with pytest.raises(RuntimeError, match="deadlock"):
        launcher.launch(torch.device("cpu"), "k", 1, (), 64)


def test_fibers_pass_a_phase_in_changing_orders(tmp_path):
    orders = [tuple(map(int, ln.split()[1:])) for ln in _run(tmp_path) if ln.startswith("order")]
    assert tuple(range(64)) not in orders and tuple(range(63, -1, -1)) not in orders, orders
    assert len(set(orders)) == len(orders), orders   # six phases, six different orders
