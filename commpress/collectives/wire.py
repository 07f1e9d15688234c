"""The wire format of the steady-state collectives: every layout fact lives here,
and what a rank puts on the wire: its compressor chain's fixed-size payload
(:func:`try_compress_fixed`, an :class:`~commpress.ErrorFeedback` staging its
residual update), the error code of its local checks (:func:`local_check`) and the
chain's :func:`fingerprint` for the signatures.

A compressed tensor costs its payload collectives and nothing more: no header
round, no size message.  Every rank derives every message size from static
facts (``numel``, dtype, the compressor's configuration), and the *status*
that used to need its own round rides inside the payload.

Byte messages (sparse all-gather, two-phase all-to-all and all-gather)
    start with a status word of two int32 (:data:`STATUS_BYTES` bytes):

    ====  ==============================================================
    word  content
    ====  ==============================================================
    0     flags: bit 0 :data:`NONFINITE` (this rank's input held a NaN/inf),
          bits 8..15 an error code from :data:`ERRORS` (0 = ok), bits 16..30
          (forwarded by a two-phase owner) the ranks it heard an error from
    1     signature: CRC of the call's static facts (kind, numel, dtype,
          configuration); ranks that disagree raise together
    ====  ==============================================================

    then the payload's tensors, each starting at a multiple of 8 bytes
    (:func:`layout`), and the message is padded to a multiple of 8.

``all_reduce`` messages (sum kinds, PowerSGD factors, dense parts)
    end with :data:`SUM_SLOTS` elements of the message's dtype that the
    reduction adds up: ``[sum of 2**rank over the ranks with an error (a count
    where the dtype cannot add that exactly), count of ranks with a NaN/inf input]``.

``reduce_scatter`` messages (``"sum"`` compressors: fp16 / bf16, shared-seed random-k)
    ``P`` equal pieces, piece ``r`` for rank ``r``: the payload of shard ``r``
    (its tensors, one dtype, back to back) followed by the same
    :data:`SUM_SLOTS`, so every rank receives the summed status with its shard.

The validation header (:mod:`commpress.collectives.validate`)
    exchanged only where static facts must first be agreed (the first call of a
    collective for a key, every call of the variable-size sparse algorithms):
    one int64 row per rank, one ``all_gather``.

    =======================  ==================================================
    slot                     content
    =======================  ==================================================
    0 :data:`H_ERROR`        error code of this rank's local checks (0 = ok, see :data:`ERRORS`)
    1 :data:`H_NUMEL`        ``numel``
    2 :data:`H_DTYPE`        dtype code of the values / tensor (index in :data:`DTYPES`)
    3 :data:`H_ALGORITHM`    algorithm code (index in :data:`ALGORITHM_CODES`)
    4 :data:`H_KIND`         kind of collective (index in :data:`KINDS`)
    5 :data:`H_CONFIG`       CRC32 of the compressor's name and configuration
    6 :data:`H_COUNT`        this rank's entry count ``k`` (sparse) or payload size (gather)
    7 :data:`H_MODEL`        cost-model state for ``"auto"``
                             (:func:`~commpress.collectives.costmodel.model_state`)
    8 .. 8+P                 per-owner range counts (``"split"``, ``"auto"``): :func:`header_split`
    8+P .. 8+2P              per-owner hash counts (``"hashed"``, ``"auto"``): :func:`header_hashed`
    8+2P .. 8+4P             reserved (zero)
    8+4P .. 8+4P+SKETCH      union sketch of :data:`SKETCH` hashes (``"auto"``): :func:`header_sketch`
    =======================  ==================================================

    Its length, :func:`header_len` ``= HEADER_FIXED + 4*P + SKETCH``, depends only
    on the group size, so ranks that disagree about everything else still
    complete the exchange.

Reading a status is the one host read of a call, and only where it is free:
on CPU tensors (host memory, no synchronization).  CUDA statuses are copied
to pinned memory behind an event and checked by :func:`flush_deferred` (at the
next call of the same thread, or the end of the step that made them) without
waiting for the device.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from ..compressors._util import mix_seed, stable_hash
from ..compressors.base import Compressor, Payload
from ..feedback import ErrorFeedback, ResidualTransaction, nonfinite_flag

STATUS_BYTES = 8
NONFINITE = 1
SUM_SLOTS = 2

#: ``hash_owner(i, HASH_RANGE)`` is the full 32-bit hash (Zen partitions, union sketches)
HASH_RANGE = 2**32

# ---------------------------------------------------------------- the validation header
#: fixed slots of the validation header (then 4 per rank, then the union sketch)
HEADER_FIXED = 8
#: hashes in the header's union sketch (k-minimum values)
SKETCH = 16
H_ERROR, H_NUMEL, H_DTYPE, H_ALGORITHM, H_KIND, H_CONFIG, H_COUNT, H_MODEL = range(HEADER_FIXED)

#: header slot :data:`H_DTYPE` is the index in this tuple (-1: another dtype)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64,
          torch.int32, torch.int64, torch.uint8, torch.int8, torch.int16)
#: header slot :data:`H_ALGORITHM` is the index in this tuple (-1: unknown)
ALGORITHM_CODES = ("auto", "allgather", "recursive_doubling", "split", "hashed", "dense",
                   "two_phase", "gather_all", "allreduce", "powersgd", "local", "reduce_scatter")
#: header slot :data:`H_KIND` is the index in this tuple
KINDS = ("sparse", "sum", "gather", "lowrank", "reduce_scatter")


def header_len(world: int) -> int:
    """Elements (int64) of one rank's validation header in a group of ``world`` ranks."""
    return HEADER_FIXED + 4 * world + SKETCH


def header_split(world: int) -> slice:
    """The header's per-owner range counts (SparCML ``"split"``)."""
    return slice(HEADER_FIXED, HEADER_FIXED + world)


def header_hashed(world: int) -> slice:
    """The header's per-owner hash counts (Zen ``"hashed"``)."""
    return slice(HEADER_FIXED + world, HEADER_FIXED + 2 * world)


def header_sketch(world: int) -> slice:
    """The header's union sketch (:data:`SKETCH` smallest hashes, for ``"auto"``)."""
    s = HEADER_FIXED + 4 * world
    return slice(s, s + SKETCH)


def dtype_code(dtype: Any) -> int:
    """Header slot :data:`H_DTYPE` of ``dtype`` (-1 for a dtype not in :data:`DTYPES`)."""
    return DTYPES.index(dtype) if dtype in DTYPES else -1


#: error codes carried in bits 8..15 of the flags word
ERRORS = {
    0: "ok",
    1: "index out of range",
    2: "duplicate indices",
    3: "indices and values have different lengths",
    4: "unsupported dtype or type",
    5: "bad shape",
    6: "compressor misuse",
    7: "configuration differs across ranks",
}
E_RANGE, E_DUPLICATE, E_LENGTH, E_DTYPE, E_SHAPE, E_MISUSE, E_CONFIG = 1, 2, 3, 4, 5, 6, 7


class CollectiveInputError(ValueError):
    """Bad input or a configuration that differs across ranks, raised on every rank together.

    A ``ValueError``.  Its cause travels in the status word of the call's messages, so no rank
    is left waiting; the message names the argument and what differs.
    """


def signature(*facts: Any) -> int:
    """A 31-bit CRC of ``repr(facts)`` (the same in every process)."""
    return zlib.crc32(repr(facts).encode()) & 0x7FFFFFFF


def align8(n: int) -> int:
    return (n + 7) & ~7


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------- what a rank puts on the wire
# The payload and the status a rank sends come from its compressor chain (an optional
# :class:`~commpress.ErrorFeedback` around a real compressor): its fixed-size payload, the error
# code of its local checks or of a compress that failed, the fingerprint in the signature.
def unwrap(compressor: Any) -> Any:
    """The real compressor behind error-feedback wrappers (or the compressor itself).

    Args:
        compressor: a compressor, or an :class:`~commpress.ErrorFeedback` (possibly nested).

    Returns:
        The innermost compressor.
    """
    inner = compressor
    while is_feedback(inner):
        inner = inner.compressor
    return inner


def is_feedback(c: Any) -> bool:
    return isinstance(c, ErrorFeedback)


def fingerprint(compressor: Any) -> int:
    """A hash of the compressor chain's names and configurations, compared across ranks.

    The header exchange of the collectives (``validate=True``) and the hooks' configuration
    check send it; computing it sends nothing.

    Args:
        compressor: a compressor, or an :class:`~commpress.ErrorFeedback` around one.

    Returns:
        A 31-bit integer (a CRC), equal on ranks whose chains have the same types, names and
        ``config()``.
    """
    parts = []
    c = compressor
    while True:
        cfg = c.config() if hasattr(c, "config") else {}
        parts.append((type(c).__name__, getattr(c, "name", ""), sorted((k, repr(v)) for k, v in cfg.items())))
        if not is_feedback(c):
            break
        c = c.compressor
    return signature(*parts)


def compress_fixed(compressor: Compressor, tensor: torch.Tensor, *, step: int, key: Any,
                   generator: torch.Generator | None, transaction: ResidualTransaction | None,
                   scale: float = 1.0, scratch: bool = False) -> Payload:
    """The fixed-size payload of ``tensor * scale``; an error-feedback residual update is staged in
    ``transaction`` (committed by the caller once every rank's status is known).  An int
    ``generator`` (a seed) is mixed with ``key``, so the chunks of one call draw
    independent noise.  ``scale``: folded into error feedback's compensation pass
    (:meth:`~commpress.ErrorFeedback.compress_fixed`), a multiplication of its own otherwise;
    ``scratch``: ``tensor`` is not read after the call (error feedback may work in it)."""
    if isinstance(generator, int) and not isinstance(generator, bool):
        generator = mix_seed(generator, stable_hash(key))
    if isinstance(compressor, ErrorFeedback):
        return compressor.compress_fixed(tensor, step=step, key=key, generator=generator, scale=scale,
                                         transaction=transaction, scratch=scratch)
    if scale != 1.0:
        tensor = tensor * scale
    return compressor.compress_fixed(tensor, step=step, key=key, generator=generator)


_PROBES: "weakref.WeakKeyDictionary[Any, dict[tuple, int]]" = weakref.WeakKeyDictionary()
_PROBES_LOCK = threading.Lock()


def payload_bytes(inner: Any, numel: int, dtype: torch.dtype) -> int:
    """Bytes of ``inner``'s fixed-size payload of ``numel`` elements (measured once per size, by
    compressing zeros; keyed weakly by the compressor, so a new compressor never reuses a dead
    one's entry).  What a caller plans with before it compresses anything."""
    k = (numel, str(dtype))
    with _PROBES_LOCK:
        found = _PROBES.get(inner, {}).get(k)
    if found is None:
        z = torch.zeros(numel, dtype=dtype if dtype in inner.supported_dtypes else torch.float32)
        found = inner.compress_fixed(z, key=("size-probe",)).nbytes if numel else 0
        with _PROBES_LOCK:
            _PROBES.setdefault(inner, {})[k] = found
    return found


def has_feedback(compressor: Any) -> bool:
    return isinstance(compressor, ErrorFeedback)


def local_check(tensor: torch.Tensor, compressor: Any, algorithm: str, allowed: tuple[str, ...]
                ) -> tuple[int, str]:
    """This rank's static checks: ``(error code, message)``, code 0 when fine."""
    if algorithm not in allowed:
        return E_MISUSE, f"algorithm must be one of {allowed}, got {algorithm!r}"
    inner = unwrap(compressor)
    if tensor.dtype not in inner.supported_dtypes:
        return E_DTYPE, f"dtype {tensor.dtype} not supported by {inner.name}"
    return 0, ""


def size_step(inner: Compressor, step: int) -> int:
    """The step to compress a zero payload at when only its size matters: ``step`` for a
    compressor whose size follows the step (a density warm-up, ``ratio_at``), else 0 (a
    compressor that failed at ``step`` may fail there again)."""
    return step if inner.ratio_at(step) is not None else 0


def try_compress_fixed(compressor: Compressor, tensor: torch.Tensor, *, step: int, key: Any,
                       generator, transaction: ResidualTransaction | None, error: tuple[int, str],
                       stats=None, scale: float = 1.0, scratch: bool = False) -> tuple[Payload | None, int, str]:
    """:func:`compress_fixed` unless ``error`` is already set; a compress that raises
    becomes an error code (raised on every rank through the status, never here).
    ``stats`` (a :class:`~.accounting.CommStats`): its ``"compress"`` pass is charged."""
    code, msg = error
    if code:
        return None, code, msg
    t0 = time.perf_counter()
    try:
        return compress_fixed(compressor, tensor, step=step, key=key, generator=generator,
                              transaction=transaction, scale=scale, scratch=scratch), 0, ""
    except Exception as exc:  # noqa: BLE001 - reported through the status word
        return None, E_MISUSE, f"compress failed: {type(exc).__name__}: {exc}"
    finally:
        if stats is not None:  # accounting.codec_timer's charge (wire imports no other module here)
            stats.add_codec("compress", time.perf_counter() - t0)


def cast_message(tensor: torch.Tensor, dtype: torch.dtype, scale: float | None = None, *,
                 slots: int = 0, pieces: int = 1, scale_in_place: bool = False) -> torch.Tensor:
    """The one cast path (identity / fp16 / bf16): a new flat message of ``dtype`` holding ``tensor``.

    The values are ``tensor`` times ``scale`` (computed in ``tensor``'s dtype and rounded once),
    followed by ``slots`` elements left for the caller (the status slots, :data:`SUM_SLOTS`).
    The message is what goes on the wire in the ``all_reduce`` / ``reduce_scatter`` of a
    ``"sum"`` compressor that casts.

    Args:
        tensor: the floating tensor to cast.
        dtype: the message's dtype (``torch.float16``, ``torch.bfloat16``, or ``tensor``'s).
        scale: a factor applied before the cast (``None``: none).
        slots: elements left after the values (after each piece with ``pieces``).
        pieces: ``tensor`` is that many equal shards, each followed by its own ``slots`` (a
            ``reduce_scatter`` message: ``pieces * (numel / pieces + slots)`` elements).
        scale_in_place: ``tensor`` itself is scaled, then cast (for a tensor whose values are
            not needed afterwards, such as a DDP bucket the result overwrites): the same bits,
            two passes and no temporary (2.1M elements on one core: 0.45 ms against 0.8-1.2 in
            one call).

    Returns:
        The flat message, on ``tensor``'s device.

    Raises:
        ValueError: ``tensor.numel()`` is not divisible by ``pieces``.
    """
    if scale_in_place and scale is not None:
        tensor.mul_(scale)
        scale = None
    n = tensor.numel()
    if pieces == 1:
        message = torch.empty(n + slots, dtype=dtype, device=tensor.device)
        body, src = message[:n], tensor.reshape(-1)
    else:
        if n % pieces:
            raise ValueError(f"cast_message: tensor.numel()={n} must be divisible by pieces={pieces}")
        per = n // pieces
        message = torch.empty(pieces * (per + slots), dtype=dtype, device=tensor.device)
        body, src = message.view(pieces, per + slots)[:, :per], tensor.reshape(pieces, per)
    if scale is None:
        body.copy_(src)
    elif src.dim() == 1:
        _scaled_cast(src, scale, body)
    else:
        for row, out in zip(src, body):
            _scaled_cast(row, scale, out)
    return message


#: Elements per slice of a host scaled cast (4 MiB of fp32): ``torch.mul(src, scale, out=fp16)``
#: builds an fp32 temporary of the whole input on CPU, a fresh allocation a call that is paged in
#: and out of cache (one core, median of 20: 6.5M elements, a 25 MB DDP bucket, 4.4-5.0 ms in one
#: call against 2.6-3.1 ms in 1M slices; 12M 44 ms against 5.5; 2.1M alike).
CAST_SLICE = 1 << 20


def _scaled_cast(src: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """``out = (src * scale)`` cast to ``out``'s dtype, rounded once, in slices of at most
    :data:`CAST_SLICE` elements where a temporary is made (a host cast to another dtype):
    elementwise, so the bits are those of one call."""
    n = src.numel()
    if n <= CAST_SLICE or src.is_cuda or out.dtype == src.dtype:
        torch.mul(src, scale, out=out)
        return
    for start in range(0, n, CAST_SLICE):
        torch.mul(src[start:start + CAST_SLICE], scale, out=out[start:start + CAST_SLICE])


# ---------------------------------------------------------------- byte layouts
@dataclass(frozen=True)
class Layout:
    """Where each tensor of a payload sits in a byte message (after the status word)."""

    specs: tuple[tuple[torch.dtype, tuple[int, ...], int, int], ...]   # (dtype, shape, byte offset, bytes)
    width: int                                                          # message bytes, a multiple of 8

    @staticmethod
    def of(tensors: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> "Layout":
        specs, off = [], STATUS_BYTES
        for t in tensors:
            n = nbytes_of(t)
            specs.append((t.dtype, tuple(t.shape), off, n))
            off = align8(off + n)
        return Layout(tuple(specs), align8(off))

    # (every torch call on these small views costs a dispatch, several microseconds on a CPU:
    # the ones that would change nothing, a uint8 view of uint8 or a 1-D shape, are skipped)
    def write(self, msg: torch.Tensor, tensors, status: torch.Tensor) -> None:
        """Fill ``msg`` (uint8, ``width`` bytes) with ``status`` (int32[2]) and ``tensors``."""
        msg[:STATUS_BYTES].view(torch.int32).copy_(status)
        for t, (dtype, _, off, n) in zip(tensors, self.specs):
            if n:
                dst = msg[off:off + n]
                (dst if dtype == torch.uint8 else dst.view(dtype)).copy_(t if t.dim() == 1 else t.reshape(-1))

    def read(self, msg: torch.Tensor) -> list[torch.Tensor]:
        """The tensors of a message (views into ``msg``, which must start 8-aligned)."""
        out = []
        for dtype, shape, off, n in self.specs:
            v = msg[off:off + n]
            if dtype != torch.uint8:
                v = v.view(dtype)
            out.append(v if len(shape) == 1 else v.view(shape))
        return out


# ---------------------------------------------------------------- a dense part riding in a message
@dataclass
class Rider:
    """A flat tensor summed exactly with a call's payload (``allreduce(..., dense=)``): the
    gather messages carry it raw after the payload's tensors (its own 8-aligned slot of the
    :class:`Layout`), and every rank adds the P contributions in rank order (:func:`add_rows`).
    ``carried`` is set by the path that sent it; a path that cannot carry it leaves it unset
    and the caller all-reduces it on its own."""

    tensor: torch.Tensor
    carried: bool = False

    @staticmethod
    def free(world: int) -> bool:
        """Whether riding in an ``all_gather`` costs no more bytes than a ring ``all_reduce`` of
        the same values (:mod:`.accounting`: ``m·(P−1)`` against ``2·m·(P−1)/P``): ``P <= 2``."""
        return world <= 2

    def flag(self, bad: torch.Tensor | None) -> torch.Tensor:
        """``bad`` (a payload's NaN/inf flag, or ``None``) or'ed with this part's own (no host read)."""
        own = nonfinite_flag(self.tensor)
        return own if bad is None else bad | own


# ---------------------------------------------------------------- held messages riding in a call's gather
@dataclass
class Passengers:
    """Messages of calls encoded earlier and held (:func:`commpress.collectives.joint.hold`) that
    ride in a later call's first ``all_gather``: appended after that call's own message, so the
    step pays one round for all of them.  The path that carries them (the steady lanes) sets
    ``rows``, their gathered ``[P, width]`` bytes (a view), and ``carried``, and calls ``landing(rows)``
    (when given) as soon as they arrive, before it waits for its own later messages (a pipelined
    call's next chunk): their decoding overlaps that flight.  A path that cannot carry them leaves
    both unset and the caller gathers them itself (:func:`commpress.collectives.joint.gather_held`)."""

    messages: list[torch.Tensor]
    landing: Any = None
    rows: torch.Tensor | None = None
    carried: bool = False

    @property
    def width(self) -> int:
        """Their bytes (each message 8-aligned, so every one starts 8-aligned after an 8-aligned message)."""
        return sum(m.numel() for m in self.messages)

    def board(self, buf: torch.Tensor, at: int) -> None:
        """Copy the messages into ``buf`` from byte ``at`` (the carrying call's message ends there)."""
        self.carried = True
        for m in self.messages:
            buf[at:at + m.numel()].copy_(m)
            at += m.numel()

    def alight(self, gathered: torch.Tensor, at: int) -> None:
        """Their gathered rows, ``gathered[:, at:]``, landed at once when a ``landing`` is given."""
        self.rows = gathered[:, at:]
        if self.landing is not None:
            landing, self.landing = self.landing, None
            landing(self.rows)


def add_rows(dst: torch.Tensor, rows: list[torch.Tensor]) -> None:
    """``dst = rows[0] + rows[1] + ...`` in this order (rank order: bitwise the same on every
    rank), in fp32 for fp16 / bf16 (rounded once into ``dst``), in ``dst``'s dtype otherwise."""
    if dst.dtype in (torch.float16, torch.bfloat16):
        acc = rows[0].float()
        for r in rows[1:]:
            acc.add_(r)
        dst.copy_(acc)
        return
    dst.copy_(rows[0])
    for r in rows[1:]:
        dst.add_(r)


def read_status(msgs: torch.Tensor) -> torch.Tensor:
    """The status words of a ``[P, width]`` stack of messages: int32 ``[P, 2]`` (on the CPU a view of
    the messages: no copy, no torch op)."""
    if msgs.device.type == "cpu" and msgs.shape[1] % 4 == 0:
        return torch.from_numpy(msgs.numpy()[:, :STATUS_BYTES].view(np.int32))
    return msgs[:, :STATUS_BYTES].contiguous().view(torch.int32).reshape(-1, 2)


def status_word(device: torch.device, *, error: int = 0, sig: int = 0,
                nonfinite: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 ``[flags, signature]`` on ``device`` built without a host read or copy (on the CPU,
    where flags are host memory already, read and written as one small tensor: a torch op on a
    tiny tensor costs more there than the read)."""
    extra = _DEVICE_ERROR.flag
    if out is None and torch.device(device).type == "cpu" and (nonfinite is None or nonfinite.device.type == "cpu"):
        word = host_status(error, sig, nonfinite is not None and bool(nonfinite.numpy()))
        if word is not None:
            return torch.tensor(word, dtype=torch.int32)
    w = out if out is not None else torch.empty(2, dtype=torch.int32, device=device)
    w[0].fill_(int(error) << 8)
    w[1].fill_(int(sig))
    if nonfinite is not None:
        w[0:1].add_(nonfinite.to(torch.int32).reshape(1))
    if extra is not None and not error:
        w[0:1].add_(extra.to(torch.int32).reshape(1) * (E_MISUSE << 8))
    return w


def host_status(error: int, sig: int, nonfinite: bool) -> tuple[int, int] | None:
    """:func:`status_word`'s two int32 ``(flags, signature)`` computed on the host, for a CPU call
    whose NaN/inf verdict is a Python bool; ``None`` while a device error flag is pending (only
    the device may read it: build the word with :func:`status_word` there)."""
    extra = _DEVICE_ERROR.flag
    if extra is not None and extra.device.type != "cpu":
        return None
    flags = int(error) << 8
    if nonfinite:
        flags |= NONFINITE
    if extra is not None and not error and bool(extra.numpy()):
        flags += E_MISUSE << 8
    return flags, int(sig)


class _DeviceError(threading.local):
    flag: torch.Tensor | None = None


_DEVICE_ERROR = _DeviceError()


@contextlib.contextmanager
def device_error(flag: torch.Tensor | None) -> Iterator[None]:
    """Within the block, every status this thread writes (:func:`status_word`, :func:`sum_slots`)
    also reports an error (:data:`E_MISUSE`) where the 0-d bool ``flag`` is set, decided on the
    device: how a verdict known only on the device (a node's, in the two-level protocol) reaches
    every rank of the next collective without a host read.  ``None``: nothing added."""
    previous, _DEVICE_ERROR.flag = _DEVICE_ERROR.flag, flag
    try:
        yield
    finally:
        _DEVICE_ERROR.flag = previous


#: ranks whose error bits an all_reduce slot of this dtype adds exactly (2**rank each)
_EXACT_RANKS = {torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def sum_slots(buf: torch.Tensor, *, error: int = 0, nonfinite: torch.Tensor | None = None,
              rank: int = 0, world: int = 1) -> None:
    """Write the :data:`SUM_SLOTS` status elements at the end of an all_reduce message:
    ``2**rank`` in the error slot on a bad rank (1 when the dtype cannot add that many
    powers of two exactly), this rank's NaN/inf flag in the other."""
    exact = world <= _EXACT_RANKS.get(buf.dtype, 0)
    buf[-2].fill_(0 if not error else (float(2 ** rank) if exact else 1.0))
    extra = _DEVICE_ERROR.flag
    if extra is not None and not error:
        buf[-2:-1].add_(extra.to(buf.dtype).reshape(1) * (float(2 ** rank) if exact else 1.0))
    if nonfinite is None:
        buf[-1].fill_(0)
    else:
        buf[-1:].copy_(nonfinite.to(buf.dtype).reshape(1))


# ---------------------------------------------------------------- verdicts
def any_nonfinite(statuses: torch.Tensor) -> torch.Tensor:
    """0-d bool: some rank flagged a NaN/inf (``statuses``: int32 ``[P, 2]``)."""
    return (statuses[:, 0] & NONFINITE).any()


def poison_(out: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """Make ``out`` all-NaN where the 0-d ``bad`` is set (so AMP skips the step); no host read.

    A CPU flag is host memory already: it is read (no synchronisation) and ``out`` is
    only touched when it is set (no pass over the result in the common case)."""
    if bad.device.type == "cpu" and out.device.type == "cpu":
        if bool(bad.numpy()):
            out.fill_(float("nan"))
        return out
    if out.numel():  # x + (-0.0) is x bitwise (signed zeros included); x + NaN is NaN
        nan = torch.full((), float("nan"), dtype=out.dtype, device=out.device)
        out.add_(torch.where(bad, nan, torch.full((), -0.0, dtype=out.dtype, device=out.device)))
    return out


def check_byte_statuses(statuses: torch.Tensor, sig: int, what: str, local: str = "") -> None:
    """Raise :class:`CollectiveInputError` on every rank when any rank reported an error or a
    different signature (``statuses`` gathered from every rank, so all ranks decide alike)."""
    if statuses.device.type != "cpu":
        _defer(statuses, ("bytes", sig, what, local))
        return
    judge_bytes(statuses.numpy(), sig, what, local)


def check_sum_slots(buf: torch.Tensor, what: str, local: str = "", world: int = 1) -> None:
    """Raise on every rank when the summed error slot of an all_reduce message is non-zero."""
    slot = buf[-2:-1]
    exact = world <= _EXACT_RANKS.get(buf.dtype, 0)
    if slot.device.type != "cpu":
        _defer(slot, ("sum", exact, what, local))
        return
    _judge_sum(slot.float().numpy(), exact, what, local)


def _ranks(mask: int) -> list[int]:
    return [r for r in range(31) if mask >> r & 1]


def judge_bytes(st, sig: int, what: str, local: str = "") -> None:
    """:func:`check_byte_statuses` on statuses already in host memory (a numpy ``[P, 2]`` int32)."""
    codes = [(int(f) >> 8) & 0xFF for f in st[:, 0]]
    bad = [r for r, c in enumerate(codes) if c]
    if bad:
        forwarded = 0
        for f in st[:, 0]:
            forwarded |= (int(f) >> 16) & 0x7FFF
        ranks = _ranks(forwarded) or bad   # owners forward their senders' ranks (P <= 15)
        detail = ", ".join(sorted({ERRORS.get(c, "error") for c in codes if c}))
        mine = f" (this rank: {local})" if local else ""
        raise CollectiveInputError(f"{what}: bad input on rank(s) {ranks}: {detail}{mine}")
    sigs = [int(s) for s in st[:, 1]]
    if len(set(sigs)) > 1:
        raise CollectiveInputError(
            f"{what}: configuration differs across ranks (numel, dtype, compressor or algorithm); "
            f"signatures {sigs}")


def _judge_sum(slot, exact: bool, what: str, local: str) -> None:
    value = float(slot[0])
    if value != 0.0:
        who = f"rank(s) {_ranks(int(value))}" if exact else "some rank(s)"
        mine = f" (this rank: {local})" if local else ""
        raise CollectiveInputError(f"{what}: bad input on {who}{mine}")


# ---------------------------------------------------------------- CUDA: deferred checks
class _Deferred(threading.local):
    """Each thread's own pending statuses: the DDP worker's are judged by the worker, never
    by a call of another thread (an error must not surface in an unrelated call)."""

    def __init__(self) -> None:
        self.items: list[tuple[torch.Tensor, Any, tuple]] = []


_DEFERRED = _Deferred()


def _defer(t: torch.Tensor, how: tuple) -> None:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    _DEFERRED.items.append((host, event, how))


def flush_deferred(wait: bool = False) -> None:
    """Judge this thread's CUDA statuses whose copies have landed (all of them with ``wait``).

    On CUDA the status word travels with the payload and is read on the host later, without a
    synchronization; this raises :class:`CollectiveInputError` like the CPU path, one or more
    calls later.  The hooks call it at the end of each step (and the collectives at their
    start).  Nothing is sent.

    Args:
        wait: wait for every pending status (a device synchronization) instead of judging only
            those that have landed.

    Raises:
        CollectiveInputError: a judged status reports bad input on some rank.
    """
    pending = _DEFERRED.items
    while pending:
        host, event, (kind, extra, what, local) = pending[0]
        if not wait and not event.query():
            return
        event.synchronize()
        pending.pop(0)
        if kind == "bytes":
            judge_bytes(host.numpy(), extra, what, local)
        else:
            _judge_sum(host.float().numpy(), extra, what, local)
