"""How error feedback stores a residual between steps: fp32, bf16, 8-bit or 4-bit blockwise.

A residual is what error feedback still owes; it is read and rewritten once per
step, and it is kept for every compressed parameter of the model, on every rank
(momentum correction's velocity too, in the same storage).
Stored in fp32 it costs 4 bytes per parameter (8 with the pending copy a
non-finite step needs; a lean store's old codes wait in memory the DDP hook lends
instead, :mod:`commpress.loan`); stored lean it costs

==========  ==========================================  ============================
storage     per element                                 error of one store
==========  ==========================================  ============================
``fp32``    4 bytes                                     none (the reference)
``bf16``    2 bytes                                     unbiased, ``|e| < 2**-8 |x|``
``int8``    1 byte + one fp32 scale per 128 (1.03 B)    unbiased, ``|e| < max|block| / 127``
``int4``    half a byte + one fp32 scale per 64 (0.56 B) unbiased, ``|e| < max|block| / 7``
==========  ==========================================  ============================

The lean formats round **stochastically** (LoCo, MicroAdam): a store is unbiased,
so a small gradient that a residual accumulates over many steps is not rounded
away at every store (round-to-nearest would keep a coordinate whose steps are
below half a code at zero for ever).  The noise is a counter-based hash
(:func:`commpress.ops.noise_bytes`) of a seed (:func:`~commpress.compressors._util.mix_seed` of
the owner's seed and a store count), so a run and its resume from a checkpoint store the same
codes, on any device.

Everything runs on the tensor's device with torch operations: no host read.
"""

from __future__ import annotations

import math
import os

import torch

from . import ops

#: The storages :class:`LeanTensor` (and ``ErrorFeedback(storage=)``) take.
STORAGES = ("fp32", "bf16", "int8", "int4")
#: The DDP and FSDP2 hooks' default ``residual_storage`` (docs/results/memory.md: how it was chosen).
HOOK_DEFAULT = "int8"
#: Elements per fp32 scale of the ``int8`` storage.
INT8_BLOCK = 128
#: Elements per fp32 scale of the ``int4`` storage (even: a byte's two nibbles share a block).
INT4_BLOCK = 64
#: Elements :meth:`LeanTensor.add_to` decodes at a time (a 4 MiB fp32 buffer while it runs).
DECODE_CHUNK = 1 << 20


def check_storage(value: object, name: str = "storage") -> str:
    """``value`` when it is one of :data:`STORAGES`, else ``ValueError`` naming ``name`` and them."""
    if not isinstance(value, str) or value not in STORAGES:
        raise ValueError(f"{name} must be one of {', '.join(repr(s) for s in STORAGES)}, got {value!r}")
    return value


def bytes_per_element(storage: str) -> float:
    """Bytes one element of a residual takes in ``storage`` (scales included, padding not)."""
    return {"fp32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / INT8_BLOCK,
            "int4": 0.5 + 4.0 / INT4_BLOCK}[check_storage(storage)]


def velocity_mode(storage: str, device: torch.device, *tensors: torch.Tensor) -> str | None:
    """How the numba velocity passes (:meth:`LeanTensor.velocity_into`,
    :meth:`LeanTensor.store_velocity`) round the multiply-add (``"fma"`` / ``"plain"``,
    :func:`~commpress.ops.numba_backend.velocity_mode`) for a store of ``storage`` on ``device`` and
    ``tensors``, where they run: int8 on the CPU, fp32 contiguous CPU tensors, the numba backend;
    ``None`` elsewhere (the caller goes another way)."""
    if storage != "int8" or device.type != "cpu" or any(
            t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
        return None
    if os.environ.get("COMMPRESS_BACKEND", "numba") not in ("numba", ""):
        return None
    try:
        from .ops import numba_backend
    except ImportError:
        return None
    return numba_backend.velocity_mode()


class LeanTensor:
    """A flat fp32 tensor of ``numel`` elements kept in a lean ``storage`` ("bf16", "int8" or "int4").

    Args:
        storage: ``"bf16"``, ``"int8"`` or ``"int4"``.
        numel: elements it stands for.
        device: where the codes live.

    Starts as zeros (``zeroed=False``: undefined, for one about to be encoded).  :meth:`encode` stores an fp32 tensor (stochastic rounding),
    :meth:`decode` writes the stored value back as fp32, :meth:`keep_where`
    chooses between two stores elementwise on the device (a transaction's commit).
    """

    __slots__ = ("storage", "numel", "codes", "scales")

    def __init__(self, storage: str, numel: int, device: torch.device, zeroed: bool = True) -> None:
        if check_storage(storage) == "fp32":
            raise ValueError("LeanTensor: storage must be 'bf16', 'int8' or 'int4' (fp32 is kept as a plain tensor)")
        self.storage = storage
        self.numel = int(numel)
        make = torch.zeros if zeroed else torch.empty   # empty: for a store about to be encoded
        if storage == "bf16":
            self.codes = make(self.numel, dtype=torch.bfloat16, device=device)
            self.scales = None
        elif storage == "int8":
            blocks = math.ceil(self.numel / INT8_BLOCK)
            self.codes = make(blocks * INT8_BLOCK, dtype=torch.int8, device=device)
            self.scales = make(blocks, dtype=torch.float32, device=device)
        else:   # int4: two codes a byte; zeros are the nibble 8
            blocks = math.ceil(self.numel / INT4_BLOCK)
            self.codes = (torch.full((blocks * INT4_BLOCK // 2,), 0x88, dtype=torch.uint8, device=device) if zeroed
                          else torch.empty(blocks * INT4_BLOCK // 2, dtype=torch.uint8, device=device))
            self.scales = make(blocks, dtype=torch.float32, device=device)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors it keeps alive (codes, and scales for int8 and int4)."""
        return (self.codes,) if self.scales is None else (self.codes, self.scales)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def encode(self, src: torch.Tensor, seed: int) -> None:
        """Store ``src`` (fp32, ``numel`` elements, any shape), rounding stochastically with
        noise drawn from ``seed``.  A NaN/inf in ``src`` stores garbage: the caller's commit
        keeps the old value where its flag says so."""
        flat = src.reshape(-1)
        if flat.numel() != self.numel:
            raise ValueError(f"LeanTensor.encode: expected {self.numel} elements, got {flat.numel()}")
        if self.numel == 0:
            return
        x = flat if flat.dtype == torch.float32 and flat.is_contiguous() else flat.float().contiguous()
        if self.storage == "bf16":
            noise = ops.noise_bytes(seed, 2 * self.numel, device=x.device).view(torch.int16)
            ops.bf16_stochastic_encode(x, noise, self.codes)
        elif self.storage == "int8":
            noise = ops.noise_bytes(seed, self.numel, device=x.device)
            ops.int8_block_encode(x, noise, self.codes, self.scales, INT8_BLOCK)
        else:
            noise = ops.noise_bytes(seed, self.numel, device=x.device)
            ops.int4_block_encode(x, noise, self.codes, self.scales, INT4_BLOCK)

    def decode(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The stored value as fp32 (``numel`` elements), in ``out`` when given (any shape with
        ``numel`` elements, contiguous), else in a new flat tensor."""
        if out is None:
            out = torch.empty(self.numel, dtype=torch.float32, device=self.device)
        self._decode_range(0, self.numel, out.view(-1))
        return out

    def add_to(self, dst: torch.Tensor, alpha: float = 1.0, chunk: int = DECODE_CHUNK, *,
               pre: float = 1.0) -> torch.Tensor:
        """``dst := dst * pre + alpha * value`` (``dst`` flat fp32, contiguous, ``numel`` elements;
        ``dst * pre`` rounded on its own, as ``dst.mul_(pre)`` before the add), decoded ``chunk``
        elements at a time: no fp32 buffer of the whole residual (a transient one of ``chunk``
        elements).  Returns ``dst``."""
        if dst.numel() != self.numel:
            raise ValueError(f"LeanTensor.add_to: expected {self.numel} elements, got {dst.numel()}")
        if self.storage == "int8" and alpha == 1.0:   # one op (numba on the CPU: one pass, pre folded in)
            return ops.int8_block_add(dst, self.codes, self.scales, INT8_BLOCK, pre)
        if self.storage == "int4" and alpha == 1.0:
            return ops.int4_block_add(dst, self.codes, self.scales, INT4_BLOCK, pre)
        if pre != 1.0:
            dst.mul_(pre)
        step = max(INT8_BLOCK, chunk - chunk % INT8_BLOCK)
        buf = torch.empty(min(step, self.numel), dtype=torch.float32, device=self.device)
        for lo in range(0, self.numel, step):
            hi = min(lo + step, self.numel)
            part = self._decode_range(lo, hi, buf[:hi - lo])
            if alpha == 1.0:
                dst[lo:hi].add_(part)
            else:
                dst[lo:hi].add_(part, alpha=alpha)
        return dst

    def velocity_into(self, x: torch.Tensor, scale: float, momentum: float, offset: int,
                      out: torch.Tensor, also: torch.Tensor | None = None) -> bool:
        """``out := x*scale + momentum * value[offset:offset + n]`` with
        :func:`~commpress.ops.reference.accumulate_velocity`'s roundings, in one numba pass over an
        int8 store on the CPU (``x``, ``out`` flat fp32 contiguous, ``n`` elements; ``out`` may be
        ``x``), written to ``also`` too in that pass when given (likewise; it may be ``x``).
        Returns ``False``, touching nothing, where that pass does not apply (another storage or
        device, no numba, torch's rounding not reproduced here): the caller decodes."""
        n = x.numel()
        if not 0 <= offset <= self.numel - n or out.numel() != n or (also is not None and also.numel() != n):
            raise ValueError(f"LeanTensor.velocity_into: {n} elements at offset {offset} of {self.numel}, out "
                             f"{out.numel()}{'' if also is None else f', also {also.numel()}'}: out of range")
        mode = self._velocity_mode(x, out, *(() if also is None else (also,)))
        if mode is None:
            return False
        import numpy as np

        from .ops import numba_backend

        numba_backend.K.lean_int8_velocity(x.view(-1).numpy(), np.float32(scale), np.float32(momentum),
                                           self.codes.numpy(), self.scales.numpy(), INT8_BLOCK, int(offset),
                                           mode == "fma", out.view(-1).numpy(),
                                           (out if also is None else also).view(-1).numpy(), also is not None)
        return True

    def store_velocity(self, buf: torch.Tensor, parts: list[tuple[int, int]], scale: float, momentum: float,
                       live: "LeanTensor | None", seed: int) -> bool:
        """Momentum correction of a whole input laid out as ``parts`` of ``buf`` (``(offset, n)``,
        in order, ``numel`` elements in all), in one numba pass: each part ``:= x*scale +
        momentum*live`` (``live`` ``None``: a zero velocity) with
        :func:`~commpress.ops.reference.accumulate_velocity`'s roundings, and this store :=
        that new velocity, as :meth:`encode` with ``seed`` stores it (bitwise).  Only where
        :func:`velocity_mode` says it runs.  Returns whether the new velocity holds a NaN/inf."""
        import numpy as np

        from .ops import numba_backend
        from .ops.reference import seed_words

        starts = np.array([o for o, _ in parts], np.int64)
        lens = np.array([n for _, n in parts], np.int64)
        if int(lens.sum()) != self.numel or (live is not None and live.numel != self.numel):
            raise ValueError(f"LeanTensor.store_velocity: parts of {int(lens.sum())} elements (live "
                             f"{None if live is None else live.numel}) for a store of {self.numel}")
        k0, k1 = seed_words(seed)
        src = live if live is not None else self   # not read without a live velocity
        return numba_backend.K.lean_int8_velocity_store(
            buf.view(-1).numpy(), starts, lens, np.float32(scale), np.float32(momentum), src.codes.numpy(),
            src.scales.numpy(), live is not None, self._velocity_mode(buf) == "fma", np.uint64(k0),
            np.uint64(k1), self.codes.numpy(), self.scales.numpy(), INT8_BLOCK)

    def _velocity_mode(self, *tensors: torch.Tensor) -> str | None:
        """:func:`velocity_mode` for this store."""
        return velocity_mode(self.storage, self.device, *tensors)

    def decode_span(self, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the stored value as a new fp32 tensor (any ``lo``: the blocks
        around the span are decoded)."""
        if not 0 <= lo <= hi <= self.numel:
            raise ValueError(f"LeanTensor.decode_span: [{lo}, {hi}) outside {self.numel} elements")
        start = lo - lo % (INT4_BLOCK if self.storage == "int4" else INT8_BLOCK)
        out = torch.empty(hi - start, dtype=torch.float32, device=self.device)
        return self._decode_range(start, hi, out)[lo - start:]

    def _decode_range(self, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        """Elements ``[lo, hi)`` (``lo`` a multiple of :data:`INT8_BLOCK`) decoded into ``out``."""
        if self.storage == "bf16":
            return out.copy_(self.codes[lo:hi])
        if self.storage == "int4":
            return ops.int4_block_decode(self.codes, self.scales, lo, hi, out, INT4_BLOCK)
        return ops.int8_block_decode(self.codes, self.scales, lo, hi, out, INT8_BLOCK)

    def zero_at(self, indices: torch.Tensor) -> None:
        """Store exact zeros at ``indices`` (int, on the device; an index ``numel`` is padding and
        ignored): momentum factor masking of a stored velocity.  Through a transient bool mask of
        ``numel + 1`` entries: no host read."""
        mask = torch.zeros(self.numel + 1, dtype=torch.bool, device=self.device)
        mask.index_fill_(0, indices.to(self.device).long(), True)
        self._zero_where(mask[:self.numel])

    def zero_(self) -> None:
        """Store zeros everywhere (the scales kept: every code is the zero code)."""
        if self.storage == "int4":
            self.codes.fill_(0x88)
        else:
            self.codes.zero_()

    def _zero_where(self, mask: torch.Tensor) -> None:
        if self.storage != "int4":
            self.codes[:self.numel].masked_fill_(mask, 0)
            return
        blocks = self.scales.numel()
        full = torch.nn.functional.pad(mask, (0, blocks * INT4_BLOCK - self.numel)).view(blocks, 2, INT4_BLOCK // 2)
        codes = self.codes.view(blocks, INT4_BLOCK // 2)
        torch.where(full[:, 0], (codes & 0xF0) | 0x08, codes, out=codes)   # element j: the low nibble
        torch.where(full[:, 1], (codes & 0x0F) | 0x80, codes, out=codes)   # element j + 32: the high one

    def keep_where(self, bad: torch.Tensor, new: "LeanTensor") -> None:
        """``self`` := ``self`` where the 0-d bool ``bad`` is set, else ``new`` (on the device)."""
        for mine, theirs in zip(self.tensors(), new.tensors()):
            torch.where(bad, mine, theirs, out=mine)

    def saved(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(codes, scales)`` for a checkpoint: the codes (int8: the ``numel`` codes, padding
        dropped; int4: every block's bytes, each holding two halves of its block) and the
        blockwise scales (``None`` for bf16)."""
        if self.scales is None:
            return self.codes, None
        return (self.codes[:self.numel].clone() if self.storage == "int8" else self.codes), self.scales

    @classmethod
    def from_saved(cls, storage: str, codes: torch.Tensor, scales: torch.Tensor | None,
                   numel: int | None = None) -> "LeanTensor":
        """The inverse of :meth:`saved` (copies); ``numel`` is needed for int4 (two codes a byte,
        blocks padded).  ``ValueError`` when the parts do not fit."""
        if storage == "int4":
            if (numel is None or -(-int(numel) // INT4_BLOCK) * (INT4_BLOCK // 2) != codes.numel()
                    or codes.dtype != torch.uint8):
                raise ValueError(f"int4 residual: {codes.numel()} {codes.dtype} bytes do not hold {numel} elements")
            lean = cls(storage, int(numel), codes.device)
            if scales is None or scales.numel() != lean.scales.numel():
                raise ValueError(f"int4 residual: {numel} elements need {lean.scales.numel()} scales")
            lean.scales.copy_(scales)
            lean.codes[:codes.numel()].copy_(codes)
            return lean
        lean = cls(storage, codes.numel(), codes.device)
        if storage == "int8":
            if scales is None or scales.numel() != lean.scales.numel() or codes.dtype != torch.int8:
                raise ValueError(f"int8 residual: {codes.numel()} int8 codes need {lean.scales.numel()} scales")
            lean.scales.copy_(scales)
            lean.codes[:codes.numel()].copy_(codes)
        else:
            if codes.dtype != torch.bfloat16:
                raise ValueError(f"bf16 residual: codes must be bfloat16, got {codes.dtype}")
            lean.codes.copy_(codes)
        return lean

    def copy_(self, other: "LeanTensor") -> None:
        """Take ``other``'s stored value (same storage and numel)."""
        for mine, theirs in zip(self.tensors(), other.tensors()):
            mine.copy_(theirs)


__all__ = ["STORAGES", "INT4_BLOCK", "INT8_BLOCK", "LeanTensor", "bytes_per_element", "check_storage"]
