"""Pure-torch reference implementations: the definition of correct for every op.

Every other backend (numba on CPU, CUDA through CuPy) must match these bitwise
for deterministic ops, and bitwise for the same seed for the counter-based
stochastic ones.  They run on any device.

Conventions shared by all backends
----------------------------------
* Inputs are 1-D.  Float inputs are computed on in fp32 (``x.float()``).
* Index tensors come back int32 when ``numel < 2**31`` else int64, ascending.
* Magnitude order is the order of ``bits(|x|)`` as an unsigned 31-bit integer
  (for fp32: ``x.view(int32) & 0x7fffffff``): a total order in which NaN ranks
  above +inf above every finite value, so non-finite entries are always kept by
  top-k and propagate.  Ties go to the lower index.
* Random numbers come from :func:`counter_uniform`: a counter-based hash of
  (seed, element index), so results do not depend on thread count or backend.
* Rounding to nearest is ``floor(y + 0.5)``; stochastic rounding is
  ``floor(y + u)`` with ``u = counter_uniform(seed, i)``.
* Bit packing is little-endian: element ``j`` occupies bits ``[j*b, (j+1)*b)``
  of the byte stream, lowest bit first.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
_HALF = 0.5


def index_dtype(numel: int) -> torch.dtype:
    """int32 when every index of a ``numel``-element tensor fits, else int64."""
    return torch.int32 if numel < 2**31 else torch.int64


# ---------------------------------------------------------------- random numbers
def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The 'lowbias32' integer hash (C. Wellons) on uint32 values held in int64."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    x = x ^ (x >> 16)
    return x


def seed_words(seed: int) -> tuple[int, int]:
    """Split a 64-bit seed into the two 32-bit keys the hash uses."""
    seed = int(seed) & 0xFFFFFFFFFFFFFFFF
    return seed & MASK32, (seed >> 32) & MASK32


def counter_bits(seed: int, start: int, n: int, device="cpu") -> torch.Tensor:
    """24 random bits per element ``i`` in ``[start, start+n)``: int64 tensor.

    ``h = mix32((mix32((i mod 2**32) ^ k0) + k1) mod 2**32) >> 8``.
    """
    k0, k1 = seed_words(seed)
    i = (torch.arange(n, dtype=torch.int64, device=device) + int(start)) & MASK32
    h = _mix32(i ^ k0)
    h = _mix32((h + k1) & MASK32)
    return h >> 8


def counter_uniform(seed: int, start: int, n: int, device="cpu") -> torch.Tensor:
    """Uniform fp32 numbers in ``[0, 1)``, exactly ``counter_bits / 2**24``."""
    return counter_bits(seed, start, n, device).to(torch.float32) * (1.0 / 16777216.0)


def hash_owner(indices: torch.Tensor, world_size: int) -> torch.Tensor:
    """Owner rank of each index: ``mix32(index mod 2**32) mod world_size`` (int64)."""
    h = _mix32(indices.to(torch.int64) & MASK32)
    return h % int(world_size)


# ---------------------------------------------------------------- selection
def magnitude_key(x: torch.Tensor) -> torch.Tensor:
    """int64 key ordering entries by magnitude (NaN > inf > finite), see module doc."""
    return (x.float().view(torch.int32).to(torch.int64)) & 0x7FFFFFFF


def threshold_compact(x: torch.Tensor, threshold: float, residual: torch.Tensor | None = None):
    """Select ``|x| >= threshold`` (NaN never passes), compact in index order.

    Returns ``(indices, values)`` with values in ``x.dtype``.  When ``residual``
    is given (same numel; may be ``x`` itself) it receives ``x`` with the
    selected entries set to zero, in the same pass.
    """
    flat = x.reshape(-1)
    mask = flat.float().abs() >= float(threshold)
    idx = mask.nonzero().reshape(-1)
    values = flat[idx].clone()
    if residual is not None:
        r = residual.view(-1)
        if r.data_ptr() != flat.data_ptr():
            r.copy_(flat)
        r[idx] = 0
    return idx.to(index_dtype(flat.numel())), values


def topk_compact(x: torch.Tensor, k: int, residual: torch.Tensor | None = None):
    """Exact top-``k`` by magnitude key, ties to the lower index, indices ascending.

    Returns ``(indices, values)``; ``residual`` as in :func:`threshold_compact`.
    """
    flat = x.reshape(-1)
    n = flat.numel()
    k = max(0, min(int(k), n))
    key = magnitude_key(flat)
    order = torch.sort(key, descending=True, stable=True).indices[:k]
    idx = torch.sort(order).values
    values = flat[idx].clone()
    if residual is not None:
        r = residual.view(-1)
        if r.data_ptr() != flat.data_ptr():
            r.copy_(flat)
        r[idx] = 0
    return idx.to(index_dtype(n)), values


def scatter_add_(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``out[indices] += values`` for unique indices, in place; returns ``out``."""
    out.index_add_(0, indices.to(torch.int64), values.to(out.dtype))
    return out


# ---------------------------------------------------------------- bit packing
def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``codes`` (integers in ``[0, 2**bits)``) into ``ceil(n*bits/8)`` bytes."""
    n = codes.numel()
    nbytes = (n * bits + 7) // 8
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int64)
    stream = ((codes.reshape(-1, 1).to(torch.int64) >> shifts) & 1).reshape(-1)
    pad = nbytes * 8 - stream.numel()
    if pad:
        stream = torch.cat([stream, stream.new_zeros(pad)])
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int64))
    return (stream.reshape(-1, 8) * weights).sum(1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``numel`` codes as uint8."""
    shifts8 = torch.arange(8, device=packed.device, dtype=torch.int64)
    stream = ((packed.reshape(-1, 1).to(torch.int64) >> shifts8) & 1).reshape(-1)
    stream = stream[: numel * bits].reshape(numel, bits)
    weights = (1 << torch.arange(bits, device=packed.device, dtype=torch.int64))
    return (stream * weights).sum(1).to(torch.uint8)


def bitmap_encode(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """A ``ceil(numel/8)``-byte bitmap with bit ``i`` set for each index ``i``."""
    mask = torch.zeros(numel, dtype=torch.uint8, device=indices.device)
    mask[indices.to(torch.int64)] = 1
    return pack_bits(mask, 1)


def bitmap_decode(bitmap: torch.Tensor, numel: int) -> torch.Tensor:
    """Indices (ascending) of the set bits of a bitmap over ``numel`` entries."""
    mask = unpack_bits(bitmap, 1, numel)
    return mask.nonzero().reshape(-1).to(index_dtype(numel))


def hash_partition(indices: torch.Tensor, world_size: int):
    """Group indices by :func:`hash_owner`.

    Returns ``(counts, order)``: ``counts[r]`` indices go to rank ``r``;
    ``indices[order]`` lists rank 0's first, then rank 1's, …, each group in its
    original order (a stable permutation, int64).
    """
    owner = hash_owner(indices, world_size)
    counts = torch.bincount(owner, minlength=world_size)
    order = torch.sort(owner, stable=True).indices
    return counts, order


# ---------------------------------------------------------------- block quantization
def qmax_for(bits: int) -> int:
    """Largest code magnitude for symmetric signed ``bits``-bit codes (8→127, 4→7, 2→1)."""
    return (1 << (bits - 1)) - 1


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-block max ``|x|`` in fp32 (NaN if the block holds a NaN)."""
    xf = x.reshape(-1).float()
    n = xf.numel()
    nblocks = (n + block - 1) // block
    padded = torch.zeros(nblocks * block, dtype=torch.float32, device=x.device)
    padded[:n] = xf.abs()
    m = padded.reshape(nblocks, block).amax(1) if nblocks else padded.new_zeros(0)
    has_nan = torch.zeros(nblocks, dtype=torch.bool, device=x.device)
    if n:
        nanmask = torch.zeros(nblocks * block, dtype=torch.bool, device=x.device)
        nanmask[:n] = torch.isnan(xf)
        has_nan = nanmask.reshape(nblocks, block).any(1)
    return torch.where(has_nan, torch.full_like(m, float("nan")), m)


def block_quantize(x: torch.Tensor, bits: int, block: int, stochastic: bool = False, seed: int = 0):
    """Absmax block quantization to signed ``bits``-bit codes, bit-packed.

    Per block ``s = max|x|``; ``inv = qmax / s`` (0 when ``s == 0``);
    ``y = x * inv``; ``q = floor(y + 0.5)`` or ``floor(y + u_i)``; clamped to
    ``[-qmax, qmax]`` (a NaN ``y`` gives 0); code ``q + qmax`` packed with
    ``bits`` bits.  Returns ``(packed uint8, scales fp32)``.
    """
    xf = x.reshape(-1).float()
    n = xf.numel()
    qmax = qmax_for(bits)
    scales = block_absmax(xf, block)
    nblocks = scales.numel()
    inv = torch.where(scales > 0, torch.tensor(float(qmax), dtype=torch.float32) / scales,
                      torch.zeros_like(scales))
    y = xf * inv.repeat_interleave(block)[:n] if nblocks else xf
    if stochastic:
        u = counter_uniform(seed, 0, n, x.device)
        q = torch.floor(y + u)
    else:
        q = torch.floor(y + _HALF)
    q = torch.nan_to_num(q, nan=0.0).clamp(-qmax, qmax)
    codes = (q + qmax).to(torch.uint8)
    return pack_bits(codes, bits), scales


def block_dequantize(packed: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int,
                     out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """Decode :func:`block_quantize`: ``(code - qmax) * (s / qmax)`` in fp32.

    With ``out`` (fp32, ``numel``) the result is written there, or added to it
    when ``accumulate`` (the owner's sum in the two-phase allreduce).
    """
    qmax = qmax_for(bits)
    codes = unpack_bits(packed, bits, numel).to(torch.float32) - qmax
    step = scales.float() / float(qmax)
    vals = codes * step.repeat_interleave(block)[:numel]
    return _emit(vals, out, accumulate)


# ---------------------------------------------------------------- 1-bit sign + scale
def pairwise_sum_rows(m: torch.Tensor) -> torch.Tensor:
    """Row sums of a 2-D fp32 tensor in a fixed, backend-independent order.

    Each row is zero-padded to a power-of-two width, then adjacent pairs are
    added level by level (``m[:, 0::2] + m[:, 1::2]``) until one column is left:
    a perfect binary tree over the entries in index order.
    """
    rows, width = m.shape
    p = 1
    while p < width:
        p *= 2
    if p != width:
        m = torch.cat([m, m.new_zeros(rows, p - width)], 1)
    while m.shape[1] > 1:
        m = m[:, 0::2] + m[:, 1::2]
    return m.reshape(rows)


def sign_pack(x: torch.Tensor, chunk: int):
    """1 bit per entry plus one scale (mean ``|x|``) per chunk.

    Bit ``i`` is 1 when ``not (x_i < 0)`` (so 0, -0.0 and NaN read as
    positive).  ``scales[c] = sum(|x|)/len`` over chunk ``c`` in fp32 (NaN/inf
    propagate); the sum is :func:`pairwise_sum_rows` (a fixed order, so every
    backend gets the same bits).  Returns ``(bits uint8 ceil(n/8), scales fp32
    ceil(n/chunk))``.
    """
    xf = x.reshape(-1).float()
    n = xf.numel()
    nchunks = (n + chunk - 1) // chunk
    positive = (~(xf < 0)).to(torch.uint8)
    padded = torch.zeros(nchunks * chunk, dtype=torch.float32, device=x.device)
    padded[:n] = xf.abs()
    sums = pairwise_sum_rows(padded.reshape(nchunks, chunk))
    lengths = torch.full((nchunks,), float(chunk), dtype=torch.float32, device=x.device)
    if nchunks and n % chunk:
        lengths[-1] = float(n % chunk)
    return pack_bits(positive, 1), sums / lengths


def sign_unpack(bits: torch.Tensor, scales: torch.Tensor, chunk: int, numel: int,
                out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """Decode :func:`sign_pack`: ``+scale`` where the bit is 1, ``-scale`` otherwise."""
    positive = unpack_bits(bits, 1, numel).bool()
    s = scales.float().repeat_interleave(chunk)[:numel]
    vals = torch.where(positive, s, -s)
    return _emit(vals, out, accumulate)


def _emit(vals: torch.Tensor, out: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
    if out is None:
        return vals
    if accumulate:
        out.add_(vals)
    else:
        out.copy_(vals)
    return out


__all__ = [
    "index_dtype", "seed_words", "counter_bits", "counter_uniform", "hash_owner",
    "magnitude_key", "threshold_compact", "topk_compact", "scatter_add_",
    "pack_bits", "unpack_bits", "bitmap_encode", "bitmap_decode", "hash_partition",
    "qmax_for", "block_absmax", "block_quantize", "block_dequantize",
    "sign_pack", "sign_unpack",
]
