"""Where a fragment's exchange runs: in the ``step()`` call, or on one worker thread.

The worker runs the exchanges in the order they were sent, on a process group of its
own (so its collectives never interleave with the user's), on a side CUDA stream when
the tensors live on a GPU (ordered after the kernels that produced the pseudo-gradient,
and waited for by the stream that applies it).  An exception in the worker is kept
with its exchange and raised from the ``step()`` that applies it; the collectives
raise on every rank together, so every rank raises there.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from .._worker import JobThread, seconds

log = logging.getLogger("commpress")


class Exchange:
    """One fragment's exchange: sent at inner step ``sent_at``, applied at ``apply_at``."""

    def __init__(self, fragment: int, sent_at: int, apply_at: int) -> None:
        self.fragment = fragment
        self.sent_at = sent_at
        self.apply_at = apply_at
        self.result: torch.Tensor | None = None  # the sum over ranks (fp32, flat)
        self.error: BaseException | None = None
        self.bytes_sent = 0
        self.bytes_received = 0
        self._done = threading.Event()
        self._event: Any = None  # CUDA event recorded after the exchange (worker on CUDA)

    def finish(self, result: torch.Tensor | None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self._done.set()

    def wait(self) -> torch.Tensor:
        """The summed pseudo-gradient; raises what the exchange raised."""
        self._done.wait()
        if self.error is not None:
            raise RuntimeError(f"commpress diloco: the exchange of fragment {self.fragment} sent at "
                               f"inner step {self.sent_at} failed: {type(self.error).__name__}: "
                               f"{self.error}") from self.error
        if self._event is not None:  # made on the worker's side stream: order it before its use here
            stream = torch.cuda.current_stream(self.result.device)
            stream.wait_event(self._event)
            self.result.record_stream(stream)
            self._event = None
        assert self.result is not None
        return self.result


class Inline:
    """Runs the exchange in the calling thread, at once."""

    group = None

    def submit(self, item: Exchange, fn: Callable[[], tuple[torch.Tensor, int, int]]) -> None:
        try:
            result, item.bytes_sent, item.bytes_received = fn()
        except BaseException as exc:  # noqa: BLE001 - kept with the exchange, raised on apply
            item.finish(None, exc)
            raise
        item.finish(result)

    def close(self) -> None:
        pass


class Worker:
    """One daemon thread, exchanges in submission order, on ``group`` (owned: destroyed by close).

    The thread (a :class:`~commpress._worker.JobThread`) is joined before the interpreter
    finalizes when :meth:`close` was never called (an exchange in progress completes there)."""

    def __init__(self, group: dist.ProcessGroup, timeout: float | None = None) -> None:
        self.group = group
        self._stream = None
        self._worker = JobThread("commpress-diloco", self._job, timeout)

    def submit(self, item: Exchange, fn: Callable[[], tuple[torch.Tensor, int, int]],
               device: torch.device | None = None) -> None:
        stream = None
        if device is not None and device.type == "cuda":
            if self._stream is None:
                self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
            stream = self._stream
        self._worker.put((item, fn, stream))

    @staticmethod
    def _job(job: tuple) -> None:
        item, fn, stream = job
        try:
            if stream is not None:
                with torch.cuda.stream(stream):
                    result, item.bytes_sent, item.bytes_received = fn()
                    item._event = torch.cuda.Event()
                    item._event.record(stream)
            else:
                result, item.bytes_sent, item.bytes_received = fn()
            item.finish(result)
        except BaseException as exc:  # noqa: BLE001 - raised from step() on every rank
            item.finish(None, exc)

    def stop(self) -> None:
        """Let the worker finish what is queued and exit; no wait, the group kept (its owner
        collected without ``close()``)."""
        self._worker.stop()

    def close(self) -> None:
        if not self._worker.close():   # still in a collective after the group's timeout
            log.warning("commpress diloco: the overlap worker did not stop; its group is kept")
            return
        if self.group is not None:
            try:
                dist.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001 - already gone with the default group
                log.debug("commpress diloco: the overlap group was already destroyed")
            self.group = None


def make_executor(process_group: dist.ProcessGroup | None, overlap: bool) -> Inline | Worker:
    """A :class:`Worker` on a new group spanning ``process_group`` when overlapping on more
    than one rank (collective: every rank of the world calls it), else :class:`Inline`."""
    if not overlap or not dist.is_initialized():
        return Inline()
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return Inline()
    if dist.get_world_size(group) != dist.get_world_size():
        log.info("commpress diloco: overlap needs a process group spanning the world; the "
                 "exchanges run in step() (still applied the same number of steps later)")
        return Inline()
    from ..hooks.ddp import _group_timeout  # the user's timeout, read the way the DDP hook reads it

    ranks = dist.get_process_group_ranks(group)
    timeout = _group_timeout(group)
    own = dist.new_group(ranks=ranks, backend=dist.get_backend(group), timeout=timeout)
    return Worker(own, seconds(timeout))
