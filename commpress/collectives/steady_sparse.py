"""The steady-state lane of the fixed-size sparse ``"allgather"``: topk with error feedback, fp32 on the CPU.

:func:`.sparse.fixed_sparse_allreduce` serves every sparsifier, every error and every device; each
call goes through the compressor chain's layers (error feedback, the compressor, the ops dispatch
and the numba backend's checks), builds the message's layout and signature, writes it with torch
ops on small views and decodes each rank's entries through the dispatch again: about 650 Python
calls, near 2 ms of a one-core rank's CPU per call on a 64K-element bucket, most of it not the
kernels.  A training step calls it with the same static facts every time.

This lane is what the call reduces to in the DDP hook's topk steps once the selection is the
smaller message (after the density warm-up's first stages): :class:`~commpress.compressors.TopK`
under :class:`~commpress.ErrorFeedback` (with or without momentum correction, without ``clip``), the
numba backend, ``"auto"`` or ``"allgather"`` choosing the all-gather:

* a :class:`Plan` holds the call's static facts, made once per (group, size, capacity, riding
  dense part): the message's byte layout and signature, the general path's own
  (:class:`~.wire.Layout` of the payload's tensors);
* the fused selection (:func:`commpress.ops.numba_backend.topk_feedback_arrays`) compensates,
  selects and writes the new residual (and velocity) in its pass; its indices and values are
  copied into the message, the sent entries' velocities zeroed (momentum factor masking), the
  residual staged in the call's transaction;
* every rank's entries are added into the output in rank order
  (:func:`commpress.ops.numba_backend.scatter_add_into` on views of the gathered messages).

Messages, results, riding dense parts and residuals are bitwise the general path's
(``tests/collectives/test_collectives_steady_sparse.py`` runs both).  Anything else takes the
general path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import ops
from ..compressors.topk import TopK
from ..feedback import ErrorFeedback
from . import _comm, costmodel, steady, wire
from .accounting import CommStats, codec_timer


@dataclass(frozen=True)
class Plan:
    """The static facts of one call site: ``k`` entries (int32 indices at byte ``idx_at``, fp32
    values at ``val_at``) and the riding dense part at ``dense_at`` (``-1``: none) in a message of
    ``width`` bytes signed ``sig``."""

    world: int
    numel: int
    k: int
    width: int
    idx_at: int
    val_at: int
    dense_at: int
    sig: int


def _runs(compressor: Any, flat: torch.Tensor, out: torch.Tensor | None, error: tuple[int, str]) -> bool:
    """Whether this call can take the lane (the cheap checks; the plan checks the choice)."""
    return (type(getattr(compressor, "compressor", None)) is TopK
            and steady.cpu_feedback_call(compressor, flat, out, error, ("topk_compact_feedback", "scatter_add_")))


def plan_for(flat: torch.Tensor, compressor: Any, *, group, algorithm: str, step: int, error: tuple[int, str],
             out: torch.Tensor | None, dense: wire.Rider | None, world: int, whole_choice) -> Plan | None:
    """The call's :class:`Plan` when it can take the lane, else ``None`` (the general path runs).
    ``out``: the call's output, which must be ``flat``'s own buffer (the hooks' ``out=t``);
    ``whole_choice``: the general path's :func:`.sparse.whole_choice` (what ``"auto"`` sends)."""
    if world < 2 or algorithm not in ("auto", "allgather") or not _runs(compressor, flat, out, error):
        return None
    n = flat.numel()
    k = compressor.compressor.capacity(n, step)
    rider = None if dense is None or not wire.Rider.free(world) else (dense.tensor.numel(), dense.tensor.dtype)
    key = ("sparse", _comm.group_key(group), n, k, algorithm, rider, world)
    return steady.cached_plan(compressor, key, lambda: _make_plan(flat, compressor.compressor, step, world, k,
                                                                  algorithm, rider, whole_choice))


def _make_plan(flat: torch.Tensor, inner: TopK, step: int, world: int, k: int, algorithm: str, rider,
               whole_choice) -> Plan | None:
    """The general path's choices and wire format for these facts (``None``: it would send the
    whole tensor, or another algorithm, or an index wider than int32)."""
    n = flat.numel()
    if ops.reference.index_dtype(n + 1) != torch.int32:   # the fixed wire's index (sparse.wire_index_dtype)
        return None
    if algorithm == "auto":
        if whole_choice(flat, inner, step, world) != "selection":
            return None
        algorithm = costmodel.choose_fixed_sparse(n, k, world, 4, 4)
    if algorithm != "allgather":
        return None
    parts = [torch.empty(k, dtype=torch.int32, device="meta"), torch.empty(k, dtype=torch.float32, device="meta")]
    facts = ("sparse", n, str(torch.float32), k)
    if rider is not None:
        parts.append(torch.empty(rider[0], dtype=rider[1], device="meta"))
        facts += (rider[0], str(rider[1]))
    layout = wire.Layout.of(parts)
    offsets = [spec[2] for spec in layout.specs]
    return Plan(world, n, k, layout.width, offsets[0], offsets[1], offsets[2] if rider is not None else -1,
                wire.signature(*facts))


def run(plan: Plan, flat: torch.Tensor, compressor: ErrorFeedback, *, group, key: Any, stats: CommStats | None,
        transaction, dense: wire.Rider | None, passengers: wire.Passengers | None = None,
        scale: float = 1.0) -> torch.Tensor:
    """The call on the lane: the selection encoded into the message, the messages gathered and
    judged (an error anywhere raises on every rank), every rank's entries added into ``flat`` (the
    output) in rank order; a NaN/inf anywhere poisons ``flat`` and keeps the residuals.  A
    selection that raises sends padding (index ``numel``, value 0) with :data:`~.wire.E_MISUSE`.
    ``passengers``: held messages that ride after this one (:class:`~.wire.Passengers`; landed as
    soon as they arrive).  ``scale``: ``flat``'s factor, folded into error feedback's pass."""
    extra = passengers.width if passengers is not None else 0
    buf, msg = encode(plan, flat, compressor, key=key, stats=stats, transaction=transaction, dense=dense,
                      extra=extra, scale=scale)
    if extra:
        passengers.board(buf, plan.width)
    gathered = _comm.all_gather(buf, group=group, stats=stats)
    if passengers is not None:
        passengers.alight(gathered, plan.width)
    return land(plan, gathered, flat, msg=msg, dense=dense, stats=stats, transaction=transaction)


def encode(plan: Plan, flat: torch.Tensor, compressor: ErrorFeedback, *, key: Any, stats: CommStats | None,
           transaction, dense: wire.Rider | None, extra: int = 0, scale: float = 1.0) -> tuple[torch.Tensor, str]:
    """The message's bytes (``extra`` more after them, left for passengers): the selection under
    error feedback, the riding dense part, the status word; returns ``(buffer, local error message)``."""
    k, n = plan.k, plan.numel
    ops._usage.note("topk_compact_feedback", "numba")   # what ops.backends_used() reports, as on the general path
    ops._usage.note("scatter_add_", "numba")
    buf = torch.empty(plan.width + extra, dtype=torch.uint8)
    raw = buf.numpy()
    idx = raw[plan.idx_at:plan.idx_at + 4 * k].view(np.int32)
    val = raw[plan.val_at:plan.val_at + 4 * k].view(np.float32)
    code, msg, bad = 0, "", False
    try:
        with codec_timer(stats, "compress"):
            bad = _encode(flat, compressor, k, key, idx, val, transaction, scale)
    except Exception as exc:  # noqa: BLE001 - raised on every rank through the status
        idx[:] = n
        val[:] = 0
        code, msg = wire.E_MISUSE, f"compress failed: {type(exc).__name__}: {exc}"
    if plan.dense_at >= 0:
        dense.carried = True
        bad = steady._put_dense(dense.tensor.reshape(-1), buf, raw, plan.dense_at) or bad
    steady._put_status(raw, flat.device, code, plan.sig, bad)
    return buf, msg


def land(plan: Plan, gathered: torch.Tensor, flat: torch.Tensor, *, msg: str, dense: wire.Rider | None,
         stats: CommStats | None, transaction) -> torch.Tensor:
    """The P gathered messages (``[P, >= width]`` bytes) judged (an error anywhere raises here, on
    every rank), their entries added into ``flat`` in rank order, the riding dense part summed; a
    NaN/inf anywhere poisons ``flat`` and marks ``transaction`` bad; the call counted in ``stats``.
    Returns ``flat``."""
    k = plan.k
    got = gathered.numpy()
    statuses = wire.read_status(gathered).numpy()
    wire.judge_bytes(statuses, plan.sig, "allreduce", msg)
    nb = steady._nb()
    with codec_timer(stats, "decompress"):
        out = flat.zero_().numpy()
        with nb.threads_context(plan.numel):
            for s in range(plan.world):   # rank order on every rank: bitwise identical sums
                nb.scatter_add_into(out, got[s, plan.idx_at:plan.idx_at + 4 * k].view(np.int32),
                                    got[s, plan.val_at:plan.val_at + 4 * k].view(np.float32))
    if plan.dense_at >= 0:
        steady._sum_dense(dense.tensor.view(-1), gathered, got, plan.dense_at, plan.world)
    if (statuses[:, 0] & wire.NONFINITE).any():
        flag = torch.ones((), dtype=torch.bool)
        transaction.mark_bad(flag)
        wire.poison_(flat, flag)
    if stats is not None:
        stats.add(calls=1, algorithm="allgather")
    return flat


def _encode(flat: torch.Tensor, ef: ErrorFeedback, k: int, key: Any, idx: np.ndarray, val: np.ndarray,
            transaction, scale: float = 1.0) -> bool:
    """The selection of ``flat`` under error feedback into ``idx`` / ``val`` (message views), its
    new residual staged in ``transaction`` as :meth:`ErrorFeedback.compress_fixed` stages it
    (committed with the step, or at once without one); returns its NaN/inf verdict (the general
    path's: the fp32 sum of the values sent)."""
    # momentum correction's velocity too, in the same pass; the input is the call's output (scratch):
    # with a lean residual storage the next residual is written over it (no buffer of its size)
    slots = ef.open_fused(flat, key, scratch=True, scale=scale, transaction=transaction)
    x, live = slots.x, slots.live
    nb = steady._nb()
    with nb.threads_context(x.numel()):
        chosen, bits = nb.topk_feedback_arrays(x.numpy(), None if live is None else live.view(-1).numpy(), ef.beta,
                                               slots.scale, k, slots.pending.view(-1).numpy(), slots.velocity)
    bad = False
    if k:
        idx[:] = chosen
        val.view(np.int32)[:] = bits
        bad = steady.host_nonfinite(torch.from_numpy(bits.view(np.float32)))
    # momentum factor masking: the sent entries' velocity restarts
    ef.close_fused(key, torch.tensor(bad), transaction, sent=torch.from_numpy(chosen) if k else None)
    return bad
