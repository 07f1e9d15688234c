"""Sparse allreduce algorithms against dense all_reduce, measured side by side in one run.

``python -m benchmarks collectives [--quick] [--world-sizes 2 4] [--net RATE[,DELAY]]``
``python -m benchmarks collectives --topology 2x2 --net 1gbit [--numels ...]``

For every configuration (numel, density, overlap of the ranks' supports) every
rank process runs every algorithm of :data:`commpress.collectives.SPARSE_ALGORITHMS`,
``"auto"`` and a plain ``dist.all_reduce`` of the dense fp32 tensor (the
baseline), interleaved, ``--repeat`` times after a warm-up.  A call's time is the
slowest rank's (max over ranks); the figure is the median over repeats.

Reported per algorithm: time ratio to the dense all_reduce of the same run,
bytes this rank sent (max over ranks, from :class:`commpress.collectives.CommStats`)
against the lower bound ``2 k (P-1) / P`` words of 4 bytes (``k`` the mean
per-rank count), and, for ``"auto"``, what it chose and whether that was the
fastest explicit algorithm (or within 10% of it).

Supports: rank ``r`` keeps ``round(overlap*k)`` indices from a pool shared by all
ranks and the rest from its own random draw, so ``overlap=1`` means identical
supports and ``overlap=0`` independent ones.

:func:`run_suite` runs one world size (optionally in an emulated network, see
:mod:`benchmarks.netem`); :func:`rank_main` is what each rank executes.

With ``--topology NODESxRANKS`` the suite compares flat and two-level compressed
allreduce instead (:func:`hierarchy_main`): per tensor size, a dense
``all_reduce`` (baseline), ``allreduce`` flat, two-level
(``Hierarchy(RANKS)``) and ``hierarchy="auto"`` for each compressor of
:data:`HIER_COMPRESSORS`, interleaved, with the bytes that crossed nodes in each
call: the growth of every node's NIC counter (the one throttled veth of
:mod:`benchmarks.netem`'s topology; TCP/IP headers and the timing barriers
included), summed over nodes.  On loopback those bytes are not measurable.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any, Callable

from .common import markdown_table, results_dir, steady_params, write_results

log = logging.getLogger("commpress.benchmarks")

FULL = {"numels": [2**22, 2**23, 2**24], "densities": [0.001, 0.01, 0.1, 0.3], "overlaps": [0.0, 0.5, 1.0]}
QUICK = {"numels": [2**22], "densities": [0.001, 0.1], "overlaps": [0.0, 1.0]}


def make_configs(numels, densities, overlaps) -> list[dict[str, Any]]:
    return [{"numel": n, "density": d, "overlap": o} for n in numels for d in densities for o in overlaps]


def _support(rank: int, cfg: dict[str, Any], seed: int):
    import torch

    n, k = cfg["numel"], max(1, int(round(cfg["density"] * cfg["numel"])))
    m = int(round(cfg["overlap"] * k))
    shared = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:m]
    own = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1009 + rank + 1))[: k - m]
    idx = torch.unique(torch.cat([shared, own]))  # sorted, unique
    vals = torch.randn(idx.numel(), generator=torch.Generator().manual_seed(rank))
    return idx.to(torch.int32), vals


def rank_main(rank: int, world_size: int, *, report: Callable[[dict], None] | None = None,
              configs: list[dict[str, Any]], repeat: int = 3, warmup: int = 1,
              cost_model: tuple[float, float] | None = None) -> list[dict[str, Any]]:
    """Run every configuration on this rank; returns one row per (config, algorithm)."""
    import torch
    import torch.distributed as dist

    from commpress.collectives import SPARSE_ALGORITHMS, CommStats, calibrate, set_cost_model, sparse_allreduce

    if cost_model is not None:
        set_cost_model(*cost_model)
        model = cost_model
    else:
        m = calibrate()
        model = (m.alpha, m.beta, m.gamma, m.delta)
    rows = []
    variants = ("dense_allreduce",) + SPARSE_ALGORITHMS + ("auto",)
    for ci, cfg in enumerate(configs):
        idx, vals = _support(rank, cfg, seed=ci + 1)
        n = cfg["numel"]
        dense_buf = torch.zeros(n)
        counts = torch.tensor([idx.numel()], dtype=torch.float64)
        dist.all_reduce(counts)
        k_mean = float(counts) / world_size

        def call(v, stats=None):
            if v == "dense_allreduce":
                dense_buf.zero_()
                dense_buf[idx.long()] = vals
                dist.all_reduce(dense_buf)
                if stats is not None:
                    b = 2 * n * 4 * (world_size - 1) // world_size
                    stats.add(b, b, 2 * (world_size - 1), calls=1, algorithm="dense_allreduce")
                return dense_buf
            return sparse_allreduce(idx, vals, n, algorithm=v, stats=stats, validate=False)

        times = {v: [] for v in variants}
        stats = {v: CommStats() for v in variants}
        for it in range(warmup + repeat):
            for v in variants:  # interleaved, so load changes hit every variant alike
                dist.barrier()
                t0 = time.perf_counter()
                call(v, stats[v] if it == 0 else None)
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if it >= warmup:
                    times[v].append(float(t))
        for v in variants:
            sent = torch.tensor([stats[v].bytes_sent], dtype=torch.float64)
            dist.all_reduce(sent, op=dist.ReduceOp.MAX)
            rows.append({**cfg, "world": world_size, "algorithm": v, "k_mean": k_mean,
                         "seconds": statistics.median(times[v]), "bytes_sent_max": int(sent),
                         "lower_bound_bytes": 2 * k_mean * (world_size - 1) / world_size * 4,
                         "chosen": stats[v].last_algorithm, "alpha": model[0], "beta": model[1]})
        if report is not None and rank == 0:
            report({"config": ci + 1, "of": len(configs), **cfg})
    return rows


HIER_COMPRESSORS = {"topk1%": ("topk", {"ratio": 0.01}), "blockquant8": ("blockquant", {"bits": 8})}


def hierarchy_main(rank: int, world_size: int, *, report: Callable[[dict], None] | None = None,
                   numels: list[int], local_size: int, compressors: list[str], repeat: int = 3,
                   warmup: int = 1) -> list[dict[str, Any]]:
    """Flat against two-level on this rank; one row per (numel, variant)."""
    import torch
    import torch.distributed as dist

    import commpress
    from commpress.collectives import CommStats, Hierarchy, allreduce

    from .netem import nic_bytes

    two = Hierarchy(local_size)
    auto = Hierarchy(local_size, mode="auto")
    auto.models()  # calibrate the intra and inter models now (collective)
    leader = rank % local_size == 0
    rows = []
    for n in numels:
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        dense_buf = torch.empty(n)
        variants: dict[str, Callable] = {}

        def dense(stats):
            dense_buf.copy_(x)
            dist.all_reduce(dense_buf)
            if stats is not None:
                b = 2 * n * 4 * (world_size - 1) // world_size
                stats.add(b, b, 2 * (world_size - 1), calls=1, algorithm="dense_allreduce")
        variants["dense_allreduce"] = dense
        for cname in compressors:
            name, params = HIER_COMPRESSORS[cname]
            for label, h in (("flat", None), ("two_level", two), ("auto", auto)):
                codec = commpress.ErrorFeedback(commpress.get(name, **steady_params(name, params)))
                variants[f"{cname}/{label}"] = (
                    lambda stats, c=codec, h=h, k=f"{cname}/{label}":
                    allreduce(x, c, key=k, hierarchy=h, stats=stats))
        times = {v: [] for v in variants}
        crossed = {v: [] for v in variants}
        stats = {v: CommStats() for v in variants}
        for it in range(warmup + repeat):
            for v, fn in variants.items():  # interleaved, so load changes hit every variant alike
                dist.barrier()
                c0 = nic_bytes() if leader else 0
                dist.barrier()
                t0 = time.perf_counter()
                fn(stats[v] if it == warmup else None)
                dt = time.perf_counter() - t0
                dist.barrier()
                c1 = nic_bytes() if leader else 0
                t = torch.tensor([dt, -1.0 if c0 is None or c1 is None else float(c1 - c0)], dtype=torch.float64)
                dist.all_reduce(t[:1], op=dist.ReduceOp.MAX)
                dist.all_reduce(t[1:], op=dist.ReduceOp.SUM)
                if it >= warmup:
                    times[v].append(float(t[0]))
                    crossed[v].append(float(t[1]) if float(t[1]) >= 0 else None)
        for v in variants:
            sent = torch.tensor([stats[v].bytes_sent], dtype=torch.float64)
            dist.all_reduce(sent, op=dist.ReduceOp.MAX)
            cr = [c for c in crossed[v] if c is not None]
            rows.append({"world": world_size, "local_size": local_size, "numel": n, "variant": v,
                         "seconds": statistics.median(times[v]), "bytes_sent_max": int(sent),
                         "bytes_across_nodes": statistics.median(cr) if cr else None,
                         "chosen": stats[v].last_algorithm})
        if report is not None and rank == 0:
            report({"numel": n})
    return rows


def summarize_hierarchy(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add per row: time ratio to the dense all_reduce, and for two-level / auto rows the
    flat row's bytes across nodes over this row's, and flat's time over this row's."""
    by = {(r["numel"], r["variant"]): r for r in rows}
    for r in rows:
        r["ratio_to_dense"] = r["seconds"] / by[(r["numel"], "dense_allreduce")]["seconds"]
        if "/" in r["variant"]:
            flat = by[(r["numel"], r["variant"].split("/")[0] + "/flat")]
            b, fb = r["bytes_across_nodes"], flat["bytes_across_nodes"]
            r["flat_bytes_over_this"] = fb / b if b and fb is not None else None
            r["flat_time_over_this"] = flat["seconds"] / r["seconds"]
    return rows


def run_hierarchy(topology: str, numels: list[int], *, net: str | None, compressors: list[str],
                  repeat: int = 3, warmup: int = 1, timeout: float = 3600.0) -> list[dict[str, Any]]:
    """Run :func:`hierarchy_main` on the emulated ``topology`` (``"2x2"``)."""
    from .netem import launch, parse_topology

    nodes, local = parse_topology(topology, _world_of(topology))
    results = launch("benchmarks.collectives:hierarchy_main", nodes * local, net=net, topology=(nodes, local),
                     kwargs={"numels": numels, "local_size": local, "compressors": compressors,
                             "repeat": repeat, "warmup": warmup},
                     timeout=timeout, on_message=lambda r, m: log.info("topology %s: %s", topology, m))
    return summarize_hierarchy(results[0])


def _world_of(topology: str) -> int:
    a, _, b = topology.partition("x")
    return int(a) * int(b) if a.isdigit() and b.isdigit() else 0


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Add ratio_to_dense, bytes_over_lower_bound and, on "auto" rows, auto_fastest."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["world"], r["numel"], r["density"], r["overlap"]), []).append(r)
    for g in groups.values():
        base = next(r["seconds"] for r in g if r["algorithm"] == "dense_allreduce")
        explicit = {r["algorithm"]: r["seconds"] for r in g if r["algorithm"] not in ("auto", "dense_allreduce")}
        fastest = min(explicit, key=explicit.get)
        for r in g:
            r["ratio_to_dense"] = r["seconds"] / base
            r["bytes_over_lower_bound"] = r["bytes_sent_max"] / max(r["lower_bound_bytes"], 1.0)
            r["fastest"] = fastest
            if r["algorithm"] == "auto":
                r["auto_fastest"] = r["chosen"] == fastest
                r["auto_within_10pct"] = explicit[r["chosen"]] <= 1.1 * explicit[fastest]
    return rows


def run_suite(world_size: int, configs: list[dict[str, Any]], *, net: str | None = None, cluster=None,
              repeat: int = 3, warmup: int = 1, cost_model: tuple[float, float] | None = None,
              timeout: float = 3600.0, echo: bool = False) -> list[dict[str, Any]]:
    """Run ``configs`` on ``world_size`` local ranks (gloo; ``net``/``cluster`` as in
    :func:`benchmarks.netem.launch`) and return the summarized rows of rank 0."""
    from .netem import launch

    def progress(rank: int, msg: dict) -> None:
        log.info("world %d: config %s/%s %s", world_size, msg.get("config"), msg.get("of"), msg)

    results = launch("benchmarks.collectives:rank_main", world_size, net=net, cluster=cluster,
                     kwargs={"configs": configs, "repeat": repeat, "warmup": warmup, "cost_model": cost_model},
                     timeout=timeout, on_message=progress, echo=echo)
    return summarize(results[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks collectives", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2**22 elements, densities 0.1%% and 10%%, overlaps 0 and 1, 2 repeats (about 2 min)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--numels", type=int, nargs="+", help="override the element counts")
    p.add_argument("--densities", type=float, nargs="+", help="override the densities (fractions)")
    p.add_argument("--overlaps", type=float, nargs="+", help="override the overlaps (fractions)")
    p.add_argument("--repeat", type=int, default=None, help="timed repetitions (default 3, quick 2)")
    p.add_argument("--net", default=None, help="emulated link RATE[,DELAY] (see benchmarks.netem); loopback if absent")
    p.add_argument("--cost-model", type=float, nargs=2, metavar=("ALPHA", "BETA"),
                   help="fix the cost model instead of calibrating")
    p.add_argument("--topology", default=None, metavar="NODESxRANKS",
                   help="compare flat and two-level compressed allreduce on emulated nodes (e.g. 2x2; "
                        "with --net only the links between nodes are throttled)")
    p.add_argument("--compressors", nargs="+", default=list(HIER_COMPRESSORS), choices=list(HIER_COMPRESSORS),
                   help="with --topology: the compressors compared")
    p.add_argument("--out", default="results", help="results root folder")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.topology:
        return _main_hierarchy(args, argv)

    grid = dict(QUICK if args.quick else FULL)
    for key in ("numels", "densities", "overlaps"):
        if getattr(args, key):
            grid[key] = getattr(args, key)
    for w in args.world_sizes:
        if w < 2:
            p.error("--world-sizes must be >= 2")
    configs = make_configs(grid["numels"], grid["densities"], grid["overlaps"])
    repeat = args.repeat or (2 if args.quick else 3)
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    for w in args.world_sizes:
        rows += run_suite(w, configs, net=args.net, repeat=repeat, cost_model=tuple(args.cost_model)
                          if args.cost_model else None)
    out = results_dir("collectives", args.out)
    write_results(out, rows, {"suite": "collectives", "argv": argv, "net": args.net or "loopback",
                              "repeat": repeat, "wall_seconds": time.time() - t0})
    cols = ["world", "numel", "density", "overlap", "algorithm", "seconds", "ratio_to_dense", "bytes_sent_max",
            "bytes_over_lower_bound", "chosen", "auto_fastest"]
    table = markdown_table(rows, cols)
    (out / "table.md").write_text(table + "\n")
    print(table)
    autos = [r for r in rows if r["algorithm"] == "auto"]
    if autos:
        print(f"\nauto chose the fastest explicit algorithm in {sum(r['auto_fastest'] for r in autos)}"
              f"/{len(autos)} configurations, within 10% in {sum(r['auto_within_10pct'] for r in autos)}"
              f"/{len(autos)}")
    print(f"results: {out}")
    return 0


def _main_hierarchy(args, argv) -> int:
    numels = args.numels or ([2**22] if args.quick else [2**22, 2**24])
    repeat = args.repeat or (2 if args.quick else 3)
    t0 = time.time()
    rows = run_hierarchy(args.topology, numels, net=args.net, compressors=args.compressors, repeat=repeat)
    out = results_dir("collectives_hierarchy", args.out)
    write_results(out, rows, {"suite": "collectives --topology", "argv": argv, "topology": args.topology,
                              "net": args.net or "loopback", "repeat": repeat, "wall_seconds": time.time() - t0})
    cols = ["numel", "variant", "seconds", "ratio_to_dense", "bytes_across_nodes", "flat_bytes_over_this",
            "flat_time_over_this", "bytes_sent_max", "chosen"]
    table = markdown_table(rows, cols)
    (out / "table.md").write_text(table + "\n")
    print(table)
    print(f"results: {out}")
    return 0
