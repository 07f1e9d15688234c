"""Compressor suite: compress/decompress time of every compressor as a ratio to memcpy
of the same tensor, compression ratio and relative error.
Compression goes through the public API (``ErrorFeedback`` where marked) in steady state (after
warm-up calls); decompression writes into one reused ``out`` buffer.  Every ratio is measured side
by side: each round times a memcpy (``copy_`` of the tensor) right before the call, so a shared
machine's load drift moves both, and the row reports that memcpy too.

``python -m benchmarks compressors [--numel N] [--repeat R] [--only NAME ...] [--threads T]
[--clock wall|thread] [--stat median|min]``; on a shared, loaded machine use one thread and its CPU
time: ``--threads 1 --clock thread --stat min``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import time
from typing import Any, Callable

import torch

import commpress

from .common import markdown_table, results_dir, steady_params, write_results

# (label, registry name, params, with error feedback)
SUITE: list[tuple[str, str, dict[str, Any], bool]] = [
    ("identity", "identity", {}, False),
    ("fp16", "fp16", {}, False),
    ("fp16 + EF", "fp16", {}, True),
    ("bf16", "bf16", {}, False),
    ("bf16 + EF", "bf16", {}, True),   # "auto" runs bf16 so (every choice under error feedback)
    ("topk 1%", "topk", {"ratio": 0.01}, False),
    ("topk 1% + EF", "topk", {"ratio": 0.01}, True),
    ("randomk 1%", "randomk", {"ratio": 0.01}, False),
    ("threshold", "threshold", {"threshold": 2.576}, False),  # ~1% of a unit normal
    ("dgc 1%", "dgc", {"ratio": 0.01}, False),
    ("dgc 1% + EF", "dgc", {"ratio": 0.01}, True),
    ("qsgd 7 levels, bucket 512", "qsgd", {"levels": 7, "bucket": 512}, False),
    ("qsgd 7 levels, bucket 512 + EF", "qsgd", {"levels": 7, "bucket": 512}, True),
    ("terngrad", "terngrad", {}, False),
    ("terngrad + EF", "terngrad", {}, True),
    ("signsgd", "signsgd", {"chunk": 1024}, False),
    ("signsgd + EF", "signsgd", {"chunk": 1024}, True),
    ("blockquant 8b", "blockquant", {"bits": 8}, False),
    ("blockquant 4b", "blockquant", {"bits": 4}, False),
    ("blockquant 4b stoch", "blockquant", {"bits": 4, "stochastic": True}, False),
    ("blockquant 2b", "blockquant", {"bits": 2}, False),
    ("powersgd r4", "powersgd", {"rank": 4}, False),
    ("fp8 e4m3", "fp8", {"format": "e4m3"}, False),
    ("fp8 e5m2 stoch", "fp8", {"format": "e5m2", "stochastic": True}, False),
    ("mx fp8", "mx", {"element": "fp8_e4m3"}, False),
    ("mx fp6", "mx", {"element": "fp6_e2m3"}, False),
    ("mx fp4", "mx", {"element": "fp4_e2m1"}, False),
    ("mx fp4 + EF", "mx", {"element": "fp4_e2m1"}, True),
]


def matrix_shape(numel: int) -> tuple[int, ...]:
    """``(rows, cols)`` with rows the largest divisor <= sqrt(numel) (so PowerSGD has a matrix)."""
    rows = math.isqrt(numel)
    while rows > 1 and numel % rows:
        rows -= 1
    return (rows, numel // rows)


def _clock(name: str) -> Callable[[], float]:
    return {"thread": time.thread_time, "cpu": time.process_time}.get(name, time.perf_counter)


def side_by_side(fn: Callable[[], Any], memcpy: Callable[[], Any], repeat: int, clock: str = "wall",
                 stat: str = "median") -> tuple[float, float]:
    """``(fn seconds, memcpy seconds)``: ``stat`` over ``repeat`` rounds of a memcpy then ``fn``
    (after one warm-up of each), so that a shared machine's load moves both alike."""
    now = _clock(clock)
    reduce = min if stat == "min" else statistics.median
    memcpy()
    fn()
    t_fn, t_mc = [], []
    for _ in range(repeat):
        t0 = now()
        memcpy()
        t1 = now()
        fn()
        t2 = now()
        t_mc.append(t1 - t0)
        t_fn.append(t2 - t1)
    return reduce(t_fn), reduce(t_mc)


def measure(label: str, name: str, params: dict, ef: bool, x: torch.Tensor, repeat: int,
            clock: str = "wall", stat: str = "median") -> dict[str, Any]:
    inner = commpress.get(name, **steady_params(name, params))
    c = commpress.ErrorFeedback(inner) if ef else inner
    steps = itertools.count()
    gen = torch.Generator().manual_seed(0)
    dst = torch.empty_like(x)

    def compress():
        return c.compress(x, step=next(steps), key="bench", generator=gen)

    def memcpy():
        dst.copy_(x)

    compress()  # warm-up: error feedback allocates its residual and pending buffers here
    t_c, mc_c = side_by_side(compress, memcpy, repeat, clock, stat)
    payload = compress()
    out = torch.empty_like(x)  # decode into a reused buffer, as the collectives do
    t_d, mc_d = side_by_side(lambda: c.decompress(payload, out=out), memcpy, repeat, clock, stat)
    y = c.decompress(payload)
    err = ((y.float() - x.float()).norm() / x.float().norm()).item()
    return {
        "compressor": label, "name": name, "params": params, "error_feedback": ef,
        "compress_x_memcpy": t_c / mc_c, "decompress_x_memcpy": t_d / mc_d,
        "compress_ms": 1e3 * t_c, "decompress_ms": 1e3 * t_d, "memcpy_ms": 1e3 * mc_c,
        "nbytes": payload.nbytes, "ratio": payload.dense_nbytes / payload.nbytes,
        "rel_error": err,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks compressors", description=__doc__)
    ap.add_argument("--numel", type=int, default=2**24, help="tensor size (default 2**24)")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds per measurement")
    ap.add_argument("--only", nargs="*", default=None, help="registry names to run (default all)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch (and numba) threads (default: torch's own default)")
    ap.add_argument("--clock", choices=["wall", "thread", "cpu"], default="wall",
                    help="wall time (default), this thread's or the process's CPU time")
    ap.add_argument("--stat", choices=["median", "min"], default="median",
                    help="statistic of the rounds (default median; min is robust on a loaded machine)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results", help="results root folder")
    args = ap.parse_args(argv)
    if args.numel < 1 or args.repeat < 1 or (args.threads is not None and args.threads < 1):
        ap.error("--numel, --repeat and --threads must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)  # the numba kernels follow torch's thread count

    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(matrix_shape(args.numel), generator=g)
    rows = []
    for label, name, params, ef in SUITE:
        if args.only and name not in args.only:
            continue
        rows.append(measure(label, name, params, ef, x, args.repeat, args.clock, args.stat))
        print(f"{label}: {rows[-1]['compress_x_memcpy']:.3g}x memcpy", flush=True)
    memcpy = statistics.median(r["memcpy_ms"] for r in rows) / 1e3 if rows else 0.0
    meta = {"numel": args.numel, "shape": list(x.shape), "memcpy_seconds": memcpy,
            "repeat": args.repeat, "threads": torch.get_num_threads(), "clock": args.clock, "stat": args.stat,
            "backends": commpress.ops.available_backends(), "load": os.getloadavg()[0]}
    cols = ["compressor", "compress_x_memcpy", "decompress_x_memcpy", "compress_ms",
            "decompress_ms", "memcpy_ms", "ratio", "rel_error"]
    print(f"\nnumel={args.numel} shape={tuple(x.shape)} memcpy={1e3 * memcpy:.3f} ms (median of the rows) "
          f"threads={torch.get_num_threads()} clock={args.clock} stat={args.stat} backends={meta['backends']}\n")
    print(markdown_table(rows, cols))
    path = results_dir("compressors", args.out)
    write_results(path, rows, meta)
    print(f"\nresults: {path}/results.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
