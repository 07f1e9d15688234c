"""The pipeline suite end to end with tiny settings on loopback: structure, both modes run (no timing goals)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import pipeline  # noqa: E402
from benchmarks.__main__ import SUITES  # noqa: E402


@pytest.mark.timeout(120)
def test_tiny_run_has_both_modes_and_their_rounds():
    assert "pipeline" in SUITES
    rows = pipeline.run_suite([4096], net=None, steps=4, compute_ms=0.0)
    assert [r["mode"] for r in rows] == list(pipeline.MODES)
    one, piped = rows
    assert one["collective_rounds"] == 1 and piped["collective_rounds"] == 2   # one all_gather per chunk at P=2
    assert one["vs_one_message"] == 1
    for r in rows:
        assert math.isfinite(r["call_ms"]) and r["call_ms"] > 0, r
