"""Steps to the demo's target, read from sweep results (``python -m benchmarks.steps_to_target RESULTS.json...``).

Step counts do not depend on how loaded the machine is, so they can be measured on a
shared one.  Run the sweep with every config for the same, longer, number of steps,
e.g. ``python -m benchmarks sweep --tasks digits --configs ddp,topk-1% --steps digits=300
--equal-steps --evals 100 --seed 0``; this reads its ``results.json`` and takes the
target the demo would set, DDP's smoothed metric after ``--ddp-steps`` steps (100,
the demo's) minus 0.5 points of accuracy (plus 2% of loss), and prints, per config,
the first step at which its smoothed metric reaches it and the ratio to DDP's.
For the LM it also prints each config's smoothed loss at ``--ddp-steps`` against DDP's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from .sweep import ACC_MARGIN, LOSS_MARGIN, SMOOTH


def _smoothed(curve: list[dict], metric: str, upto: int | None = None) -> list[tuple[int, float]]:
    pts = [p for p in curve if p["step"] > 0 and (upto is None or p["step"] <= upto)]
    w = max(1, min(SMOOTH, len(pts)))
    return [(pts[i]["step"], statistics.fmean(p[metric] for p in pts[i - w + 1:i + 1]))
            for i in range(w - 1, len(pts))]


def report(rows: list[dict], ddp_steps: int) -> list[str]:
    ddp = next(r for r in rows if r["config"] == "ddp" and "curve" in r)
    metric = ddp["metric"]
    at = _smoothed(ddp["curve"], metric, ddp_steps)[-1][1]
    acc = metric == "accuracy"
    target = at - ACC_MARGIN if acc else at * (1 + LOSS_MARGIN)
    ok = (lambda v: v >= target) if acc else (lambda v: v <= target)
    hit_ddp = next(s for s, v in _smoothed(ddp["curve"], metric) if ok(v))
    lines = [f"task {ddp['task']} seed {ddp.get('seed')}: DDP's smoothed {metric} at step {ddp_steps} "
             f"{at:.4f}, target {target:.4f}, DDP reaches it at step {hit_ddp}"]
    for r in rows:
        if "curve" not in r:
            lines.append(f"  {r['config']}: {r.get('error', 'no curve')}")
            continue
        sm = _smoothed(r["curve"], metric)
        hit = next((s for s, v in sm if ok(v)), None)
        same = _smoothed(r["curve"], metric, ddp_steps)[-1][1]
        lines.append(f"  {r['config']:<22} steps to target {hit if hit else 'not reached':>5}"
                     + (f" ({hit / hit_ddp:.2f}x DDP)" if hit else f" in {r['steps']}")
                     + f"; {metric} at step {ddp_steps}: {same:.4f} ({same / at - 1:+.2%} vs DDP)")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.steps_to_target", description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="results.json files of sweep runs")
    p.add_argument("--ddp-steps", type=int, default=100, help="DDP's steps that set the target (the demo's: 100)")
    args = p.parse_args(argv)
    for path in args.results:
        with open(path) as f:
            rows = json.load(f)["rows"]
        by_task: dict[str, list[dict]] = {}
        for r in rows:
            by_task.setdefault(f"{r['task']}/{r.get('seed')}", []).append(r)
        for task_rows in by_task.values():
            print("\n".join(report(task_rows, args.ddp_steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
