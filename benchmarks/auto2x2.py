"""``python -m benchmarks auto2x2``: does ``"auto"`` pick the right path on an emulated 2x2 topology?

``python -m benchmarks auto2x2 [--nets 100mbit,10gbit] [--steps 30] [--check-every 10]``

Issue 19's last goal: on an emulated 2 nodes x 2 ranks topology, ``register(model, "auto",
hierarchy=2)`` picks the two-level path (dense inside a node, compressed between nodes) when it
pays, and the flat path when it does not.

Per network setting (``--nets``; one launch each) the 4 ranks (gloo, one torch thread each) run in
the topology of :mod:`benchmarks.netem` (``topology=(2, 2)``: the two ranks of a node share one
network namespace and talk over its loopback, unthrottled; only the node's veth, shared by both
ranks like a NIC, is rate-limited); ``loopback`` runs every rank on the host's loopback (no
namespaces, no rate limit: a fast network everywhere).  Each rank trains the digits MLP of
:mod:`benchmarks.train` (1.1M parameters, SGD + momentum, DDP's default buckets), the same seed and
batches for every configuration, ``--steps`` steps each:

1. ``auto``: ``commpress.ddp.register(model, "auto", hierarchy=2, check_every=N, every=N)``; the plan
   of every unit after each check point (``state.stats.as_dict()["auto"]``);
2. DDP (the reference), and for each compressor kind in auto's final plan (``dense`` included) and
   each kind of ``--kinds``, that kind fixed for the whole model on the **flat** path (dense: DDP
   itself) and on the **two-level** path (``register(model, kind, hierarchy=2)``; dense:
   ``"identity"`` under error feedback, as auto runs it: without, the hook sends it DDP's way).

Per configuration: the median step time (rank 0's wall time of forward + backward + optimizer step)
over the steps after the first ``SKIP`` (auto's first decision ends step 3), and the bytes that
crossed nodes per step (the growth of each node's veth transmit counter, summed over the nodes; not
measurable on loopback).  Verdict per unit: auto's path for its kind is right when it is the faster
of that kind's two fixed paths, or when the two are within ``TIE`` of each other (either is then as
good).  The configurations run one after the other in one launch: load on a shared machine hits
them unevenly; 4 ranks on fewer than 4 cores are oversubscribed (said in the output).

Writes ``results/auto2x2-<timestamp>/`` with ``results.json``, ``results.csv`` and ``summary.md``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import statistics
import sys
import time
from typing import Any, Callable

from .common import markdown_table, results_dir, write_results

log = logging.getLogger("commpress.benchmarks")

TOPOLOGY = (2, 2)          # nodes x ranks per node
NETS = ("100mbit", "10gbit")
STEPS = 30
CHECK_EVERY = 10
SKIP = 3                   # steps left out of the median: DDP's bucket rebuild, auto's first decision (end of step 3)
TASKS = {"digits": "digits MLP 64-1024-1024-10 (1.1M parameters, SGD + momentum, batch 32 per rank)",
         "tiny": "MLP 64-128-10 on random batches"}
TIE = 0.10                 # two fixed paths within 10% of each other: either path is right


# ---------------------------------------------------------------------------- inside a rank
def _kind_label(kind: str, param: Any) -> str:
    from commpress.auto.candidates import Candidate, describe

    return describe(Candidate(kind, param))


def _register(ddp: Any, config: dict[str, Any], local_size: int, check_every: int) -> Any:
    """Attach ``config`` (``{"name", "kind", "param", "path"}``) to ``ddp``; the hook state or None."""
    import commpress
    from commpress.auto.candidates import Candidate

    if config["kind"] == "auto":
        return commpress.ddp.register(ddp, "auto", hierarchy=local_size, check_every=check_every,
                                      every=check_every)
    two = config["path"] == "two_level"
    if config["kind"] == "dense" and not two:
        return None                                  # DDP's own all_reduce
    comp = Candidate(config["kind"], config["param"]).build()   # dense: "identity"
    if config["kind"] == "dense":   # under error feedback, as auto runs it: else the hook sends it DDP's way, flat
        return commpress.ddp.register(ddp, comp, hierarchy=local_size, error_feedback=True)
    return commpress.ddp.register(ddp, comp, hierarchy=local_size if two else None)


def _plan(state: Any) -> dict[str, str]:
    return {name: e["choice"] for name, e in state.stats.as_dict().get("auto", {}).items()}


def _tiny_task(seed: int) -> Any:
    """A 64-128-10 MLP on random batches (no data set to load): the tests' task."""
    import torch
    from torch import nn

    from .train import Task, _ce

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def batch(gen):
        return torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)

    return Task("tiny", "none", model, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), batch, _ce,
                lambda m, r, w: 0.0, {"model": "MLP 64-128-10, random batches"})


def make_task(name: str, seed: int) -> Any:
    """``digits`` (the digits MLP of :mod:`benchmarks.train`, 1.1M parameters) or ``tiny``."""
    if name == "tiny":
        return _tiny_task(seed)
    if name != "digits":
        raise ValueError(f"task must be 'digits' or 'tiny', got {name!r}")
    from .train import make_task as train_task

    return train_task("digits", "quick", seed)


def train_config(rank: int, world: int, config: dict[str, Any], *, steps: int, seed: int, local_size: int,
                 check_every: int, report: Callable[[dict], None], task: str = "digits") -> dict[str, Any]:
    """Train ``config`` for ``steps`` steps from the seed's weights; rank 0's measurements."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .netem import nic_bytes

    w0 = time.perf_counter()
    task_name, task = task, make_task(task, seed)
    ddp = DDP(task.model)
    opt = task.make_opt(ddp.parameters())
    state = _register(ddp, config, local_size, check_every)
    setup_s = time.perf_counter() - w0
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    leader = rank % local_size == 0
    times: list[float] = []
    history: list[dict[str, Any]] = []
    checks, c0 = 0, None
    dist.barrier()
    for step in range(1, steps + 1):
        if step == SKIP + 1:
            dist.barrier()
            c0 = nic_bytes() if leader else 0
        x, y = task.batch(gen)
        t0 = time.perf_counter()
        task.loss(ddp, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        if config["kind"] == "auto" and state.codec.checks != checks:   # a check point ended this step
            checks = state.codec.checks
            cur = state.codec.decider.current
            history.append({"step": step, "plan": _plan(state), "round_ms": 1e3 * state.codec.round_s,
                            "predicted_step_ms": None if cur is None else 1e3 * cur.step_s,
                            "price": None if cur is None else cur.price})
    dist.barrier()
    c1 = nic_bytes() if leader else 0
    crossed = torch.tensor([-1.0 if c0 is None or c1 is None else float(c1 - c0)], dtype=torch.float64)
    dist.all_reduce(crossed)             # summed over the nodes (0 from the non-leaders)
    timed = times[SKIP:] or times
    out = {**config, "task": task_name, "steps": steps, "step_ms": 1e3 * statistics.median(timed),
           "step_ms_spread": [1e3 * min(timed), 1e3 * max(timed)], "setup_s": setup_s,
           "wall_s": time.perf_counter() - w0,
           "bytes_across_nodes_per_step": (float(crossed) / len(timed) if float(crossed) >= 0 else None)}
    if state is not None:
        last = state.stats.as_dict().get("last_step") or {}
        out["bytes_sent"] = int(last.get("bytes_sent", 0))
        out["algorithms"] = sorted(set(state.stats.algorithms.values()))
        if config["kind"] == "auto":
            out["auto"] = state.stats.as_dict()["auto"]
            out["plan"] = _plan(state)
            out["history"] = history
            net = state.codec.network
            out["network_model"] = {name: (None if m is None else [m.alpha, m.beta])
                                    for name, m in (("flat", net.flat), ("intra", net.intra), ("inter", net.inter))}
        state.close()
    if rank == 0:
        report({"event": "done", "config": config["name"], "step_ms": out["step_ms"], "plan": out.get("plan"),
                "setup_s": setup_s, "wall_s": out["wall_s"]})
    del ddp, opt, task
    dist.barrier()
    return out


def rank_main(rank: int, world_size: int, *, report: Callable[[dict], None], steps: int = STEPS,
              seed: int = 0, local_size: int = 2, check_every: int = CHECK_EVERY,
              kinds: list[tuple[str, Any]] | None = None, task: str = "digits") -> list[dict[str, Any]]:
    """``auto`` first, then DDP, then each kind of its final plan (and of ``kinds``) fixed on both paths."""
    from commpress.auto.candidates import Candidate

    common = dict(steps=steps, seed=seed, local_size=local_size, check_every=check_every, report=report, task=task)
    rows = [train_config(rank, world_size, {"name": "auto", "kind": "auto", "param": None, "path": "chosen"},
                         **common)]
    chosen = [(c.candidate.kind, c.candidate.param) for c in _final_choices(rows[0])]
    todo: list[tuple[str, Any]] = []
    for k in chosen + [tuple(k) for k in (kinds or [])]:
        if k not in todo:
            Candidate(*k)   # validates
            todo.append(k)
    if ("dense", None) not in todo:       # DDP: the reference of every setting
        rows.append(train_config(rank, world_size, {"name": "ddp", "kind": "dense", "param": None, "path": "flat"},
                                 **common))
    for kind, param in todo:
        for path in ("flat", "two_level"):
            name = _kind_label(kind, param) + ("+two_level" if path == "two_level" else "")
            if kind == "dense" and path == "flat":
                name = "ddp"
            rows.append(train_config(rank, world_size, {"name": name, "kind": kind, "param": param, "path": path},
                                     **common))
    return rows


def _final_choices(row: dict[str, Any]) -> list[Any]:
    """The auto row's final plan as :class:`~commpress.auto.candidates.Choice` objects, unit order."""
    return [parse_choice(text) for text in row.get("plan", {}).values()]


def parse_choice(text: str) -> Any:
    """``"blockquant(bits=4)+two_level"`` -> ``Choice(Candidate("blockquant", 4), "two_level")``."""
    from commpress.auto.candidates import Candidate, Choice

    path = "flat"
    if text.endswith("+two_level"):
        text, path = text[: -len("+two_level")], "two_level"
    if "(" not in text:
        return Choice(Candidate(text), path)
    kind, _, rest = text.partition("(")
    value = rest.rstrip(")").split("=", 1)[1]
    param: Any = float(value) if kind == "topk" else int(value)
    return Choice(Candidate(kind, param), path)


# ---------------------------------------------------------------------------- verdict and report
def verdict(rows: list[dict[str, Any]], tie: float = TIE) -> list[dict[str, Any]]:
    """Per unit of auto's final plan: the fixed flat and two-level step times of its kind, the
    faster path, and whether auto's path is right (the faster one, or a tie within ``tie``)."""
    auto = next((r for r in rows if r.get("kind") == "auto"), None)
    if auto is None:
        return []
    by = {(r["kind"], r["param"], r["path"]): r for r in rows if r.get("kind") != "auto" and "step_ms" in r}
    out = []
    for unit, text in auto.get("plan", {}).items():
        choice = parse_choice(text)
        c = choice.candidate
        flat, two = by.get((c.kind, c.param, "flat")), by.get((c.kind, c.param, "two_level"))
        if flat is None or two is None:
            out.append({"unit": unit, "choice": text, "right": None})
            continue
        faster = "flat" if flat["step_ms"] <= two["step_ms"] else "two_level"
        gap = max(flat["step_ms"], two["step_ms"]) / min(flat["step_ms"], two["step_ms"]) - 1
        out.append({"unit": unit, "choice": text, "kind": _kind_label(c.kind, c.param), "path": choice.path,
                    "flat_ms": flat["step_ms"], "two_level_ms": two["step_ms"], "faster": faster,
                    "gap": gap, "right": choice.path == faster or gap <= tie})
    return out


def render(results: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    """The markdown summary: per setting, auto's plan, every configuration's step, the verdict."""
    lines = ["# auto on an emulated 2x2 topology: flat or two-level", "",
             f"4 ranks (2 nodes x 2 ranks), {TASKS[meta.get('task', 'digits')]}, {meta['steps']} steps per "
             "configuration, median step "
             f"after the first {SKIP}; auto checks every {meta['check_every']} steps. "
             f"{meta['oversubscribed_note']}", ""]
    for net, res in results.items():
        lines += [f"## {net}", "", f"Network: {res['network']}", ""]
        if "error" in res:
            lines += [f"**failed**: {res['error']}", ""]
            continue
        rows = res["rows"]
        auto = next(r for r in rows if r["kind"] == "auto")
        ddp = next((r for r in rows if r["name"] == "ddp"), None)
        table = []
        for r in rows:
            what = ("auto: " + ", ".join(f"{u}: {c}" for u, c in r["plan"].items())) if r["kind"] == "auto" else \
                f"{_kind_label(r['kind'], r['param'])}, {r['path'].replace('_', '-')}"
            b = r.get("bytes_across_nodes_per_step")
            table.append({"config": r["name"], "what": what, "step ms": f"{r['step_ms']:.0f}",
                          "vs DDP": f"{ddp['step_ms'] / r['step_ms']:.2f}x" if ddp else "",
                          "MB across nodes/step": "n/a" if b is None else f"{b / 1e6:.2f}"})
        lines += [markdown_table(table, ["config", "what", "step ms", "vs DDP", "MB across nodes/step"]), ""]
        hist = "; ".join(f"step {h['step']}: " + ", ".join(f"{u} {c}" for u, c in h["plan"].items())
                         + (f" (predicted step {h['predicted_step_ms']:.0f} ms)" if h.get("predicted_step_ms") else "")
                         for h in auto.get("history", []))
        if hist:
            lines += [f"auto's plan after each check point: {hist}", ""]
        for v in res["verdict"]:
            if v["right"] is None:
                lines.append(f"- unit {v['unit']}: {v['choice']}: no fixed runs of its kind")
                continue
            lines.append(f"- unit {v['unit']}: auto chose **{v['choice']}**; {v['kind']} fixed: flat "
                         f"{v['flat_ms']:.0f} ms, two-level {v['two_level_ms']:.0f} ms: "
                         + ("**right**" if v["right"] else "**wrong**")
                         + (f" (a tie: {v['gap']:.0%} apart)" if v["gap"] <= TIE and v["path"] != v["faster"] else ""))
        lines.append("")
    lines += [f"{meta['seconds']:.0f} s in all. Command: `{meta['command']}`", ""]
    return "\n".join(lines)


def run_setting(net: str, *, steps: int, check_every: int, seed: int, kinds: list[tuple[str, Any]],
                timeout: float, echo: bool = False, task: str = "digits") -> dict[str, Any]:
    """One network setting: ``net`` a rate (``100mbit``, ``1gbit,1ms``) on the emulated topology, or
    ``loopback``.  Returns ``{"network", "rows", "verdict"}`` (or ``"error"``)."""
    from .netem import LaunchError, Loopback, launch, make_cluster

    nodes, local = TOPOLOGY
    world = nodes * local
    with make_cluster(world, None if net == "loopback" else net, TOPOLOGY) as cluster:
        network = cluster.describe()
        if isinstance(cluster, Loopback) and net != "loopback":
            print(f"{net}: emulated network unavailable; running on loopback", file=sys.stderr)
        print(f"== {net}: {nodes}x{local} ranks; network: {network}", file=sys.stderr)

        def progress(rank: int, msg: dict) -> None:  # noqa: ARG001
            print(f"   {net}: {msg.get('config')}: {msg.get('step_ms', 0):.0f} ms/step, {msg.get('wall_s', 0):.1f} s "
                  f"(setup {msg.get('setup_s', 0):.1f} s)"
                  + (f", plan {msg['plan']}" if msg.get("plan") else ""), file=sys.stderr)

        try:
            got = launch("benchmarks.auto2x2:rank_main", world, cluster=cluster, on_message=progress, echo=echo,
                         kwargs={"steps": steps, "seed": seed, "local_size": local, "check_every": check_every,
                                 "kinds": kinds, "task": task}, timeout=timeout, pg_timeout=180.0)
        except LaunchError as exc:
            print(f"!! {net} failed: {str(exc)[-3000:]}", file=sys.stderr)
            return {"network": network, "error": str(exc).splitlines()[0][:300]}
    rows = got[0]
    for r in rows:
        r["net"] = net
    return {"network": network, "rows": rows, "verdict": verdict(rows)}


def _parse_kinds(text: str) -> list[tuple[str, Any]]:
    out = []
    for item in (t.strip() for t in text.split(",")):
        if item:
            try:
                c = parse_choice(item).candidate
            except (ValueError, IndexError) as exc:
                raise SystemExit(f"--kinds: {item!r} is not a candidate like 'blockquant(bits=4)' or 'bf16' ({exc})")
            out.append((c.kind, c.param))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks auto2x2", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--nets", default=",".join(NETS),
                   help="network settings, ';'-separated or ','-separated rates (RATE or RATE,DELAY needs ';'), "
                        "'loopback' for no namespaces (default 100mbit,10gbit)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"steps per configuration (default {STEPS})")
    p.add_argument("--check-every", type=int, default=CHECK_EVERY,
                   help=f"auto's check_every (and every) (default {CHECK_EVERY})")
    p.add_argument("--kinds", default="", help="more kinds to run fixed on both paths, e.g. 'blockquant(bits=4)' "
                                              "(default: only the kinds auto chose)")
    p.add_argument("--task", choices=("digits", "tiny"), default="digits",
                   help="digits: the digits MLP (1.1M parameters); tiny: a 64-128-10 MLP on random batches (tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results", help="parent folder of results/auto2x2-<timestamp>/")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds before a setting's ranks are killed")
    p.add_argument("--echo", action="store_true", help="echo the ranks' output")
    return p


def _split_nets(text: str) -> list[str]:
    sep = ";" if ";" in text else ","
    return [n.strip() for n in text.split(sep) if n.strip()]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.steps <= SKIP:
        raise SystemExit(f"--steps must be > {SKIP}")
    nets = _split_nets(args.nets)
    if not nets:
        raise SystemExit("--nets is empty")
    kinds = _parse_kinds(args.kinds)
    cores = len(os.sched_getaffinity(0))
    world = TOPOLOGY[0] * TOPOLOGY[1]
    note = (f"{world} ranks on {cores} cores: oversubscribed (compute and the codecs share the cores; the step "
            "times carry that load)" if world > cores else f"{world} ranks on {cores} cores")
    command = "python -m benchmarks auto2x2 " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                   else sys.argv[1:]))
    meta: dict[str, Any] = {"command": command.strip(), "steps": args.steps, "check_every": args.check_every,
                            "skip": SKIP, "tie": TIE, "topology": "2x2", "cores": cores,
                            "oversubscribed": world > cores, "oversubscribed_note": note,
                            "load_average": os.getloadavg()[0], "seed": args.seed, "task": args.task}
    print(note, file=sys.stderr)
    out = results_dir("auto2x2", args.out)
    t0 = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    for net in nets:
        results[net] = run_setting(net, steps=args.steps, check_every=args.check_every, seed=args.seed,
                                   kinds=kinds, timeout=args.timeout, echo=args.echo, task=args.task)
    meta["seconds"] = time.monotonic() - t0
    meta["networks"] = {n: r["network"] for n, r in results.items()}
    meta["verdict"] = {n: r.get("verdict") for n, r in results.items()}
    rows = [r for res in results.values() for r in res.get("rows", [])]
    write_results(out, rows, meta)
    summary = render(results, meta)
    (out / "summary.md").write_text(summary)
    print(summary)
    print(f"results in {out}/ ({meta['seconds']:.0f} s)", file=sys.stderr)
    return 1 if any("error" in r for r in results.values()) else 0
