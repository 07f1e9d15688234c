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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class CommStats:
    """Bytes and messages this rank sent and received, accumulated over calls."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages: int = 0
    calls: int = 0
    last_algorithm: str = ""

    def add(self, sent: int = 0, received: int = 0, messages: int = 0, *,
            calls: int = 0, algorithm: str | None = None) -> None:
        """Add one transfer (or one finished call with its ``algorithm``)."""
        self.bytes_sent += int(sent)
        self.bytes_received += int(received)
        self.messages += int(messages)
        self.calls += int(calls)
        if algorithm is not None:
            self.last_algorithm = str(algorithm)

    def merge(self, other: "CommStats") -> None:
        """Add another ``CommStats`` into this one."""
        self.add(other.bytes_sent, other.bytes_received, other.messages,
                 calls=other.calls, algorithm=other.last_algorithm or None)

    def reset(self) -> None:
        """Set every counter back to zero."""
        self.bytes_sent = self.bytes_received = self.messages = self.calls = 0
        self.last_algorithm = ""

    def as_dict(self) -> dict[str, Any]:
        """A plain dict (for JSON / logging)."""
        return asdict(self)


def all_gather_cost(nbytes: int, world: int) -> tuple[int, int, int]:
    """(sent, received, messages) of an all_gather of ``nbytes`` per rank."""
    return nbytes * (world - 1), nbytes * (world - 1), world - 1


def all_reduce_cost(nbytes: int, world: int) -> tuple[int, int, int]:
    """(sent, received, messages) of a ring all_reduce of ``nbytes``."""
    if world <= 1:
        return 0, 0, 0
    b = (2 * nbytes * (world - 1)) // world
    return b, b, 2 * (world - 1)
