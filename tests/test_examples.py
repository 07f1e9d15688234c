"""The distributed examples in examples/ run as a user runs them (2 gloo ranks, one process each).

The torchrun examples honour ``COMMPRESS_INIT_METHOD``: here a ``file://`` store (no
ports), with ``RANK`` / ``WORLD_SIZE`` set as torchrun would.  The Lightning example
runs only where Lightning is installed (``pip install lightning``; it launches its
ranks itself, on loopback); the Hugging Face examples only where the ``hf`` extra is
(``pip install "commpress[hf]"``: transformers and accelerate).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def start_ranks(script: str, args: list[str], tmp_path: Path, world: int = 2,
                env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Start ``examples/<script>`` on ``world`` ranks with a fresh file store."""
    store = tmp_path / f"store-{os.urandom(4).hex()}"
    return [subprocess.Popen([sys.executable, str(EXAMPLES / script), *args], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=_env(COMMPRESS_INIT_METHOD=f"file://{store}", RANK=str(r), LOCAL_RANK=str(r),
                                      WORLD_SIZE=str(world), **(env or {})))
            for r in range(world)]


def finish_ranks(procs: list[subprocess.Popen], script: str, timeout: float = 150) -> str:
    """Wait for the ranks of :func:`start_ranks` (killed after ``timeout``); rank 0's stdout."""
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} of {script} failed:\n{out[-3000:]}"
    return outs[0]


def run_ranks(script: str, args: list[str], tmp_path: Path, world: int = 2, timeout: float = 150,
              env: dict[str, str] | None = None) -> str:
    """Run ``examples/<script>`` on ``world`` ranks with a fresh file store; rank 0's stdout."""
    return finish_ranks(start_ranks(script, args, tmp_path, world, env), script, timeout)


def _result(out: str) -> dict[str, str]:
    line = next(ln for ln in out.splitlines() if ln.startswith("step "))
    return dict(re.findall(r"(\S+) (\S+)", line))


@pytest.mark.timeout(600)
def test_ddp_example_trains_and_resumes_bitwise(tmp_path):
    ckpt = tmp_path / "ckpt"
    # the uninterrupted run and the first half side by side (their ranks mostly import and wait)
    whole_ranks = start_ranks("ddp_train.py", ["--steps", "8"], tmp_path)
    half_ranks = start_ranks("ddp_train.py", ["--steps", "4", "--ckpt", str(ckpt)], tmp_path)
    try:
        whole = _result(finish_ranks(whole_ranks, "ddp_train.py"))
        half = _result(finish_ranks(half_ranks, "ddp_train.py"))
    finally:
        for p in half_ranks:
            if p.poll() is None:
                p.kill()
    assert (ckpt / "step00000004-rank0.pt").exists() and (ckpt / "step00000004-rank1.pt").exists()
    resumed = _result(run_ranks("ddp_train.py", ["--steps", "8", "--ckpt", str(ckpt)], tmp_path))
    assert float(whole["ratio"].rstrip("x")) > 2.0          # blockquant 8-bit went compressed
    assert half["params-crc32"] != whole["params-crc32"]
    assert resumed["params-crc32"] == whole["params-crc32"]  # resume continues bitwise
    assert resumed["loss"] == whole["loss"]
    assert resumed["opt-crc32"] == whole["opt-crc32"] and resumed["hook-crc32"] == whole["hook-crc32"]
    assert whole["replicas-identical"] == "True"


@pytest.mark.timeout(600)
def test_fsdp_example_trains_compressed_and_resumes_bitwise(tmp_path):
    ckpt = tmp_path / "ckpt"
    whole_ranks = start_ranks("fsdp_train.py", ["--steps", "6", "--all-gather"], tmp_path)
    half_ranks = start_ranks("fsdp_train.py", ["--steps", "3", "--all-gather", "--ckpt", str(ckpt)], tmp_path)
    try:
        res = _result(finish_ranks(whole_ranks, "fsdp_train.py"))
        half = _result(finish_ranks(half_ranks, "fsdp_train.py"))
    finally:
        for p in half_ranks:
            if p.poll() is None:
                p.kill()
    assert float(res["ratio"].rstrip("x")) > 2.0
    assert float(res["loss"]) == float(res["loss"])   # finite, not NaN
    assert (ckpt / "step00000003-rank0.pt").exists() and (ckpt / "step00000003-rank1.pt").exists()
    resumed = _result(run_ranks("fsdp_train.py", ["--steps", "6", "--all-gather", "--ckpt", str(ckpt)], tmp_path))
    assert half["params-crc32"] != res["params-crc32"]
    for key in ("params-crc32", "opt-crc32", "hook-crc32", "loss"):   # every rank's shards, bitwise
        assert resumed[key] == res[key], key


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                    reason="Lightning is not installed (optional: pip install lightning)")
def test_lightning_example_binds_the_hook_through_ddp_strategy():
    out = subprocess.run([sys.executable, str(EXAMPLES / "lightning_train.py"), "--devices", "2", "--steps", "6"],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    res = _result(out.stdout)
    assert res["bound"] == "True" and res["steps"] == "6"
    assert float(res["ratio"].rstrip("x")) > 2.0


HF_MISSING = importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None
needs_hf = pytest.mark.skipif(HF_MISSING, reason='the hf extra is not installed (pip install "commpress[hf]")')
# as torchrun sets them (accelerate reads LOCAL_WORLD_SIZE); no hub access; small tensors: the reference ops
HF_ENV = {"LOCAL_WORLD_SIZE": "2", "HF_HUB_OFFLINE": "1", "COMMPRESS_BACKEND": "torch",
          "TOKENIZERS_PARALLELISM": "false"}


def _hook_files_hold_residuals(folder: Path) -> None:
    import torch

    for r in range(2):
        state = torch.load(folder / f"commpress_rank{r}.pt", weights_only=True)
        assert state["rank"] == r and state["world_size"] == 2 and state["step"] > 0
        residuals = state["codec"]["residuals"]["tensors"]
        assert any(float(t.abs().sum()) > 0 for t in residuals), f"rank {r}: no non-zero residual saved"


@needs_hf
@pytest.mark.timeout(300)
def test_hf_trainer_example_resumes_bitwise(tmp_path):
    """One 2-rank launch: train 6 steps (checkpoints at 3 and 6, gradient accumulation 2,
    find_unused_parameters), resume from step 3 in a fresh Trainer, and once more without the hook files."""
    out = tmp_path / "out"
    res = _result(run_ranks("hf_trainer.py", ["--steps", "6", "--save-steps", "3", "--grad-accum", "2",
                                              "--find-unused", "--check-resume", "--out", str(out)],
                            tmp_path, timeout=280, env=HF_ENV))
    assert res["bound"] == "True" and res["step"] == "6"
    assert float(res["ratio"].rstrip("x")) > 2.0                # blockquant 8-bit went compressed
    assert res["replicas-identical"] == "True"
    assert res["resumed-bitwise"] == "True"                     # residuals restored from checkpoint-3
    assert res["zero-residuals-differ"] == "True"               # ... and they matter
    for step in (3, 6):
        _hook_files_hold_residuals(out / f"checkpoint-{step}")


@needs_hf
@pytest.mark.timeout(300)
def test_accelerate_example_resumes_bitwise(tmp_path):
    """One 2-rank launch: save_state at step 3 of 6, then load_state and train the second half again."""
    ckpt = tmp_path / "ckpt"
    res = _result(run_ranks("accelerate_train.py", ["--steps", "6", "--grad-accum", "2", "--check-resume",
                                                    "--ckpt", str(ckpt)], tmp_path, timeout=280, env=HF_ENV))
    assert float(res["ratio"].rstrip("x")) > 2.0
    assert res["replicas-identical"] == "True"
    assert res["resumed-bitwise"] == "True"
    _hook_files_hold_residuals(ckpt)
