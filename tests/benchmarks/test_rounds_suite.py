"""The rounds suite end to end with tiny settings: its structure (no timing goals)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import rounds  # noqa: E402
from benchmarks.__main__ import SUITES  # noqa: E402


@pytest.mark.timeout(180)
def test_tiny_run_times_every_round_and_every_ddp_configuration():
    assert "rounds" in SUITES
    rows = rounds.run(calls=3, steps=2, pin=False, warmup=2)
    collectives = [r for r in rows if "bytes" in r]
    assert [(r["op"], r["bytes"]) for r in collectives] == [(op, b) for b in rounds.SIZES
                                                           for op in ("all_gather", "all_reduce")]
    steps = [r for r in rows if "step_ms" in r]
    assert [r["op"] for r in steps] == ["DDP default (2 buckets)", "DDP bucket_cap_mb=25 (1 bucket)",
                                        "PyTorch allreduce_hook (2 buckets)", "commpress identity (2 buckets)"]
    for r in collectives:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("wall_ms", "mean_ms")), r
        assert r["cpu_ms"] >= 0
    assert all(math.isfinite(r["step_ms"]) and r["step_ms"] > 0 for r in steps)


def test_main_rejects_nonpositive_counts(capsys):
    with pytest.raises(SystemExit):
        rounds.main(["--calls", "0"])
    assert "--calls and --steps must be >= 1" in capsys.readouterr().err
