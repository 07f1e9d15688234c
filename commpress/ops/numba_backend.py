"""The ``"numba"`` backend: fused CPU kernels, bitwise equal to :mod:`.reference`.

Tensors go in and out zero-copy through ``Tensor.numpy()`` (CPU, contiguous;
other layouts are made contiguous first, and fp16/bf16/fp64 inputs are
converted to fp32 once, as the reference does).  Inputs the kernels do not
cover (non-CPU tensors, unusual dtypes or shapes, invalid arguments) are handed
to the reference, which defines the result or the error.

Importing this module raises ``ImportError`` when numba is missing, and
:mod:`commpress.ops` then simply does not register the backend.
"""

from __future__ import annotations

import functools
import logging
import math
import os

import numpy as np
import torch

from . import _numba_kernels as K
from . import reference as ref
from ._args import codes_u8, threshold_key_range, valid_bits, valid_block

log = logging.getLogger("commpress")

#: Smallest parallel chunk (elements).  Results never depend on it; tests lower it
#: to exercise the multi-chunk paths on small inputs.
MIN_CHUNK = 1 << 15
#: Elements per block-quantization chunk (whole blocks, kept cache-resident).
QUANT_CHUNK = 1 << 14
#: Inputs smaller than this (elements) run on the calling thread alone.  Handing chunks to the
#: kernels' pool and waiting for them costs ~130 us per call on a 2-core VM (two thread wake-ups),
#: so a second thread paid for block quantization, top-k and the counter hash only from 2**20
#: elements there (1.6x, 1.25x, 1.8x; ``tests/ops/test_ops_numba_threads.py`` checks the bits).
SERIAL_BELOW = 1 << 20
#: Sample size used by top-k to estimate its candidate threshold (:func:`_sample_runs`).
TOPK_SAMPLE = 1 << 14
#: Consecutive entries per run of that sample (one 64-byte cache line of fp32).
SAMPLE_RUN = 16

_MAX_KEY = 0x7FFFFFFF
_INF_KEY = 0x7F800000
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INTS = (torch.int32, torch.int64)


def _cpu(*tensors) -> bool:
    return all(t is None or t.device.type == "cpu" for t in tensors)


def _f32(x: torch.Tensor) -> torch.Tensor:
    """Flat, contiguous fp32 version of ``x`` (no copy when it already is)."""
    flat = x.detach().reshape(-1)
    if flat.dtype != torch.float32:
        flat = flat.float()
    return flat.contiguous()


def _bits_view(t: torch.Tensor) -> np.ndarray:
    """The int32 bit patterns of a contiguous fp32 tensor (shares memory)."""
    return t.detach().numpy().view(np.int32)


def _threads() -> int:
    """Threads the next kernel call may split its chunks over (:func:`._numba_kernels.use_threads`)."""
    return K.kernel_threads()


def _chunk(n: int, multiple: int = 64) -> int:
    """Parallel chunk length: several chunks per thread, at least ``MIN_CHUNK``."""
    c = max(MIN_CHUNK, -(-n // (4 * _threads())))
    return -(-c // multiple) * multiple


def _quant_chunk(block: int) -> int:
    """Chunk of whole blocks and whole bytes (a multiple of ``lcm(block, 8)``)."""
    unit = block * 8 // math.gcd(block, 8)
    return unit * max(1, QUANT_CHUNK // unit)


def _index_np(n: int):
    return np.int32 if ref.index_dtype(n) == torch.int32 else np.int64


def _fused_residual(flat: torch.Tensor, residual: torch.Tensor | None):
    """(mode, int32 view) when the residual can be written by the kernel, else None."""
    if residual is None:
        return None
    if (flat.dtype != torch.float32 or residual.dtype != torch.float32
            or residual.device.type != "cpu" or not residual.is_contiguous()
            or residual.numel() != flat.numel() or residual.requires_grad):
        return None
    r = residual.view(-1)
    return (1 if r.data_ptr() == flat.data_ptr() else 2), _bits_view(r)


def _residual_torch(flat: torch.Tensor, residual: torch.Tensor, idx: torch.Tensor) -> None:
    r = residual.view(-1)
    if r.data_ptr() != flat.data_ptr():
        r.copy_(flat)
    r[idx.to(torch.int64)] = 0


def _finish_selection(x, flat, xf, idx_np, val_np, residual, fused):
    idx = torch.from_numpy(idx_np)
    if x.dtype == torch.float32:
        values = torch.from_numpy(val_np.view(np.float32))
    else:
        values = flat[idx.to(torch.int64)].clone()
    if residual is not None and fused is None:
        _residual_torch(flat, residual, idx)
    return idx, values


# ---------------------------------------------------------------- selection
def threshold_compact(x: torch.Tensor, threshold: float, residual: torch.Tensor | None = None):
    """See :func:`commpress.ops.reference.threshold_compact`."""
    if not _cpu(x, residual) or x.dtype not in _FLOATS:
        return ref.threshold_compact(x, threshold, residual)
    flat = x.reshape(-1)
    xf = _f32(flat)
    xi = _bits_view(xf)
    lo, hi = threshold_key_range(threshold)
    fused = _fused_residual(flat, residual)
    mode, res = (fused if fused is not None else (0, xi))
    idx_np, val_np = _select(xi, lo, hi, res, mode, _sample_fraction(xi, lo, hi))
    return _finish_selection(x, flat, xf, idx_np, val_np, residual, fused)


def _sample_fraction(xi: np.ndarray, lo: int, hi: int) -> float:
    """Fraction of a strided sample whose key lies in ``[lo, hi]`` (1.0 for small inputs)."""
    n = xi.size
    m = 16384
    if n < 16 * m:
        return 1.0
    stride = n // m
    keys = xi[: stride * m: stride] & _MAX_KEY
    return float(np.count_nonzero((keys >= lo) & (keys <= hi))) / m


def _select(xi: np.ndarray, lo: int, hi: int, res: np.ndarray, mode: int, frac: float):
    """Indices and value bits of the entries with key in ``[lo, hi]``, in index order.

    One pass into per-chunk slots sized from the expected fraction ``frac``;
    chunks that overflow their slot are rescanned (correct for any ``frac``).
    """
    n = xi.size
    clen, nch, cap, ibuf, vbuf = _chunk_slots(n, frac)
    lo32, hi32 = np.int32(lo), np.int32(hi)
    counts = K.select_chunks(xi, lo32, hi32, clen, cap, ibuf, vbuf, res, mode)
    total = int(counts.sum())
    idx = np.empty(total, _index_np(n))
    val = np.empty(total, np.int32)
    K.select_gather(xi, lo32, hi32, clen, cap, ibuf, vbuf, counts, idx, val, res, mode)
    return idx, val


def _sample_runs(a: np.ndarray, m: int) -> np.ndarray:
    """``m`` entries of the flat contiguous ``a`` (``a.size >= 4 * m``) as ``m // SAMPLE_RUN`` evenly
    spaced runs of :data:`SAMPLE_RUN` consecutive ones: a ``(runs, SAMPLE_RUN)`` view, no copy.  A run
    is one cache line of fp32, so a sample reads ``m / 16`` lines of a cold gradient, where a
    stride of one entry per line read ``m``."""
    runs, run, step = _sample_geometry(a.size, m)
    return a[:runs * step].reshape(runs, step)[:, :run]   # a view (as_strided costs tens of microseconds)


def _sample_geometry(size: int, m: int) -> tuple[int, int, int]:
    """``(runs, run, step)`` of :func:`_sample_runs`' ``m`` entries of ``size``: ``runs`` runs of
    ``run`` consecutive entries, ``step`` apart (``>= 4 * run``: the runs never overlap)."""
    run = min(SAMPLE_RUN, m)
    runs = m // run
    return runs, run, size // runs


def _candidate_thresholds(xi: np.ndarray, k: int, sample_keys=None):
    """Yield decreasing (key, expected fraction passing) to try as top-``k`` candidate thresholds.

    From a sample (:func:`_sample_runs`): the key ranked a few standard deviations beyond the
    expected rank of the ``k``-th largest, then lower ones; ends with 0 (all).
    Lazy: usually only the first is needed.  ``sample_keys(m)``: the magnitude keys of the
    :func:`_sample_runs` ``m`` entries, flat (default: read from ``xi``).
    """
    n = xi.size
    m = TOPK_SAMPLE
    if n >= 4 * m:
        sample = (sample_keys(m) if sample_keys is not None else _sample_runs(xi, m) & _MAX_KEY).reshape(-1)
        m = sample.size
        expected = k * m / n
        r = int(expected + 4.0 * math.sqrt(expected) + 8)
        while r < m // 2:
            yield int(np.partition(sample, m - r)[m - r]), r / m
            r *= 4
    yield 0, 1.0


def topk_compact(x: torch.Tensor, k: int, residual: torch.Tensor | None = None):
    """See :func:`commpress.ops.reference.topk_compact`.

    A threshold key estimated from a strided sample picks candidates (one count
    pass and one compaction pass, which also copies the residual); an exact
    selection on the candidates finishes, lowering the threshold if fewer than
    ``k`` entries passed it.
    """
    if not _cpu(x, residual) or x.dtype not in _FLOATS:
        return ref.topk_compact(x, k, residual)
    flat = x.reshape(-1)
    n = flat.numel()
    k = max(0, min(int(k), n))
    xf = _f32(flat)
    xi = _bits_view(xf)
    fused = _fused_residual(flat, residual)
    res = fused[1] if fused is not None else xi
    if k == 0:
        idx = torch.empty(0, dtype=ref.index_dtype(n))
        if residual is not None:
            _residual_torch(flat, residual, idx)
        return idx, flat[:0].clone()
    # A separate residual gets x with every candidate zeroed in the pass (while in cache);
    # the candidates not chosen are restored afterwards (fewer random writes than zeroing).
    mode = 2 if fused is not None and fused[0] == 2 else 0
    for lo, frac in _candidate_thresholds(xi, k):
        cidx, cval = _select(xi, lo, _MAX_KEY, res, mode, frac)
        if cidx.size >= k:
            break
    take = np.empty(cidx.size, np.uint8)
    idx_np, val_np = K.topk_finish(cidx, cval, k, take)
    if mode == 2:
        K.restore_unselected(res, cidx, cval, take)
    elif fused is not None:
        K.zero_at(res, idx_np)
    return _finish_selection(x, flat, xf, idx_np, val_np, residual, fused)


def _fb_layout_ok(x: torch.Tensor, residual: torch.Tensor | None, new_residual: torch.Tensor) -> bool:
    """``new_residual`` is a plain fp32 CPU buffer of ``x``'s numel, and it either is or
    does not overlap ``x`` and ``residual`` (the kernel works elementwise)."""
    n = x.numel()
    if (not _cpu(x, residual, new_residual) or x.dtype not in _FLOATS
            or new_residual.dtype != torch.float32 or not new_residual.is_contiguous()
            or new_residual.numel() != n or new_residual.requires_grad):
        return False
    if residual is not None and (residual.dtype != torch.float32 or not residual.is_contiguous()
                                 or residual.numel() != n):
        return False
    out_storage = new_residual.untyped_storage().data_ptr()
    for t in (x, residual):
        if t is None or t.untyped_storage().data_ptr() != out_storage:
            continue
        if t.data_ptr() != new_residual.data_ptr() or not t.is_contiguous() or t.dtype != torch.float32:
            return False
    return True


@functools.lru_cache(maxsize=None)
def velocity_mode() -> str | None:
    """How torch's CPU ``add(other, alpha=m)`` rounds on this machine, which the fused momentum
    correction must reproduce: ``"fma"`` (one rounding, ATen's vectorized ``fmadd`` on CPUs
    with FMA), ``"plain"`` (the product rounded on its own) or ``None`` (neither, everywhere:
    the velocity is then computed with torch's ops, unfused).  Probed once against
    :func:`commpress.ops._numba_kernels.compensate`: on a long vector with a remainder (ATen's
    vector body and its tail) and on every length up to 40 (tails alone)."""
    rng = np.random.default_rng(0)
    m = 0.9
    sizes = [4 * 8192 + 13, *range(1, 41)]
    cases = []
    for n in sizes:
        x, v = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
        cases.append((x, v, torch.add(torch.from_numpy(x), torch.from_numpy(v), alpha=m).numpy().view(np.int32)))
    for mode, bit in (("fma", 32), ("plain", 0)):
        for x, v, want in cases:
            u, c = np.empty(x.size, np.float32), np.empty(x.size, np.float32)
            K.compensate(x, x, _F1, _F1, 8 | 16 | bit, c, _chunk(x.size), v, np.float32(m), u)
            if not np.array_equal(u.view(np.int32), want):
                break
        else:
            return mode
    log.info("numba backend: torch's add(alpha=) rounds like neither fma nor a separate product here; "
             "momentum correction keeps torch's ops for its velocity")
    return None


def _velocity_ok(x: torch.Tensor, velocity) -> bool:
    """Whether the kernels can compute this velocity (:func:`velocity_mode` known, fp32 buffers
    of ``x``'s numel, ``new`` contiguous)."""
    live, _, new = velocity
    n = x.numel()
    if x.dtype != torch.float32 or not _cpu(live, new) or velocity_mode() is None:
        return False
    if new.dtype != torch.float32 or not new.is_contiguous() or new.numel() != n or new.requires_grad:
        return False
    return live is None or (live.dtype == torch.float32 and live.is_contiguous() and live.numel() == n)


def _velocity_args(velocity, x: np.ndarray) -> tuple[np.ndarray, np.float32, np.ndarray, int]:
    """The kernels' momentum arguments ``(v, m, uout, how bits)`` for ``velocity=(live, momentum,
    new)`` (tensors :func:`_velocity_ok` accepted): bit 8, and 16 with a live velocity (32 where
    torch rounds it with an FMA).  ``None``: placeholders no kernel reads (``x``), and no bits."""
    if velocity is None:
        return x, _F0, x, 0
    live, momentum, new = velocity
    if live is None:
        return x, np.float32(momentum), new.view(-1).numpy(), 8
    bits = 8 | 16 | (32 if velocity_mode() == "fma" else 0)
    return live.view(-1).numpy(), np.float32(momentum), new.view(-1).numpy(), bits


def topk_compact_feedback(x: torch.Tensor, residual: torch.Tensor | None, beta: float, k: int,
                          new_residual: torch.Tensor, scale: float = 1.0, velocity=None):
    """See :func:`commpress.ops.reference.topk_compact_feedback`.

    As :func:`topk_compact`, with the compensation fused into the candidate pass: each
    piece of ``c = x*scale + residual*beta`` is written into ``new_residual`` and
    compacted while in cache (read ``x`` and ``residual``, write ``c``: no separate
    compensated tensor, no second read); the threshold sample is compensated on its
    own; the chosen entries are then zeroed in ``new_residual``.  With ``velocity``, the
    momentum correction's velocity is computed and written in the same pass
    (:func:`velocity_mode` says how it rounds; where it is unknown, torch's ops compute it first).
    """
    if not _fb_layout_ok(x, residual, new_residual):
        return ref.topk_compact_feedback(x, residual, beta, k, new_residual, scale, velocity)
    if velocity is not None and not _velocity_ok(x, velocity):
        x, scale, velocity = ref.accumulate_velocity(x.reshape(-1), scale, *velocity), 1.0, None
    n = x.numel()
    k = max(0, min(int(k), n))
    xf = _f32(x.reshape(-1)).numpy()
    rf = residual.view(-1).numpy() if residual is not None else None
    idx_np, val_bits = topk_feedback_arrays(xf, rf, beta, scale, k, new_residual.view(-1).numpy(), velocity)
    if idx_np is None:
        return torch.empty(0, dtype=ref.index_dtype(n)), torch.empty(0, dtype=torch.float32)
    return torch.from_numpy(idx_np), torch.from_numpy(val_bits.view(np.float32))


def topk_feedback_arrays(xf: np.ndarray, rf: np.ndarray | None, beta: float, scale: float, k: int, out: np.ndarray,
                         velocity=None) -> tuple[np.ndarray | None, np.ndarray]:
    """The kernel calls of :func:`topk_compact_feedback` on flat numpy arrays the caller owns (fp32
    ``xf``, ``rf`` or ``None``, ``out`` the new residual; ``0 <= k <= xf.size``; ``velocity``:
    ``(live, momentum, new)`` tensors that :func:`_velocity_ok` accepted, or ``None``).  Returns
    the chosen indices (index order) and their values' bits (int32), or ``(None, None)`` for
    ``k == 0`` (compensated only).  What the sparse steady-state lane
    (:mod:`commpress.collectives.steady_sparse`) calls."""
    n = xf.size
    oi = out.view(np.int32)
    has_r = rf is not None
    rf = rf if has_r else xf
    b32, s32 = np.float32(beta), np.float32(scale)
    how = (1 if has_r else 0) | (2 if has_r and float(beta) != 1.0 else 0) | (4 if float(scale) != 1.0 else 0)
    vf, m32, uf, vbits = _velocity_args(velocity, xf)
    how |= vbits

    def sample_keys(m: int) -> np.ndarray:   # the runs of _sample_runs, compensated in one kernel pass
        runs, run, step = _sample_geometry(n, m)
        keys = np.empty(runs * run, np.int32)
        # the velocity, unfused (how bit 16): the sample only places the threshold
        K.sample_keys(xf, rf, b32, s32, how, vf, m32, runs, run, step, keys.view(np.float32), keys)
        return keys

    if k == 0:  # compensate only
        K.compensate(xf, rf, b32, s32, how, out, _chunk(n), vf, m32, uf)
        return None, None
    first, zeroed = True, False
    for lo, frac in _candidate_thresholds(oi, k, sample_keys):
        if first:  # the fused pass: c is written, its candidates compacted and zeroed
            cidx, cval, zeroed = _select_feedback(xf, rf, b32, s32, how, out, oi, min(lo, _INF_KEY), frac,
                                                  vf, m32, uf)
            first = False
        else:  # a lower threshold: c is in new_residual now
            if zeroed:   # the fused pass's candidates get their values back first
                oi[cidx] = cval
                zeroed = False
            cidx, cval = _select(oi, lo, _MAX_KEY, oi, 0, frac)
        if cidx.size >= k:
            break
    take = np.empty(cidx.size, np.uint8)
    idx_np, val_np = K.topk_finish(cidx, cval, k, take)
    if zeroed:
        K.restore_unselected(oi, cidx, cval, take)
    else:
        K.zero_at(oi, idx_np)
    return idx_np, val_np


def _chunk_slots(n: int, frac: float):
    """Per-chunk output slots for a selection of an expected fraction ``frac`` of ``n`` entries:
    ``(chunk length, chunks, slots per chunk, index buffer, value-bits buffer)``.  The slack
    covers sampling error (~5 sigma of a 4096-entry sample) and uneven chunks."""
    clen = _chunk(n)
    nch = (n + clen - 1) // clen
    cap = min(clen, int(clen * (1.2 * frac + 5.0 * math.sqrt(frac / 4096)) + 64))
    return clen, nch, cap, np.empty(nch * cap, _index_np(n)), np.empty(nch * cap, np.int32)


def _select_feedback(xf, rf, b32, s32, how, out, oi, lo: int, frac: float, vf, m32, uf):
    """:func:`_select` (keys ``[lo, max]``, ``lo <= inf``'s key) over the compensated input,
    written into ``out`` in the same pass (the velocity into ``uf`` with ``how`` bit 8).
    Returns ``(indices, value bits, zeroed)``: with ``zeroed`` every candidate is 0 in ``out``
    (the caller restores those not chosen), else every one holds its value."""
    n = xf.size
    clen, nch, cap, ibuf, vbuf = _chunk_slots(n, frac)
    thr = np.array([lo], np.int32).view(np.float32)[0]  # |c| >= thr  <=>  key(c) >= lo
    counts = K.select_chunks_feedback(xf, rf, b32, s32, how, thr, out, oi, clen, cap, ibuf, vbuf, vf, m32, uf)
    total = int(counts.sum())
    idx = np.empty(total, _index_np(n))
    val = np.empty(total, np.int32)
    K.select_gather(oi, np.int32(lo), np.int32(_MAX_KEY), clen, cap, ibuf, vbuf, counts, idx, val, oi, 0)
    overflowed = bool((counts > cap).any())
    if overflowed:   # an overflowed chunk kept its values: back to one rule, every candidate's value in out
        oi[idx] = val
    return idx, val, not overflowed


def magnitude_key(x: torch.Tensor) -> torch.Tensor:
    """See :func:`commpress.ops.reference.magnitude_key`."""
    if not _cpu(x) or x.dtype not in _FLOATS:
        return ref.magnitude_key(x)
    xf = _f32(x)
    out = np.empty(xf.numel(), np.int64)
    K.magnitude_key(_bits_view(xf), out)
    return torch.from_numpy(out).reshape(x.shape)


def scatter_add_(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """See :func:`commpress.ops.reference.scatter_add_` (duplicates add in order)."""
    if (not _cpu(out, indices, values) or out.dtype not in (torch.float32, torch.float64)
            or out.dim() != 1 or not out.is_contiguous() or indices.dtype not in _INTS
            or indices.dim() != 1 or values.dim() != 1 or indices.numel() != values.numel()
            or out.requires_grad):
        return ref.scatter_add_(out, indices, values)
    scatter_add_into(out.numpy(), indices.contiguous().numpy(), values.detach().to(out.dtype).contiguous().numpy())
    return out


def zero_entries(a: np.ndarray, idx: np.ndarray) -> None:
    """``a[idx] = 0`` for a flat fp32 array and in-range indices (the kernel's scattered write:
    numpy's fancy index converts the indices first)."""
    K.zero_at(a.view(np.int32), idx)


def scatter_add_into(out: np.ndarray, idx: np.ndarray, val: np.ndarray) -> None:
    """The kernel call of :func:`scatter_add_` on numpy arrays (``out`` flat fp32 / fp64, ``idx``
    int32 / int64, ``val`` of ``out``'s dtype, e.g. views into a gathered message)."""
    nparts = 1 if idx.size < 4096 else _threads()
    bad = K.scatter_add(out, idx, val, nparts)
    if bad >= 0:
        raise IndexError(f"scatter_add_: indices[{bad}] = {int(idx[bad])} is out of range "
                         f"for out of size {out.size}")


# ---------------------------------------------------------------- random numbers and hashing
def counter_bits(seed: int, start: int, n: int, device="cpu") -> torch.Tensor:
    """See :func:`commpress.ops.reference.counter_bits`."""
    if torch.device(device).type != "cpu":
        return ref.counter_bits(seed, start, n, device)
    k0, k1 = ref.seed_words(seed)
    out = np.empty(int(n), np.int64)
    K.counter_bits(np.uint64(int(start) & ref.MASK32), int(n), np.uint64(k0), np.uint64(k1), out)
    return torch.from_numpy(out)


def counter_uniform(seed: int, start: int, n: int, device="cpu") -> torch.Tensor:
    """See :func:`commpress.ops.reference.counter_uniform`."""
    if torch.device(device).type != "cpu":
        return ref.counter_uniform(seed, start, n, device)
    k0, k1 = ref.seed_words(seed)
    out = np.empty(int(n), np.float32)
    K.counter_uniform(np.uint64(int(start) & ref.MASK32), int(n), np.uint64(k0), np.uint64(k1), out)
    return torch.from_numpy(out)


def _int64_np(indices: torch.Tensor) -> np.ndarray:
    return indices.reshape(-1).to(torch.int64).contiguous().numpy()


def hash_owner(indices: torch.Tensor, world_size: int) -> torch.Tensor:
    """See :func:`commpress.ops.reference.hash_owner`."""
    if not _cpu(indices) or indices.is_floating_point() or int(world_size) < 1:
        return ref.hash_owner(indices, world_size)
    out = np.empty(indices.numel(), np.int64)
    K.hash_owner(_int64_np(indices), int(world_size), out)
    return torch.from_numpy(out).reshape(indices.shape)


def hash_partition(indices: torch.Tensor, world_size: int):
    """See :func:`commpress.ops.reference.hash_partition`."""
    if (not _cpu(indices) or indices.is_floating_point() or indices.dim() != 1
            or int(world_size) < 1):
        return ref.hash_partition(indices, world_size)
    idx = _int64_np(indices)
    counts = np.empty(int(world_size), np.int64)
    order = np.empty(idx.size, np.int64)
    K.hash_partition(idx, int(world_size), _chunk(idx.size), counts, order)
    return torch.from_numpy(counts), torch.from_numpy(order)


# ---------------------------------------------------------------- bit packing

def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """See :func:`commpress.ops.reference.pack_bits`."""
    if not _cpu(codes) or not valid_bits(bits) or codes.is_complex():
        return ref.pack_bits(codes, bits)
    bits = int(bits)
    c = codes_u8(codes, bits).numpy()
    packed = np.empty((c.size * bits + 7) // 8, np.uint8)
    K.pack_bits(c, bits, _chunk(c.size), packed)
    return torch.from_numpy(packed)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """See :func:`commpress.ops.reference.unpack_bits`."""
    numel = int(numel)
    if (not _cpu(packed) or not valid_bits(bits) or packed.dtype != torch.uint8 or numel < 0
            or packed.numel() < (numel * int(bits) + 7) // 8):
        return ref.unpack_bits(packed, bits, numel)
    codes = np.empty(numel, np.uint8)
    K.unpack_bits(packed.reshape(-1).contiguous().numpy(), int(bits), numel, _chunk(numel), codes)
    return torch.from_numpy(codes)


def bitmap_encode(indices: torch.Tensor, numel: int) -> torch.Tensor:
    """See :func:`commpress.ops.reference.bitmap_encode`."""
    numel = int(numel)
    if not _cpu(indices) or indices.dtype not in _INTS or numel < 0:
        return ref.bitmap_encode(indices, numel)
    idx = indices.reshape(-1).contiguous().numpy()
    bitmap = np.zeros((numel + 7) // 8, np.uint8)
    bad = K.bitmap_encode(idx, numel, bitmap)
    if bad >= 0:
        raise IndexError(f"bitmap_encode: indices[{bad}] = {int(idx[bad])} is out of range "
                         f"for numel {numel}")
    return torch.from_numpy(bitmap)


def bitmap_decode(bitmap: torch.Tensor, numel: int) -> torch.Tensor:
    """See :func:`commpress.ops.reference.bitmap_decode`."""
    numel = int(numel)
    if (not _cpu(bitmap) or bitmap.dtype != torch.uint8 or numel < 0
            or bitmap.numel() < (numel + 7) // 8):
        return ref.bitmap_decode(bitmap, numel)
    bm = bitmap.reshape(-1).contiguous().numpy()
    clen = _chunk(numel)
    counts = K.bitmap_count(bm, numel, clen)
    out = np.empty(int(counts.sum()), _index_np(numel))
    K.bitmap_write(bm, numel, clen, counts, out)
    return torch.from_numpy(out)


# ---------------------------------------------------------------- block quantization

def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """See :func:`commpress.ops.reference.block_absmax`."""
    if not _cpu(x) or x.dtype not in _FLOATS or not valid_block(block):
        return ref.block_absmax(x, block)
    xf = _f32(x)
    n = xf.numel()
    scales = np.empty((n + block - 1) // block, np.float32)
    K.block_absmax(_bits_view(xf), int(block), scales.view(np.int32))
    return torch.from_numpy(scales)


def block_quantize(x: torch.Tensor, bits: int, block: int, stochastic: bool = False, seed: int = 0):
    """See :func:`commpress.ops.reference.block_quantize` (one pass per chunk of blocks)."""
    if not _cpu(x) or x.dtype not in _FLOATS or not valid_bits(bits) or not valid_block(block):
        return ref.block_quantize(x, bits, block, stochastic, seed)
    bits, block = int(bits), int(block)
    xf = _f32(x)
    n = xf.numel()
    packed = np.empty((n * bits + 7) // 8, np.uint8)
    scales = np.empty((n + block - 1) // block, np.float32)
    k0, k1 = ref.seed_words(seed)
    xn = xf.numpy()
    K.block_quantize(xn, xn.view(np.int32), bits, block, bool(stochastic), np.uint64(k0),
                     np.uint64(k1), _quant_chunk(block), packed, scales)
    return torch.from_numpy(packed), torch.from_numpy(scales)


def block_dequantize(packed: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int,
                     out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """See :func:`commpress.ops.reference.block_dequantize` (unpack + scale + accumulate fused)."""
    numel = int(numel)
    if (not _cpu(packed, scales, out) or not valid_bits(bits) or not valid_block(block)
            or packed.dtype != torch.uint8 or numel < 0
            or packed.numel() < (numel * int(bits) + 7) // 8
            or scales.numel() < (numel + int(block) - 1) // int(block)
            or not _flat_f32_out(out, numel)):
        return ref.block_dequantize(packed, scales, bits, block, numel, out, accumulate)
    bits, block = int(bits), int(block)
    dst = out if out is not None else torch.empty(numel, dtype=torch.float32)
    p, s = _dequant_inputs(packed, scales)
    K.block_dequantize(p, s, p, s, False, bits, block, numel, _quant_chunk(block), dst.numpy(),
                       bool(accumulate and out is not None))
    return dst


def _flat_f32_out(out: torch.Tensor | None, numel: int) -> bool:
    """``out`` is absent or a flat contiguous fp32 buffer of ``numel`` the kernels may write."""
    return out is None or (out.dtype == torch.float32 and out.dim() == 1 and out.numel() == numel
                           and out.is_contiguous() and not out.requires_grad)


def _dequant_inputs(packed: torch.Tensor, scales: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Flat numpy views (copies only where needed: a torch call per tensor costs more than the
    checks on the hot path's flat contiguous fp32 inputs)."""
    p = packed if packed.dim() == 1 and packed.is_contiguous() else packed.reshape(-1).contiguous()
    if not (scales.dim() == 1 and scales.dtype == torch.float32 and scales.is_contiguous()):
        scales = scales.reshape(-1).float().contiguous()
    return p.numpy(), scales.numpy()


def block_dequantize_sum(packed, scales, bits: int, block: int, numel: int,
                         out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """See :func:`commpress.ops.reference.block_dequantize_sum`: two payloads per pass, each
    chunk of ``out`` written once per pair (the sum in the reference's order)."""
    numel = int(numel)
    pieces = list(zip(packed, scales)) if isinstance(packed, (list, tuple)) and isinstance(scales, (list, tuple)) \
        and len(packed) == len(scales) else None
    if (not pieces or not valid_bits(bits) or not valid_block(block) or numel < 0
            or not _cpu(out, *packed, *scales)
            or any(p.dtype != torch.uint8 or p.numel() < (numel * int(bits) + 7) // 8
                   or s.numel() < (numel + int(block) - 1) // int(block) for p, s in pieces)
            or not _flat_f32_out(out, numel)):
        return ref.block_dequantize_sum(packed, scales, bits, block, numel, out, accumulate)
    dst = out if out is not None else torch.empty(numel, dtype=torch.float32)
    dequantize_sum_into([_dequant_inputs(p, s) for p, s in pieces], int(bits), int(block), numel, dst.numpy(),
                        bool(accumulate and out is not None))
    return dst


def dequantize_sum_into(arrays: list[tuple[np.ndarray, np.ndarray]], bits: int, block: int, numel: int,
                        out: np.ndarray, accumulate: bool = False) -> None:
    """The kernel loop of :func:`block_dequantize_sum` on numpy arrays (``(packed, fp32 scales)`` per
    payload, ``out`` fp32 of ``numel``): two payloads per pass, added in their order.  What the
    steady-state lane (:mod:`commpress.collectives.steady`) calls on message views."""
    clen = _quant_chunk(block)
    for i in range(0, len(arrays), 2):
        pa, sa = arrays[i]
        pb, sb = arrays[i + 1] if i + 1 < len(arrays) else arrays[i]
        K.block_dequantize(pa, sa, pb, sb, i + 1 < len(arrays), bits, block, numel, clen, out, accumulate or i > 0)


def block_quantize_feedback(x: torch.Tensor, residual: torch.Tensor | None, beta: float, bits: int, block: int,
                            new_residual: torch.Tensor, scale: float = 1.0, velocity=None):
    """See :func:`commpress.ops.reference.block_quantize_feedback` (one pass per chunk of blocks:
    read ``x`` and ``residual``, write the codes and the new residual; with ``velocity``, also read
    the live velocity and write the new one, as :func:`topk_compact_feedback`)."""
    if not _fb_layout_ok(x, residual, new_residual) or not valid_bits(bits) or not valid_block(block):
        return ref.block_quantize_feedback(x, residual, beta, bits, block, new_residual, scale, velocity)
    if velocity is not None and not _velocity_ok(x, velocity):
        x, scale, velocity = ref.accumulate_velocity(x.reshape(-1), scale, *velocity), 1.0, None
    bits, block = int(bits), int(block)
    n = x.numel()
    packed = np.empty((n * bits + 7) // 8, np.uint8)
    scales = np.empty((n + block - 1) // block, np.float32)
    bad = quantize_feedback_into(_flat_np(x), None if residual is None else _flat_np(residual), beta, scale, bits,
                                 block, _flat_np(new_residual), packed, scales, velocity)
    return torch.from_numpy(packed), torch.from_numpy(scales), torch.from_numpy(np.array(bad == 0))


def quantize_feedback_into(x: np.ndarray, residual: np.ndarray | None, beta: float, scale: float, bits: int,
                           block: int, new_residual: np.ndarray, packed: np.ndarray, scales: np.ndarray,
                           velocity=None) -> int:
    """The kernel call of :func:`block_quantize_feedback` on flat numpy arrays the caller owns (fp32
    ``x``, ``residual`` or ``None``, ``new_residual``; ``packed`` uint8 of ``ceil(n*bits/8)``,
    ``scales`` fp32 of ``ceil(n/block)``, e.g. views into a message); ``bits`` and ``block`` valid;
    ``velocity``: ``(live, momentum, new)`` tensors that :func:`_velocity_ok` accepted, or ``None``.
    Returns the number of chunks with a non-finite scale.  What the steady-state lane
    (:mod:`commpress.collectives.steady`) calls."""
    has_r = residual is not None
    how = (1 if has_r else 0) | (2 if has_r and float(beta) != 1.0 else 0) | (4 if float(scale) != 1.0 else 0)
    v, m, u, vbits = _velocity_args(velocity, x)
    return K.block_quantize_feedback(x, residual if has_r else x, np.float32(beta), np.float32(scale), how | vbits,
                                     bits, block, _quant_chunk(block), new_residual, packed, scales, v, m, u)


def _flat_np(t: torch.Tensor) -> np.ndarray:
    """A flat fp32 numpy view of ``t`` (contiguous fp32 ones, the hot path, with no torch call but
    ``numpy()``), else of its fp32 copy."""
    if t.dtype == torch.float32 and t.is_contiguous():
        return t.detach().numpy().reshape(-1) if t.requires_grad else t.numpy().reshape(-1)
    return _f32(t).numpy()


# ---------------------------------------------------------------- sign + scale
def sign_pack(x: torch.Tensor, chunk: int):
    """See :func:`commpress.ops.reference.sign_pack`."""
    if not _cpu(x) or x.dtype not in _FLOATS or not valid_block(chunk):
        return ref.sign_pack(x, chunk)
    chunk = int(chunk)
    xf = _f32(x).numpy()
    n = xf.size
    packed = np.empty((n + 7) // 8, np.uint8)
    scales = np.empty((n + chunk - 1) // chunk, np.float32)
    K.sign_bits(xf, packed)
    K.sign_scales(xf, chunk, scales)
    return torch.from_numpy(packed), torch.from_numpy(scales)


def sign_unpack(bits: torch.Tensor, scales: torch.Tensor, chunk: int, numel: int,
                out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """See :func:`commpress.ops.reference.sign_unpack`."""
    numel = int(numel)
    if (not _cpu(bits, scales, out) or not valid_block(chunk) or bits.dtype != torch.uint8
            or numel < 0 or bits.numel() < (numel + 7) // 8
            or scales.numel() < (numel + int(chunk) - 1) // int(chunk)
            or not _flat_f32_out(out, numel)):
        return ref.sign_unpack(bits, scales, chunk, numel, out, accumulate)
    chunk = int(chunk)
    dst = out if out is not None else torch.empty(numel, dtype=torch.float32)
    sc = scales.reshape(-1).float().contiguous().numpy()[: (numel + chunk - 1) // chunk]
    K.sign_unpack(bits.reshape(-1).contiguous().numpy(), np.ascontiguousarray(sc), chunk, numel,
                  dst.numpy(), bool(accumulate and out is not None))
    return dst


# ---------------------------------------------------------------- minifloats (fp8, MX)
#: Format index the kernels specialize on (see ``_numba_kernels._minifloat_any``).
MINIFLOAT_IDS = {"e4m3": 0, "e5m2": 1, "e2m3": 2, "e2m1": 3}
_TABLES = {fmt: ref.minifloat_table(fmt).numpy() for fmt in MINIFLOAT_IDS}


def _valid_out(out, numel) -> bool:
    return out is None or (out.device.type == "cpu" and out.dtype == torch.float32 and out.dim() == 1
                           and out.numel() == numel and out.is_contiguous() and not out.requires_grad)


def fp8_quantize(x: torch.Tensor, fmt: str, block: int, stochastic: bool = False, seed: int = 0):
    """See :func:`commpress.ops.reference.fp8_quantize`."""
    if not _cpu(x) or x.dtype not in _FLOATS or not valid_block(block) or fmt not in ("e4m3", "e5m2"):
        return ref.fp8_quantize(x, fmt, block, stochastic, seed)
    block = int(block)
    fm = np.float32(ref.MINIFLOATS[fmt][2])
    xf = _f32(x)
    n = xf.numel()
    codes = np.empty(n, np.uint8)
    scales = np.empty((n + block - 1) // block, np.float32)
    k0, k1 = ref.seed_words(seed)
    xn = xf.numpy()
    K.fp8_quantize(xn, xn.view(np.int32), block, MINIFLOAT_IDS[fmt], fm, bool(stochastic),
                   np.uint64(k0), np.uint64(k1), _quant_chunk(block), codes, scales)
    return torch.from_numpy(codes), torch.from_numpy(scales)


def fp8_dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: str, block: int, numel: int,
                   out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """See :func:`commpress.ops.reference.fp8_dequantize`."""
    numel = int(numel)
    if (not _cpu(codes, scales, out) or not valid_block(block) or fmt not in ("e4m3", "e5m2")
            or codes.element_size() != 1 or numel < 0 or codes.numel() < numel
            or scales.numel() < (numel + int(block) - 1) // int(block) or not _valid_out(out, numel)):
        return ref.fp8_dequantize(codes, scales, fmt, block, numel, out, accumulate)
    block = int(block)
    table = _TABLES[fmt]
    c = codes.reshape(-1)
    c = (c if c.dtype == torch.uint8 else c.view(torch.uint8)).contiguous().numpy()
    dst = out if out is not None else torch.empty(numel, dtype=torch.float32)
    K.fp8_dequantize(c, scales.reshape(-1).float().contiguous().numpy(), table, block, numel,
                     _quant_chunk(block), dst.numpy(), bool(accumulate and out is not None))
    return dst


def mx_quantize(x: torch.Tensor, element: str, stochastic: bool = False, seed: int = 0):
    """See :func:`commpress.ops.reference.mx_quantize`."""
    if not _cpu(x) or x.dtype not in _FLOATS or element not in ref.MX_ELEMENTS:
        return ref.mx_quantize(x, element, stochastic, seed)
    fmt, bits, emax = ref.MX_ELEMENTS[element]
    xf = _f32(x)
    n = xf.numel()
    packed = np.empty((n * bits + 7) // 8, np.uint8)
    scale_bytes = np.empty((n + ref.MX_BLOCK - 1) // ref.MX_BLOCK, np.uint8)
    k0, k1 = ref.seed_words(seed)
    xn = xf.numpy()
    K.mx_quantize(xn, xn.view(np.int32), bits, np.int32(emax), MINIFLOAT_IDS[fmt], bool(stochastic),
                  np.uint64(k0), np.uint64(k1), _quant_chunk(ref.MX_BLOCK), packed, scale_bytes)
    return torch.from_numpy(packed), torch.from_numpy(scale_bytes)


_E8M0 = ref.e8m0_table().numpy()


def mx_dequantize(packed: torch.Tensor, scales: torch.Tensor, element: str, numel: int,
                  out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """See :func:`commpress.ops.reference.mx_dequantize`."""
    numel = int(numel)
    if (not _cpu(packed, scales, out) or element not in ref.MX_ELEMENTS or packed.dtype != torch.uint8
            or scales.dtype != torch.uint8 or numel < 0
            or packed.numel() < (numel * ref.MX_ELEMENTS[element][1] + 7) // 8
            or scales.numel() < (numel + ref.MX_BLOCK - 1) // ref.MX_BLOCK or not _valid_out(out, numel)):
        return ref.mx_dequantize(packed, scales, element, numel, out, accumulate)
    fmt, bits, _ = ref.MX_ELEMENTS[element]
    table = _TABLES[fmt]
    dst = out if out is not None else torch.empty(numel, dtype=torch.float32)
    K.mx_dequantize(packed.reshape(-1).contiguous().numpy(), scales.reshape(-1).contiguous().numpy(),
                    table, _E8M0, bits, numel, _quant_chunk(ref.MX_BLOCK), dst.numpy(),
                    bool(accumulate and out is not None))
    return dst


# ---------------------------------------------------------------- QSGD / TernGrad levels
def _valid_levels(levels) -> bool:
    return isinstance(levels, (int, np.integer)) and 1 <= int(levels) <= 127


def bucket_norms(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """See :func:`commpress.ops.reference.bucket_norms`."""
    if not _cpu(x) or x.dtype not in _FLOATS or not valid_block(bucket):
        return ref.bucket_norms(x, bucket)
    xf = _f32(x)
    n = xf.numel()
    b = max(1, min(int(bucket), n))
    norms = np.empty((n + b - 1) // b, np.float32)
    xn = xf.numpy()
    K.bucket_norms(xn, xn.view(np.int32), b, norms)
    return torch.from_numpy(norms)


def level_quantize(x: torch.Tensor, scales: torch.Tensor, bucket: int, levels: int, seed: int):
    """See :func:`commpress.ops.reference.level_quantize` (codes and packing in one pass)."""
    n = x.numel()
    b = max(1, min(int(bucket), n)) if valid_block(bucket) else 0
    if (not _cpu(x, scales) or x.dtype not in _FLOATS or not b or not _valid_levels(levels)
            or scales.numel() < (n + b - 1) // b):
        return ref.level_quantize(x, scales, bucket, levels, seed)
    bits = ref.level_bits(int(levels))
    xf = _f32(x)
    packed = np.empty((n * bits + 7) // 8, np.uint8)
    k0, k1 = ref.seed_words(seed)
    K.level_quantize(xf.numpy(), scales.reshape(-1).float().contiguous().numpy(), b,
                     int(levels), bits, np.uint64(k0), np.uint64(k1), _chunk(n), packed)
    return torch.from_numpy(packed)


def qsgd_quantize(x: torch.Tensor, levels: int, bucket: int, seed: int):
    """See :func:`commpress.ops.reference.qsgd_quantize` (one pass for cache-sized buckets)."""
    n = x.numel()
    if (not _cpu(x) or x.dtype not in _FLOATS or not valid_block(bucket) or not _valid_levels(levels)
            or min(int(bucket), n) > K._PAIRWISE_MAX):
        norms = bucket_norms(x, bucket)
        return level_quantize(x, norms, bucket, levels, seed), norms
    b = max(1, min(int(bucket), n))
    bits = ref.level_bits(int(levels))
    xf = _f32(x)
    packed = np.empty((n * bits + 7) // 8, np.uint8)
    norms = np.empty((n + b - 1) // b, np.float32)
    k0, k1 = ref.seed_words(seed)
    K.qsgd_quantize(xf.numpy(), b, int(levels), bits, np.uint64(k0), np.uint64(k1), _quant_chunk(b), packed, norms)
    return torch.from_numpy(packed), torch.from_numpy(norms)


def _how(has_r: bool, beta: float, scale: float) -> int:
    """The ``how`` of :func:`~._numba_kernels._compensate_plain` for ``x*scale + residual*beta``."""
    return (1 if has_r else 0) | (2 if has_r and float(beta) != 1.0 else 0) | (4 if float(scale) != 1.0 else 0)


def qsgd_quantize_feedback(x: torch.Tensor, residual: torch.Tensor | None, beta: float, levels: int, bucket: int,
                           seed: int, new_residual: torch.Tensor, scale: float = 1.0):
    """See :func:`commpress.ops.reference.qsgd_quantize_feedback` (one pass per chunk of buckets, each
    bucket compensated, summed, coded and its residual written while it is in L1)."""
    n = x.numel()
    if (not _fb_layout_ok(x, residual, new_residual) or not valid_block(bucket) or not _valid_levels(levels)
            or min(int(bucket), n) > K._PAIRWISE_MAX):
        return ref.qsgd_quantize_feedback(x, residual, beta, levels, bucket, seed, new_residual, scale)
    b = max(1, min(int(bucket), n))
    bits = ref.level_bits(int(levels))
    packed = np.empty((n * bits + 7) // 8, np.uint8)
    norms = np.empty((n + b - 1) // b, np.float32)
    k0, k1 = ref.seed_words(seed)
    xn = _flat_np(x)
    has_r = residual is not None
    bad = K.qsgd_quantize_feedback(xn, _flat_np(residual) if has_r else xn, np.float32(beta), np.float32(scale),
                                   _how(has_r, beta, scale), b, int(levels), bits, np.uint64(k0), np.uint64(k1),
                                   _quant_chunk(b), _flat_np(new_residual), packed, norms)
    return torch.from_numpy(packed), torch.from_numpy(norms), torch.from_numpy(np.array(bad == 0))


def terngrad_quantize_feedback(x: torch.Tensor, residual: torch.Tensor | None, beta: float, seed: int,
                               new_residual: torch.Tensor, scale: float = 1.0):
    """See :func:`commpress.ops.reference.terngrad_quantize_feedback` (two passes: the scale of the
    compensated tensor, then its codes and residual; the compensated tensor is never stored)."""
    if not _fb_layout_ok(x, residual, new_residual):
        return ref.terngrad_quantize_feedback(x, residual, beta, seed, new_residual, scale)
    n = x.numel()
    packed = np.empty((n * 2 + 7) // 8, np.uint8)
    k0, k1 = ref.seed_words(seed)
    xn = _flat_np(x)
    has_r = residual is not None
    s = K.terngrad_quantize_feedback(xn, _flat_np(residual) if has_r else xn, np.float32(beta), np.float32(scale),
                                     _how(has_r, beta, scale), np.uint64(k0), np.uint64(k1), _chunk(n),
                                     _flat_np(new_residual), packed)
    scale_t = torch.from_numpy(s)
    return torch.from_numpy(packed), scale_t, torch.isfinite(scale_t).all()


def level_dequantize(packed: torch.Tensor, scales: torch.Tensor, bucket: int, levels: int, numel: int,
                     out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """See :func:`commpress.ops.reference.level_dequantize`."""
    numel = int(numel)
    b = max(1, min(int(bucket), numel)) if valid_block(bucket) else 0
    if (not _cpu(packed, scales, out) or not b or not _valid_levels(levels) or packed.dtype != torch.uint8
            or numel < 0 or packed.numel() < (numel * ref.level_bits(int(levels)) + 7) // 8
            or scales.numel() < (numel + b - 1) // b or not _valid_out(out, numel)):
        return ref.level_dequantize(packed, scales, bucket, levels, numel, out, accumulate)
    dst = out if out is not None else torch.empty(numel, dtype=torch.float32)
    K.level_dequantize(packed.reshape(-1).contiguous().numpy(), scales.reshape(-1).float().contiguous().numpy(),
                       b, int(levels), ref.level_bits(int(levels)), numel, _chunk(numel), dst.numpy(),
                       bool(accumulate and out is not None))
    return dst


def sign_pack_feedback(x: torch.Tensor, residual: torch.Tensor, beta: float, chunk: int,
                       new_residual: torch.Tensor):
    """See :func:`commpress.ops.reference.sign_pack_feedback` (one pass, chunk by chunk)."""
    n = x.numel()
    ok = (_cpu(x, residual, new_residual) and x.dtype in _FLOATS and valid_block(chunk) and int(chunk) % 8 == 0
          and all(t.dtype == torch.float32 and t.is_contiguous() and t.numel() == n and not t.requires_grad
                  for t in (residual, new_residual))
          and new_residual.data_ptr() != residual.data_ptr())
    if not ok:
        return ref.sign_pack_feedback(x, residual, beta, chunk, new_residual)
    chunk = int(chunk)
    xf = _f32(x).numpy()
    packed = np.empty((n + 7) // 8, np.uint8)
    scales = np.empty((n + chunk - 1) // chunk, np.float32)
    fin = K.sign_pack_feedback(xf, residual.view(-1).numpy(), np.float32(beta), float(beta) != 1.0, chunk,
                               new_residual.view(-1).numpy(), packed, scales)
    return torch.from_numpy(packed), torch.from_numpy(scales), torch.tensor(bool(fin))


#: Most threads one call splits its chunks over: the cores this process may run on.
MAX_THREADS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def threads_for(size: int) -> int:
    """Threads a kernel call on ``size`` elements runs on: 1 under :data:`SERIAL_BELOW`, else
    ``torch.get_num_threads()`` (at most :data:`MAX_THREADS`)."""
    return 1 if size < SERIAL_BELOW else max(1, min(MAX_THREADS, torch.get_num_threads()))


def threads_context(size: int) -> K.use_threads:
    """:class:`~._numba_kernels.use_threads` of :func:`threads_for` ``(size)``: what every op of this
    backend runs its kernels in, for callers of the ``*_into`` functions."""
    return K.use_threads(threads_for(size))


def _serial_when_small(fn):
    """Run ``fn`` on ``torch.get_num_threads()`` threads (at most :data:`MAX_THREADS`), or on the
    calling thread alone for inputs under :data:`SERIAL_BELOW` elements.

    The kernels follow torch's intra-op thread count.  When that is 1 (``torchrun``
    workers sharing a host should call ``torch.set_num_threads(1)``; a rank that
    owns one core has 1 anyway) every kernel runs on the calling thread and no
    thread is started (:func:`~commpress.ops._numba_kernels.use_threads`).
    """

    @functools.wraps(fn)
    def call(*args, **kwargs):
        size = -1
        for a in args:
            if isinstance(a, torch.Tensor):
                size = max(size, a.numel())
        for a in kwargs.values():
            if isinstance(a, torch.Tensor):
                size = max(size, a.numel())
        if size < 0 and args and isinstance(args[0], (list, tuple)):  # block_dequantize_sum: numel
            size = int(args[4]) if len(args) > 4 else int(kwargs.get("numel", 0))
        if size < 0:  # counter ops: n is the third argument
            n = args[2] if len(args) > 2 else kwargs.get("n", 0)
            size = int(n) if isinstance(n, (int, np.integer)) else 0
        wanted = threads_for(size)
        before = getattr(K._MODE, "threads", 1)
        if wanted == before:
            return fn(*args, **kwargs)
        K._MODE.threads = wanted  # K.use_threads, set inline: a hot path
        try:
            return fn(*args, **kwargs)
        finally:
            K._MODE.threads = before

    return call


_PROBE_NANS = np.array([0x7FC00000, 0xFFC00000, 0x7FF92C0B, 0xFFF92C0B, 0x7F800001, 0xFF800001, 0x7FFFFFFF],
                       dtype=np.uint32)


def _nan_rule(dtype: torch.dtype) -> tuple[int, int, bool] | None:
    """How torch's CPU conversion to ``dtype`` (bf16 / fp16) writes a NaN: ``(pos, neg, payload)``,
    the int16 bits of a positive and a negative NaN and whether it keeps the payload's top bits
    instead (quieted; fp16 with F16C: ``0x7FF92C0B`` -> ``0x7FC9``); ``None`` when neither rule
    reproduces it here (the reference then runs).  bf16 with AVX2 gives 0xFFFF for every NaN."""
    x = torch.from_numpy(_PROBE_NANS.view(np.float32).copy())
    got = x.to(dtype).view(torch.int16).numpy().astype(np.int32) & 0xFFFF
    bits = _PROBE_NANS.view(np.int32)
    sign = (bits >> 16) & 0x8000
    pos, neg = int(got[0]), int(got[1])
    if all(g == (neg if s else pos) for g, s in zip(got, sign)):
        return _int16(pos), _int16(neg), False
    if dtype == torch.float16 and np.array_equal(got, sign | 0x7E00 | ((bits & 0x7FFFFFFF) >> 13 & 0x3FF)):
        return _int16(pos), _int16(neg), True
    log.info("numba backend: torch's NaN conversion to %s follows no known rule here; its casts under "
             "error feedback keep torch's ops", dtype)
    return None


def _int16(v: int) -> int:
    return v - 0x10000 if v >= 0x8000 else v


_NAN_RULES: dict[torch.dtype, tuple[int, int, bool] | None] = {}
_HALF = (torch.bfloat16, torch.float16)


def cast_feedback(x: torch.Tensor, residual: torch.Tensor | None, beta: float, new_residual: torch.Tensor,
                  wire_dtype: torch.dtype, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`commpress.ops.reference.cast_feedback`: fp32 input to bf16 or fp16 in one pass
    (:func:`~commpress.ops._numba_kernels.half_feedback`: bitwise the reference, NaNs written as
    :func:`_nan_rule` found torch writes them); other inputs go to the reference."""
    if wire_dtype in _HALF and wire_dtype not in _NAN_RULES:
        _NAN_RULES[wire_dtype] = _nan_rule(wire_dtype)
    rule = _NAN_RULES.get(wire_dtype)
    if rule is None or x.dtype != torch.float32 or not x.is_contiguous() \
            or not _fb_layout_ok(x, residual, new_residual):
        return ref.cast_feedback(x, residual, beta, new_residual, wire_dtype, scale)
    nan_pos, nan_neg, payload = rule
    res = new_residual.view(-1).numpy()
    rf = residual.view(-1).numpy() if residual is not None else res
    how = (1 if residual is not None else 0) | (2 if residual is not None and float(beta) != 1.0 else 0) \
        | (4 if float(scale) != 1.0 else 0)
    sent = torch.empty(x.numel(), dtype=wire_dtype)
    args = (x.detach().reshape(-1).numpy(), rf, np.float32(beta), np.float32(scale), how, res,
            sent.view(torch.int16).numpy(), np.int32(nan_pos), np.int32(nan_neg))
    ok = K.half_feedback(*args, payload, wire_dtype == torch.float16)
    return sent, torch.tensor(bool(ok))


_OPS = {
    "threshold_compact": threshold_compact,
    "topk_compact": topk_compact,
    "topk_compact_feedback": topk_compact_feedback,
    "cast_feedback": cast_feedback,
    "magnitude_key": magnitude_key,
    "scatter_add_": scatter_add_,
    "counter_bits": counter_bits,
    "counter_uniform": counter_uniform,
    "hash_owner": hash_owner,
    "hash_partition": hash_partition,
    "pack_bits": pack_bits,
    "unpack_bits": unpack_bits,
    "bitmap_encode": bitmap_encode,
    "bitmap_decode": bitmap_decode,
    "block_absmax": block_absmax,
    "block_quantize": block_quantize,
    "block_dequantize": block_dequantize,
    "block_dequantize_sum": block_dequantize_sum,
    "sign_pack": sign_pack,
    "sign_unpack": sign_unpack,
    "fp8_quantize": fp8_quantize,
    "fp8_dequantize": fp8_dequantize,
    "mx_quantize": mx_quantize,
    "mx_dequantize": mx_dequantize,
    "bucket_norms": bucket_norms,
    "level_quantize": level_quantize,
    "qsgd_quantize": qsgd_quantize,
    "level_dequantize": level_dequantize,
    "qsgd_quantize_feedback": qsgd_quantize_feedback,
    "terngrad_quantize_feedback": terngrad_quantize_feedback,
    "sign_pack_feedback": sign_pack_feedback,
    "block_quantize_feedback": block_quantize_feedback,
}
OPS = {name: _serial_when_small(fn) for name, fn in _OPS.items()}


def _register() -> None:
    from . import register_backend

    register_backend("numba", OPS)


_register()
