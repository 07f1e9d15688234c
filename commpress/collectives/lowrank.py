"""The PowerSGD protocol (Vogels et al., 2019) for ``"lowrank"`` compressors, batched.

The input is one tensor or, with ``shapes``, a flat concatenation of several
(the matrices of a DDP bucket).  For each matrix-shaped piece ``M_i`` (the
compressor decides through ``is_compressed``; the answer depends only on the
shape, so it is the same on every rank):

1. ``P_i = compressor.begin(M_i, (key, i))`` — ``M_i Q_i`` with the warm-started ``Q_i``;
2. **one** ``all_reduce`` of every ``P_i``, the pieces that are not compressed
   (vectors, small matrices, in fp32) and the two status slots of :mod:`.wire`;
3. ``Q_i = compressor.middle(M_i, P_i, (key, i))`` — orthogonalizes ``P_i`` in place, ``M_iᵀ P̂_i``;
4. **one** ``all_reduce`` of every ``Q_i``;
5. ``compressor.end(P̂_i, Q_i, ...)`` — ``P̂_i Q_iᵀ``, the **sum** over ranks of the
   rank-r approximations (it also keeps ``Q_i`` as the warm start).

Two rounds per call whatever the number of matrices; on the wire ``(n_i + m_i) r``
fp32 words per ``n_i x m_i`` matrix.

Error feedback (``compressor`` a :class:`commpress.ErrorFeedback`): the whole
input is compensated under ``key`` before step 1 and the residual
``M - aggregate / P`` (what PyTorch's ``powerSGD_hook`` keeps; summed over ranks
it is exactly the mass the aggregate missed) is staged in the transaction;
a NaN/inf on any rank (counted in the status slots) makes the result all-NaN
and keeps the residual.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..feedback import ResidualTransaction, nonfinite_flag, owns_transaction
from . import _comm, wire
from .wire import has_feedback, local_check, unwrap
from .accounting import CommStats, codec_timer


@owns_transaction
def powersgd_allreduce(tensor: torch.Tensor, compressor: Any, *, group=None, key: Any = 0, step: int = 0,
                       algorithm: str = "auto", stats: CommStats | None = None, generator=None,
                       transaction: ResidualTransaction | None = None, error: tuple[int, str] = (0, ""),
                       model=None, shapes: list[tuple[int, ...]] | None = None) -> torch.Tensor:
    """Summed rank-r approximation of ``tensor`` over ranks (PowerSGD; see the module doc).

    Called by :func:`commpress.collectives.allreduce` for ``"lowrank"`` compressors.  Wire: two
    ``all_reduce`` per call, of the P factors then of the Q factors of every matrix (batched
    over ``shapes``), each with the status slots of :mod:`.wire`.

    Args:
        tensor: the floating tensor (a matrix, or the flat concatenation of ``shapes``).
        compressor: a ``"lowrank"`` compressor (powersgd) or a :class:`~commpress.ErrorFeedback`
            around one.
        group: the process group (``None``: the default group).
        key: the warm start's key (``(key, i)`` per matrix with ``shapes``).
        step: the training step.
        algorithm: ``"auto"`` or ``"powersgd"`` (the same protocol).
        stats: a :class:`~commpress.collectives.CommStats` that counts this rank's bytes.
        generator: the random generator of the first Q factors.
        transaction: collects the residual updates for the caller's commit.
        error: ``(code, message)`` of a local check already failed on this rank.
        model: unused (the protocol has one algorithm); accepted like the other kinds'.
        shapes: ``tensor`` is the flat concatenation of tensors of these shapes, each treated as
            its own matrix.

    Returns:
        The sum of the ranks' approximations, of ``tensor``'s shape and dtype, identical on
        every rank.

    Raises:
        CollectiveInputError: bad input on any rank, raised on every rank together.
    """
    world = _comm.world(group)
    inner = unwrap(compressor)
    tx = transaction
    if error == (0, ""):
        error = local_check(tensor, compressor, algorithm, ("auto", "powersgd"))
    code, msg = error
    if world == 1 and code:
        raise wire.CollectiveInputError(f"allreduce: {msg}")
    ef = compressor if has_feedback(compressor) else None
    src = tensor
    if code:  # keep the message sizes right; raised on every rank after round 1
        src = torch.zeros(tensor.shape, dtype=torch.float32, device=tensor.device)
    flat = src.reshape(-1)
    m = ef.compensate(src, key).reshape(-1) if ef is not None else flat
    pieces, off = [], 0
    for shape in (shapes if shapes is not None else [tuple(tensor.shape)]):
        n = 1
        for s in shape:
            n *= s
        pieces.append(m[off:off + n].view(shape))
        off += n
    lowrank = [inner.is_compressed(p) for p in pieces]
    wkeys = [key] if shapes is None else [(key, i) for i in range(len(pieces))]
    try:
        with codec_timer(stats, "compress"):
            ps = [inner.begin(p, wkeys[i]) for i, p in enumerate(pieces) if lowrank[i]]
    except Exception as exc:  # noqa: BLE001 - raised on every rank through the status
        code, msg = wire.E_MISUSE, f"compress failed: {type(exc).__name__}: {exc}"
        ps = [torch.zeros(p.shape[0], inner.rank, device=flat.device) for i, p in enumerate(pieces) if lowrank[i]]
    dense = [p.reshape(-1) for i, p in enumerate(pieces) if not lowrank[i]]
    round1 = torch.cat([t.reshape(-1).float() for t in ps + dense]
                       + [torch.empty(wire.SUM_SLOTS, device=flat.device)])
    wire.sum_slots(round1, error=code, nonfinite=nonfinite_flag(m) if ef is not None else None,
                   rank=_comm.rank(group), world=world)
    _comm.all_reduce_(round1, group=group, stats=stats)
    wire.check_sum_slots(round1, "allreduce", msg, world)
    views1, pos = [], 0
    for t in ps + dense:
        views1.append(round1[pos:pos + t.numel()].view(t.shape))
        pos += t.numel()
    p_sums, dense_sums = views1[:len(ps)], views1[len(ps):]
    mats = [(i, p) for i, p in enumerate(pieces) if lowrank[i]]
    with codec_timer(stats, "compress"):
        qs = [inner.middle(p, p_sum, wkeys[i]) for (i, p), p_sum in zip(mats, p_sums)]
    if qs:
        round2 = torch.cat([q.reshape(-1) for q in qs])
        _comm.all_reduce_(round2, group=group, stats=stats)
    out = torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)
    off, qpos, j, d = 0, 0, 0, 0
    t_decode = time.perf_counter()
    for i, p in enumerate(pieces):
        n = p.numel()
        if lowrank[i]:
            q_sum = round2[qpos:qpos + qs[j].numel()].view(qs[j].shape)
            qpos += qs[j].numel()
            out[off:off + n] = inner.end(p_sums[j], q_sum, wkeys[i], (n,), torch.float32)
            j += 1
        else:
            out[off:off + n] = dense_sums[d]
            d += 1
        off += n
    if stats is not None:
        stats.add_codec("decompress", time.perf_counter() - t_decode)
    if ef is not None:
        _stage_residual(ef, key, m.view(src.shape), out, pieces, lowrank, world, round1[-1] != 0, tx)
    if stats is not None:
        stats.add(calls=1, algorithm="powersgd" if world > 1 else "local")
    return out.to(tensor.dtype).reshape(tensor.shape)


def _stage_residual(ef, key, compensated: torch.Tensor, out: torch.Tensor, pieces, lowrank: list[bool],
                    world: int, bad: torch.Tensor, tx: ResidualTransaction) -> None:
    """Residual ``M - aggregate / P`` staged in ``tx`` (pieces sent as they are leave none); a
    NaN/inf on any rank (``bad``) marks ``tx`` and makes ``out`` all-NaN."""
    sent = out / world
    off = 0
    for i, p in enumerate(pieces):
        if not lowrank[i]:
            sent[off:off + p.numel()] = p.reshape(-1)
        off += p.numel()
    ef.stage(key, compensated, sent.view(compensated.shape), transaction=tx)
    tx.mark_bad(bad)
    wire.poison_(out, bad)
