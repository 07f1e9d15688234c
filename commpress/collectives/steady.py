"""The steady-state lane of the quantized ``"gather_all"``: blockquant with error feedback, fp32 on the CPU.

The general path (:func:`.quantized.quantized_allreduce`) serves every ``"gather"`` compressor, every
error and every device.  Each call re-derives the chunks, the payload sizes, the message layouts and
signatures, and each chunk goes through the layers of the compressor chain (error feedback, the
compressor, the ops dispatch, the numba backend's checks), then is copied into its message.  A
training step calls it with the same static facts every time.  On a CPU rank of one core that
Python costs a third of the commpress worker's CPU (``perf`` on the digits step: the interpreter
3.2 ms against the numba kernels' 3.4 ms per step).

This lane is what the call reduces to in the DDP hook's hottest CPU case, blockquant (round to
nearest) under :class:`~commpress.ErrorFeedback` (with or without momentum correction, without
``clip``), on the numba backend:

* a :class:`Plan` holds the call's static facts, made once per (group, size, compressor, cost model,
  riding dense part): the chunks, the algorithm and whether it pipelines, each message's byte
  layout and signature;
* each chunk is quantized by the fused kernel straight into its message
  (:func:`commpress.ops.numba_backend.quantize_feedback_into`), its new residual (and, with momentum
  correction, its new velocity) into the error feedback's pending buffers, staged in the call's
  transaction;
* each chunk's P pieces are decoded from the gathered messages straight into the output
  (:func:`commpress.ops.numba_backend.dequantize_sum_into`).

Messages, signatures, residuals and results are bitwise the general path's (``tests/collectives/
test_collectives_steady_lane.py`` runs both).  Anything else (another compressor, a local error,
``COMMPRESS_BACKEND=torch``, an output that is not the input's fp32 buffer, a CUDA tensor) takes the
general path.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import ops
from ..compressors.blockquant import BlockQuant
from ..feedback import ErrorFeedback
from . import _comm, costmodel, wire
from .accounting import CommStats, codec_timer


@dataclass(frozen=True)
class Piece:
    """Where chunk ``chunk``'s payload sits in a message: its packed codes and its fp32 scales
    (byte offsets and sizes, after the status word, as :class:`~.wire.Layout` places them)."""

    chunk: int
    codes_at: int
    codes_bytes: int
    scales_at: int
    scales_bytes: int


@dataclass(frozen=True)
class Message:
    """One message of a call: its width, its signature, its pieces and where a riding dense part sits."""

    width: int
    sig: int
    pieces: tuple[Piece, ...]
    dense_at: int = -1


@dataclass(frozen=True)
class Plan:
    """The static facts of one call site: chunk ``r`` is ``bounds[r]:bounds[r + 1]``; one message per
    chunk when ``pipelined`` (each started as soon as its chunk is encoded), else one for all.
    ``whole``: a sparsifier's whole-tensor send (:func:`whole_plan_for`): one chunk, the error
    feedback's residual under the call's own key (not per chunk), every coordinate sent."""

    world: int
    bounds: tuple[int, ...]
    bits: int
    block: int
    algorithm: str
    pipelined: bool
    messages: tuple[Message, ...]
    whole: bool = False


_PLANS: "weakref.WeakKeyDictionary[Any, dict[tuple, Plan]]" = weakref.WeakKeyDictionary()
_PLANS_LOCK = threading.Lock()
_UNSEEN = object()
#: the ops the lane's kernels stand for (checked on the numba backend; reported as used)
_OPS = ("block_quantize_feedback", "block_dequantize_sum")


def _runs(compressor: Any, flat: torch.Tensor, out: torch.Tensor | None, error: tuple[int, str]) -> bool:
    """Whether this call can take the lane (the cheap checks; the plan checks the algorithm)."""
    inner = getattr(compressor, "compressor", None)
    return (type(inner) is BlockQuant and not inner.stochastic
            and cpu_feedback_call(compressor, flat, out, error, _OPS))


def cpu_feedback_call(compressor: Any, flat: torch.Tensor, out: torch.Tensor | None, error: tuple[int, str],
                      ops_used: tuple[str, ...]) -> bool:
    """The checks every CPU lane makes: plain :class:`~commpress.ErrorFeedback` (no ``clip``), no
    local error, ``flat`` a contiguous fp32 CPU tensor outside autograd, ``out`` its own buffer,
    ``ops_used`` on the numba backend, and momentum correction only where the kernels know how torch
    rounds the velocity."""
    if type(compressor) is not ErrorFeedback or error != (0, "") or compressor.clip is not None:
        return False
    if flat.device.type != "cpu" or flat.dtype != torch.float32 or not flat.is_contiguous() or flat.requires_grad:
        return False
    if (out is None or out.data_ptr() != flat.data_ptr() or not out.is_contiguous() or out.dtype != torch.float32
            or out.numel() != flat.numel()):
        return False
    if any(ops._resolve(op, flat.device)[0] != "numba" for op in ops_used):
        return False
    return not compressor.momentum or _nb().velocity_mode() is not None


def plan_for(flat: torch.Tensor, compressor: Any, *, group, algorithm: str, error: tuple[int, str],
             model: costmodel.CostModel | None, out: torch.Tensor | None, dense: wire.Rider | None,
             world: int, bounds: list[int], min_wire_s: float = math.inf) -> Plan | None:
    """The call's :class:`Plan` when it can take the lane, else ``None`` (the general path runs).
    ``bounds``: the chunks :func:`.quantized.chunk_bounds` made; ``out``: the call's output, which
    must be ``flat``'s own buffer (the hooks' ``out=t``); ``min_wire_s``: the general path's
    pipelining threshold (:data:`.quantized.PIPELINE_MIN_WIRE_S`)."""
    if world < 2 or algorithm not in ("auto", "gather_all") or not _runs(compressor, flat, out, error):
        return None
    if algorithm == "auto":   # as the general path: it reads the group's model for "auto" only
        model = model if model is not None else costmodel.get_cost_model(group)
        facts = (model.alpha, model.beta, model.gamma, model.delta)
    else:
        model, facts = None, None
    rider = None if dense is None else (dense.tensor.numel(), dense.tensor.dtype)
    key = (_comm.group_key(group), flat.numel(), tuple(bounds), algorithm, rider, facts, min_wire_s)
    return cached_plan(compressor, key, lambda: _make_plan(flat, compressor.compressor, world, bounds, algorithm,
                                                           model, rider, min_wire_s))


def cached_plan(owner: Any, key: tuple, make) -> Any:
    """``make()`` (a plan, or ``None``: no lane) made once per ``(owner, key)``: kept while ``owner``
    (the error feedback) lives, its last 64 keys (a density warm-up's stages, a rebuilt layout)."""
    with _PLANS_LOCK:
        found = _PLANS.get(owner, {}).get(key, _UNSEEN)
    if found is not _UNSEEN:
        return found
    plan = make()
    with _PLANS_LOCK:
        plans = _PLANS.setdefault(owner, {})
        if len(plans) >= 64:
            plans.pop(next(iter(plans)))
        plans[key] = plan
    return plan


def _make_plan(flat, inner: BlockQuant, world: int, bounds: list[int], algorithm: str,
               model: costmodel.CostModel | None, rider, min_wire_s: float) -> Plan | None:
    """The general path's choices and wire format for these facts (``None``: it would not run
    ``"gather_all"`` here, or the riding part would not ride)."""
    n, bits, block = flat.numel(), inner.bits, inner.block
    sizes = [_payload(bounds[r + 1] - bounds[r], bits, block) for r in range(world)]
    nbytes = [c + s for c, s in sizes]
    pipelined = False
    if algorithm == "auto":
        algorithm = costmodel.choose_gather(sum(nbytes), n, world, model)
        pipelined = algorithm == "gather_all" and costmodel.pipelines_at(model, nbytes, min_wire_s)
    if algorithm != "gather_all" or (rider is not None and not wire.Rider.free(world)):
        return None
    dtype = str(flat.dtype)
    if pipelined:
        base = wire.signature("gather", n, dtype, algorithm)
        messages = []
        for r in range(world):
            sig = wire.signature(base, r, nbytes[r])
            if r == 0 and rider is not None:
                sig = wire.signature(sig, rider[0], str(rider[1]))
            messages.append(_message(sig, [(r, sizes[r])], rider if r == 0 else None))
    else:
        sig = wire.signature("gather", n, dtype, nbytes, algorithm)
        if rider is not None:
            sig = wire.signature(sig, rider[0], str(rider[1]))
        messages = [_message(sig, list(enumerate(sizes)), rider)]
    return Plan(world, tuple(bounds), bits, block, algorithm, pipelined, tuple(messages))


def whole_plan_for(flat: torch.Tensor, compressor: Any, *, codec: BlockQuant, group, error: tuple[int, str],
                   out: torch.Tensor | None, dense: wire.Rider | None, world: int) -> Plan | None:
    """The :class:`Plan` of a sparsifier's whole-tensor send (:func:`.sparse._whole_quantized`: the
    compensated tensor in ``codec``, :data:`.sparse.WHOLE_CODEC`, one ``all_gather``, the dense part
    riding at P <= 2) when it can take the lane (the checks of :func:`cpu_feedback_call`), else
    ``None``.  The same message, signature, sums and residual as the general path (a density
    warm-up's early stages: topk 1%'s first ~80 steps of its 200)."""
    if world < 2 or not cpu_feedback_call(compressor, flat, out, error, _OPS):
        return None
    rider = None if dense is None or not wire.Rider.free(world) else (dense.tensor.numel(), dense.tensor.dtype)
    key = ("whole", _comm.group_key(group), flat.numel(), rider, codec.bits, codec.block)
    return cached_plan(compressor, key, lambda: _whole_plan(flat.numel(), codec, world, rider))


def _whole_plan(n: int, codec: BlockQuant, world: int, rider) -> Plan:
    facts = ("whole", n, codec.name, codec.bits, codec.block)
    if rider is not None:
        facts += (rider[0], str(rider[1]))
    message = _message(wire.signature(*facts), [(0, _payload(n, codec.bits, codec.block))], rider)
    return Plan(world, (0, n), codec.bits, codec.block, "whole_blockquant", False, (message,), whole=True)


def _payload(m: int, bits: int, block: int) -> tuple[int, int]:
    """Bytes of a chunk of ``m`` elements: its packed codes and its fp32 scales (blockquant's wire)."""
    return (m * bits + 7) // 8, 4 * ((m + block - 1) // block)


def _message(sig: int, chunks: list[tuple[int, tuple[int, int]]], rider) -> Message:
    """A message of these chunks' payloads (and the riding part), laid out as :class:`~.wire.Layout`."""
    pieces, off = [], wire.STATUS_BYTES
    for r, (codes, scales) in chunks:
        codes_at = off
        off = wire.align8(off + codes)
        pieces.append(Piece(r, codes_at, codes, off, scales))
        off = wire.align8(off + scales)
    dense_at = -1
    if rider is not None:
        dense_at = off
        off = wire.align8(off + rider[0] * torch.empty((), dtype=rider[1]).element_size())
    return Message(wire.align8(off), sig, tuple(pieces), dense_at)


def run(plan: Plan, flat: torch.Tensor, compressor: ErrorFeedback, *, group, key: Any, step: int,
        stats: CommStats | None, transaction, dense: wire.Rider | None,
        passengers: wire.Passengers | None = None, scale: float = 1.0) -> None:
    """The call on the lane: every chunk encoded into its message, the messages gathered, every
    chunk's pieces decoded into ``flat`` (the output) in rank order, then judged and counted
    (:func:`finish`).  A chunk whose kernel raises sends a zeros payload with
    :data:`~.wire.E_MISUSE` (every rank raises at the verdict, as on the general path).
    ``passengers``: held messages that ride after the first message (:class:`~.wire.Passengers`;
    landed as soon as they arrive)."""
    code, msg, flights = 0, "", []
    for j, message in enumerate(plan.messages):
        extra = passengers.width if j == 0 and passengers is not None else 0
        buf, code, msg = encode(plan, message, flat, compressor, key=key, step=step, stats=stats,
                                transaction=transaction, dense=dense, error=(code, msg), extra=extra, scale=scale)
        if extra:
            passengers.board(buf, message.width)
        if plan.pipelined:
            flights.append(_comm.all_gather_start(buf, group=group, stats=stats))
        else:
            flights.append(_Done(_comm.all_gather(buf, group=group, stats=stats)))
    results = []
    for j, (message, flight) in enumerate(zip(plan.messages, flights)):
        gathered = flight.wait()
        if j == 0 and passengers is not None:
            passengers.alight(gathered, message.width)
        results.append(land(plan, message, gathered, flat, dense=dense, stats=stats))
    finish(plan, results, msg, flat, compressor, transaction, stats)


def finish(plan: Plan, results: list[tuple[torch.Tensor, int]], msg: str, flat: torch.Tensor, compressor: Any,
           transaction, stats: CommStats | None) -> None:
    """A call's landed messages (``[(statuses, signature)]``, :func:`land`'s) judged (:func:`judge`:
    an error anywhere raises on every rank; a NaN/inf poisons ``flat``) and the call counted."""
    judge(results, "allreduce", msg, flat, compressor, transaction)
    if stats is not None:
        stats.add(calls=1, algorithm=plan.algorithm)


def encode(plan: Plan, message: Message, flat: torch.Tensor, compressor: ErrorFeedback, *, key: Any, step: int,
           stats: CommStats | None, transaction, dense: wire.Rider | None, error: tuple[int, str] = (0, ""),
           extra: int = 0, scale: float = 1.0) -> tuple[torch.Tensor, int, str]:
    """``message``'s bytes (``extra`` more bytes after them, left for passengers), its chunks encoded
    under error feedback, the riding dense part and the status word in; returns ``(buffer, code,
    local message)``: ``error`` or, when a chunk's kernel raised, :data:`~.wire.E_MISUSE` (its payload
    zeros)."""
    for op in _OPS:   # what ops.backends_used() reports, as on the general path
        ops._usage.note(op, "numba")
    code, msg = error
    buf = torch.empty(message.width + extra, dtype=torch.uint8)
    raw = buf.numpy()
    bad = False   # this message's NaN/inf verdict: host memory on this CPU-only lane
    for piece in message.pieces:
        try:
            bad = _encode(plan, flat, compressor, piece, raw, key, step, transaction, stats, scale) or bad
        except Exception as exc:  # noqa: BLE001 - raised on every rank through the status
            raw[piece.codes_at:piece.scales_at + piece.scales_bytes] = 0
            if not code:
                code, msg = wire.E_MISUSE, f"compress failed: {type(exc).__name__}: {exc}"
    if message.dense_at >= 0:
        dense.carried = True
        bad = _put_dense(dense.tensor.reshape(-1), buf, raw, message.dense_at) or bad
    _put_status(raw, flat.device, code, message.sig, bad)
    return buf, code, msg


def land(plan: Plan, message: Message, gathered: torch.Tensor, flat: torch.Tensor, *, dense: wire.Rider | None,
         stats: CommStats | None) -> tuple[torch.Tensor, int]:
    """``message``'s P gathered copies (``[P, >= width]`` bytes) decoded into ``flat``, the riding dense
    part summed; returns ``(statuses, signature)`` for the verdict."""
    got = gathered.numpy()
    with codec_timer(stats, "decompress"):
        for piece in message.pieces:
            a, b = plan.bounds[piece.chunk], plan.bounds[piece.chunk + 1]
            arrays = [(got[s, piece.codes_at:piece.codes_at + piece.codes_bytes],
                       got[s, piece.scales_at:piece.scales_at + piece.scales_bytes].view(np.float32))
                      for s in range(plan.world)]
            with _nb().threads_context(b - a):
                _nb().dequantize_sum_into(arrays, plan.bits, plan.block, b - a, flat[a:b].numpy())
    if message.dense_at >= 0:
        _sum_dense(dense.tensor.view(-1), gathered, got, message.dense_at, plan.world)
    return wire.read_status(gathered), message.sig


def judge(messages, what: str, msg: str, out: torch.Tensor, compressor: Any, transaction) -> None:
    """Judge a call's messages whose statuses are in host memory (``[(statuses, signature)]``, each
    its own signature), in numpy: raise on every rank on an error anywhere; with error feedback, a
    NaN/inf anywhere poisons ``out`` and keeps the residuals (:func:`.quantized._verdict`'s CPU case)."""
    bad = False
    for statuses, sig in messages:
        st = statuses.numpy()
        wire.judge_bytes(st, sig, what, msg)
        bad = bad or bool((st[:, 0] & wire.NONFINITE).any())
    if bad and wire.has_feedback(compressor):
        flag = torch.ones((), dtype=torch.bool)
        transaction.mark_bad(flag)
        wire.poison_(out, flag)


def _put_dense(d: torch.Tensor, buf: torch.Tensor, raw: np.ndarray, at: int) -> bool:
    """The riding dense part ``d`` into the message at byte ``at``; returns its NaN/inf verdict,
    :func:`~commpress.feedback.nonfinite_flag`'s (one fp32 sum, read on the host)."""
    if d.dtype == torch.float32:
        raw[at:at + 4 * d.numel()].view(np.float32)[:] = d.numpy()
    else:
        buf[at:at + d.numel() * d.element_size()].view(d.dtype).copy_(d)
    return host_nonfinite(d)


def host_nonfinite(t: torch.Tensor) -> bool:
    """A CPU tensor's NaN/inf verdict as a Python bool: :func:`~commpress.feedback.nonfinite_flag`'s
    test (its fp32 sum is not finite), read through numpy (host memory: no device sync)."""
    return t.numel() > 0 and not math.isfinite(t.sum(dtype=torch.float32).numpy())


def _put_status(raw: np.ndarray, device: torch.device, code: int, sig: int, bad: bool) -> None:
    """The message's status word (:func:`~.wire.status_word`'s bytes), built on the host."""
    word = wire.host_status(code, sig, bad)
    if word is None:   # a device error flag is pending: the device builds the word
        word = wire.status_word(device, error=code, sig=sig, nonfinite=torch.tensor(bad)).numpy()
    raw[:wire.STATUS_BYTES].view(np.int32)[:] = word


def _sum_dense(d: torch.Tensor, gathered: torch.Tensor, got: np.ndarray, at: int, world: int) -> None:
    """``d`` := the P riding dense parts added in rank order (:func:`~.wire.add_rows`; in numpy for
    fp32, the same IEEE additions)."""
    width = d.numel() * d.element_size()
    if d.dtype != torch.float32:
        wire.add_rows(d, [gathered[s, at:at + width].view(d.dtype) for s in range(world)])
        return
    out = d.numpy()
    out[:] = got[0, at:at + width].view(np.float32)
    for s in range(1, world):
        np.add(out, got[s, at:at + width].view(np.float32), out=out)


def _encode(plan: Plan, flat: torch.Tensor, ef: ErrorFeedback, piece: Piece, raw: np.ndarray, key: Any, step: int,
            transaction, stats: CommStats | None, scale: float = 1.0) -> bool:
    """Chunk ``piece.chunk`` under error feedback into ``raw`` (the message's bytes), its new residual
    staged in ``transaction`` as :meth:`ErrorFeedback.compress_fixed` stages it (committed with the
    step, or at once without one); returns its NaN/inf verdict."""
    r = piece.chunk
    chunk = flat[plan.bounds[r]:plan.bounds[r + 1]]
    k = key if plan.whole else (key, r)
    # momentum correction's velocity too, in the same pass; the input is the call's output (scratch):
    # with a lean residual storage the next residual is written over it (no buffer of its size)
    slots = ef.open_fused(chunk, k, scratch=True, scale=scale, transaction=transaction)
    x, live = slots.x, slots.live
    codes = raw[piece.codes_at:piece.codes_at + piece.codes_bytes]
    scales = raw[piece.scales_at:piece.scales_at + piece.scales_bytes].view(np.float32)
    nb = _nb()
    with codec_timer(stats, "compress"), nb.threads_context(chunk.numel()):
        bad = nb.quantize_feedback_into(x.numpy(), None if live is None else live.view(-1).numpy(), ef.beta,
                                        slots.scale, plan.bits, plan.block, slots.pending.view(-1).numpy(), codes,
                                        scales, slots.velocity) > 0
    # momentum factor masking: a whole tensor sent had every coordinate sent
    ef.close_fused(k, torch.tensor(bad), transaction, sent_all=plan.whole)
    return bool(bad)


def _nb():
    from ..ops import numba_backend   # loaded: the plan was made only where it is the ops' backend

    return numba_backend


class _Done:
    """A finished all-gather, read like a :class:`~._comm.Gathering`."""

    def __init__(self, gathered: torch.Tensor) -> None:
        self._gathered = gathered

    def wait(self) -> torch.Tensor:
        return self._gathered
