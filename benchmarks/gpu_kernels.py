"""Bandwidth of the CUDA backend's ops on one GPU (run by benchmarks/gpu_check.sh).

    python -m benchmarks.gpu_kernels [--sizes 24 26] [--repeat 20] [--out results/gpu-kernels.json]

For each size (2**24 and 2**26 fp32 by default) it prints, per op: time (median of CUDA-event
timings), GB/s of the bytes the op must move at least, % of the device's HBM peak, the ratio of
its time to a device memcpy of the same tensor (read + write 4n bytes), and for top-k the speed-up
over ``torch.topk`` on ``|x|``; for the main ops also each kernel's time, GB/s and % of peak.  Each result is first checked bitwise against the torch reference
on the same device.  Goals of the first run: top-k 1% + residual <= 3x memcpy and >= 5x
faster than torch.topk; blockquant compress and decode <= 1.5x memcpy; streaming ops >= 70% of peak.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

# Peak HBM bandwidth (GB/s) by device name, when the driver does not report clock and bus width.
KNOWN_PEAKS = {"H200": 4800.0, "H100 SXM": 3350.0, "H100 PCIe": 2000.0, "H100": 3350.0,
               "A100-SXM4-80GB": 2039.0, "A100 80GB": 1935.0, "A100": 1555.0, "L40S": 864.0,
               "A10": 600.0, "V100": 900.0}


def hbm_peak_gbs(index: int) -> tuple[float, str]:
    """(peak GB/s, where it came from): $HBM_PEAK_GBS, the driver's attributes, or a table."""
    if os.environ.get("HBM_PEAK_GBS"):
        return float(os.environ["HBM_PEAK_GBS"]), "HBM_PEAK_GBS"
    try:
        import cupy

        clock_khz = cupy.cuda.runtime.deviceGetAttribute(36, index)  # cudaDevAttrMemoryClockRate
        bus_bits = cupy.cuda.runtime.deviceGetAttribute(37, index)  # cudaDevAttrGlobalMemoryBusWidth
        if clock_khz > 0 and bus_bits > 0:
            return 2.0 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "driver (2 x memory clock x bus width)"
    except Exception:  # attribute removed in a newer CUDA, or CuPy missing
        pass
    name = torch.cuda.get_device_name(index)
    for key, peak in KNOWN_PEAKS.items():
        if key in name:
            return peak, f"table entry {key!r}"
    raise SystemExit(f"gpu_kernels: unknown HBM peak for {name!r}: set HBM_PEAK_GBS")


def time_ms(fn, repeat: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn()`` on the current stream (CUDA events, no host reads inside)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def same(a, b, what: str) -> None:
    """Bitwise equality (any NaN equals any NaN), or exit with the op's name."""
    if isinstance(a, (tuple, list)):
        for x, y in zip(a, b):
            same(x, y, what)
        return
    if a.dtype != b.dtype or a.shape != b.shape:
        raise SystemExit(f"gpu_kernels: {what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
    if a.is_floating_point():
        wide = {torch.float32: torch.int32, torch.float64: torch.int64}[a.dtype]
        ok = (a.view(wide) == b.view(wide)) | (torch.isnan(a) & torch.isnan(b))
    else:
        ok = a == b
    if not bool(ok.all()):
        raise SystemExit(f"gpu_kernels: {what}: differs from the torch reference")


BREAKDOWN = ("topk 1% + residual", "blockquant 8b/256 compress", "blockquant 8b decode+acc",
             "sign_pack chunk 4096")


def cases(cb, ref, x: torch.Tensor):
    """(name, function, bytes it must move, reference check or None)."""
    n = x.numel()
    k = n // 100
    res = torch.empty_like(x)
    q8 = cb.block_quantize(x, 8, 256)
    q4 = cb.block_quantize(x, 4, 64)
    sp = cb.sign_pack(x, 4096)
    acc = torch.zeros_like(x)
    idx, vals = cb.topk_compact(x, k)
    out = torch.zeros_like(x)
    xi = x.view(torch.int32)
    yield ("topk 1% + residual", lambda: cb.topk_compact(x, k, res), 8 * n + 8 * k,
           lambda: same(cb.topk_compact(x, k, res), ref.topk_compact(x, k, torch.empty_like(x)), "topk"))
    yield ("  radix select only", lambda: cb.radix_select_state(xi, k), 4 * n, None)
    yield ("topk 1% (no residual)", lambda: cb.topk_compact(x, k), 4 * n + 8 * k, None)
    yield ("threshold (1 host read)", lambda: cb.threshold_compact(x, 2.5), 4 * n, None)
    yield ("blockquant 8b/256 compress", lambda: cb.block_quantize(x, 8, 256), 5 * n,
           lambda: same(q8, ref.block_quantize(x, 8, 256), "quantize 8"))
    yield ("blockquant 8b decode+acc", lambda: cb.block_dequantize(*q8, 8, 256, n, acc, True), 9 * n,
           lambda: same(cb.block_dequantize(*q8, 8, 256, n), ref.block_dequantize(*q8, 8, 256, n), "dq 8"))
    yield ("blockquant 4b/64 compress", lambda: cb.block_quantize(x, 4, 64), 4.5 * n,
           lambda: same(q4, ref.block_quantize(x, 4, 64), "quantize 4"))
    yield ("blockquant 4b decode", lambda: cb.block_dequantize(*q4, 4, 64, n, out), 4.5 * n, None)
    yield ("sign_pack chunk 4096", lambda: cb.sign_pack(x, 4096), 4 * n + n / 8,
           lambda: same(sp, ref.sign_pack(x, 4096), "sign_pack"))
    yield ("sign_pack one chunk", lambda: cb.sign_pack(x, n), 4 * n + n / 8,
           lambda: same(cb.sign_pack(x, n), ref.sign_pack(x, n), "sign_pack n"))
    yield ("sign_unpack + acc", lambda: cb.sign_unpack(*sp, 4096, n, acc, True), 8 * n + n / 8, None)
    yield ("counter_uniform", lambda: cb.counter_uniform(1, 0, n, x.device), 4 * n, None)
    yield ("scatter_add_ 1%", lambda: cb.scatter_add_(acc, idx, vals), 20 * k,
           lambda: same(cb.scatter_add_(torch.zeros_like(x), idx, vals),
                        ref.scatter_add_(torch.zeros_like(x), idx, vals), "scatter_add_"))
    yield ("hash_owner 1%, 2**32", lambda: cb.hash_owner(idx, 2**32), 12 * k,
           lambda: same(cb.hash_owner(idx, 2**32), ref.hash_owner(idx, 2**32), "hash_owner"))


# Bytes one call of a kernel must move for n fp32 elements (top-k writing its residual, 8-bit codes).
KERNEL_BYTES = {"radix_hist": 4.0, "sel_count": 4.0, "sel_write_i32": 8.0, "block_absmax_kernel": 4.0,
                "block_quantize_kernel": 5.0, "block_dequantize_kernel": 9.0, "sign_bits_kernel": 4.125,
                "tree256_kernel": 4.0}


def kernel_breakdown(name: str, fn, n: int, peak: float, repeat: int = 5) -> None:
    """Each GPU kernel of one op (torch.profiler/CUPTI sees CuPy's launches too): us per call,
    and for the kernels of kernels/*.cu that stream the tensor, GB/s and % of peak."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            fn()
        torch.cuda.synchronize()
    print(f"  kernels of {name}:")
    for evt in sorted(prof.key_averages(), key=lambda e: e.key):
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = getattr(evt, "self_cuda_time_total", 0.0)
        if not us or getattr(evt, "self_cpu_time_total", 0.0):
            continue  # not a device-side row
        per_call = us / repeat
        calls = evt.count / repeat
        factor = KERNEL_BYTES.get(evt.key)
        rate = ""
        if factor is not None:
            gbs = factor * n * calls / per_call / 1e3
            rate = f"{gbs:7.0f} GB/s {100 * gbs / peak:4.0f}%"
        print(f"    {evt.key[:40]:40s} x{calls:<4.0f} {per_call:9.1f} us  {rate}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[24, 26], help="log2 of the element counts")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("results/gpu-kernels.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_kernels: torch sees no CUDA device")
    from commpress.ops import cuda_backend as cb
    from commpress.ops import reference as ref

    if not cb.available():
        raise SystemExit(f"gpu_kernels: cuda backend unavailable (cupy={cb.cp is not None}, "
                         f"NVRTC: {cb.nvrtc_problem() if cb.cp is not None else 'n/a'})")
    index = torch.cuda.current_device()
    peak, source = hbm_peak_gbs(index)
    print(f"device {torch.cuda.get_device_name(index)}: HBM peak {peak:.0f} GB/s ({source})")
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for log2 in args.sizes:
        n = 1 << log2
        x = torch.randn(n, device="cuda", generator=gen)
        dst = torch.empty_like(x)
        t_copy = time_ms(lambda: dst.copy_(x), args.repeat)
        copy_gbs = 8 * n / t_copy / 1e6
        k = n // 100
        t_torch_topk = time_ms(lambda: torch.topk(x.abs(), k, sorted=False), max(3, args.repeat // 4))
        print(f"\nn = 2**{log2} fp32: memcpy {t_copy:.3f} ms = {copy_gbs:.0f} GB/s "
              f"({100 * copy_gbs / peak:.0f}% of peak); torch.topk(|x|, 1%) {t_torch_topk:.3f} ms")
        print(f"{'op':30s} {'ms':>8s} {'GB/s':>7s} {'%peak':>6s} {'x memcpy':>9s}  notes")
        for name, fn, nbytes, check in cases(cb, ref, x):
            if check is not None:
                check()
            t = time_ms(fn, args.repeat)
            gbs = nbytes / t / 1e6
            note = f"{t_torch_topk / t:.1f}x faster than torch.topk" if name.startswith("topk") else ""
            print(f"{name:30s} {t:8.3f} {gbs:7.0f} {100 * gbs / peak:5.0f}% {t / t_copy:8.2f}x  {note}")
            rows.append({"n": n, "op": name.strip(), "ms": t, "bytes": nbytes, "gbs": gbs,
                         "pct_peak": 100 * gbs / peak, "x_memcpy": t / t_copy,
                         "torch_topk_ms": t_torch_topk if name.startswith("topk") else None})
            if name in BREAKDOWN:
                try:
                    kernel_breakdown(name, fn, n, peak)
                except Exception as exc:  # profiler without CUPTI: the op figures stand
                    print(f"  (per-kernel breakdown unavailable: {exc!r})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(index), "hbm_peak_gbs": peak,
                                    "rows": rows}, indent=1))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
