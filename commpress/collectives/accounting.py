"""Per-rank traffic accounting for the collectives.

Every collective in :mod:`commpress.collectives` takes ``stats: CommStats | None``
and, when given, adds what *this rank* handed to / got from ``torch.distributed``.

How bytes are counted (one convention, used everywhere)
--------------------------------------------------------
Bytes are the sizes of the tensors actually passed to ``torch.distributed``
(``numel * element_size``), padding included, and the small count / size /
validation exchanges included.  Each primitive is charged with a *direct*
model, independent of the algorithm the backend uses inside, where ``n`` is
the buffer size in bytes and ``P`` the group size:

=====================  ==========================  ==========================  ===========
primitive              bytes_sent                  bytes_received              messages
=====================  ==========================  ==========================  ===========
``all_gather`` (n/rank) ``n·(P−1)``                 ``n·(P−1)``                 ``P−1``
``all_reduce`` (n)     ``2·n·(P−1)/P`` (ring)      ``2·n·(P−1)/P``             ``2·(P−1)``
``all_to_all_single``  bytes to other ranks        bytes from other ranks      ``P−1``
``send`` / ``recv``    ``n``                       ``n``                       1 per tensor
=====================  ==========================  ==========================  ===========

``all_reduce`` is charged as a bandwidth-optimal ring (reduce-scatter then
all-gather, the model NCCL and gloo approach for large buffers); the other rows
are exact.  The data a rank keeps for itself is never counted.  With one rank
nothing is sent and nothing is counted.  ``calls`` counts top-level collective
calls (one ``allreduce`` / ``sparse_allreduce`` / ``reduce_scatter`` = 1).

Step-time account: ``rounds`` counts the ``torch.distributed`` calls
themselves (one ``all_gather`` / ``all_reduce`` / ``all_to_all_single`` / one
batched send-receive = 1 round, whatever its message count), ``comm_seconds`` the
host time spent inside them, and ``codec_seconds`` the host time of each codec
pass by name (``"compress"``, ``"decompress"``).  Times are ``time.perf_counter``
around host-side work only: on CUDA they measure launches and waits the host
does anyway, never a synchronisation added for the timer.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator


@dataclass
class CommStats:
    """Bytes and messages this rank sent and received, accumulated over calls.

    Pass one as ``stats=`` to the collectives; bytes are counted by the convention of this
    module (what this rank hands to ``torch.distributed``).

    Attributes:
        bytes_sent: bytes this rank sent.
        bytes_received: bytes this rank received.
        messages: messages sent.
        calls: collective calls finished.
        last_algorithm: the algorithm the last call used.
        rounds: collective rounds issued.
        comm_seconds: host seconds spent inside the collectives.
        codec_seconds: host seconds in compress / decompress, by name.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0
    calls: int = 0
    last_algorithm: str = ""
    rounds: int = 0
    comm_seconds: float = 0.0
    codec_seconds: dict[str, float] = field(default_factory=dict)

    def add(self, sent: int = 0, received: int = 0, messages: int = 0, *,
            calls: int = 0, algorithm: str | None = None, rounds: int = 0, seconds: float = 0.0) -> None:
        """Add one transfer (or one finished call with its ``algorithm``); ``rounds`` /
        ``seconds``: collective rounds issued and host seconds spent inside them."""
        self.bytes_sent += int(sent)
        self.bytes_received += int(received)
        self.messages += int(messages)
        self.calls += int(calls)
        self.rounds += int(rounds)
        self.comm_seconds += float(seconds)
        if algorithm is not None:
            self.last_algorithm = str(algorithm)

    def add_codec(self, name: str, seconds: float) -> None:
        """Add ``seconds`` of host time to the codec pass ``name``."""
        self.codec_seconds[name] = self.codec_seconds.get(name, 0.0) + float(seconds)

    def merge(self, other: "CommStats") -> None:
        """Add another ``CommStats`` into this one."""
        self.add(other.bytes_sent, other.bytes_received, other.messages,
                 calls=other.calls, algorithm=other.last_algorithm or None, rounds=other.rounds,
                 seconds=other.comm_seconds)
        for name, sec in other.codec_seconds.items():
            self.add_codec(name, sec)

    def reset(self) -> None:
        """Set every counter back to zero."""
        self.bytes_sent = self.bytes_received = self.messages = self.calls = self.rounds = 0
        self.comm_seconds = 0.0
        self.codec_seconds = {}
        self.last_algorithm = ""

    def as_dict(self) -> dict[str, Any]:
        """A plain dict (for JSON / logging)."""
        return asdict(self)


@contextmanager
def codec_timer(stats: "CommStats | None", name: str) -> Iterator[None]:
    """Charge the host time of the block to ``stats``'s codec pass ``name`` (no-op without stats)."""
    if stats is None:
        yield
        return
    t0 = time.perf_counter()
    try:
        yield
    finally:
        stats.add_codec(name, time.perf_counter() - t0)


def all_gather_cost(nbytes: int, world: int) -> tuple[int, int, int]:
    """(sent, received, messages) of an all_gather of ``nbytes`` per rank."""
    return nbytes * (world - 1), nbytes * (world - 1), world - 1


def all_reduce_cost(nbytes: int, world: int) -> tuple[int, int, int]:
    """(sent, received, messages) of a ring all_reduce of ``nbytes``."""
    if world <= 1:
        return 0, 0, 0
    b = (2 * nbytes * (world - 1)) // world
    return b, b, 2 * (world - 1)


def reduce_scatter_cost(nbytes: int, world: int) -> tuple[int, int, int]:
    """(sent, received, messages) of a reduce_scatter whose result is ``nbytes`` per rank
    (an input of ``world * nbytes``): ``nbytes·(P−1)`` each way."""
    return nbytes * (world - 1), nbytes * (world - 1), world - 1
