"""Error feedback: compress ``x + residual`` and remember what was not sent (Stich 2018, Karimireddy 2019).

One residual memory, as GRACE's ``Memory``: :class:`ErrorFeedback` holds every
piece of per-key state the gradient path keeps between steps (the residual, the
momentum-correction velocity, and the plain momentum of the parameters a hook
sends dense) behind one public protocol:

* :meth:`ErrorFeedback.compensate` — ``m·u + g`` (momentum correction) plus ``beta·residual``;
* :meth:`ErrorFeedback.stage` — the next residual ``compensated − sent``, pending;
* :meth:`ErrorFeedback.commit` — live := pending for one key, unless a 0-d ``bad`` flag is set;
* :meth:`ErrorFeedback.rollback` — drop a key's pending update.

Residual changes are applied on the device, never decided on the host: a
compress writes the next residual into a *pending* buffer, and a commit sets the
live residual to it, or keeps the old one where a 0-d ``bad`` flag (a NaN/inf
on some rank) says so, with one ``torch.where`` on CUDA (on the CPU, where the
flag is host memory, by swapping the two buffers).  A :class:`ResidualTransaction`
groups the commits of one collective call or one training step, so an overflow
anywhere in a step leaves every residual as it was.  Only the outermost caller
owns a transaction: inner code receives it, or calls :func:`transaction_scope`,
which opens one only when none was given.  The local non-finite verdict of a
compress travels with its payload (:attr:`Payload.nonfinite
<commpress.compressors.base.Payload>`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import threading
from typing import Any, Iterator, Protocol

import torch

from .compressors._sparse import SparseCompressor
from .compressors._util import decode_keyed, encode_keyed, exact_nonfinite_flag, mix_seed, stable_hash
from .compressors.base import Compressor, Payload
from .ops.reference import accumulate_velocity
from ._pool import BufferPool
from .loan import Loan, Saved
from .storage import LeanTensor, check_storage, velocity_mode

log = logging.getLogger("commpress")


def nonfinite_flag(t: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor on ``t``'s device: True when ``t`` holds a NaN or inf (no host read).

    One fp32 sum: NaN and inf propagate into it (``inf - inf`` is NaN).  A finite
    tensor whose sum overflows fp32 also reads as non-finite (conservative).
    """
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=t.device)
    return ~torch.isfinite(t.sum(dtype=torch.float32))


def _host_verdict(bad: torch.Tensor | None) -> bool | None:
    """``bad`` as a Python bool when it lives in host memory (``None`` flag: False);
    ``None`` for a device flag, which only the device may read."""
    if bad is None:
        return False
    if bad.device.type == "cpu":
        return bool(bad.numpy())
    return None


def _either(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    return a | b.to(a.device)


class Memory(Protocol):
    """What a :class:`ResidualTransaction` commits: one key's pending state at a time."""

    def commit(self, key: Any, bad: torch.Tensor | None = None) -> None: ...

    def rollback(self, key: Any) -> None: ...


@dataclasses.dataclass(frozen=True)
class _Dense:
    """The key of a dense tensor's momentum in :class:`ErrorFeedback` (its own namespace)."""

    name: str


@dataclasses.dataclass(frozen=True)
class _VelocityOnly:
    """The key of a staged velocity update with no residual update beside it
    (:meth:`ErrorFeedback.velocity_into`)."""

    key: Any


class ResidualTransaction:
    """The staged residual updates of one collective call or one training step.

    :meth:`ErrorFeedback.compress` with ``transaction=tx`` stages its update;
    :meth:`commit` applies every staged update where neither its own local flag
    nor the transaction's ``bad`` flag (``mark_bad``, or the argument of
    ``commit``) is set, and keeps the old residual elsewhere; :meth:`rollback`
    drops them all.  Flags are 0-d bool tensors: nothing is read on the host.
    With a :attr:`loan` set, lean residuals are rewritten in place and their old codes wait
    in the lent memory (:mod:`commpress.loan`) instead of a pending store.
    """

    def __init__(self) -> None:
        self._staged: list[tuple[ErrorFeedback, Any, torch.Tensor | None]] = []
        self._done = 0      # entries before this one were committed early (commit_through)
        self._bad: torch.Tensor | None = None
        #: memory lent until this transaction's verdict (:mod:`commpress.loan`): a lean residual
        #: staged while it is set saves its old codes there and stores the new ones over them
        #: (no pending store).  Its owner sets it around the calls whose lender it is, and keeps
        #: the lent memory untouched until the commit (or rollback) of what was staged then.
        self.loan: Loan | None = None

    def __len__(self) -> int:
        return len(self._staged) - self._done

    @contextlib.contextmanager
    def lending(self, loan: Loan | None) -> Iterator[None]:
        """:attr:`loan` set to ``loan`` for the block (``None``: no loan), unset after it."""
        self.loan = loan
        try:
            yield
        finally:
            self.loan = None

    def stage(self, memory: Memory, key: Any, local_bad: torch.Tensor | None = None) -> None:
        """Remember that ``memory`` holds a pending update for ``key`` (committed by :meth:`commit`)."""
        self._staged.append((memory, key, local_bad))

    def position(self) -> int:
        """How many updates were staged so far (for :meth:`commit_through`)."""
        return len(self._staged)

    def commit_through(self, position: int) -> None:
        """Commit the staged updates before ``position`` now, under the bad flag marked so far
        (which stays: a later mark still keeps every update staged after it).  A step that
        commits each unit's updates once its collective judged it (the hooks'
        ``rollback="unit"``) keeps no pending state beyond the units in flight; a NaN/inf then
        keeps the residuals of the unit that saw it and of every unit after it."""
        end = min(position, len(self._staged))
        for memory, key, local in self._staged[self._done:end]:
            memory.commit(key, _either(self._bad, local))
        self._done = max(self._done, end)

    def mark_bad(self, flag: torch.Tensor) -> None:
        """OR ``flag`` (0-d bool) into the transaction's bad flag."""
        self._bad = _either(self._bad, flag)

    @property
    def bad(self) -> torch.Tensor | None:
        return self._bad

    def commit(self, bad: torch.Tensor | None = None) -> None:
        flag = _either(self._bad, bad)
        for memory, key, local in self._staged[self._done:]:
            memory.commit(key, _either(flag, local))
        self._staged.clear()
        self._done = 0
        self._bad = None

    def rollback(self) -> None:
        """Drop every staged update not committed yet (the live state keeps its value)."""
        for memory, key, _ in self._staged[self._done:]:
            memory.rollback(key)
        self._staged.clear()
        self._done = 0
        self._bad = None


@contextlib.contextmanager
def transaction_scope(transaction: ResidualTransaction | None) -> Iterator[ResidualTransaction]:
    """``transaction`` itself when given (its owner commits it), else a new one that
    commits when the block ends and rolls back when it raises.  The one place a
    collective opens a transaction: only the outermost caller owns one."""
    if transaction is not None:
        yield transaction
        return
    tx = ResidualTransaction()
    try:
        yield tx
    except BaseException:
        tx.rollback()
        raise
    tx.commit()


def owns_transaction(fn):
    """Decorate a collective with a ``transaction=`` keyword: called without one, it runs in a
    :func:`transaction_scope` of its own (committed when it returns); called with one (by an
    outer collective or a hook's step), it only stages into it."""

    @functools.wraps(fn)
    def wrapper(*args: Any, transaction: ResidualTransaction | None = None, **kwargs: Any):
        if transaction is not None:
            return fn(*args, transaction=transaction, **kwargs)
        with transaction_scope(None) as tx:
            return fn(*args, transaction=tx, **kwargs)

    return wrapper


@dataclasses.dataclass
class FusedSlots:
    """One key's buffers for a fused error-feedback kernel (:meth:`ErrorFeedback.open_fused`).

    Attributes:
        x: the input (its scale not applied yet when ``scale != 1``).
        scale: multiply ``x`` by it in the kernel (the hook's folded ``1/P``).
        live: the live residual in fp32, shaped like ``x`` (``None``: zero).
        pending: fp32 buffer shaped like ``x`` for the next residual.
        velocity: momentum correction's ``(live, momentum, new)`` or ``None``.
    """

    x: torch.Tensor
    scale: float
    live: torch.Tensor | None
    pending: torch.Tensor
    velocity: Any


class ErrorFeedback(Compressor):
    """Wraps ``compressor``; itself a Compressor with the same wire format and aggregation.

    Per ``key``: ``c = x + beta * e`` (fp32); the payload is
    ``compressor.compress(c)`` (``c`` cast back to ``x``'s dtype); then
    ``e = c - decompress(payload)``.  So ``decompress(payload) + e_after ==
    x + beta * e_before``.  Residuals are fp32 (or lean, ``storage``), shaped like the
    input, allocated once per key (with one pending buffer of the same size that also holds
    ``c``) and updated in place.  When ``c`` holds a NaN/inf the payload still
    carries it (so AMP's GradScaler sees it) and the residual keeps its old
    value.  For fp32 input to a sparsifier the residual is written in the same
    pass as the selection (same result as the generic path).

    Collectives pass ``transaction=`` (a :class:`ResidualTransaction`) so that
    the update waits for the cross-rank verdict; without one it is committed at
    once with the local non-finite flag.

    Allocation-free in steady state for fp32 input: the generic path decodes into
    one reused buffer (per dtype and device, as large as the largest key), and a
    compressor with ``compress_feedback`` (signsgd) compensates, encodes and writes
    the pending residual in one fused pass.

    Momentum correction (DGC, Lin et al. 2018), ``momentum=m > 0``: per key a
    velocity ``u = m*u + g`` is kept, where ``g`` is the input clipped to L2 norm
    ``clip`` when given (local gradient clipping); error feedback then runs on
    ``u`` (``c = u + beta*e``, ``e = c - sent``), and for sparsifiers ``u`` is zeroed
    at the sent coordinates (momentum factor masking; ``masking=False`` keeps it, so
    that a coordinate sent at every step sees exactly SGD's momentum).  The momentum now lives
    here: pair it with plain SGD, ``torch.optim.SGD(params, lr, momentum=0)``.
    The velocity commits with the residual (same non-finite rule and
    transactions), adds two fp32 buffers per key, and is in ``state_dict``.

    Args:
        compressor: what encodes the compensated tensor.
        beta: the residual's weight in the compensation, in [0, 1].
        momentum: momentum correction's factor in [0, 1) (0: off).
        clip: local gradient clipping before the velocity (L2 norm), or ``None``.
        masking: momentum factor masking (with ``momentum``).
        storage: how residuals (and momentum correction's velocities) are kept between steps:
            ``"fp32"`` (exact), ``"bf16"``, ``"int8"`` or ``"int4"`` (blockwise, stochastic
            rounding; :mod:`commpress.storage`).  The
            computation is fp32 either way; a lean store decodes into a buffer of the key's
            size while it works.
        seed: the lean stores' rounding noise is drawn from it (and the rank, key and a count).
        hold_pending: keep each key's pending residual between steps (allocated once; the
            commit swaps it with the live one).  ``False`` frees it at the commit: only the
            keys between a compress and their commit hold one (the hooks' ``rollback="unit"``).

    Raises:
        TypeError: ``compressor`` is not a Compressor, ``masking``/``hold_pending`` not bools.
        ValueError: a number out of its range, or an unknown ``storage`` (naming the allowed ones).
    """

    unbiased = False

    def __init__(self, compressor: Compressor, beta: float = 1.0, momentum: float = 0.0,
                 clip: float | None = None, masking: bool = True, storage: str = "fp32",
                 seed: int = 0, hold_pending: bool = True) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a Compressor, got {type(compressor).__name__}")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be a number in [0, 1], got {beta!r}")
        self.compressor = compressor
        self.beta = float(beta)
        self.name = f"ef({compressor.name})"
        self.aggregation = compressor.aggregation
        self.deterministic = compressor.deterministic
        self.supported_dtypes = compressor.supported_dtypes
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                                 or not clip > 0 or clip == float("inf")):
            raise ValueError(f"clip must be None or a finite number > 0, got {clip!r}")
        if not isinstance(masking, bool):
            raise TypeError(f"masking must be a bool, got {type(masking).__name__}")
        self.storage = check_storage(storage)
        if not isinstance(hold_pending, bool):
            raise TypeError(f"hold_pending must be a bool, got {type(hold_pending).__name__}")
        self.hold_pending = hold_pending
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__}")
        self.seed = seed
        self._stores = 0   # lean stores so far: with the seed, the stochastic rounding's noise
        self.momentum = float(momentum)
        self.clip = None if clip is None else float(clip)
        self.masking = masking
        self._config = {"compressor": compressor.name, "params": compressor.config(), "beta": beta}
        if self.momentum or self.clip is not None:
            self._config.update(momentum=self.momentum, clip=self.clip)
        if self.momentum and not masking:  # absent by default: older fingerprints stay valid
            self._config["masking"] = False
        if self.storage != "fp32":   # absent by default: older fingerprints stay valid
            self._config["storage"] = self.storage
        # fp32 storage: fp32 tensors shaped like the input; lean storage: LeanTensor (flat)
        self._residuals: dict[Any, Any] = {}
        self._pending: dict[Any, Any] = {}
        self._open: dict[Any, torch.Tensor] = {}   # lean storage: fp32 next residuals until sealed
        self._work = BufferPool()   # lean storage's fp32 buffers for the next residuals, until sealed
        self._borrowed: set = set()   # keys whose open buffer is the caller's scratch input
        self._saved: dict[Any, Saved] = {}   # keys stored over their live residual: the old codes, lent
        self._vsaved: dict[Any, Saved] = {}  # the same for velocities (_velocity_sealed then aliases the live one)
        self._decoded: dict[tuple[int, torch.device], torch.Tensor] = {}   # per thread: a decoded live one
        # momentum correction's velocity: fp32 tensors, or LeanTensor (flat) with a lean storage
        self._velocity: dict[Any, Any] = {}
        # the step's new velocity in fp32, numel + 1 entries (slot numel is padding); with a lean
        # storage a pooled working buffer until sealed into _velocity_sealed (the pending LeanTensor)
        self._velocity_pending: dict[Any, torch.Tensor] = {}
        self._velocity_sealed: dict[Any, LeanTensor] = {}
        self._vstores = 0   # lean velocity stores so far (their own count: a path stores once a step)
        self._vdecoded: dict[tuple[int, torch.device], torch.Tensor] = {}   # per thread: a decoded live velocity
        self._decode: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._dense_velocity: dict[str, torch.Tensor] = {}   # plain momentum of dense tensors
        self._dense_pending: dict[str, torch.Tensor] = {}

    # -- buffers -----------------------------------------------------------
    def residual(self, key: Any) -> torch.Tensor | None:
        """The stored residual for ``key`` in fp32, or ``None``: the live buffer itself with fp32
        storage, a decoded (flat) copy with a lean one."""
        live = self._residuals.get(key)
        return live.decode() if isinstance(live, LeanTensor) else live

    def _pending_buf(self, key: Any, like: torch.Tensor) -> torch.Tensor:
        """The fp32 buffer (shaped like ``like``) where ``key``'s next residual is written: the
        pending residual itself with fp32 storage, a working buffer until :meth:`_seal` with a lean one."""
        if self.storage == "fp32":
            return self._slot(self._pending, key, like)
        buf = self._open.get(key)
        if buf is None or buf.numel() != like.numel() or buf.device != like.device:
            self._release_open(key)
            buf = self._open[key] = self._work.take(like.numel(), torch.float32, like.device)
        return buf.view(like.shape)

    def _seal(self, key: Any, transaction: ResidualTransaction | None = None) -> None:
        """Lean storage: store ``key``'s written next residual (its working buffer, then freed)
        as its pending residual, or over its live one where ``transaction`` has a loan that takes
        the old codes (:meth:`_over_live`).  A no-op with fp32 storage (it was written in place)."""
        if self.storage == "fp32":
            return
        src = self._open[key]
        self._next_store(self._residuals, self._saved, self._pending, key, src.numel(), src.device,
                         transaction).encode(src, self._next_seed(key))
        self._release_open(key)

    def _next_store(self, live_table: dict, saved_table: dict, pending_table: dict, key: Any, numel: int,
                    device: torch.device, transaction: ResidualTransaction | None,
                    alias: bool = False) -> LeanTensor:
        """Where ``key``'s next lean store (a residual, or a velocity) is written: over the live one
        where ``transaction``'s loan takes its old codes (:meth:`_over_live`; with ``alias``,
        ``pending_table`` names it until the commit), else its pending store in ``pending_table``
        (made, undefined, where it has none of that size and device)."""
        store = self._over_live(live_table, saved_table, pending_table, key, numel, device, transaction)
        if store is not None:
            if alias:
                pending_table[key] = store
            return store
        store = pending_table.get(key)
        if store is None or store.numel != numel or store.device != device:
            store = pending_table[key] = LeanTensor(self.storage, numel, device, zeroed=False)
        return store

    def _restore_saved(self, saved_table: dict, key: Any, bad: torch.Tensor | None,
                       keep_old: bool | None) -> bool:
        """``key``'s old codes back from the loan where the step is judged bad (a rollback:
        ``keep_old=True``), if it was stored over its live store in ``saved_table``; whether it was.
        A velocity's alias in ``_velocity_sealed`` is dropped (not a pending store)."""
        saved = saved_table.pop(key, None)
        if saved is None:
            return False
        if saved_table is self._vsaved:
            self._velocity_sealed.pop(key, None)
        saved.restore(bad, keep_old)
        return True

    def _over_live(self, live_table: dict, saved_table: dict, pending_table: dict, key: Any, numel: int,
                   device: torch.device, transaction: ResidualTransaction | None) -> LeanTensor | None:
        """``key``'s live lean store in ``live_table`` (residuals or velocities), to be overwritten
        with the next one, once its codes are saved in ``transaction``'s loan (in ``saved_table``:
        the commit copies them back where the step is judged bad); a store of zeros where it has
        none of ``numel`` elements on ``device`` (the first step: zero is what it owed).  ``None`` where
        the next one goes to a pending store instead: no loan, or no room left in it."""
        loan = transaction.loan if transaction is not None else None
        if loan is None:
            return None
        live = live_table.get(key)
        fresh = not isinstance(live, LeanTensor) or live.numel != numel or live.device != device
        if fresh:
            live = LeanTensor(self.storage, numel, device)
        if key not in saved_table:   # stored twice before the verdict: the first save keeps the old codes
            saved = loan.save(live.tensors())
            if saved is None:
                return None
            saved_table[key] = saved
        if fresh:
            live_table[key] = live
        pending_table.pop(key, None)   # a pending store held from a step without a loan: not needed now
        return live

    def _release_open(self, key: Any) -> None:
        """Drop ``key``'s open buffer: back to the pool, unless it is the caller's scratch input."""
        buf = self._open.pop(key, None)
        if key in self._borrowed:
            self._borrowed.discard(key)
        elif buf is not None:
            self._work.give(buf)

    def _next_seed(self, key: Any) -> int:
        self._stores += 1
        return mix_seed(self.seed, _rank(), stable_hash(key), self._stores)

    def _slot(self, table: dict, key: Any, like: torch.Tensor) -> torch.Tensor:
        r = table.get(key)
        if r is None or r.numel() != like.numel() or r.device != like.device:
            if r is not None:
                log.debug("error feedback: key %r changed size; buffer reset", key)
            r = table[key] = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
        elif r.shape != like.shape:
            r = table[key] = r.view(like.shape)
        return r

    def compensate(self, tensor: torch.Tensor, key: Any, *, scale: float = 1.0) -> torch.Tensor:
        """``x + beta * residual(key)`` in fp32, shaped like ``tensor``, where ``x`` is
        ``tensor * scale`` or, with momentum correction, the pending velocity
        ``m·u + clip(tensor * scale)``.

        Written into the key's pending buffer (no allocation after the first call):
        valid until the next ``compensate`` / ``compress`` of the same key.  Pair it
        with :meth:`stage` (the residual of what was sent) and a commit.

        Args:
            tensor: the input.
            key: the residual's key.
            scale: the input's factor, folded into the compensation pass (as in :meth:`compress`).
        """
        tensor, scale = self._scaled(tensor, scale)
        if self.momentum:
            return self._add_residual(self._accumulate(tensor, key, scale), key)
        return self._add_residual(tensor, key, scale)

    # -- the input scale (a hook's 1/P), folded into the first pass -----------
    def _scaled(self, tensor: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
        """``(tensor, scale)`` to compensate: ``scale`` folded into the compensation pass for fp32
        input, applied at once (an allocating multiply) for other dtypes and with ``clip``.

        The folded ``scale`` is rounded to fp32 and ``tensor * scale`` is rounded on its own before
        the residual is added: fp32 results are bitwise those of ``tensor.mul_(scale)`` followed by
        the compress, except on the generic (unfused) path with a scale that is not a power of two,
        which keeps that separate multiplication, and except for subnormal products where the
        generic path folds a power-of-two scale into one ``torch.add``."""
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise ValueError(f"scale must be a finite number, got {scale!r}")
        if scale == 1.0:
            return tensor, 1.0
        if tensor.dtype != torch.float32 or (self.momentum and self.clip is not None):
            return tensor * scale, 1.0
        return tensor, float(scale)

    def _live(self, key: Any, like: torch.Tensor) -> torch.Tensor | None:
        """The live residual of ``key`` in fp32 shaped like ``like`` (decoded into a new tensor
        with lean storage), or ``None`` when it has none (or one of another size or device: a
        zero residual)."""
        live = self._residuals.get(key)
        if live is None or _numel(live) != like.numel() or live.device != like.device:
            return None
        if isinstance(live, LeanTensor):
            return _thread_decoded(self._decoded, live).view(like.shape)
        return live if live.shape == like.shape else live.view(like.shape)

    def _add_residual(self, tensor: torch.Tensor, key: Any, scale: float = 1.0,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        pend = self._pending_buf(key, tensor) if out is None else out.view(tensor.shape)
        live = self._live(key, tensor)
        if live is None:
            if scale == 1.0:
                pend.copy_(tensor)
            else:
                torch.mul(tensor, scale, out=pend)
        elif scale == 1.0:
            torch.add(tensor, live, alpha=self.beta, out=pend)
        elif self.beta == 1.0 and _power_of_two(scale):  # one pass: scale * tensor is exact
            torch.add(live, tensor, alpha=scale, out=pend)
        else:  # the multiplication rounded on its own, as a separate mul_ would
            torch.mul(tensor, scale, out=pend)
            pend.add_(live, alpha=self.beta)
        return pend

    def commit(self, key: Any, bad: torch.Tensor | None = None) -> None:
        """Live residual (and velocity) of ``key`` := pending, except where ``bad`` (0-d bool) is set.

        On CUDA one ``torch.where`` decides on the device.  On the CPU the flag is
        already in host memory (reading it synchronizes nothing), so the two buffers
        are swapped instead of copied, the velocity's too: the step costs no pass over
        the residual or the velocity.
        """
        if isinstance(key, _Dense):
            self._commit_dense(key.name, bad)
            return
        if isinstance(key, _VelocityOnly):
            self._commit_velocity(key.key, bad, _host_verdict(bad))
            return
        keep_old = _host_verdict(bad)
        if self._restore_saved(self._saved, key, bad, keep_old):   # stored over the live residual
            if self.momentum:
                self._commit_velocity(key, bad, keep_old)
            return
        pend = self._pending[key] if self.hold_pending else self._pending.pop(key)
        if isinstance(pend, LeanTensor):
            self._commit_lean(self._residuals, self._pending, key, pend, bad, keep_old)
        else:
            live = self._slot(self._residuals, key, pend)
            if keep_old is None:
                torch.where(bad, live, pend, out=live)
            elif not keep_old:
                self._residuals[key] = pend
                if self.hold_pending:
                    self._pending[key] = live
        if self.momentum:
            self._commit_velocity(key, bad, keep_old, None if isinstance(pend, LeanTensor) else pend.shape)

    def _commit_velocity(self, key: Any, bad: torch.Tensor | None, keep_old: bool | None,
                         shape: torch.Size | None = None) -> None:
        """Live velocity of ``key`` := pending, except where ``bad`` (:meth:`commit`'s rule: swapped
        on the host, ``torch.where`` for a device flag, ``keep_old`` its host verdict)."""
        if self.storage != "fp32":
            self._commit_lean_velocity(key, bad, keep_old)
            return
        vbuf = self._velocity_pending[key]
        vpend = vbuf[:-1] if shape is None else vbuf[:-1].view(shape)
        if keep_old is None:
            vlive = self._slot(self._velocity, key, vpend)
            torch.where(bad, vlive, vpend, out=vlive)
        elif not keep_old:  # swapped: the live velocity becomes a view of the pending buffer
            old = self._velocity.get(key)
            self._velocity[key] = vpend
            spare = old._base if old is not None else None   # the (numel + 1) buffer it views, if any
            if spare is not None and spare.numel() == vbuf.numel() and spare.data_ptr() == old.data_ptr():
                self._velocity_pending[key] = spare
            else:  # the first swap: the next compensate allocates a pending buffer
                del self._velocity_pending[key]
        if not self.hold_pending:   # only the keys in flight hold a pending velocity
            self._velocity_pending.pop(key, None)

    def _commit_lean_velocity(self, key: Any, bad: torch.Tensor | None, keep_old: bool | None) -> None:
        """:meth:`_commit_velocity` with a lean storage: the sealed pending store becomes the live
        one (swapped on the host, ``keep_where`` for a device flag)."""
        self._seal_velocity(key)   # a velocity written but not sealed yet (nothing masked it)
        if self._restore_saved(self._vsaved, key, bad, keep_old):   # stored over the live velocity
            return
        pend = self._velocity_sealed[key] if self.hold_pending else self._velocity_sealed.pop(key)
        self._commit_lean(self._velocity, self._velocity_sealed, key, pend, bad, keep_old)

    def _commit_lean(self, live_table: dict, pending_table: dict, key: Any, pend: LeanTensor,
                     bad: torch.Tensor | None, keep_old: bool | None) -> None:
        """``live_table[key]`` := ``pend`` (a lean store) except where ``bad``: ``keep_where`` for a
        device flag, else swapped on the host (the old live store kept as the next pending one
        when pending stores are held)."""
        live = live_table.get(key)
        if live is None or live.numel != pend.numel or live.device != pend.device:
            live = live_table[key] = LeanTensor(self.storage, pend.numel, pend.device)
        if keep_old is None:
            live.keep_where(bad, pend)
        elif not keep_old:
            live_table[key] = pend
            if self.hold_pending:
                pending_table[key] = live

    def _seal_velocity(self, key: Any, transaction: ResidualTransaction | None = None) -> None:
        """Lean storage: store ``key``'s new velocity (its fp32 working buffer, then back to the
        pool) as its pending velocity (over the live one with ``transaction``'s loan).  A no-op
        with fp32 storage or when none is open."""
        if self.storage == "fp32":
            return
        buf = self._velocity_pending.get(key)
        if buf is None:
            return
        self._encode_velocity(key, buf[:-1], transaction)
        self._drop_velocity_buffer(key)

    def _drop_velocity_buffer(self, key: Any) -> None:
        """Forget ``key``'s fp32 new-velocity buffer (with a lean storage, back to the pool)."""
        buf = self._velocity_pending.pop(key, None)
        if buf is not None and self.storage != "fp32":
            self._work.give(buf)

    def _encode_velocity(self, key: Any, src: torch.Tensor, transaction: ResidualTransaction | None = None) -> None:
        """Lean storage: ``key``'s pending velocity := ``src`` (fp32, flat) stored; with
        ``transaction``'s loan stored over the live one (its old codes saved there), which
        ``_velocity_sealed`` then names until the commit."""
        self._next_store(self._velocity, self._vsaved, self._velocity_sealed, key, src.numel(), src.device,
                         transaction, alias=True).encode(src, self._next_vseed(key))

    def _next_vseed(self, key: Any) -> int:
        """The next lean velocity store's seed (a count of its own, apart from the residuals')."""
        self._vstores += 1
        return mix_seed(self.seed, _rank(), stable_hash(key), self._vstores, _VELOCITY_SEED)

    def _decoded_velocity(self, key: Any, numel: int, device: torch.device) -> torch.Tensor | None:
        """The live velocity of ``key`` in fp32 (flat, ``numel``): the tensor itself, or a lean one
        decoded into this thread's buffer; ``None`` for none (or one of another size or device)."""
        live = self._velocity.get(key)
        if live is None or _numel(live) != numel or live.device != device:
            return None
        return _thread_decoded(self._vdecoded, live) if isinstance(live, LeanTensor) else live

    _apply = commit  # the name before the public protocol

    def rollback(self, key: Any) -> None:
        """Drop ``key``'s pending update: the live buffers keep their values (a residual stored
        over its live one gets its saved codes back; the pending ones are overwritten by the next
        compensate)."""
        self._release_open(key)
        self._restore_saved(self._saved, key, None, True)
        self._restore_saved(self._vsaved, key, None, True)

    # -- plain momentum of the tensors that bypass compression ----------------
    def dense_momentum(self, tensor: torch.Tensor, name: str,
                       transaction: ResidualTransaction | None = None) -> None:
        """Plain SGD momentum for a tensor sent dense (a hook's biases and small parameters):
        pending ``v = m·v + tensor`` (fp32), then ``tensor := v`` in place; committed like a
        residual (staged in ``transaction``, kept where the step saw a NaN/inf).

        With momentum correction the optimizer runs without momentum, so the parameters
        that bypass error feedback get theirs here, on the averaged gradient (the same on
        every rank).  A no-op without ``momentum``.
        """
        if not self.momentum:
            return
        n = tensor.numel()
        pend = self._dense_pending.get(name)
        if pend is None or pend.numel() != n or pend.device != tensor.device:
            pend = self._dense_pending[name] = torch.empty(n, dtype=torch.float32, device=tensor.device)
        live = self._dense_velocity.get(name)
        if live is None or live.numel() != n:
            pend.copy_(tensor.reshape(-1))
        else:
            torch.add(tensor.reshape(-1), live, alpha=self.momentum, out=pend)
        tensor.view(-1).copy_(pend)
        if transaction is not None:
            transaction.stage(self, _Dense(name))
        else:
            self._commit_dense(name, None)

    def _commit_dense(self, name: str, bad: torch.Tensor | None) -> None:
        pend = self._dense_pending[name]
        live = self._dense_velocity.get(name)
        if live is None or live.numel() != pend.numel():
            live = self._dense_velocity[name] = torch.zeros_like(pend)
        torch.where(bad, live, pend, out=live) if bad is not None else live.copy_(pend)

    def dense_velocities(self) -> dict[str, torch.Tensor]:
        """The live plain-momentum velocities of the dense tensors, by name (not copies)."""
        return self._dense_velocity

    def load_dense_velocities(self, velocities: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`dense_velocities` (copied to fp32)."""
        self._dense_velocity = {str(k): v.float().clone() for k, v in velocities.items()}
        self._dense_pending.clear()

    def velocity(self, key: Any) -> torch.Tensor | None:
        """The stored momentum-correction velocity for ``key`` in fp32 (the live buffer with fp32
        storage, a decoded flat copy with a lean one), or ``None``."""
        live = self._velocity.get(key)
        return live.decode() if isinstance(live, LeanTensor) else live

    def _velocity_slots(self, tensor: torch.Tensor, key: Any, numel: int | None = None,
                        decode: bool = True) -> tuple[torch.Tensor | None, float, torch.Tensor]:
        """``(live, momentum, new)`` for ``key``: its live velocity in fp32 (``None``: fresh, a zero
        one; a lean one decoded into this thread's buffer, or left out with ``decode=False``) and
        the pending buffer's first ``numel`` entries (default ``tensor``'s), where the step's
        velocity goes."""
        n = tensor.numel() if numel is None else numel
        buf = self._velocity_pending.get(key)
        if buf is None or buf.numel() != n + 1 or buf.device != tensor.device:
            if self.storage == "fp32":
                buf = torch.zeros(n + 1, dtype=torch.float32, device=tensor.device)
            else:   # a working buffer until sealed
                if buf is not None:
                    self._work.give(buf)
                buf = self._work.take(n + 1, torch.float32, tensor.device)
                buf[-1] = 0.0
            self._velocity_pending[key] = buf
        live = self._velocity.get(key)
        if live is None or _numel(live) != n or live.device != tensor.device:
            live = None
        elif isinstance(live, LeanTensor):
            live = self._decoded_velocity(key, n, tensor.device) if decode else None
        return live, self.momentum, buf[:n]

    def velocity_into(self, tensor: torch.Tensor, key: Any, numel: int, offset: int = 0, *,
                      scale: float = 1.0) -> None:
        """Momentum correction of a part of ``key``'s input that is sent as it is (no residual: an
        exact codec's, e.g. ``"auto"``'s dense choice on DDP's own all_reduce): ``tensor :=
        m·u + tensor·scale`` in place, where ``u`` is the live velocity's entries ``offset ..
        offset + tensor.numel()`` of ``numel``, written to the pending velocity too (the same
        fp32 operations as :meth:`compress`'s, element by element).  Call it for every part of the
        key, then :meth:`stage_velocity` once.

        Args:
            tensor: fp32, contiguous: the part of the input.
            key: the residual's key.
            numel: the key's whole input size.
            offset: where ``tensor`` starts in it.
            scale: the input's factor (a hook's ``1/P``).
        """
        if not self.momentum or self.clip is not None:
            raise RuntimeError("velocity_into: needs momentum correction without clip")
        n = tensor.numel()
        if tensor.dtype != torch.float32 or not tensor.is_contiguous() or not 0 <= offset <= numel - n:
            raise ValueError(f"velocity_into: an fp32 contiguous part inside {numel} elements, got "
                             f"{tensor.dtype} of {n} at {offset}")
        lean = self._velocity.get(key)
        if isinstance(lean, LeanTensor):   # decode only this part's span (int8 on the CPU: in the pass)
            _, m, new = self._velocity_slots(tensor, key, numel, decode=False)
            part = new[offset:offset + n]
            fits = lean.numel == numel and lean.device == tensor.device
            if fits and lean.velocity_into(tensor.view(-1), float(scale), m, offset, part, also=tensor.view(-1)):
                return   # the part and the pending velocity written in one pass
            live = lean.decode_span(offset, offset + n) if fits else None
        else:
            live, m, new = self._velocity_slots(tensor, key, numel)
            live = None if live is None else live.view(-1)[offset:offset + n]
            part = new[offset:offset + n]
        accumulate_velocity(tensor.view(-1), float(scale), live, m, part)
        tensor.view(-1).copy_(part)

    def velocity_unit(self, buf: torch.Tensor, parts: list[tuple[int, int]], key: Any, numel: int, *,
                      scale: float = 1.0, transaction: ResidualTransaction | None = None) -> bool | None:
        """:meth:`velocity_into` for every part of ``key``'s input, then :meth:`stage_velocity`, in
        one pass where the storage allows it (int8 on the CPU with numba: the live velocity decoded,
        the parts written and the pending velocity stored a block at a time, bitwise what the part
        by part calls give, with no fp32 buffer of the input's size).  Returns whether the new
        velocity holds a NaN/inf (read in that pass, on the host); ``None`` elsewhere, nothing
        touched (the caller goes part by part).

        Args:
            buf: fp32, contiguous: the buffer holding the parts (a DDP bucket).
            parts: ``(offset, numel)`` of each part in ``buf``, in the input's order (``numel`` in all).
            key: the residual's key.
            numel: the key's whole input size.
            scale: the input's factor (a hook's ``1/P``).
            transaction: where the velocity is staged (``None``: committed at once).
        """
        if not self.momentum or self.clip is not None:
            raise RuntimeError("velocity_unit: needs momentum correction without clip")
        if sum(n for _, n in parts) != numel:
            raise ValueError(f"velocity_unit: parts of {sum(n for _, n in parts)} elements for an input of {numel}")
        live = self._velocity.get(key)
        if self.storage != "int8" or key in self._velocity_pending or not (live is None or isinstance(live, LeanTensor)):
            return None   # another storage; a part-by-part write open; an fp32 velocity (loaded)
        if live is not None and (live.numel != numel or live.device != buf.device):
            live = None    # as _velocity_slots has it: a fresh velocity
        if velocity_mode(self.storage, buf.device, buf) is None:
            return None
        # with transaction's loan: stored over the live velocity (the kernel reads each chunk of it
        # before it writes that chunk), its old codes saved in the loan
        pend = self._next_store(self._velocity, self._vsaved, self._velocity_sealed, key, numel, buf.device,
                                transaction, alias=True)
        bad = pend.store_velocity(buf, parts, float(scale), self.momentum, live, self._next_vseed(key))
        self.stage_velocity(key, transaction)   # sealed already: no working buffer was opened
        return bool(bad)

    def stage_velocity(self, key: Any, transaction: ResidualTransaction | None = None) -> None:
        """Stage ``key``'s pending velocity (written by :meth:`velocity_into`) in ``transaction``, or
        commit it at once; its residual is left as it is."""
        self._seal_velocity(key, transaction)
        if transaction is not None:
            transaction.stage(self, _VelocityOnly(key))
        else:
            self.commit(_VelocityOnly(key))

    def _accumulate(self, tensor: torch.Tensor, key: Any, scale: float = 1.0) -> torch.Tensor:
        """Pending velocity ``m * u + clip(g)`` (fp32, ``tensor``'s shape), ``g = tensor * scale``
        (``scale`` folded: 1 with ``clip``, see :meth:`_scaled`); committed by :meth:`_apply`."""
        live, m, new = self._velocity_slots(tensor, key)
        g = tensor
        if self.clip is not None:  # on the device: scale = min(1, clip / ||g||) (NaN norm -> NaN)
            norm = torch.linalg.vector_norm(tensor, dtype=torch.float32)
            g = tensor * torch.clamp(self.clip / norm, max=1.0)
        return accumulate_velocity(g, scale, live, m, new)

    # -- the fused lanes' protocol (collectives/steady*.py run their own kernels) ----------
    def open_fused(self, tensor: torch.Tensor, key: Any, *, scratch: bool = False,
                   scale: float = 1.0, transaction: ResidualTransaction | None = None) -> "FusedSlots":
        """What a kernel that compensates, encodes and writes the next residual in one pass needs
        for ``key``: the input and its folded ``scale``, the live residual in fp32
        (``None``: zero), the fp32 buffer for the next residual, and momentum correction's velocity
        slots (``None`` without).  Close it with :meth:`close_fused`.

        Args:
            tensor: the input (fp32).
            key: the residual's key.
            scratch: the caller overwrites ``tensor`` after :meth:`close_fused` (it is the call's
                output): with a lean ``storage`` the compensation is then done in ``tensor``
                (the live residual decoded a chunk at a time, momentum correction's velocity
                added first) and the kernel writes the next residual over it, so no fp32 buffer
                of the key's size is kept (the slots: scale 1, no live residual, no velocity).
            scale: the input's factor (the hook's ``1/P``), folded into the kernel's pass.
            transaction: the one :meth:`close_fused` will stage in (its loan may take the live
                velocity's old codes when the new one is stored at once, on a scratch input).
        """
        x, scale = self._scaled(tensor, scale)
        if scratch and self.storage != "fp32" and x.dtype == torch.float32 and x.is_contiguous():
            return self._open_in_place(x, key, scale, transaction)
        velocity = self._velocity_slots(x, key) if self.momentum else None
        return FusedSlots(x, scale, self._live(key, x), self._pending_buf(key, x), velocity)

    def _open_in_place(self, x: torch.Tensor, key: Any, scale: float,
                       transaction: ResidualTransaction | None = None) -> "FusedSlots":
        """:meth:`open_fused` on a scratch input with lean storage: ``x := (m*u +) x*scale +
        beta*e`` in place; ``x`` is then the buffer of the next residual (sealed from it)."""
        if self.momentum and self.clip is None and self.storage != "fp32":
            self._velocity_in_place(x, key, scale, transaction)   # x := m*u + g, stored as the pending velocity
            scale = 1.0
        elif self.momentum:
            x.copy_(self._accumulate(x, key, scale))   # the pending velocity m*u + g
            scale = 1.0
        live = self._residuals.get(key)
        if live is not None and live.numel == x.numel() and live.device == x.device:
            live.add_to(x.view(-1), self.beta, pre=scale)   # x * scale rounded, then the residual added
        elif scale != 1.0:
            x.mul_(scale)
        self._release_open(key)
        self._open[key] = x
        self._borrowed.add(key)
        return FusedSlots(x, 1.0, None, x, None)

    def _velocity_in_place(self, x: torch.Tensor, key: Any, scale: float,
                           transaction: ResidualTransaction | None = None) -> None:
        """Lean storage: ``x := m*u + x*scale`` in place (:func:`accumulate_velocity`'s operations,
        the live velocity decoded a chunk at a time) and stored at once as the pending velocity
        (momentum factor masking then zeroes the stored codes): no fp32 buffer of the key's size."""
        flat = x.view(-1)
        live = self._velocity.get(key)
        if live is None or live.numel != flat.numel() or live.device != flat.device:
            if scale != 1.0:
                flat.mul_(scale)
        elif not live.velocity_into(flat, scale, self.momentum, 0, flat):   # int8 on the CPU: one pass
            if scale != 1.0:
                flat.mul_(scale)
            live.add_to(flat, self.momentum)
        self._drop_velocity_buffer(key)
        self._encode_velocity(key, flat, transaction)

    def close_fused(self, key: Any, bad: torch.Tensor, transaction: ResidualTransaction | None = None,
                    sent: Any = None, sent_all: bool = False) -> None:
        """After the kernel of :meth:`open_fused` wrote the next residual: store it, apply momentum
        factor masking (at the ``sent`` indices, or everywhere with ``sent_all``), and stage it in
        ``transaction`` (else commit at once) under the local NaN/inf flag ``bad`` (0-d bool)."""
        self._seal(key, transaction)
        self._seal_velocity(key, transaction)
        if self.momentum and self.masking:
            if sent_all:
                self._zero_pending_velocity(key)
            elif sent is not None and len(sent):
                self.mask_sent(key, torch.as_tensor(sent))
        if transaction is not None:
            transaction.stage(self, key, bad)
        else:
            self.commit(key, bad)

    def mask_sent(self, key: Any, indices: torch.Tensor) -> None:
        """Momentum factor masking: zero ``key``'s pending velocity at ``indices`` (a padding
        index ``numel`` lands in the buffer's extra slot, zeroed too; a lean store's codes are
        zeroed there once it is sealed)."""
        if self.storage != "fp32":
            self._seal_velocity(key)
            self._velocity_sealed[key].zero_at(indices)
            return
        buf = self._velocity_pending[key]
        buf.index_fill_(0, indices.to(buf.device).long(), 0.0)
        buf[-1] = 0.0

    def _zero_pending_velocity(self, key: Any) -> None:
        """Momentum factor masking when every coordinate was sent: the pending velocity is zero."""
        if self.storage != "fp32":
            self._seal_velocity(key)
            self._velocity_sealed[key].zero_()
        else:
            self._velocity_pending[key].zero_()

    def _mask_velocity(self, key: Any, payload: Payload) -> None:
        """Momentum factor masking: zero the pending velocity at the sent indices
        (padding slots point at ``numel``, the buffer's extra entry)."""
        if self.compressor.aggregation == "sparse" and payload.tensors[0].numel():
            self.mask_sent(key, payload.tensors[0])

    def _decode_buffer(self, payload: Payload) -> torch.Tensor:
        """A reused buffer for ``decompress(payload, out=)`` (grown to the largest key)."""
        slot = (payload.dtype, payload.device)
        buf = self._decode.get(slot)
        if buf is None or buf.numel() < payload.numel:
            buf = self._decode[slot] = torch.empty(payload.numel, dtype=payload.dtype, device=payload.device)
        return buf[:payload.numel]

    # -- compress ----------------------------------------------------------
    def compress(self, tensor, *, step=0, key=0, generator=None,
                 transaction: ResidualTransaction | None = None, scale: float = 1.0,
                 scratch: bool = False) -> Payload:
        """The payload of ``tensor * scale`` plus the residual of ``key`` (see the class).

        Args:
            tensor: the input.
            step: the training step (seeds).
            key: names the tensor's residual.
            generator: a stochastic inner compressor's randomness.
            transaction: stages the residual update for a later commit (else committed at once).
            scale: the input's factor, folded into the compensation pass (a DDP hook's ``1/P``):
                no pass of its own for fp32 input.
            scratch: the caller does not read ``tensor`` after the call (a collective whose
                output overwrites it, FSDP2's reduce-scatter input): with a lean ``storage``
                the compensation and the next residual are computed in it, so no fp32 buffer
                of the key's size is kept (gather kinds still decode the payload into one).
        """
        return self._compress(tensor, step, key, generator, transaction, fixed=False, scale=scale,
                              scratch=scratch)

    def compress_fixed(self, tensor, *, step=0, key=0, generator=None,
                       transaction: ResidualTransaction | None = None, scale: float = 1.0,
                       scratch: bool = False) -> Payload:
        """As :meth:`compress` with the inner compressor's fixed-size wire format
        (:meth:`Compressor.compress_fixed`): what the collectives send."""
        return self._compress(tensor, step, key, generator, transaction, fixed=True, scale=scale, scratch=scratch)

    def compress_whole(self, tensor: torch.Tensor, codec: Compressor, *, step: int = 0, key: Any = 0,
                       transaction: ResidualTransaction | None = None, scale: float = 1.0,
                       scratch: bool = False) -> Payload:
        """The whole compensated tensor (``x + beta * residual(key)``, with momentum correction as
        in :meth:`compensate`) compressed by ``codec``, a deterministic ``"gather"`` compressor
        other than this one's (a sparsifier's warm-up sends it block-quantized rather than a
        selection no smaller): ``codec``'s fixed-size payload, and ``key``'s pending residual
        keeps what ``codec`` did not send, as for this feedback's own compressor.  With momentum
        factor masking every coordinate counts as sent: the pending velocity is zeroed.  Staged in
        ``transaction`` when given, else committed at once; the payload's ``nonfinite`` is the
        local NaN/inf flag."""
        if getattr(codec, "aggregation", None) != "gather" or not getattr(codec, "deterministic", False):
            raise TypeError(f"compress_whole: codec must be a deterministic gather compressor, got {codec!r}")
        return self._compress(tensor, step, key, None, transaction, fixed=True, inner=codec, scale=scale,
                              scratch=scratch)

    def _compress(self, tensor, step, key, generator, transaction, fixed: bool, inner=None,
                  scale: float = 1.0, scratch: bool = False) -> Payload:
        self.check_input(tensor)
        x, scale = self._scaled(tensor, scale)
        whole = inner is not None   # another codec over every coordinate (:meth:`compress_whole`)
        inner = inner if whole else self.compressor
        if (scratch and self.storage != "fp32" and x is tensor and x.dtype == torch.float32
                and x.is_contiguous()):   # compensated in the caller's input, the next residual over it
            return self._compress_generic(self._open_in_place(x, key, scale, transaction).x, inner, step, key,
                                          generator, transaction, fixed, whole)
        velocity = {}
        if self.momentum:
            if self.clip is None and inner.fuses_velocity(x, fixed):   # the velocity joins the fused pass
                velocity = {"velocity": self._velocity_slots(x, key)}
            else:
                x, scale = self._accumulate(x, key, scale), 1.0
        if inner.fuses_feedback(x, fixed):  # compensate + encode + next residual, one pass
            payload, finite = inner.compress_feedback(x, self._live(key, x), self.beta,
                                                      self._pending_buf(key, x),
                                                      step=step, key=key, fixed=fixed, scale=scale, **velocity,
                                                      **({} if inner.deterministic else {"generator": generator}))
            return self._stage(key, payload, ~finite, transaction, whole)
        return self._compress_generic(self._add_residual(x, key, scale), inner, step, key, generator, transaction,
                                      fixed, whole, tensor.dtype)

    def _compress_generic(self, c, inner, step, key, generator, transaction, fixed: bool, whole: bool,
                          dtype: torch.dtype = torch.float32) -> Payload:
        """Compress the compensated ``c`` (fp32; ``dtype``: the input's) with ``inner``, leave the
        next residual in ``c`` and stage it."""
        if isinstance(inner, SparseCompressor) and dtype == torch.float32:
            # one fused pass: the selection leaves c with the kept entries zeroed (the residual)
            run = inner.compress_fixed_with_residual if fixed else inner.compress_with_residual
            # a selection that always keeps NaN/inf first (topk) shows them in its values:
            # the verdict reads k values instead of a pass over c
            local_bad = None if inner.keeps_nonfinite else nonfinite_flag(c)
            payload = run(c, c, step=step, key=key)
            if local_bad is None:
                local_bad = nonfinite_flag(payload.tensors[1])
        else:
            local_bad = nonfinite_flag(c)
            src = c if dtype == torch.float32 else c.to(dtype)
            run = inner.compress_fixed if fixed else inner.compress
            payload = run(src, step=step, key=key, generator=generator)
            payload = _detach_from(payload, c)
            if src is c and inner.exact:   # sent as it is: nothing is left (no decode buffer)
                c.zero_()
            else:
                c.sub_(inner.decompress(payload, out=self._decode_buffer(payload)).reshape(c.shape).float())
            if inner.aggregation == "lowrank":   # a finite c whose factors overflowed: a non-finite residual
                local_bad = local_bad | exact_nonfinite_flag(c)
        return self._stage(key, payload, local_bad, transaction, whole)

    def _stage(self, key, payload, local_bad, transaction, whole: bool = False) -> Payload:
        self._seal(key, transaction)
        self._seal_velocity(key, transaction)
        if self.momentum and self.masking:
            if whole:
                self._zero_pending_velocity(key)
            else:
                self._mask_velocity(key, payload)
        if transaction is not None:
            transaction.stage(self, key, local_bad)
        else:
            self.commit(key, local_bad)
        return dataclasses.replace(payload, nonfinite=local_bad)

    def send_whole(self, tensor: torch.Tensor, key: Any, out: torch.Tensor,
                   transaction: ResidualTransaction | None = None, scale: float = 1.0,
                   scratch: bool = False) -> torch.Tensor:
        """Write the whole compensated tensor ``x + beta * residual(key)`` (``x`` with momentum
        correction as in :meth:`compensate`) into ``out`` (``tensor.numel()`` elements), for a
        caller that sends it uncompressed.  ``out`` in fp32: the key's pending residual is zero
        and, with momentum factor masking, so is its pending velocity (every coordinate was
        sent).  ``out`` in a narrower float dtype (bf16, fp16): ``out`` gets the compensated
        tensor rounded to it and the pending residual keeps the rounding error, as for any
        other compressor.  Staged in ``transaction`` when given, else committed at once; a
        non-finite input keeps the old residual.  Returns the local non-finite flag (0-d bool).
        ``scale`` and ``scratch`` as for :meth:`compress`; with a lean ``storage`` no fp32 buffer of
        the key's size is kept for fp32 ``out`` (nor for a narrower one with ``scratch``)."""
        self.check_input(tensor)
        if out.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"send_whole: out must be fp32, fp16 or bf16, got {out.dtype}")
        x, scale = self._scaled(tensor, scale)
        exact = out.dtype == torch.float32
        lean = (self.storage != "fp32" and x.dtype == torch.float32 and x.is_contiguous() and out.is_contiguous()
                and (exact or (scratch and x is tensor)))
        if lean:   # compensated in out (exact) or in the input (scratch): no buffer of the key's size
            c = self._open_in_place(out.view(x.shape).copy_(x) if exact else x, key, scale, transaction).x
            if not exact:
                out.view(c.shape).copy_(c)   # the rounded message
                c.sub_(out.view(c.shape))    # the next residual: compensated - what was sent
            return self._stage_whole(key, nonfinite_flag(c if exact else out), transaction, zero=exact)
        tensor = x
        dst = out if exact else None   # narrower: compensate into the pending slot, then round
        if self.momentum:
            dst = self._add_residual(self._accumulate(tensor, key, scale), key, out=dst)
        else:
            dst = self._add_residual(tensor, key, scale, out=dst)
        if exact:
            self._pending_buf(key, tensor).zero_()
        else:
            out.view(dst.shape).copy_(dst)           # the rounded message
            dst.sub_(out.view(dst.shape))            # pending := compensated - what was sent
        return self._stage_whole(key, nonfinite_flag(dst if exact else out), transaction)

    def _stage_whole(self, key: Any, bad: torch.Tensor, transaction: ResidualTransaction | None,
                     zero: bool = False) -> torch.Tensor:
        """:meth:`send_whole`'s end: seal (``zero``: a lean store of zeros, nothing owed) and stage
        (or commit) the next residual, every coordinate sent (masking zeroes the pending velocity);
        returns ``bad``."""
        if zero:
            src = self._open[key]
            self._release_open(key)
            pend = self._next_store(self._residuals, self._saved, self._pending, key, src.numel(), src.device,
                                    transaction)
            for t in pend.tensors():
                t.zero_()
        else:
            self._seal(key, transaction)
        self._seal_velocity(key, transaction)
        if self.momentum and self.masking:
            self._zero_pending_velocity(key)
        if transaction is not None:
            transaction.stage(self, key, bad)
        else:
            self.commit(key, bad)
        return bad

    def stage(self, key: Any, compensated: torch.Tensor, sent: torch.Tensor,
              transaction: ResidualTransaction | None = None) -> None:
        """Pending residual of ``key`` := ``compensated - sent`` (what :meth:`compensate`
        returned minus what was sent), kept as it was where either is non-finite; staged in
        ``transaction`` when given, else committed at once."""
        pend = self._pending_buf(key, compensated)
        bad = nonfinite_flag(compensated) | nonfinite_flag(sent)
        torch.sub(compensated.reshape(pend.shape).float(), sent.reshape(pend.shape).float(), out=pend)
        self._seal(key, transaction)
        if transaction is not None:
            transaction.stage(self, key, bad)
        else:
            self.commit(key, bad)

    update = stage  # the name before the public protocol

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.compressor.decompress(payload, out=out)

    def take(self, key: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Remove ``key``'s live residual and velocity and return them (fp32, or ``None``):
        what the key still owes, for a caller that moves it elsewhere (``commpress.auto``)."""
        self._pending.pop(key, None)
        self._saved.pop(key, None)
        self._vsaved.pop(key, None)
        self._release_open(key)
        self._drop_velocity_buffer(key)
        self._velocity_sealed.pop(key, None)
        live = self._residuals.pop(key, None)
        u = self._velocity.pop(key, None)
        return ((live.decode() if isinstance(live, LeanTensor) else live),
                (u.decode() if isinstance(u, LeanTensor) else u))

    def absorb(self, key: Any, residual: torch.Tensor | None, velocity: torch.Tensor | None = None) -> None:
        """Add ``residual`` (and ``velocity``, with momentum correction) to ``key``'s live
        buffers, creating them: the next compress of ``key`` sends it (``beta`` applies).
        Shapes follow the next input (same numel); ``ValueError`` when a velocity comes
        without momentum correction (it would be lost)."""
        if velocity is not None and not self.momentum:
            raise ValueError("ErrorFeedback.absorb: a velocity needs momentum correction (momentum > 0)")
        for table, t in ((self._residuals, residual), (self._velocity, velocity)):
            if t is None:
                continue
            live = table.get(key)
            src = t.detach().float()
            if isinstance(live, LeanTensor) and live.numel == src.numel() and live.device == src.device:
                live.encode(live.decode().add_(src.reshape(-1)), self._next_seed(key))
                continue
            if self.storage != "fp32":
                lean = table[key] = LeanTensor(self.storage, src.numel(), src.device)
                lean.encode(src, self._next_seed(key))
                continue
            if live is None or live.numel() != src.numel() or live.device != src.device:
                table[key] = src.clone()
            else:
                live.add_(src.view(live.shape))

    # -- state ---------------------------------------------------------------
    def reset(self) -> None:
        """Forget every residual (the inner compressor's state is kept)."""
        self._residuals.clear()
        self._pending.clear()
        self._open.clear()
        self._borrowed.clear()
        self._saved.clear()
        self._vsaved.clear()
        self._work.clear()
        self._decoded.clear()
        self._velocity.clear()
        self._velocity_pending.clear()
        self._velocity_sealed.clear()
        self._vdecoded.clear()
        self._dense_velocity.clear()
        self._dense_pending.clear()

    def state_dict(self) -> dict[str, Any]:
        """``{"beta", "residuals": {"keys", "tensors"}, "compressor": inner state}``, plus
        ``"momentum"`` and ``"velocities"`` (same layout) with momentum correction.  A lean
        storage adds ``"storage"``, ``"stores"`` (the rounding noise's counter) and, for int8 and
        int4, ``"residual_scales"`` (int4 also ``"residual_numel"``: two codes a byte); its
        ``"residuals"`` are the stored codes, so a resume is bitwise."""
        state = {"beta": self.beta, "compressor": self.compressor.state_dict(),
                 **self._saved_stores(self._residuals, "residuals", "residual_scales", "residual_numel")}
        if self.storage != "fp32":
            state.update(storage=self.storage, stores=self._stores)
        if self.momentum:   # lean: the stored codes, as the residuals': a resume is bitwise
            state.update(momentum=self.momentum,
                         **self._saved_stores(self._velocity, "velocities", "velocity_scales", "velocity_numel"))
            if self.storage != "fp32":
                state["velocity_stores"] = self._vstores
        return state

    def _saved_stores(self, table: dict, codes_key: str, scales_key: str, numel_key: str) -> dict[str, Any]:
        """``table``'s stores for a checkpoint: fp32 tensors, or a lean storage's codes, and for the
        blockwise storages their scales (int4 also the element counts: two codes a byte)."""
        if self.storage == "fp32":
            return {codes_key: encode_keyed(table)}
        out = {codes_key: encode_keyed({k: t.saved()[0] for k, t in table.items()})}
        if self.storage in _BLOCKWISE:
            out[scales_key] = encode_keyed({k: t.saved()[1] for k, t in table.items()})
        if self.storage == "int4":
            out[numel_key] = encode_keyed({k: torch.tensor(t.numel) for k, t in table.items()})
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.  Residuals saved with another storage are converted
        (decoded to fp32, then stored in this one's); ``ValueError`` for a malformed state."""
        keys = {"beta", "residuals", "compressor"} | ({"momentum", "velocities"} if self.momentum else set())
        saved = state.get("storage", "fp32") if isinstance(state, dict) else "fp32"
        try:
            check_storage(saved)
        except ValueError as exc:
            raise ValueError(f"error feedback state: saved {exc} (this one stores {self.storage!r})") from None
        if saved != "fp32":
            keys |= {"storage", "stores"} | ({"residual_scales"} if saved in _BLOCKWISE else set()) \
                | ({"residual_numel"} if saved == "int4" else set())
        # lean velocities (saved as codes since they are kept lean; fp32 tensors before)
        lean_velocity = self.momentum and saved != "fp32" and isinstance(state, dict) and "velocity_stores" in state
        if lean_velocity:
            keys |= {"velocity_stores"} | ({"velocity_scales"} if saved in _BLOCKWISE else set()) \
                | ({"velocity_numel"} if saved == "int4" else set())
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError(f"error feedback state must have keys {sorted(keys)}")
        residuals = _loaded_stores(state, saved, "residuals", "residual_scales", "residual_numel", "residual")
        self.compressor.load_state_dict(state["compressor"])
        self._stores = int(state.get("stores", self._stores))
        self._residuals = {k: _convert(v, self.storage, lambda: self._next_seed(k)) for k, v in residuals.items()}
        self._vstores = int(state.get("velocity_stores", self._vstores))
        velocities = (_loaded_stores(state, saved if lean_velocity else "fp32", "velocities", "velocity_scales",
                                     "velocity_numel", "velocity") if self.momentum else {})
        self._velocity = {k: _convert(u, self.storage, lambda: self._next_vseed(k)) for k, u in velocities.items()}
        self._velocity_sealed.clear()
        self._pending.clear()
        self._open.clear()
        self._borrowed.clear()
        self._saved.clear()
        self._vsaved.clear()
        self._work.clear()
        self._decoded.clear()
        self._velocity_pending.clear()

    # -- memory ----------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """Bytes this error feedback keeps alive, by kind: ``residuals`` (live), ``pending``
        (the next residuals a transaction has not committed yet, kept between steps as buffers),
        ``working`` (lean storage's fp32 buffers: the next residuals until sealed, pooled, and a
        decoded live residual per thread, each of the order of the largest key), ``velocities``
        and ``velocities_pending`` (momentum correction), ``dense_momentum`` (and its pending),
        ``decode`` (the reused decode buffers) and ``compressor`` (the inner compressor's state,
        e.g. PowerSGD's factors).  Each storage is counted once, in the first kind that holds it."""
        seen: set[int] = set()
        out: dict[str, int] = {}
        groups = {
            "residuals": self._residuals.values(), "pending": self._pending.values(),
            "working": [*(b for k, b in self._open.items() if k not in self._borrowed), *self._work.buffers(),
                        *self._decoded.values(), *self._vdecoded.values()],
            "velocities": self._velocity.values(),
            "velocities_pending": [*self._velocity_pending.values(), *self._velocity_sealed.values()],
            "dense_momentum": [*self._dense_velocity.values(), *self._dense_pending.values()],
            "decode": self._decode.values(), "compressor": _tensors_of(self.compressor.state_dict()),
        }
        for kind, items in groups.items():
            total = 0
            for t in items:
                for tensor in (t.tensors() if isinstance(t, LeanTensor) else (t,)):
                    total += _storage_bytes(tensor, seen)
            out[kind] = total
        return out

    def memory_bytes(self) -> int:
        """The sum of :meth:`memory`: every byte this error feedback keeps alive."""
        return sum(self.memory().values())


#: The storages with blockwise scales (saved as ``"residual_scales"``).
_BLOCKWISE = ("int8", "int4")
#: Mixed into a lean velocity store's seed (apart from the residuals' stores).
_VELOCITY_SEED = 0x7E10C17F


def _rank() -> int:
    """This process's rank in the default group (0 when torch.distributed is not initialized)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _numel(t: Any) -> int:
    return t.numel if isinstance(t, LeanTensor) else t.numel()


def _thread_decoded(buffers: dict, lean: LeanTensor) -> torch.Tensor:
    """``lean`` decoded (flat fp32) into this thread's buffer in ``buffers``, reused by its next decode."""
    slot = (threading.get_ident(), lean.device)
    buf = buffers.get(slot)
    if buf is None or buf.numel() < lean.numel:
        buf = buffers[slot] = torch.empty(lean.numel, dtype=torch.float32, device=lean.device)
    return lean.decode(buf[:lean.numel])


def _loaded_stores(state: dict, saved: str, codes_key: str, scales_key: str, numel_key: str,
                   what: str) -> dict[Any, Any]:
    """The inverse of :meth:`ErrorFeedback._saved_stores`: ``{key: fp32 tensor or LeanTensor}`` as
    saved in the storage ``saved``."""
    codes = decode_keyed(state[codes_key], f"error feedback {codes_key}")
    if saved == "fp32":
        return {k: c.float().clone() for k, c in codes.items()}
    scales = decode_keyed(state[scales_key], f"error feedback {what} scales") if saved in _BLOCKWISE else {}
    numels = decode_keyed(state[numel_key], f"error feedback {what} sizes") if saved == "int4" else {}
    return {k: LeanTensor.from_saved(saved, c, scales.get(k), None if numels.get(k) is None else int(numels[k]))
            for k, c in codes.items()}


def _convert(value: Any, storage: str, seed) -> Any:
    """A loaded residual (fp32 tensor or LeanTensor) in ``storage``: as it is when it already is,
    else decoded and stored anew (``seed()`` draws the rounding's seed)."""
    if isinstance(value, LeanTensor) and value.storage == storage:
        return value
    if not isinstance(value, LeanTensor) and storage == "fp32":
        return value
    fp32 = value.decode() if isinstance(value, LeanTensor) else value.reshape(-1)
    if storage == "fp32":
        return fp32
    lean = LeanTensor(storage, fp32.numel(), fp32.device)
    lean.encode(fp32, seed())
    return lean


def _storage_bytes(t: torch.Tensor, seen: set[int]) -> int:
    """``t``'s whole storage in bytes, the first time that storage is seen (0 after)."""
    st = t.untyped_storage()
    ptr = st.data_ptr()
    if ptr in seen or st.nbytes() == 0:
        return 0
    seen.add(ptr)
    return st.nbytes()


def _tensors_of(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors_of(v)]
    return []


def _power_of_two(v: float) -> bool:
    """``v`` is ``2**j`` for an integer ``j`` (multiplying by it is exact, barring subnormals)."""
    m, _ = math.frexp(v)
    return v > 0 and m == 0.5


def _detach_from(payload: Payload, buf: torch.Tensor) -> Payload:
    """``payload`` with any wire tensor that shares ``buf``'s memory cloned
    (``buf`` is about to become the residual)."""
    ptr = buf.untyped_storage().data_ptr()
    if not any(t.untyped_storage().data_ptr() == ptr for t in payload.tensors):
        return payload
    tensors = tuple(t.clone() if t.untyped_storage().data_ptr() == ptr else t for t in payload.tensors)
    return Payload(tensors, payload.shape, payload.dtype, payload.numel, payload.meta)
