"""The lean residual stores' encoders (:mod:`commpress.storage`): torch reference and numba kernels.

Nine ops, dispatched like every op of :mod:`commpress.ops`:

* :func:`int8_block_encode` — ``scales[b] = max|x_b| / 127``; ``codes = clamp(floor(x / scale + u),
  -127, 127)`` with ``u = (noise + 0.5) / 256`` (noise: one random byte per element), so
  ``E[codes * scale] == x`` up to the noise's 1/256 resolution;
* :func:`int8_block_add` — ``dst += codes * scales`` (a stored residual added to the compensation
  in place, without decoding it into a buffer of its size);
* :func:`int4_block_encode` / :func:`int4_block_add` — the same with ``scale = max|x_b| / 7`` and
  codes in ``[-7, 7]``, kept as ``code + 8`` two to a byte: byte ``j`` of a block holds its element
  ``j`` (low nibble) and element ``j + block/2`` (high nibble), so that both halves are contiguous
  (the kernels' loops vectorize); a block holding a NaN/inf (or only subnormals) stores zeros;
* :func:`int8_block_decode` / :func:`int4_block_decode` — a range of a store decoded into fp32;
* :func:`noise_bytes` — the stores' rounding noise: ``n`` bytes from a counter-based hash of the
  seed (four bytes a 32-bit word ``mix32((mix32(j ^ k0) + k1) mod 2**32)``, little-endian), the
  same on every device and backend, so a run and its resume store the same codes;
* :func:`bf16_stochastic_encode` — the fp32 bit pattern plus 16 random low bits, truncated to its
  top 16 bits (bf16): rounds the magnitude up with probability (dropped bits) / 2**16.

The numba kernels make one pass over ``x`` (int8: two over each block, which stays in cache) and
compute in fp32 with the reference's operations in its order: bitwise the same codes.
"""

from __future__ import annotations

import numpy as np
import torch

from .reference import MASK32, _mix32, seed_words

#: The ``int8`` codes' largest magnitude.
INT8_MAX = 127.0
#: The ``int4`` codes' largest magnitude (a code ``c`` is kept as the nibble ``c + 8``).
INT4_MAX = 7.0


def check_store(op: str, codes: torch.Tensor, scales: torch.Tensor, block: int, nibbles: bool, *,
                numel: int | None = None, blocks_exact: bool = False, noise: torch.Tensor | None = None,
                span: tuple[int, int] | None = None, out: torch.Tensor | None = None) -> None:
    """``ValueError`` naming ``op`` unless the arguments describe one store the kernels may touch
    whole: ``codes`` of ``len(scales) * block`` elements (int8) or half that (int4, ``nibbles``),
    ``numel`` elements inside it (``blocks_exact``: exactly the blocks they need), ``noise`` of at
    least ``numel`` bytes, ``span`` ``[lo, hi)`` inside it from a block's start, ``out`` holding it.
    The numba kernels index without bounds checks: a short buffer would be written past its end."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or (nibbles and block % 2):
        raise ValueError(f"{op}: block must be a positive{' even' if nibbles else ''} int, got {block!r}")
    blocks = scales.numel()
    want = blocks * block // 2 if nibbles else blocks * block
    if codes.numel() != want:
        raise ValueError(f"{op}: codes must hold {want} {'bytes' if nibbles else 'codes'} for {blocks} "
                         f"scales of {block}, got {codes.numel()}")
    if numel is not None:
        need = -(-numel // block)
        if need > blocks or (blocks_exact and need != blocks):
            raise ValueError(f"{op}: {numel} elements need {need} scales of {block}, got {blocks}")
        if noise is not None and noise.numel() < numel:
            raise ValueError(f"{op}: noise must hold at least {numel} bytes, got {noise.numel()}")
    if span is not None:
        lo, hi = span
        if not (0 <= lo <= hi <= blocks * block) or lo % block:
            raise ValueError(f"{op}: span [{lo}, {hi}) must start at a block and lie in {blocks * block} elements")
        if out is not None and out.numel() < hi - lo:
            raise ValueError(f"{op}: out must hold {hi - lo} elements, got {out.numel()}")


def _block_levels(x: torch.Tensor, noise: torch.Tensor, scales: torch.Tensor, block: int, top: float,
                  usable_only: bool) -> torch.Tensor:
    """The blockwise stores' rounding: ``scales[b] = max|x_b| / top`` and the levels
    ``clamp(floor(x / scale + u), -top, top)`` (fp32, ``(blocks, block)``, the tail padding's from
    zeros), ``u = (noise + 0.5) / 256``.  ``usable_only``: a block whose scale is not finite or is
    below fp32's smallest normal gets zero levels (else its inverse scale is 0 where the scale is)."""
    blocks = scales.numel()
    n = x.numel()
    xf = x.float()
    pad = blocks * block - n
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    xb = xf.view(blocks, block)
    torch.amax(xb.abs(), dim=1, out=scales)
    scales.div_(top)
    usable = ((scales >= torch.finfo(torch.float32).tiny) & torch.isfinite(scales)) if usable_only else scales > 0
    inv = torch.where(usable, 1.0 / scales, torch.zeros_like(scales))
    y = xb * inv[:, None]
    u = noise[:n].to(torch.float32).add_(0.5).mul_(1.0 / 256)
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    y.add_(u.view(blocks, block)).floor_().clamp_(-top, top)
    return torch.where(usable[:, None], y, torch.zeros_like(y)) if usable_only else y


def int8_block_encode(x: torch.Tensor, noise: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      block: int) -> None:
    """Store the flat fp32 ``x`` (``n`` elements) as ``codes`` (int8, ``len(scales) * block``, the
    tail padding written as 0) and ``scales`` (fp32, one per ``block``), rounding stochastically
    with ``noise`` (uint8, at least ``n`` bytes)."""
    check_store("int8_block_encode", codes, scales, block, False, numel=x.numel(), blocks_exact=True, noise=noise)
    codes.view(scales.numel(), block).copy_(_block_levels(x, noise, scales, block, INT8_MAX, False))


def int4_block_encode(x: torch.Tensor, noise: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      block: int) -> None:
    """Store the flat fp32 ``x`` (``n`` elements) as ``codes`` (uint8, two nibbles a byte: byte ``j``
    of a block holds its elements ``j`` and ``j + block/2``; ``len(scales) * block / 2`` bytes, the
    tail padding written as zeros) and ``scales`` (fp32, one per ``block``, even), rounding
    stochastically with ``noise`` (uint8, at least ``n`` bytes).  A block whose scale is not finite
    or is below fp32's smallest normal stores zero codes."""
    check_store("int4_block_encode", codes, scales, block, True, numel=x.numel(), blocks_exact=True, noise=noise)
    blocks = scales.numel()
    y = _block_levels(x, noise, scales, block, INT4_MAX, True)
    q = y.add_(INT4_MAX + 1).to(torch.uint8).view(blocks, 2, block // 2)
    torch.bitwise_or(q[:, 0], q[:, 1] << 4, out=codes.view(blocks, block // 2))


def bf16_stochastic_encode(x: torch.Tensor, noise: torch.Tensor, codes: torch.Tensor) -> None:
    """Store the flat fp32 ``x`` as bf16 ``codes`` (same numel), rounding stochastically with
    ``noise`` (int16, one per element: its low 16 bits are the added ones)."""
    bits = x.float().contiguous().view(torch.int32).add(noise.to(torch.int32).bitwise_and_(0xFFFF))
    codes.view(torch.int16).copy_(bits.bitwise_right_shift_(16))


#: Noise words :func:`noise_bytes` hashes at a time (bounds its int64 temporaries).
NOISE_CHUNK = 1 << 20


def noise_bytes(seed: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``n`` uniformly random bytes (uint8) for the lean stores' stochastic rounding: byte ``4j + b``
    is byte ``b`` (little-endian) of ``mix32((mix32(j ^ k0) + k1) mod 2**32)``, ``(k0, k1)`` the
    seed's words."""
    k0, k1 = seed_words(seed)
    words = -(-int(n) // 4)
    out = torch.empty(words * 4, dtype=torch.uint8, device=device)
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int64, device=device)
    for lo in range(0, words, NOISE_CHUNK):
        hi = min(lo + NOISE_CHUNK, words)
        j = torch.arange(lo, hi, dtype=torch.int64, device=device) & MASK32
        h = _mix32((_mix32(j ^ k0) + k1) & MASK32)
        out[4 * lo:4 * hi].copy_(((h[:, None] >> shifts) & 0xFF).reshape(-1))
    return out[:n]


#: Elements :func:`int8_block_add` decodes at a time (a transient fp32 buffer of this size).
ADD_CHUNK = 1 << 20


def int8_block_decode(codes: torch.Tensor, scales: torch.Tensor, lo: int, hi: int, out: torch.Tensor,
                      block: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of an int8 store (``lo`` a multiple of ``block``) decoded into ``out``
    (``hi - lo`` fp32 elements): ``codes * scales`` per block, the tail block's part included."""
    check_store("int8_block_decode", codes, scales, block, False, span=(lo, hi), out=out)
    b0, full_hi = lo // block, hi - (hi - lo) % block
    nfull = (full_hi - lo) // block
    if nfull:
        torch.mul(codes[lo:full_hi].view(nfull, block), scales[b0:b0 + nfull, None],
                  out=out[:full_hi - lo].view(nfull, block))
    if full_hi < hi:
        torch.mul(codes[full_hi:hi], scales[b0 + nfull], out=out[full_hi - lo:])
    return out


def int4_block_decode(codes: torch.Tensor, scales: torch.Tensor, lo: int, hi: int, out: torch.Tensor,
                      block: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of an int4 store (``lo`` a multiple of ``block``) decoded into ``out``
    (``hi - lo`` fp32 elements): ``(nibble - 8) * scale`` per block."""
    check_store("int4_block_decode", codes, scales, block, True, span=(lo, hi), out=out)
    packed = codes[lo // 2:-(-hi // block) * (block // 2)].view(-1, block // 2)
    nib = torch.stack((packed & 15, packed >> 4), dim=1).view(-1)[:hi - lo]   # a block's halves in turn
    vals = nib.to(torch.float32).sub_(INT4_MAX + 1)
    b0, full_hi = lo // block, hi - (hi - lo) % block
    nfull = (full_hi - lo) // block
    if nfull:
        torch.mul(vals[:full_hi - lo].view(nfull, block), scales[b0:b0 + nfull, None],
                  out=out[:full_hi - lo].view(nfull, block))
    if full_hi < hi:
        torch.mul(vals[full_hi - lo:], scales[b0 + nfull], out=out[full_hi - lo:])
    return out


def _block_add(dst: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int, decode,
               pre: float = 1.0) -> torch.Tensor:
    """``dst := dst * pre + decode(...)`` a range of :data:`ADD_CHUNK` elements at a time (``block``
    divides it): no buffer of ``dst``'s size."""
    n = dst.numel()
    step = ADD_CHUNK - ADD_CHUNK % block
    buf = torch.empty(min(step, n), dtype=torch.float32, device=dst.device)
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        part = dst[lo:hi]
        if pre != 1.0:
            part.mul_(pre)
        part.add_(decode(codes, scales, lo, hi, buf[:hi - lo], block))
    return dst


def int4_block_add(dst: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int,
                   pre: float = 1.0) -> torch.Tensor:
    """``dst := dst * pre + (nibbles - 8) * scales`` (an int4 store added to the flat fp32 ``dst``),
    decoded :data:`ADD_CHUNK` elements at a time: no buffer of ``dst``'s size."""
    check_store("int4_block_add", codes, scales, block, True, numel=dst.numel())
    return _block_add(dst, codes, scales, block, int4_block_decode, pre)


def int8_block_add(dst: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: int,
                   pre: float = 1.0) -> torch.Tensor:
    """``dst := dst * pre + codes * scales`` (the stored int8 value added to the flat fp32 ``dst`` of
    ``n`` elements: ``codes`` int8 of at least ``n``, one fp32 scale per ``block``; ``dst * pre``
    rounded on its own, as ``dst.mul_(pre)`` then the add), decoded :data:`ADD_CHUNK` elements at a
    time (``block`` divides it): no buffer of ``dst``'s size."""
    check_store("int8_block_add", codes, scales, block, False, numel=dst.numel())
    return _block_add(dst, codes, scales, block, int8_block_decode, pre)


REFERENCE = {"int8_block_encode": int8_block_encode, "bf16_stochastic_encode": bf16_stochastic_encode,
             "int8_block_add": int8_block_add, "int4_block_encode": int4_block_encode,
             "int4_block_add": int4_block_add, "noise_bytes": noise_bytes,
             "int8_block_decode": int8_block_decode, "int4_block_decode": int4_block_decode}


def _numba_impls() -> dict:
    """The numba kernels (CPU; :mod:`._numba_kernels`, compiled at their first call and cached on
    disk), or ``{}`` without numba."""
    import importlib.util

    if importlib.util.find_spec("numba") is None:
        return {}

    def kernels():
        from . import _numba_kernels

        return _numba_kernels

    def adder(kernel_name, reference):
        def add(dst, codes, scales, block, pre=1.0):
            if dst.dtype != torch.float32 or not dst.is_contiguous() or dst.device.type != "cpu":
                return reference(dst, codes, scales, block, pre)
            check_store(reference.__name__, codes, scales, block, kernel_name == "lean_int4_add", numel=dst.numel())
            getattr(kernels(), kernel_name)(dst.view(-1).numpy(), codes.numpy(), scales.numpy(), block,
                                            np.float32(pre))
            return dst
        return add

    def encoder(kernel_name, reference):
        def encode(x, noise, codes, scales, block):
            if x.dtype != torch.float32 or not x.is_contiguous():
                return reference(x, noise, codes, scales, block)
            check_store(reference.__name__, codes, scales, block, kernel_name == "lean_int4_encode",
                        numel=x.numel(), blocks_exact=True, noise=noise)
            xf = x.numpy()
            getattr(kernels(), kernel_name)(xf, xf.view(np.int32), noise.numpy(), codes.numpy(), scales.numpy(),
                                            block)
        return encode

    def decoder(kernel_name, reference):
        def decode(codes, scales, lo, hi, out, block):
            if out.dtype != torch.float32 or not out.is_contiguous() or out.device.type != "cpu":
                return reference(codes, scales, lo, hi, out, block)
            check_store(reference.__name__, codes, scales, block, kernel_name == "lean_int4_decode",
                        span=(lo, hi), out=out)
            getattr(kernels(), kernel_name)(codes.numpy(), scales.numpy(), block, lo, out.view(-1)[:hi - lo].numpy())
            return out
        return decode

    def noise_numba(seed, n, device="cpu"):
        if torch.device(device).type != "cpu":
            return noise_bytes(seed, n, device)
        k0, k1 = seed_words(seed)
        words = np.empty(-(-int(n) // 4), np.uint32)
        kernels().lean_noise_words(np.uint64(k0), np.uint64(k1), words)
        return torch.from_numpy(words.view(np.uint8)[:n])

    def bf16_numba(x, noise, codes):
        if x.dtype != torch.float32 or not x.is_contiguous():
            return bf16_stochastic_encode(x, noise, codes)
        kernels().lean_bf16_encode(x.numpy().view(np.int32), noise.numpy(), codes.view(torch.int16).numpy())

    return {"int8_block_encode": encoder("lean_int8_encode", int8_block_encode), "bf16_stochastic_encode": bf16_numba,
            "int8_block_add": adder("lean_int8_add", int8_block_add),
            "int4_block_encode": encoder("lean_int4_encode", int4_block_encode),
            "int4_block_add": adder("lean_int4_add", int4_block_add), "noise_bytes": noise_numba,
            "int8_block_decode": decoder("lean_int8_decode", int8_block_decode),
            "int4_block_decode": decoder("lean_int4_decode", int4_block_decode)}


NUMBA = _numba_impls()

__all__ = ["INT4_MAX", "INT8_MAX", "bf16_stochastic_encode", "noise_bytes", "int4_block_add", "int4_block_decode",
           "int4_block_encode", "int8_block_add", "int8_block_decode", "int8_block_encode"]
