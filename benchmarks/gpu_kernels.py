"""Bandwidth of the CUDA backend's ops on one GPU (step of benchmarks/gpu_check.sh).

    python -m benchmarks.gpu_kernels [--sizes 20 .. 26] [--repeat 20] [--out FILE.json] [--dry-run]

For each size (2**20 to 2**26 fp32 by default) it prints, per op: time (median of CUDA-event
timings), GB/s of the bytes the op must move at least, % of the device's HBM peak (2 x memory
clock x bus width, read from the device), the ratio of its time to a device memcpy of the same
tensor (read + write 4n bytes), and for top-k the speed-up over ``torch.topk`` on ``|x|``; at
the largest size, for the main ops, each kernel's time, GB/s and % of peak.  Each result is first
checked bitwise against the torch reference on the same device (a mismatch exits non-zero).
benchmarks/gpu_report.py judges the goals: elementwise ops >= 70% of peak, top-k 1% of 2**26
>= 5x faster than torch.topk.  ``--dry-run``: the same on CPU with the host build of the kernels.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

def same(a, b, what: str) -> None:
    """Bitwise equality (any NaN equals any NaN), or exit with the op's name and the first difference."""
    if isinstance(a, (tuple, list)):
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{what}[{i}]")
        return
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        raise SystemExit(f"gpu_kernels: {what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
    if a.is_floating_point():
        wide = {torch.float32: torch.int32, torch.float64: torch.int64}[a.dtype]
        ok = (a.view(wide) == b.view(wide)) | (torch.isnan(a) & torch.isnan(b))
    else:
        ok = a == b
    if not bool(ok.all()):
        bad = (~ok).nonzero().reshape(-1)
        i = int(bad[0])
        raise SystemExit(f"gpu_kernels: {what}: {bad.numel()} of {a.numel()} differ from the torch "
                         f"reference, first at {i}: {a[i].item()!r} vs {b[i].item()!r}")


class OnHost:
    """The reference ops run on CPU copies of their tensor arguments: the reference's definition.
    On CUDA tensors torch itself may round differently (a division by a Python float is a
    multiplication by its reciprocal there), so the GPU kernels are checked against the host."""

    def __init__(self, ref):
        self.ref = ref

    def __getattr__(self, name):
        fn = getattr(self.ref, name)

        def host(a):
            if isinstance(a, torch.Tensor):
                return a.cpu()
            return type(a)(host(t) for t in a) if isinstance(a, (tuple, list)) else a

        return lambda *args, **kw: fn(*[host(a) for a in args], **{k: host(v) for k, v in kw.items()})


BREAKDOWN = ("topk 1% + residual", "blockquant 8b/256 compress", "blockquant 8b decode+acc",
             "sign_pack chunk 4096", "fp8 e4m3/128 compress", "qsgd 7 levels/512 compress",
             "signsgd EF chunk 1024")

#: Kinds of case: "elementwise" streams the tensor (goal: >= 70% of HBM peak at the largest size).
ELEMENTWISE = "elementwise"


def cases(cb, ref, x: torch.Tensor):
    """(name, kind, function, bytes it must move at least, reference check or None)."""
    n = x.numel()
    k = max(1, n // 100)
    res = torch.empty_like(x)
    q8 = cb.block_quantize(x, 8, 256)
    q4 = cb.block_quantize(x, 4, 64)
    sp = cb.sign_pack(x, 4096)
    acc = torch.zeros_like(x)
    idx, vals = cb.topk_compact(x, k)
    out = torch.zeros_like(x)
    xi = x.view(torch.int32)
    f8 = cb.fp8_quantize(x, "e4m3", 128)
    mx4 = cb.mx_quantize(x, "fp4_e2m1")
    qs = cb.qsgd_quantize(x, 7, 512, 3)
    r = torch.randn(n, generator=torch.Generator(device=x.device).manual_seed(1), device=x.device)
    new_r = torch.empty_like(x)
    tscale = cb.block_absmax(x, 1 << 16).amax().reshape(1)
    E = ELEMENTWISE
    yield ("topk 1% + residual", "select", lambda: cb.topk_compact(x, k, res), 8 * n + 8 * k,
           lambda: same(cb.topk_compact(x, k, res), ref.topk_compact(x, k, torch.empty_like(x)), "topk"))
    yield ("  radix select only", "select", lambda: cb.radix_select_state(xi, k), 4 * n, None)
    yield ("topk 1%", "select", lambda: cb.topk_compact(x, k), 4 * n + 8 * k,
           lambda: same(cb.topk_compact(x, k), ref.topk_compact(x, k), "topk no residual"))
    yield ("threshold (1 host read)", "select", lambda: cb.threshold_compact(x, 2.5), 4 * n, None)
    yield ("blockquant 8b/256 compress", E, lambda: cb.block_quantize(x, 8, 256), 5 * n,
           lambda: same(q8, ref.block_quantize(x, 8, 256), "quantize 8"))
    yield ("blockquant 8b decode+acc", E, lambda: cb.block_dequantize(*q8, 8, 256, n, acc, True), 9 * n,
           lambda: same(cb.block_dequantize(*q8, 8, 256, n), ref.block_dequantize(*q8, 8, 256, n), "dq 8"))
    yield ("blockquant 4b/64 compress", E, lambda: cb.block_quantize(x, 4, 64), 4.5 * n,
           lambda: same(q4, ref.block_quantize(x, 4, 64), "quantize 4"))
    yield ("blockquant 4b decode", E, lambda: cb.block_dequantize(*q4, 4, 64, n, out), 4.5 * n, None)
    yield ("sign_pack chunk 4096", E, lambda: cb.sign_pack(x, 4096), 4 * n + n / 8,
           lambda: same(sp, ref.sign_pack(x, 4096), "sign_pack"))
    yield ("sign_pack one chunk", "reduce", lambda: cb.sign_pack(x, n), 4 * n + n / 8,
           lambda: same(cb.sign_pack(x, n), ref.sign_pack(x, n), "sign_pack n"))
    yield ("sign_unpack + acc", E, lambda: cb.sign_unpack(*sp, 4096, n, acc, True), 8 * n + n / 8, None)
    yield ("signsgd EF chunk 1024", E, lambda: cb.sign_pack_feedback(x, r, 0.9, 1024, new_r), 12 * n + n / 8,
           lambda: same(cb.sign_pack_feedback(x, r, 0.9, 1024, new_r)[:2] + (new_r.clone(),),
                        _feedback_ref(ref, x, r), "sign_pack_feedback"))
    yield ("fp8 e4m3/128 compress", E, lambda: cb.fp8_quantize(x, "e4m3", 128), 5 * n,
           lambda: same(f8, ref.fp8_quantize(x, "e4m3", 128), "fp8 e4m3"))
    yield ("fp8 e5m2 stochastic", E, lambda: cb.fp8_quantize(x, "e5m2", 128, True, 5), 5 * n,
           lambda: same(cb.fp8_quantize(x, "e5m2", 128, True, 5), ref.fp8_quantize(x, "e5m2", 128, True, 5),
                        "fp8 e5m2"))
    yield ("fp8 decode+acc", E, lambda: cb.fp8_dequantize(*f8, "e4m3", 128, n, acc, True), 9 * n,
           lambda: same(cb.fp8_dequantize(*f8, "e4m3", 128, n), ref.fp8_dequantize(*f8, "e4m3", 128, n), "fp8 dq"))
    yield ("mx fp8_e4m3 compress", E, lambda: cb.mx_quantize(x, "fp8_e4m3"), 5 * n,
           lambda: same(cb.mx_quantize(x, "fp8_e4m3"), ref.mx_quantize(x, "fp8_e4m3"), "mx fp8"))
    yield ("mx fp4_e2m1 compress", E, lambda: cb.mx_quantize(x, "fp4_e2m1"), 4.5 * n,
           lambda: same(mx4, ref.mx_quantize(x, "fp4_e2m1"), "mx fp4"))
    yield ("mx fp6 stochastic", E, lambda: cb.mx_quantize(x, "fp6_e2m3", True, 2), 4.75 * n,
           lambda: same(cb.mx_quantize(x, "fp6_e2m3", True, 2), ref.mx_quantize(x, "fp6_e2m3", True, 2), "mx fp6"))
    yield ("mx fp4 decode", E, lambda: cb.mx_dequantize(*mx4, "fp4_e2m1", n, out), 4.5 * n,
           lambda: same(cb.mx_dequantize(*mx4, "fp4_e2m1", n), ref.mx_dequantize(*mx4, "fp4_e2m1", n), "mx dq"))
    yield ("qsgd 7 levels/512 compress", E, lambda: cb.qsgd_quantize(x, 7, 512, 3), 4.5 * n,
           lambda: same(qs, ref.qsgd_quantize(x, 7, 512, 3), "qsgd"))
    yield ("qsgd decode+acc", E, lambda: cb.level_dequantize(*qs, 512, 7, n, acc, True), 8.5 * n,
           lambda: same(cb.level_dequantize(*qs, 512, 7, n), ref.level_dequantize(*qs, 512, 7, n), "qsgd dq"))
    yield ("terngrad codes", E, lambda: cb.level_quantize(x, tscale, n, 1, 4), 4.25 * n,
           lambda: same(cb.level_quantize(x, tscale, n, 1, 4), ref.level_quantize(x, tscale, n, 1, 4), "terngrad"))
    yield ("counter_uniform", E, lambda: cb.counter_uniform(1, 0, n, x.device), 4 * n, None)
    yield ("scatter_add_ 1%", "scatter", lambda: cb.scatter_add_(acc, idx, vals), 20 * k,
           lambda: same(cb.scatter_add_(torch.zeros_like(x), idx, vals),
                        ref.scatter_add_(torch.zeros_like(x), idx, vals), "scatter_add_"))
    yield ("hash_owner 1%, 2**32", "scatter", lambda: cb.hash_owner(idx, 2**32), 12 * k,
           lambda: same(cb.hash_owner(idx, 2**32), ref.hash_owner(idx, 2**32), "hash_owner"))


def _feedback_ref(ref, x, r):
    new_r = torch.empty_like(x, device="cpu")
    bits, scales, _ = ref.sign_pack_feedback(x, r, 0.9, 1024, new_r)
    return bits, scales, new_r


# Bytes one call of a kernel must move for n fp32 elements (top-k writing its residual, 8-bit codes).
KERNEL_BYTES = {"radix_hist": 4.0, "sel_count": 4.0, "sel_write_i32": 8.0, "block_absmax_kernel": 4.0,
                "block_quantize_kernel": 5.0, "block_dequantize_kernel": 9.0, "sign_bits_kernel": 4.125,
                "tree256_kernel": 4.0, "fp8_quantize_kernel": 5.0, "table_dequantize_kernel": 9.0,
                "level_quantize_kernel": 4.5, "feedback_sign_kernel": 12.125, "sign_residual_kernel": 8.0}


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
    ap.add_argument("--sizes", type=int, nargs="+", default=list(range(20, 27)),
                    help="log2 of the element counts (default 20..26)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--check-max", type=int, default=22,
                    help="check against the reference (on the host) at sizes up to 2**N (default 22)")
    ap.add_argument("--out", type=Path, default=Path("results/gpu-check/kernels.json"))
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: the host build of the kernels stands in for the GPU (small sizes)")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the per-kernel profile")
    args = ap.parse_args(argv)
    from benchmarks.gpu_common import setup, write_json
    from commpress.ops import cuda_backend as cb
    from commpress.ops import reference as ref

    env = setup(args.dry_run)
    warmup = 0 if args.dry_run else 2
    peak, source = env.hbm_peak_gbs()
    print(f"device {env.name}: HBM peak {peak:.0f} GB/s ({source})")
    rows = []
    gen = torch.Generator(device=env.device).manual_seed(0)
    for log2 in args.sizes:
        n = 1 << log2
        x = torch.randn(n, device=env.device, generator=gen)
        dst = torch.empty_like(x)
        t_copy = env.time_ms(lambda: dst.copy_(x), args.repeat)
        copy_gbs = 8 * n / t_copy / 1e6
        k = max(1, n // 100)
        t_torch_topk = env.time_ms(lambda: torch.topk(x.abs(), k, sorted=False), max(3, args.repeat // 4))
        print(f"\nn = 2**{log2} fp32: memcpy {t_copy:.3f} ms = {copy_gbs:.0f} GB/s "
              f"({100 * copy_gbs / peak:.0f}% of peak); torch.topk(|x|, 1%) {t_torch_topk:.3f} ms")
        print(f"{'op':30s} {'ms':>8s} {'GB/s':>7s} {'%peak':>6s} {'x memcpy':>9s}  notes")
        for name, kind, fn, nbytes, check in cases(cb, OnHost(ref), x):
            if check is not None and log2 <= args.check_max:
                check()
            t = env.time_ms(fn, args.repeat, warmup)
            gbs = nbytes / t / 1e6
            speedup = t_torch_topk / t if name.startswith("topk") else None
            note = f"{speedup:.1f}x faster than torch.topk" if speedup is not None else ""
            print(f"{name:30s} {t:8.3f} {gbs:7.0f} {100 * gbs / peak:5.0f}% {t / t_copy:8.2f}x  {note}")
            rows.append({"n": n, "log2": log2, "op": name.strip(), "kind": kind, "ms": t, "bytes": nbytes,
                         "gbs": gbs, "pct_peak": 100 * gbs / peak, "x_memcpy": t / t_copy,
                         "memcpy_gbs": copy_gbs, "torch_topk_ms": t_torch_topk if speedup else None,
                         "x_faster_than_torch_topk": speedup})
            if name in BREAKDOWN and log2 == max(args.sizes) and not args.dry_run and not args.no_breakdown:
                try:
                    kernel_breakdown(name, fn, n, peak)
                except Exception as exc:  # profiler without CUPTI: the op figures stand
                    print(f"  (per-kernel breakdown unavailable: {exc!r})")
    write_json(args.out, {"device": env.name, "dry_run": args.dry_run, "hbm_peak_gbs": peak,
                          "hbm_peak_source": source, "sizes": args.sizes, "rows": rows})
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
