"""Held calls: a compressed call encoded now, its message sent in a later call's ``all_gather``.

A DDP step reduces each bucket in a collective round of its own.  On a CPU rank of one core a
gloo round costs about 1.4 ms of CPU beside its bytes (``benchmarks``' README, "Overhead"), time
the backward pass needs; the digits MLP's step was 2.1-2.3 ms (12-13%) faster with DDP's buckets
joined into one (README, "Where the host CPU goes").  Copying the buckets into one unit took half
of that back.  Holding joins the rounds, not the tensors: each unit keeps its own key, residual,
message and verdict, only the flight is shared.

* :func:`hold` encodes a call on a steady lane (:mod:`.steady`: blockquant, unpipelined;
  :mod:`.steady_sparse`: topk) exactly as :func:`~.core.allreduce` would (its residual staged in
  the step's transaction, its riding dense part in its message) and returns a :class:`Held`, or
  ``None`` where the call would take another path (it must then run at once).
* The next call that runs (``allreduce(..., passengers=)`` with a :class:`~.wire.Passengers` of the
  held messages) appends them to its first message: one round for all.  Where that call takes a
  path that cannot carry them, :func:`gather_held` sends them in one round of their own.
* :meth:`Held.land` decodes a held call's P gathered copies into its output and judges its
  status: an error on any rank raises on every rank, a NaN/inf anywhere poisons that call's
  output and keeps the step's residuals, as its own call would.

The values are bitwise those of the calls run one by one (the same messages, decoded by the same
code; ``tests/collectives/test_collectives_joint.py``).  Every rank must hold the same calls: the
choice is a function of facts equal on every rank (the configuration, the sizes, the lane's
static checks), and a failure while encoding travels in the held message's status, so no rank
skips the shared round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import _comm, costmodel, quantized, sparse, steady, steady_sparse, wire
from .accounting import CommStats

#: A call is held only while the held messages, this one included, spend at most this long on the
#: wire by the group's calibrated cost model: a longer message is better sent at once, its flight
#: overlapping the backward pass, than saving a round.  The pipelining threshold, the same trade
#: measured (:data:`.quantized.PIPELINE_MIN_WIRE_S`: a message of its own pays from about 1.3-1.8 ms
#: on the wire).  Measured on the digits MLP at 1 Gbit/s (2 ranks of one core; DDP's first bucket holds
#: fc2 and fc3, 1.06M elements): topk 1%'s message of it (85 KB, about 0.8 ms on the wire) held, the
#: step 1.0-1.3 ms shorter; blockquant 4-bit's (530 KB, about 4.8 ms) held without this limit, 0.4 ms
#: shorter on average over ten alternating pairs, inside their spread: with it, that one is sent at
#: once, as before (a larger model's first buckets have more of the backward pass to overlap).
HOLD_MAX_WIRE_S = quantized.PIPELINE_MIN_WIRE_S


@dataclass
class Held:
    """A call encoded and waiting for its flight: ``message`` (uint8, 8-aligned width), the
    algorithm it stands for, and :meth:`land`."""

    message: torch.Tensor
    algorithm: str
    _land: Callable[[torch.Tensor], None]

    def land(self, rows: torch.Tensor) -> None:
        """Decode the P gathered copies of :attr:`message` (``[P, width]`` bytes, a view) into the
        call's output and judge them (raises on every rank on an error anywhere)."""
        self._land(rows)


def hold(tensor: torch.Tensor, compressor: Any, *, group, key: Any, step: int, algorithm: str,
         stats: CommStats | None, transaction, dense: torch.Tensor | None = None, held_bytes: int = 0,
         max_wire_s: float = math.inf, scale: float = 1.0) -> Held | None:
    """Encode ``allreduce(tensor, compressor, ..., out=tensor, dense=dense)`` for a later flight,
    where it takes a steady lane in one message and the held messages (``held_bytes`` already,
    this one added) spend at most ``max_wire_s`` on the wire by the calibrated cost model;
    ``None`` otherwise (nothing done: run the call).  The sum lands in ``tensor`` (and ``dense``)
    at :meth:`Held.land`.  ``transaction`` (the step's) stages the residual.  ``scale``: encode
    ``tensor * scale``, folded into error feedback's pass (as ``allreduce(prescale=)``)."""
    world = _comm.world(group)
    kind = getattr(wire.unwrap(compressor), "aggregation", None)
    if world < 2 or transaction is None or kind not in ("gather", "sparse"):
        return None
    flat = tensor.reshape(-1)
    rider = wire.Rider(dense) if dense is not None else None
    if kind == "gather":
        error = wire.local_check(tensor, compressor, algorithm, ("auto", "two_phase", "gather_all"))
        bounds = quantized.chunk_bounds(flat.numel(), world, quantized.alignment(compressor))
        plan = steady.plan_for(flat, compressor, group=group, algorithm=algorithm, error=error, model=None,
                               out=tensor, dense=rider, world=world, bounds=bounds)  # one message: unpipelined
        return _hold_steady(plan, flat, compressor, key, step, stats, transaction, rider, group, world, held_bytes,
                            max_wire_s, scale)
    error = wire.local_check(tensor, compressor, algorithm, ("auto",) + sparse.SPARSE_ALGORITHMS)
    if (algorithm == "auto" and wire.has_feedback(compressor)
            and sparse.whole_choice(tensor, wire.unwrap(compressor), step, world) == "blockquant"):
        plan = steady.whole_plan_for(flat, compressor, codec=sparse.WHOLE_CODEC, group=group, error=error, out=tensor,
                                     dense=rider, world=world)
        return _hold_steady(plan, flat, compressor, key, step, stats, transaction, rider, group, world, held_bytes,
                            max_wire_s, scale)
    splan = steady_sparse.plan_for(flat, compressor, group=group, algorithm=algorithm, step=step, error=error,
                                   out=tensor, dense=rider, world=world, whole_choice=sparse.whole_choice)
    if splan is None or not _fits(group, world, held_bytes + splan.width, max_wire_s):
        return None
    buf, msg = steady_sparse.encode(splan, flat, compressor, key=key, stats=stats, transaction=transaction,
                                    dense=rider, scale=scale)

    def land_sparse(rows: torch.Tensor) -> None:
        steady_sparse.land(splan, rows, flat, msg=msg, dense=rider, stats=stats, transaction=transaction)
    return Held(buf, "allgather", land_sparse)


def _hold_steady(plan, flat, compressor, key, step, stats, transaction, rider, group, world, held_bytes,
                 max_wire_s, scale: float = 1.0) -> Held | None:
    """A call on the quantized lane (:mod:`.steady`: blockquant's chunks, or a sparsifier's whole send)
    held, when its plan is one message that fits the wire limit."""
    if plan is None or len(plan.messages) != 1 or not _fits(group, world, held_bytes + plan.messages[0].width,
                                                            max_wire_s):
        return None
    message = plan.messages[0]
    buf, _, msg = steady.encode(plan, message, flat, compressor, key=key, step=step, stats=stats,
                                transaction=transaction, dense=rider, scale=scale)

    def land(rows: torch.Tensor) -> None:
        steady.finish(plan, [steady.land(plan, message, rows, flat, dense=rider, stats=stats)], msg, flat,
                      compressor, transaction, stats)
    return Held(buf, plan.algorithm, land)


def _fits(group, world: int, nbytes: int, max_wire_s: float) -> bool:
    """Whether ``nbytes`` gathered from every rank spend at most ``max_wire_s`` on the wire (the
    calibrated model, agreed across ranks: every rank decides alike)."""
    return math.isinf(max_wire_s) or costmodel.get_cost_model(group).beta * nbytes * (world - 1) <= max_wire_s


def passengers(held: list[Held], landing: Callable[[torch.Tensor], None] | None = None) -> wire.Passengers:
    """The held messages, to ride in the next call (``allreduce(..., passengers=)``); ``landing(rows)``
    is called with their gathered rows as soon as they arrive (:class:`~.wire.Passengers`)."""
    return wire.Passengers([h.message for h in held], landing)


def gather_held(held: list[Held], *, group, stats: CommStats | None) -> torch.Tensor:
    """The held messages' flight of their own (one ``all_gather``): their ``[P, width]`` rows."""
    if len(held) == 1:
        return _comm.all_gather(held[0].message, group=group, stats=stats)
    riders = passengers(held)
    buf = torch.empty(riders.width, dtype=torch.uint8)
    riders.board(buf, 0)
    return _comm.all_gather(buf, group=group, stats=stats)


def rows_of(held: list[Held], rows: torch.Tensor) -> list[torch.Tensor]:
    """Each held call's slice of the gathered ``rows`` (their messages in order)."""
    out, at = [], 0
    for h in held:
        n = h.message.numel()
        out.append(rows[:, at:at + n])
        at += n
    return out
