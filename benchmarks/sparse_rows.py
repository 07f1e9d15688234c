"""Bytes (and loopback time) of the lossless row-sparse sum against a dense all_reduce.

``python -m benchmarks.sparse_rows`` (about a minute on 2 cores): an embedding gradient of
``--rows`` x ``--dim`` fp32 with 1% and 5% of its rows touched per rank, on P = 2, 3, 4 gloo
ranks (one torch thread each; P > cores is oversubscribed: times are then the machine's, not the
network's).  Two ways of touching rows: ``"independent"`` (each rank draws its rows uniformly:
little overlap) and ``"shared"`` (80% of a rank's rows are the same hot rows on every rank, as
frequent tokens are; 20% its own).

Per case: the capacities a :class:`~commpress.hooks.sparse_rows.SparseRows` plan would hold after a
step (rows seen, 10% headroom, its ladder), then one call of each algorithm with the facts already
agreed: bytes this rank sent (:mod:`commpress.collectives.accounting`'s convention, rank 0), rounds,
median wall ms of ``--calls`` calls, and the algorithm ``"auto"`` picks (calibrated model).  The
dense all_reduce of the same gradient is charged as a ring (``2 n (P-1)/P``) and timed alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def _grad(rank: int, rows: int, dim: int, frac: float, mode: str, seed: int):
    import torch

    g = torch.Generator().manual_seed(1000 * seed + rank)
    k = max(1, int(frac * rows))
    if mode == "independent":
        touched = torch.randperm(rows, generator=g)[:k]
    else:   # frequent rows (tokens) shared: the same hot 80% on every rank, 20% of the rank's own
        hot = torch.arange(0, rows, rows // k)[: (4 * k) // 5]
        own = torch.randperm(rows, generator=g)
        own = own[~torch.isin(own, hot)][: k - hot.numel()]
        touched = torch.cat([hot, own])
    x = torch.zeros(rows, dim)
    x[touched] = torch.randn(touched.numel(), dim, generator=g)
    return x


def _rank(rank: int, world: int, store: str, args, results) -> None:
    import torch
    import torch.distributed as dist

    from commpress.collectives import CommStats, rows_allreduce
    from commpress.hooks.sparse_rows import capacity_ladder

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    out = []
    for frac in args.fracs:
        for mode in ("independent", "shared"):
            x = _grad(rank, args.rows, args.dim, frac, mode, 0)
            # learn the sizes as a plan would: the counts (a count round, then exact sizes), then
            # each owner's summed rows (every row reaches its owner; the summed rows overflow)
            first = rows_allreduce(x, algorithm="allgather", key=("learn", frac, mode))
            per_owner = max(max(r) for r in first.owner_counts)
            owners = rows_allreduce(x, algorithm="hashed", owner_capacity=per_owner, union_capacity=0,
                                    key=("learn-owners", frac, mode))
            room = 1.1
            caps = {"capacity": capacity_ladder(max(first.counts) * room),
                    "owner_capacity": capacity_ladder(per_owner * room),
                    "union_capacity": capacity_ladder(max(owners.owner_unions) * room)}
            row = {"P": world, "frac": frac, "mode": mode, "counts": first.counts,
                   "union": int(first.union), **caps}
            for algorithm in ("allgather", "hashed", "auto"):
                key = ("bench", frac, mode, algorithm)
                res = rows_allreduce(x, algorithm=algorithm, key=key, **caps)   # agrees the facts
                stats = CommStats()
                rows_allreduce(x, algorithm=algorithm, key=key, stats=stats, **caps)
                walls = []
                for _ in range(args.calls):
                    dist.barrier()
                    t0 = time.perf_counter()
                    rows_allreduce(x, algorithm=algorithm, key=key, **caps)
                    walls.append(time.perf_counter() - t0)
                row[algorithm] = {"bytes_sent": stats.bytes_sent, "rounds": stats.rounds,
                                  "overflow": res.overflow_rounds, "ms": 1e3 * statistics.median(walls),
                                  "chose": res.algorithm}
            walls = []
            for _ in range(args.calls):
                d = x.clone()
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(d)
                walls.append(time.perf_counter() - t0)
            n = args.rows * args.dim * 4
            row["dense"] = {"bytes_sent": 2 * n * (world - 1) // world, "rounds": 1,
                            "ms": 1e3 * statistics.median(walls)}
            row["touched_bytes"] = max(first.counts) * (args.dim * 4 + 4)
            out.append(row)
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def run(world: int, args) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, world, os.path.join(tmp, "store"), args, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        rows = results.get(timeout=600)
        for p in procs:
            p.join(60)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| P | rows touched | overlap | union / max k | dense KB | allgather KB | hashed KB | auto | "
             "auto / touched rows | dense ms | allgather ms | hashed ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        auto = r["auto"]
        lines.append(
            f"| {r['P']} | {100 * r['frac']:.0f}% | {r['mode']} | {r['union'] / max(max(r['counts']), 1):.2f} | "
            f"{r['dense']['bytes_sent'] / 1e3:.0f} | {r['allgather']['bytes_sent'] / 1e3:.0f} | "
            f"{r['hashed']['bytes_sent'] / 1e3:.0f} | {auto['chose']} | "
            f"{auto['bytes_sent'] / ((r['P'] - 1) * r['touched_bytes']):.2f} | {r['dense']['ms']:.2f} | "
            f"{r['allgather']['ms']:.2f} | {r['hashed']['ms']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sparse_rows", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=50_000, help="embedding rows (default 50000)")
    p.add_argument("--dim", type=int, default=64, help="embedding dimension (default 64)")
    p.add_argument("--fracs", type=float, nargs="+", default=[0.01, 0.05], help="fractions of rows touched")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4], help="ranks (default 2 3 4)")
    p.add_argument("--calls", type=int, default=10, help="timed calls per algorithm (default 10)")
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args(argv)
    rows = [row for world in args.worlds for row in run(world, args)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
