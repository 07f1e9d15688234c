"""Numba CPU kernels behind :mod:`commpress.ops.numba_backend` (numpy in, numpy out).

Every kernel reproduces :mod:`commpress.ops.reference` bit for bit:

* fp32 arithmetic stays fp32 (constants are ``np.float32``; numba would widen a
  Python float to fp64), no ``fastmath``; one fused multiply-add (:func:`fma32`) only where
  the reference's torch op fuses one on this machine (the momentum velocity's
  ``add(alpha=)``, probed by :func:`commpress.ops.numba_backend.velocity_mode`);
* the 32-bit hash runs on ``uint64`` with explicit ``& 0xFFFFFFFF`` masks;
* magnitude comparisons run on the int32 bit pattern of fp32 values
  (``bits & 0x7fffffff``), which orders NaN > inf > finite like the reference.

Every kernel is compiled once, without ``prange``: numba's own thread pool never
starts (it spun in every rank process sharing a host's cores), and a first call
compiles one build, not a parallel one and its serial twin.  The chunked kernels
take the range of chunks ``[c0, c1)`` they run as their last two arguments;
:func:`run_split` hands the ranges to a small thread pool when the caller asked
for several threads (:func:`use_threads`; the numba backend does for large inputs
when torch has several threads).  Chunks are ``clen`` elements (a multiple of 64,
chosen by the caller), so results never depend on the thread count.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

_M32 = np.uint64(0xFFFFFFFF)
_C1 = np.uint64(0x7FEB352D)
_C2 = np.uint64(0x846CA68B)
_S8 = np.uint64(8)
_S15 = np.uint64(15)
_S16 = np.uint64(16)
_INF_KEY = np.int32(0x7F800000)
_ABS = np.int32(0x7FFFFFFF)
_F0 = np.float32(0.0)
_HALF = np.float32(0.5)
_U24 = np.float32(1.0 / 16777216.0)
_F1 = np.float32(1.0)
_INF32 = np.float32(np.inf)
_NORM_TINY = np.float32(2.0 ** -60)  # reference.NORM_TINY
_F32_MAX64 = np.float64(np.finfo(np.float32).max)
_F32_MIN = np.float32(2.0 ** -126)
_PRESCALE = np.float32(2.0 ** 64)  # reference.LEVEL_PRESCALE
_INV_PRESCALE = np.float32(2.0 ** -64)
_NAN32 = np.float32(np.nan)
_F32_MAX32 = np.float32(np.finfo(np.float32).max)
_SIGN_DOWN = np.float32(2.0 ** -32)  # reference.SIGN_RESCUE_SHIFT
_SIGN_UP = np.float32(2.0 ** 32)
_ZERO64 = np.uint64(0)

_PIECE = 8192  # cache-resident piece of a chunk (elements)
_PAIRWISE_MAX = 1 << 16  # longest run summed level by level in a scratch buffer
_SOPTS = dict(cache=True, nogil=True, error_model="numpy")

_MODE = threading.local()


@intrinsic
def fma32(typingctx, a, b, c):
    """``a*b + c`` in fp32 with one rounding (``llvm.fma``): what ATen's vectorized
    ``add(other, alpha=)`` computes on CPUs with FMA (:func:`commpress.ops.numba_backend.velocity_mode`
    checks it against torch before any kernel relies on it)."""
    if not (a == types.float32 and b == types.float32 and c == types.float32):
        return None

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _cttz64(typingctx, w):
    """Trailing zero bits of a nonzero uint64 (``llvm.cttz``: one instruction)."""
    if w != types.uint64:
        return None

    def codegen(context, builder, signature, args):
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))

    return types.uint64(types.uint64), codegen


def kernel_threads() -> int:
    """Threads the kernels called on this thread may use (1 unless :func:`use_threads` says more)."""
    return getattr(_MODE, "threads", 1)


class use_threads:
    """Context manager: kernels called in it (on this thread) split their chunks over ``threads``
    threads: the calling one and ``threads - 1`` of a small pool.  1 (the default outside it) runs
    every kernel on the calling thread and starts no thread."""

    __slots__ = ("threads", "_before")

    def __init__(self, threads: int) -> None:
        self.threads = max(1, int(threads))

    def __enter__(self):
        self._before = kernel_threads()
        _MODE.threads = self.threads

    def __exit__(self, *exc):
        _MODE.threads = self._before


def serial_kernels() -> use_threads:
    """Context manager: kernels called in it (on this thread) run on the calling thread only."""
    return use_threads(1)


def in_serial_mode() -> bool:
    """True when kernels called on this thread run on it alone (:func:`kernel_threads` is 1)."""
    return kernel_threads() == 1


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) - 1),
                                       thread_name_prefix="commpress-kernels")
        return _POOL


def _forget_pool() -> None:
    """After a fork the child has none of the pool's threads: a new pool starts on first use."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def pool_started() -> bool:
    """Whether this process has started the kernels' thread pool (only multi-thread calls do)."""
    return _POOL is not None


def run_split(units: int, fn, align: int = 1) -> None:
    """``fn(a, b)`` over ``[0, units)`` split into :func:`kernel_threads` contiguous ranges (edges a
    multiple of ``align``): the first on the calling thread, the others on the pool, all finished
    (or one's error raised) before it returns.  Results never depend on the split: every kernel
    writes each unit's output from that unit's input alone."""
    t = min(kernel_threads(), -(-units // align))
    if t <= 1:
        fn(0, units)
        return
    edges = [0] + [units * i // t // align * align for i in range(1, t)] + [units]
    pool = _pool()
    rest = [pool.submit(fn, edges[i], edges[i + 1]) for i in range(1, t)]
    try:
        fn(0, edges[1])
    finally:
        for f in rest:
            f.result()


class _Chunked:
    """A kernel compiled once (no ``prange``) whose last two arguments are the range ``[c0, c1)``
    of chunks it runs; called with the others, it runs every chunk, split by :func:`run_split`.
    The kernels are ``nogil``, so the pool's threads run them side by side."""

    def __init__(self, py_func, units):
        self.jit = njit(**_SOPTS)(py_func)
        self.units = units
        self.__name__ = py_func.__name__
        self.__doc__ = py_func.__doc__

    def __call__(self, *args):
        jit, n = self.jit, self.units(*args)
        if kernel_threads() == 1:
            jit(*args, 0, n)
        else:
            run_split(n, lambda a, b: jit(*args, a, b))


def chunked(units):
    """Decorator for a kernel over chunks ``[c0, c1)`` (its last two parameters); ``units(*args)``
    gives the number of chunks from the other arguments."""
    return lambda py_func: _Chunked(py_func, units)


def _nch(n, clen) -> int:
    return (n + clen - 1) // clen


# ---------------------------------------------------------------- hashing
@njit(inline="always", **_SOPTS)
def _mix32(x):
    x = x ^ (x >> _S16)
    x = (x * _C1) & _M32
    x = x ^ (x >> _S15)
    x = (x * _C2) & _M32
    x = x ^ (x >> _S16)
    return x


@njit(inline="always", **_SOPTS)
def _hash32(i, k0, k1):
    """``mix32((mix32(i ^ k0) + k1) mod 2**32)`` (uint64 counter, keys as uint64): the counter hash
    under ``counter_bits`` and the lean stores' rounding noise."""
    h = _mix32((np.uint64(i) & _M32) ^ k0)
    return _mix32((h + k1) & _M32)


@njit(inline="always", **_SOPTS)
def _bits24(i, k0, k1):
    """``counter_bits`` for element ``i`` (uint64 counter, keys as uint64)."""
    return _hash32(i, k0, k1) >> _S8


@njit(inline="always", **_SOPTS)
def _uniform24(i, k0, k1):
    """``counter_uniform`` of element ``i`` (an int): ``_bits24 / 2**24`` as fp32.  The uint64 form
    with its masks vectorizes best here (64-bit lanes, the masked products as ``vpmuludq``): 1.4x
    faster in the QSGD code loop than wrapping uint32 arithmetic (``vpmulld``)."""
    return np.float32(np.int32(_bits24(np.uint64(i), k0, k1))) * _U24


_UW = 16  # lanes of :func:`_uniform24_lanes`


@intrinsic
def _uniform24_lanes(typingctx, out, j, i, k0, k1):
    """``out[j + l] = _uniform24(i + l, k0, k1)`` for the ``_UW`` lanes ``l`` (``out`` a contiguous
    fp32 array with ``j + _UW <= out.size``; ``i`` a uint64 counter; ``k0``, ``k1`` the seed words,
    below ``2**32`` as :func:`commpress.ops.reference.seed_words` gives them).

    The same hash as :func:`_bits24`, written as one ``<16 x i32>`` LLVM vector: every step of
    ``_mix32`` on a value below ``2**32`` keeps only its low 32 bits, so wrapping 32-bit lanes give
    the same bits.  The loop vectorizer, left to itself, runs the uint64 form 8 lanes wide with
    64-bit multiplies (``vpmullq``: 3 uops each with AVX-512); 16 lanes of ``vpmulld`` and 32-bit
    shifts are about 3x faster per element here (2**24 draws: 0.27 vs 0.86 ns each, L1-resident).
    Without AVX-512 LLVM splits the vector into halves (same bits)."""
    if not (isinstance(out, types.Array) and out.dtype == types.float32 and out.ndim == 1
            and out.layout == "C" and isinstance(j, types.Integer) and i == types.uint64
            and k0 == types.uint64 and k1 == types.uint64):
        return None
    sig = types.void(out, j, i, k0, k1)

    def codegen(context, builder, signature, args):
        arr, jv, iv, k0v, k1v = args
        ary = context.make_array(signature.args[0])(context, builder, arr)
        i32 = ir.IntType(32)
        vt = ir.VectorType(i32, _UW)
        vf = ir.VectorType(ir.FloatType(), _UW)

        def splat(v):
            u = builder.insert_element(ir.Constant(vt, ir.Undefined), builder.trunc(v, i32), ir.Constant(i32, 0))
            return builder.shuffle_vector(u, ir.Constant(vt, ir.Undefined), ir.Constant(vt, [0] * _UW))

        def c(v):
            return ir.Constant(vt, [v] * _UW)

        def mix(x):
            x = builder.xor(x, builder.lshr(x, c(16)))
            x = builder.mul(x, c(0x7FEB352D))
            x = builder.xor(x, builder.lshr(x, c(15)))
            x = builder.mul(x, c(0x846CA68B))
            return builder.xor(x, builder.lshr(x, c(16)))

        ctr = builder.add(splat(iv), ir.Constant(vt, list(range(_UW))))
        h = mix(builder.xor(ctr, splat(k0v)))
        h = mix(builder.add(h, splat(k1v)))
        u = builder.fmul(builder.sitofp(builder.lshr(h, c(8)), vf), ir.Constant(vf, [2.0 ** -24] * _UW))
        jj = context.cast(builder, jv, signature.args[1], types.intp)
        ptr = builder.gep(ary.data, [jj])
        builder.store(u, builder.bitcast(ptr, vf.as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _prefetch(typingctx, arr, j, write):
    """Prefetch the cache line of ``arr[j]`` into L1 (``llvm.prefetch``: a hint, it never faults;
    the callers keep ``j`` in bounds anyway); ``write`` (a literal bool): for writing
    (``prefetchw``: the line arrives owned, its read-for-ownership off the store's path)."""
    if not (isinstance(arr, types.Array) and isinstance(j, types.Integer)
            and isinstance(write, types.BooleanLiteral)):
        return None
    rw = 1 if write.literal_value else 0

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        jj = context.cast(builder, args[1], signature.args[1], types.intp)
        p = builder.bitcast(builder.gep(ary.data, [jj]), ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        name = "llvm.prefetch.p0" if str(p.type) == "ptr" else "llvm.prefetch.p0i8"  # opaque or typed pointers
        fn = builder.module.globals.get(name)
        if fn is None:
            fn = ir.Function(builder.module, ir.FunctionType(ir.VoidType(), [p.type, i32, i32, i32]), name)
        builder.call(fn, [p, ir.Constant(i32, rw), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(arr, j, write), codegen


#: How far ahead (elements) :func:`_fill_uniform24` prefetches the arrays it is given: two 512-entry
#: QSGD buckets, one TernGrad piece.  The fused error-feedback kernels spend most of their time
#: computing on a cache-resident bucket; the hardware prefetcher alone left the next bucket's
#: reads (and its residual's read-for-ownership) to stall the next compensation loop.
_AHEAD = 1024


@njit(inline="always", **_SOPTS)
def _fill_uniform24(u, base, k0, k1, pa, pb, pc, at):
    """``u[j] = _uniform24(base + j, k0, k1)`` for every ``j`` (``u`` contiguous fp32), ``_UW`` at a
    time (:func:`_uniform24_lanes`), the tail one by one.  ``at >= 0``: with each ``_UW`` lanes (one
    cache line of fp32) it also prefetches ``pa[at + j]`` and ``pb[at + j]`` for reading and
    ``pc[at + j]`` for writing (``pa``, ``pb``, ``pc`` of one size), a few buckets ahead."""
    m = u.size
    b = np.uint64(base)
    full = m - m % _UW
    if at >= 0:
        lim = min(full, pa.size - at)
        for j in range(0, full, _UW):
            _uniform24_lanes(u, j, b + np.uint64(j), k0, k1)
            if j < lim:
                _prefetch(pa, at + j, False)
                _prefetch(pb, at + j, False)
                _prefetch(pc, at + j, True)
    else:
        for j in range(0, full, _UW):
            _uniform24_lanes(u, j, b + np.uint64(j), k0, k1)
    for j in range(full, m):
        u[j] = _uniform24(b + np.uint64(j), k0, k1)


_GRAIN = 64  # split edges of the elementwise kernels (whole cache lines)


@njit(**_SOPTS)
def _counter_bits(start, n, k0, k1, out):
    s = np.uint64(start)
    for j in range(n):
        out[j] = np.int64(_bits24((s + np.uint64(j)) & _M32, k0, k1))


def counter_bits(start, n, k0, k1, out):
    """out[j] = 24-bit hash of element ``start + j`` (int64 ``out``)."""
    run_split(n, lambda a, b: _counter_bits(np.uint64(int(start) + a), b - a, k0, k1, out[a:b]), _GRAIN)


@njit(**_SOPTS)
def _counter_uniform(start, n, k0, k1, out):
    s = np.uint64(start)
    for j in range(n):
        out[j] = np.float32(np.int32(_bits24((s + np.uint64(j)) & _M32, k0, k1))) * _U24


def counter_uniform(start, n, k0, k1, out):
    """out[j] = counter_bits / 2**24 as fp32."""
    run_split(n, lambda a, b: _counter_uniform(np.uint64(int(start) + a), b - a, k0, k1, out[a:b]), _GRAIN)


@njit(**_SOPTS)
def _hash_owner(idx, world, out):
    w = np.uint64(world)
    for j in range(idx.size):
        out[j] = np.int64(_mix32(np.uint64(idx[j]) & _M32) % w)


def hash_owner(idx, world, out):
    """out[j] = mix32(idx[j] mod 2**32) mod world (int64 ``out``)."""
    run_split(idx.size, lambda a, b: _hash_owner(idx[a:b], world, out[a:b]), _GRAIN)


@chunked(lambda idx, world, clen, local: _nch(idx.size, clen))
def _hash_count(idx, world, clen, local, c0, c1):
    """local[c, r] = entries of chunk ``c`` owned by rank ``r``."""
    n = idx.size
    w = np.uint64(world)
    for c in range(c0, c1):
        lo = c * clen
        hi = min(lo + clen, n)
        for j in range(lo, hi):
            local[c, np.int64(_mix32(np.uint64(idx[j]) & _M32) % w)] += 1


@njit(**_SOPTS)
def _hash_offsets(local, counts):
    """Per owner, the counts; ``local`` becomes each chunk's first position in ``order``."""
    run = 0
    for r in range(local.shape[1]):
        counts[r] = 0
        for c in range(local.shape[0]):
            cnt = local[c, r]
            local[c, r] = run
            run += cnt
            counts[r] += cnt


@chunked(lambda idx, world, clen, local, order: _nch(idx.size, clen))
def _hash_place(idx, world, clen, local, order, c0, c1):
    n = idx.size
    w = np.uint64(world)
    for c in range(c0, c1):
        lo = c * clen
        hi = min(lo + clen, n)
        pos = local[c].copy()
        for j in range(lo, hi):
            r = np.int64(_mix32(np.uint64(idx[j]) & _M32) % w)
            order[pos[r]] = j
            pos[r] += 1


def hash_partition(idx, world, clen, counts, order):
    """Stable grouping of ``idx`` by owner: fills ``counts`` (world) and ``order``."""
    local = np.zeros((_nch(idx.size, clen), world), np.int64)
    _hash_count(idx, world, clen, local)
    _hash_offsets(local, counts)
    _hash_place(idx, world, clen, local, order)


# ---------------------------------------------------------------- selection
@njit(**_SOPTS)
def _magnitude_key(xi, out):
    for j in range(xi.size):
        out[j] = np.int64(xi[j] & _ABS)


def magnitude_key(xi, out):
    """out[j] = xi[j] & 0x7fffffff as int64 (``xi``: fp32 bits as int32)."""
    run_split(xi.size, lambda a, b: _magnitude_key(xi[a:b], out[a:b]), _GRAIN)


@njit(inline="always", **_SOPTS)
def _compact_piece(seg, base, lo_key, hi_key, idx_out, val_out, pos, flags):
    """Append the selected entries of ``seg`` (at most ``_PIECE``; global offset ``base``).

    A vectorized pass writes one flag byte per entry; the scan then skips
    8 entries at a time by testing the flags as one uint64.  Stops writing at
    the end of ``idx_out`` but keeps counting; returns the new ``pos``.
    """
    m = seg.size
    for j in range(m):
        k = seg[j] & _ABS
        flags[j] = (k >= lo_key) & (k <= hi_key)
    return _scan_flags(seg, base, m, idx_out, val_out, pos, flags)


@njit(inline="always", **_SOPTS)
def _compact_range(xi, a, b, lo_key, hi_key, idx_out, val_out, pos, res, copy, zero, flags):
    """:func:`_compact_piece` over ``[a, b)`` piece by piece, while each piece is in cache:
    ``copy``: res[piece] = xi[piece] first; ``zero``: then zero res at the selected entries
    (needs ``res`` distinct from ``xi``, or a final pass)."""
    cap = idx_out.size
    for p0 in range(a, b, _PIECE):
        p1 = min(p0 + _PIECE, b)
        seg = xi[p0:p1]
        if copy:
            res[p0:p1] = seg
        before = pos
        pos = _compact_piece(seg, p0, lo_key, hi_key, idx_out, val_out, pos, flags)
        if zero:
            if pos <= cap:
                for t in range(before, pos):
                    res[idx_out[t]] = 0
            else:  # slot full: zero from the flags
                for t in range(p1 - p0):
                    if flags[t]:
                        res[p0 + t] = 0
    return pos


@chunked(lambda xi, lo_key, hi_key, clen, cap, ibuf, vbuf, res, mode, counts: counts.size)
def _select_chunks(xi, lo_key, hi_key, clen, cap, ibuf, vbuf, res, mode, counts, c0, c1):
    """One chunk range of :func:`select_chunks` (counts into ``counts``)."""
    n = xi.size
    for c in range(c0, c1):
        a = c * clen
        b = min(a + clen, n)
        flags = np.empty(_PIECE, np.uint8)
        io = ibuf[c * cap:(c + 1) * cap]
        vo = vbuf[c * cap:(c + 1) * cap]
        cnt = _compact_range(xi, a, b, lo_key, hi_key, io, vo, 0, res, mode >= 2, mode == 2, flags)
        counts[c] = cnt
        if cnt <= cap and mode == 1:  # in place: zero only once the chunk's values are safe
            for t in range(cnt):
                res[io[t]] = 0


def select_chunks(xi, lo_key, hi_key, clen, cap, ibuf, vbuf, res, mode):
    """One pass: compact each chunk's selected entries into its slot of ``cap`` entries.

    ``ibuf``/``vbuf`` hold ``nchunks * cap`` entries.  Returns the per-chunk
    counts; a chunk whose count exceeds ``cap`` overflowed: its residual is left
    as it was (mode 1) or a plain copy (mode 2) and :func:`select_gather`
    rescans it.  ``mode``: 0 no residual; 1 ``res`` is ``xi`` (zero the
    selected in place); 2 ``res = xi`` with the selected zeroed; 3 ``res = xi``.
    """
    counts = np.zeros(_nch(xi.size, clen), np.int64)
    _select_chunks(xi, lo_key, hi_key, clen, cap, ibuf, vbuf, res, mode, counts)
    return counts


@chunked(lambda xi, lo_key, hi_key, clen, cap, ibuf, vbuf, counts, idx_out, val_out, res, mode: counts.size)
def select_gather(xi, lo_key, hi_key, clen, cap, ibuf, vbuf, counts, idx_out, val_out, res, mode, c0, c1):
    """Concatenate the chunk slots of :func:`select_chunks`; rescan overflowed chunks."""
    n = xi.size
    nch = counts.size
    offsets = np.empty(nch, np.int64)
    run = 0
    for c in range(nch):
        offsets[c] = run
        run += counts[c]
    for c in range(c0, c1):
        o = offsets[c]
        cnt = counts[c]
        if cnt <= cap:
            idx_out[o:o + cnt] = ibuf[c * cap:c * cap + cnt]
            val_out[o:o + cnt] = vbuf[c * cap:c * cap + cnt]
        else:
            a = c * clen
            b = min(a + clen, n)
            flags = np.empty(_PIECE, np.uint8)
            io = idx_out[o:o + cnt]
            _compact_range(xi, a, b, lo_key, hi_key, io, val_out[o:o + cnt], 0, res, False, False, flags)
            if mode == 1:  # (mode 2 zeroed during the first pass)
                for t in range(cnt):
                    res[io[t]] = 0


@njit(inline="always", **_SOPTS)
def _scan_flags(seg, base, m, idx_out, val_out, pos, flags, zero=False):
    """The scan half of :func:`_compact_piece`: append ``seg[t]`` (global index ``base + t``)
    for every set ``flags[t]``, ``t < m``, skipping 8 clear flags at a time and visiting only
    the set ones of a word (its lowest set byte by ``cttz``: no branch per flag).  With ``zero``,
    ``seg[t]`` is zeroed once stored (while the piece is in cache; :func:`select_chunks_feedback`)."""
    cap = idx_out.size
    groups = (m + 7) >> 3
    for j in range(m, groups << 3):
        flags[j] = 0
    words = flags.view(np.uint64)
    one = np.uint64(1)
    for g in range(groups):
        w = words[g]
        while w != 0:
            t = (g << 3) + np.int64(_cttz64(w) >> np.uint64(3))
            if pos < cap:
                idx_out[pos] = base + t
                val_out[pos] = seg[t]
                if zero:
                    seg[t] = 0
            pos += 1
            w &= w - one
    return pos


@njit(inline="always", **_SOPTS)
def _compensate(x, r, beta, scale, how, thr, out, flags):
    """out = x*scale + r*beta in fp32 (equal-length slices), each product rounded on its own
    (no FMA: numba does not contract without fastmath), like the reference; and in the same
    loop flags[j] = not |out[j]| < thr (NaN passes: for a threshold that is not NaN, the key
    rule ``key >= lo`` of :func:`_compact_piece` with ``thr`` the float of key ``lo``).
    ``how``: bit 1 add ``r``, bit 2 multiply ``r`` by ``beta``, bit 4 multiply ``x`` by
    ``scale`` (one loop per case over slices, so each vectorizes)."""
    m = out.size
    if how == 0:
        for j in range(m):
            c = x[j]
            out[j] = c
            flags[j] = not abs(c) < thr
    elif how == 1:
        for j in range(m):
            c = x[j] + r[j]
            out[j] = c
            flags[j] = not abs(c) < thr
    elif how == 3:
        for j in range(m):
            c = x[j] + r[j] * beta
            out[j] = c
            flags[j] = not abs(c) < thr
    elif how == 4:
        for j in range(m):
            c = x[j] * scale
            out[j] = c
            flags[j] = not abs(c) < thr
    elif how == 5:
        for j in range(m):
            c = x[j] * scale + r[j]
            out[j] = c
            flags[j] = not abs(c) < thr
    else:
        for j in range(m):
            c = x[j] * scale + r[j] * beta
            out[j] = c
            flags[j] = not abs(c) < thr


@njit(inline="always", **_SOPTS)
def _compensate_velocity(x, v, m, r, beta, scale, how, thr, uout, out, flags):
    """Momentum correction fused into :func:`_compensate` (``how`` bit 8): ``u = x*scale``
    (bit 4), plus ``m*v`` (bit 16: a live velocity ``v``) with one rounding (bit 32, ``fma``)
    or the product rounded on its own, as torch's ``u.add_(v, alpha=m)`` on this CPU; ``uout :=
    u`` (the pending velocity); then ``c = u + r*beta`` (bits 1, 2), ``out := c`` and the flags
    as :func:`_compensate`.  One loop: its branches are loop-invariant."""
    k = out.size
    for j in range(k):
        u = x[j] * scale if how & 4 else x[j]
        if how & 16:
            u = fma32(v[j], m, u) if how & 32 else u + v[j] * m
        uout[j] = u
        if how & 2:
            c = u + r[j] * beta
        elif how & 1:
            c = u + r[j]
        else:
            c = u
        out[j] = c
        flags[j] = not abs(c) < thr


@njit(**_SOPTS)
def sample_keys(x, r, beta, scale, how, v, m, runs, run, step, outf, outi):
    """The top-k threshold's sample of the compensated input, as magnitude keys: for ``runs`` runs of
    ``run`` entries ``step`` apart, ``c = x*scale`` (``how`` bit 4) ``+ v*m`` (bit 16) ``+ r*beta``
    (bit 1; ``beta`` with bit 2), each product and sum rounded to fp32 as numpy rounds them, written
    into ``outf`` and its int32 view ``outi`` masked to the key (one pass over the sample, no
    temporary arrays)."""
    for i in range(runs):
        base = i * step
        for j in range(run):
            p = base + j
            c = x[p]
            if how & 4:
                c = c * scale
            if how & 16:
                c = c + v[p] * m
            if how & 1:
                c = c + (r[p] * beta if how & 2 else r[p])
            outf[i * run + j] = c
    for q in range(runs * run):
        outi[q] = outi[q] & _ABS


@njit(inline="always", **_SOPTS)
def _compensate_piece(x, v, m, r, beta, scale, how, thr, uout, out, flags, p0, p1):
    """:func:`_compensate` (or, ``how`` bit 8, :func:`_compensate_velocity`) of ``[p0, p1)``."""
    if how & 8:
        _compensate_velocity(x[p0:p1], v[p0:p1], m, r[p0:p1], beta, scale, how, thr, uout[p0:p1], out[p0:p1],
                             flags)
    else:
        _compensate(x[p0:p1], r[p0:p1], beta, scale, how, thr, out[p0:p1], flags)


@chunked(lambda x, r, beta, scale, how, thr, out, outi, clen, cap, ibuf, vbuf, v, m, uout, counts: counts.size)
def _select_chunks_feedback(x, r, beta, scale, how, thr, out, outi, clen, cap, ibuf, vbuf, v, m, uout, counts,
                            c0, c1):
    """One chunk range of :func:`select_chunks_feedback` (counts into ``counts``)."""
    n = x.size
    for c in range(c0, c1):
        a = c * clen
        b = min(a + clen, n)
        flags = np.empty(_PIECE, np.uint8)
        io = ibuf[c * cap:(c + 1) * cap]
        vo = vbuf[c * cap:(c + 1) * cap]
        pos = 0
        for p0 in range(a, b, _PIECE):
            p1 = min(p0 + _PIECE, b)
            _compensate_piece(x, v, m, r, beta, scale, how, thr, uout, out, flags, p0, p1)
            pos = _scan_flags(outi[p0:p1], p0, p1 - p0, io, vo, pos, flags, True)
        if pos > cap:   # overflowed: select_gather rescans this chunk's values, so they go back
            for q in range(cap):
                outi[io[q]] = vo[q]
        counts[c] = pos


def select_chunks_feedback(x, r, beta, scale, how, thr, out, outi, clen, cap, ibuf, vbuf, v, m, uout):
    """:func:`select_chunks` (mode 0, keys ``[lo, max]``) of the compensated ``c = x*scale +
    r*beta``, written into ``out`` (fp32; ``outi`` its int32 view): one loop per piece
    computes ``c``, stores it and flags ``not |c| < thr`` (``thr``: the float of key ``lo``,
    at most inf), then the flags are scanned while the piece is in cache.  One pass reads
    ``x`` and ``r`` and writes ``c``.  ``out`` may be ``x`` or ``r`` (elementwise).
    With momentum correction (``how`` bit 8) ``x*scale`` is first turned into the velocity
    ``u`` (:func:`_compensate_velocity`, ``v`` the live one, ``m`` the momentum), written
    into ``uout`` in the same pass.  Every candidate of a chunk that did not overflow is zeroed
    in ``out`` (its value is in the slots): the caller restores those not chosen, fewer scattered
    writes than zeroing the chosen ones afterwards.  Overflowed chunks keep their values and are
    rescanned from ``outi`` by :func:`select_gather`."""
    counts = np.zeros(_nch(x.size, clen), np.int64)
    _select_chunks_feedback(x, r, beta, scale, how, thr, out, outi, clen, cap, ibuf, vbuf, v, m, uout, counts)
    return counts


@chunked(lambda x, r, beta, scale, how, out, clen, v, m, uout: _nch(x.size, clen))
def compensate(x, r, beta, scale, how, out, clen, v, m, uout, c0, c1):
    """out = x*scale + r*beta (see :func:`_compensate`; ``how`` bit 8: :func:`_compensate_velocity`;
    no selection)."""
    n = x.size
    for c in range(c0, c1):
        a = c * clen
        b = min(a + clen, n)
        flags = np.empty(_PIECE, np.uint8)
        for p0 in range(a, b, _PIECE):
            p1 = min(p0 + _PIECE, b)
            _compensate_piece(x, v, m, r, beta, scale, how, _F0, uout, out, flags, p0, p1)


@njit(**_SOPTS)
def _kth_largest(keys, k):
    """The ``k``-th largest of non-negative int32 ``keys`` (1 <= k <= size): three radix passes of
    11, 10 and 10 bits, each counting the keys under the prefix fixed so far (a 16 KB histogram:
    a candidate set of a few thousand keys costs microseconds, where 16-bit passes cleared and
    scanned 512 KB twice)."""
    hist = np.zeros(2048, np.int64)
    prefix = 0
    above = 0
    for p in range(3):
        shift = 20 - 10 * p
        width = 11 if p == 0 else 10
        mask = (1 << width) - 1
        top = shift + width
        hist[:] = 0
        for j in range(keys.size):
            kj = keys[j]
            if (kj >> top) == prefix:
                hist[(kj >> shift) & mask] += 1
        b = mask
        while above + hist[b] < k:
            above += hist[b]
            b -= 1
        prefix = (prefix << width) | b
    return np.int32(prefix)


@njit(**_SOPTS)
def topk_finish(cidx, cval, k, take):
    """Exact top-``k`` among candidates (index order): largest keys, ties to lower index.

    Returns ``(idx, val)`` in index order; ``take[j]`` is set to 1 for the chosen
    candidates, 0 for the others.
    """
    c = cidx.size
    if k <= 0:   # none chosen (the callers compensate only, without calling this)
        take[:] = 0
        return cidx[:0].copy(), cval[:0].copy()
    keys = cval & _ABS
    kth = _kth_largest(keys, k) if k < c else np.int32(0)
    above = 0
    for j in range(c):
        above += keys[j] > kth
    ties = k - above
    # one slot more than k: every candidate is written at p and p advances only when taken
    # (no branch on the taken flag, which a candidate set near k makes unpredictable)
    idx = np.empty(k + 1, cidx.dtype)
    val = np.empty(k + 1, cval.dtype)
    p = 0
    for j in range(c):
        kj = keys[j]
        t = kj > kth
        if kj == kth and ties > 0:
            t = True
            ties -= 1
        take[j] = t
        idx[p] = cidx[j]
        val[p] = cval[j]
        p += t
    return idx[:k], val[:k]


@njit(**_SOPTS)
def _zero_at(res, idx):
    for j in range(idx.size):
        res[idx[j]] = 0


def zero_at(res, idx):
    """res[idx[j]] = 0 for every j."""
    run_split(idx.size, lambda a, b: _zero_at(res, idx[a:b]), _GRAIN)


@njit(**_SOPTS)
def _restore_unselected(res, cidx, cval, take):
    for j in range(cidx.size):
        if take[j] == 0:
            res[cidx[j]] = cval[j]


def restore_unselected(res, cidx, cval, take):
    """res[cidx[j]] = cval[j] for the candidates not taken (their residual was zeroed in the pass)."""
    run_split(cidx.size, lambda a, b: _restore_unselected(res, cidx[a:b], cval[a:b], take[a:b]), _GRAIN)


@njit(**_SOPTS)
def _first_out_of_range(idx, n):
    for j in range(idx.size):
        if idx[j] < 0 or idx[j] >= n:
            return j
    return -1


@chunked(lambda out, idx, val, step, nparts: nparts)
def _scatter_parts(out, idx, val, step, nparts, c0, c1):
    """:func:`scatter_add` into the ranges ``[p * step, (p + 1) * step)`` of ``out``, ``p`` in ``[c0, c1)``."""
    for p in range(c0, c1):
        a = p * step
        b = a + step
        for j in range(idx.size):
            t = idx[j]
            if t >= a and t < b:
                out[t] += val[j]


def scatter_add(out, idx, val, nparts):
    """out[idx[j]] += val[j] in ``j`` order, split over ``nparts`` ranges of ``out`` (duplicates safe).

    Returns -1, or the position of the first index out of ``[0, out.size)``
    (then nothing was written).
    """
    bad = _first_out_of_range(idx, out.size)
    if bad >= 0:
        return bad
    _scatter_parts(out, idx, val, (out.size + nparts - 1) // nparts, nparts)
    return -1


# ---------------------------------------------------------------- bit packing
@njit(inline="always", **_SOPTS)
def _pack_groups_2_6(codes, cbase, a, e, bits, packed):
    """Pack elements ``[a, e)`` (both multiples of 8) for 2 or 6 bits: 8 codes -> 2 or 6 bytes."""
    if bits == 2:
        for g in range(a, e, 8):
            c = codes[g - cbase:g - cbase + 8]
            o = g >> 2
            packed[o] = (c[0] & 3) | ((c[1] & 3) << 2) | ((c[2] & 3) << 4) | ((c[3] & 3) << 6)
            packed[o + 1] = (c[4] & 3) | ((c[5] & 3) << 2) | ((c[6] & 3) << 4) | ((c[7] & 3) << 6)
    else:
        for g in range(a, e, 8):
            c = codes[g - cbase:g - cbase + 8]
            o = (g >> 3) * 6
            w0 = np.uint32(c[0] & 63) | (np.uint32(c[1] & 63) << 6) | (np.uint32(c[2] & 63) << 12) \
                | (np.uint32(c[3] & 63) << 18)
            w1 = np.uint32(c[4] & 63) | (np.uint32(c[5] & 63) << 6) | (np.uint32(c[6] & 63) << 12) \
                | (np.uint32(c[7] & 63) << 18)
            packed[o] = np.uint8(w0 & 255)
            packed[o + 1] = np.uint8((w0 >> 8) & 255)
            packed[o + 2] = np.uint8(w0 >> 16)
            packed[o + 3] = np.uint8(w1 & 255)
            packed[o + 4] = np.uint8((w1 >> 8) & 255)
            packed[o + 5] = np.uint8(w1 >> 16)


@njit(inline="always", **_SOPTS)
def _unpack_groups_2_6(packed, a, e, bits, codes, cbase):
    """Inverse of :func:`_pack_groups_2_6`."""
    if bits == 2:
        for g in range(a, e, 8):
            c = codes[g - cbase:g - cbase + 8]
            o = g >> 2
            v0 = packed[o]
            v1 = packed[o + 1]
            c[0] = v0 & 3
            c[1] = (v0 >> 2) & 3
            c[2] = (v0 >> 4) & 3
            c[3] = v0 >> 6
            c[4] = v1 & 3
            c[5] = (v1 >> 2) & 3
            c[6] = (v1 >> 4) & 3
            c[7] = v1 >> 6
    else:
        for g in range(a, e, 8):
            c = codes[g - cbase:g - cbase + 8]
            o = (g >> 3) * 6
            w0 = np.uint32(packed[o]) | (np.uint32(packed[o + 1]) << 8) | (np.uint32(packed[o + 2]) << 16)
            w1 = np.uint32(packed[o + 3]) | (np.uint32(packed[o + 4]) << 8) | (np.uint32(packed[o + 5]) << 16)
            c[0] = np.uint8(w0 & 63)
            c[1] = np.uint8((w0 >> 6) & 63)
            c[2] = np.uint8((w0 >> 12) & 63)
            c[3] = np.uint8(w0 >> 18)
            c[4] = np.uint8(w1 & 63)
            c[5] = np.uint8((w1 >> 6) & 63)
            c[6] = np.uint8((w1 >> 12) & 63)
            c[7] = np.uint8(w1 >> 18)


@njit(inline="always", **_SOPTS)
def _pack_range(codes, cbase, a, b, bits, packed):
    """Pack elements ``[a, b)`` (``a`` a multiple of 8) whose codes are ``codes[a - cbase ...]``."""
    nbytes = packed.size
    mask = np.uint64((1 << bits) - 1)
    if bits == 8:
        for j in range(a, b):
            packed[j] = codes[j - cbase]
    elif bits == 4:
        half = (b - a) >> 1
        src = codes[a - cbase:a - cbase + 2 * half]
        dst = packed[a >> 1:(a >> 1) + half]
        for t in range(half):
            dst[t] = (src[2 * t] & np.uint8(15)) | np.uint8((src[2 * t + 1] & np.uint8(15)) << np.uint8(4))
        if (b - a) & 1:
            packed[(b - 1) >> 1] = np.uint8(codes[b - 1 - cbase] & np.uint8(15))
    else:
        ub = np.uint64(bits)
        start = a
        if bits == 2 or bits == 6:  # whole groups of 8 codes without the 64-bit accumulator
            start = a + (((b - a) >> 3) << 3)
            _pack_groups_2_6(codes, cbase, a, start, bits, packed)
        for g in range(start, b, 8):
            acc = np.uint64(0)
            sh = np.uint64(0)
            for j in range(g, min(g + 8, b)):
                acc |= (np.uint64(codes[j - cbase]) & mask) << sh
                sh += ub
            byte0 = (g >> 3) * bits
            for t in range(bits):
                if byte0 + t < nbytes:
                    packed[byte0 + t] = np.uint8((acc >> np.uint64(8 * t)) & np.uint64(0xFF))


@njit(inline="always", **_SOPTS)
def _unpack_range(packed, a, b, bits, codes, cbase):
    """Inverse of :func:`_pack_range`: codes of elements ``[a, b)`` into ``codes[j - cbase]``."""
    nbytes = packed.size
    mask = np.uint64((1 << bits) - 1)
    if bits == 8:
        for j in range(a, b):
            codes[j - cbase] = packed[j]
    elif bits == 4:
        half = (b - a) >> 1
        src = packed[a >> 1:(a >> 1) + half]
        dst = codes[a - cbase:a - cbase + 2 * half]
        for t in range(half):
            v = src[t]
            dst[2 * t] = v & np.uint8(15)
            dst[2 * t + 1] = v >> np.uint8(4)
        if (b - a) & 1:
            codes[b - 1 - cbase] = packed[(b - 1) >> 1] & np.uint8(15)
    else:
        ub = np.uint64(bits)
        start = a
        if bits == 2 or bits == 6:  # whole groups of 8 codes without the 64-bit accumulator
            start = a + (((b - a) >> 3) << 3)
            _unpack_groups_2_6(packed, a, start, bits, codes, cbase)
        for g in range(start, b, 8):
            byte0 = (g >> 3) * bits
            acc = np.uint64(0)
            for t in range(bits):
                if byte0 + t < nbytes:
                    acc |= np.uint64(packed[byte0 + t]) << np.uint64(8 * t)
            sh = np.uint64(0)
            for j in range(g, min(g + 8, b)):
                codes[j - cbase] = np.uint8((acc >> sh) & mask)
                sh += ub


@chunked(lambda codes, bits, clen, packed: _nch(codes.size, clen))
def pack_bits(codes, bits, clen, packed, c0, c1):
    """Little-endian bit packing of uint8 ``codes`` (``clen`` a multiple of 8)."""
    n = codes.size
    for c in range(c0, c1):
        a = c * clen
        _pack_range(codes, 0, a, min(a + clen, n), bits, packed)


@chunked(lambda packed, bits, n, clen, codes: _nch(n, clen))
def unpack_bits(packed, bits, n, clen, codes, c0, c1):
    """Inverse of :func:`pack_bits` into uint8 ``codes`` (``n`` entries)."""
    for c in range(c0, c1):
        a = c * clen
        _unpack_range(packed, a, min(a + clen, n), bits, codes, 0)


@njit(**_SOPTS)
def bitmap_encode(idx, n, bitmap):
    """Set bit ``idx[j]`` (negative indices count from the end); returns the bad position or -1."""
    for j in range(idx.size):
        t = np.int64(idx[j])
        if t < 0:
            t += n
        if t < 0 or t >= n:
            return j
        bitmap[t >> 3] |= np.uint8(1 << (t & 7))
    return -1


@chunked(lambda bitmap, n, clen, counts: counts.size)
def _bitmap_count(bitmap, n, clen, counts, c0, c1):
    for c in range(c0, c1):
        a = c * clen
        b = min(a + clen, n)
        cnt = 0
        for j in range(a, b):
            cnt += (bitmap[j >> 3] >> (j & 7)) & 1
        counts[c] = cnt


def bitmap_count(bitmap, n, clen):
    """Per chunk of ``clen`` entries (multiple of 8), the number of set bits below ``n``."""
    counts = np.zeros(_nch(n, clen), np.int64)
    _bitmap_count(bitmap, n, clen, counts)
    return counts


@chunked(lambda bitmap, n, clen, counts, idx_out: counts.size)
def bitmap_write(bitmap, n, clen, counts, idx_out, c0, c1):
    """Write the set-bit indices (ascending) using the chunk counts of :func:`bitmap_count`."""
    nch = counts.size
    offsets = np.empty(nch, np.int64)
    run = 0
    for c in range(nch):
        offsets[c] = run
        run += counts[c]
    for c in range(c0, c1):
        a = c * clen
        b = min(a + clen, n)
        pos = offsets[c]
        for j in range(a, b):
            if (bitmap[j >> 3] >> (j & 7)) & 1:
                idx_out[pos] = j
                pos += 1


# ---------------------------------------------------------------- block quantization
# Per block of ``block`` entries (all kernels): the block is staged in a private buffer while it
# is in L1 (``tmp``), so every loop is a plain unit-stride loop over distinct arrays that LLVM
# vectorizes without runtime overlap checks failing (an output that is also an input would
# otherwise send the loop down its scalar path); integer arithmetic stays int32 (numba widens
# int32 operations to int64, which AVX2 has no float conversion for); codes are packed and
# unpacked a 32-bit word (4 codes) at a time.
@njit(inline="always", **_SOPTS)
def _absmax_key(xi, a, b):
    """max over ``xi[a:b]`` of ``bits & 0x7fffffff`` (int32 throughout: one vector max per 8)."""
    seg = xi[a:b]
    m = np.int32(0)
    for j in range(seg.size):
        m = max(m, np.int32(seg[j] & _ABS))
    return m


@njit(inline="always", **_SOPTS)
def _block_scale(xi, s0, s1, kbuf, fbuf, fq):
    """Block ``[s0, s1)``'s absmax scale ``s`` (NaN when it holds a NaN; ``xi`` the int32 view)
    and ``inv = qmax / s`` (0 when ``s`` is 0); ``kbuf``/``fbuf``: a one-element int32 buffer
    and its float32 view."""
    m = _absmax_key(xi, s0, s1)
    if m > _INF_KEY:
        s = _NAN32
    else:
        kbuf[0] = m
        s = fbuf[0]
    if s > _F0:
        inv = fq / s
    else:
        inv = _F0
    return s, inv


@chunked(lambda xi, block, scales: scales.size)
def block_absmax(xi, block, scales, c0, c1):
    """scales[b] = max |x| over block ``b`` as fp32 bits (int32 view), NaN if any NaN."""
    n = xi.size
    for b in range(c0, c1):
        a = b * block
        m = _absmax_key(xi, a, min(a + block, n))
        scales[b] = m if m <= _INF_KEY else np.int32(0x7FC00000)


@njit(inline="always", **_SOPTS)
def _level(y, lim):
    """floor(y) as fp32, NaN -> 0, clamped to [-lim, lim] (branch-free; never -0.0 here: the
    callers' ``y`` is ``v * inv + 0.5`` or ``+ u`` with ``u >= 0``)."""
    q = np.floor(y)
    q = q if q == q else _F0
    return min(max(q, -lim), lim)


@njit(inline="always", **_SOPTS)
def _compensate_plain(x, r, beta, scale, how, out):
    """out = x*scale + r*beta as :func:`_compensate`, without the flags (``out`` distinct)."""
    m = out.size
    if how == 0:
        for j in range(m):
            out[j] = x[j]
    elif how == 1:
        for j in range(m):
            out[j] = x[j] + r[j]
    elif how == 3:
        for j in range(m):
            out[j] = x[j] + r[j] * beta
    elif how == 4:
        for j in range(m):
            out[j] = x[j] * scale
    elif how == 5:
        for j in range(m):
            out[j] = x[j] * scale + r[j]
    else:
        for j in range(m):
            out[j] = x[j] * scale + r[j] * beta


@njit(inline="always", **_SOPTS)
def _levels_to_codes(lv, qmax, codes):
    """codes[j] = uint8(int32(lv[j]) + qmax) (``lv``: whole levels in [-qmax, qmax])."""
    q = np.int32(qmax)
    for j in range(lv.size):
        codes[j] = np.uint8(np.int32(lv[j]) + q)


@njit(inline="always", **_SOPTS)
def _pack_chunk(codes, m, a, bits, packed):
    """Pack the chunk's ``m`` codes ``codes[0:m]`` (a private buffer of at least ``m + 4``
    entries, 4-byte aligned) as elements ``[a, a + m)``, ``a`` a multiple of 8: 2 and 4 bits a
    32-bit word of 4 codes at a time (codes below ``2**bits``), other widths by :func:`_pack_range`."""
    if bits == 4:
        w = m >> 2
        c32 = codes[:4 * w].view(np.uint32)
        p16 = packed[a >> 1:(a >> 1) + 2 * w].view(np.uint16)
        for k in range(w):  # bytes c0 c1 c2 c3 -> (c0 | c1 << 4), (c2 | c3 << 4)
            v = c32[k]
            v = (v | (v >> np.uint32(4))) & np.uint32(0x00FF00FF)
            p16[k] = np.uint16((v | (v >> np.uint32(8))) & np.uint32(0xFFFF))
        for j in range(4 * w, m, 2):
            hi = codes[j + 1] if j + 1 < m else np.uint8(0)
            packed[(a + j) >> 1] = codes[j] | np.uint8(hi << np.uint8(4))
    elif bits == 2:
        w = m >> 2
        c32 = codes[:4 * w].view(np.uint32)
        p8 = packed[a >> 2:(a >> 2) + w]
        for k in range(w):  # c0 | c1 << 2 | c2 << 4 | c3 << 6
            v = c32[k]
            v = (v | (v >> np.uint32(6))) & np.uint32(0x000F000F)
            p8[k] = np.uint8((v | (v >> np.uint32(12))) & np.uint32(0xFF))
        if m > 4 * w:
            v = np.uint8(0)
            for j in range(4 * w, m):
                v |= np.uint8(codes[j] << np.uint8(2 * (j - 4 * w)))
            packed[(a >> 2) + w] = v
    else:
        _pack_range(codes, a, a, a + m, bits, packed)


@njit(inline="always", **_SOPTS)
def _unpack_chunk(packed, a, m, bits, codes):
    """Inverse of :func:`_pack_chunk`: the codes of elements ``[a, a + m)`` into ``codes[0:m]``."""
    if bits == 4:
        w = m >> 2
        c32 = codes[:4 * w].view(np.uint32)
        p16 = packed[a >> 1:(a >> 1) + 2 * w].view(np.uint16)
        for k in range(w):
            v = np.uint32(p16[k])
            v = (v | (v << np.uint32(8))) & np.uint32(0x00FF00FF)
            c32[k] = (v | (v << np.uint32(4))) & np.uint32(0x0F0F0F0F)
        for j in range(4 * w, m):
            codes[j] = (packed[(a + j) >> 1] >> np.uint8(4 * (j & 1))) & np.uint8(15)
    elif bits == 2:
        w = m >> 2
        c32 = codes[:4 * w].view(np.uint32)
        p8 = packed[a >> 2:(a >> 2) + w]
        for k in range(w):
            v = np.uint32(p8[k])
            v = (v | (v << np.uint32(12))) & np.uint32(0x000F000F)
            c32[k] = (v | (v << np.uint32(6))) & np.uint32(0x03030303)
        for j in range(4 * w, m):
            codes[j] = (packed[(a >> 2) + w] >> np.uint8(2 * (j - 4 * w))) & np.uint8(3)
    else:
        _unpack_range(packed, a, a + m, bits, codes, a)


@njit(**_SOPTS)  # not inlined: one compiled body for the four kernels below (compile time)
def _quantize_chunk(x, r, beta, scale, how, feedback, stochastic, k0, k1, bits, block, a, b,
                    out, packed, scales, v, mom, uout):
    """Quantize elements ``[a, b)`` (whole blocks; ``a`` a multiple of 8) into ``packed`` and
    ``scales``; the values are ``x*scale + r*beta`` (:func:`_compensate_plain`, ``how``; with
    ``how`` bit 8, ``x*scale`` is first the momentum correction's velocity, momentum ``mom``, written
    into ``uout``: :func:`_compensate_velocity`), each block staged in a private buffer.  ``feedback``: also
    ``out[j] := c_j - decoded_j`` (the new residual; ``out`` may be ``x`` or ``r``).  Returns True
    when some block's scale is not finite."""
    qmax = np.int32((1 << (bits - 1)) - 1)
    fq = np.float32(qmax)
    m = b - a
    if bits == 8:
        codes = packed[a:b]  # 8-bit codes are the packed bytes: written in place
    else:
        codes = np.empty(m + 4, np.uint8)
    width = min(block, m)
    tmpi = np.empty(width, np.int32)
    tmp = tmpi.view(np.float32)
    lvb = np.empty(width, np.float32)
    kbuf = np.empty(1, np.int32)
    fbuf = kbuf.view(np.float32)
    flags = np.empty(width if how & 8 else 0, np.uint8)
    bad = False
    for s0 in range(a, b, block):
        s1 = min(s0 + block, b)
        k = s1 - s0
        t = tmp[:k]
        if how & 8:
            _compensate_velocity(x[s0:s1], v[s0:s1], mom, r[s0:s1], beta, scale, how, _F0, uout[s0:s1], t, flags)
        else:
            _compensate_plain(x[s0:s1], r[s0:s1], beta, scale, how, t)
        s, inv = _block_scale(tmpi, 0, k, kbuf, fbuf, fq)
        scales[s0 // block] = s
        if not s < np.float32(np.inf):
            bad = True
        lv = lvb[:k]
        # a finite block with a finite inv: |t * inv| <= qmax * (1 + 2**-23), so floor(t * inv + 0.5)
        # is already a whole level in [-qmax, qmax] (never NaN): the NaN fix and clamp are no-ops
        plain = s < np.float32(np.inf) and inv < np.float32(np.inf)
        if stochastic:
            for j in range(k):
                u = np.float32(np.int32(_bits24(s0 + j, k0, k1))) * _U24
                lv[j] = _level(t[j] * inv + u, fq)
        elif feedback:  # the level, and the residual c - level * (s / qmax), in one loop
            step = s / fq
            os = out[s0:s1]
            if plain:
                for j in range(k):
                    q = np.floor(t[j] * inv + _HALF)
                    lv[j] = q
                    os[j] = t[j] - q * step
            else:
                for j in range(k):
                    q = _level(t[j] * inv + _HALF, fq)
                    lv[j] = q
                    os[j] = t[j] - q * step
        elif plain:
            for j in range(k):
                lv[j] = np.floor(t[j] * inv + _HALF)
        else:
            for j in range(k):
                lv[j] = _level(t[j] * inv + _HALF, fq)
        _levels_to_codes(lv, qmax, codes[s0 - a:s1 - a])
    if bits != 8:
        _pack_chunk(codes, m, a, bits, packed)
    return bad


@chunked(lambda x, xi, bits, block, stochastic, k0, k1, clen, packed, scales: _nch(x.size, clen))
def block_quantize(x, xi, bits, block, stochastic, k0, k1, clen, packed, scales, c0, c1):
    """Absmax block quantization + packing in one pass per chunk (:func:`_quantize_chunk`).

    ``clen`` is a multiple of ``block`` and of 8, so chunks hold whole blocks and
    whole bytes.  ``scales`` is fp32; ``packed`` uint8 of ``ceil(n*bits/8)``.
    """
    n = x.size
    for c in range(c0, c1):
        a = c * clen
        _quantize_chunk(x, x, _F0, _F0, 0, False, stochastic, k0, k1, bits, block, a, min(a + clen, n),
                        x, packed, scales, x, _F0, x)


@chunked(lambda x, r, beta, scale, how, bits, block, clen, out, packed, scales, v, m, uout, bad: bad.size)
def _block_quantize_feedback(x, r, beta, scale, how, bits, block, clen, out, packed, scales, v, m, uout, bad,
                             c0, c1):
    """One chunk range of :func:`block_quantize_feedback` (``bad[c]`` set for a non-finite scale)."""
    n = x.size
    for c in range(c0, c1):
        a = c * clen
        if _quantize_chunk(x, r, beta, scale, how, True, False, _ZERO64, _ZERO64, bits, block, a,
                           min(a + clen, n), out, packed, scales, v, m, uout):
            bad[c] = 1


def block_quantize_feedback(x, r, beta, scale, how, bits, block, clen, out, packed, scales, v=None, m=_F0,
                            uout=None):
    """Error feedback + :func:`block_quantize` (round to nearest) in one pass per chunk of
    blocks, each block while it is in L1: ``c = x*scale + r*beta`` (:func:`_compensate`), its
    absmax scale and codes, then ``out := c - decoded``, the new residual.  ``clen`` as for
    :func:`block_quantize`; ``out`` may be ``x`` or ``r`` (elementwise).  ``how`` bit 8: momentum
    correction first (:func:`_compensate_velocity`; ``v`` the live velocity, ``uout`` the new one).
    Returns the number of chunks with a non-finite scale."""
    bad = np.zeros(_nch(x.size, clen), np.uint8)
    _block_quantize_feedback(x, r, beta, scale, how, bits, block, clen, out, packed, scales,
                             x if v is None else v, m, x if uout is None else uout, bad)
    return int(bad.sum())


@njit(inline="always", **_SOPTS)
def _chunk_codes(packed, a, b, bits, buf):
    """The codes of elements ``[a, b)``: a slice of ``packed`` for 8 bits, else unpacked into ``buf``."""
    if bits == 8:
        return packed[a:b]
    _unpack_chunk(packed, a, b - a, bits, buf)
    return buf


@chunked(lambda pa, sa, pb, sb, two, bits, block, n, clen, out, accumulate: _nch(n, clen))
def block_dequantize(pa, sa, pb, sb, two, bits, block, n, clen, out, accumulate, c0, c1):
    """out[j] (+)= (code_j - qmax) * (scale / qmax), unpacking per chunk; with ``two``, a second
    payload ``(pb, sb)`` is added in the same pass: ``out = (out +) da + db``, the sum in that
    order (as two accumulating calls), written once."""
    for c in range(c0, c1):
        a = c * clen
        _dequantize_chunk(pa, sa, pb, sb, two, bits, block, a, min(a + clen, n), out, accumulate)


@njit(**_SOPTS)
def _dequantize_chunk(pa, sa, pb, sb, two, bits, block, a, b, out, accumulate):
    """:func:`block_dequantize` of elements ``[a, b)`` (whole blocks, ``a`` a multiple of 8)."""
    qmax = np.int32((1 << (bits - 1)) - 1)
    fq = np.float32(qmax)
    ca = _chunk_codes(pa, a, b, bits, np.empty(b - a + 4, np.uint8))
    cb = _chunk_codes(pb, a, b, bits, np.empty(b - a + 4, np.uint8)) if two else ca
    for s0 in range(a, b, block):
        s1 = min(s0 + block, b)
        ka = sa[s0 // block] / fq
        kb = sb[s0 // block] / fq
        os = out[s0:s1]
        xa = ca[s0 - a:s1 - a]
        xb = cb[s0 - a:s1 - a]
        if two and accumulate:
            for j in range(s1 - s0):
                os[j] = (os[j] + (np.float32(np.int32(xa[j])) - fq) * ka) \
                    + (np.float32(np.int32(xb[j])) - fq) * kb
        elif two:
            for j in range(s1 - s0):
                os[j] = (np.float32(np.int32(xa[j])) - fq) * ka + (np.float32(np.int32(xb[j])) - fq) * kb
        elif accumulate:
            for j in range(s1 - s0):
                os[j] = os[j] + (np.float32(np.int32(xa[j])) - fq) * ka
        else:
            for j in range(s1 - s0):
                os[j] = (np.float32(np.int32(xa[j])) - fq) * ka


# ---------------------------------------------------------------- sign + scale
@njit(inline="always", **_SOPTS)
def _tree_sum_abs(x, a, b, f):
    """Sum of |x[a:b]| * f in the reference's fixed order: adjacent pairs, level by level,
    over ``[a, b)`` zero-padded to a power of two (a streaming binary counter); ``f`` is a power
    of two (the literal 1.0 folds away after inlining)."""
    stack = np.empty(64, np.float32)
    level = np.empty(64, np.int64)
    top = 0
    j = a
    while j + 8 <= b:
        v0 = abs(x[j]) * f + abs(x[j + 1]) * f
        v1 = abs(x[j + 2]) * f + abs(x[j + 3]) * f
        v2 = abs(x[j + 4]) * f + abs(x[j + 5]) * f
        v3 = abs(x[j + 6]) * f + abs(x[j + 7]) * f
        v = (v0 + v1) + (v2 + v3)
        lv = 3
        while top > 0 and level[top - 1] == lv:
            top -= 1
            v = stack[top] + v
            lv += 1
        stack[top] = v
        level[top] = lv
        top += 1
        j += 8
    while j < b:
        v = abs(x[j]) * f
        lv = 0
        while top > 0 and level[top - 1] == lv:
            top -= 1
            v = stack[top] + v
            lv += 1
        stack[top] = v
        level[top] = lv
        top += 1
        j += 1
    if top == 0:
        return _F0
    acc = stack[top - 1]
    for t in range(top - 2, -1, -1):
        acc = stack[t] + acc
    return acc


@chunked(lambda x, chunk, scales: scales.size)
def sign_scales(x, chunk, scales, c0, c1):
    """scales[c] = the scale of chunk ``c`` (:func:`_sign_scale`: mean |x| in the reference's
    pairwise order, rescued where a finite chunk's sum overflows)."""
    n = x.size
    buf = np.empty(min(chunk, _PAIRWISE_MAX), np.float32)
    for c in range(c0, c1):
        a = c * chunk
        b = min(a + chunk, n)
        scales[c] = _sign_scale(x, a, b, buf)


@njit(inline="always", **_SOPTS)
def _abs_sum(x, a, b, buf, f):
    """The reference's pairwise sum of ``|x[a:b]| * f``: level by level in ``buf`` for runs of at
    most ``_PAIRWISE_MAX`` (vectorized), else streaming."""
    if b - a <= _PAIRWISE_MAX:
        return _pairwise_level_sum(x[a:b], False, buf, f)
    return _tree_sum_abs(x, a, b, f)


@njit(inline="always", **_SOPTS)
def _sign_scale(x, a, b, buf):
    """``reference.sign_pack``'s scale of chunk ``x[a:b]``: mean |x| in the pairwise order, or, for a
    finite chunk whose sum overflowed, the rescue on ``|x| * 2**-SIGN_RESCUE_SHIFT``."""
    m = np.float32(b - a)
    s = _abs_sum(x, a, b, buf, _F1)
    if s == _INF32:
        for j in range(a, b):
            if not abs(x[j]) < _INF32:
                return s / m   # a NaN/inf entry: the scale stays non-finite
        r = (_abs_sum(x, a, b, buf, _SIGN_DOWN) / m) * _SIGN_UP
        return r if r < _INF32 else _F32_MAX32
    return s / m


#: ``w * _BYTE_BITS >> 56`` gathers the low bits of the 8 bytes of ``w`` (each 0 or 1, little-endian)
#: into one byte, byte ``t`` to bit ``t``: the partial products never overlap, so nothing carries.
_BYTE_BITS = np.uint64(0x0102040810204080)
_S56 = np.uint64(56)


@njit(inline="always", **_SOPTS)
def _sign_bytes(c, flags, packed, byte0):
    """``packed[byte0 + i]`` = bits ``not (c[8i + t] < 0)`` of ``c`` (``t`` = bit), the tail byte
    zero-padded: one vectorized compare per entry into ``flags`` (at least ``c.size`` bytes,
    8-aligned), then one multiply per 8 entries."""
    m = c.size
    for j in range(m):
        flags[j] = np.uint8(not (c[j] < _F0))
    w = m >> 3
    words = flags[:8 * w].view(np.uint64)
    for i in range(w):
        packed[byte0 + i] = np.uint8((words[i] * _BYTE_BITS) >> _S56)
    if m & 7:
        v = np.uint8(0)
        for t in range(m & 7):
            v |= np.uint8(flags[8 * w + t] << t)
        packed[byte0 + w] = v


@chunked(lambda x, packed: packed.size)
def sign_bits(x, packed, c0, c1):
    """Bit j = not (x[j] < 0), little-endian, 8 entries per byte (bytes ``[c0, c1)``, a piece at a time)."""
    n = x.size
    flags = np.empty(_PIECE, np.uint8)
    for p0 in range(8 * c0, min(8 * c1, n), _PIECE):
        p1 = min(p0 + _PIECE, 8 * c1, n)
        _sign_bytes(x[p0:p1], flags, packed, p0 >> 3)


@chunked(lambda packed, scales, chunk, n, out, accumulate: scales.size)
def sign_unpack(packed, scales, chunk, n, out, accumulate, c0, c1):
    """out[j] (+)= +scale or -scale of ``j``'s chunk by bit ``j``."""
    for c in range(c0, c1):
        a = c * chunk
        b = min(a + chunk, n)
        s = scales[c]
        for j in range(a, b):
            v = s if (packed[j >> 3] >> (j & 7)) & 1 else -s
            if accumulate:
                out[j] = out[j] + v
            else:
                out[j] = v


# ---------------------------------------------------------------- minifloats (fp8, MX)
@njit(inline="always", **_SOPTS)
def _minifloat_codes(y, yi, base, fmax, fmax_key, emin, mbits, sbit, inv_tab, stochastic, k0, k1,
                     codes, cbase):
    """codes[cbase + j] = minifloat code of y[j] (see ``reference.minifloat_codes``);
    ``yi`` is ``y``'s int32 view, ``base`` the global index of ``y[0]`` (noise counter)."""
    for j in range(y.size):
        v = yi[j]
        ab = v & _ABS
        a = min(abs(y[j]), fmax)  # branch-free; NaN is fixed up below
        e = max((min(ab, fmax_key) >> 23) - 127, emin)
        r = a * inv_tab[e - emin]
        q = np.floor(r)
        f = r - q
        qi = np.int32(q)
        if stochastic:
            u = np.float32(np.int32(_bits24(base + j, k0, k1))) * _U24
            up = np.int32(u < f)
        else:
            up = np.int32(f > _HALF) | (np.int32(f == _HALF) & qi & 1)
        mag = (((e - emin) << mbits) + qi + up) | (sbit if v < 0 else 0)
        codes[cbase + j] = np.uint8(mag) if ab <= _INF_KEY else np.uint8(0)


def _minifloat_consts(e_bits, m_bits, fmax):
    """(fmax fp32, its bits, emin, M, sign bit, table of 2**(M - e) for e in [emin, emax])."""
    emin = 2 - (1 << (e_bits - 1))
    fm = np.float32(fmax)
    key = int(np.array([fm], np.float32).view(np.int32)[0])
    emax = (key >> 23) - 127
    tab = np.array([2.0 ** (m_bits - e) for e in range(emin, emax + 1)], np.float32)
    return fm, np.int32(key), np.int32(emin), np.int32(m_bits), np.int32(1 << (e_bits + m_bits)), tab


# One set of compile-time constants per format (index = MINIFLOAT_IDS in the backend):
# with literal parameters LLVM specializes each loop, several times faster than runtime ones.
_F0M, _F0K, _F0E, _F0B, _F0S, _F0T = _minifloat_consts(4, 3, 448.0)     # e4m3
_F1M, _F1K, _F1E, _F1B, _F1S, _F1T = _minifloat_consts(5, 2, 57344.0)   # e5m2
_F2M, _F2K, _F2E, _F2B, _F2S, _F2T = _minifloat_consts(2, 3, 7.5)       # e2m3
_F3M, _F3K, _F3E, _F3B, _F3S, _F3T = _minifloat_consts(2, 1, 6.0)       # e2m1


@njit(inline="always", **_SOPTS)
def _minifloat_any(fmt, y, yi, base, stochastic, k0, k1, codes, cbase):
    """:func:`_minifloat_codes` for format ``fmt`` (0 e4m3, 1 e5m2, 2 e2m3, 3 e2m1)."""
    if fmt == 0:
        _minifloat_codes(y, yi, base, _F0M, _F0K, _F0E, _F0B, _F0S, _F0T, stochastic, k0, k1, codes, cbase)
    elif fmt == 1:
        _minifloat_codes(y, yi, base, _F1M, _F1K, _F1E, _F1B, _F1S, _F1T, stochastic, k0, k1, codes, cbase)
    elif fmt == 2:
        _minifloat_codes(y, yi, base, _F2M, _F2K, _F2E, _F2B, _F2S, _F2T, stochastic, k0, k1, codes, cbase)
    else:
        _minifloat_codes(y, yi, base, _F3M, _F3K, _F3E, _F3B, _F3S, _F3T, stochastic, k0, k1, codes, cbase)


@chunked(lambda x, xi, block, fmt, fmax, stochastic, k0, k1, clen, codes, scales: _nch(x.size, clen))
def fp8_quantize(x, xi, block, fmt, fmax, stochastic, k0, k1, clen, codes, scales, c0, c1):
    """Per block: scale = absmax / fmax, codes of x * (fmax / absmax); one pass per chunk of blocks."""
    n = x.size
    for c in range(c0, c1):
        a = c * clen
        b = min(a + clen, n)
        ybuf = np.empty(min(block, _PIECE), np.float32)
        yib = ybuf.view(np.int32)
        kbuf = np.empty(1, np.int32)
        fbuf = kbuf.view(np.float32)
        for s0 in range(a, b, block):
            s1 = min(s0 + block, b)
            amax, inv = _block_scale(xi, s0, s1, kbuf, fbuf, fmax)
            scales[s0 // block] = amax / fmax
            for p0 in range(s0, s1, _PIECE):
                p1 = min(p0 + _PIECE, s1)
                yp = ybuf[:p1 - p0]
                xs = x[p0:p1]
                for j in range(p1 - p0):
                    yp[j] = xs[j] * inv
                _minifloat_any(fmt, yp, yib[:p1 - p0], p0, stochastic, k0, k1, codes, p0)


@chunked(lambda codes, scales, table, block, n, clen, out, accumulate: _nch(n, clen))
def fp8_dequantize(codes, scales, table, block, n, clen, out, accumulate, c0, c1):
    """out[j] (+)= table[codes[j]] * scales[j // block]."""
    for c in range(c0, c1):
        a = c * clen
        b = min(a + clen, n)
        for s0 in range(a, b, block):
            s1 = min(s0 + block, b)
            s = scales[s0 // block]
            cs = codes[s0:s1]
            os = out[s0:s1]
            if accumulate:
                for j in range(cs.size):
                    os[j] = os[j] + table[cs[j]] * s
            else:
                for j in range(cs.size):
                    os[j] = table[cs[j]] * s


@chunked(lambda x, xi, bits, emax, fmt, stochastic, k0, k1, clen, packed, scale_bytes: _nch(x.size, clen))
def mx_quantize(x, xi, bits, emax, fmt, stochastic, k0, k1, clen, packed, scale_bytes, c0, c1):
    """OCP MX blocks of 32: E8M0 scale byte and ``bits``-bit element codes, packed per chunk.

    ``clen`` is a multiple of 32 (so chunks start on a byte of the packed stream).
    """
    n = x.size
    for c in range(c0, c1):
        a = c * clen
        b = min(a + clen, n)
        if bits == 8:
            codes = packed[a:b]
        else:
            codes = np.empty(b - a, np.uint8)
        ybuf = np.empty(32, np.float32)
        yib = ybuf.view(np.int32)
        kbuf = np.empty(1, np.int32)
        fbuf = kbuf.view(np.float32)
        for s0 in range(a, b, 32):
            s1 = min(s0 + 32, b)
            m = _absmax_key(xi, s0, s1)
            if m >= _INF_KEY:
                scale_bytes[s0 >> 5] = np.uint8(255)
                inv = _F0
            else:
                shared = max((m >> 23) - 127 - emax, -127)
                scale_bytes[s0 >> 5] = np.uint8(shared + 127)
                kbuf[0] = np.int32((127 - shared) << 23)
                inv = fbuf[0]
            xs = x[s0:s1]
            for j in range(s1 - s0):
                ybuf[j] = xs[j] * inv
            _minifloat_any(fmt, ybuf[:s1 - s0], yib[:s1 - s0], s0, stochastic, k0, k1, codes, s0 - a)
        if bits != 8:
            _pack_range(codes, a, a, b, bits, packed)


@chunked(lambda packed, scale_bytes, table, scale_tab, bits, n, clen, out, accumulate: _nch(n, clen))
def mx_dequantize(packed, scale_bytes, table, scale_tab, bits, n, clen, out, accumulate, c0, c1):
    """out[j] (+)= table[code_j] * scale_tab[scale_bytes[j // 32]], unpacking per chunk."""
    for c in range(c0, c1):
        a = c * clen
        b = min(a + clen, n)
        if bits == 8:
            codes = packed[a:b]
        else:
            codes = np.empty(b - a, np.uint8)
            _unpack_range(packed, a, b, bits, codes, a)
        for s0 in range(a, b, 32):
            s1 = min(s0 + 32, b)
            s = scale_tab[scale_bytes[s0 >> 5]]
            cs = codes[s0 - a:s1 - a]
            os = out[s0:s1]
            if accumulate:
                for j in range(cs.size):
                    os[j] = os[j] + table[cs[j]] * s
            else:
                for j in range(cs.size):
                    os[j] = table[cs[j]] * s


# ---------------------------------------------------------------- QSGD / TernGrad levels
@njit(inline="always", **_SOPTS)
def _tree_sum_sq(x, a, b, f):
    """Sum of (x[a:b] * f)**2 in the reference's fixed pairwise order (see :func:`_tree_sum_abs`);
    ``f`` is a power of two (the literal 1.0 folds away after inlining)."""
    stack = np.empty(64, np.float32)
    level = np.empty(64, np.int64)
    top = 0
    j = a
    while j + 8 <= b:
        y0, y1, y2, y3 = x[j] * f, x[j + 1] * f, x[j + 2] * f, x[j + 3] * f
        y4, y5, y6, y7 = x[j + 4] * f, x[j + 5] * f, x[j + 6] * f, x[j + 7] * f
        v0 = y0 * y0 + y1 * y1
        v1 = y2 * y2 + y3 * y3
        v2 = y4 * y4 + y5 * y5
        v3 = y6 * y6 + y7 * y7
        v = (v0 + v1) + (v2 + v3)
        lv = 3
        while top > 0 and level[top - 1] == lv:
            top -= 1
            v = stack[top] + v
            lv += 1
        stack[top] = v
        level[top] = lv
        top += 1
        j += 8
    while j < b:
        y = x[j] * f
        v = y * y
        lv = 0
        while top > 0 and level[top - 1] == lv:
            top -= 1
            v = stack[top] + v
            lv += 1
        stack[top] = v
        level[top] = lv
        top += 1
        j += 1
    if top == 0:
        return _F0
    acc = stack[top - 1]
    for t in range(top - 2, -1, -1):
        acc = stack[t] + acc
    return acc


@njit(inline="always", **_SOPTS)
def _norm_shift(xi, a, b):
    """``reference.norm_shift`` of the largest bits(|x|) over x[a:b] (``xi``: x's int32 view)."""
    m = np.int32(0)
    for t in range(a, b):
        m = max(m, xi[t] & _ABS)
    return min(max(np.int32(127) - (m >> 23), np.int32(-126)), np.int32(126))


@njit(inline="always", **_SOPTS)
def _pow2_f32(k):
    """2**k as fp32 (k in [-126, 127]); exact."""
    return np.float32(math.ldexp(1.0, k))


@njit(inline="always", **_SOPTS)
def _norm_fast_ok(s):
    """The unscaled sum of squares ``s`` is the norm's (``reference.NORM_TINY <= s < inf``)."""
    return s >= _NORM_TINY and s < _INF32


@njit(inline="always", **_SOPTS)
def _norm_rescued(s, k):
    """fp32 of sqrt(s) * 2**-k (fp64), saturated at the fp32 maximum when finite."""
    r = np.sqrt(np.float64(s)) * math.ldexp(1.0, -k)
    if r > _F32_MAX64 and r < np.inf:
        r = _F32_MAX64
    return np.float32(r)


@chunked(lambda x, xi, bucket, norms: norms.size)
def bucket_norms(x, xi, bucket, norms, c0, c1):
    """norms[b] = sqrt(tree-sum of squares over bucket ``b``) in fp32, summed again scaled by a
    power of two when the plain sum overflowed or is tiny (``reference.bucket_norms``)."""
    n = x.size
    for c in range(c0, c1):
        a = c * bucket
        e = min(a + bucket, n)
        s = _tree_sum_sq(x, a, e, _F1)
        if _norm_fast_ok(s):
            norms[c] = np.float32(np.sqrt(np.float64(s)))
        else:
            k = _norm_shift(xi, a, e)
            norms[c] = _norm_rescued(_tree_sum_sq(x, a, e, _pow2_f32(k)), k)


@njit(inline="always", **_SOPTS)
def _level_multiplier(fl, s):
    """``reference.level_multiplier`` for one bucket's scale ``s > 0``: (m, p)."""
    m = fl / s
    if m == _INF32:
        p = _PRESCALE
    elif m > _F0 and m < _F32_MIN:
        p = _INV_PRESCALE
    else:
        return m, _F1
    return fl / (s * p), p


@njit(inline="always", **_SOPTS)
def _level_codes(t, pre, mul, fl, step, base, k0, k1, feedback, codes, os, ub, pa, pb, pc, at):
    """QSGD/TernGrad codes of one bucket's values ``t`` (see ``reference.level_quantize``), element
    ``j`` with the noise of element ``base + j``: ``q = clamp(floor((|t_j| * pre) * mul + u), 0, fl)``
    (NaN -> 0), ``code = fl + q`` or ``fl - q`` by ``t_j``'s sign bit, into ``codes[j]``;
    ``feedback``: also ``os[j] = t_j - (code - fl) * step``, what ``level_dequantize`` leaves of it.
    The noise is drawn first into ``ub`` (a private fp32 buffer of at least ``t.size``:
    :func:`_fill_uniform24`, 16 lanes at a time, prefetching ``pa``, ``pb`` and, to be written,
    ``pc`` from ``at`` when ``at >= 0``); the signed level is ``copysign(q, t_j)``, so the
    loop has no branch and vectorizes; ``codes`` and ``os`` must not overlap ``t``."""
    m = t.size
    u = ub[:m]
    _fill_uniform24(u, base, k0, k1, pa, pb, pc, at)
    if feedback:
        for j in range(m):
            v = t[j]
            q = np.floor((abs(v) * pre) * mul + u[j])
            q = min(max(_F0, q), fl)  # max(0, NaN) is 0
            code = fl + np.copysign(q, v)
            codes[j] = np.uint8(np.int32(code))
            os[j] = v - (code - fl) * step
    else:
        for j in range(m):
            v = t[j]
            q = np.floor((abs(v) * pre) * mul + u[j])
            q = min(max(_F0, q), fl)  # max(0, NaN) is 0
            codes[j] = np.uint8(np.int32(fl + np.copysign(q, v)))


@chunked(lambda x, scales, bucket, levels, bits, k0, k1, clen, packed: _nch(x.size, clen))
def level_quantize(x, scales, bucket, levels, bits, k0, k1, clen, packed, c0, c1):
    """QSGD/TernGrad stochastic codes (see ``reference.level_quantize``), coded and packed a piece
    of ``_PIECE`` entries at a time (chunks of ``clen`` entries, a multiple of 8)."""
    n = x.size
    fl = np.float32(levels)
    codes = np.empty(_PIECE + 4, np.uint8)
    ub = np.empty(_PIECE, np.float32)
    for c in range(c0, c1):
        a = c * clen
        b = min(a + clen, n)
        for p0 in range(a, b, _PIECE):
            p1 = min(p0 + _PIECE, b)
            j = p0
            while j < p1:
                bk = j // bucket
                e = min(p1, (bk + 1) * bucket)
                s = scales[bk]
                if not (s > _F0):
                    s = np.float32(1.0)
                mul, pre = _level_multiplier(fl, s)
                _level_codes(x[j:e], pre, mul, fl, _F0, j, k0, k1, False, codes[j - p0:e - p0], x, ub, x, x, x, -1)
                j = e
            _put_codes(codes, p1 - p0, p0, bits, packed)


@njit(inline="always", **_SOPTS)
def _put_codes(codes, m, a, bits, packed):
    """The ``m`` codes ``codes[0:m]`` (a private buffer of at least ``m + 4``) as elements ``[a, a + m)``
    of ``packed`` (``a`` a multiple of 8): copied for 8 bits, else :func:`_pack_chunk`."""
    if bits == 8:
        packed[a:a + m] = codes[:m]
    else:
        _pack_chunk(codes, m, a, bits, packed)


@njit(inline="always", **_SOPTS)
def _compensate_squares(x, r, beta, scale, how, t, buf):
    """``t = x*scale + r*beta`` as :func:`_compensate_plain` and, in the same loop, the first level
    of the bucket's pairwise sum of squares, ``buf[i] = t[2i]**2 + t[2i+1]**2`` (what
    :func:`_pairwise_level_sum` starts with): one pass over the bucket instead of two.  For the
    common ``how`` (0: ``x``; 1: ``x + r``; 5: ``x*scale + r``, the hooks' averaging); returns False
    (``t`` written, ``buf`` not) for the others."""
    m = t.size
    h = m >> 1
    if how == 1:
        for i in range(h):
            c0 = x[2 * i] + r[2 * i]
            c1 = x[2 * i + 1] + r[2 * i + 1]
            t[2 * i] = c0
            t[2 * i + 1] = c1
            buf[i] = c0 * c0 + c1 * c1
        if m & 1:
            t[m - 1] = x[m - 1] + r[m - 1]
    elif how == 0:
        for i in range(h):
            c0 = x[2 * i]
            c1 = x[2 * i + 1]
            t[2 * i] = c0
            t[2 * i + 1] = c1
            buf[i] = c0 * c0 + c1 * c1
        if m & 1:
            t[m - 1] = x[m - 1]
    elif how == 5:
        for i in range(h):
            c0 = x[2 * i] * scale + r[2 * i]
            c1 = x[2 * i + 1] * scale + r[2 * i + 1]
            t[2 * i] = c0
            t[2 * i + 1] = c1
            buf[i] = c0 * c0 + c1 * c1
        if m & 1:
            t[m - 1] = x[m - 1] * scale + r[m - 1]
    else:
        _compensate_plain(x, r, beta, scale, how, t)
        return False
    return True


@intrinsic
def _pair_sums(typingctx, buf, i):
    """``buf[i + l] = buf[2*i + 2*l] + buf[2*i + 2*l + 1]`` for ``l < _UW`` (``buf`` contiguous fp32):
    one level of the pairwise tree, ``_UW`` sums at once from ``2 * _UW`` loaded entries (the even
    and odd lanes split by two shuffles).  All loads come before the store, and ``i <= 2*i``, so
    calls for ``i = 0, _UW, 2*_UW, ...`` fold a level in place.  The loop vectorizer leaves the
    same in-place loop scalar (it cannot prove the strided reads and the writes apart)."""
    if not (isinstance(buf, types.Array) and buf.dtype == types.float32 and buf.layout == "C"
            and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ii = context.cast(builder, args[1], signature.args[1], types.intp)
        v2 = ir.VectorType(ir.FloatType(), 2 * _UW)
        vf = ir.VectorType(ir.FloatType(), _UW)
        src = builder.gep(ary.data, [builder.add(ii, ii)])
        v = builder.load(builder.bitcast(src, v2.as_pointer()), align=4)
        i32 = ir.IntType(32)
        ev = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, _UW), list(range(0, 2 * _UW, 2))))
        od = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, _UW), list(range(1, 2 * _UW, 2))))
        builder.store(builder.fadd(ev, od), builder.bitcast(builder.gep(ary.data, [ii]), vf.as_pointer()), align=4)
        return context.get_dummy_value()

    return types.void(buf, i), codegen


@njit(inline="always", **_SOPTS)
def _fold_levels(buf, full, half):
    """The pairwise sum of ``buf[:full]``, zero-padded to ``half`` (a power of two): adjacent
    pairs level by level, in place (the reference's order); the levels of at least ``_UW`` sums
    ``_UW`` at a time (:func:`_pair_sums`), the last few one by one (the same additions)."""
    for i in range(full, half):
        buf[i] = _F0
    w = half
    while w >= 2 * _UW:
        w >>= 1
        for i in range(0, w, _UW):
            _pair_sums(buf, i)
    while w > 1:
        w >>= 1
        for i in range(w):
            buf[i] = buf[2 * i] + buf[2 * i + 1]
    return buf[0]


@njit(inline="always", **_SOPTS)
def _pairwise_squares_finish(t, buf):
    """:func:`_pairwise_level_sum` of ``t`` squared (``f = 1``) whose first level is already in
    ``buf[:t.size // 2]`` (:func:`_compensate_squares`)."""
    m = t.size
    if m < 2:
        return t[0] * t[0] if m else _F0
    p = 2
    while p < m:
        p *= 2
    half = p >> 1
    full = m >> 1
    if m & 1:
        buf[full] = t[m - 1] * t[m - 1]
        full += 1
    return _fold_levels(buf, full, half)


@njit(inline="always", **_SOPTS)
def _bucket_norm(t, ti, buf, first):
    """``reference.bucket_norms`` of one cache-resident bucket ``t`` (``ti`` its int32 view, ``buf``
    at least half its power-of-two size): the pairwise sum of squares (its first level already in
    ``buf`` when ``first``), again scaled when it over- or underflowed."""
    sq = _pairwise_squares_finish(t, buf) if first else _pairwise_level_sum(t, True, buf, _F1)
    if _norm_fast_ok(sq):
        return np.float32(np.sqrt(np.float64(sq)))
    k = _norm_shift(ti, 0, t.size)
    return _norm_rescued(_pairwise_level_sum(t, True, buf, _pow2_f32(k)), k)


@njit(**_SOPTS)  # not inlined: one compiled body for the two kernels below (compile time)
def _qsgd_chunk(x, r, beta, scale, how, feedback, levels, bits, bucket, k0, k1, a, b, out, packed, norms):
    """QSGD of elements ``[a, b)`` (whole buckets of at most ``_PAIRWISE_MAX``; ``a`` a multiple of
    8): each bucket staged in a private buffer (``c = x*scale + r*beta`` with the first level of its
    squares, :func:`_compensate_squares`), its norm (:func:`_bucket_norm`) and codes
    (:func:`_level_codes`) while it is in L1; ``feedback``: also ``out[j] := c_j - decoded_j`` (the new residual; ``out`` may be ``x`` or
    ``r``).  Returns True when some bucket's norm is not finite."""
    fl = np.float32(levels)
    m = b - a
    n = x.size
    codes = np.empty(m + 4, np.uint8)
    width = min(bucket, m)
    tmpi = np.empty(width, np.int32)
    tmp = tmpi.view(np.float32)
    buf = np.empty(width, np.float32)
    ub = np.empty(width, np.float32)
    bad = False
    for s0 in range(a, b, bucket):
        s1 = min(s0 + bucket, b)
        k = s1 - s0
        t = tmp[:k]
        first = _compensate_squares(x[s0:s1], r[s0:s1], beta, scale, how, t, buf)
        nrm = _bucket_norm(t, tmpi[:k], buf, first)
        norms[s0 // bucket] = nrm
        if not abs(nrm) < _INF32:
            bad = True
        mul, pre = _level_multiplier(fl, nrm if nrm > _F0 else _F1)
        at = s0 + _AHEAD if s0 + _AHEAD < n else -1
        _level_codes(t, pre, mul, fl, nrm / fl, s0, k0, k1, feedback, codes[s0 - a:s1 - a], out[s0:s1], ub,
                     x, r, out if feedback else x, at)
    _put_codes(codes, m, a, bits, packed)
    return bad


@chunked(lambda x, bucket, levels, bits, k0, k1, clen, packed, norms: _nch(x.size, clen))
def qsgd_quantize(x, bucket, levels, bits, k0, k1, clen, packed, norms, c0, c1):
    """:func:`bucket_norms` + :func:`level_quantize` in one pass (:func:`_qsgd_chunk`): each bucket
    (at most ``_PAIRWISE_MAX`` entries) is summed while in cache, then coded.  ``clen`` is a
    multiple of ``bucket`` and of 8."""
    n = x.size
    for c in range(c0, c1):
        a = c * clen
        _qsgd_chunk(x, x, _F0, _F1, 0, False, levels, bits, bucket, k0, k1, a, min(a + clen, n), x, packed, norms)


@chunked(lambda x, r, beta, scale, how, bucket, levels, bits, k0, k1, clen, out, packed, norms, bad: bad.size)
def _qsgd_quantize_feedback(x, r, beta, scale, how, bucket, levels, bits, k0, k1, clen, out, packed, norms, bad,
                            c0, c1):
    n = x.size
    for c in range(c0, c1):
        a = c * clen
        if _qsgd_chunk(x, r, beta, scale, how, True, levels, bits, bucket, k0, k1, a, min(a + clen, n), out,
                       packed, norms):
            bad[c] = 1


def qsgd_quantize_feedback(x, r, beta, scale, how, bucket, levels, bits, k0, k1, clen, out, packed, norms):
    """Error feedback + :func:`qsgd_quantize` in one pass per chunk of buckets, each bucket while it
    is in L1: ``c = x*scale + r*beta`` (``how`` as :func:`_compensate_plain`), its norm and codes,
    then ``out := c - decoded``, the new residual (``out`` may be ``x`` or ``r``).  Returns the
    number of chunks with a non-finite norm."""
    bad = np.zeros(_nch(x.size, clen), np.uint8)
    _qsgd_quantize_feedback(x, r, beta, scale, how, bucket, levels, bits, k0, k1, clen, out, packed, norms, bad)
    return int(bad.sum())


@chunked(lambda x, r, beta, scale, how, clen, keys: keys.size)
def _absmax_compensated(x, r, beta, scale, how, clen, keys, c0, c1):
    """keys[c] = the largest bits(|c_j|) of chunk ``c``, ``c = x*scale + r*beta`` staged a piece at a time."""
    n = x.size
    tmpi = np.empty(_PIECE, np.int32)
    tmp = tmpi.view(np.float32)
    for c in range(c0, c1):
        a = c * clen
        b = min(a + clen, n)
        m = np.int32(0)
        for p0 in range(a, b, _PIECE):
            p1 = min(p0 + _PIECE, b)
            _compensate_plain(x[p0:p1], r[p0:p1], beta, scale, how, tmp[:p1 - p0])
            m = max(m, _absmax_key(tmpi, 0, p1 - p0))
        keys[c] = m


@chunked(lambda x, r, beta, scale, how, s, k0, k1, clen, out, packed: _nch(x.size, clen))
def _terngrad_codes_feedback(x, r, beta, scale, how, s, k0, k1, clen, out, packed, c0, c1):
    """Pass 2 of :func:`terngrad_quantize_feedback`: ``c`` again, a piece at a time, its 2-bit codes
    under the scale ``s`` and ``out := c - decoded``.  Pieces of ``_AHEAD`` entries: the next
    piece's inputs (and ``out``) are prefetched while this one's noise is drawn."""
    n = x.size
    fl = _F1
    mul, pre = _level_multiplier(fl, s if s > _F0 else _F1)
    tmp = np.empty(_AHEAD, np.float32)
    ub = np.empty(_AHEAD, np.float32)
    codes = np.empty(_AHEAD + 4, np.uint8)
    step = s / fl
    for c in range(c0, c1):
        a = c * clen
        b = min(a + clen, n)
        for p0 in range(a, b, _AHEAD):
            p1 = min(p0 + _AHEAD, b)
            t = tmp[:p1 - p0]
            _compensate_plain(x[p0:p1], r[p0:p1], beta, scale, how, t)
            at = p0 + _AHEAD if p0 + _AHEAD < n else -1
            _level_codes(t, pre, mul, fl, step, p0, k0, k1, True, codes, out[p0:p1], ub, x, r, out, at)
            _pack_chunk(codes, p1 - p0, p0, 2, packed)


def terngrad_quantize_feedback(x, r, beta, scale, how, k0, k1, clen, out, packed):
    """Error feedback + TernGrad (one level, one scale ``max |c|``) in two passes over ``x`` and
    ``r``: the scale of ``c = x*scale + r*beta`` (no write), then ``c`` again, its 2-bit codes and
    ``out := c - decoded`` (``out`` may be ``x`` or ``r``: each piece is read before it is
    written).  ``clen`` a multiple of 8.  Returns the scale (fp32; NaN when some ``c`` is NaN)."""
    keys = np.zeros(_nch(x.size, clen), np.int32)
    _absmax_compensated(x, r, beta, scale, how, clen, keys)
    key = np.int32(keys.max()) if keys.size else np.int32(0)
    s = np.array([key if key <= _INF_KEY else 0x7FC00000], np.int32).view(np.float32)
    _terngrad_codes_feedback(x, r, beta, scale, how, s[0], k0, k1, clen, out, packed)
    return s


@chunked(lambda packed, scales, bucket, levels, bits, n, clen, out, accumulate: _nch(n, clen))
def level_dequantize(packed, scales, bucket, levels, bits, n, clen, out, accumulate, c0, c1):
    """out[j] (+)= (code_j - levels) * (scales[j // bucket] / levels), unpacked a piece of ``_PIECE``
    entries at a time (:func:`_unpack_chunk`; chunks of ``clen``, a multiple of 8)."""
    fl = np.float32(levels)
    codes = np.empty(_PIECE + 4, np.uint8)
    for c in range(c0, c1):
        a = c * clen
        b = min(a + clen, n)
        for p0 in range(a, b, _PIECE):
            p1 = min(p0 + _PIECE, b)
            if bits == 8:
                codes[:p1 - p0] = packed[p0:p1]
            else:
                _unpack_chunk(packed, p0, p1 - p0, bits, codes)
            j = p0
            while j < p1:
                bk = j // bucket
                e = min(p1, (bk + 1) * bucket)
                step = scales[bk] / fl
                cs = codes[j - p0:e - p0]
                os = out[j:e]
                if accumulate:
                    for t in range(e - j):
                        os[t] = os[t] + (np.float32(cs[t]) - fl) * step
                else:
                    for t in range(e - j):
                        os[t] = (np.float32(cs[t]) - fl) * step
                j = e


# ---------------------------------------------------------------- sign + scale + error feedback
@njit(inline="always", **_SOPTS)
def _pairwise_level_sum(v, square, buf, f):
    """Sum of |v| * f (or (v*f)**2; ``f`` a power of two: the literal 1.0 folds away after inlining)
    in the reference's pairwise order (zero-padded to a power of two, adjacent pairs level by
    level), computed level by level in ``buf`` (>= half that power): vectorizable, unlike the
    streaming :func:`_tree_sum_abs`; for cache-sized ``v``."""
    m = v.size
    if m == 0:
        return _F0
    if m == 1:
        return (v[0] * f) * (v[0] * f) if square else abs(v[0]) * f
    p = 2
    while p < m:
        p *= 2
    half = p >> 1
    full = m >> 1
    if square:
        for i in range(full):
            y0 = v[2 * i] * f
            y1 = v[2 * i + 1] * f
            buf[i] = y0 * y0 + y1 * y1
    else:
        for i in range(full):
            buf[i] = abs(v[2 * i]) * f + abs(v[2 * i + 1]) * f
    if m & 1:
        buf[full] = (v[m - 1] * f) * (v[m - 1] * f) if square else abs(v[m - 1]) * f
        full += 1
    return _fold_levels(buf, full, half)


@chunked(lambda x, res, beta, use_beta, chunk, new_res, packed, scales, bad: bad.size)
def _sign_pack_feedback(x, res, beta, use_beta, chunk, new_res, packed, scales, bad, c0, c1):
    """One chunk range of :func:`sign_pack_feedback` (``bad[c]`` set for a non-finite chunk)."""
    n = x.size
    buf = np.empty(min(chunk, _PAIRWISE_MAX), np.float32)
    flags = np.empty(min(chunk, n), np.uint8)
    for c in range(c0, c1):
        a = c * chunk
        b = min(a + chunk, n)
        cs = new_res[a:b]
        xs = x[a:b]
        rs = res[a:b]
        if use_beta:
            for j in range(b - a):
                cs[j] = xs[j] + rs[j] * beta
        else:
            for j in range(b - a):
                cs[j] = xs[j] + rs[j]
        s = _sign_scale(new_res, a, b, buf)
        scales[c] = s
        if not (abs(s) < np.float32(np.inf)):
            bad[c] = 1
        m = b - a
        _sign_bytes(cs, flags, packed, a >> 3)
        for j in range(m):
            cj = cs[j]
            cs[j] = cj + s if cj < _F0 else cj - s


def sign_pack_feedback(x, res, beta, use_beta, chunk, new_res, packed, scales):
    """Per chunk, while in cache: c = x + res (* beta), scale = mean |c|, sign bits,
    new_res = c - (+-scale).  ``chunk`` must be a multiple of 8 (whole bytes per chunk);
    returns False when some c or scale is not finite."""
    bad = np.zeros(scales.size, np.uint8)
    _sign_pack_feedback(x, res, beta, use_beta, chunk, new_res, packed, scales, bad)
    return not bad.any()


# ---------------------------------------------------------------- bf16 cast under error feedback
_BF16_MAX_BITS = np.int32(0x7F7F0000)   # bf16's largest finite value, as fp32 bits
_F32_INF_BITS = np.int32(0x7F800000)


_HALF_CHUNK = 512   # elements a piece: its compensated values and sent bits stay in L1
_F16_MAX_BITS = np.int32(0x477FE000)    # fp16's largest finite value (65504), as fp32 bits
_F16_MIN_NORMAL_BITS = np.int32(0x38800000)   # 2**-14
_F32_ROUND = np.float32(12582912.0)     # 1.5 * 2**23: adding and subtracting it rounds to an integer (RNE)
_F32_2P24 = np.float32(16777216.0)
_F32_2M24 = np.float32(2.0 ** -24)


@njit(inline="always", **_SOPTS)
def _half_compensate(xb, rb, cf, m, beta, scale, how):
    """``cf[:m] = x*scale`` (``how & 4``) ``+ r`` (``how & 1``; ``r*beta``: ``how & 2``), each product
    rounded on its own (:func:`commpress.ops.reference.compensated`)."""
    for j in range(m):
        v = xb[j] * scale if how & 4 else xb[j]
        if how & 1:
            v = v + (rb[j] * beta if how & 2 else rb[j])
        cf[j] = v


@njit(cache=True, nogil=True, error_model="numpy")
def half_feedback(x, r, beta, scale, how, res, sent, nan_pos, nan_neg, nan_payload, fp16):   # pragma: no cover - compiled
    """``ops.cast_feedback`` in one pass: ``c`` compensated (:func:`_half_compensate`), ``sent`` its
    bf16 bits (``fp16`` False) or fp16 bits (True), ``res := c - sent`` (the sent value exact in
    fp32).  Returns whether every ``c`` is finite.

    bf16: round to nearest even on the bits, a finite ``c`` beyond bf16's largest value saturated
    there, inf kept, a NaN as torch converts it (``nan_pos`` / ``nan_neg`` by its sign).  fp16 (numba
    has no float16: the conversion on the bits): a normal result rounds the mantissa to nearest
    even (a carry moves into the exponent), one below 2**-14 is ``|c| * 2**24`` rounded to an
    integer (RNE, the subnormal's code), a finite ``c`` beyond 65504 is sent as ±65504, inf kept, a
    NaN as torch converts it (``nan_payload``: quieted with its payload's top bits, as F16C does;
    else ``nan_pos`` / ``nan_neg``).  A piece at a time through small buffers, so that each loop
    vectorizes (the bits of ``c`` and of the sent value are views of them).  ``r`` may be ``res``
    or ``x`` may be ``res``: a piece is read before it is written."""
    n = x.size
    cf = np.empty(_HALF_CHUNK, np.float32)
    ci = cf.view(np.int32)
    qi = np.empty(_HALF_CHUNK, np.int32)
    qf = qi.view(np.float32)
    top = np.int32(0)
    for lo in range(0, n, _HALF_CHUNK):
        m = min(_HALF_CHUNK, n - lo)
        ob, sb = res[lo:lo + m], sent[lo:lo + m]
        _half_compensate(x[lo:lo + m], r[lo:lo + m], cf, m, beta, scale, how)
        if not fp16:
            for j in range(m):
                b = ci[j]
                a = b & np.int32(0x7FFFFFFF)
                ub = np.uint32(b)
                t = np.int32((ub + np.uint32(0x7FFF) + ((ub >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
                t = (((b >> 16) & np.int32(0x8000)) | np.int32(0x7F7F)) if a > _BF16_MAX_BITS else t
                t = ((b >> 16) & np.int32(0xFFFF)) if a == _F32_INF_BITS else t
                t = (nan_neg if b < 0 else nan_pos) if a > _F32_INF_BITS else t
                top = max(top, a)
                sb[j] = np.int16(t)
                qi[j] = t << 16
            for j in range(m):
                ob[j] = cf[j] - qf[j]
            continue
        for j in range(m):
            b = ci[j]
            a = b & np.int32(0x7FFFFFFF)
            sign = (b >> 16) & np.int32(0x8000)
            tn = ((a + np.int32(0xFFF) + ((a >> 13) & np.int32(1))) >> 13) - np.int32(112 << 10)
            v = abs(cf[j]) * _F32_2P24   # exact: |c| < 2**-14 here, so below 1024
            ts = np.int32((v + _F32_ROUND) - _F32_ROUND)
            t = tn if a >= _F16_MIN_NORMAL_BITS else ts
            t = np.int32(0x7BFF) if a > _F16_MAX_BITS else t
            t = np.int32(0x7C00) if a == _F32_INF_BITS else t
            t = t | sign
            if nan_payload:   # F16C's rule: quieted, the payload's top bits kept
                t = (sign | np.int32(0x7E00) | ((a >> 13) & np.int32(0x3FF))) if a > _F32_INF_BITS else t
            else:
                t = (nan_neg if b < 0 else nan_pos) if a > _F32_INF_BITS else t
            top = max(top, a)
            sb[j] = np.int16(t)
            mag = t & np.int32(0x7FFF)
            qi[j] = ((mag + np.int32(112 << 10)) << 13) | (sign << 16)   # a normal one's fp32 bits
        for j in range(m):
            mag = np.int32(sb[j]) & np.int32(0x7FFF)
            q = np.float32(mag) * _F32_2M24   # a subnormal (or zero) one's value
            q = -q if sb[j] < 0 else q
            ob[j] = cf[j] - (q if mag < np.int32(0x400) else qf[j])
    return top < _F32_INF_BITS


# ---------------------------------------------------------------- lean residual storage (ops/lean.py)
_NOISE_HALF = np.float32(0.5)        # a noise byte's uniform: (byte + 0.5) / 256
_NOISE_STEP = np.float32(1.0 / 256)
# Module-level, so that numba's disk cache serves them to every process (defined in a closure they
# were compiled again by each one: about 0.8 s on the first step).  127: lean.INT8_MAX.
@njit(cache=True, nogil=True, error_model="numpy")
def lean_int8_block_slow(x, noise, codes, lo, hi, s):   # pragma: no cover - compiled
    """A block holding a NaN/inf: the reference's conversions, element by element."""
    f127 = np.float32(127)
    half = np.float32(0.5)
    step = np.float32(1.0 / 256)
    inv = np.float32(1.0) / s if s > 0 else np.float32(0.0)
    for i in range(lo, hi):
        v = x[i] * inv + (np.float32(noise[i]) + half) * step
        if v != v:   # NaN: the platform's conversion, as the reference's
            codes[i] = np.int8(v)
            continue
        if v >= f127:
            t = 127
        elif v <= -f127:
            t = -127
        else:
            t = np.int32(v)   # floor without a libm call
            if t > v:
                t -= 1
        codes[i] = np.int8(t)


@njit(cache=True, nogil=True, error_model="numpy")
def lean_int8_encode(x, xi, noise, codes, scales, block):   # pragma: no cover - compiled
    """:func:`_int8_encode`, compiled on its own."""
    return _int8_encode(x, xi, noise, codes, scales, block)


@njit(inline="always", **_SOPTS)
def _int8_encode(x, xi, noise, codes, scales, block):
    """``x`` stored as int8 blocks (``codes``, ``scales``).  Branch-free inner loops (slices, so that they vectorize: 6x a memcpy became ~1.5x on one core): the
    block's largest magnitude as the max of the sign-cleared bit patterns (ordered like the
    values; a NaN's above inf's), then ``floor(clamp(v))``, which equals the reference's
    ``clamp(floor(v))`` for finite ``v``.  Returns whether a block held a NaN/inf."""
    n = x.size
    f127 = np.float32(127)
    half, step, one = _NOISE_HALF, _NOISE_STEP, _F1
    bits = np.empty(1, np.int32)
    as_float = bits.view(np.float32)
    bad = False
    for b in range(scales.size):
        lo = b * block
        hi = min(lo + block, n)
        m = _absmax_key(xi, lo, hi)   # on a slice: the loop vectorizes
        bits[0] = m
        s = as_float[0] / f127   # NaN for a NaN anywhere in the block (as torch.amax)
        scales[b] = s
        if m >= np.int32(0x7F800000):   # a NaN/inf: the reference's conversions
            bad = True
            lean_int8_block_slow(x, noise, codes, lo, hi, s)
        else:
            inv = one / s if s > 0 else np.float32(0.0)
            xb, ub, cb = x[lo:hi], noise[lo:hi], codes[lo:hi]
            for j in range(xb.size):
                v = xb[j] * inv + (np.float32(ub[j]) + half) * step
                cb[j] = np.int8(np.int32(np.floor(min(max(v, -f127), f127))))
        for i in range(hi, lo + block):
            codes[i] = 0
    return bad


@njit(cache=True, nogil=True, error_model="numpy")
def lean_bf16_encode(bits, noise, out):   # pragma: no cover - compiled
    for i in range(bits.size):
        out[i] = np.int16((bits[i] + (np.int32(noise[i]) & 0xFFFF)) >> 16)


@njit(cache=True, nogil=True, error_model="numpy")
def lean_int8_add(dst, codes, scales, block, pre):   # pragma: no cover - compiled
    """``dst := dst * pre + codes * scales`` (each product rounded on its own: the reference's
    ``mul_`` then ``add_``; ``x * 1`` is ``x``, NaN and signed zeros included)."""
    n = dst.size
    for b in range(scales.size):
        lo = b * block
        hi = min(lo + block, n)
        if lo >= hi:
            break
        s = scales[b]
        db, cb = dst[lo:hi], codes[lo:hi]   # slices: the loop vectorizes
        for j in range(db.size):
            db[j] = db[j] * pre + np.float32(cb[j]) * s


# int4: a code c in [-7, 7] (lean.INT4_MAX) kept as the nibble c + 8; byte j of a block holds its
# element j (low nibble) and element j + block/2 (high nibble): both halves contiguous, so the loops vectorize.
_F32_TINY = np.float32(1.1754943508222875e-38)   # fp32's smallest normal


@njit(inline="always", **_SOPTS)
def _int4_code(v, f7):
    return np.int32(np.floor(min(max(v, -f7), f7))) + 8


@njit(cache=True, nogil=True, error_model="numpy")
def lean_int4_encode(x, xi, noise, codes, scales, block):   # pragma: no cover - compiled
    """As :func:`lean_int8_encode`, 4-bit: a block's largest magnitude from the sign-cleared bit
    patterns, then ``floor(clamp(v)) + 8``; a block with a NaN/inf (or a scale below fp32's
    smallest normal) stores the zero code, as the reference."""
    n = x.size
    f7 = np.float32(7)
    half, step, one = _NOISE_HALF, _NOISE_STEP, _F1
    bits = np.empty(1, np.int32)
    as_float = bits.view(np.float32)
    hb = block // 2
    for b in range(scales.size):
        lo = b * block
        hi = min(lo + block, n)
        m = _absmax_key(xi, lo, hi)
        bits[0] = m
        s = as_float[0] / f7
        scales[b] = s
        cb = codes[b * hb:(b + 1) * hb]
        if m >= np.int32(0x7F800000) or not (s >= _F32_TINY):
            for j in range(hb):
                cb[j] = np.uint8(0x88)
            continue
        inv = one / s
        if hi - lo == block:   # a whole block: two contiguous halves
            xa, xb, ua, ub = x[lo:lo + hb], x[lo + hb:hi], noise[lo:lo + hb], noise[lo + hb:hi]
            for j in range(hb):
                c0 = _int4_code(xa[j] * inv + (np.float32(ua[j]) + half) * step, f7)
                c1 = _int4_code(xb[j] * inv + (np.float32(ub[j]) + half) * step, f7)
                cb[j] = np.uint8(c0 | (c1 << 4))
        else:   # the tail block: padding is the zero code
            for j in range(hb):
                c0 = 8
                c1 = 8
                if lo + j < hi:
                    c0 = _int4_code(x[lo + j] * inv + (np.float32(noise[lo + j]) + half) * step, f7)
                if lo + hb + j < hi:
                    c1 = _int4_code(x[lo + hb + j] * inv + (np.float32(noise[lo + hb + j]) + half) * step, f7)
                cb[j] = np.uint8(c0 | (c1 << 4))


@njit(cache=True, nogil=True, error_model="numpy")
def lean_int4_add(dst, codes, scales, block, pre):   # pragma: no cover - compiled
    """As :func:`lean_int8_add`: ``dst := dst * pre + (nibbles - 8) * scales``."""
    n = dst.size
    hb = block // 2
    for b in range(scales.size):
        lo = b * block
        hi = min(lo + block, n)
        if lo >= hi:
            break
        s = scales[b]
        cb = codes[b * hb:(b + 1) * hb]
        if hi - lo == block:
            da, db = dst[lo:lo + hb], dst[lo + hb:hi]
            for j in range(hb):
                p = np.int32(cb[j])
                da[j] = da[j] * pre + np.float32((p & 15) - 8) * s
                db[j] = db[j] * pre + np.float32((p >> 4) - 8) * s
        else:
            for j in range(hb):
                p = np.int32(cb[j])
                if lo + j < hi:
                    dst[lo + j] = dst[lo + j] * pre + np.float32((p & 15) - 8) * s
                if lo + hb + j < hi:
                    dst[lo + hb + j] = dst[lo + hb + j] * pre + np.float32((p >> 4) - 8) * s


@njit(cache=True, nogil=True, error_model="numpy")
def lean_noise_words(k0, k1, out):   # pragma: no cover - compiled
    """``out[j] = mix32((mix32(j ^ k0) + k1) mod 2**32)`` (uint32): the lean stores' rounding noise,
    four bytes a word (``ops.lean.noise_bytes``)."""
    for j in range(out.size):
        out[j] = np.uint32(_hash32(j, k0, k1))


@njit(cache=True, nogil=True, error_model="numpy")
def lean_int8_decode(codes, scales, block, lo, out):   # pragma: no cover - compiled
    """``out[j] = codes[lo + j] * scales[(lo + j) // block]`` (``lo`` a multiple of ``block``)."""
    n = out.size
    b0 = lo // block
    for b in range(-(-n // block)):
        a = b * block
        e = min(a + block, n)
        s = scales[b0 + b]
        ob, cb = out[a:e], codes[lo + a:lo + e]
        for j in range(ob.size):
            ob[j] = np.float32(cb[j]) * s


@njit(cache=True, nogil=True, error_model="numpy")
def lean_int4_decode(codes, scales, block, lo, out):   # pragma: no cover - compiled
    """The int4 store's elements ``[lo, lo + out.size)`` (``lo`` a multiple of ``block``):
    ``(nibble - 8) * scale``, byte ``j`` of a block holding its elements ``j`` and ``j + block/2``."""
    n = out.size
    hb = block // 2
    b0 = lo // block
    for b in range(-(-n // block)):
        a = b * block
        e = min(a + block, n)
        s = scales[b0 + b]
        cb = codes[(b0 + b) * hb:(b0 + b + 1) * hb]
        if e - a == block:
            oa, ob = out[a:a + hb], out[a + hb:e]
            for j in range(hb):
                p = np.int32(cb[j])
                oa[j] = np.float32((p & 15) - 8) * s
                ob[j] = np.float32((p >> 4) - 8) * s
        else:
            for j in range(hb):
                p = np.int32(cb[j])
                if a + j < e:
                    out[a + j] = np.float32((p & 15) - 8) * s
                if a + hb + j < e:
                    out[a + hb + j] = np.float32((p >> 4) - 8) * s


@njit(inline="always", **_SOPTS)
def _scaled(t, xs, scale):
    """``t := xs * scale`` (``xs`` as it is when ``scale`` is 1)."""
    if scale != _F1:
        for k in range(xs.size):
            t[k] = xs[k] * scale
    else:
        for k in range(xs.size):
            t[k] = xs[k]


@njit(inline="always", **_SOPTS)
def _plus_momentum(t, cs, s, m, fma):
    """``t := t + m * (cs * s)`` (an int8 store's block decoded), as ``torch.add(t, u, alpha=m)``
    rounds it: ``fma(u, m, t)`` when ``fma``, else the product on its own."""
    if fma:
        for k in range(t.size):
            t[k] = fma32(np.float32(cs[k]) * s, m, t[k])
    else:
        for k in range(t.size):
            t[k] = t[k] + (np.float32(cs[k]) * s) * m


@njit(cache=True, nogil=True, error_model="numpy")
def lean_int8_velocity(x, scale, m, codes, scales, block, offset, fma, out, out2, two):   # pragma: no cover - compiled
    """Momentum correction with an int8 velocity: ``out[j] = x[j]*scale + m*u[offset + j]``, ``u``
    the stored velocity (``codes * scales`` per ``block``), with torch's own roundings
    (:func:`commpress.ops.reference.accumulate_velocity`: the product ``x*scale`` on its own, left
    out when ``scale`` is 1; then ``fma(u, m, .)`` when ``fma``, else ``. + u*m``), and to ``out2``
    too when ``two``.  ``out`` and ``out2`` may be ``x``: a block goes through a small buffer, so
    that every loop vectorizes (with ``out`` on ``x`` the loop vectorizer's overlap check failed
    and it ran scalar: 1.7 ms against 0.9 per 2.2M elements on one core)."""
    n = x.size
    tmp = np.empty(block, np.float32)
    j = 0
    while j < n:
        i = offset + j
        b = i // block
        e = min(n, (b + 1) * block - offset)
        s = scales[b]
        xs, os_, cs = x[j:e], out[j:e], codes[i:i + e - j]
        t = tmp[:e - j]
        _scaled(t, xs, scale)
        _plus_momentum(t, cs, s, m, fma)
        for k in range(t.size):
            os_[k] = t[k]
        if two:
            o2 = out2[j:e]
            for k in range(t.size):
                o2[k] = t[k]
        j = e


#: blocks :func:`lean_int8_velocity_store` takes at a time (its gather, scatter and noise loops run
#: over this many; 2.14 -> 1.88 ms on 2.2M elements in three parts against one block at a time)
VSTORE_BLOCKS = 16


@njit(cache=True, nogil=True, error_model="numpy")
def lean_int8_velocity_store(buf, starts, lens, scale, m, codes, scales, has_u, fma, k0, k1,
                             pcodes, pscales, block):   # pragma: no cover - compiled
    """A unit's momentum correction on DDP's own path, in one pass: its parts ``buf[starts[p]:
    starts[p] + lens[p]]`` (in the unit's order) := ``x*scale + m*u`` (:func:`lean_int8_velocity`'s
    roundings; ``u`` the int8 store ``codes``/``scales``, zero without ``has_u``), and that new
    velocity stored in int8 in ``pcodes``/``pscales`` as :func:`lean_int8_encode` stores it, with
    the noise bytes of ``lean_noise_words(k0, k1)`` (hashed here).  :data:`VSTORE_BLOCKS` blocks
    at a time through small buffers (each stored by :func:`lean_int8_encode`): no fp32 buffer of the
    unit's size, no noise array.  Returns whether the new velocity holds a NaN/inf."""
    ch = block * VSTORE_BLOCKS
    t = np.empty(ch, np.float32)
    ti = t.view(np.int32)
    words = np.empty(ch // 4, np.uint32)
    noise = words.view(np.uint8)
    n = 0
    for p in range(lens.size):
        n += lens[p]
    gp, ga = 0, 0   # the part, and the position in it, the next gathered element comes from
    p, at = 0, 0    # and the next scattered one goes to
    bad = False
    for c0 in range(0, n, ch):
        w = min(c0 + ch, n) - c0
        k = 0
        while k < w:   # gather (a chunk may straddle parts)
            while ga == lens[gp]:
                gp += 1
                ga = 0
            c = min(w - k, lens[gp] - ga)
            _scaled(t[k:k + c], buf[starts[gp] + ga:starts[gp] + ga + c], scale)
            k += c
            ga += c
        if has_u:
            for a in range(0, w, block):
                e = min(a + block, w)
                _plus_momentum(t[a:e], codes[c0 + a:c0 + e], scales[(c0 + a) // block], m, fma)
        k = 0
        while k < w:   # scatter
            while at == lens[p]:
                p += 1
                at = 0
            c = min(w - k, lens[p] - at)
            dst, tb = buf[starts[p] + at:starts[p] + at + c], t[k:k + c]
            for j in range(c):
                dst[j] = tb[j]
            k += c
            at += c
        w0 = c0 // 4
        for j in range(-(-w // 4)):   # the chunk's noise words
            words[j] = np.uint32(_hash32(w0 + j, k0, k1))
        b0, nb = c0 // block, -(-w // block)   # each block's scale and codes
        bad = _int8_encode(t[:w], ti[:w], noise[:w], pcodes[c0:c0 + nb * block], pscales[b0:b0 + nb],
                           block) or bad
    return bad
