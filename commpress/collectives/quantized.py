"""Two-phase quantized allreduce and reduce-scatter for ``"gather"`` compressors.

Codes that must be decoded before they can be added (qsgd, terngrad, signsgd,
blockquant) are aggregated like 1-bit Adam / ZeRO++:

1. the flat tensor is cut into P chunks (boundaries rounded up to the
   compressor's block / chunk size when it has one, see :func:`chunk_bounds`);
   every rank compresses chunk ``r`` with ``key=(key, r)``;
2. ``all_to_all_single``: chunk ``r`` of every rank goes to rank ``r`` (its *owner*);
3. the owner decodes the P pieces and sums them in fp32 **in rank order**;
4. the owner re-compresses its sum (``key=("owner", key, r)``); with error
   feedback the owner's residual lives in the same
   :class:`~commpress.ErrorFeedback` under that key (so it is in its
   ``state_dict``) and is staged in the same transaction;
5. ``all_gather`` of the owners' payloads; every rank decodes every chunk, so
   all ranks hold bitwise the same result.

``"gather_all"`` (cheaper for P <= 2, chosen by the cost model): one
``all_gather`` of every rank's compressed chunks, every rank decodes all P x P
pieces and sums them in rank order (no re-compression).  Where the calibrated
link puts a chunk's message long enough on the wire (:func:`pipelines`), one
``all_gather`` per chunk instead, each started as soon as its chunk is encoded,
so the wire overlaps the codec (:func:`_gather_all_pipelined`; bitwise the same
result).

Wire format (:mod:`.wire`): each message is the status word followed by the
payload's tensors.  A payload's size depends only on its chunk's numel and
dtype, so every rank knows every message size from its own payloads: no size
exchange.  The owner forwards the worst phase-1 status it received in its
phase-2 message, so every rank learns every error and NaN/inf in the same
two rounds.

:func:`reduce_scatter` is phases 1-3 alone on an input made of P equal
shards (FSDP2's layout): rank ``r`` gets the sum of shard ``r``.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

import torch

from ..compressors.base import Payload
from ..feedback import ErrorFeedback, ResidualTransaction, owns_transaction
from . import _comm, costmodel, sparse, steady, wire
from .wire import compress_fixed, fingerprint, has_feedback, local_check, size_step, unwrap
from .accounting import CommStats, codec_timer
from .validate import check_once

def alignment(compressor: Any) -> int:
    """The chain's :attr:`~commpress.Compressor.alignment` (a block quantizer's block), at least 1."""
    return max(1, int(unwrap(compressor).alignment))


def chunk_bounds(numel: int, world: int, align: int = 1) -> list[int]:
    """Chunk ``r`` is ``[b[r], b[r+1])``: ``ceil(numel/P)`` rounded up to ``align``, the last ones shorter."""
    per = -(-numel // world) if world else numel
    per = -(-per // align) * align
    return [min(numel, r * per) for r in range(world + 1)]


# ---------------------------------------------------------------- helpers
def _piece(tensors: list[torch.Tensor], template: Payload) -> Payload:
    return Payload(tuple(tensors), template.shape, template.dtype, template.numel, template.meta)


def _chunk_payloads(flat, compressor, bounds, key, step, generator, transaction, error, stats=None,
                    scale: float = 1.0, scratch: bool = False):
    """Chunk by chunk, ``(payload, NaN/inf flag or None, code, message)``: chunk ``r`` compressed
    with ``key=(key, r)``, or, once a local error is known (``error``, or a compress that raised:
    :data:`~.wire.E_MISUSE`), the zeros payload of its size, so the message sizes stay right.
    Lazy: a pipeline sends each chunk before the next is compressed."""
    inner = unwrap(compressor)
    code, msg = error
    templates = None
    for r in range(len(bounds) - 1):
        p = None
        if not code:
            try:
                with codec_timer(stats, "compress"):
                    p = compress_fixed(compressor, flat[bounds[r]:bounds[r + 1]], step=step,
                                       key=(key, r), generator=generator, transaction=transaction, scale=scale,
                                       scratch=scratch)
            except Exception as exc:  # noqa: BLE001 - raised on every rank through the status
                code, msg = wire.E_MISUSE, f"compress failed: {type(exc).__name__}: {exc}"
        if p is None:
            templates = templates or _templates(inner, flat, bounds, step)
            yield templates[r], None, code, msg
        else:   # this rank's NaN/inf verdict, from the chunk's own scan
            yield p, p.nonfinite, code, msg


def _compress_chunks(flat, compressor, bounds, key, step, generator, transaction, error, stats=None,
                     scale: float = 1.0, scratch: bool = False):
    """Every chunk's fixed-size payload (all zeros-payloads after a local error, so the
    message sizes stay right); returns ``(payloads, code, message, NaN/inf flag or None)``."""
    inner = unwrap(compressor)
    payloads, bad = [], None
    code, msg = error
    for p, flag, code, msg in _chunk_payloads(flat, compressor, bounds, key, step, generator, transaction,
                                              error, stats, scale, scratch):
        payloads.append(p)
        if flag is not None:
            bad = flag if bad is None else bad | flag
    if code:
        return _templates(inner, flat, bounds, step), code, msg, None
    _remember(inner, flat, bounds, payloads, step)
    return payloads, code, msg, bad


#: per compressor and layout, what its payloads look like (their tensors' shapes and dtypes, not the
#: tensors: zeros of a dense payload's size kept here would be a model-size buffer nobody counts)
_TEMPLATES: "weakref.WeakKeyDictionary[Any, dict[tuple, list[_Shape]]]" = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True)
class _Shape:
    """A payload without its tensors: their shapes and dtypes, and the payload's own fields."""

    tensors: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    template: Payload

    @classmethod
    def of(cls, p: Payload) -> "_Shape":
        bare = Payload((), p.shape, p.dtype, p.numel, p.meta)
        return cls(tuple((tuple(t.shape), t.dtype) for t in p.tensors), bare)

    def zeros(self, device: torch.device) -> Payload:
        return _piece([torch.zeros(s, dtype=d, device=device) for s, d in self.tensors], self.template)


_TEMPLATES_LOCK = threading.Lock()


def _layout_key(inner, flat, bounds, step) -> tuple:
    """What fixes the payloads' sizes: the chunks, the device and, for a compressor with a
    density warm-up, its density at ``step``."""
    return (tuple(bounds), str(flat.device), inner.ratio_at(step))


def _remember(inner, flat, bounds, payloads, step) -> None:
    """Keep zero payloads of this layout: a rank whose compress fails later can still send
    messages of the right sizes (the others must not be left waiting)."""
    key = _layout_key(inner, flat, bounds, step)
    with _TEMPLATES_LOCK:
        layouts = _TEMPLATES.setdefault(inner, {})
        if key in layouts:
            return
        if len(layouts) >= 64:
            layouts.pop(next(iter(layouts)))
        layouts[key] = [_Shape.of(p) for p in payloads]


def _templates(inner, flat, bounds, step) -> list[Payload]:
    """Zero payloads of the right layout: remembered, else compressed from zeros (which
    raises when even that fails: then this rank cannot take part, and says why)."""
    with _TEMPLATES_LOCK:
        remembered = _TEMPLATES.get(inner, {}).get(_layout_key(inner, flat, bounds, step))
    if remembered is not None:
        return [shape.zeros(flat.device) for shape in remembered]
    zeros = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
    return [inner.compress_fixed(zeros[bounds[r]:bounds[r + 1]], step=size_step(inner, step))
            for r in range(len(bounds) - 1)]


def _status(flat, code, sig, bad):
    return wire.status_word(flat.device, error=code, sig=sig, nonfinite=bad)


def _phase1(flat, payloads, code, sig, bad, group, stats, extra=None):
    """All-to-all of ``[status | payload of chunk r]`` to owner ``r``; returns the P received
    messages ``[P, width]`` (uint8) and this rank's chunk layout.  ``extra``: one raw tensor
    per owner, sent after its payload (a riding dense part's chunks)."""
    world, me = _comm.world(group), _comm.rank(group)
    parts = [p.tensors if extra is None else p.tensors + (extra[r],) for r, p in enumerate(payloads)]
    layouts = [wire.Layout.of(t) for t in parts]
    status = _status(flat, code, sig, bad)
    send = torch.empty(sum(lay.width for lay in layouts), dtype=torch.uint8, device=flat.device)
    off = 0
    for t, lay in zip(parts, layouts):
        lay.write(send[off:off + lay.width], t, status)
        off += lay.width
    mine = layouts[me]
    recv = _comm.all_to_all_bytes(send, [lay.width for lay in layouts], [mine.width] * world,
                                  group=group, stats=stats)
    return recv.reshape(world, mine.width), mine


def _owner_sum(inner, received, layout, template) -> torch.Tensor:
    """Decode the P pieces of this rank's chunk and add them in rank order (fp32)."""
    acc = torch.empty(template.numel, dtype=torch.float32, device=received.device)
    k = len(template.tensors)
    _decode_sum_into(inner, [_piece(layout.read(received[s])[:k], template) for s in range(received.shape[0])], acc)
    return acc


def _decode_sum_into(inner, pieces: list[Payload], dst: torch.Tensor) -> None:
    """``dst`` (flat fp32) := the sum of the decoded ``pieces`` in their order: in fused passes
    when the compressor has ``decompress_sum`` (blockquant: two pieces per pass over ``dst``),
    else the first decoded into ``dst`` and each later one added (:func:`_decode_into`)."""
    if len(pieces) > 1 and pieces[0].dtype == torch.float32 and hasattr(inner, "decompress_sum"):
        inner.decompress_sum(pieces, dst)
        return
    for s, piece in enumerate(pieces):
        _decode_into(inner, piece, dst, add=s > 0)


def _decode_into(inner, piece: Payload, dst: torch.Tensor, add: bool) -> None:
    """Decode ``piece`` straight into the flat fp32 ``dst`` (no temporaries, no copy):
    written, or added (``add``) in one pass when the compressor has ``decompress_add``."""
    if not add and piece.dtype == torch.float32:
        inner.decompress(piece, out=dst)
    elif add and piece.dtype == torch.float32 and hasattr(inner, "decompress_add"):
        inner.decompress_add(piece, dst)
    elif add:
        dst += inner.decompress(piece).float().reshape(-1)
    else:
        dst.copy_(inner.decompress(piece).reshape(-1))


def _worst(statuses: torch.Tensor, sig: int, out: torch.Tensor) -> torch.Tensor:
    """The status an owner forwards: max error code (configuration error when the
    signatures differ), any NaN/inf, its own signature; device ops only."""
    flags = statuses[:, 0]
    codes = (flags >> 8) & 0xFF
    code = torch.maximum(codes.amax(), (statuses[:, 1] != sig).any().to(codes.dtype) * wire.E_CONFIG)
    word = (code << 8) | (flags & wire.NONFINITE).amax()
    if statuses.shape[0] <= 15:  # which senders reported an error, for the message on every rank
        bits = torch.ones_like(codes) << torch.arange(statuses.shape[0], device=codes.device, dtype=codes.dtype)
        word = word | ((codes != 0).to(codes.dtype) * bits).sum() << 16
    out[0:1].copy_(word.reshape(1))
    out[1].fill_(sig)
    return out


def _verdict(messages, what, msg, out, compressor, transaction) -> None:
    """Judge a call's messages (``[(statuses, signature)]``, each its own signature): raise on every
    rank on an error anywhere; with error feedback, a NaN/inf anywhere poisons ``out`` and keeps
    the residuals."""
    if all(st.device.type == "cpu" for st, _ in messages):   # host memory: judged in numpy, no torch op
        steady.judge(messages, what, msg, out, compressor, transaction)
        return
    for statuses, sig in messages:
        wire.check_byte_statuses(statuses, sig, what, msg)
    if has_feedback(compressor):
        statuses = messages[0][0] if len(messages) == 1 else torch.cat([st for st, _ in messages])
        bad = wire.any_nonfinite(statuses)
        transaction.mark_bad(bad)
        wire.poison_(out, bad)


# ---------------------------------------------------------------- public API
@owns_transaction
def quantized_allreduce(tensor: torch.Tensor, compressor: Any, *, group=None, key: Any = 0, step: int = 0,
                        algorithm: str = "auto", stats: CommStats | None = None,
                        generator: torch.Generator | None = None,
                        transaction: ResidualTransaction | None = None, error: tuple[int, str] = (0, ""),
                        model: costmodel.CostModel | None = None, out: torch.Tensor | None = None,
                        dense: wire.Rider | None = None, passengers: wire.Passengers | None = None,
                        scale: float = 1.0) -> torch.Tensor:
    """Sum of ``tensor`` over ranks through a ``"gather"`` compressor; identical on every rank.

    Called by :func:`commpress.collectives.allreduce`, which checks the arguments and owns the
    transaction; call that one unless you need this kind's options.  Wire: ``"two_phase"``, one
    ``all_to_all`` (chunk ``r``'s payload to its owner ``r``) then one ``all_gather`` (each owner's
    re-encoded sum); ``"gather_all"``, one ``all_gather`` of every rank's whole payload, decoded
    and summed on every rank; each message behind the 8-byte status word of :mod:`.wire`.

    ``dense`` (:class:`~.wire.Rider`) rides raw where that costs no more bytes than its own ring
    all_reduce, its NaN/inf in this rank's status flag: ``"two_phase"`` sends chunk ``r`` to
    owner ``r`` after the payload, the owner sums it in rank order and sends the sum with its own
    (a reduce-scatter then an all-gather: ring bytes); ``"gather_all"`` (P <= 2 only) sends it
    whole and every rank sums in rank order.  Left uncarried otherwise (``"gather_all"`` at
    P > 2: the caller all-reduces it).

    Args:
        tensor: the floating tensor to sum.
        compressor: a ``"gather"`` compressor (blockquant, fp8, mx, ...) or a
            :class:`~commpress.ErrorFeedback` around one.
        group: the process group (``None``: the default group).
        key: names the tensor for per-tensor state (residuals per chunk, seeds).
        step: the training step (stochastic rounding's seed).
        algorithm: ``"two_phase"``, ``"gather_all"`` or ``"auto"`` (the cost model ``model``).
        stats: a :class:`~commpress.collectives.CommStats` that counts this rank's bytes.
        generator: the random generator of stochastic rounding.
        transaction: collects the residual updates (error feedback) for the caller's commit.
        error: ``(code, message)`` of a local check already failed on this rank: it travels in
            the status so every rank raises together.
        model: the :class:`~commpress.collectives.CostModel` behind ``"auto"``.
        out: fp32, ``tensor``'s shape, contiguous (may be ``tensor``): the sum is decoded
            straight into it and it is returned.
        dense: a part summed exactly beside the payload (above).
        passengers: (:class:`~.wire.Passengers`) held messages that ride in the first
            ``all_gather`` on the steady lane (:mod:`.steady`); left uncarried elsewhere.
        scale: sum ``tensor * scale`` instead: each chunk's factor, folded into error feedback's
            compensation pass (a multiplication of its own without error feedback).

    Returns:
        The sum over ranks, of ``tensor``'s shape and dtype (``out`` when given).

    Raises:
        CollectiveInputError: a compress error or mismatched static facts on any rank, raised
            on every rank together.
    """
    world = _comm.world(group)
    inner = unwrap(compressor)
    tx = transaction
    if error == (0, ""):
        error = local_check(tensor, compressor, algorithm, ("auto", "two_phase", "gather_all"))
    flat = tensor.reshape(-1)
    n = flat.numel()
    if world == 1:
        return _local("allreduce", error, compressor, flat, key, step, stats, generator,
                      tx, scale).to(tensor.dtype).reshape(tensor.shape)
    bounds = chunk_bounds(n, world, alignment(compressor))
    plan = steady.plan_for(flat, compressor, group=group, algorithm=algorithm, error=error, model=model,
                           out=out, dense=dense, world=world, bounds=bounds, min_wire_s=PIPELINE_MIN_WIRE_S)
    if plan is not None:   # the steady-state lane (blockquant + error feedback on the CPU): the same bytes
        steady.run(plan, flat, compressor, group=group, key=key, step=step, stats=stats, transaction=tx,
                   dense=dense, passengers=passengers, scale=scale)
        return out
    direct = (out is not None and out.dtype == torch.float32 and out.is_contiguous()
              and out.shape == tensor.shape)
    dst = out.view(-1) if direct else torch.empty(n, dtype=torch.float32, device=flat.device)
    # out is the input itself (the hooks' out=t): error feedback may work in each chunk (read once)
    scratch = direct and out.data_ptr() == flat.data_ptr()
    sizes = _chunk_bytes(inner, flat, bounds) if algorithm == "auto" else None
    if sizes is not None:  # payload sizes are static: the choice is made before compressing
        model = model if model is not None else costmodel.get_cost_model(group)
        algorithm = costmodel.choose_gather(sum(sizes), n, world, model)
        if algorithm == "gather_all" and pipelines(model, sizes):
            if dense is not None and wire.Rider.free(world):
                dense.carried = True
            else:
                dense = None
            base = wire.signature("gather", n, str(tensor.dtype), algorithm)
            results, msg = _gather_all_pipelined(flat, compressor, inner, bounds, key, step, generator, tx, error,
                                                 base, group, stats, dst, dense, scale, scratch)
            _verdict(results, "allreduce", msg, dst, compressor, tx)
            if stats is not None:
                stats.add(calls=1, algorithm=algorithm)
            return out if direct else dst.to(tensor.dtype).reshape(tensor.shape)
    payloads, code, msg, bad = _compress_chunks(flat, compressor, bounds, key, step, generator, tx, error, stats,
                                                scale, scratch)
    if algorithm == "auto":
        total = sum(p.nbytes for p in payloads)
        model = model if model is not None else costmodel.get_cost_model(group)
        algorithm = costmodel.choose_gather(total, n, world, model)
    sig = wire.signature("gather", n, str(tensor.dtype), [p.nbytes for p in payloads], algorithm)
    # the dense part rides where that costs no more bytes than its own ring all_reduce: the
    # two phases carry its P chunks (a reduce-scatter then an all-gather: exactly ring bytes),
    # gather_all its whole at P <= 2
    if dense is not None and (algorithm == "two_phase" or wire.Rider.free(world)):
        dense.carried = True
        sig = wire.signature(sig, dense.tensor.numel(), str(dense.tensor.dtype))
        if has_feedback(compressor):
            bad = dense.flag(bad)
    else:
        dense = None
    if algorithm == "gather_all":
        statuses = _gather_all(flat, inner, payloads, code, sig, bad, bounds, group, stats, dst, dense)
    else:
        statuses = _two_phase(flat, compressor, inner, payloads, code, sig, bad, bounds, group, key, step, stats,
                              generator, tx, dst, dense)
    _verdict([(statuses, sig)], "allreduce", msg, dst, compressor, tx)
    if stats is not None:
        stats.add(calls=1, algorithm=algorithm)
    return out if direct else dst.to(tensor.dtype).reshape(tensor.shape)


def _local(caller, err, compressor, flat, key, step, stats, generator, transaction, scale: float = 1.0) -> torch.Tensor:
    """One rank: raise the input error, else compress and decode locally (nothing is sent)."""
    if err[0]:
        raise wire.CollectiveInputError(f"{caller}: {err[1]}")
    p = compress_fixed(compressor, flat, step=step, key=(key, 0), generator=generator, transaction=transaction,
                       scale=scale)
    if stats is not None:
        stats.add(calls=1, algorithm="local")
    return unwrap(compressor).decompress(p).reshape(-1)


def _two_phase(flat, compressor, inner, payloads, code, sig, bad, bounds, group, key, step, stats, generator,
               tx, out, dense=None):
    world, me = _comm.world(group), _comm.rank(group)
    pieces = None
    if dense is not None:  # chunk r of the raw dense part goes to owner r, which sums it in rank order
        d = dense.tensor.view(-1)
        dbounds = chunk_bounds(d.numel(), world)
        pieces = [d[dbounds[r]:dbounds[r + 1]] for r in range(world)]
    received, layout = _phase1(flat, payloads, code, sig, bad, group, stats, pieces)
    with codec_timer(stats, "decompress"):
        acc = _owner_sum(inner, received, layout, payloads[me])
    if pieces is not None:
        summed = torch.empty_like(pieces[me])
        wire.add_rows(summed, [layout.read(received[s])[-1] for s in range(world)])
    src = acc.to(flat.dtype if flat.dtype in inner.supported_dtypes else torch.float32)
    owner_key = ("owner", key, me)
    status = _worst(wire.read_status(received), sig, torch.empty(2, dtype=torch.int32, device=flat.device))
    try:
        codec = compressor if isinstance(compressor, ErrorFeedback) and not inner.unbiased else inner
        with codec_timer(stats, "compress"):
            p2 = compress_fixed(codec, src, step=step, key=owner_key, generator=generator, transaction=tx)
    except Exception:  # noqa: BLE001 - forwarded in the status: every rank raises
        p2 = payloads[me]  # same layout as the owner's message must have; content unused
        status[0].fill_(wire.E_MISUSE << 8)
    parts = [p.tensors if pieces is None else p.tensors + (pieces[r],) for r, p in enumerate(payloads)]
    layouts = [wire.Layout.of(t) for t in parts]
    width = max(lay.width for lay in layouts)
    message = torch.zeros(width, dtype=torch.uint8, device=flat.device)
    layouts[me].write(message, p2.tensors if pieces is None else p2.tensors + (summed,), status)
    gathered = _comm.all_gather(message, group=group, stats=stats)
    with codec_timer(stats, "decompress"):
        for r in range(world):
            got = layouts[r].read(gathered[r])
            if pieces is not None:
                pieces[r].copy_(got.pop())  # owner r's sum of dense chunk r
            _decode_into(inner, _piece(got, payloads[r]), out[bounds[r]:bounds[r + 1]], add=False)
    return wire.read_status(gathered)


def _gather_all(flat, inner, payloads, code, sig, bad, bounds, group, stats, out, dense=None):
    world = _comm.world(group)
    tensors = [t for p in payloads for t in p.tensors]
    if dense is not None:  # the raw dense part after the payloads, summed in rank order
        tensors.append(dense.tensor.reshape(-1))
    layout = wire.Layout.of(tensors)
    message = torch.empty(layout.width, dtype=torch.uint8, device=flat.device)
    layout.write(message, tensors, _status(flat, code, sig, bad))
    gathered = _comm.all_gather(message, group=group, stats=stats)
    per = [len(p.tensors) for p in payloads]
    starts = [sum(per[:r]) for r in range(world + 1)]
    decoded = [layout.read(gathered[s]) for s in range(world)]
    with codec_timer(stats, "decompress"):
        for r in range(world):  # rank order on every rank, straight into out
            _decode_sum_into(inner, [_piece(decoded[s][starts[r]:starts[r + 1]], payloads[r]) for s in range(world)],
                             out[bounds[r]:bounds[r + 1]])
    if dense is not None:
        wire.add_rows(dense.tensor.view(-1), [decoded[s][-1] for s in range(world)])
    return wire.read_status(gathered)


#: ``"gather_all"`` pipelines (one all_gather per chunk) when the cost model puts a chunk's
#: message at least this many seconds on the wire.  Below, a second message costs more than
#: the overlap saves.  Measured per call, 2 CPU ranks of one core each, blockquant 4-bit with
#: error feedback, 10 ms of compute between calls (``python -m benchmarks pipeline``):
#: at 1 Gbit/s 300K elements 4.2 -> 4.8 ms (a chunk 0.6 ms on the wire), 600K and 800K even
#: (1.3, 1.8 ms), 1.13M 10.9 -> 9.4 ms, 2.26M 22.7 -> 17.0, 4.5M 45.6 -> 32.8; at 100 Mbit/s
#: 140K even (3 ms), 300K 20.6 -> 16.9, 1.13M 77.7 -> 63.1; on loopback never better.  Set
#: well below the digits bucket's chunk (2.6 ms at the nominal 1 Gbit/s): calibrations of that
#: link read 104 to 156 MB/s run to run, and at 156 MB/s a 2 ms threshold left it in one message.
PIPELINE_MIN_WIRE_S = 1.5e-3


def pipelines(model: costmodel.CostModel, chunk_bytes: list[int]) -> bool:
    """Whether ``"gather_all"`` sends each of its P chunks in a message of its own
    (:func:`_gather_all_pipelined`): :func:`~.costmodel.pipelines_at` with :data:`PIPELINE_MIN_WIRE_S`."""
    return costmodel.pipelines_at(model, chunk_bytes, PIPELINE_MIN_WIRE_S)


def _chunk_bytes(inner, flat, bounds) -> list[int] | None:
    """Each chunk's payload bytes, known before compressing (:func:`~.wire.payload_bytes`);
    ``None`` when the compressor cannot size them (the call then compresses first, as before)."""
    try:
        return [wire.payload_bytes(inner, bounds[r + 1] - bounds[r], flat.dtype) for r in range(len(bounds) - 1)]
    except Exception:  # noqa: BLE001 - the compress itself reports the error, in the status
        return None


def _gather_all_pipelined(flat, compressor, inner, bounds, key, step, generator, tx, error, base, group, stats,
                          out, dense=None, scale: float = 1.0, scratch: bool = False):
    """``"gather_all"`` as a pipeline: one ``all_gather`` per chunk, started as soon as the chunk
    is compressed, so chunk ``r`` travels while chunk ``r+1`` is compressed and while the
    chunks before it are decoded (on a GPU the compression runs on the current stream, the
    collective on its own).  Every message is ``[status | chunk r's payload]``, the dense
    part riding raw in the first; each status is judged on its own (a rank that failed to
    compress chunk ``r`` sends zeros payloads with its error code from there on, so the
    message sizes stay right).  Returns ``([(statuses, signature)] per message, local error
    message)``."""
    world = len(bounds) - 1
    code, msg = error
    payloads, flights = [], []
    chunks = _chunk_payloads(flat, compressor, bounds, key, step, generator, tx, error, stats, scale, scratch)
    for r, (p, bad, code, msg) in enumerate(chunks):
        payloads.append(p)
        tensors = list(p.tensors)
        sig = wire.signature(base, r, p.nbytes)
        if r == 0 and dense is not None:  # the raw dense part rides in the first message
            tensors.append(dense.tensor.reshape(-1))
            sig = wire.signature(sig, dense.tensor.numel(), str(dense.tensor.dtype))
            if has_feedback(compressor):
                bad = dense.flag(bad)
        layout = wire.Layout.of(tensors)
        message = torch.empty(layout.width, dtype=torch.uint8, device=flat.device)
        layout.write(message, tensors, _status(flat, code, sig, bad))
        flights.append((_comm.all_gather_start(message, group=group, stats=stats), layout, sig, message))
    if not code:
        _remember(inner, flat, bounds, payloads, step)
    results = []
    for r, (flight, layout, sig, _) in enumerate(flights):
        gathered = flight.wait()
        decoded = [layout.read(gathered[s]) for s in range(world)]
        k = len(payloads[r].tensors)
        with codec_timer(stats, "decompress"):  # rank order on every rank, straight into out
            _decode_sum_into(inner, [_piece(decoded[s][:k], payloads[r]) for s in range(world)],
                             out[bounds[r]:bounds[r + 1]])
        if r == 0 and dense is not None:
            wire.add_rows(dense.tensor.view(-1), [decoded[s][-1] for s in range(world)])
        results.append((wire.read_status(gathered), sig))
    return results, msg


REDUCE_SCATTER_ALGORITHMS = ("auto", "two_phase", "reduce_scatter")


@owns_transaction
def reduce_scatter(tensor: torch.Tensor, compressor: Any, *, group=None, key: Any = 0, step: int = 0,
                   stats: CommStats | None = None, generator: torch.Generator | None = None,
                   validate: bool = True, transaction: ResidualTransaction | None = None,
                   algorithm: str = "auto", scratch: bool = False) -> torch.Tensor:
    """Compressed reduce-scatter: rank ``r`` gets the sum over ranks of shard ``r`` of ``tensor``.

    ``tensor`` (numel divisible by P) is P equal shards.  Wire, ``algorithm="two_phase"``:
    shard ``r`` is compressed with ``key=(key, r)`` (fixed-size payload) and sent to rank ``r``
    behind the status word (one ``all_to_all_single``); rank ``r`` decodes the P pieces and sums
    them in fp32 in rank order.  Works for ``"gather"``, ``"sum"`` and ``"sparse"`` compressors
    (everything whose payload decodes on its own).  ``algorithm="reduce_scatter"`` (``"sum"``
    compressors only, whose payloads add elementwise: fp16, bf16, shared-seed random-k): ONE
    ``reduce_scatter`` (sum) of the P shards' payloads, each followed by the status slots of
    :mod:`.wire`, summed on the wire in the payload's dtype, then decoded.  With error feedback
    a NaN/inf on any rank makes every shard all-NaN and keeps the residuals of ``transaction``
    (committed here when not given); without, it travels in the payload.  With one rank:
    compress + decompress of the whole tensor.  FSDP2's compressed reduce-scatter is this call.

    Args:
        tensor: the floating tensor of P equal shards (numel divisible by P).
        compressor: a ``"gather"``, ``"sum"`` or ``"sparse"`` compressor, or a
            :class:`~commpress.ErrorFeedback` around one.
        group: the process group (``None``: the default group).
        key: names the tensor for per-tensor state (each shard's under ``(key, r)``).
        step: the training step.
        stats: a :class:`~commpress.collectives.CommStats` that counts this rank's bytes.
        generator: the random generator of a stochastic compressor.
        validate: agree on the static facts with one header exchange the first time a key is
            seen (``False``: the caller guarantees them).
        transaction: collects the residual updates for the caller's commit (committed here when
            not given).
        algorithm: ``"two_phase"``, ``"reduce_scatter"`` or ``"auto"`` (``"reduce_scatter"`` for
            a ``"sum"`` compressor without error feedback, else ``"two_phase"``).
        scratch: the caller does not read ``tensor`` after the call (FSDP2's reduce-scatter
            input): error feedback with a lean residual storage compensates in it, keeping no
            fp32 buffer of a shard's size.

    Returns:
        This rank's shard of the sum: 1-D, ``numel / P`` elements of ``tensor``'s dtype.

    Raises:
        TypeError: a compressor of another kind (``"lowrank"``).
        CollectiveInputError: (a ``ValueError``) bad input on any rank, raised on every rank
            together: a numel not divisible by P, an algorithm the compressor cannot run, an
            unsupported dtype, a compress that fails.

    Example::

        >>> shard = commpress.collectives.reduce_scatter(flat_grads, commpress.get("bf16"))
    """
    world = _comm.world(group)
    inner = unwrap(compressor)
    kind = getattr(inner, "aggregation", None)
    if kind not in ("gather", "sum", "sparse"):
        raise TypeError(f"reduce_scatter: compressor aggregation must be 'gather', 'sum' or 'sparse', "
                        f"got {kind!r}")
    wire.flush_deferred()
    flat = tensor.reshape(-1)
    n = flat.numel()
    err = (0, "")
    if algorithm == "auto":
        algorithm = "reduce_scatter" if kind == "sum" and not has_feedback(compressor) else "two_phase"
    if algorithm not in REDUCE_SCATTER_ALGORITHMS[1:] or (algorithm == "reduce_scatter" and kind != "sum"):
        err = (wire.E_MISUSE, f"algorithm must be one of {REDUCE_SCATTER_ALGORITHMS} ('reduce_scatter' "
                              f"for a 'sum' compressor only), got {algorithm!r}")
        algorithm = "two_phase"
    elif n % world:
        err = (wire.E_SHAPE, f"tensor.numel()={n} must be divisible by the group size {world}")
    elif tensor.dtype not in inner.supported_dtypes:
        err = (wire.E_DTYPE, f"dtype {tensor.dtype} not supported by {inner.name}")
    tx = transaction
    if validate:
        check_once(group, key, ("reduce_scatter", n, str(tensor.dtype), fingerprint(compressor), algorithm),
                   device=flat.device, error=err[0], numel=n, dtype=tensor.dtype, algorithm=algorithm,
                   kind="reduce_scatter", config=fingerprint(compressor), stats=stats, local_message=err[1],
                   what="reduce_scatter")
    if world == 1:
        out = _local("reduce_scatter", err, compressor, flat, key, step, stats, generator, tx).to(tensor.dtype)
        return out
    if err[0]:
        flat = torch.zeros(world * max(1, -(-n // world)), dtype=torch.float32, device=flat.device)
    per = flat.numel() // world
    bounds = [r * per for r in range(world + 1)]
    if algorithm == "reduce_scatter":
        out = _sum_reduce_scatter(flat, compressor, inner, bounds, err, group, key, step, stats, generator, tx)
        if stats is not None:
            stats.add(calls=1, algorithm="reduce_scatter")
        return out.to(tensor.dtype)
    decoder = inner
    if kind == "sparse" and has_feedback(compressor) and sparse.whole_per_chunk(inner, per, step, flat.dtype):
        decoder = sparse.WHOLE_CODEC  # each chunk whole, block-quantized: its selection would be no smaller
        payloads, code, msg, bad = _whole_chunks(flat, compressor, bounds, key, step, tx, err, stats)
    else:
        payloads, code, msg, bad = _compress_chunks(flat, compressor, bounds, key, step, generator, tx, err, stats,
                                                    scratch=scratch and not err[0])
    sig = wire.signature("reduce_scatter", flat.numel(), str(flat.dtype), [p.nbytes for p in payloads],
                         decoder is not inner)
    received, layout = _phase1(flat, payloads, code, sig, bad, group, stats)
    with codec_timer(stats, "decompress"):
        out = _owner_sum(decoder, received, layout, payloads[_comm.rank(group)])
    _verdict([(wire.read_status(received), sig)], "reduce_scatter", msg, out, compressor, tx)
    out = out.to(tensor.dtype)
    if stats is not None:
        stats.add(calls=1, algorithm="reduce_scatter")
    return out


def _whole_chunks(flat, ef: ErrorFeedback, bounds, key, step, tx, error, stats=None):
    """As :func:`_compress_chunks`, every chunk sent whole: ``ef``'s compensation of chunk ``r``
    (``key=(key, r)``) in :data:`.sparse.WHOLE_CODEC`, the residual keeping its rounding
    (:meth:`~commpress.ErrorFeedback.compress_whole`); zeros payloads after a local error."""
    codec = sparse.WHOLE_CODEC
    code, msg = error
    payloads, bad = [], None
    for r in range(len(bounds) - 1):
        if code:
            break
        try:
            with codec_timer(stats, "compress"):
                p = ef.compress_whole(flat[bounds[r]:bounds[r + 1]], codec, step=step, key=(key, r), transaction=tx)
        except Exception as exc:  # noqa: BLE001 - reported through the status word on every rank
            code, msg = wire.E_MISUSE, f"compress failed: {type(exc).__name__}: {exc}"
            break
        payloads.append(p)
        bad = p.nonfinite if bad is None else bad | p.nonfinite
    if code:  # equal chunks: one zeros payload of their size for every owner
        zeros = codec.compress_fixed(torch.zeros(bounds[1] - bounds[0], dtype=torch.float32, device=flat.device))
        return [zeros] * (len(bounds) - 1), code, msg, None
    return payloads, code, msg, bad


def _sum_reduce_scatter(flat, compressor, inner, bounds, err, group, key, step, stats, generator, tx):
    """``algorithm="reduce_scatter"``: piece ``r`` of the message is shard ``r``'s payload and the
    status slots (:mod:`.wire`); one sum ``reduce_scatter``; this rank's summed piece decoded.
    A cast (fp16 / bf16 / identity without error feedback) is written straight into the message
    (:func:`~.wire.cast_message`, the one cast path)."""
    world, me = len(bounds) - 1, _comm.rank(group)
    per = bounds[1]
    if inner.casts and not has_feedback(compressor):
        code, msg, bad, template = err[0], err[1], None, None
        width = per + wire.SUM_SLOTS
        dtype = inner.cast_to or flat.dtype
        if code:
            send = torch.zeros(world, width, dtype=dtype, device=flat.device)
        else:
            send = wire.cast_message(flat, dtype, slots=wire.SUM_SLOTS, pieces=world).view(world, width)
    else:
        payloads, code, msg, bad = _compress_chunks(flat, compressor, bounds, key, step, generator, tx, err, stats)
        template = payloads[me]
        sizes = [t.numel() for t in template.tensors]
        width = sum(sizes) + wire.SUM_SLOTS
        send = torch.empty(world, width, dtype=template.tensors[0].dtype, device=flat.device)
        for r, p in enumerate(payloads):
            pos = 0
            for t, k in zip(p.tensors, sizes):
                send[r, pos:pos + k].copy_(t.reshape(-1))
                pos += k
    wire.sum_slots(send[0], error=code, nonfinite=bad, rank=me, world=world)
    send[1:, width - wire.SUM_SLOTS:].copy_(send[:1, width - wire.SUM_SLOTS:].expand(world - 1, -1))
    recv = torch.empty(width, dtype=send.dtype, device=flat.device)
    _comm.reduce_scatter_(recv, send.view(-1), group=group, stats=stats)
    wire.check_sum_slots(recv, "reduce_scatter", msg, world)
    if template is None:
        out = recv[:per]
    else:
        pos, wires = 0, []
        for t in template.tensors:
            wires.append(recv[pos:pos + t.numel()].view(t.shape))
            pos += t.numel()
        with codec_timer(stats, "decompress"):
            out = inner.decompress(_piece(wires, template)).reshape(-1)
    if has_feedback(compressor):
        bad_any = recv[-1] != 0
        tx.mark_bad(bad_any)
        out = wire.poison_(out.float(), bad_any)
    return out
