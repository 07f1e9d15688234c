"""The GPU check's report: merges the steps' JSON files into one JSON and one readable table.

    python -m benchmarks.gpu_report DIR [--steps kernels sync shared nccl]

Reads ``DIR/<step>.json`` (written by benchmarks/gpu_kernels.py and benchmarks/gpu_ddp.py) and
``DIR/steps.txt`` (one ``name<TAB>status`` line per shell step of gpu_check.sh, if any), writes
``DIR/gpu-check.json`` and ``DIR/gpu-check.txt`` and prints the table.  Failures (a step that
failed or left no result, a check that failed) make the exit status 1.  Goals are judged
separately (met / missed / not measured on a dry run) and do not change the exit status:

* every elementwise op at the largest size reaches >= 70% of the HBM peak;
* top-k 1% of 2**26 runs >= 5x faster than ``torch.topk``;
* zero synchronizations in a steady-state DDP step, for every compressor.

Standard library only (it must report even when torch is broken).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STEPS = ("kernels", "sync", "shared", "nccl")
GOAL_PCT = 70.0
GOAL_TOPK = 5.0
TOPK_LOG2 = 26


def _rate(gbs: float) -> str:
    return f"{gbs:7.0f}" if gbs >= 100 else f"{gbs:7.3g}"


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def build(out: Path, steps=STEPS) -> tuple[dict, list[str]]:
    """(merged report, table lines)."""
    data = {s: _load(out / f"{s}.json") for s in steps}
    shell = []
    if (out / "steps.txt").exists():
        for line in (out / "steps.txt").read_text().splitlines():
            name, _, status = line.partition("\t")
            shell.append({"step": name, "status": status})
    failures = [f"shell step {s['step']}: {s['status']}" for s in shell
                if not s["status"].startswith(("ok", "skipped"))]
    lines = []
    dry = any(isinstance(d, dict) and d.get("dry_run") for d in data.values())
    device = next((d.get("device") for d in data.values() if isinstance(d, dict) and d.get("device")), "?")
    lines.append(f"GPU check on {device}" + ("  [DRY RUN: CPU stands in, figures mean nothing]" if dry else ""))
    goals = []

    # ---- kernels
    k = data.get("kernels")
    lines.append("")
    if "kernels" not in steps:
        pass
    elif not k:
        failures.append("kernels: no result")
        lines.append("kernels: NO RESULT")
    else:
        big = max(k["sizes"])
        lines.append(f"kernels (fp32; HBM peak {k['hbm_peak_gbs']:.0f} GB/s from {k['hbm_peak_source']}); "
                     f"GB/s and % of peak per size 2**n, x memcpy at 2**{big}")
        sizes = sorted(k["sizes"])
        head = f"{'op':28s}" + "".join(f" {'2**' + str(s):>13s}" for s in sizes) + f" {'x memcpy':>9s}"
        lines.append(head)
        by_op: dict[str, dict] = {}
        for r in k["rows"]:
            by_op.setdefault(r["op"], {})[r["log2"]] = r
        slow = []
        for op, per in by_op.items():
            cells = "".join(f" {_rate(per[s]['gbs'])} {per[s]['pct_peak']:4.0f}%" if s in per else f" {'-':>13s}"
                            for s in sizes)
            last = per.get(big)
            lines.append(f"{op:28s}{cells} {last['x_memcpy'] if last else float('nan'):8.2f}x")
            if last and last["kind"] == "elementwise" and last["pct_peak"] < GOAL_PCT:
                slow.append(f"{op} {last['pct_peak']:.0f}%")
        elementwise = [r for r in k["rows"] if r["log2"] == big and r["kind"] == "elementwise"]
        goals.append({"goal": f"every elementwise op >= {GOAL_PCT:.0f}% of HBM peak at 2**{big}",
                      "met": (not slow) if elementwise else None,
                      "detail": ("below: " + ", ".join(slow)) if slow else f"{len(elementwise)} ops"})
        tk = [r for r in k["rows"] if r["op"] == "topk 1%" and r["log2"] == TOPK_LOG2]
        if tk:
            x = tk[0]["x_faster_than_torch_topk"]
            goals.append({"goal": f"topk 1% of 2**{TOPK_LOG2} >= {GOAL_TOPK:.0f}x faster than torch.topk",
                          "met": x >= GOAL_TOPK, "detail": f"{x:.1f}x"})
        else:
            goals.append({"goal": f"topk 1% of 2**{TOPK_LOG2} >= {GOAL_TOPK:.0f}x faster than torch.topk",
                          "met": None, "detail": f"2**{TOPK_LOG2} not measured"})

    # ---- sync
    s = data.get("sync")
    lines.append("")
    if "sync" not in steps:
        pass
    elif not s:
        failures.append("sync: no result")
        lines.append("sync check: NO RESULT")
    else:
        lines.append("steady-state DDP step under torch.cuda.set_sync_debug_mode('error') (overlap on)")
        lines.append(f"{'compressor':28s} {'result':10s} ops not on the cuda kernels "
                     "(a sync of plain DDP is torch's own)")
        syncing = []
        for r in s["rows"]:
            if not r["ok"]:
                failures.append(f"sync: {r['config']} crashed")
                status = "CRASHED"
            elif r["sync_free"]:
                status = "sync-free"
            else:
                status = "SYNCS"
                if r.get("compressor") is not None:  # plain DDP's own sync is torch's, not a goal
                    syncing.append(r["config"])
            off = sorted(op for op, b in r.get("backends", {}).items() if b != "cuda")
            lines.append(f"{r['config']:28s} {status:10s} {', '.join(off) or '-'}")
        if s.get("missing_configs"):
            failures.append(f"sync: compressors not covered: {s['missing_configs']}")
        goals.append({"goal": "zero syncs in a steady-state step, every compressor",
                      "met": not syncing, "detail": ("syncing: " + ", ".join(syncing)) if syncing
                      else f"{len(s['rows'])} configs"})

    # ---- DDP training runs
    for name, title in (("shared", "2 ranks sharing one GPU, gloo, CUDA tensors, overlap on"),
                        ("nccl", "2 GPUs, NCCL")):
        d = data.get(name)
        lines.append("")
        if name not in steps:
            continue
        if not d:
            failures.append(f"{name}: no result")
            lines.append(f"DDP {title}: NO RESULT")
            continue
        if d.get("skipped"):
            lines.append(f"DDP {title}: skipped ({d['skipped']})")
            continue
        lines.append(f"DDP {title}:" + ("" if d.get("checks") else f" FAILED: {d.get('error', '?')[-800:]}"))
        for c in d.get("checks", []):
            lines.append(f"  {'PASS' if c['ok'] else 'FAIL'}  {c['check']}")
            if not c["ok"]:
                failures.append(f"{name}: {c['check']}")
        if not d.get("ok", False) and not d.get("checks"):
            failures.append(f"{name}: {str(d.get('error', 'failed'))[:200]}")

    # ---- goals and failures
    lines.append("")
    lines.append("goals" + (" (dry run: not judged)" if dry else ""))
    for g in goals:
        state = "n/a" if dry or g["met"] is None else "MET" if g["met"] else "MISSED"
        lines.append(f"  {state:7s} {g['goal']}: {g['detail']}")
    lines.append("")
    if shell:
        lines.append("shell steps: " + "; ".join(f"{x['step']}: {x['status']}" for x in shell))
    lines.append(("FAILED: " + "; ".join(failures)) if failures else "all checks passed")
    report = {"device": device, "dry_run": dry, "failures": failures, "goals": goals, "shell_steps": shell,
              "steps": data}
    return report, lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    args = ap.parse_args(argv)
    report, lines = build(args.out, tuple(args.steps))
    (args.out / "gpu-check.json").write_text(json.dumps(report, indent=1))
    (args.out / "gpu-check.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwrote {args.out / 'gpu-check.json'} and {args.out / 'gpu-check.txt'}")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
