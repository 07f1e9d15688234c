"""The quantized ``"gather_all"`` allreduce in one message against pipelined (one message per chunk).

``python -m benchmarks pipeline --net 1gbit --numels 300000 1130000``: 2 ranks (one core
each), blockquant with error feedback and a riding dense part, the hook's call
(``algorithm="auto"``, ``out=`` the input).  Between calls each rank spins for
``--compute-ms`` (a training step's compute: the link's token bucket drains, as after a
backward).  The two modes alternate in the same processes, three rounds each; a row is a mode's
median call over the rounds' medians.  The library pipelines when the calibrated model puts a
chunk's message at :data:`commpress.collectives.quantized.PIPELINE_MIN_WIRE_S` or more on the
wire; this suite forces each mode (the threshold at 0 or infinity) to show where that pays.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Any, Callable

from .common import markdown_table, results_dir, write_results

MODES = ("one message", "pipelined")


def rank_main(rank: int, world_size: int, *, report: Callable[[dict], None] | None = None, numel: int,
              steps: int, compute_ms: float, bits: int, rounds: int = 3) -> dict[str, list[float]]:
    import torch

    import commpress
    from commpress.collectives import CommStats, allreduce
    from commpress.collectives import quantized
    from commpress.feedback import ResidualTransaction

    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    d = torch.randn(3000, generator=torch.Generator().manual_seed(100 + rank))
    medians: dict[str, list[float]] = {m: [] for m in MODES}
    rounds_of: dict[str, int] = {}
    for _ in range(rounds):
        for mode in MODES:
            quantized.PIPELINE_MIN_WIRE_S = 0.0 if mode == "pipelined" else math.inf
            ef = commpress.ErrorFeedback(commpress.get("blockquant", bits=bits))
            times = []
            for step in range(steps):
                t, dense = x.clone(), d.clone()
                until = time.perf_counter() + compute_ms / 1e3
                while time.perf_counter() < until:   # the step's compute, on this rank's core
                    pass
                tx, stats = ResidualTransaction(), CommStats()
                t0 = time.perf_counter()
                allreduce(t, ef, key="unit", step=step, validate=False, transaction=tx, out=t, dense=dense,
                          stats=stats)
                tx.commit()
                times.append(time.perf_counter() - t0)
                rounds_of[mode] = stats.rounds
            medians[mode].append(statistics.median(times[3:]))   # the first calls warm the caches
    return {"medians": medians, "rounds": rounds_of}


def run_suite(numels: list[int], *, net: str | None, steps: int = 40, compute_ms: float = 10.0,
              bits: int = 4) -> list[dict[str, Any]]:
    from .netem import launch

    rows = []
    for n in numels:
        res = launch("benchmarks.pipeline:rank_main", 2, net=net, pin=True,
                     kwargs=dict(numel=n, steps=steps, compute_ms=compute_ms, bits=bits))
        one = None
        for mode in MODES:
            per_round = [max(r["medians"][mode][i] for r in res) for i in range(len(res[0]["medians"][mode]))]
            ms = statistics.median(per_round) * 1e3
            one = ms if one is None else one
            rows.append({"numel": n, "mode": mode, "call_ms": round(ms, 2),
                         "rounds_ms": " / ".join(f"{v * 1e3:.1f}" for v in per_round),
                         "collective_rounds": res[0]["rounds"][mode], "vs_one_message": round(ms / one, 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks pipeline", description=__doc__.split("\n")[0])
    p.add_argument("--net", default="1gbit", help="emulated link RATE[,DELAY] (benchmarks.netem), or 'loopback'")
    p.add_argument("--numels", type=int, nargs="+", default=[300_000, 1_130_000, 4_520_000])
    p.add_argument("--steps", type=int, default=40, help="calls per mode and round")
    p.add_argument("--compute-ms", type=float, default=10.0, help="spin between calls (a step's compute)")
    p.add_argument("--bits", type=int, default=4, choices=(2, 4, 8))
    p.add_argument("--out", default="results", help="results root folder")
    args = p.parse_args(argv)
    net = None if args.net == "loopback" else args.net
    t0 = time.time()
    rows = run_suite(args.numels, net=net, steps=args.steps, compute_ms=args.compute_ms, bits=args.bits)
    out = results_dir("pipeline", args.out)
    write_results(out, rows, {"suite": "pipeline", "argv": argv, "net": args.net, "wall_seconds": time.time() - t0})
    table = markdown_table(rows, ["numel", "mode", "call_ms", "rounds_ms", "collective_rounds", "vs_one_message"])
    (out / "table.md").write_text(table + "\n")
    print(table)
    print(f"results: {out}")
    return 0
