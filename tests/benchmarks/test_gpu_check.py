"""``bash benchmarks/gpu_check.sh --dry-run`` end to end: the GPU check's own code runs in CI.

The dry run takes every step of the GPU run on CPU (host build of kernels/*.cu standing in for the
GPU, small sizes), so a GPU session only measures.  Checked here: exit status 0, the one JSON and
the table with every section, each kernel case checked and timed, every registered compressor
through the sync check on the cuda backend, the 2-rank DDP checks passing; and that a failed step
makes the report (and so the script) fail.  No timing is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_ddp, gpu_kernels, gpu_report  # noqa: E402


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    if not __import__("shutil").which("g++"):
        pytest.skip("no C++ compiler for the host build (kernels/host_check.sh installs g++)")
    out = tmp_path_factory.mktemp("gpu-check")
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_check.sh"), "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return proc, out


@pytest.mark.timeout(620)
def test_dry_run_passes_and_reports_every_section(dry_run):
    proc, out = dry_run
    log = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    assert "all checks passed" in proc.stdout and "gpu_check: all steps passed" in proc.stdout, log
    report = json.loads((out / "gpu-check.json").read_text())
    table = (out / "gpu-check.txt").read_text()
    assert report["dry_run"] and report["failures"] == []
    for section in ("kernels (fp32", "set_sync_debug_mode", "2 ranks sharing one GPU", "2 GPUs, NCCL: skipped",
                    "goals"):
        assert section in table, section
    kernels = report["steps"]["kernels"]["rows"]
    import torch

    x = torch.randn(64)
    from commpress.ops import cuda_backend, reference

    names = [c[0].strip() for c in gpu_kernels.cases(cuda_backend, reference, x)]
    assert sorted(r["op"] for r in kernels) == sorted(names)
    assert all(r["ms"] > 0 and r["x_memcpy"] > 0 for r in kernels)
    sync = report["steps"]["sync"]
    assert [r["config"] for r in sync["rows"]] == [c[0] for c in gpu_ddp.CONFIGS]
    assert sync["missing_configs"] == [] and all(r["ok"] for r in sync["rows"])
    for row in sync["rows"]:  # the compressors' ops ran on the (host-built) kernels where they exist
        ran = row["backends"]
        assert ran or row["compressor"] in (None, "identity", "fp16", "bf16", "powersgd", "sparseloco"), row  # torch ops only
        for op in ("fp8_quantize", "mx_quantize", "qsgd_quantize", "level_quantize", "sign_pack_feedback",
                   "block_quantize", "topk_compact"):
            assert ran.get(op, "cuda") == "cuda", (row["config"], ran)
    by = {r["config"]: r["backends"] for r in sync["rows"]}
    assert "sign_pack_feedback" in by["signsgd (EF)"] and "mx_quantize" in by["mx fp8"]
    shared = report["steps"]["shared"]
    assert shared["ok"] and len(shared["checks"]) >= 12
    assert {g["goal"].split(" ")[0] for g in report["goals"]} >= {"every", "topk", "zero"}


def test_report_fails_on_a_failed_step(dry_run, tmp_path):
    _, out = dry_run
    for name in ("kernels.json", "sync.json", "nccl.json"):
        (tmp_path / name).write_text((out / name).read_text())
    shared = json.loads((out / "shared.json").read_text())
    shared["checks"][0]["ok"] = False
    shared["ok"] = False
    (tmp_path / "shared.json").write_text(json.dumps(shared))
    (tmp_path / "steps.txt").write_text("kernels\tok\nsync\tTIMED OUT after 60s\n")
    assert gpu_report.main([str(tmp_path)]) == 1
    failures = json.loads((tmp_path / "gpu-check.json").read_text())["failures"]
    assert any("TIMED OUT" in f for f in failures) and any(f.startswith("shared:") for f in failures)
    (tmp_path / "kernels.json").unlink()
    report, _ = gpu_report.build(tmp_path)
    assert "kernels: no result" in report["failures"]


def test_every_compressor_has_a_sync_config():
    assert gpu_ddp.check_coverage() == []


def test_sync_goal_counts_compressors_not_the_plain_ddp_baseline(tmp_path):
    rows = [{"config": "plain DDP (no hook)", "compressor": None, "ok": True, "sync_free": False},
            {"config": "identity", "compressor": "identity", "ok": True, "sync_free": True}]
    (tmp_path / "sync.json").write_text(json.dumps({"device": "GPU", "rows": rows, "missing_configs": []}))
    report, _ = gpu_report.build(tmp_path, ("sync",))
    assert report["goals"][0]["met"] is True  # torch's own sync in plain DDP is not commpress's
    rows.append({"config": "topk 1%", "compressor": "topk", "ok": True, "sync_free": False})
    (tmp_path / "sync.json").write_text(json.dumps({"device": "GPU", "rows": rows, "missing_configs": []}))
    report, _ = gpu_report.build(tmp_path, ("sync",))
    assert report["goals"][0]["met"] is False and "topk 1%" in report["goals"][0]["detail"]


def test_kernel_checks_run_the_reference_on_the_host():
    from commpress.ops import reference as ref

    seen = []

    class Spy:
        def block_absmax(self, x, block):
            seen.append(x.device.type)
            return ref.block_absmax(x, block)

    x = torch.randn(1000)
    got = gpu_kernels.OnHost(Spy()).block_absmax(x, 64)
    assert seen == ["cpu"] and torch.equal(got, ref.block_absmax(x, 64))
    gpu_kernels.same((got, got), (got, got.clone()), "same")
    other = got.clone()
    other[3] = other[3] + 1
    with pytest.raises(SystemExit, match=r"same\[1\]: 1 of \d+ differ .* first at 3"):
        gpu_kernels.same((got, got), (got, other), "same")


def test_report_judges_only_the_steps_asked_for(tmp_path):
    rows = [{"config": "identity", "compressor": "identity", "ok": True, "sync_free": True}]
    (tmp_path / "sync.json").write_text(json.dumps({"device": "GPU", "rows": rows, "missing_configs": []}))
    report, _ = gpu_report.build(tmp_path, ("sync",))
    assert report["failures"] == []  # no kernels.json, and kernels were not asked for
    report, _ = gpu_report.build(tmp_path, ("kernels", "sync"))
    assert report["failures"] == ["kernels: no result"]
