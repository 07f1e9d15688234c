"""Kernel suite: each hot op per backend, as a ratio to memcpy and to the torch reference.

``python -m benchmarks kernels`` (defaults: 2**24 fp32 elements, 2 threads, CPU
backends).  ``ef_*_compress_fixed`` time the public error-feedback path
(``ErrorFeedback(topk|dgc 1%|blockquant).compress_fixed``, what a hook calls) rather than one
op, and ``blockquant*_decode_sum_2`` the receive side of a gather allreduce at 2 ranks (decode two
payloads and sum them in rank order), alternating with the memcpy (best of ``--repeat`` each).
On a shared machine use one thread and CPU time, e.g.
``python -m benchmarks kernels --ops ef_topk_1pct_compress_fixed --threads 1 --clock cpu --repeat 7``.  Every ratio is measured in the same run: a memcpy (``copy_`` of the
tensor) is timed right before each op, so load drift on a shared machine moves
both.  Writes ``results/kernels-<stamp>/results.{json,csv}`` and prints a
markdown table.  ``--device cuda`` times the CUDA backend against torch on the GPU.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from typing import Any, Callable

import torch

import commpress.ops as ops
from benchmarks.common import markdown_table, results_dir, write_results

BLOCK = 256
SIGN_CHUNK = 1 << 14

#: op name -> (the project's target ratio to memcpy, description).
TARGETS = {
    "topk_1pct_residual": (3.0, "<= 3x memcpy and >= 10x faster than torch.topk baseline"),
    "ef_topk_1pct_compress_fixed": (2.0, "<= 2x memcpy (public API: ErrorFeedback(topk).compress_fixed)"),
    "dgc_threshold_1pct_residual": (2.0, "<= 2x memcpy"),
    "blockquant8_compress": (1.5, "<= 1.5x memcpy"),
    "blockquant4_compress": (1.5, "<= 1.5x memcpy"),
    "blockquant8_decode_accumulate": (1.5, "<= 1.5x memcpy"),
    "blockquant4_decode_accumulate": (1.5, "<= 1.5x memcpy"),
    "ef_blockquant4_compress_fixed": (3.0, "<= 3x memcpy (public API: ErrorFeedback(blockquant 4).compress_fixed)"),
    "blockquant4_decode_sum_2": (3.0, "<= 3x memcpy (decode 2 payloads + sum, public API)"),
}
#: ops on the public path (Python around the kernels): timed alternating with the memcpy.
PUBLIC = ("ef_", "blockquant4_decode_sum", "blockquant8_decode_sum")


def _timer(device: torch.device, repeat: int, warmup: int, stat: str = "min",
           clock: str = "wall") -> Callable[[Callable[[], Any]], float]:
    """Timer of a callable: ``stat`` (min or median) of ``repeat`` times after ``warmup`` calls.

    ``clock="cpu"`` measures process CPU time: with one thread it is the op's
    cost without the time it spent waiting for a core on a loaded machine.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    reduce = min if stat == "min" else statistics.median
    now = {"cpu": time.process_time, "thread": time.thread_time}.get(clock, time.perf_counter)

    def run(fn: Callable[[], Any]) -> float:
        for _ in range(warmup):
            fn()
        sync()
        times = []
        for _ in range(repeat):
            t0 = now()
            fn()
            sync()
            times.append(now() - t0)
        return reduce(times)

    return run


def _forced(backend: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run with ``COMMPRESS_BACKEND=backend`` (the public paths pick their ops' backend)."""

    def run():
        before = os.environ.get("COMMPRESS_BACKEND")
        os.environ["COMMPRESS_BACKEND"] = backend
        try:
            return fn()
        finally:
            if before is None:
                del os.environ["COMMPRESS_BACKEND"]
            else:
                os.environ["COMMPRESS_BACKEND"] = before

    return run


def _ef_compress_fixed(x: torch.Tensor, name: str, ratio: float | None = None,
                       **params: Any) -> Callable[[str], Callable[[], Any]]:
    """backend -> one ``ErrorFeedback(get(name, ratio=ratio, **params)).compress_fixed(x)`` in
    steady state: the public path a hook takes (compensate with the residual, encode, write the
    next residual, verdict).  The backend is forced with ``COMMPRESS_BACKEND`` for the call; each
    backend gets its own ErrorFeedback, primed by one call so that a residual exists."""
    import commpress
    from benchmarks.common import steady_params

    if ratio is not None:
        params = {"ratio": ratio, **params}

    def make(backend: str) -> Callable[[], Any]:
        ef = commpress.ErrorFeedback(commpress.get(name, **steady_params(name, params)))
        step = iter(range(1 << 62))
        run = _forced(backend, lambda: ef.compress_fixed(x, step=next(step), key="bench"))
        run()
        return run

    return make


def _decode_sum(x: torch.Tensor, bits: int, world: int = 2) -> Callable[[str], Callable[[], Any]]:
    """backend -> the receive side of a gather allreduce at ``world`` ranks on the public path:
    ``world`` blockquant payloads of ``x``'s size decoded and summed in rank order into one buffer
    (``decompress_sum`` where the compressor has it, else ``decompress`` then ``decompress_add``,
    as ``collectives/quantized.py`` does)."""
    import commpress

    bq = commpress.get("blockquant", bits=bits, block=BLOCK)
    g = torch.Generator().manual_seed(3)
    payloads = [bq.compress_fixed(x * float(torch.rand((), generator=g)) - 0.1 * s) for s in range(world)]
    out = torch.empty_like(x)

    def once():
        if hasattr(bq, "decompress_sum"):
            return bq.decompress_sum(payloads, out)
        bq.decompress(payloads[0], out=out)
        for p in payloads[1:]:
            bq.decompress_add(p, out)
        return out

    return lambda backend: _forced(backend, once)


def _interleaved(fn: Callable[[], Any], memcpy: Callable[[], Any], repeat: int, clock: str) -> tuple[float, float]:
    """``(best time of fn, best time of memcpy)`` over ``repeat`` rounds of memcpy then ``fn``
    (after one warm-up of each), so that a shared machine's load moves both alike."""
    now = {"cpu": time.process_time, "thread": time.thread_time}.get(clock, time.perf_counter)
    memcpy()
    fn()
    best_fn = best_mc = math.inf
    for _ in range(repeat):
        t0 = now()
        memcpy()
        t1 = now()
        fn()
        t2 = now()
        best_mc, best_fn = min(best_mc, t1 - t0), min(best_fn, t2 - t1)
    return best_fn, best_mc


def _cases(x: torch.Tensor, k: int) -> dict[str, Callable[[str], Callable[[], Any]]]:
    """op name -> (backend -> zero-argument callable doing one op)."""
    n = x.numel()
    res = torch.empty_like(x)
    acc = torch.zeros_like(x)
    packed8, scales8 = ops.block_quantize(x, 8, BLOCK, backend="torch")
    packed4, scales4 = ops.block_quantize(x, 4, BLOCK, backend="torch")
    bits, sscales = ops.sign_pack(x, SIGN_CHUNK, backend="torch")
    g = torch.Generator().manual_seed(0)
    idx = torch.randperm(n, generator=g)[:k].sort().values.to(x.device)
    vals = torch.randn(k, generator=g).to(x.device)
    stride = max(1, n // (1 << 16))

    def dgc_threshold() -> float:
        # DGC: the k-th largest |x| of a strided sample scaled to the sample size.
        sample = x[::stride].abs()
        kk = max(1, int(sample.numel() * k / n))
        return float(torch.topk(sample, kk).values[-1])

    return {
        "topk_1pct_residual": lambda b: lambda: ops.topk_compact(x, k, res, backend=b),
        "dgc_threshold_1pct_residual": lambda b: lambda: ops.threshold_compact(x, dgc_threshold(), res, backend=b),
        "ef_topk_1pct_compress_fixed": _ef_compress_fixed(x, "topk", 0.01),
        "ef_dgc_1pct_compress_fixed": _ef_compress_fixed(x, "dgc", 0.01),
        "ef_blockquant4_compress_fixed": _ef_compress_fixed(x, "blockquant", bits=4, block=BLOCK),
        "ef_blockquant8_compress_fixed": _ef_compress_fixed(x, "blockquant", bits=8, block=BLOCK),
        "blockquant4_decode_sum_2": _decode_sum(x, 4),
        "blockquant8_decode_sum_2": _decode_sum(x, 8),
        "threshold_1pct_no_residual": lambda b: lambda: ops.threshold_compact(x, 2.576, backend=b),
        "blockquant8_compress": lambda b: lambda: ops.block_quantize(x, 8, BLOCK, backend=b),
        "blockquant4_compress": lambda b: lambda: ops.block_quantize(x, 4, BLOCK, backend=b),
        "blockquant8_stochastic_compress": lambda b: lambda: ops.block_quantize(x, 8, BLOCK, True, 7, backend=b),
        "blockquant8_decode_accumulate":
            lambda b: lambda: ops.block_dequantize(packed8, scales8, 8, BLOCK, n, acc, True, backend=b),
        "blockquant4_decode_accumulate":
            lambda b: lambda: ops.block_dequantize(packed4, scales4, 4, BLOCK, n, acc, True, backend=b),
        "sign_pack": lambda b: lambda: ops.sign_pack(x, SIGN_CHUNK, backend=b),
        "sign_unpack_accumulate": lambda b: lambda: ops.sign_unpack(bits, sscales, SIGN_CHUNK, n, acc, True, backend=b),
        "scatter_add_1pct": lambda b: lambda: ops.scatter_add_(acc, idx, vals, backend=b),
        "bitmap_encode_1pct": lambda b: lambda: ops.bitmap_encode(idx, n, backend=b),
        "hash_partition_1pct_4": lambda b: lambda: ops.hash_partition(idx, 4, backend=b),
    }


def _topk_baseline(x: torch.Tensor, k: int) -> Callable[[], Any]:
    """The baseline: torch.topk on abs(), gather, residual update in torch."""
    res = torch.empty_like(x)

    def run():
        i = torch.topk(x.abs(), k, sorted=False).indices
        v = x[i]
        res.copy_(x)
        res[i] = 0
        return i, v

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks kernels", description=__doc__)
    ap.add_argument("--numel", type=int, default=1 << 24, help="tensor size (default 2**24)")
    ap.add_argument("--threads", type=int, default=2, help="torch and numba threads (default 2)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--backends", default=None,
                    help="comma list (default: numba on cpu, cuda on cuda) - torch always runs")
    ap.add_argument("--ops", default=None, help="comma list of op names (default: all)")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per fast op (median)")
    ap.add_argument("--ref-repeat", type=int, default=1, help="timed runs of the torch reference")
    ap.add_argument("--stat", choices=["min", "median"], default="min",
                    help="statistic of the repeats (default min: robust on a shared, loaded machine)")
    ap.add_argument("--clock", choices=["wall", "cpu", "thread"], default="wall",
                    help="wall time (default), process CPU time or this thread's CPU time (use with "
                         "--threads 1 on a loaded machine)")
    ap.add_argument("--out", default="results", help="results root folder")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)  # the numba kernels follow torch's thread count
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    default = "numba" if device.type == "cpu" else "cuda"
    backends = [b for b in (args.backends or default).split(",") if b and b != "torch"]
    missing = [b for b in backends if b not in ops.available_backends()]
    if missing:
        print(f"backends not available: {missing} (have {ops.available_backends()})")
        return 1

    n = args.numel
    k = max(1, n // 100)
    x = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(device)
    if args.clock != "wall" and device.type == "cuda":
        ap.error("--clock cpu is for CPU backends")
    fast = _timer(device, args.repeat, 1, args.stat, args.clock)
    slow = _timer(device, args.ref_repeat, 0 if device.type == "cpu" else 1, args.stat, args.clock)
    base_timer = _timer(device, max(3, args.ref_repeat), 1, args.stat, args.clock)
    dst = torch.empty_like(x)

    def memcpy() -> float:
        return fast(lambda: dst.copy_(x))

    # warm up (numba compiles here, cached on disk after the first run)
    t0 = time.perf_counter()
    cases = _cases(x, k)
    selected = args.ops.split(",") if args.ops else list(cases)
    unsupported = set()
    for name in selected:
        for b in backends:
            try:
                cases[name](b)()
            except NotImplementedError:  # the backend lacks this op
                unsupported.add((name, b))
    warmup_s = time.perf_counter() - t0

    rows: list[dict[str, Any]] = []
    load = os.getloadavg()[0]
    t_base = None
    for name in selected:
        if name == "topk_1pct_residual":  # the baseline, timed next to the op it rates
            mc = memcpy()
            t_base = base_timer(_topk_baseline(x, k))
            rows.append({"op": "torch_topk_abs_gather_residual", "backend": "torch (baseline)",
                         "ms": t_base * 1e3, "memcpy_ms": mc * 1e3, "x_memcpy": t_base / mc})
        mc = memcpy()
        t_ref = slow(cases[name]("torch"))
        rows.append({"op": name, "backend": "torch", "ms": t_ref * 1e3, "memcpy_ms": mc * 1e3,
                     "x_memcpy": t_ref / mc, "speedup_vs_torch": 1.0})
        for b in backends:
            if (name, b) in unsupported:
                continue
            if name.startswith(PUBLIC):  # memcpy and the op alternate, best of each: load drift hits both
                t, mc = _interleaved(cases[name](b), lambda: dst.copy_(x), args.repeat, args.clock)
            else:
                mc = memcpy()
                t = fast(cases[name](b))
            row = {"op": name, "backend": b, "ms": t * 1e3, "memcpy_ms": mc * 1e3,
                   "x_memcpy": t / mc, "speedup_vs_torch": t_ref / t}
            if name == "topk_1pct_residual" and t_base is not None:
                row["speedup_vs_baseline"] = t_base / t
            if name in TARGETS:
                limit, text = TARGETS[name]
                ok = t / mc <= limit and (name != "topk_1pct_residual" or t_base / t >= 10)
                row["target"] = text
                row["met"] = "yes" if ok else "no"
            rows.append(row)

    meta = {"numel": n, "k": k, "threads": args.threads, "device": str(device), "block": BLOCK,
            "sign_chunk": SIGN_CHUNK, "repeat": args.repeat, "ref_repeat": args.ref_repeat, "stat": args.stat, "clock": args.clock,
            "loadavg_1min_start": load, "loadavg_1min_end": os.getloadavg()[0],
            "warmup_s": warmup_s, "argv": argv}
    out = results_dir("kernels", root=args.out)
    write_results(out, rows, meta)
    cols = ["op", "backend", "ms", "x_memcpy", "speedup_vs_torch", "speedup_vs_baseline", "met"]
    print(f"kernels: n={n} fp32, {args.threads} threads, device={device}, {args.stat} of {args.repeat} ({args.clock} clock), "
          f"load {load:.1f} -> {os.getloadavg()[0]:.1f}, warm-up {warmup_s:.1f}s")
    print(markdown_table(rows, cols))
    print(f"results: {out}")
    if not math.isfinite(sum(r["ms"] for r in rows)):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
