"""Two-phase quantized allreduce and reduce-scatter for ``"gather"`` compressors.

Codes that must be decoded before they can be added (qsgd, terngrad, signsgd,
blockquant) are aggregated like 1-bit Adam / ZeRO++:

1. the flat tensor is cut into P chunks (boundaries rounded up to the
   compressor's block / chunk size when it has one, see :func:`chunk_bounds`);
   every rank compresses chunk ``r`` with ``key=(key, r)``;
2. ``all_to_all_single`` of the packed payload bytes: chunk ``r`` of every
   rank goes to rank ``r`` (its *owner*);
3. the owner decodes the P pieces and sums them in fp32 **in rank order**;
4. the owner re-compresses its sum (``key=("owner", key, r)``) — through an
   owner-side error feedback keyed ``(key, r)`` when the compressor is biased
   (``not compressor.unbiased``; see :func:`owner_feedback`);
5. ``all_gather`` of the owners' payloads; every rank decodes every chunk, so
   all ranks hold bitwise the same result.

``"gather_all"`` (cheaper for P <= 2, chosen by the cost model): one
``all_gather`` of every rank's compressed chunks, every rank decodes all P x P
pieces and sums them in rank order (no re-compression).

Wire format: a payload is sent as the concatenated raw bytes of its tensors.
The byte size of every tensor of every chunk is exchanged in the validation
header (one small all-gather), so receivers can cut the buffers; the dtypes,
shapes and ``meta`` of a piece are taken from the receiver's own payload of
the same chunk (same numel and dtype, so the same structure by the contract).
In phase 2 the owner's re-compressed chunk must have the size its phase-1
chunk had; each phase-2 piece carries its byte size in 8 leading bytes and a
mismatch raises on every rank.

:func:`reduce_scatter` is phases 1-3 alone on an input made of P equal
shards (FSDP2's layout): rank ``r`` gets the sum of shard ``r``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..compressors.base import Payload
from ..feedback import ErrorFeedback
from . import _comm, costmodel
from .accounting import CommStats
from .core import ALLREDUCE_ALGORITHMS, fingerprint, unwrap
from .validate import HEADER_FIXED, CollectiveInputError, exchange_header, make_header

MAX_WIRE_TENSORS = 4
_ALIGN_ATTRS = ("alignment", "block", "block_size", "chunk", "chunk_size", "bucket_size")


def alignment(compressor: Any) -> int:
    """The compressor's block size (first positive int among ``alignment``, ``block``, ...), else 1."""
    inner = unwrap(compressor)
    for attr in _ALIGN_ATTRS:
        v = getattr(inner, attr, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 1


def chunk_bounds(numel: int, world: int, align: int = 1) -> list[int]:
    """Chunk ``r`` is ``[b[r], b[r+1])``: ``ceil(numel/P)`` rounded up to ``align``, the last ones shorter."""
    per = -(-numel // world) if world else numel
    per = -(-per // align) * align
    return [min(numel, r * per) for r in range(world + 1)]


# ---------------------------------------------------------------- owner-side error feedback
_OWNER_FB: "weakref.WeakKeyDictionary[Any, ErrorFeedback]" = weakref.WeakKeyDictionary()


def owner_feedback(compressor: Any) -> ErrorFeedback:
    """The owner-side :class:`commpress.ErrorFeedback` of ``compressor`` (created on first use).

    It holds one residual per ``(key, chunk)`` this rank owns: the part of the
    summed chunk its re-compression did not send.  Save and restore it with its
    ``state_dict()`` / ``load_state_dict()`` next to the worker-side feedback.
    """
    inner = unwrap(compressor)
    if inner not in _OWNER_FB:
        _OWNER_FB[inner] = ErrorFeedback(inner)
    return _OWNER_FB[inner]


# ---------------------------------------------------------------- helpers
def _sizes(payload: Payload) -> list[int]:
    return [t.numel() * t.element_size() for t in payload.tensors]


def _parse(buf: torch.Tensor, sizes: list[int], template: Payload) -> Payload:
    """Rebuild a payload from its bytes, with the template's dtypes / shapes / meta."""
    tensors, off = [], 0
    for t, nb in zip(template.tensors, sizes):
        x = buf[off:off + nb].clone().view(t.dtype)
        tensors.append(x.reshape(t.shape) if x.numel() == t.numel() else x)
        off += nb
    return Payload(tuple(tensors), template.shape, template.dtype, template.numel, template.meta)


def _phase1(flat, compressor, bounds, group, key, step, stats, generator, validate, algorithm, kind,
            extra_error=(0, "")):
    """Compress every chunk, exchange the header (sizes + validation).

    Returns (payloads, sizes[src][chunk][tensor], every rank's cost-model state)."""
    world = _comm.world(group)
    code, msg = extra_error
    payloads: list[Payload] = []
    if not code:
        try:
            payloads = [compressor.compress(flat[bounds[r]:bounds[r + 1]], step=step, key=(key, r),
                                            generator=generator) for r in range(world)]
        except Exception as exc:  # reported to every rank through the header instead of hanging them
            code, msg = 6, f"compress failed: {type(exc).__name__}: {exc}"
    T = len(payloads[0].tensors) if payloads else 0
    if not code and T > MAX_WIRE_TENSORS:
        code, msg = 6, f"payloads with more than {MAX_WIRE_TENSORS} tensors are not supported"
    h = make_header(world, _comm.comm_device(group, flat), error=code, numel=flat.numel(), dtype=flat.dtype,
                    algorithm=algorithm, kind=kind, config=fingerprint(compressor), count=T,
                    group=group)
    if not code:
        sz = torch.tensor([s for p in payloads for s in _sizes(p)], dtype=torch.int64)
        grid = torch.zeros(world, MAX_WIRE_TENSORS, dtype=torch.int64)
        grid[:, :T] = sz.reshape(world, T)
        h[HEADER_FIXED:HEADER_FIXED + MAX_WIRE_TENSORS * world] = grid.reshape(-1).to(h.device)
    table = exchange_header(h, group=group, stats=stats, local_message=msg, what=kind)
    sizes = table[:, HEADER_FIXED:HEADER_FIXED + MAX_WIRE_TENSORS * world].reshape(world, world, MAX_WIRE_TENSORS)
    sizes = sizes[:, :, :T].tolist()  # sizes[src][chunk][j]
    return payloads, sizes, table[:, 7].tolist()


def _reduce_own_chunk(flat, compressor, payloads, sizes, group, stats):
    """Phases 2-3: all-to-all to the owners, owner decodes and sums in rank order (fp32)."""
    world = _comm.world(group)
    me = _comm.rank(group)
    inner = unwrap(compressor)
    send = _comm.to_bytes(*[t for p in payloads for t in p.tensors])
    if send.numel() == 0:
        send = torch.empty(0, dtype=torch.uint8, device=flat.device)
    recv = _comm.all_to_all_bytes(send, [sum(sizes[me][r]) for r in range(world)],
                                  [sum(sizes[s][me]) for s in range(world)], group=group, stats=stats)
    template = payloads[me]
    acc = torch.zeros(template.numel, dtype=torch.float32, device=flat.device)
    off = 0
    for s in range(world):
        nb = sum(sizes[s][me])
        acc += inner.decompress(_parse(recv[off:off + nb], sizes[s][me], template)).float().reshape(-1)
        off += nb
    return acc


# ---------------------------------------------------------------- public API
def quantized_allreduce(tensor: torch.Tensor, compressor: Any, *, group=None, key: Any = 0, step: int = 0,
                        algorithm: str = "auto", stats: CommStats | None = None,
                        generator: torch.Generator | None = None, validate: bool = True) -> torch.Tensor:
    """Sum of ``tensor`` over ranks through a ``"gather"`` compressor; identical on every rank.

    ``algorithm``: ``"two_phase"`` (all-to-all, owner decode+sum+re-encode,
    all-gather), ``"gather_all"`` (all-gather of every rank's payload, decode and
    sum everything locally) or ``"auto"`` (the cost model).  Returns ``tensor``'s
    shape and dtype.
    """
    world = _comm.world(group)
    inner = unwrap(compressor)
    flat = tensor.reshape(-1)
    n = flat.numel()
    allowed = ALLREDUCE_ALGORITHMS["gather"]
    err = (0, "")
    if algorithm not in allowed:
        err = (6, f"algorithm must be one of {allowed}, got {algorithm!r}")
    elif tensor.dtype not in inner.supported_dtypes:
        err = (4, f"dtype {tensor.dtype} not supported by {inner.name}")
    if world == 1:
        return _local("quantized_allreduce", err, compressor, flat, key, step, stats,
                      generator).to(tensor.dtype).reshape(tensor.shape)
    bounds = chunk_bounds(n, world, alignment(compressor))
    payloads, sizes, states = _phase1(flat, compressor, bounds, group, key, step, stats, generator, validate,
                                      algorithm, "gather", err)
    if algorithm == "auto":
        total = max(sum(sum(c) for c in sizes[s]) for s in range(world))
        algorithm = costmodel.choose_gather(total, n, world, group=group, states=states)
    if algorithm == "gather_all":
        out = _gather_all(flat, inner, payloads, sizes, bounds, group, stats)
    else:
        out = _two_phase(flat, compressor, inner, payloads, sizes, bounds, group, key, step, stats, generator)
    if stats is not None:
        stats.add(calls=1, algorithm=algorithm)
    return out.to(tensor.dtype).reshape(tensor.shape)


def _local(caller, err, compressor, flat, key, step, stats, generator) -> torch.Tensor:
    """One rank: raise the input error, else compress and decode locally (nothing is sent)."""
    if err[0]:
        raise CollectiveInputError(f"{caller}: {err[1]}")
    p = compressor.compress(flat, step=step, key=(key, 0), generator=generator)
    if stats is not None:
        stats.add(calls=1, algorithm="local")
    return unwrap(compressor).decompress(p).reshape(-1)


def _two_phase(flat, compressor, inner, payloads, sizes, bounds, group, key, step, stats, generator):
    world = _comm.world(group)
    me = _comm.rank(group)
    acc = _reduce_own_chunk(flat, compressor, payloads, sizes, group, stats)
    src = acc.to(flat.dtype)
    if inner.unbiased:
        p2 = inner.compress(src, step=step, key=("owner", key, me), generator=generator)
    else:
        p2 = owner_feedback(compressor).compress(src, step=step, key=(key, me), generator=generator)
    body = _comm.to_bytes(*p2.tensors) if p2.tensors else torch.empty(0, dtype=torch.uint8, device=flat.device)
    expected = [sum(sizes[r][r]) for r in range(world)]  # owner r's phase-1 size of its own chunk
    width = 8 + max(expected)
    buf = torch.zeros(width, dtype=torch.uint8, device=flat.device)
    ok = body.numel() == expected[me]
    buf[:8] = torch.tensor([body.numel() if ok else -1], dtype=torch.int64).view(torch.uint8).to(buf.device)
    if ok:
        buf[8:8 + body.numel()] = body
    gathered = _comm.all_gather(buf, group=group, stats=stats)
    got = gathered[:, :8].contiguous().view(torch.int64).reshape(-1).tolist()
    bad = [r for r in range(world) if got[r] != expected[r]]
    if bad:
        raise CollectiveInputError(
            f"quantized_allreduce: owner(s) {bad} re-compressed to a size different from phase 1; "
            f"two_phase needs a compressor whose payload size depends only on (numel, dtype)")
    out = torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)
    for r in range(world):
        piece = _parse(gathered[r, 8:8 + expected[r]], sizes[r][r], payloads[r])
        out[bounds[r]:bounds[r + 1]] = inner.decompress(piece).float().reshape(-1)
    return out


def _gather_all(flat, inner, payloads, sizes, bounds, group, stats):
    world = _comm.world(group)
    me = _comm.rank(group)
    totals = [sum(sum(c) for c in sizes[s]) for s in range(world)]
    buf = torch.zeros(max(totals), dtype=torch.uint8, device=flat.device)
    mine = _comm.to_bytes(*[t for p in payloads for t in p.tensors]) if totals[me] else buf[:0]
    buf[:totals[me]] = mine
    gathered = _comm.all_gather(buf, group=group, stats=stats)
    out = torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)
    starts = [[0] * (world + 1) for _ in range(world)]
    for s in range(world):
        for r in range(world):
            starts[s][r + 1] = starts[s][r] + sum(sizes[s][r])
    for r in range(world):
        acc = torch.zeros(bounds[r + 1] - bounds[r], dtype=torch.float32, device=flat.device)
        for s in range(world):  # rank order on every rank
            piece = _parse(gathered[s, starts[s][r]:starts[s][r + 1]], sizes[s][r], payloads[r])
            acc += inner.decompress(piece).float().reshape(-1)
        out[bounds[r]:bounds[r + 1]] = acc
    return out


def reduce_scatter(tensor: torch.Tensor, compressor: Any, *, group=None, key: Any = 0, step: int = 0,
                   stats: CommStats | None = None, generator: torch.Generator | None = None,
                   validate: bool = True) -> torch.Tensor:
    """Compressed reduce-scatter: ``tensor`` (numel divisible by P) is P equal shards; rank ``r``
    gets the sum over ranks of shard ``r`` (1-D, ``tensor``'s dtype).

    Shard ``r`` is compressed with ``key=(key, r)`` and sent to rank ``r``
    (``all_to_all_single`` of the packed payloads); rank ``r`` decodes the P
    pieces and sums them in fp32 in rank order.  Works for ``"gather"``,
    ``"sum"`` and ``"sparse"`` compressors (everything whose payload decodes on
    its own).  With one rank: compress + decompress of the whole tensor.
    """
    world = _comm.world(group)
    inner = unwrap(compressor)
    if getattr(inner, "aggregation", None) not in ("gather", "sum", "sparse"):
        raise TypeError(f"reduce_scatter: compressor aggregation must be 'gather', 'sum' or 'sparse', "
                        f"got {getattr(inner, 'aggregation', None)!r}")
    flat = tensor.reshape(-1)
    n = flat.numel()
    err = (0, "")
    if n % world:
        err = (5, f"tensor.numel()={n} must be divisible by the group size {world}")
    elif tensor.dtype not in inner.supported_dtypes:
        err = (4, f"dtype {tensor.dtype} not supported by {inner.name}")
    if world == 1:
        return _local("reduce_scatter", err, compressor, flat, key, step, stats, generator).to(tensor.dtype)
    bounds = [r * (n // world) for r in range(world + 1)]
    payloads, sizes, _ = _phase1(flat, compressor, bounds, group, key, step, stats, generator, validate,
                                 "two_phase", "reduce_scatter", err)
    acc = _reduce_own_chunk(flat, compressor, payloads, sizes, group, stats)
    if stats is not None:
        stats.add(calls=1, algorithm="reduce_scatter")
    return acc.to(tensor.dtype)
