"""The training sweep end to end on loopback with a tiny configuration, and its pure helpers."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import configs as C  # noqa: E402
from benchmarks import sweep  # noqa: E402
from benchmarks.__main__ import main as bench_main  # noqa: E402


def test_cli_lists_suites_and_reports_missing_ones(capsys):
    assert bench_main(["--help"]) == 0
    out = capsys.readouterr().out
    for suite in ("compressors", "collectives", "kernels", "sweep"):
        assert suite in out
    assert bench_main(["nosuch"]) == 2


def test_resolve_configs():
    assert [c.name for c in C.resolve("ddp,torch", False)][:2] == ["ddp", "torch-fp16"]
    assert len({c.name for c in C.resolve("all,ddp", False)}) == len(C.ALL)
    with pytest.raises(ValueError, match="unknown config"):
        C.resolve("ddp,nope", False)
    assert C.BY_NAME["torch-powersgd-r2"].bucket_cap_mb == C.ONE_BUCKET_MB
    assert C.BY_NAME["ddp"].bucket_cap_mb is None


def test_torch_powersgd_payload_mirrors_the_hook():
    import torch

    params = [torch.zeros(100, 50), torch.zeros(50), torch.zeros(3, 3), torch.zeros(8, 2, 5)]
    unc, ps, qs = C.torch_powersgd_payload(params, rank=2)
    # 100x50: (150)*2*2 < 5000 -> compressed; 50: 1-D; 3x3: (6*2*2=24) >= 9 -> dense; 8x10: 18*2*2=72 < 80
    assert (ps, qs) == (100 * 2 + 8 * 2, 50 * 2 + 10 * 2)
    assert unc == 50 + 9
    b = C.hook_bytes(C.BY_NAME["torch-fp16"], params, 4)
    n = sum(p.numel() for p in params)
    assert b["payload_bytes"] == 2 * n and b["bytes_sent"] == 2 * 2 * n * 3 // 4


def test_time_to_target():
    curve = lambda vals: [{"step": i, "time": float(i), "accuracy": v} for i, v in enumerate(vals)]  # noqa: E731
    rows = [{"config": "ddp", "metric": "accuracy", "final": 0.9, "curve": curve([0.1, 0.5, 0.896, 0.9])},
            {"config": "fast", "metric": "accuracy", "final": 0.95, "curve": curve([0.1, 0.95, 0.95, 0.95])},
            {"config": "slow", "metric": "accuracy", "final": 0.8, "curve": curve([0.1, 0.5, 0.7, 0.8])}]
    meta = sweep.time_to_target(rows)
    assert meta["target"] == pytest.approx(0.895)
    assert rows[0]["ttt_s"] == 2.0 and rows[1]["ttt_s"] == 1.0 and rows[2]["ttt_s"] is None
    assert rows[1]["speedup"] == pytest.approx(2.0)


@pytest.mark.timeout(150)
def test_tiny_sweep_writes_results(tmp_path):
    names = ["ddp", "torch-fp16"] + (["identity"] if C.unavailable_reason(C.BY_NAME["identity"]) is None else [])
    rc = sweep.main(["--quick", "--world-size", "2", "--tasks", "digits", "--steps", "4", "--evals", "2",
                     "--configs", ",".join(names), "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    (run_dir,) = list(tmp_path.iterdir())
    doc = json.loads((run_dir / "results.json").read_text())
    rows = doc["rows"]
    assert [r["config"] for r in rows] == names
    for r in rows:
        assert "error" not in r, r
        assert r["steps"] >= 2 and len(r["curve"]) >= 2
        assert r["curve"][-1]["step"] == r["steps"]
        assert 0.0 <= r["final"] <= 1.0
        assert r["bytes_sent"] > 0 and r["step_s"] > 0
    dense = rows[0]
    assert dense["steps"] == 4                     # ddp runs --steps; the others get its training time
    assert all(r["time_budget_s"] == pytest.approx(dense["train_time_s"]) for r in rows[1:])
    assert dense["bytes_sent"] == dense["dense_bytes"]
    assert rows[1]["bytes_sent"] == dense["bytes_sent"] // 2          # fp16: 2 bytes per element
    with open(run_dir / "results.csv") as f:
        assert [r["config"] for r in csv.DictReader(f)] == names
    for png in ("time_to_target.png", "frontier.png", "step_time.png"):
        assert (run_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (run_dir / "summary.md").read_text()
    assert "| config |" in summary and "python -m benchmarks sweep" in summary
