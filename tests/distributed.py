"""Run a function on several local gloo ranks (FileStore, no ports) and collect results.

Workers are forked from a forkserver that has already imported torch and
commpress and loaded numba's registries (:mod:`numba_warm`; started when this
module is imported), so each test pays milliseconds, not seconds, per rank.
Every phase of a run has a time limit derived from its own bound (the ranks' group timeout for coming up and for
exiting, the caller's ``timeout`` for ``fn``): a hung rank fails the test
instead of the CI job, and a slow machine only makes it slower.  Every rank
process is dead before its store and queue go, and its exit code is checked.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import tempfile
import time
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
                                     "commpress.fsdp", "numba_warm"])
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
    # one message per rank once its group is up, then one with its result (or what it raised)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((rank, "err", _error(rank, exc)))
        return
    try:
        try:
            if backend == "gloo":
                # every rank's connections are up before any rank runs fn: a rank that raises at
                # once would otherwise close its side while a peer is still in gloo's
                # connectFullMesh (a RuntimeError there, not the peer's own result)
                dist.barrier()
            results.put((rank, "up", None))
            out = fn(rank, world_size, *args, **kwargs)
            # plain pickle bytes: torch's queue reductions would share tensor storage through
            # a socket of this process, which may have exited before the parent reads it
            results.put((rank, "ok", pickle.dumps(out)))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent (after "ok": it wins)
        results.put((rank, "err", _error(rank, exc)))


def _error(rank: int, exc: BaseException) -> RankError:
    return RankError(rank, type(exc).__name__, str(exc), traceback.format_exc())


#: seconds a rank may take beyond its group's timeout to come up, or to exit once it has
#: answered (a rank waiting on a peer fails by the group's timeout; this covers a slow machine)
SLACK = 30.0


class _Ranks:
    """The rank processes of one :func:`run` and what they sent, read in one place."""

    def __init__(self, world_size: int, results) -> None:
        self.procs: list = []
        self.world_size = world_size
        self.results = results
        self.up: set[int] = set()
        self.collected: dict[int, tuple[str, Any]] = {}

    def _take(self, message) -> None:
        rank, status, value = message
        if status == "up":
            self.up.add(rank)
        elif rank not in self.collected or (status == "err" and self.collected[rank][0] == "ok"):
            # an error after the result: destroying the group raised
            self.collected[rank] = (status, pickle.loads(value) if status == "ok" else value)

    def drain(self, timeout: float) -> None:
        """Read what has arrived, waiting at most ``timeout`` for the first message."""
        try:
            self._take(self.results.get(timeout=max(timeout, 0.0)))
            while True:
                self._take(self.results.get_nowait())
        except queue_mod.Empty:
            pass

    def dead_silent(self) -> list[int]:
        """Ranks whose process ended without a result, once what they sent is read: a rank
        flushes its messages before it exits, so a read after its death finds them."""
        gone = [i for i, p in enumerate(self.procs) if i not in self.collected and p.exitcode is not None]
        if gone:
            self.drain(0.5)
        return [i for i in gone if i not in self.collected]

    def wait(self, done: Callable[[], bool], deadline: float, what: str, return_exceptions: bool) -> None:
        """Read messages until ``done()``; a rank that died silently is an error (or, with
        ``return_exceptions``, its result); ``deadline`` (monotonic) passed: ``TimeoutError``."""
        while not done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(what)
            self.drain(min(remaining, 1.0))
            dead = self.dead_silent()
            if dead and not return_exceptions:
                raise RuntimeError(f"ranks {dead} died (exit codes {[self.procs[i].exitcode for i in dead]})")
            for i in dead:
                self.collected[i] = ("err", RankError(i, "ProcessDied", f"exit code {self.procs[i].exitcode}", ""))

    def reap(self, timeout: float) -> None:
        """Wait ``timeout`` seconds in all for every started process to exit; kill the rest."""
        started = [p for p in self.procs if p.pid is not None]
        deadline = time.monotonic() + timeout
        for p in started:
            p.join(timeout=max(deadline - time.monotonic(), 0.0))
        for p in started:
            if p.exitcode is None:
                p.kill()
                p.join()


def run(fn: Callable[..., Any], world_size: int, *args, timeout: float = 60.0,
        pg_timeout: float = 30.0, return_exceptions: bool = False, backend: str = "gloo",
        **kwargs) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks (gloo, or ``backend``).

    ``fn`` must be importable (module level).  Returns the per-rank results in
    rank order.  A rank that raises makes this raise ``RuntimeError`` with its
    traceback, unless ``return_exceptions`` (then its :class:`RankError` is in
    the list).  A rank process that dies without a result, or exits abnormally
    (exit code not 0) after it answered, is an error too (``ProcessDied`` /
    ``AbnormalExit``).

    Time limits, each from the phase's own bound rather than a race with a slow machine:
    the ranks come up within ``pg_timeout`` (their group's timeout: a rank waiting for a
    peer fails by then) plus :data:`SLACK` after they were started; ``fn`` runs within
    ``timeout`` seconds from then (ranks still running are killed and ``TimeoutError``
    is raised); a rank exits within ``pg_timeout`` + :data:`SLACK` after it answered.
    Every rank is dead before the store's directory and the queue go.
    """
    ctx = _context()
    results = ctx.Queue()
    ranks = _Ranks(world_size, results)
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        answered = False
        try:
            for r in range(world_size):
                p = ctx.Process(target=_worker, daemon=True,
                                args=(r, world_size, store_path, fn, args, kwargs, results, pg_timeout, backend))
                ranks.procs.append(p)
                p.start()   # waits for the forkserver (started at import, its preload may still run)
            all_in = lambda: len(ranks.up | set(ranks.collected)) == world_size  # noqa: E731
            ranks.wait(all_in, time.monotonic() + pg_timeout + SLACK,
                       f"ranks did not come up within pg_timeout + {SLACK:.0f}s ({pg_timeout + SLACK:.0f}s)",
                       return_exceptions)
            missing = lambda: sorted(set(range(world_size)) - set(ranks.collected))  # noqa: E731
            try:
                ranks.wait(lambda: not missing(), time.monotonic() + timeout, "", return_exceptions)
            except TimeoutError:
                raise TimeoutError(f"ranks {missing()} did not finish within {timeout}s") from None
            answered = True
            ranks.reap(pg_timeout + SLACK)   # then the exit codes are known
            ranks.drain(0.0)                 # and an error raised after the result is read
        finally:
            if not answered:  # a timeout, a dead rank, an interrupt: no rank outlives this call
                ranks.reap(0.0)
    out = []
    errors = []
    for r in range(world_size):
        status, value = ranks.collected[r]
        code = ranks.procs[r].exitcode
        if status == "ok" and code != 0:
            status, value = "err", RankError(r, "AbnormalExit", f"exit code {code} after it returned", "")
        if status == "err" and not return_exceptions:
            errors.append(value)
        out.append(value)
    if errors:
        msg = "\n".join(f"--- rank {e.rank}: {e.type}: {e.message}\n{e.traceback}" for e in errors)
        raise RuntimeError(f"{len(errors)} rank(s) failed:\n{msg}")
    return out


def prestart() -> None:
    """Start the forkserver now (its preload of torch and commpress runs in the background),
    so the first test that runs ranks does not pay for it inside its own timeout (a minute
    and more on a loaded machine).  Not in a rank (which imports this module with ``fn``)."""
    import multiprocessing
    from multiprocessing import forkserver

    if multiprocessing.parent_process() is not None or getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    _context()
    # the forkserver imports its preload with the interpreter's own sys.path (3.11 does not pass
    # this process's): this folder, for numba_warm, through its environment
    here = os.path.dirname(os.path.abspath(__file__))
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = here if not before else here + os.pathsep + before
    try:
        forkserver.ensure_running()
    except Exception:  # noqa: BLE001 - started again (and its error raised) by the first run
        pass
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


prestart()
