"""A rank exits cleanly after commpress collectives: exit code 0, no "terminate called" (SIGABRT).

A worker thread (the DDP hook's overlap executor, DiLoCo's exchanges) still running when the
interpreter finalizes is ended by ``pthread_exit`` where it stands; inside C++ that must not
unwind (completing a bucket's future releases its callback under a re-acquired GIL; the GIL
taken back after a gloo collective) that is ``std::terminate``.  commpress joins its workers
in an ``atexit`` hook (``commpress/_worker.py``).  The race is narrow, so many short runs:
this file is also their driver.  One process imports torch and commpress once and forks
pairs of ranks; each rank runs a short script (DDP hook bound + 2 steps, or DiLoCo with an
exchange in flight) and then *exits as a script does*: its ``SystemExit`` unwinds to the top
and the interpreter finalizes (multiprocessing's workers leave through ``os._exit`` and never
finalize, so tests/distributed.py cannot show this).  Without the exit hook, 40 runs had 3
aborts in the "diloco" runs and "ddp-late" aborted 11 ranks of 12.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: runs of a 2-rank pair: each is a fork, a FileStore rendezvous, 2-3 steps and a whole interpreter
#: exit, about 1.5 s on 2 cores that others share (load 10): 30 runs and the driver's imports
#: stay under 60 s
RUNS = 30
#: "ddp" and "diloco" leave without close(); "ddp-late" widens the DDP worker's window (without the
#: fix it aborts almost every time, "diloco" about one run in three, "ddp" rarely)
MODES = ("ddp-late", "diloco", "ddp", "ddp-close")


def _rank(rank: int, store: str, mode: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpress

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    g = torch.Generator().manual_seed(rank)
    if mode.startswith("ddp"):
        model = DDP(net)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        state = commpress.ddp.register(model, "blockquant", bits=8, min_numel=16)  # overlap (a worker)
        for step in range(2):  # the first step is dense, the second goes through the worker
            if step == 1 and mode == "ddp-late":
                _late_callbacks()
            opt.zero_grad()
            model(torch.randn(8, 32, generator=g)).sum().backward()
            if step == 0:
                opt.step()   # after the last backward the rank goes straight to its exit
        assert state.overlap
        if mode == "ddp-close":
            state.close()
            dist.destroy_process_group()
    else:  # an exchange still in flight on the worker at exit (no close())
        dl = commpress.diloco.DiLoCo(net, torch.optim.SGD(net.parameters(), lr=0.05), sync_every=3, overlap=1)
        for _ in range(3):
            net(torch.randn(8, 32, generator=g)).sum().backward()
            dl.step()
            dl.zero_grad()
        assert len(dl._in_flight) == 1
    # no close(), no destroy_process_group(): a script that forgets them must still exit cleanly


def _late_callbacks() -> None:
    """Widen the race the DDP worker loses at exit: one more callback on each bucket's future,
    run by the worker after DDP's backward has its result (so after the main thread may have
    left), that takes 0.2 s; it returns to C++, which re-acquires the GIL (a daemon thread
    that does so during finalization is ended there: without the exit hook, SIGABRT)."""
    from commpress.hooks import ddp as hooks_ddp

    hook = hooks_ddp._hook

    def late(*args, **kwargs):
        fut = hook(*args, **kwargs)
        fut.then(lambda _: time.sleep(0.2))
        return fut

    hooks_ddp._hook = late


def _wait(pids: list[int], deadline: float) -> list[int]:
    """The exit code of each pid (``-N``: killed by signal N); the ones still running at
    ``deadline`` are killed (``-9``)."""
    out: dict[int, int] = {}
    while True:
        for pid in pids:
            if pid not in out:
                got, status = os.waitpid(pid, os.WNOHANG)
                if got:
                    out[pid] = os.waitstatus_to_exitcode(status)
        if len(out) == len(pids):
            return [out[p] for p in pids]
        if time.monotonic() > deadline:
            for pid in set(pids) - set(out):
                os.kill(pid, 9)
        time.sleep(0.01)


def main(runs: int, per_run: float, modes: tuple[str, ...] = MODES) -> None:
    """Fork ``runs`` pairs of ranks, one pair at a time; print one JSON line: the failures."""
    os.environ.setdefault("COMMPRESS_BACKEND", "torch")   # tiny tensors: the reference ops, no JIT
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch._dynamo  # noqa: F401 - DDP's constructor imports it: once, here, not per rank
    import torch.distributed  # noqa: F401

    import commpress  # noqa: F401
    import commpress.diloco  # noqa: F401

    torch.set_num_threads(1)
    # the imports' objects out of the collector's reach, as a server that forks workers does: a
    # rank's exit is still the interpreter's whole finalization, without collecting (and copying,
    # page by page) the parent's heap: about 1 s instead of 4 on 2 busy cores
    gc.freeze()
    parent = os.getpid()
    failures = []
    t0 = time.monotonic()
    tmp = tempfile.mkdtemp()   # no with-block: a rank's SystemExit unwinds this frame too
    for i in range(runs):
        mode = modes[i % len(modes)]
        store = os.path.join(tmp, f"store{i}")
        logs = [os.path.join(tmp, f"run{i}-rank{r}.log") for r in range(2)]
        pids = []
        for r in range(2):
            pid = os.fork()
            if pid == 0:  # the rank: its output to its log, then the script's own exit
                fd = os.open(logs[r], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                code = 0
                try:
                    _rank(r, store, mode)
                except BaseException:  # noqa: BLE001 - reported through the exit code and log
                    import traceback

                    traceback.print_exc()
                    code = 3
                sys.exit(code)   # unwinds main() and the caller: the interpreter finalizes
            pids.append(pid)
        codes = _wait(pids, time.monotonic() + per_run)
        for r, (code, log) in enumerate(zip(codes, logs)):
            text = Path(log).read_text(errors="replace")
            if code != 0 or "terminate called" in text:
                failures.append({"run": i, "mode": mode, "rank": r, "exit_code": code, "log": text[-1500:]})
    assert os.getpid() == parent
    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"runs": runs, "seconds": round(time.monotonic() - t0, 1), "failures": failures}))


@pytest.mark.timeout(240)
def test_ranks_exit_cleanly_after_commpress_workers():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, __file__, str(RUNS)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["runs"] == RUNS
    shown = "\n".join(f"run {f['run']} ({f['mode']}) rank {f['rank']}: exit code {f['exit_code']} (-6: SIGABRT)"
                      f"\n{f['log']}" for f in report["failures"][:4])
    assert not report["failures"], f"{len(report['failures'])} abnormal rank exit(s) in {RUNS} runs:\n{shown}"


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else RUNS, float(sys.argv[2]) if len(sys.argv) > 2 else 60.0,
         tuple(sys.argv[3].split(",")) if len(sys.argv) > 3 else MODES)
