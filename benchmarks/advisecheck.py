"""``python -m benchmarks advisecheck``: ``commpress.advise``'s predicted step times against measured ones.

``python -m benchmarks advisecheck [--clusters P2-1gbit,P2-100mbit,P4-1gbit,2x2-1gbit] [--steps 12]
[--width 1024] [--out results] [--doc docs/results/advise.md]``

Per emulated cluster (:mod:`benchmarks.netem`: ranks in network namespaces, ``tc`` limits on the
links; ``2x2``: two nodes of two ranks, only the link between nodes limited) one launch (gloo, one
torch thread per rank, ranks pinned to cores) runs, on every rank:

1. **compute**: the model without DDP (forward, backward, SGD step), ``--steps`` timed steps;
2. **the per-round cost** (advise's ``round_ms``): the same for a tiny model (``Linear(TINY, TINY)``,
   4,160 parameters) without DDP and with each compressor, ``max(--steps, TINY_STEPS)`` steps each;
   what each compressor's step took beyond advise's prediction at that size (round cost 0: its
   codec and link time there are tens of microseconds), summed over the compressors and divided by
   their collective rounds: ``"auto"``'s estimator (``AutoCodec._per_round``) at a size where the
   α-β terms vanish.  Measured on the launch's group, independently of the timed configs below;
3. **DDP** (PyTorch's own all-reduce), then each compressor of ``--compressors`` through
   ``commpress.ddp.register`` (its default error feedback; ``hierarchy=2`` on ``2x2``), a warm-up of
   ``WARMUP`` steps then ``--steps`` timed steps each.

The model is one ``Linear(width, width)`` (``width**2 + width`` parameters, 1.05M at 1024: one DDP
bucket, one 1024x1024 matrix for PowerSGD), batch 32.  Step time: rank 0's median.  Then
``commpress.advise.advise`` predicts each step from the parameter count, the measured compute median,
the world, the link (``tc`` rate; latency ``LATENCY_US``; ``2x2``: ``--gpus-per-node 2`` with the
node's loopback as a ``INTRA`` link) and the codec measured on this machine (one thread, as a rank),
overlap 0 (one bucket: nothing to overlap), the per-round cost of step 2 and ``--ranks-per-core``
``world / cores`` when the ranks outnumber the cores (pinned two to a core: each codes at half
speed); and again with the link as measured: the alpha-beta calibration "auto" runs
(``commpress.collectives.get_cost_model``) on the launch's group (on ``2x2`` the hierarchy's own,
``Hierarchy.models()``: inside a node and between nodes; the per-round cost is taken against
these).  Plain DDP on ``2x2`` is compared with advise's ``"ddp(flat ring)"`` row (PyTorch DDP runs
one ring over the four ranks).  The load average before and after each launch is recorded (the machine may be shared).  Writes ``results/advisecheck-<timestamp>/`` and
the table to ``--doc``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from commpress.advise import FLAT_DDP

from .common import markdown_table, results_dir, write_results

COMPRESSORS = ("blockquant(bits=8)", "blockquant(bits=4)", "fp16", "topk(ratio=0.01)", "powersgd(rank=4)")
CLUSTERS = {   # name -> (world, net, topology)
    "P2-1gbit": (2, "1gbit", None),
    "P2-100mbit": (2, "100mbit", None),
    "P4-1gbit": (4, "1gbit", None),
    "2x2-1gbit": (4, "1gbit", (2, 2)),
}
WARMUP = 3
TINY = 64                # the per-round cost's model: Linear(64, 64)
TINY_STEPS = 30
LATENCY_US = 50.0        # advise's default for a link it is not told the latency of
INTRA = "20gbit"         # a namespace's loopback, as advise's intra-node link (2x2)
INTRA_LATENCY_US = 5.0   # advise's default inside a node
BATCH = 32


def _model(width: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width))


def _timed(step: Callable[[], None], warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def rank_main(rank: int, world_size: int, *, report: Callable[[dict], None], width: int, steps: int,
              compressors: list[str], local_size: int | None) -> dict[str, float]:
    """Median step ms of compute alone, DDP and each compressor (see the module doc)."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpress
    from commpress.advise import parse_compressor

    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(BATCH, width, generator=g), torch.randn(BATCH, width, generator=g)

    def stepper(model: nn.Module, inp: torch.Tensor = x, target: torch.Tensor = y) -> Callable[[], None]:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step() -> None:
            opt.zero_grad()
            nn.functional.mse_loss(model(inp), target).backward()
            opt.step()
        return step

    out = {"compute": _timed(stepper(_model(width)), WARMUP, steps)}
    report({"rank": rank, "config": "compute", "ms": out["compute"]})
    from commpress.collectives import get_cost_model

    cm = get_cost_model(None)            # the alpha-beta calibration "auto" runs (a collective)
    out["alpha_us"], out["beta_bytes_per_s"] = 1e6 * cm.alpha, 1.0 / cm.beta
    if local_size:                       # and the two-level path's: inside a node, between nodes
        from commpress.collectives import Hierarchy

        intra, inter = Hierarchy(local_size).models()
        out["intra_alpha_us"], out["intra_beta_bytes_per_s"] = 1e6 * intra.alpha, 1.0 / intra.beta
        out["inter_alpha_us"], out["inter_beta_bytes_per_s"] = 1e6 * inter.alpha, 1.0 / inter.beta
    # the per-round cost: the same configs on a tiny model (see the module doc, step 2)
    tx, ty = x[:, :TINY].contiguous(), y[:, :TINY].contiguous()
    def register(model: nn.Module, spec: str) -> Any:
        return commpress.ddp.register(model, parse_compressor(spec)[1],
                                      **({"hierarchy": local_size} if local_size else {}))

    tiny_steps = max(steps, TINY_STEPS)
    out["tiny:compute"] = _timed(stepper(_model(TINY), tx, ty), WARMUP, tiny_steps)
    for spec in compressors:
        model = DDP(_model(TINY))
        state = register(model, spec)
        out["tiny:" + spec] = _timed(stepper(model, tx, ty), WARMUP, tiny_steps)
        state.close()
    for spec in ["ddp", *compressors]:
        model = DDP(_model(width))
        state = register(model, spec) if spec != "ddp" else None
        out[spec] = _timed(stepper(model), WARMUP, steps)
        report({"rank": rank, "config": spec, "ms": out[spec]})
        if state is not None:
            state.close()
    return out


def predict(width: int, compute_ms: float, world: int, net: str, latency_us: float,
            topology: tuple[int, int] | None, compressors: list[str], round_ms: float = 0.0,
            ranks_per_core: float = 1.0, intra: tuple[str, float] = (INTRA, INTRA_LATENCY_US)) -> dict[str, float]:
    """``commpress.advise``'s step ms per row for this cluster (``net``: a bandwidth such as ``1gbit``;
    ``intra``: the link inside a node, bandwidth and latency, on ``2x2``)."""
    from commpress.advise import advise

    kw: dict[str, Any] = {}
    if topology is not None:
        kw = {"gpus_per_node": topology[1], "intra_bandwidth": intra[0], "intra_latency_us": intra[1],
              "flat_ddp": True}
    res = advise(width * width + width, compute_ms, world, net, latency_us, compressors=compressors,
                 round_ms=round_ms, ranks_per_core=ranks_per_core, dense_params=width, **kw)   # the bias
    return {r["compressor"]: r["step_ms"] for r in res["rows"]}


def round_cost(measured: dict[str, float], world: int, link: str, latency_us: float,
               topology: tuple[int, int] | None, compressors: list[str],
               intra: tuple[str, float] = (INTRA, INTRA_LATENCY_US)) -> float:
    """ms per collective round of the hook (advise's ``round_ms``) from the tiny model's steps:
    what the compressors' steps took beyond advise's prediction with no round cost, summed, per
    round (:func:`commpress.auto.decide.kind_rounds`; the two-level path two rounds more; the
    dense part's all-reduce where it does not ride, :func:`commpress.advise.dense_rounds`: the bias),
    at least 0."""
    from commpress.advise import dense_rounds, parse_compressor
    from commpress.auto.decide import kind_rounds

    pred = predict(TINY, measured["tiny:compute"], world, link, latency_us, topology, compressors, intra=intra)
    nodes = world // topology[1] if topology else world
    excess = sum(measured["tiny:" + c] - pred[c] for c in compressors)
    comps = [parse_compressor(c)[1] for c in compressors]
    rounds = sum(kind_rounds(comp.aggregation, nodes) + (2 if topology else 0)
                 + dense_rounds(comp, world, topology is not None) for comp in comps)
    return max(0.0, excess) / rounds if rounds else 0.0


def main(argv: list[str] | None = None) -> int:
    from .netem import Cluster, launch

    p = argparse.ArgumentParser(prog="python -m benchmarks advisecheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--clusters", default=",".join(CLUSTERS), help=f"comma-separated, of {', '.join(CLUSTERS)}")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--compressors", default=",".join(COMPRESSORS))
    p.add_argument("--out", default="results")
    p.add_argument("--doc", default=None, help="also write the table to this markdown file")
    args = p.parse_args(argv)
    names = [c for c in args.clusters.split(",") if c]
    bad = [c for c in names if c not in CLUSTERS]
    if bad:
        p.error(f"--clusters: unknown {bad}; known: {list(CLUSTERS)}")
    reason = Cluster.probe()
    if reason is not None:
        print(f"advisecheck needs network namespaces (emulated links): {reason}")
        return 2
    comps = [c for c in args.compressors.split(",") if c]

    cores = len(os.sched_getaffinity(0))
    out = results_dir("advisecheck", args.out)
    rows: list[dict[str, Any]] = []
    for name in names:
        world, net, topo = CLUSTERS[name]
        load0 = os.getloadavg()[0]
        got = launch("benchmarks.advisecheck:rank_main", world, net=net, topology=topo, pin=True, timeout=1200,
                     kwargs={"width": args.width, "steps": args.steps, "compressors": comps,
                             "local_size": topo[1] if topo else None})
        measured = got[0]
        link, alpha_us = f"{8 * measured['beta_bytes_per_s'] / 1e6:.1f}mbit", measured["alpha_us"]
        flat_link = (link, alpha_us)   # the default group's: what PyTorch DDP's one ring runs on
        intra = (INTRA, INTRA_LATENCY_US)
        if topo:   # calibrated: the hierarchy's own models, inside a node and between nodes
            intra = (f"{8 * measured['intra_beta_bytes_per_s'] / 1e6:.1f}mbit", measured["intra_alpha_us"])
            link, alpha_us = f"{8 * measured['inter_beta_bytes_per_s'] / 1e6:.1f}mbit", measured["inter_alpha_us"]
        rpc = max(1.0, world / cores)   # pinned r % cores: ranks per core when they outnumber the cores
        round_ms = round_cost(measured, world, link, alpha_us, topo, comps, intra)
        nominal = predict(args.width, measured["compute"], world, net, LATENCY_US, topo, comps, round_ms, rpc)
        calibrated = predict(args.width, measured["compute"], world, link, alpha_us, topo, comps,
                             round_ms, rpc, intra)
        if topo:   # the ring's inter-node hop on the flat group's calibration, not the inter groups' (shared)
            calibrated[FLAT_DDP] = predict(args.width, measured["compute"], world, *flat_link, topo, ["fp16"],
                                           0.0, rpc, intra)[FLAT_DDP]
        for spec in ["ddp", *comps]:
            row = FLAT_DDP if (spec == "ddp" and topo) else spec   # PyTorch DDP: one flat ring
            m, q, c = measured[spec], nominal[row], calibrated[row]
            rows.append({"cluster": name, "ranks": world, "cores": cores, "compute_ms": round(measured["compute"], 2),
                         "load_1min": f"{load0:.1f}-{os.getloadavg()[0]:.1f}",
                         "calibrated_link": (f"flat {flat_link[0]}, {flat_link[1]:.0f} us; inter {link}, {alpha_us:.0f} us; "
                                             f"intra {intra[0]}, {intra[1]:.0f} us") if topo
                                            else f"{link}, {alpha_us:.0f} us",
                         "round_ms": round(round_ms, 2), "ranks_per_core": rpc,
                         "config": spec, "predicted_row": row, "measured_ms": round(m, 2), "predicted_ms": round(q, 2),
                         "error_pct": round(100 * (q - m) / m, 1), "predicted_calibrated_ms": round(c, 2),
                         "error_calibrated_pct": round(100 * (c - m) / m, 1)})
            print(rows[-1], flush=True)
    write_results(out, rows, {"width": args.width, "steps": args.steps, "latency_us": LATENCY_US, "intra": INTRA,
                              "tiny": TINY, "tiny_steps": max(args.steps, TINY_STEPS)})
    table = markdown_table(rows, ["cluster", "load_1min", "compute_ms", "calibrated_link", "round_ms", "ranks_per_core",
                                  "config", "predicted_row", "measured_ms", "predicted_ms", "error_pct",
                                  "predicted_calibrated_ms", "error_calibrated_pct"])
    (out / "summary.md").write_text(table + "\n")
    print(table)
    if args.doc:
        Path(args.doc).write_text(table + "\n")
    print(f"results in {out}")
    return 0
