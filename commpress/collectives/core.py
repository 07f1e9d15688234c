"""``allreduce(tensor, compressor)``: compress, run the collective the compressor's
aggregation kind needs, decompress; returns the **sum** over ranks (not the mean),
bitwise identical on every rank.

=========== ===================================================================
aggregation steady-state messages (status inside, see :mod:`.wire`)
=========== ===================================================================
``sum``     one ``all_reduce`` of the payload plus two status slots
``sparse``  one fixed-size ``all_gather`` of ``capacity`` entries (``"allgather"``)
            or one ``all_reduce`` of the densified entries (``"dense"``; with
            error feedback, of the whole compensated tensor, taken whenever
            the gathered slots would be no smaller)
``gather``  ``all_to_all`` + ``all_gather`` (``"two_phase"``) or one ``all_gather``
            (``"gather_all"``), sizes derived from numel
``lowrank`` two ``all_reduce`` (PowerSGD), batched over the matrices of the tensor
=========== ===================================================================

``dense=`` (the DDP hook's 1-D and small parameters) rides raw in the ``"allgather"`` /
``"gather_all"`` message at P <= 2, where an all_gather sends the bytes of a ring all_reduce
(so does a sparsifier's whole compensated tensor with error feedback, gathered there),
and in the ``"two_phase"`` phases at any P (its chunks to their owners, the owners' sums to
all: ring bytes): no round of its own (:func:`carries_dense`); elsewhere it takes its own
``all_reduce``.

Nothing is exchanged before the payload: sizes and the ``"auto"`` choice are pure
functions of ``numel``, the configuration, ``P`` and the calibrated cost model.
``validate=True`` (the default) agrees on those static facts once per key with a
header exchange (:func:`~commpress.collectives.validate.check_once`); later calls
with the same facts send only their payload.  Bad input on any rank (a compress
error, an unsupported dtype) travels in the status and raises
:class:`~commpress.collectives.wire.CollectiveInputError` on every rank together.

Error feedback: ``compressor`` may be a :class:`commpress.ErrorFeedback`.  Its
residual updates are staged in ``transaction`` (a new one per call when not
given) and committed on the device with the call's verdict: when any rank's
input held a NaN/inf, the result is all-NaN (AMP's GradScaler skips the step)
and every residual keeps its value.
"""

from __future__ import annotations

from typing import Any

import torch

from ..compressors.base import Compressor, Payload
from ..feedback import ResidualTransaction, nonfinite_flag, owns_transaction
from . import _comm, costmodel, lowrank, quantized, sparse, wire
from .wire import cast_message, fingerprint, has_feedback, local_check, try_compress_fixed, unwrap
from .accounting import CommStats, codec_timer
from .validate import check_once

ALLREDUCE_ALGORITHMS = {
    "sum": ("auto", "allreduce"),
    "sparse": ("auto",) + sparse.SPARSE_ALGORITHMS,
    "gather": ("auto", "two_phase", "gather_all"),
    "lowrank": ("auto", "powersgd"),
}


@owns_transaction
def allreduce(tensor: torch.Tensor, compressor: Compressor, *, group=None, key: Any = 0, step: int = 0,
              algorithm: str = "auto", stats: CommStats | None = None,
              generator: torch.Generator | None = None, validate: bool = True,
              transaction: ResidualTransaction | None = None,
              shapes: list[tuple[int, ...]] | None = None, out: torch.Tensor | None = None,
              hierarchy=None, prescale: float | None = None, dense: torch.Tensor | None = None,
              passengers: wire.Passengers | None = None, _error: tuple[int, str] | None = None) -> torch.Tensor:
    """Compressed sum of ``tensor`` over the ranks of ``group``, identical on every rank.

    Compress, run the collective the compressor's aggregation kind needs (the module's table:
    one ``all_reduce`` for ``"sum"``, one fixed-size ``all_gather`` or one ``all_reduce`` for
    ``"sparse"``, ``all_to_all`` + ``all_gather`` or one ``all_gather`` for ``"gather"``, two
    ``all_reduce`` for ``"lowrank"``), decompress.  On the wire: the payload's tensors and an
    8-byte status word (:mod:`.wire`), nothing else in steady state; the first call per ``key``
    adds a header exchange when ``validate``.  Returns the **sum**, not the mean.

    ``dense``: a contiguous floating tensor (any numel, ``tensor``'s device) summed over the
    ranks **exactly**, written back in place: the DDP hook's dense part (1-D and small
    parameters) sent with the payload.  Where it costs no more bytes than its own ring
    all_reduce (:func:`carries_dense`: the sparse ``"allgather"`` and the quantized
    ``"gather_all"`` message at P <= 2, and there also a sparsifier's whole compensated
    tensor with error feedback, sent as one all_gather; the quantized ``"two_phase"``
    phases at any P) it rides raw in the payload's messages, no round of its own, and the P
    contributions are added in rank order (fp32 for fp16 / bf16), so the sum is bitwise the
    same on every rank; its NaN/inf joins this rank's status (with error feedback: the result
    all-NaN and the residuals kept, as for the payload), and an error anywhere raises on every
    rank.  Otherwise it takes one ``all_reduce`` of its own after the payload's collective
    (with error feedback a NaN/inf in it is the call's verdict alike).

    Args:
        tensor: the floating tensor to sum (any shape; the compressor's supported dtypes).
        compressor: a :class:`~commpress.Compressor`, or a :class:`~commpress.ErrorFeedback`
            around one (its residual updates are staged in ``transaction``).
        group: the process group (``None``: the default group).
        key: names the tensor (bucket, parameter) for per-tensor state: error-feedback
            residuals, PowerSGD warm starts, shared random seeds.
        step: the training step (sparsifiers' density schedules, shared seeds).
        algorithm: ``"auto"`` (the calibrated cost model, the same choice on every rank) or one
            of the kind's algorithms (:data:`ALLREDUCE_ALGORITHMS`).
        stats: a :class:`~commpress.collectives.CommStats` that counts this rank's bytes,
            messages and algorithm.
        generator: the random generator of a stochastic compressor (default: one seeded from
            ``key`` and ``step``).
        validate: ``False`` skips the first-call header exchange (the caller guarantees equal
            static facts on every rank, as the hooks do after registration).
        transaction: a :class:`~commpress.collectives.ResidualTransaction` that collects the
            residual updates of several calls (a training step) for one commit by the caller;
            without one the call commits its own, on the device, with its verdict: when any
            rank's input held a NaN/inf the result is all-NaN and every residual keeps its value.
        shapes: (``"lowrank"`` only) ``tensor`` is the flat concatenation of tensors of these
            shapes, all sent in one batched PowerSGD protocol.
        out: a tensor of ``tensor``'s shape and dtype (may be ``tensor`` itself) written and
            returned.
        hierarchy: a :class:`~commpress.collectives.Hierarchy`: dense inside each node,
            compressed between nodes (:mod:`.hierarchy`).
        prescale: reduce ``tensor * prescale`` instead (``tensor`` is not changed); identity /
            fp16 / bf16 fold it into their cast, error feedback around a sparsifier or a gather
            kind into its compensation pass (:func:`folds_scale`), a ``hierarchy`` into its
            intra-node copy: how the DDP hook averages at no extra pass.
        dense: a part summed exactly beside the payload (above).
        passengers: (:class:`~.wire.Passengers`) messages of calls held earlier
            (:func:`~.joint.hold`) that ride in this call's first ``all_gather`` where it takes a
            steady lane; ``passengers.carried`` tells, and the rows reach ``passengers.landing``
            as soon as they arrive (each held call's :meth:`~.joint.Held.land`) or, uncarried,
            the caller gathers them itself (:func:`~.joint.gather_held`).

    Returns:
        The sum over ranks, of ``tensor``'s shape and dtype (``out`` when given), bitwise the
        same on every rank.

    Raises:
        TypeError: ``tensor`` is not a tensor, ``compressor`` not a compressor, or ``dense``
            not a tensor (before anything is sent).
        ValueError: an algorithm the kind does not have, a bad ``out``, ``dense`` or
            ``prescale`` (before anything is sent).
        CollectiveInputError: bad input on any rank (a compress error, an unsupported dtype,
            static facts that differ), raised on every rank together.

    Example::

        >>> c = commpress.get("blockquant", bits=4)
        >>> total = commpress.collectives.allreduce(grad, c, key="layer1", step=step)
        >>> mean = total / dist.get_world_size()
    """
    if dense is not None:
        _check_dense(dense, tensor)
    if prescale is not None and hierarchy is None and not (_casts(compressor) or folds_scale(compressor)):
        tensor, prescale = tensor * prescale, None
    if hierarchy is not None:  # the two-level protocol is built on this function (no import back)
        out = hierarchy.allreduce(tensor, compressor, group=group, key=key, step=step, algorithm=algorithm,
                                  stats=stats, generator=generator, validate=validate, transaction=transaction,
                                  shapes=shapes, out=out, prescale=prescale)
        if dense is not None:
            _dense_round(dense, compressor, group, stats, transaction, out)
        return out
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"allreduce: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    inner = unwrap(compressor)
    kind = getattr(inner, "aggregation", None)
    if kind not in ALLREDUCE_ALGORITHMS:
        raise TypeError(f"allreduce: compressor must be a commpress Compressor with aggregation in "
                        f"{tuple(ALLREDUCE_ALGORITHMS)}, got {compressor!r}")
    wire.flush_deferred()
    err = _error or local_check(tensor, compressor, algorithm, ALLREDUCE_ALGORITHMS[kind])
    states = None
    if validate:
        facts = (kind, tensor.numel(), str(tensor.dtype), algorithm, fingerprint(compressor))
        if dense is not None:
            facts += ("dense", dense.numel(), str(dense.dtype))
        states = check_once(group, key, facts, device=_comm.comm_device(group, tensor), error=err[0],
                            numel=tensor.numel(), dtype=tensor.dtype, algorithm=algorithm, kind=kind,
                            config=fingerprint(compressor), stats=stats, local_message=err[1],
                            what="allreduce")
    if algorithm == "auto" and kind == "gather" and _comm.world(group) > 1:  # sparse: by bytes alone
        model = (costmodel.agreed_cost_model(states, group) if states is not None
                 else costmodel.get_cost_model(group))
    else:
        model = None
    tx = transaction
    args = dict(group=group, key=key, step=step, algorithm=algorithm, stats=stats, generator=generator,
                transaction=tx, error=err, model=model)
    if out is not None and (out.shape != tensor.shape or out.dtype != tensor.dtype):
        raise ValueError(f"allreduce: out must have tensor's shape {tuple(tensor.shape)} and dtype "
                         f"{tensor.dtype}, got {tuple(out.shape)} {out.dtype}")
    result = out
    rider = wire.Rider(dense) if dense is not None else None
    if kind == "sum":
        out = _sum_path(tensor, compressor, out=result, prescale=prescale, **args)
    elif kind == "sparse":
        out = sparse.fixed_sparse_allreduce(tensor, compressor, out=result, dense=rider, passengers=passengers,
                                            scale=1.0 if prescale is None else prescale, **args)
    elif kind == "gather":
        out = quantized.quantized_allreduce(tensor, compressor, out=result, dense=rider, passengers=passengers,
                                            scale=1.0 if prescale is None else prescale, **args)
    else:
        out = lowrank.powersgd_allreduce(tensor, compressor, shapes=shapes, **args)
    if result is not None and out is not result:
        result.copy_(out)
        out = result
    if rider is not None and not rider.carried:
        _dense_round(dense, compressor, group, stats, tx, out)
    return out


def _dense_round(dense, compressor, group, stats, transaction, out) -> None:
    """A dense part the payload's message did not carry: its own all_reduce, after the payload's;
    with error feedback its NaN/inf is the call's verdict too (``out`` all-NaN, residuals kept)."""
    _comm.all_reduce_(dense, group=group, stats=stats)
    if has_feedback(compressor):
        bad = nonfinite_flag(dense)
        transaction.mark_bad(bad)
        wire.poison_(out, bad)


def carries_dense(compressor: Compressor, *, world: int, algorithm: str = "auto", hierarchy=None) -> bool:
    """Whether ``allreduce(..., dense=)`` sends the dense part inside the payload's messages.

    True (no round of its own) with no hierarchy and ``world > 1`` for a gather kind
    (``"two_phase"``: in its two phases, any P; ``"gather_all"``: P <= 2; ``"auto"``: either)
    or, at P <= 2, a sparse kind (``"auto"`` / ``"allgather"``, and with error feedback
    ``"dense"`` and ``"whole_blockquant"``, the label of ``"auto"``'s whole-tensor send: the whole
    compensated tensor then goes in one all_gather with the dense part).  With ``"auto"`` a call
    may still pick an algorithm that cannot carry it (a sparse ``"dense"`` all_reduce without
    error feedback, ``"gather_all"`` at P > 2); the dense part then takes an all_reduce of its
    own.  Nothing is sent.

    Args:
        compressor: the compressor (or :class:`~commpress.ErrorFeedback`) ``allreduce`` gets.
        world: the number of ranks P.
        algorithm: the ``algorithm`` ``allreduce`` gets.
        hierarchy: the ``hierarchy`` ``allreduce`` gets (with one, never).

    Returns:
        ``True`` when the dense part rides in the payload's messages.
    """
    kind = getattr(unwrap(compressor), "aggregation", None)
    if hierarchy is not None or world < 2:
        return False
    free = wire.Rider.free(world)
    if kind == "gather":
        return algorithm in ("auto", "two_phase") or (algorithm == "gather_all" and free)
    return (kind == "sparse" and free
            and (algorithm in ("auto", "allgather")
                 or (algorithm in ("dense", "whole_blockquant") and has_feedback(compressor))))


def _check_dense(dense, tensor) -> None:
    if not isinstance(dense, torch.Tensor):
        raise TypeError(f"allreduce: dense must be a torch.Tensor, got {type(dense).__name__}")
    if not dense.is_floating_point() or not dense.is_contiguous():
        raise ValueError(f"allreduce: dense must be a contiguous floating tensor, got {dense.dtype}"
                         f"{'' if dense.is_contiguous() else ' (not contiguous)'}")
    if isinstance(tensor, torch.Tensor) and dense.device != tensor.device:
        raise ValueError(f"allreduce: dense must be on tensor's device {tensor.device}, got {dense.device}")


def folds_scale(compressor) -> bool:
    """Whether :func:`allreduce` folds ``prescale`` into ``compressor``'s first pass: error feedback
    around a sparsifier, a gather or a sum kind (its compensation pass,
    :meth:`ErrorFeedback.compress`); the casts fold it into their cast (:func:`_casts`)."""
    return has_feedback(compressor) and getattr(unwrap(compressor), "aggregation", None) in ("sparse", "gather",
                                                                                           "sum")


def _casts(compressor) -> bool:
    """identity / fp16 / bf16 without error feedback: the payload is the input, cast."""
    return unwrap(compressor).casts and not has_feedback(compressor)


def _sum_path(tensor, compressor, *, group, key, step, algorithm, stats, generator, transaction, error,
              model, out=None, prescale=None) -> torch.Tensor:
    """One ``all_reduce`` of the payload's tensors (one dtype) plus the status slots."""
    inner = unwrap(compressor)
    code, msg = error
    world = _comm.world(group)
    if _casts(compressor) and world > 1:
        return _cast_path(tensor, inner.cast_to or tensor.dtype, group, stats, code, msg, out, prescale)
    # error feedback folds the scale into its compensation pass and, when the output overwrites the
    # input (the hooks' out=t), works in the input: no buffer of its size
    payload, code, msg = try_compress_fixed(compressor, tensor, step=step, key=key, generator=generator,
                                            transaction=transaction, error=(code, msg), stats=stats,
                                            scale=1.0 if prescale is None else prescale,
                                            scratch=sparse._is_scratch(tensor, out))
    if world == 1:
        if code:
            raise wire.CollectiveInputError(f"allreduce: {msg}")
        if stats is not None:
            stats.add(calls=1, algorithm="local")
        return inner.decompress(payload).to(tensor.dtype).reshape(tensor.shape)
    flat = tensor.reshape(-1)
    if payload is None:  # zeros of the right size (remembered from a good call): no rank is left waiting
        payload = quantized._templates(inner, flat, [0, flat.numel()], step)[0]
    else:
        quantized._remember(inner, flat, [0, flat.numel()], [payload], step)
    dtype = payload.tensors[0].dtype
    sizes = [t.numel() for t in payload.tensors]
    msg_buf = torch.empty(sum(sizes) + wire.SUM_SLOTS, dtype=dtype, device=tensor.device)
    pos = 0
    for t, n in zip(payload.tensors, sizes):
        msg_buf[pos:pos + n].copy_(t.reshape(-1))
        pos += n
    bad_local = payload.nonfinite
    wire.sum_slots(msg_buf, error=code, nonfinite=bad_local, rank=_comm.rank(group), world=world)
    _comm.all_reduce_(msg_buf, group=group, stats=stats)
    wire.check_sum_slots(msg_buf, "allreduce", msg, world)
    bad = msg_buf[-1] != 0 if has_feedback(compressor) else None
    pos, wires = 0, []
    for t, n in zip(payload.tensors, sizes):
        wires.append(msg_buf[pos:pos + n].view(t.shape))
        pos += n
    summed = Payload(tuple(wires), payload.shape, payload.dtype, payload.numel, payload.meta)
    if stats is not None:
        stats.add(calls=1, algorithm="allreduce")
    with codec_timer(stats, "decompress"):
        out = inner.decompress(summed).to(tensor.dtype).reshape(tensor.shape)
    if bad is not None:
        transaction.mark_bad(bad)
        wire.poison_(out, bad)
    return out


def _cast_path(tensor, wire_dtype, group, stats, code, msg, out, prescale=None) -> torch.Tensor:
    """identity / fp16 / bf16 without error feedback: the cast is written straight into the
    message and the sum cast back into ``out`` (no payload tensors in between)."""
    n = tensor.numel()
    if code:
        message = torch.zeros(n + wire.SUM_SLOTS, dtype=wire_dtype, device=tensor.device)
    else:
        message = cast_message(tensor, wire_dtype, prescale, slots=wire.SUM_SLOTS)
    world = _comm.world(group)
    wire.sum_slots(message, error=code, rank=_comm.rank(group), world=world)
    _comm.all_reduce_(message, group=group, stats=stats)
    wire.check_sum_slots(message, "allreduce", msg, world)
    if stats is not None:
        stats.add(calls=1, algorithm="allreduce")
    if out is None:
        return message[:n].to(tensor.dtype).reshape(tensor.shape)
    out.view(-1).copy_(message[:n])
    return out


@owns_transaction
def all_gather(tensor: torch.Tensor, compressor: Compressor, *, group=None, key: Any = 0, step: int = 0,
               stats: CommStats | None = None, out: torch.Tensor | None = None,
               generator: torch.Generator | int | None = None, validate: bool = True,
               transaction: ResidualTransaction | None = None) -> torch.Tensor:
    """Every rank's ``tensor``, compressed on the wire, decoded, in a ``[P, *tensor.shape]`` tensor.

    Row ``r`` comes from rank ``r`` (this rank's own row decoded too, so every rank holds the
    same values).  FSDP2's quantized parameter all-gather is this call.

    Wire: ONE ``all_gather`` of ``w`` bytes per rank: the 8-byte status word of :mod:`.wire`
    (error code, signature of the static facts) and the fixed-size payload
    (``compress_fixed``), each tensor 8-aligned; ``w = 8 + Σ align8(tensor bytes)``.  A
    quantizer (aggregation ``"gather"``) or a ``"sum"`` compressor sends its codes as they are;
    a sparsifier (``"sparse"``: topk, dgc, threshold) sends exactly
    ``capacity(numel, step)`` slots of ``(indices, values)`` (int32 indices when ``numel <
    2**31``, values in ``tensor``'s dtype), a slot with no entry holding index ``numel`` and value
    0 (:class:`~commpress.compressors._sparse.SparseCompressor`), so ``w`` follows from ``numel``
    and ``step`` alone and row ``r`` is ``decompress(compress_fixed(x_r))``: the kept entries,
    zeros elsewhere.  A rank whose compress fails sends a zero payload of the same size, and every
    rank raises :class:`~commpress.collectives.wire.CollectiveInputError` together.

    Args:
        tensor: this rank's floating tensor (the same numel and dtype on every rank).
        compressor: a fixed-size kind (``"gather"``, ``"sum"`` or ``"sparse"``), or a
            :class:`~commpress.ErrorFeedback` around one: its residual update (what this rank's
            row did not carry) is staged in ``transaction``.
        group: the process group (``None``: the default group).
        key: names the tensor for per-tensor state (residuals, seeds, the header check).
        step: the training step (a sparsifier's capacity, stochastic rounding's seed).
        stats: a :class:`~commpress.collectives.CommStats` that counts this rank's bytes.
        out: ``P * numel`` elements of ``tensor``'s dtype (any shape, contiguous), written and
            returned viewed as ``[P, *tensor.shape]``.
        generator: a ``torch.Generator`` or an int seed for stochastic rounding.
        validate: agree on ``(numel, dtype, compressor)`` with one header exchange the first time
            a key is seen (``False``: the caller guarantees it).
        transaction: collects the residual update for the caller's commit (a new one per call
            when not given, committed when the call returns and dropped when it raises).

    Returns:
        A ``[P, *tensor.shape]`` tensor of ``tensor``'s dtype (``out`` viewed so when given).

    Raises:
        TypeError: ``compressor`` is not of a fixed-size kind.
        CollectiveInputError: a compress error or static facts that differ on any rank, on every
            rank together.

    Example::

        >>> rows = commpress.collectives.all_gather(shard, commpress.get("blockquant", bits=8))
        >>> rows.shape == (dist.get_world_size(), *shard.shape)
    """
    inner = unwrap(compressor)
    if getattr(inner, "aggregation", None) not in ("gather", "sum", "sparse"):
        raise TypeError(f"all_gather: compressor must be a fixed-size commpress Compressor (aggregation "
                        f"'gather', 'sum' or 'sparse'), got {compressor!r}")
    wire.flush_deferred()
    world, n = _comm.world(group), tensor.numel()
    err = local_check(tensor, compressor, "auto", ("auto",))
    if validate:
        check_once(group, key, ("all_gather", n, str(tensor.dtype), fingerprint(compressor)),
                   device=_comm.comm_device(group, tensor), error=err[0], numel=n, dtype=tensor.dtype,
                   algorithm="auto", kind="gather", config=fingerprint(compressor), stats=stats,
                   local_message=err[1], what="all_gather")
    payload, code, msg = try_compress_fixed(compressor, tensor, step=step, key=key, generator=generator,
                                            transaction=transaction, error=err)
    result = torch.empty(world * n, dtype=tensor.dtype, device=tensor.device) if out is None else out
    rows_out = result.view(world, n)
    if world == 1:
        if code:
            raise wire.CollectiveInputError(f"all_gather: {msg}")
        rows_out[0].copy_(inner.decompress(payload).reshape(-1))
        return result.view((world,) + tuple(tensor.shape))
    flat = tensor.reshape(-1)
    if payload is None:  # a zero payload of the right size: the other ranks are not left waiting
        payload = quantized._templates(inner, flat, [0, n], step)[0]
    else:
        quantized._remember(inner, flat, [0, n], [payload], step)
    layout = wire.Layout.of(payload.tensors)
    sig = wire.signature("all_gather", n, str(tensor.dtype), layout.width, fingerprint(compressor))
    message = torch.empty(layout.width, dtype=torch.uint8, device=tensor.device)
    layout.write(message, payload.tensors, wire.status_word(tensor.device, error=code, sig=sig))
    rows = _comm.all_gather(message, group, stats)
    wire.check_byte_statuses(wire.read_status(rows), sig, "all_gather", msg)
    for r in range(world):
        got = Payload(tuple(layout.read(rows[r])), payload.shape, payload.dtype, payload.numel, payload.meta)
        rows_out[r].copy_(inner.decompress(got).reshape(-1))
    if stats is not None:
        stats.add(calls=1, algorithm="all_gather")
    return result.view((world,) + tuple(tensor.shape))
