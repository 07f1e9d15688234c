"""Steps of benchmarks/gpu_check.sh, run in one process (the dry run) or one per process (GPU).

    python -m benchmarks.gpu_check --out DIR [--dry-run] [--step kernels sync shared nccl]

Each step writes ``DIR/<step>.json`` (benchmarks/gpu_report.py merges them); a step that raises
is reported and the next one runs.  Exit status 1 when a step failed.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

STEPS = ("kernels", "sync", "shared", "nccl")


def run_step(step: str, out: Path, dry_run: bool) -> int:
    from benchmarks import gpu_ddp, gpu_kernels

    dry = ["--dry-run"] if dry_run else []
    if step == "kernels":
        sizes = ["9"] if dry_run else [str(s) for s in range(20, 27)]
        repeat = "1" if dry_run else "20"
        return gpu_kernels.main(["--sizes", *sizes, "--repeat", repeat, "--out", str(out / "kernels.json"), *dry])
    return gpu_ddp.main([step, "--out", str(out / f"{step}.json"), *dry])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--step", nargs="+", default=list(STEPS), choices=STEPS)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for step in args.step:
        t0 = time.perf_counter()
        print(f"=== gpu_check step {step}", flush=True)
        try:
            rc = run_step(step, args.out, args.dry_run)
        except SystemExit as exc:  # a bitwise mismatch or a missing device, with its message
            rc = exc.code if isinstance(exc.code, int) else 1
            if not isinstance(exc.code, int):
                print(f"gpu_check {step}: {exc.code}")
        except Exception:
            traceback.print_exc()
            rc = 1
        print(f"=== gpu_check step {step}: {'ok' if rc == 0 else 'FAILED'} ({time.perf_counter() - t0:.0f} s)",
              flush=True)
        if rc:
            failed.append(step)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
