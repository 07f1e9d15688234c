"""The one kind of thread commpress starts: a worker that runs jobs in order, off the caller's thread.

The DDP hook's overlap executor and DiLoCo's exchanges both run on one.  It is a daemon
thread (a process never waits at exit for a worker its owner forgot), but a daemon thread
must not be running at interpreter finalization: from then on a thread that asks for the
GIL is ended by ``pthread_exit`` where it stands, and when that is inside C++ code that
must not unwind (a pybind11 GIL re-acquire in a destructor, as completing a DDP bucket's
future ends with; the GIL taken back after a gloo collective) the process aborts with
"terminate called without an active exception".  So every worker still alive at
interpreter exit is stopped and joined first (an ``atexit`` hook, which runs before
finalization): the job it is running completes (a collective fails by the group's
timeout at the latest), the jobs still queued are dropped (nobody is left to use their
results), then it exits.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from typing import Any, Callable

log = logging.getLogger("commpress")

_STOP = object()
_LIVE: "weakref.WeakSet[JobThread]" = weakref.WeakSet()  # a running thread holds its JobThread
_LOCK = threading.Lock()
_HOOKED = False


class JobThread:
    """A daemon thread calling ``run(job)`` for each :meth:`put` job, in order, until stopped.

    ``run`` handles its own errors (one that escapes is logged and the thread goes on);
    ``join_timeout`` (seconds, or None) bounds how long :meth:`close` and the exit hook wait
    for a running job: the timeout of the group its collectives use.
    """

    def __init__(self, name: str, run: Callable[[Any], None], join_timeout: float | None) -> None:
        self.join_timeout = join_timeout
        self._run = run
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._exiting = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        _track(self)
        self.thread.start()

    def put(self, job: Any) -> None:
        self._queue.put(job)

    def stop(self) -> None:
        """Let the thread finish what is queued and exit; no wait (an owner collected without close)."""
        self._queue.put(_STOP)

    def close(self) -> bool:
        """Finish what is queued, then exit and join the thread: True once it has exited."""
        if self.thread.is_alive():
            self._queue.put(_STOP)
            self.thread.join(timeout=_slack(self.join_timeout))
        return not self.thread.is_alive()

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def _loop(self) -> None:
        import torch

        torch.set_grad_enabled(False)
        while True:
            job = self._queue.get()
            if job is _STOP or self._exiting:
                return
            try:
                self._run(job)
            except BaseException:  # noqa: BLE001 - the owner's run reports its own errors
                log.exception("commpress: %s: a job raised", self.thread.name)
            job = None   # an idle worker holds no job (its tensors, parameters, futures)


def _slack(timeout: float | None) -> float:
    """A join's timeout: the group's timeout (torch's default, 30 minutes, when unknown) and a
    margin: a collective running on the thread has failed by then."""
    return (1800.0 if timeout is None else float(timeout)) + 10.0


def seconds(timeout: Any) -> float | None:
    """A group's timeout (a ``timedelta``, or None when unknown) in seconds."""
    return None if timeout is None else float(timeout.total_seconds())


def _track(worker: JobThread) -> None:
    global _HOOKED
    with _LOCK:
        _LIVE.add(worker)
        if not _HOOKED:
            atexit.register(_join_at_exit)
            _HOOKED = True


def _join_at_exit() -> None:
    """Stop every live worker (dropping queued jobs) and join it, before finalization."""
    with _LOCK:
        workers = [w for w in _LIVE if w.is_alive()]
    for w in workers:
        w._exiting = True
        w.stop()
    for w in workers:
        timeout = _slack(w.join_timeout)
        start = time.monotonic()
        w.thread.join(timeout=timeout)
        if w.is_alive():
            log.warning("commpress: the worker thread %s still runs at exit after %.0fs",
                        w.thread.name, time.monotonic() - start)
