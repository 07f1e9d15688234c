"""Elastic restart under ``torchrun``: a worker SIGKILLed mid-run, the run resumes bitwise.

``examples/ddp_train.py`` runs twice side by side under ``torchrun --standalone`` (a c10d
rendezvous on a port the OS picks, 2 local gloo workers): once uninterrupted, once with
``--max-restarts=1 --save-every 4 --kill-at 10``, where the last rank sends itself SIGKILL
after step 10 on the first attempt.  torchrun restarts both workers, they resume from the
newest complete checkpoint (step 8) and must end with the same parameters, optimizer state
and every rank's commpress state, bit for bit.  Skipped where torchrun cannot run here.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "ddp_train.py"
STEPS, SAVE_EVERY, KILL_AT = 16, 4, 10


def _why_no_torchrun() -> str | None:
    """None when ``python -m torch.distributed.run`` with gloo on 127.0.0.1 can work here, else why not."""
    if not sys.platform.startswith("linux"):
        return f"torchrun's elastic agent is exercised on Linux only (this is {sys.platform})"
    if importlib.util.find_spec("torch.distributed.run") is None:
        return "torch.distributed.run (torchrun) is not importable"
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return "torch.distributed with gloo is not available in this build"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
    except OSError as exc:
        return f"cannot bind a TCP socket on 127.0.0.1 ({exc})"
    return None


pytestmark = pytest.mark.skipif(_why_no_torchrun() is not None, reason=str(_why_no_torchrun()))


def _example():
    spec = importlib.util.spec_from_file_location("ddp_train_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _torchrun(args: list[str], torchrun_args: list[str] = ()) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "COMMPRESS_INIT_METHOD")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["OMP_NUM_THREADS"] = "1"
    # a fresh worker store per restart: the agent's shared one keeps the dead workers' gloo addresses
    # (pytorch/pytorch#135712); the documented recipe (docs/multinode.md) sets it too
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           *torchrun_args, str(EXAMPLE), *args]
    # own session: on a timeout the agent and its workers go together
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out = proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{out[-4000:]}"
    return out


def _result(out: str) -> dict[str, str]:
    line = next(ln for ln in out.splitlines() if ln.startswith("step "))
    return dict(re.findall(r"(\S+) (\S+)", line))


def test_newest_complete_checkpoint_wins(tmp_path):
    ex = _example()
    for step, ranks in ((4, (0, 1)), (8, (0, 1)), (12, (0,))):     # 12: rank 1 died before its rename
        for r in ranks:
            Path(ex.ckpt_file(str(tmp_path), step, r)).touch()
    (tmp_path / "step00000016-rank1.pt.tmp123").touch()             # a write cut short
    assert ex.newest_complete(str(tmp_path), 2) == 8
    assert ex.newest_complete(str(tmp_path), 1) == 12
    assert ex.newest_complete(str(tmp_path / "missing"), 2) is None


@pytest.mark.timeout(240)
def test_sigkilled_worker_restarts_and_resumes_bitwise(tmp_path):
    ckpt = tmp_path / "ckpt"
    whole = _torchrun(["--steps", str(STEPS)])
    elastic = _torchrun(["--steps", str(STEPS), "--ckpt", str(ckpt), "--save-every", str(SAVE_EVERY),
                         "--kill-at", str(KILL_AT)], ["--max-restarts=1"])
    try:
        whole_out = _finish(whole, 200)
    finally:
        elastic_out = _finish(elastic, 200)
    ref, res = _result(whole_out), _result(elastic_out)

    assert "exitcode: -9" in elastic_out, elastic_out[-3000:]       # the worker died of SIGKILL ...
    last_saved = KILL_AT // SAVE_EVERY * SAVE_EVERY
    assert f"resumed at step {last_saved} (TORCHELASTIC_RESTART_COUNT=1)" in elastic_out, elastic_out[-3000:]   # ... and came back
    assert float(ref["ratio"].rstrip("x")) > 2.0                     # blockquant 8-bit went compressed
    assert ref["replicas-identical"] == res["replicas-identical"] == "True"
    for key in ("params-crc32", "opt-crc32", "hook-crc32", "loss"):
        assert res[key] == ref[key], f"{key}: resumed {res[key]} != uninterrupted {ref[key]}"
    # only the final checkpoint is kept, and no temporary file is left behind
    assert sorted(p.name for p in ckpt.iterdir()) == [f"step{STEPS:08d}-rank0.pt", f"step{STEPS:08d}-rank1.pt"]
