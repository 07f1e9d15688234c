"""``python -m benchmarks sweep``: real training under every compression configuration, side by side.

Launches ``--world-size`` local ranks (one process each, gloo, one torch thread
each) — inside an emulated rate-limited cluster of network namespaces with
``--net`` (see :mod:`benchmarks.netem`) — and trains two tasks under every
configuration with the same seeds:

* ``digits``: an MLP classifier on scikit-learn's digits (metric: test accuracy);
* ``lm``: a causal character transformer on the Python standard library's own
  source (metric: validation loss).

Per configuration it records bytes sent per rank per step, compression ratio,
step time split into compute / compression / communication, the final metric
and the wall time to reach the dense DDP run's final metric within a margin
(accuracy −0.5 points, loss +2%).  Writes ``results/sweep-<timestamp>/`` with
``results.json``, ``results.csv``, plots and ``summary.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from . import configs as C
from .common import markdown_table, results_dir, write_results
from .netem import LaunchError, NetSpec, launch, make_cluster

log = logging.getLogger("commpress.benchmarks")

ACC_MARGIN = 0.005      # accuracy target: dense final - 0.5 points
LOSS_MARGIN = 0.02      # loss target: dense final * 1.02

DEFAULT_STEPS = {"full": {"digits": 150, "lm": 40}, "quick": {"digits": 60, "lm": 30}}


def _parse_steps(text: str | None, quick: bool) -> dict[str, int]:
    steps = dict(DEFAULT_STEPS["quick" if quick else "full"])
    if not text:
        return steps
    for item in text.split(","):
        key, _, val = item.partition("=")
        try:
            if val:
                if key not in steps:
                    raise ValueError
                steps[key] = int(val)
            else:
                steps = {k: int(key) for k in steps}
        except ValueError:
            raise SystemExit(f"--steps must be N or task=N[,task=N] with tasks {sorted(steps)}, got {text!r}")
    if any(v < 1 for v in steps.values()):
        raise SystemExit(f"--steps must be positive, got {text!r}")
    return steps


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks sweep", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="configs: " + ", ".join(c.name for c in C.ALL)
                                + "; groups: " + ", ".join(sorted(C.GROUPS)))
    p.add_argument("--quick", action="store_true", help="small models, few steps, a few configs (minutes on 2 cores)")
    p.add_argument("--world-size", type=int, default=4, help="number of ranks (default 4)")
    p.add_argument("--net", default=None, help="emulated link RATE[,DELAY], e.g. 1gbit or 1gbit,0.5ms "
                   "(needs root + iproute2; loopback otherwise)")
    p.add_argument("--configs", default=None, help="comma-separated config names or groups (default: all; quick: quick)")
    p.add_argument("--tasks", default="digits,lm", help="comma-separated tasks: digits, lm")
    p.add_argument("--steps", default=None, help="N for every task, or task=N,... (default full: digits=150,lm=40; "
                   "quick: digits=60,lm=30)")
    p.add_argument("--equal-steps", action="store_true",
                   help="every config runs --steps steps (default: ddp runs --steps steps and every other config "
                   "trains for the same wall time, at most 4x the steps)")
    p.add_argument("--evals", type=int, default=12, help="evaluations per run (time-to-target resolution)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results", help="parent folder of results/sweep-<timestamp>/")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--timeout", type=float, default=4 * 3600, help="seconds before a task's ranks are killed")
    return p


class Progress:
    """A tqdm bar per configuration, fed by rank 0's ``report`` messages."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = None
        self.current: str | None = None
        self.results: dict[str, dict] = {}

    def __call__(self, rank: int, msg: dict) -> None:  # noqa: ARG002
        ev = msg.get("event")
        if ev == "start":
            self.current = msg["config"]
            if self.enabled:
                from tqdm import tqdm

                self.bar = tqdm(total=msg["total"], desc=f"{msg['task']:>6} {msg['config']:<18}",
                                unit="step", leave=True, dynamic_ncols=True, file=sys.stderr)
        elif ev == "step" and self.bar is not None:
            self.bar.update(1)
            metric = {k: v for k, v in msg.items() if k in ("accuracy", "val_loss")}
            self.bar.set_postfix(loss=f"{msg['loss']:.3f}", **{k: f"{v:.4f}" for k, v in metric.items()},
                                 refresh=False)
        elif ev == "done":
            self.results[msg["config"]] = msg["result"]
            self.current = None
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run_task(task: str, size: str, cfgs: list[C.Config], steps: int, args, cluster) -> list[dict]:
    """Run ``cfgs`` for ``task`` in one launch; a failing config is recorded and the rest relaunched."""
    remaining = list(cfgs)
    rows: list[dict] = []
    while remaining:
        prog = Progress(not args.no_progress)
        ddp_row = next((r for r in rows if r["config"] == "ddp" and "train_time_s" in r), None)
        kwargs = {"task": task, "size": size, "configs": [{"name": c.name} for c in remaining],
                  "steps": steps, "eval_every": max(1, steps // args.evals), "seed": args.seed,
                  "equal_time": not args.equal_steps and any(c.name == "ddp" for c in cfgs),
                  "time_budget": ddp_row["train_time_s"] if ddp_row else None}
        error = None
        try:
            launch("benchmarks.train:rank_main", args.world_size, cluster=cluster, kwargs=kwargs,
                   on_message=prog, timeout=args.timeout, pg_timeout=180.0)
        except LaunchError as exc:
            error = str(exc)
        finally:
            prog.close()
        done = [c for c in remaining if c.name in prog.results]
        rows += [prog.results[c.name] for c in done]
        remaining = [c for c in remaining if c.name not in prog.results]
        if error is None:
            if remaining:
                raise RuntimeError(f"ranks finished without results for {[c.name for c in remaining]}")
            break
        lines = [ln for ln in error.splitlines() if ln.strip()]
        short = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "failed").strip()
        # the config in progress failed; when none had started, the launch itself is broken: fail them all
        failed = [c for c in remaining if c.name == prog.current] or list(remaining)
        for c in failed:
            log.error("%s/%s failed: %s", task, c.name, error[-3000:])
            print(f"!! {task}/{c.name} failed: {short[:300]}", file=sys.stderr)
            rows.append({"task": task, "config": c.name, "kind": c.kind, "describe": c.describe(),
                         "error": short[:500]})
        remaining = [c for c in remaining if c not in failed]
    order = {c.name: i for i, c in enumerate(cfgs)}
    return sorted(rows, key=lambda r: order[r["config"]])


def time_to_target(rows: list[dict]) -> dict[str, Any]:
    """Add ``target``, ``ttt_s`` (train seconds to reach it; None if never) and ``speedup`` to rows."""
    dense = next((r for r in rows if r["config"] == "ddp" and "final" in r), None)
    if dense is None:
        return {}
    metric = dense["metric"]
    if metric == "accuracy":
        target = dense["final"] - ACC_MARGIN
        ok = lambda v: v >= target  # noqa: E731
    else:
        target = dense["final"] * (1 + LOSS_MARGIN)
        ok = lambda v: v <= target  # noqa: E731
    for r in rows:
        if "curve" not in r:
            continue
        r["target"] = target
        hit = next((p for p in r["curve"] if p["step"] > 0 and ok(p[metric])), None)
        r["ttt_s"] = hit["time"] if hit else None
        r["ttt_step"] = hit["step"] if hit else None
    base = dense.get("ttt_s")
    for r in rows:
        if r.get("ttt_s"):
            r["speedup"] = base / r["ttt_s"] if base else None
    return {"metric": metric, "target": target, "dense_final": dense["final"], "dense_ttt_s": base}


def _fmt_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return ""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def table_rows(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        if "error" in r or "skipped" in r:
            out.append({"config": r["config"], "bytes/step": "", "ratio": "",
                        "final": r.get("error") or r.get("skipped")})
            continue
        fmt = "{:.4f}" if r["metric"] == "accuracy" else "{:.3f}"
        out.append({
            "config": r["config"],
            "bytes/step": _fmt_bytes(r["bytes_sent"]),
            "payload": _fmt_bytes(r.get("payload_bytes")),
            "sent/payload": f"{r['bytes_sent'] / r['payload_bytes']:.2f}" if r.get("payload_bytes") else "",
            "ratio": f"{r['ratio']:.1f}x",
            "steps": r["steps"],
            "step ms": f"{1000 * r['step_s']:.0f}",
            "compute ms": f"{1000 * r['compute_s']:.0f}",
            "codec ms": f"{1000 * r['compression_s']:.1f}",
            "comm ms": f"{1000 * r['comm_s']:.0f}",
            "final": fmt.format(r["final"]),
            "time to target s": f"{r['ttt_s']:.1f}" if r.get("ttt_s") else "not reached",
            "speedup vs ddp": f"{r['speedup']:.2f}x" if r.get("speedup") else "",
        })
    return out


COLUMNS = ["config", "bytes/step", "payload", "sent/payload", "ratio", "steps", "step ms", "compute ms", "codec ms", "comm ms", "final",
           "time to target s", "speedup vs ddp"]


def check_bars(rows_by_task: dict[str, list[dict]]) -> list[str]:
    """The issue's bars, evaluated on the measured rows (text lines for the summary)."""
    lines = []
    for task, rows in rows_by_task.items():
        ok = {r["config"]: r for r in rows if "final" in r}
        dense = ok.get("ddp")
        if dense is None:
            continue
        cp = [r for r in ok.values() if r["kind"] == "commpress" and r.get("ttt_s")]
        psgd = [r for r in ok.values() if r["kind"] == "torch_powersgd" and r.get("ttt_s")]
        if dense.get("ttt_s") and cp:
            best = min(cp, key=lambda r: r["ttt_s"])
            sp = dense["ttt_s"] / best["ttt_s"]
            best_ps = min(psgd, key=lambda r: r["ttt_s"]) if psgd else None
            vs = (f"best torch PowerSGD {best_ps['config']} {best_ps['ttt_s']:.1f}s"
                  if best_ps else "no torch PowerSGD config reached the target")
            verdict = "MET" if sp >= 3 and (best_ps is None or best["ttt_s"] < best_ps["ttt_s"]) else "MISSED"
            lines.append(f"- {task}: fastest commpress config to the target is {best['config']} in "
                         f"{best['ttt_s']:.1f}s vs DDP {dense['ttt_s']:.1f}s = {sp:.2f}x; {vs} "
                         f"(bar: >=3x and faster than PowerSGD hook: {verdict})")
        elif dense.get("ttt_s"):
            lines.append(f"- {task}: no commpress config reached the target")
        ident = ok.get("identity")
        if ident:
            ov = ident["step_s"] / dense["step_s"] - 1
            lines.append(f"- {task}: identity step {1000 * ident['step_s']:.0f} ms vs DDP "
                         f"{1000 * dense['step_s']:.0f} ms = {100 * ov:+.1f}% "
                         f"(bar < 5%: {'MET' if ov < 0.05 else 'MISSED'})")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.world_size < 1:
        raise SystemExit("--world-size must be >= 1")
    if args.net is not None:
        try:
            NetSpec.parse(args.net)
        except ValueError as exc:
            raise SystemExit(str(exc))
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if t not in ("digits", "lm")]
    if bad or not tasks:
        raise SystemExit(f"--tasks must be from digits, lm; got {args.tasks!r}")
    try:
        cfgs = C.resolve(args.configs, args.quick)
    except ValueError as exc:
        raise SystemExit(str(exc))
    steps = _parse_steps(args.steps, args.quick)
    size = "quick" if args.quick else "full"
    runnable, skipped = [], []
    for c in cfgs:
        reason = C.unavailable_reason(c)
        (skipped if reason else runnable).append((c, reason))
    for c, reason in skipped:
        print(f"skipping {c.name}: {reason}", file=sys.stderr)
    # ddp first: its final metric is the target and, by default, its training time every other config's budget
    runnable_cfgs = sorted((c for c, _ in runnable), key=lambda c: c.name != "ddp")

    out = results_dir("sweep", args.out)
    command = "python -m benchmarks sweep " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                 else sys.argv[1:]))
    cores = os.cpu_count()
    meta_git = _git_state()
    rows_by_task: dict[str, list[dict]] = {}
    meta: dict[str, Any] = {"command": command.strip(), "world_size": args.world_size, "net": args.net,
                            "equal_time": not args.equal_steps, "git": meta_git,
                            "cpu_cores": cores, "steps": steps, "size": size, "seed": args.seed}
    with make_cluster(args.world_size, args.net) as cluster:
        meta["network"] = cluster.describe()
        print(f"network: {meta['network']}", file=sys.stderr)
        print(f"{args.world_size} ranks x 1 thread on {cores} cores"
              + (" (oversubscribed)" if cores and args.world_size > cores else ""), file=sys.stderr)
        for task in tasks:
            rows = run_task(task, size, runnable_cfgs, steps[task], args, cluster)
            rows += [{"task": task, "config": c.name, "kind": c.kind, "describe": c.describe(),
                      "skipped": reason} for c, reason in skipped]
            meta.setdefault("targets", {})[task] = time_to_target(rows)
            info = next((r["task_info"] for r in rows if "task_info" in r), {})
            meta.setdefault("tasks", {})[task] = info
            rows_by_task[task] = rows
            meta["bars"] = check_bars(rows_by_task)
            summary = finalize(out, rows_by_task, meta)      # after every task: partial results survive
    print(summary)
    print(f"\nresults in {out}/", file=sys.stderr)
    return 0 if not any("error" in r for rows in rows_by_task.values() for r in rows) else 1


def _git_state() -> str:
    """``<commit>`` plus ``+dirty`` when commpress/ has uncommitted changes (best effort)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "commpress"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def rerender(run_dir: str | Path) -> str:
    """Rebuild ``summary.md`` of an existing ``results/sweep-*`` folder from its results.json."""
    run_dir = Path(run_dir)
    doc = json.loads((run_dir / "results.json").read_text())
    rows_by_task: dict[str, list[dict]] = {}
    for r in doc["rows"]:
        rows_by_task.setdefault(r["task"], []).append(r)
    pngs = [run_dir / n for n in ("time_to_target.png", "frontier.png", "step_time.png") if (run_dir / n).exists()]
    summary = render_summary(rows_by_task, doc["meta"], pngs)
    (run_dir / "summary.md").write_text(summary)
    return summary


def finalize(out: Path, rows_by_task: dict[str, list[dict]], meta: dict[str, Any]) -> str:
    """Write results.json / results.csv / plots / summary.md into ``out``; returns the summary."""
    all_rows = [r for rows in rows_by_task.values() for r in rows]
    write_results(out, all_rows, meta)
    _write_csv(out / "results.csv", [{k: v for k, v in r.items() if k not in ("curve", "task_info")}
                                     for r in all_rows])
    from . import plots

    pngs = plots.make_all(out, rows_by_task, meta)
    summary = render_summary(rows_by_task, meta, pngs)
    (out / "summary.md").write_text(summary)
    return summary


def _write_csv(path: Path, rows: list[dict]) -> None:
    import csv

    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def render_summary(rows_by_task: dict[str, list[dict]], meta: dict[str, Any], pngs: list[Path]) -> str:
    """The markdown the README embeds: command, setting, one table per task, the bars."""
    lines = [f"Command: `{meta['command']}` (commit {meta.get('git', '?')})", "",
             f"Setting: {meta['world_size']} ranks (gloo, 1 torch thread each) on a {meta['cpu_cores']}-core machine"
             + (" — oversubscribed, so compute per step is inflated and noisy" if (meta["cpu_cores"] or 0)
                < meta["world_size"] else "") + f"; network: {meta['network']}.",
             "Bytes are per rank per step, counted with commpress's convention (ring all_reduce of n bytes "
             "sends 2n(P-1)/P; an all_gather of n bytes sends n(P-1)); ratio = dense bytes / bytes sent; payload = what one rank's compressed gradient is by the compressor's contract (Payload.nbytes, dense parts at 4 bytes/element); sent/payload is then 2(P-1)/P (1.5 at P=4) for all_reduce, two-phase and low-rank exchanges and for sparse payloads between that and P-1 (3, all-gather), depending on the sparse algorithm the hook picks and how much the ranks' supports overlap. Step time is the median training step; "
             "bytes = median over steps; one-time costs (JIT compilation, DDP bucket rebuild) are paid in 3 untimed warm-up steps on a throwaway replica; compute = forward+backward without sync + optimizer step; codec = local compress+decompress "
             "of the gradient buckets; comm = the rest. Time to target = training seconds until the metric "
             "reaches the DDP run's final value (accuracy -0.5 points, loss +2%)."
             + (" Equal-time rule: DDP runs the given steps; every other config trains for the same training "
                "wall time as DDP (at most 4x the steps), so 'final' is the metric reached in DDP's time."
                if meta.get("equal_time") else " Every config runs the same number of steps."),
             "PyTorch powerSGD_hook configs run with one DDP bucket (bucket_cap_mb=10000): the hook "
             "deadlocks on gloo with several buckets. Other configs use DDP's default buckets.", ""]
    for task, rows in rows_by_task.items():
        info = meta.get("tasks", {}).get(task, {})
        tgt = meta.get("targets", {}).get(task, {})
        head = f"### {task}: {info.get('model', '')}, {info.get('params', 0) / 1e6:.2f}M params, " \
               f"{meta['steps'][task]} steps, {info.get('optimizer', '')}"
        lines += [head, ""]
        if tgt:
            lines += [f"Target {tgt['metric']}: {tgt['target']:.4f} (DDP final {tgt['dense_final']:.4f}).", ""]
        lines += [markdown_table(table_rows(rows), COLUMNS), ""]
    if meta.get("bars"):
        lines += ["Bars (issue 6):", ""] + meta["bars"] + [""]
    if pngs:
        lines += [f"![{pngs[0].stem.replace('_', ' ')}]({pngs[0].name})", "",
                  f"Plots: {', '.join(p.name for p in pngs)}", ""]
    return "\n".join(lines)
