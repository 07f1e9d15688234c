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


def compensated(x: torch.Tensor, residual: torch.Tensor | None, beta: float = 1.0,
                scale: float = 1.0) -> torch.Tensor:
    """Error feedback's compensated input ``x*scale + residual*beta``, flat fp32.

    Each product is rounded to fp32 on its own (no fused multiply-add) and left out
    when its factor is 1; ``residual=None`` means a zero residual (``c = x*scale``,
    signs of zeros kept).  A new tensor unless it is ``x`` itself (fp32, factors 1,
    no residual).
    """
    c = x.reshape(-1).float()
    if float(scale) != 1.0:
        c = c * torch.tensor(float(scale), dtype=torch.float32)
    if residual is not None:
        r = residual.reshape(-1).float()
        c = c + (r if float(beta) == 1.0 else r * torch.tensor(float(beta), dtype=torch.float32))
    return c


def accumulate_velocity(x: torch.Tensor, scale: float, live: torch.Tensor | None, momentum: float,
                        new: torch.Tensor) -> torch.Tensor:
    """Momentum correction's velocity (DGC): ``new := x*scale + momentum*live`` in fp32, ``x``'s
    shape, with torch's own ops: ``x*scale`` rounded on its own (left out when ``scale`` is 1),
    then ``add(live, alpha=momentum)``, which fuses the multiply-add on CPUs with FMA
    (``live`` ``None``: a zero velocity, ``new := x*scale``).  Returns ``new``."""
    u = new.view(x.shape)
    if scale != 1.0:
        torch.mul(x, scale, out=u)
        if live is not None:
            u.add_(live.view(x.shape), alpha=momentum)
    elif live is None:
        u.copy_(x)
    else:
        torch.add(x, live.view(x.shape), alpha=momentum, out=u)
    return u


def topk_compact_feedback(x: torch.Tensor, residual: torch.Tensor | None, beta: float, k: int,
                          new_residual: torch.Tensor, scale: float = 1.0,
                          velocity: tuple[torch.Tensor | None, float, torch.Tensor] | None = None):
    """Error-feedback top-``k`` in one pass: ``c = x*scale + residual*beta`` (fp32, see
    :func:`compensated`), then :func:`topk_compact` of ``c``, with ``new_residual`` := ``c``
    with the selected entries zeroed.

    Returns ``(indices, values)``, values fp32 (``c``'s).  ``residual`` (fp32, ``x``'s
    numel, or ``None`` for zero) and ``new_residual`` (fp32, contiguous, ``x``'s numel)
    may be the same tensor; ``new_residual`` may be ``x`` itself.  A NaN/inf in ``c``
    ranks above every finite value, so it shows in ``values`` (``k >= 1``).

    ``velocity=(live, momentum, new)``: momentum correction first, ``c = u + residual*beta``
    with ``u`` := :func:`accumulate_velocity` ``(x, scale, live, momentum, new)`` (``new``: fp32,
    contiguous, ``x``'s numel, apart from ``x`` and both residuals).
    """
    if velocity is not None:
        x, scale = accumulate_velocity(x.reshape(-1), scale, *velocity), 1.0
    c = compensated(x, residual, beta, scale)
    r = new_residual.view(-1)
    r.copy_(c)
    return topk_compact(r, k, residual=r)


def cast_feedback(x: torch.Tensor, residual: torch.Tensor | None, beta: float, new_residual: torch.Tensor,
                  wire_dtype: torch.dtype, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Error feedback around a half-precision cast in one call: ``c = x*scale + residual*beta`` (fp32,
    :func:`compensated`), ``sent`` := ``c`` in ``wire_dtype`` (fp16 / bf16, round to nearest even)
    saturated at the dtype's largest finite value for a finite ``c`` beyond it (``±65504`` for fp16,
    not ``±inf``), NaN/inf sent as they are; ``new_residual`` (fp32, contiguous, ``x``'s numel) :=
    ``c - sent``.  Returns ``(sent, finite)``: ``finite`` is a 0-d bool tensor, whether every ``c``
    is finite (``new_residual`` is only meaningful then)."""
    c = new_residual.view(-1)
    c.copy_(compensated(x, residual, beta, scale))
    lim = torch.finfo(wire_dtype).max
    sent = torch.where(torch.isinf(c), c, c.clamp(-lim, lim)).to(wire_dtype)
    finite = torch.isfinite(c).all()
    c.sub_(sent)
    return sent, finite


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


def block_dequantize_sum(packed, scales, bits: int, block: int, numel: int,
                         out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """The sum of several :func:`block_quantize` payloads of ``numel`` entries, in order:
    ``packed`` and ``scales`` are equal-length sequences (at least one payload), and the result
    is ``d_0 + d_1 + ... + d_{P-1}`` (``d_i`` :func:`block_dequantize` of payload ``i``, fp32,
    added left to right), or ``out + d_0 + d_1 + ...`` with ``out`` and ``accumulate``: bitwise
    what one decode followed by accumulating decodes gives (a gather collective's rank-order sum).
    """
    if not isinstance(packed, (list, tuple)) or not isinstance(scales, (list, tuple)):
        raise TypeError("block_dequantize_sum: packed and scales must be lists (or tuples) of tensors")
    if len(packed) != len(scales) or not packed:
        raise ValueError(f"block_dequantize_sum: need as many scales as packed payloads, at least one; "
                         f"got {len(packed)} and {len(scales)}")
    dst = block_dequantize(packed[0], scales[0], bits, block, numel, out, accumulate)
    for p, s in zip(packed[1:], scales[1:]):
        dst = block_dequantize(p, s, bits, block, numel, dst, True)
    return dst


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
    backend gets the same bits).  A finite chunk whose sum overflows is summed again on
    ``|x| * 2**-SIGN_RESCUE_SHIFT`` (exact), and its scale is ``(sum / len) * 2**SIGN_RESCUE_SHIFT``
    saturated at the fp32 maximum: a finite chunk always gets a finite scale.  Returns
    ``(bits uint8 ceil(n/8), scales fp32 ceil(n/chunk))``.
    """
    xf = x.reshape(-1).float()
    n = xf.numel()
    nchunks = (n + chunk - 1) // chunk
    positive = (~(xf < 0)).to(torch.uint8)
    padded = torch.zeros(nchunks * chunk, dtype=torch.float32, device=x.device)
    padded[:n] = xf.abs()
    rows = padded.reshape(nchunks, chunk)
    sums = pairwise_sum_rows(rows)
    lengths = torch.full((nchunks,), float(chunk), dtype=torch.float32, device=x.device)
    if nchunks and n % chunk:
        lengths[-1] = float(n % chunk)
    scales = sums / lengths
    # the rescue, computed for every chunk and selected on the device (no host read)
    up = pow2_f32(torch.tensor(SIGN_RESCUE_SHIFT, dtype=torch.int32, device=x.device))
    down = pow2_f32(torch.tensor(-SIGN_RESCUE_SHIFT, dtype=torch.int32, device=x.device))
    rescued = ((pairwise_sum_rows(rows * down) / lengths) * up).clamp(max=F32_MAX)
    overflowed = torch.isinf(sums) & (rows.view(torch.int32).amax(1) < 0x7F800000) if nchunks else sums.isinf()
    return pack_bits(positive, 1), torch.where(overflowed, rescued, scales)


#: The exact down-scaling of a sign chunk's |x| whose plain sum overflowed (:func:`sign_pack`):
#: ``2**32`` leaves room for ``2**32`` entries of the fp32 maximum.
SIGN_RESCUE_SHIFT = 32


def sign_unpack(bits: torch.Tensor, scales: torch.Tensor, chunk: int, numel: int,
                out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """Decode :func:`sign_pack`: ``+scale`` where the bit is 1, ``-scale`` otherwise."""
    positive = unpack_bits(bits, 1, numel).bool()
    s = scales.float().repeat_interleave(chunk)[:numel]
    vals = torch.where(positive, s, -s)
    return _emit(vals, out, accumulate)



# ---------------------------------------------------------------- minifloats: fp8 and MX
#: format -> (exponent bits E, mantissa bits M, largest finite value).  Codes have
#: ``1 + E + M`` bits: sign on top, then the biased exponent, then the mantissa.
MINIFLOATS = {
    "e4m3": (4, 3, 448.0),     # torch.float8_e4m3fn
    "e5m2": (5, 2, 57344.0),   # torch.float8_e5m2
    "e2m3": (2, 3, 7.5),       # OCP MX FP6
    "e2m1": (2, 1, 6.0),       # OCP MX FP4
}
#: OCP MX element name -> (minifloat format, bits per element, emax of the element).
MX_ELEMENTS = {"fp8_e4m3": ("e4m3", 8, 8), "fp6_e2m3": ("e2m3", 6, 2), "fp4_e2m1": ("e2m1", 4, 2)}
#: Elements that share one MX scale.
MX_BLOCK = 32
_FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def minifloat_params(fmt: str) -> tuple[int, int, float, int]:
    """``(E, M, max, emin)`` of a minifloat format; ``emin = 2 - 2**(E-1)`` (smallest normal exponent)."""
    if fmt not in MINIFLOATS:
        raise ValueError(f"minifloat format must be one of {tuple(MINIFLOATS)}, got {fmt!r}")
    e, m, fmax = MINIFLOATS[fmt]
    return e, m, fmax, 2 - (1 << (e - 1))


def minifloat_table(fmt: str, device="cpu") -> torch.Tensor:
    """fp32 value of every code of ``fmt`` (``2**(1+E+M)`` entries).

    fp8 formats take torch's own decoding (NaN/inf codes included); FP6/FP4
    have neither: ``(-1)**s * 2**(e - bias) * (1 + m/2**M)``, subnormal at ``e == 0``.
    """
    if fmt in _FP8_DTYPES:
        return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(_FP8_DTYPES[fmt]).float().to(device)
    e_bits, m_bits, _, emin = minifloat_params(fmt)
    code = torch.arange(1 << (1 + e_bits + m_bits), dtype=torch.int64)
    mant = (code & ((1 << m_bits) - 1)).double()
    ef = (code >> m_bits) & ((1 << e_bits) - 1)
    frac = torch.where(ef == 0, mant / (1 << m_bits), 1 + mant / (1 << m_bits))
    mag = frac * torch.pow(2.0, torch.clamp(ef.double() - (1 - emin), min=emin))
    sign = torch.where((code >> (e_bits + m_bits)) & 1 == 1, -1.0, 1.0)
    return (sign * mag).float().to(device)


def minifloat_codes(y: torch.Tensor, fmt: str, stochastic: bool = False, seed: int = 0) -> torch.Tensor:
    """``1+E+M``-bit codes (int32) of fp32 ``y`` rounded to the minifloat ``fmt``, saturating.

    ``a = min(|y|, max)``; ``e = max(floor(log2 a), emin)`` (from the fp32
    exponent field); ``r = a * 2**(M - e)`` (exact), ``q = floor(r)``,
    ``f = r - q``; round up when ``f > 1/2`` or ``f == 1/2`` and ``q`` is odd
    (nearest, ties to even), or when ``u_i < f`` (stochastic,
    ``u = counter_uniform(seed, i)``: ``E[code value] = a`` exactly).  Magnitude code
    ``((e - emin) << M) + q + up`` (a carry into the next binade is the right
    code); the sign bit is ``y``'s (so ``-0.0`` keeps it); NaN gives code 0.
    """
    e_bits, m_bits, fmax, emin = minifloat_params(fmt)
    yf = y.reshape(-1).float()
    a = yf.abs().clamp(max=fmax)
    nan = torch.isnan(a)
    a = torch.where(nan, torch.zeros_like(a), a)
    e = ((a.view(torch.int32) >> 23) - 127).clamp(min=emin)
    inv_step = ((m_bits - e + 127) << 23).view(torch.float32)
    r = a * inv_step
    q = torch.floor(r)
    f = r - q
    qi = q.to(torch.int32)
    if stochastic:
        up = counter_uniform(seed, 0, yf.numel(), yf.device) < f
    else:
        up = (f > _HALF) | ((f == _HALF) & ((qi & 1) == 1))
    mag = ((e - emin) << m_bits) + qi + up.to(torch.int32)
    sign = ((yf.view(torch.int32) < 0) & ~nan).to(torch.int32) << (e_bits + m_bits)
    return torch.where(nan, torch.zeros_like(mag), mag | sign)


def fp8_quantize(x: torch.Tensor, fmt: str, block: int, stochastic: bool = False, seed: int = 0):
    """Per block of ``block`` entries: ``s = max|x| / max(fmt)`` (fp32, NaN/inf propagate),
    ``y = x * inv`` with ``inv = max(fmt) / max|x|`` (0 when ``max|x|`` is 0 or NaN),
    codes :func:`minifloat_codes` of ``y``.  Returns ``(codes uint8 (numel), scales fp32)``;
    the codes are the bytes of ``torch.float8_e4m3fn`` / ``float8_e5m2`` values."""
    _, _, fmax, _ = minifloat_params(fmt)
    if fmt not in _FP8_DTYPES:
        raise ValueError(f"fp8 format must be one of {tuple(_FP8_DTYPES)}, got {fmt!r}")
    xf = x.reshape(-1).float()
    n = xf.numel()
    amax = block_absmax(xf, block)
    fm = torch.tensor(fmax, dtype=torch.float32, device=xf.device)
    scales = amax / fm
    inv = torch.where(amax > 0, fm / amax, torch.zeros_like(amax))
    y = xf * inv.repeat_interleave(block)[:n] if n else xf
    return minifloat_codes(y, fmt, stochastic, seed).to(torch.uint8), scales


def fp8_dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: str, block: int, numel: int,
                   out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """Decode :func:`fp8_quantize`: ``value(code) * s`` in fp32 (``codes`` uint8 or float8)."""
    table = minifloat_table(fmt, codes.device)
    c = codes.reshape(-1)[:numel]
    if c.dtype != torch.uint8:
        c = c.view(torch.uint8)
    vals = table[c.to(torch.int64)] * scales.float().repeat_interleave(block)[:numel]
    return _emit(vals, out, accumulate)


def e8m0_table(device="cpu") -> torch.Tensor:
    """fp32 value of every E8M0 scale byte: ``2**(b - 127)``; 255 is NaN."""
    b = torch.arange(256, dtype=torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    t = bits.view(torch.float32).clone()
    t[255] = float("nan")
    return t.to(device)


def mx_quantize(x: torch.Tensor, element: str, stochastic: bool = False, seed: int = 0):
    """OCP MX: per block of 32, shared exponent ``X = clamp(floor(log2 max|x|) - emax, -127)``
    (from the fp32 exponent field; E8M0 byte ``X + 127``, 255 when the block holds a
    NaN or inf); elements :func:`minifloat_codes` of ``x * 2**-X`` (saturating), bit-packed
    (:func:`pack_bits`).  Returns ``(packed uint8, scale bytes uint8)``."""
    if element not in MX_ELEMENTS:
        raise ValueError(f"element must be one of {tuple(MX_ELEMENTS)}, got {element!r}")
    fmt, bits, emax = MX_ELEMENTS[element]
    xf = x.reshape(-1).float()
    n = xf.numel()
    amax = block_absmax(xf, MX_BLOCK)
    finite = torch.isfinite(amax)
    field = (amax.view(torch.int32) >> 23) & 0xFF
    shared = (field - 127 - emax).clamp(min=-127)
    scale_bytes = torch.where(finite, shared + 127, torch.full_like(shared, 255)).to(torch.uint8)
    inv = torch.where(finite, ((127 - shared) << 23).view(torch.float32), torch.zeros_like(amax))
    y = xf * inv.repeat_interleave(MX_BLOCK)[:n] if n else xf
    return pack_bits(minifloat_codes(y, fmt, stochastic, seed), bits), scale_bytes


def mx_dequantize(packed: torch.Tensor, scales: torch.Tensor, element: str, numel: int,
                  out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """Decode :func:`mx_quantize`: ``value(code) * e8m0(scale byte)`` in fp32."""
    fmt, bits, _ = MX_ELEMENTS[element]
    codes = unpack_bits(packed, bits, numel).to(torch.int64)
    s = e8m0_table(packed.device)[scales.reshape(-1).to(torch.int64)]
    vals = minifloat_table(fmt, packed.device)[codes] * s.repeat_interleave(MX_BLOCK)[:numel]
    return _emit(vals, out, accumulate)


# ---------------------------------------------------------------- QSGD / TernGrad levels
def level_bits(levels: int) -> int:
    """Bits per entry for signed codes in ``[-levels, levels]``: ``ceil(log2(2*levels+1))``."""
    return max(1, (2 * int(levels)).bit_length())


#: The unscaled sum of squares is used when it lies in [NORM_TINY, inf); otherwise (it overflowed,
#: came near underflow, or the bucket is zero or not finite) the bucket is summed again scaled.
NORM_TINY = 2.0 ** -60
#: Largest finite fp32: a finite bucket whose norm exceeds it gets this norm instead of inf.
F32_MAX = 3.4028234663852886e38


def norm_shift(absbits: torch.Tensor) -> torch.Tensor:
    """``k`` (int32) with ``2**k * m`` in ``[1, 2)`` for ``m`` the fp32 whose bits are ``absbits``
    (the bucket's largest ``bits(|x|)``), clamped to ``[-126, 126]`` so that ``2**k`` and ``2**-k``
    are normal fp32 (zero and subnormal ``m`` get 126; inf and NaN -126)."""
    return (127 - (absbits >> 23)).clamp(-126, 126).to(torch.int32)


def pow2_f32(k: torch.Tensor) -> torch.Tensor:
    """``2**k`` as fp32, built from its bits (exact; ``k`` in ``[-126, 127]``)."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def pow2_f64(k: torch.Tensor) -> torch.Tensor:
    """``2**k`` as fp64, built from its bits (exact; ``k`` in ``[-1022, 1023]``)."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


def bucket_norms(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """fp32 L2 norm of each ``bucket``-entry slice (last one shorter), overflow- and underflow-safe.

    ``S = `` the :func:`pairwise_sum_rows` of ``x*x`` (a fixed order, so every backend agrees);
    the norm is ``sqrt(S)`` (fp64, rounded once to fp32: correctly rounded on every backend).
    When ``S`` is not in ``[NORM_TINY, inf)`` (the squares overflowed, or the bucket is tiny, zero
    or not finite) the bucket is summed again on ``y = x * 2**k``, ``k`` from :func:`norm_shift` of
    its largest ``|x|`` (exact scaling: ``max|y|`` in ``[1, 2)``, so ``y*y`` cannot overflow), and
    the norm is ``sqrt(S_y) * 2**-k`` in fp64, rounded once to fp32 and, for a finite bucket,
    saturated at ``F32_MAX`` (still ``>= max|x|``, which is all :func:`level_quantize` needs).  A
    NaN/inf entry still gives a NaN/inf norm.  Where both sums are free of over/underflow they
    are equal up to the exact factor ``4**k``, so the rescue changes no ordinary bucket's norm;
    the fast backends sum a bucket a second time only when it needs the rescue.
    """
    xf = x.reshape(-1).float()
    n = xf.numel()
    b = max(1, min(int(bucket), n))
    nb = (n + b - 1) // b
    padded = torch.zeros(nb * b, dtype=torch.float32, device=xf.device)
    padded[:n] = xf
    rows = padded.reshape(nb, b)
    s0 = pairwise_sum_rows(rows * rows)
    # sqrt in fp64, rounded once to fp32: the correctly rounded fp32 root on every backend
    # (torch's own fp32 sqrt on CPU can be one ulp off)
    fast = torch.sqrt(s0.double()).float()
    # the rescue, computed for every bucket and selected on the device (no host read)
    k = norm_shift((rows.view(torch.int32) & 0x7FFFFFFF).amax(1))
    y = rows * pow2_f32(k)[:, None]
    r = torch.sqrt(pairwise_sum_rows(y * y).double()) * pow2_f64(-k)
    r = torch.where(torch.isfinite(r), r.clamp(max=F32_MAX), r).float()
    ok = (s0 >= NORM_TINY) & (s0 < float("inf"))
    return torch.where(ok, fast, r)


#: Exact pre-scale of ``|x|`` in :func:`level_quantize` when ``levels / s`` overflows (tiny ``s``),
#: and its inverse when ``levels / s`` is subnormal (``s`` near the fp32 maximum).
LEVEL_PRESCALE = 2.0 ** 64
_F32_MIN = 2.0 ** -126


def level_multiplier(fl: torch.Tensor, s: torch.Tensor):
    """Per-bucket ``(m, p)`` (fp32) of :func:`level_quantize` for scales ``s > 0``: ``m = fl / s``
    and ``p = 1`` when that is a normal fp32 or 0 (``s`` inf); otherwise ``p = 2**64`` (``fl / s``
    overflowed: ``s`` tiny) or ``2**-64`` (``fl / s`` subnormal: ``s`` huge) and ``m = fl / (s*p)``,
    so ``(|x| * p) * m`` is ``|x| * fl / s`` without a lost exponent."""
    m0 = fl / s
    big = torch.isinf(m0)
    small = (m0 > 0) & (m0 < _F32_MIN)
    one = torch.ones_like(s)
    p = torch.where(big, one * LEVEL_PRESCALE, torch.where(small, one * (1.0 / LEVEL_PRESCALE), one))
    return torch.where(big | small, fl / (s * p), m0), p


def level_quantize(x: torch.Tensor, scales: torch.Tensor, bucket: int, levels: int, seed: int):
    """Stochastic codes of QSGD/TernGrad, bit-packed with :func:`level_bits` bits.

    Entry ``i`` of bucket ``b``: ``(m, p) = level_multiplier(levels, s_b)`` (``s_b`` replaced by 1
    unless ``> 0``), ``q = clamp(floor((|x_i| * p) * m + u_i), 0, levels)`` (NaN -> 0), code
    ``levels - q`` when ``x_i``'s sign bit is set else ``levels + q``.
    ``E[code - levels] = x_i * levels / s_b`` (``p`` is 1 unless ``levels / s_b`` is not a normal fp32).
    """
    xf = x.reshape(-1).float()
    n = xf.numel()
    b = max(1, min(int(bucket), n))
    s = scales.reshape(-1).float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    fl = torch.tensor(float(levels), dtype=torch.float32, device=xf.device)
    mul, pre = level_multiplier(fl, s)
    y = (xf.abs() * pre.repeat_interleave(b)[:n]) * mul.repeat_interleave(b)[:n] + counter_uniform(
        seed, 0, n, xf.device)
    q = torch.nan_to_num(torch.floor(y).clamp(0, levels), nan=0.0).to(torch.int32)
    neg = xf.view(torch.int32) < 0
    codes = torch.where(neg, levels - q, levels + q)
    return pack_bits(codes, level_bits(levels))


def qsgd_quantize(x: torch.Tensor, levels: int, bucket: int, seed: int):
    """QSGD in one call: ``norms = bucket_norms(x, bucket)`` and
    ``level_quantize(x, norms, bucket, levels, seed)``; returns ``(packed, norms)``
    (the fast backends compute both in one pass over ``x`` for cache-sized buckets)."""
    norms = bucket_norms(x, bucket)
    return level_quantize(x, norms, bucket, levels, seed), norms


def level_dequantize(packed: torch.Tensor, scales: torch.Tensor, bucket: int, levels: int, numel: int,
                     out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """Decode :func:`level_quantize`: ``(code - levels) * (s_b / levels)`` in fp32."""
    b = max(1, min(int(bucket), int(numel)))
    codes = unpack_bits(packed, level_bits(levels), numel).to(torch.float32) - levels
    step = scales.reshape(-1).float() / float(levels)
    return _emit(codes * step.repeat_interleave(b)[:numel], out, accumulate)


def qsgd_quantize_feedback(x: torch.Tensor, residual: torch.Tensor | None, beta: float, levels: int, bucket: int,
                           seed: int, new_residual: torch.Tensor, scale: float = 1.0):
    """Error-feedback QSGD in one call: ``c = x*scale + residual*beta`` (fp32, see
    :func:`compensated`), ``(packed, norms) = qsgd_quantize(c, levels, bucket, seed)``,
    ``new_residual = c - level_dequantize(packed, norms, ...)``.

    Returns ``(packed, norms, finite)``: ``finite`` (0-dim bool) is False when some norm is not
    finite (some ``c`` is NaN/inf), and then ``new_residual`` must not be used.  ``residual``
    (fp32, ``x``'s numel, or ``None`` for zero) and ``new_residual`` (fp32, contiguous, ``x``'s
    numel) may be the same tensor; ``new_residual`` may be ``x`` itself.
    """
    c = compensated(x, residual, beta, scale)
    packed, norms = qsgd_quantize(c, levels, bucket, seed)
    dec = level_dequantize(packed, norms, bucket, levels, c.numel())
    new_residual.view(-1).copy_(c - dec)
    return packed, norms, torch.isfinite(norms).all()


def terngrad_quantize_feedback(x: torch.Tensor, residual: torch.Tensor | None, beta: float, seed: int,
                               new_residual: torch.Tensor, scale: float = 1.0):
    """Error-feedback TernGrad in one call: ``c = x*scale + residual*beta`` (fp32, see
    :func:`compensated`), ``s = max |c|`` (one fp32 scale, NaN when some ``c`` is NaN, 0 when empty),
    ``packed = level_quantize(c, s, numel, 1, seed)`` (2-bit codes),
    ``new_residual = c - level_dequantize(packed, s, ...)``.

    Returns ``(packed, s, finite)``: ``finite`` (0-dim bool) is False when ``s`` is not finite
    (some ``c`` is NaN/inf), and then ``new_residual`` must not be used.  ``residual`` and
    ``new_residual`` as for :func:`qsgd_quantize_feedback`.
    """
    c = compensated(x, residual, beta, scale)
    n = c.numel()
    s = block_absmax(c, max(n, 1)).reshape(1) if n else torch.zeros(1, dtype=torch.float32, device=c.device)
    packed = level_quantize(c, s, max(n, 1), 1, seed)
    dec = level_dequantize(packed, s, max(n, 1), 1, n)
    new_residual.view(-1).copy_(c - dec)
    return packed, s, torch.isfinite(s).all()


def sign_pack_feedback(x: torch.Tensor, residual: torch.Tensor, beta: float, chunk: int,
                       new_residual: torch.Tensor):
    """Error-feedback scaled sign in one pass: ``c = x + residual * beta`` (fp32; ``x + residual``
    when ``beta == 1``), ``(bits, scales) = sign_pack(c)``, ``new_residual = c - sign_unpack``.

    Returns ``(bits, scales, finite)``: ``finite`` (0-dim bool) is False when ``c`` or a
    scale is NaN/inf, and then ``new_residual`` must not be used.  ``residual`` and
    ``new_residual`` are fp32 with ``x``'s numel and must not overlap.
    """
    xf = x.reshape(-1).float()
    r = residual.reshape(-1)
    c = xf + r if float(beta) == 1.0 else xf + r * torch.tensor(float(beta), dtype=torch.float32)
    bits, scales = sign_pack(c, chunk)
    dec = sign_unpack(bits, scales, chunk, c.numel())
    new_residual.view(-1).copy_(c - dec)
    finite = torch.isfinite(scales).all() & torch.isfinite(c).all()
    return bits, scales, finite


def block_quantize_feedback(x: torch.Tensor, residual: torch.Tensor | None, beta: float, bits: int, block: int,
                            new_residual: torch.Tensor, scale: float = 1.0,
                            velocity: tuple[torch.Tensor | None, float, torch.Tensor] | None = None):
    """Error-feedback block quantization in one pass: ``c = x*scale + residual*beta`` (fp32, see
    :func:`compensated`), ``(packed, scales) = block_quantize(c, bits, block)`` (round to
    nearest), ``new_residual = c - block_dequantize(packed, scales)``.

    Returns ``(packed, scales, finite)``: ``finite`` (0-dim bool) is False when some ``c`` is
    NaN/inf (its block's scale is not finite), and then ``new_residual`` must not be used.
    ``residual`` (fp32, ``x``'s numel, or ``None`` for zero) and ``new_residual`` (fp32,
    contiguous, ``x``'s numel) may be the same tensor; ``new_residual`` may be ``x`` itself.
    ``velocity``: momentum correction first, as for :func:`topk_compact_feedback`.
    """
    if velocity is not None:
        x, scale = accumulate_velocity(x.reshape(-1), scale, *velocity), 1.0
    c = compensated(x, residual, beta, scale)
    packed, scales = block_quantize(c, bits, block)
    dec = block_dequantize(packed, scales, bits, block, c.numel())
    new_residual.view(-1).copy_(c - dec)
    return packed, scales, torch.isfinite(scales).all()


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
    "magnitude_key", "threshold_compact", "topk_compact", "topk_compact_feedback",
    "cast_feedback", "scatter_add_",
    "pack_bits", "unpack_bits", "bitmap_encode", "bitmap_decode", "hash_partition",
    "qmax_for", "block_absmax", "block_quantize", "block_dequantize", "block_dequantize_sum",
    "sign_pack", "sign_unpack",
    "minifloat_codes", "fp8_quantize", "fp8_dequantize", "mx_quantize", "mx_dequantize",
    "bucket_norms", "level_quantize", "qsgd_quantize", "level_dequantize", "sign_pack_feedback", "block_quantize_feedback",
    "qsgd_quantize_feedback", "terngrad_quantize_feedback",
]
