"""Where the CUDA backend's tests run: the host build of kernels/*.cu (CI) or a real GPU.

Both go through the same wrapper, :mod:`commpress.ops.cuda_backend`, with a different launcher:
``HostLauncher`` on CPU tensors (built by kernels/host/build.py with g++) or ``CupyLauncher`` on
``cuda`` tensors.  A target moves test inputs to its device and builds launchers with a given
block size and grid cap (small grids exercise the grid-stride loops).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from commpress.ops import cuda_backend

ROOT = Path(__file__).resolve().parents[2]
HOST_DIR = ROOT / "kernels" / "host"


def _build_module():
    spec = importlib.util.spec_from_file_location("commpress_host_build", HOST_DIR / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def host_library(tsan: bool = False) -> Path:
    """The host build of the kernels (built on first use; skips the test without g++)."""
    if not shutil.which("g++") and not __import__("os").environ.get("CXX"):
        pytest.skip("no C++ compiler: run kernels/host_check.sh (installs g++)")
    try:
        return _build_module().build(HOST_DIR / "build", tsan=tsan)
    except subprocess.CalledProcessError as exc:
        pytest.fail(f"host build of kernels/*.cu failed: {exc}")


class Target:
    """A device plus a way to make launchers for it."""

    def __init__(self, name: str, device: torch.device):
        self.name, self.device = name, device

    def launcher(self, threads: int | None = None, max_grid: int | None = None):
        if self.name == "host":
            return cuda_backend.HostLauncher(host_library(), threads=threads or 64, max_grid=max_grid or 4)
        launcher = cuda_backend.CupyLauncher(max_grid=max_grid or 65535)
        if threads:
            launcher.threads = threads
        return launcher

    def to(self, t):
        if isinstance(t, (tuple, list)):
            return type(t)(self.to(v) for v in t)
        return t.to(self.device, copy=True) if isinstance(t, torch.Tensor) else t  # never aliases


def gpu_target() -> Target:
    if not cuda_backend.available():
        pytest.skip("cuda backend not available (needs a GPU, CuPy and NVRTC)")
    return Target("cuda", torch.device("cuda", torch.cuda.current_device()))


def host_target() -> Target:
    host_library()
    return Target("host", torch.device("cpu"))
