"""What the GPU check's scripts share, and the only places where its dry run differs from a GPU run.

``benchmarks/gpu_check.sh --dry-run`` runs every step of the GPU check on CPU so that CI catches a
broken script before a GPU session does: the host build of ``kernels/*.cu`` (``HostLauncher``)
stands in for the GPU and CPU tensors stand in for CUDA tensors, and the ops dispatcher sends CPU
tensors to the cuda backend (:func:`setup`).  The CUDA-only pieces are the few branches below:
timing (CUDA events / wall clock), the HBM peak (device attributes / the host memcpy rate), and
the sync check (``torch.cuda.set_sync_debug_mode("error")`` / no host read of tensor data from
Python).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from pathlib import Path

import torch

#: Peak HBM bandwidth (GB/s) by device name, used only when the device attributes are missing.
KNOWN_PEAKS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0,
               "A100-SXM4-80GB": 2039.0, "A100 80GB": 1935.0, "A100": 1555.0, "L40S": 864.0,
               "A10": 600.0, "V100": 900.0}


class Env:
    """The device the check runs on: ``cuda:N`` (GPU run) or ``cpu`` with the host launcher (dry run)."""

    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        if dry_run:
            self.device = torch.device("cpu")
            self.name = "dry run: host build of kernels/*.cu on CPU"
        else:
            if not torch.cuda.is_available():
                raise SystemExit("gpu check: torch sees no CUDA device (use --dry-run without a GPU)")
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.name = torch.cuda.get_device_name(self.device)

    def synchronize(self) -> None:
        if not self.dry_run:
            torch.cuda.synchronize(self.device)

    def time_ms(self, fn, repeat: int, warmup: int = 2) -> float:
        """Median milliseconds of ``fn()`` (CUDA events on the current stream; wall clock on CPU)."""
        for _ in range(warmup):
            fn()
        self.synchronize()
        times = []
        for _ in range(repeat):
            if self.dry_run:
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
            else:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        return statistics.median(times)

    def hbm_peak_gbs(self) -> tuple[float, str]:
        """(peak GB/s, where it came from): 2 x memory clock x bus width read from the device
        (torch's device properties, else CuPy's attributes), else $HBM_PEAK_GBS or a table; on
        the dry run, the host's measured memcpy rate."""
        if os.environ.get("HBM_PEAK_GBS"):
            return float(os.environ["HBM_PEAK_GBS"]), "HBM_PEAK_GBS"
        if self.dry_run:
            x = torch.ones(1 << 22)
            y = torch.empty_like(x)
            ms = self.time_ms(lambda: y.copy_(x), 5)
            return 8 * x.numel() / ms / 1e6, "dry run: host memcpy rate"
        index = self.device.index
        clock_khz = bus_bits = 0
        props = torch.cuda.get_device_properties(index)
        clock_khz = getattr(props, "memory_clock_rate", 0) or 0
        bus_bits = getattr(props, "memory_bus_width", 0) or 0
        source = "torch device properties"
        if not (clock_khz and bus_bits):
            try:
                import cupy

                clock_khz = cupy.cuda.runtime.deviceGetAttribute(36, index)  # cudaDevAttrMemoryClockRate
                bus_bits = cupy.cuda.runtime.deviceGetAttribute(37, index)  # cudaDevAttrGlobalMemoryBusWidth
                source = "CuPy device attributes"
            except Exception:  # attribute gone in a newer CUDA, or no CuPy
                clock_khz = bus_bits = 0
        if clock_khz > 0 and bus_bits > 0:
            return 2.0 * clock_khz * 1e3 * bus_bits / 8 / 1e9, f"{source}: 2 x {clock_khz} kHz x {bus_bits} bit"
        for key, peak in KNOWN_PEAKS.items():
            if key in self.name:
                return peak, f"table entry {key!r} (device attributes unavailable)"
        raise SystemExit(f"gpu check: unknown HBM peak for {self.name!r}: set HBM_PEAK_GBS")

    @contextlib.contextmanager
    def no_syncs(self):
        """GPU: ``torch.cuda.set_sync_debug_mode("error")``.  Dry run: any host read of tensor data
        from Python (``item``, ``tolist``, ``bool(t)``, ...) raises, the part of a GPU sync a CPU run
        can see."""
        if not self.dry_run:
            torch.cuda.synchronize(self.device)
            torch.cuda.set_sync_debug_mode("error")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
            return

        def forbidden(*args, **kwargs):
            raise RuntimeError("dry run: host read of tensor data in a steady-state step "
                               "(on a GPU: a synchronizing CUDA operation)")

        names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")
        saved = {n: getattr(torch.Tensor, n) for n in names}
        try:
            for n in names:
                setattr(torch.Tensor, n, forbidden)
            yield
        finally:
            for n, f in saved.items():
                setattr(torch.Tensor, n, f)


def setup(dry_run: bool) -> Env:
    """The environment of one script of the check.  GPU: the cuda backend must be registered.
    Dry run: the host build of the kernels is registered as the cuda backend for CPU tensors, with
    the GPU's error reporting (no host reads)."""
    import commpress.ops as ops
    from commpress.ops import cuda_backend as cb

    env = Env(dry_run)
    if dry_run:
        import importlib.util

        root = Path(__file__).resolve().parents[1]
        spec = importlib.util.spec_from_file_location("commpress_host_build", root / "kernels/host/build.py")
        build = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(build)
        launcher = cb.HostLauncher(build.build(root / "kernels/host/build"), threads=32, max_grid=8)
        launcher.reads_are_free = False
        cb._launcher = launcher
        ops.register_backend("cuda", cb.OPS)
        ops.DEVICE_BACKENDS["cpu"] = "cuda"
    elif not cb.available():
        raise SystemExit(f"gpu check: cuda backend unavailable (cupy={cb.cp is not None}, "
                         f"NVRTC: {cb.nvrtc_problem() if cb.cp is not None else 'n/a'})")
    return env


def write_json(path: Path | str | None, data: dict) -> None:
    """Write one step's results (the report merges the steps' files)."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
