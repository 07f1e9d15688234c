"""Run a function on several local gloo ranks (FileStore, no ports) and collect results.

Workers are forked from a forkserver that has already imported torch and
commpress, so each test pays milliseconds, not seconds, per rank.  Every run
has a timeout: a hung rank fails the test instead of the CI job.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import tempfile
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch.multiprocessing as mp

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # torch._dynamo: DDP's constructor imports it; commpress.fsdp: FSDP2 (import commpress
        # leaves it out); seconds per rank process otherwise
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "commpress",
                                     "commpress.fsdp"])
    return _CTX


@dataclass
class RankError:
    """What a rank raised (returned instead of raising with ``return_exceptions``)."""

    rank: int
    type: str
    message: str
    traceback: str


def _worker(rank, world_size, store_path, fn, args, kwargs, results, pg_timeout, backend="gloo"):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        try:
            if backend == "gloo":
                # every rank's connections are up before any rank runs fn: a rank that raises at
                # once would otherwise close its side while a peer is still in gloo's
                # connectFullMesh (a RuntimeError there, not the peer's own result)
                dist.barrier()
            out = fn(rank, world_size, *args, **kwargs)
            # plain pickle bytes: torch's queue reductions would share tensor storage through
            # a socket of this process, which may have exited before the parent reads it
            results.put((rank, "ok", pickle.dumps(out)))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((rank, "err", RankError(rank, type(exc).__name__, str(exc), traceback.format_exc())))


def run(fn: Callable[..., Any], world_size: int, *args, timeout: float = 60.0,
        pg_timeout: float = 30.0, return_exceptions: bool = False, backend: str = "gloo",
        **kwargs) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks (gloo, or ``backend``).

    ``fn`` must be importable (module level).  Returns the per-rank results in
    rank order.  A rank that raises makes this raise ``RuntimeError`` with its
    traceback, unless ``return_exceptions`` (then its :class:`RankError` is in
    the list).  Ranks still running after ``timeout`` seconds are killed and
    ``TimeoutError`` is raised.
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store_path, fn, args, kwargs, results, pg_timeout, backend),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        collected: dict[int, tuple[str, Any]] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        try:
            while len(collected) < world_size:
                remaining = (deadline - datetime.datetime.now()).total_seconds()
                if remaining <= 0:
                    raise TimeoutError(
                        f"ranks {sorted(set(range(world_size)) - set(collected))} did not finish "
                        f"within {timeout}s"
                    )
                try:
                    rank, status, value = results.get(timeout=min(remaining, 1.0))
                    collected[rank] = (status, pickle.loads(value) if status == "ok" else value)
                except queue_mod.Empty:
                    dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in collected
                            and p.exitcode not in (0, None)]
                    if dead and not return_exceptions:
                        raise RuntimeError(f"ranks {dead} died (exit codes "
                                           f"{[procs[i].exitcode for i in dead]})")
                    for i in dead:
                        collected[i] = ("err", RankError(i, "ProcessDied", f"exit code {procs[i].exitcode}", ""))
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    out = []
    errors = []
    for r in range(world_size):
        status, value = collected[r]
        if status == "err" and not return_exceptions:
            errors.append(value)
        out.append(value)
    if errors:
        msg = "\n".join(f"--- rank {e.rank}: {e.type}: {e.message}\n{e.traceback}" for e in errors)
        raise RuntimeError(f"{len(errors)} rank(s) failed:\n{msg}")
    return out
