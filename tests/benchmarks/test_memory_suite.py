"""The memory suite end to end at tiny widths: result structure only (no timing or exact-value goals)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import memory  # noqa: E402
from benchmarks.__main__ import SUITES  # noqa: E402


def _finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x)


def test_registered_and_configs_known():
    assert "memory" in SUITES
    names = memory.available_configs()
    for name in ("ddp", "fsdp", "torch-powersgd", "identity", "fp16", "blockquant8", "blockquant4", "topk", "dgc",
                 "powersgd", "auto", "auto-opt", "topk-opt", "fsdp-blockquant4", "fsdp-topk"):
        assert name in names
    for name in names:   # every non-baseline has a baseline of its own kind and optimizer
        spec = memory.CONFIGS[name]
        if spec["baseline"]:
            base = memory.CONFIGS[spec["baseline"]]
            assert base["baseline"] is None and base["kind"] == spec["kind"] and base["opt"] == spec["opt"]
    # the residual_storage configs appear exactly when register() takes the option
    has = memory.residual_storage_supported("ddp")
    assert ("blockquant4-int8res" in names) == has


@pytest.mark.timeout(90)
def test_tiny_run_writes_json_with_the_fields(tmp_path):
    assert memory.main(["--configs", "topk,fsdp-topk", "--sizes", "64,128", "--steps", "2",
                        "--out", str(tmp_path)]) == 0
    out = next(tmp_path.glob("memory-*"))
    doc = json.loads((out / "results.json").read_text())
    assert (out / "results.csv").exists() and "| config |" in (out / "table.md").read_text()
    rows = {r["config"]: r for r in doc["rows"]}
    assert list(rows) == ["ddp", "fsdp", "topk", "fsdp-topk"]   # the baselines are added, first
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["malloc_env"] == memory.MALLOC_ENV     # the ranks started with it
        assert len(r["n_params"]) == 2 and r["n_params"][0] < r["n_params"][1]
        assert _finite(r["total_bytes_per_param"]) and _finite(r["measured_bytes_per_param"])
        assert _finite(r["hwm_bytes_per_param"])
    # the plain baselines: their own overhead is 0 by definition, their total slope is computed
    assert rows["ddp"]["measured_bytes_per_param"] == 0.0 and rows["ddp"]["total_bytes_per_param"] > 0
    assert "reported_bytes_per_param" not in rows["ddp"]
    for name in ("topk", "fsdp-topk"):
        assert _finite(rows[name]["reported_bytes_per_param"]) and rows[name]["reported_bytes_per_param"] > 0
        assert rows[name]["baseline"] in ("ddp", "fsdp")
    frac = rows["fsdp-topk"]["fraction_of_sharded_state"]
    assert set(frac) == {"2", "8", "64"} and all(_finite(v) for v in frac.values())
    assert rows["fsdp-topk"]["scaling_world"] == 4


def test_slope_and_baselines():
    assert memory._slope([1.0, 3.0], [10.0, 14.0]) == 2.0
    assert memory._with_baselines(["topk-opt", "topk", "fsdp-topk"]) == ["ddp-sgdm", "ddp", "fsdp", "topk-opt",
                                                                         "topk", "fsdp-topk"]
