"""Compressor suite: compress/decompress time of every compressor as a ratio to memcpy
of the same tensor (measured in the same run), compression ratio and relative error.
Compression goes through the public API (``ErrorFeedback`` where marked); decompression
writes into one reused ``out`` buffer.

``python -m benchmarks compressors [--numel N] [--repeat R] [--only NAME ...]``
"""

from __future__ import annotations

import argparse
import itertools
import math
from typing import Any

import torch

import commpress

from .common import markdown_table, memcpy_seconds, results_dir, steady_params, time_call, write_results

# (label, registry name, params, with error feedback)
SUITE: list[tuple[str, str, dict[str, Any], bool]] = [
    ("identity", "identity", {}, False),
    ("fp16", "fp16", {}, False),
    ("bf16", "bf16", {}, False),
    ("topk 1%", "topk", {"ratio": 0.01}, False),
    ("topk 1% + EF", "topk", {"ratio": 0.01}, True),
    ("randomk 1%", "randomk", {"ratio": 0.01}, False),
    ("threshold", "threshold", {"threshold": 2.576}, False),  # ~1% of a unit normal
    ("dgc 1%", "dgc", {"ratio": 0.01}, False),
    ("dgc 1% + EF", "dgc", {"ratio": 0.01}, True),
    ("qsgd 7 levels, bucket 512", "qsgd", {"levels": 7, "bucket": 512}, False),
    ("terngrad", "terngrad", {}, False),
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


def measure(label: str, name: str, params: dict, ef: bool, x: torch.Tensor, memcpy: float,
            repeat: int) -> dict[str, Any]:
    inner = commpress.get(name, **steady_params(name, params))
    c = commpress.ErrorFeedback(inner) if ef else inner
    steps = itertools.count()
    gen = torch.Generator().manual_seed(0)

    def compress():
        return c.compress(x, step=next(steps), key="bench", generator=gen)

    payload = compress()
    t_c = time_call(compress, repeat=repeat, warmup=0)
    payload = compress()
    out = torch.empty_like(x)  # decode into a reused buffer, as the collectives do
    t_d = time_call(lambda: c.decompress(payload, out=out), repeat=repeat)
    y = c.decompress(payload)
    err = ((y.float() - x.float()).norm() / x.float().norm()).item()
    return {
        "compressor": label, "name": name, "params": params, "error_feedback": ef,
        "compress_x_memcpy": t_c / memcpy, "decompress_x_memcpy": t_d / memcpy,
        "compress_ms": 1e3 * t_c, "decompress_ms": 1e3 * t_d,
        "nbytes": payload.nbytes, "ratio": payload.dense_nbytes / payload.nbytes,
        "rel_error": err,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks compressors", description=__doc__)
    ap.add_argument("--numel", type=int, default=2**24, help="tensor size (default 2**24)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per measurement (median)")
    ap.add_argument("--only", nargs="*", default=None, help="registry names to run (default all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results", help="results root folder")
    args = ap.parse_args(argv)
    if args.numel < 1 or args.repeat < 1:
        ap.error("--numel and --repeat must be >= 1")

    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(matrix_shape(args.numel), generator=g)
    memcpy = memcpy_seconds(x, repeat=max(5, args.repeat))
    rows = []
    for label, name, params, ef in SUITE:
        if args.only and name not in args.only:
            continue
        rows.append(measure(label, name, params, ef, x, memcpy, args.repeat))
        print(f"{label}: {rows[-1]['compress_x_memcpy']:.3g}x memcpy", flush=True)
    meta = {"numel": args.numel, "shape": list(x.shape), "memcpy_seconds": memcpy,
            "repeat": args.repeat, "backends": commpress.ops.available_backends()}
    cols = ["compressor", "compress_x_memcpy", "decompress_x_memcpy", "compress_ms",
            "decompress_ms", "ratio", "rel_error"]
    print(f"\nnumel={args.numel} shape={tuple(x.shape)} memcpy={1e3 * memcpy:.3f} ms "
          f"threads={torch.get_num_threads()} backends={meta['backends']}\n")
    print(markdown_table(rows, cols))
    path = results_dir("compressors", args.out)
    write_results(path, rows, meta)
    print(f"\nresults: {path}/results.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
