"""The numba backend matches the torch reference bit for bit, op by op."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from commpress.ops import reference as R

nb = pytest.importorskip("commpress.ops.numba_backend")
from commpress.ops import _numba_kernels as K  # noqa: E402

from opcheck import assert_bitwise, f32_arrays, norm_extremes, run_selection, tensor  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def small_chunks():
    """Tiny chunks and top-k samples (of short runs) so small inputs exercise the multi-chunk paths,
    each call's chunks split over 3 threads (uneven ranges; more threads than this machine's pool has)."""
    with pytest.MonkeyPatch.context() as mp, K.use_threads(3):
        mp.setattr(nb, "MIN_CHUNK", 64)
        mp.setattr(nb, "QUANT_CHUNK", 16)
        mp.setattr(nb, "TOPK_SAMPLE", 8)
        mp.setattr(nb, "SAMPLE_RUN", 2)   # a sample of 4 runs
        yield


# ---------------------------------------------------------------- selection
@settings(max_examples=25)
@given(a=f32_arrays(), thr=st.one_of(st.floats(width=32), st.floats(), st.sampled_from([0.0, -0.0, 1.0])))
def test_threshold_compact(a, thr):
    run_selection(nb, "threshold_compact", tensor(a), thr)


@settings(max_examples=25)
@given(a=f32_arrays(), frac=st.floats(0, 1.2), extra=st.integers(-2, 2))
def test_topk_compact(a, frac, extra):
    k = max(0, int(frac * a.size) + extra)
    run_selection(nb, "topk_compact", tensor(a), k)


@settings(max_examples=10)
@given(a=f32_arrays(max_size=100), k=st.integers(0, 110),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float64]))
def test_selection_other_dtypes(a, k, dtype):
    with np.errstate(over="ignore"):
        run_selection(nb, "topk_compact", tensor(a), k, dtype)
        run_selection(nb, "threshold_compact", tensor(a), 0.75, dtype)


def test_topk_many_ties_and_fallback():
    # Few distinct magnitudes: the sampled threshold admits too few or far too many.
    x = torch.tensor([1.0, -1.0, 2.0, 0.0, -2.0] * 53 + [3.0])
    for k in (1, 2, 50, 107, 200, 266):
        run_selection(nb, "topk_compact", x, k)
    # Sorted data defeats a strided sample of one region.
    run_selection(nb, "topk_compact", torch.linspace(-1, 1, 999), 10)


@settings(max_examples=40)
@given(data=st.data(), keys=st.lists(st.one_of(st.integers(0, 2**31 - 1), st.sampled_from(
    [0, 1, 2**10 - 1, 2**10, 2**20, 2**31 - 1, 0x7F800000, 0x7FC00000])), min_size=1, max_size=300))
def test_kth_largest_is_the_sorted_keys_kth(data, keys):
    # The selection's exact k-th key (radix passes): ties, keys that share every prefix but the
    # last bits, the extremes (0, inf's and NaN's magnitude keys, the largest key).
    a = np.array(keys, np.int32)
    k = data.draw(st.integers(1, a.size))
    assert int(K._kth_largest(a, k)) == int(np.sort(a)[::-1][k - 1])


def _feedback_case(x, r, beta, k, scale, alias, velocity=None):
    """``topk_compact_feedback`` on both backends: indices, values and the new residual
    bitwise; ``alias``: the new residual is the residual ("r") or the input ("x") itself;
    ``velocity=(live or None, momentum)``: momentum correction in the same call, the new velocity
    bitwise too."""
    outs = []
    for op in (R.topk_compact_feedback, nb.topk_compact_feedback):
        xs = x.clone()
        rs = None if r is None else r.clone()
        new = {"r": rs, "x": xs}.get(alias) if alias else torch.empty(x.numel())
        u = None
        if velocity is not None:
            u = torch.full((x.numel(),), float("nan"))
            live = None if velocity[0] is None else velocity[0].clone()
            got = op(xs, rs, beta, k, new, scale, velocity=(live, velocity[1], u))
        else:
            got = op(xs, rs, beta, k, new, scale)
        outs.append((got, new, u))
    (want, new_ref, u_ref), (got, new_nb, u_nb) = outs
    what = (f"topk_compact_feedback k={k} beta={beta} scale={scale} alias={alias} residual={r is not None} "
            f"velocity={None if velocity is None else (velocity[0] is not None, velocity[1])}")
    assert_bitwise(got, want, what)
    assert_bitwise(new_nb, new_ref, what + " new residual")
    if velocity is not None:
        assert_bitwise(u_nb, u_ref, what + " new velocity")


@settings(max_examples=30)
@given(data=st.data(), a=f32_arrays(), frac=st.floats(0, 1.2), extra=st.integers(-2, 2),
       beta=st.sampled_from([1.0, 0.5, 0.9]), scale=st.sampled_from([1.0, 0.5, 0.25, 1 / 3]),
       alias=st.sampled_from([None, None, "r", "x"]))
def test_topk_compact_feedback(data, a, frac, extra, beta, scale, alias):
    k = max(0, int(frac * a.size) + extra)
    x = tensor(a)
    r = data.draw(st.one_of(st.none(), f32_arrays(a.size, a.size).map(tensor)))
    if r is None and alias == "r":
        alias = None
    with np.errstate(over="ignore", invalid="ignore"):
        _feedback_case(x, r, beta, k, scale, alias)


@settings(max_examples=30)
@given(data=st.data(), a=f32_arrays(), frac=st.floats(0, 1.2), extra=st.integers(-2, 2),
       beta=st.sampled_from([1.0, 0.5]), scale=st.sampled_from([1.0, 0.5, 1 / 3]),
       alias=st.sampled_from([None, "r", "x"]), momentum=st.sampled_from([0.9, 0.5, 0.99]))
def test_topk_compact_feedback_velocity(data, a, frac, extra, beta, scale, alias, momentum):
    """Momentum correction fused into the pass: the velocity ``x*scale + m*live`` (fresh: none) as
    torch's ops round it, then the same selection and residual."""
    k = max(0, int(frac * a.size) + extra)
    x = tensor(a)
    r = data.draw(st.one_of(st.none(), f32_arrays(a.size, a.size).map(tensor)))
    live = data.draw(st.one_of(st.none(), f32_arrays(a.size, a.size).map(tensor)))
    if r is None and alias == "r":
        alias = None
    with np.errstate(over="ignore", invalid="ignore"):
        _feedback_case(x, r, beta, k, scale, alias, velocity=(live, momentum))


def test_topk_compact_feedback_velocity_modes(monkeypatch):
    """Each rounding the probe may pick: ``"plain"`` is numpy's fp32 ``x + v*m`` (two roundings);
    with the mode unknown (``None``) torch computes the velocity and the result is the reference's."""
    assert nb.velocity_mode() in ("fma", "plain", None)
    rng = np.random.default_rng(1)
    x, v, r = (rng.standard_normal(3000).astype(np.float32) for _ in range(3))
    m = np.float32(0.9)
    for how, want in ((8 | 16, x + v * m), (8, x), (8 | 4, x * np.float32(0.5))):
        u, c = np.empty_like(x), np.empty_like(x)
        K.compensate(x, r, np.float32(1.0), np.float32(0.5), how | 1, c, 256, v, m, u)
        assert np.array_equal(u.view(np.int32), want.view(np.int32)), how
        assert np.array_equal(c.view(np.int32), (want + r).view(np.int32)), how
    monkeypatch.setattr(nb, "velocity_mode", lambda: None)
    _feedback_case(tensor(x), tensor(r), 1.0, 30, 0.5, None, velocity=(tensor(v), 0.9))
    _feedback_case(tensor(x), None, 1.0, 0, 1.0, None, velocity=(tensor(v), 0.9))


def test_the_topk_sample_is_evenly_spaced_runs_of_consecutive_entries(monkeypatch):
    """The threshold's sample reads whole cache lines: runs of SAMPLE_RUN entries, evenly spaced,
    inside the array and apart; a view, not a copy."""
    monkeypatch.setattr(nb, "SAMPLE_RUN", 16)
    a = np.arange(70_000, dtype=np.int32)
    s = nb._sample_runs(a, 1024)
    assert s.shape == (64, 16) and np.shares_memory(s, a)
    starts = s[:, 0]
    assert (s == starts[:, None] + np.arange(16)).all()
    assert (np.diff(starts) == 70_000 // 64).all() and starts[0] == 0 and s[-1, -1] < a.size


def test_the_sample_keys_kernel_rounds_as_numpy():
    """The threshold sample's keys (one kernel pass) are numpy's fp32 arithmetic on the same runs,
    bit for bit, for every combination of scale, velocity and residual, NaN and inf included."""
    g = np.random.default_rng(3)
    x, r, v = (g.standard_normal(4096).astype(np.float32) for _ in range(3))
    x[[5, 77, 1000]] = [np.inf, np.nan, -np.inf]
    r[9] = np.nan
    s32, b32, m32 = np.float32(1 / 3), np.float32(0.9), np.float32(0.875)
    runs, run = 32, 4
    step = x.size // runs
    for how in range(32):
        if how & 2 and not how & 1:
            continue
        with np.errstate(over="ignore", invalid="ignore"):
            xs, vs, rs = (a[:runs * step].reshape(runs, step)[:, :run] for a in (x, v, r))
            c = xs * s32 if how & 4 else xs
            c = c + vs * m32 if how & 16 else c
            c = c + (rs * b32 if how & 2 else rs) if how & 1 else c
        want = np.ascontiguousarray(c, dtype=np.float32).view(np.int32).reshape(-1) & 0x7FFFFFFF
        keys = np.empty(runs * run, np.int32)
        K.sample_keys(x, r, b32, s32, how, v, m32, runs, run, step, keys.view(np.float32), keys)
        assert np.array_equal(keys, want), how


def test_topk_compact_feedback_ties_and_rescans():
    # Few distinct magnitudes: the sampled threshold admits too few (another pass over the
    # compensated values) or far too many (chunks overflow their slots and are rescanned).
    x = torch.tensor([1.0, -1.0, 2.0, 0.0, -2.0] * 53 + [3.0])
    r = torch.tensor([0.5, 0.0, -0.5] * 88 + [0.0, 0.0])
    for k in (1, 2, 50, 107, 200, 266):
        _feedback_case(x, r, 1.0, k, 1.0, None)
        _feedback_case(x, r, 0.5, k, 0.5, "r")
    _feedback_case(torch.linspace(-1, 1, 999), torch.linspace(1, -1, 999) * 0.25, 1.0, 10, 1 / 3, None)
    # non-finite sums of finite values are selected like NaN/inf inputs
    big = torch.full((300,), 3e38)
    _feedback_case(big, big.clone(), 1.0, 3, 1.0, None)


def test_topk_compact_feedback_overflowed_chunk_in_the_fused_pass(monkeypatch):
    """The fused pass zeroes each chunk's candidates in the new residual as it stores them; a chunk
    whose candidates overflow its slots (values the sample never saw) must get them back before
    it is rescanned.  The sizes of the library (not this module's tiny ones): 8 chunks of 32K."""
    monkeypatch.setattr(nb, "MIN_CHUNK", 1 << 15)
    monkeypatch.setattr(nb, "TOPK_SAMPLE", 1 << 14)
    monkeypatch.setattr(nb, "SAMPLE_RUN", 16)
    n = 1 << 18
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * 0.01
    r = torch.randn(n, generator=g) * 0.001
    pos = torch.arange(n)
    runs, run, step = nb._sample_geometry(n, nb.TOPK_SAMPLE)
    hidden = (pos < nb._chunk(n)) & (pos % step >= run) & (pos % 4 == 0)   # chunk 0, never sampled
    x[hidden] = 10.0 + torch.rand(int(hidden.sum()), generator=g)
    assert int(hidden.sum()) > 4 * 1024                                    # far above a chunk's slots
    for k in (n // 100, int(hidden.sum()) + 7):
        _feedback_case(x, r, 1.0, k, 1.0, None)
        _feedback_case(x, r, 0.5, k, 0.5, "r")


@settings(max_examples=25)
@given(a=f32_arrays())
def test_magnitude_key(a):
    x = tensor(a)
    assert_bitwise(nb.magnitude_key(x), R.magnitude_key(x))


@settings(max_examples=25)
@given(n=st.integers(0, 200), data=st.data())
def test_scatter_add(n, data):
    m = data.draw(st.integers(0, 3 * n)) if n else 0
    idx = torch.tensor(data.draw(st.lists(st.integers(0, max(n - 1, 0)), min_size=m, max_size=m)),
                       dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))
    vals = tensor(data.draw(f32_arrays(m, m)))
    for dtype in (torch.float32, torch.float64):
        base = tensor(data.draw(f32_arrays(n, n))).to(dtype)
        want = R.scatter_add_(base.clone(), idx, vals)
        got = nb.scatter_add_(base.clone(), idx, vals)
        assert_bitwise(got, want, f"scatter_add_ {dtype}")


def test_scatter_add_out_of_range():
    out = torch.zeros(5)
    for bad in ([5], [-1], [0, 7]):
        with pytest.raises(IndexError):
            R.scatter_add_(out.clone(), torch.tensor(bad), torch.ones(len(bad)))
        with pytest.raises(IndexError):
            nb.scatter_add_(out.clone(), torch.tensor(bad), torch.ones(len(bad)))


# ---------------------------------------------------------------- random numbers and hashing
@settings(max_examples=25)
@given(seed=st.integers(0, 2**64 - 1), start=st.integers(0, 2**34), n=st.integers(0, 300))
def test_counter_rng_same_seed_same_bits(seed, start, n):
    assert_bitwise(nb.counter_bits(seed, start, n), R.counter_bits(seed, start, n))
    assert_bitwise(nb.counter_uniform(seed, start, n), R.counter_uniform(seed, start, n))


@settings(max_examples=25)
@given(seed=st.integers(0, 2**64 - 1), start=st.one_of(st.integers(0, 2**34), st.integers(2**32 - 40, 2**32 + 40)),
       n=st.integers(0, 100))
def test_uniform_lanes_are_the_counter_uniform(seed, start, n):
    """The 16-lane hash of the QSGD/TernGrad noise (:func:`_fill_uniform24`, 32-bit vector lanes) is
    ``reference.counter_uniform`` bit for bit: whole vectors, the tail, the counter's wrap at 2**32."""
    fill = _jitted_fill()
    k0, k1 = R.seed_words(seed)
    u = np.full(n + 3, 7.0, np.float32)
    v = fill(u[:n], np.int64(start), np.uint64(k0), np.uint64(k1))
    assert_bitwise(torch.from_numpy(v), torch.from_numpy(u[:n].copy()))
    assert_bitwise(torch.from_numpy(u[:n].copy()), R.counter_uniform(seed, start, n))
    assert (u[n:] == 7.0).all()  # nothing written past the end


_FILL = []


def _jitted_fill():
    if not _FILL:
        from numba import njit

        @njit
        def fill(u, base, k0, k1):
            K._fill_uniform24(u, base, k0, k1, u, u, u, -1)
            v = np.empty_like(u)  # with prefetches of u itself (hints: the same numbers)
            K._fill_uniform24(v, base, k0, k1, u, u, u, 0)
            return v

        _FILL.append(fill)
    return _FILL[0]


@settings(max_examples=25)
@given(idx=st.lists(st.integers(-2**40, 2**40)), world=st.integers(1, 9),
       dtype=st.sampled_from([torch.int32, torch.int64]))
def test_hash_owner_and_partition(idx, world, dtype):
    t = torch.tensor(idx, dtype=torch.int64)
    if dtype == torch.int32:
        t = t.clamp(-2**31, 2**31 - 1).to(torch.int32)
    assert_bitwise(nb.hash_owner(t, world), R.hash_owner(t, world))
    assert_bitwise(nb.hash_partition(t, world), R.hash_partition(t, world))


# ---------------------------------------------------------------- bit packing
@settings(max_examples=25)
@given(bits=st.integers(1, 8), data=st.data())
def test_pack_unpack_bits(bits, data):
    n = data.draw(st.integers(0, 300))
    dtype = data.draw(st.sampled_from([torch.uint8, torch.int64, torch.int32]))
    hi = (1 << bits) - 1 if dtype == torch.uint8 else 1000
    lo = 0 if dtype == torch.uint8 else -1000
    codes = torch.tensor(data.draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)), dtype=dtype)
    packed = R.pack_bits(codes, bits)
    assert_bitwise(nb.pack_bits(codes, bits), packed, "pack_bits")
    assert_bitwise(nb.unpack_bits(packed, bits, n), R.unpack_bits(packed, bits, n), "unpack_bits")
    noise = torch.tensor(data.draw(st.lists(st.integers(0, 255), min_size=packed.numel(),
                                            max_size=packed.numel())), dtype=torch.uint8)
    assert_bitwise(nb.unpack_bits(noise, bits, n), R.unpack_bits(noise, bits, n), "unpack noise")


@settings(max_examples=25)
@given(numel=st.integers(0, 300), data=st.data())
def test_bitmap(numel, data):
    idx = torch.tensor(data.draw(st.lists(st.integers(0, max(numel - 1, 0)), max_size=numel if numel else 0)),
                       dtype=torch.int64)
    bm = R.bitmap_encode(idx, numel)
    assert_bitwise(nb.bitmap_encode(idx, numel), bm, "encode")
    assert_bitwise(nb.bitmap_decode(bm, numel), R.bitmap_decode(bm, numel), "decode")
    noise = torch.tensor(data.draw(st.lists(st.integers(0, 255), min_size=bm.numel(),
                                            max_size=bm.numel())), dtype=torch.uint8)
    assert_bitwise(nb.bitmap_decode(noise, numel), R.bitmap_decode(noise, numel), "decode noise")


def test_bitmap_out_of_range():
    with pytest.raises(IndexError):
        R.bitmap_encode(torch.tensor([9]), 9)
    with pytest.raises(IndexError):
        nb.bitmap_encode(torch.tensor([9]), 9)


# ---------------------------------------------------------------- quantization
@settings(max_examples=25)
@given(a=f32_arrays(), bits=st.integers(1, 8), block=st.integers(1, 70), stochastic=st.booleans(),
       seed=st.integers(0, 2**64 - 1))
def test_block_quantize(a, bits, block, stochastic, seed):
    x = tensor(a)
    assert_bitwise(nb.block_absmax(x, block), R.block_absmax(x, block), "absmax")
    want = R.block_quantize(x, bits, block, stochastic, seed)
    assert_bitwise(nb.block_quantize(x, bits, block, stochastic, seed), want, "quantize")


@settings(max_examples=10)
@given(a=f32_arrays(max_size=100), bits=st.sampled_from([4, 8]), block=st.integers(1, 40),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float64]))
def test_block_quantize_other_dtypes(a, bits, block, dtype):
    with np.errstate(over="ignore"):
        x = tensor(a).to(dtype)
    assert_bitwise(nb.block_quantize(x, bits, block), R.block_quantize(x, bits, block))


@settings(max_examples=25)
@given(bits=st.integers(1, 8), block=st.integers(1, 70), data=st.data())
def test_block_dequantize(bits, block, data):
    n = data.draw(st.integers(0, 300))
    nbytes = (n * bits + 7) // 8
    packed = torch.tensor(data.draw(st.lists(st.integers(0, 255), min_size=nbytes, max_size=nbytes)),
                          dtype=torch.uint8)
    scales = tensor(data.draw(f32_arrays((n + block - 1) // block, (n + block - 1) // block)))
    assert_bitwise(nb.block_dequantize(packed, scales, bits, block, n),
                   R.block_dequantize(packed, scales, bits, block, n), "fresh")
    base = tensor(data.draw(f32_arrays(n, n)))
    for acc in (False, True):
        o_ref, o_nb = base.clone(), base.clone()
        r1 = R.block_dequantize(packed, scales, bits, block, n, o_ref, acc)
        r2 = nb.block_dequantize(packed, scales, bits, block, n, o_nb, acc)
        assert r2 is o_nb
        assert_bitwise(r2, r1, f"out accumulate={acc}")


@settings(max_examples=15)
@given(bits=st.integers(1, 8), block=st.integers(1, 70), pieces=st.integers(1, 5), acc=st.booleans(),
       data=st.data())
def test_block_dequantize_sum(bits, block, pieces, acc, data):
    """Several payloads summed two per pass: bitwise the reference's decode, then accumulating
    decodes in order (odd and even counts, into ``out`` or a fresh tensor)."""
    n = data.draw(st.integers(0, 300))
    nbytes, nscales = (n * bits + 7) // 8, (n + block - 1) // block
    packed = [torch.tensor(data.draw(st.lists(st.integers(0, 255), min_size=nbytes, max_size=nbytes)),
                           dtype=torch.uint8) for _ in range(pieces)]
    scales = [tensor(data.draw(f32_arrays(nscales, nscales))) for _ in range(pieces)]
    base = tensor(data.draw(f32_arrays(n, n)))
    o_ref, o_nb = base.clone(), base.clone()
    want = R.block_dequantize_sum(packed, scales, bits, block, n, o_ref, acc)
    got = nb.block_dequantize_sum(packed, scales, bits, block, n, o_nb, acc)
    assert got is o_nb
    assert_bitwise(got, want, f"out accumulate={acc}")
    assert_bitwise(nb.block_dequantize_sum(packed, scales, bits, block, n),
                   R.block_dequantize_sum(packed, scales, bits, block, n), "fresh")


def test_block_dequantize_payloads_at_odd_offsets():
    """Payloads that are views at odd byte offsets of a message (the word-wise unpacking reads
    them unaligned), several chunks and a ragged tail."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1001, generator=g)
    for bits in (2, 4, 8):
        pieces = [R.block_quantize(x * k, bits, 64) for k in (1.0, -2.0, 0.3)]
        packed = [torch.cat([torch.zeros(1 + i, dtype=torch.uint8), p])[1 + i:] for i, (p, _) in enumerate(pieces)]
        scales = [s for _, s in pieces]
        assert packed[0].data_ptr() % 2 == 1
        assert_bitwise(nb.block_dequantize_sum(packed, scales, bits, 64, x.numel()),
                       R.block_dequantize_sum(packed, scales, bits, 64, x.numel()), f"bits={bits}")
        assert_bitwise(nb.block_dequantize(packed[0], scales[0], bits, 64, x.numel()),
                       R.block_dequantize(*pieces[0], bits, 64, x.numel()), f"bits={bits} one")


@settings(max_examples=30)
@given(a=f32_arrays(), bits=st.integers(2, 8), block=st.integers(1, 70), beta=st.sampled_from([1.0, 0.5]),
       scale=st.sampled_from([1.0, 0.5, 1 / 3]), alias=st.sampled_from([None, None, "r", "x"]), data=st.data())
def test_block_quantize_feedback(a, bits, block, beta, scale, alias, data):
    """Codes, scales, the finite flag and the new residual bitwise (NaN/inf inputs included);
    ``alias``: the new residual is the residual ("r") or the input ("x") itself; with a drawn
    momentum, the velocity of momentum correction (live or fresh) in the same pass, bitwise too."""
    x = tensor(a)
    r = data.draw(st.one_of(st.none(), f32_arrays(a.size, a.size).map(tensor)))
    momentum = data.draw(st.sampled_from([None, 0.9, 0.5]))
    live = data.draw(st.one_of(st.none(), f32_arrays(a.size, a.size).map(tensor))) if momentum else None
    if r is None and alias == "r":
        alias = None
    outs = []
    with np.errstate(over="ignore", invalid="ignore"):
        for op in (R.block_quantize_feedback, nb.block_quantize_feedback):
            xs, rs = x.clone(), None if r is None else r.clone()
            new = {"r": rs, "x": xs}.get(alias) if alias else torch.empty(x.numel())
            u = torch.full((x.numel(),), float("nan"))
            velocity = None if momentum is None else (None if live is None else live.clone(), momentum, u)
            outs.append((op(xs, rs, beta, bits, block, new, scale, velocity=velocity), new, u))
    (want, new_ref, u_ref), (got, new_nb, u_nb) = outs
    what = (f"block_quantize_feedback bits={bits} block={block} beta={beta} scale={scale} alias={alias} "
            f"momentum={momentum} live={live is not None}")
    assert_bitwise(got, want, what)
    assert_bitwise(new_nb, new_ref, what + " new residual")
    assert_bitwise(u_nb, u_ref, what + " new velocity")


def test_block_quantize_feedback_packed_words():
    """2 and 4 bits pack a 32-bit word of codes at a time: odd tails, several chunks, NaN/inf
    blocks, tiny scales (an infinite ``qmax / s``), a residual aliasing the output."""
    g = torch.Generator().manual_seed(5)
    for n in (1, 2, 7, 130, 1001):
        for block, bits in ((2, 4), (3, 4), (4, 2), (64, 4), (5, 2)):
            x = torch.randn(n, generator=g) * 3
            r = torch.randn(n, generator=g)
            if n > 100:
                x[17], x[90] = float("nan"), float("inf")
                x[128:192] = torch.tensor(1e-39)  # subnormal block (with r zeroed): inv overflows
                r[128:192] = 0.0
            for alias in (False, True):
                outs = []
                for op in (R.block_quantize_feedback, nb.block_quantize_feedback):
                    rs = r.clone()
                    new = rs if alias else torch.empty(n)
                    outs.append((op(x, rs, 1.0, bits, block, new), new))
                (want, new_ref), (got, new_nb) = outs
                assert_bitwise(got, want, f"n={n} block={block} alias={alias}")
                assert_bitwise(new_nb, new_ref, f"n={n} block={block} alias={alias} residual")


@settings(max_examples=25)
@given(a=f32_arrays(), chunk=st.integers(1, 100), data=st.data())
def test_sign_pack_unpack(a, chunk, data):
    x = tensor(a)
    want = R.sign_pack(x, chunk)
    assert_bitwise(nb.sign_pack(x, chunk), want, "sign_pack")
    bits, scales = want
    n = x.numel()
    assert_bitwise(nb.sign_unpack(bits, scales, chunk, n), R.sign_unpack(bits, scales, chunk, n))
    base = tensor(data.draw(f32_arrays(n, n)))
    for acc in (False, True):
        o_ref, o_nb = base.clone(), base.clone()
        assert_bitwise(nb.sign_unpack(bits, scales, chunk, n, o_nb, acc),
                       R.sign_unpack(bits, scales, chunk, n, o_ref, acc), f"accumulate={acc}")


def test_sign_pack_sum_order_is_fixed():
    # 2**24 + 0 + 1 + 1: a left-to-right fp32 sum loses both ones, the pairwise tree keeps them.
    x = torch.tensor([2.0**24, 0.0, 1.0, 1.0])
    _, scales = R.sign_pack(x, 4)
    assert scales.item() == (2.0**24 + 2) / 4
    assert_bitwise(nb.sign_pack(x, 4), R.sign_pack(x, 4))


# ---------------------------------------------------------------- minifloats (fp8, MX)
@settings(max_examples=25)
@given(a=f32_arrays(), fmt=st.sampled_from(["e4m3", "e5m2"]), block=st.integers(1, 70),
       stochastic=st.booleans(), seed=st.integers(0, 2**64 - 1), scale=st.sampled_from([1.0, 1e-30, 1e30]))
def test_fp8_quantize(a, fmt, block, stochastic, seed, scale):
    with np.errstate(over="ignore", under="ignore"):
        x = tensor(a * np.float32(scale))
    want = R.fp8_quantize(x, fmt, block, stochastic, seed)
    assert_bitwise(nb.fp8_quantize(x, fmt, block, stochastic, seed), want, "fp8_quantize")


@settings(max_examples=25)
@given(a=f32_arrays(), element=st.sampled_from(["fp8_e4m3", "fp6_e2m3", "fp4_e2m1"]),
       stochastic=st.booleans(), seed=st.integers(0, 2**64 - 1), scale=st.sampled_from([1.0, 1e-38, 1e35]))
def test_mx_quantize(a, element, stochastic, seed, scale):
    with np.errstate(over="ignore", under="ignore"):
        x = tensor(a * np.float32(scale))
    want = R.mx_quantize(x, element, stochastic, seed)
    assert_bitwise(nb.mx_quantize(x, element, stochastic, seed), want, "mx_quantize")


@settings(max_examples=10)
@given(a=f32_arrays(max_size=100), dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float64]))
def test_minifloat_quantize_other_dtypes(a, dtype):
    with np.errstate(over="ignore"):
        x = tensor(a).to(dtype)
    assert_bitwise(nb.fp8_quantize(x, "e4m3", 16), R.fp8_quantize(x, "e4m3", 16))
    assert_bitwise(nb.mx_quantize(x, "fp6_e2m3"), R.mx_quantize(x, "fp6_e2m3"))


@settings(max_examples=25)
@given(element=st.sampled_from(["fp8_e4m3", "fp6_e2m3", "fp4_e2m1", "e4m3", "e5m2"]),
       block=st.integers(1, 70), data=st.data())
def test_minifloat_dequantize(element, block, data):
    """Random wire bytes (NaN codes, scale byte 255 included), fresh and into ``out``."""
    n = data.draw(st.integers(0, 300))
    if element in ("e4m3", "e5m2"):
        nbytes, nscales = n, (n + block - 1) // block
        codes = torch.tensor(data.draw(st.lists(st.integers(0, 255), min_size=nbytes, max_size=nbytes)),
                             dtype=torch.uint8)
        scales = tensor(data.draw(f32_arrays(nscales, nscales)))

        def run(mod, *out):
            return mod.fp8_dequantize(codes, scales, element, block, n, *out)
    else:
        bits = {"fp8_e4m3": 8, "fp6_e2m3": 6, "fp4_e2m1": 4}[element]
        nbytes, nscales = (n * bits + 7) // 8, (n + 31) // 32
        codes = torch.tensor(data.draw(st.lists(st.integers(0, 255), min_size=nbytes, max_size=nbytes)),
                             dtype=torch.uint8)
        scales = torch.tensor(data.draw(st.lists(st.integers(0, 255), min_size=nscales, max_size=nscales)),
                              dtype=torch.uint8)

        def run(mod, *out):
            return mod.mx_dequantize(codes, scales, element, n, *out)
    assert_bitwise(run(nb), run(R), "fresh")
    base = tensor(data.draw(f32_arrays(n, n)))
    for acc in (False, True):
        o_ref, o_nb = base.clone(), base.clone()
        r1, r2 = run(R, o_ref, acc), run(nb, o_nb, acc)
        assert r2 is o_nb
        assert_bitwise(r2, r1, f"out accumulate={acc}")


def test_fp8_dequantize_takes_float8_codes():
    x = torch.randn(300)
    codes, scales = R.fp8_quantize(x, "e5m2", 64)
    f8 = codes.view(torch.float8_e5m2)
    assert_bitwise(nb.fp8_dequantize(f8, scales, "e5m2", 64, 300), R.fp8_dequantize(codes, scales, "e5m2", 64, 300))


# ---------------------------------------------------------------- QSGD / TernGrad levels, sign + EF
def test_level_quantize_extremes():
    """Buckets whose sums of squares overflow or underflow fp32 (the norm's scaled second sum) and
    scales whose ``levels / s`` is not a normal fp32 (the pre-scale) match the reference; the
    streaming tree (bucket_norms) and the cache-sized one (fused qsgd) both take the rescue."""
    x = norm_extremes()
    for bucket in (1, 7, 64, 300, 10**9):
        norms = R.bucket_norms(x, bucket)
        assert torch.isfinite(norms).all(), bucket
        assert_bitwise(nb.bucket_norms(x, bucket), norms, f"norms {bucket}")
        for levels in (1, 7, 127):
            packed = R.level_quantize(x, norms, bucket, levels, 5)
            assert_bitwise(nb.level_quantize(x, norms, bucket, levels, 5), packed, f"codes {bucket}/{levels}")
            assert_bitwise(nb.qsgd_quantize(x, levels, bucket, 5), (packed, norms), f"qsgd {bucket}/{levels}")
    for part in (x[100:200], x[300:400], x[450:]):  # TernGrad: one scale max|x|, huge or subnormal
        scale = part.abs().amax().reshape(1)
        assert_bitwise(nb.level_quantize(part, scale, part.numel(), 1, 3),
                       R.level_quantize(part, scale, part.numel(), 1, 3), "terngrad")
    # the rescue is exact scaling: a bucket scaled by 2**e out of range gets the same codes and
    # its norm times 2**e
    y = torch.randn(600, generator=torch.Generator().manual_seed(3))
    norms = R.bucket_norms(y, 64)
    for e in (100, -100):
        assert_bitwise(nb.qsgd_quantize(y * 2.0**e, 7, 64, 5), (R.level_quantize(y, norms, 64, 7, 5), norms * 2.0**e))


@settings(max_examples=25)
@given(a=f32_arrays(), bucket=st.sampled_from([1, 3, 8, 64, 10**9]), levels=st.sampled_from([1, 2, 3, 7, 8, 127]),
       seed=st.integers(0, 2**64 - 1))
def test_level_quantize_and_norms(a, bucket, levels, seed):
    x = tensor(a)
    with np.errstate(over="ignore"):
        norms = R.bucket_norms(x, bucket)
    assert_bitwise(nb.bucket_norms(x, bucket), norms, "norms")
    packed = R.level_quantize(x, norms, bucket, levels, seed)
    assert_bitwise(nb.level_quantize(x, norms, bucket, levels, seed), packed, "codes")
    with np.errstate(over="ignore"):
        assert_bitwise(nb.qsgd_quantize(x, levels, bucket, seed), (packed, norms), "fused qsgd")
    n = x.numel()
    assert_bitwise(nb.level_dequantize(packed, norms, bucket, levels, n),
                   R.level_dequantize(packed, norms, bucket, levels, n), "decode")
    for acc in (False, True):
        o_ref, o_nb = x.clone(), x.clone()
        assert_bitwise(nb.level_dequantize(packed, norms, bucket, levels, n, o_nb, acc),
                       R.level_dequantize(packed, norms, bucket, levels, n, o_ref, acc), f"acc={acc}")


@settings(max_examples=25)
@given(a=f32_arrays(), chunk=st.sampled_from([8, 16, 1024]), beta=st.sampled_from([1.0, 0.5, 0.3]), data=st.data())
def test_sign_pack_feedback(a, chunk, beta, data):
    x = tensor(a)
    n = x.numel()
    r = tensor(data.draw(f32_arrays(n, n)))
    out_ref, out_nb = torch.full_like(x, 3.0), torch.full_like(x, 3.0)
    with np.errstate(over="ignore", invalid="ignore"):
        want = R.sign_pack_feedback(x, r, beta, chunk, out_ref)
        got = nb.sign_pack_feedback(x, r, beta, chunk, out_nb)
    assert_bitwise(got, want, "sign_pack_feedback")
    if bool(want[2]):
        assert_bitwise(out_nb, out_ref, "new residual")


@settings(max_examples=25)
@given(a=f32_arrays(), bucket=st.sampled_from([1, 3, 8, 64, 600]), levels=st.sampled_from([1, 2, 7, 8, 127]),
       beta=st.sampled_from([1.0, 0.5]), scale=st.sampled_from([1.0, 0.25, 1 / 3]),
       alias=st.sampled_from([None, None, "r", "x"]), seed=st.integers(0, 2**64 - 1), data=st.data())
def test_level_quantize_feedback(a, bucket, levels, beta, scale, alias, seed, data):
    """qsgd_quantize_feedback and terngrad_quantize_feedback: codes, scales, the finite flag and the
    new residual bitwise the reference's (NaN/inf included); ``alias``: the new residual is the
    residual ("r") or the input ("x") itself."""
    x = tensor(a)
    n = x.numel()
    r = data.draw(st.one_of(st.none(), f32_arrays(n, n).map(tensor)))
    if r is None and alias == "r":
        alias = None
    ops = {"qsgd": lambda m, xs, rs, new: m.qsgd_quantize_feedback(xs, rs, beta, levels, bucket, seed, new, scale),
           "terngrad": lambda m, xs, rs, new: m.terngrad_quantize_feedback(xs, rs, beta, seed, new, scale)}
    for name, op in ops.items():
        outs = []
        with np.errstate(over="ignore", invalid="ignore"):
            for m in (R, nb):
                xs, rs = x.clone(), None if r is None else r.clone()
                new = {"r": rs, "x": xs}.get(alias) if alias else torch.full((n,), 5.0)
                outs.append((op(m, xs, rs, new), new))
        (want, new_ref), (got, new_nb) = outs
        what = f"{name} bucket={bucket} levels={levels} beta={beta} scale={scale} alias={alias}"
        assert_bitwise(got, want, what)
        assert_bitwise(new_nb, new_ref, what + " new residual")


def test_level_quantize_feedback_several_chunks_and_extremes(monkeypatch):
    """Several chunks (and threads) of the fused kernels, huge and subnormal buckets (the norm's
    rescue), a NaN: bitwise the reference; a finite input always gives a finite flag."""
    monkeypatch.setattr(nb, "MIN_CHUNK", 64)
    monkeypatch.setattr(nb, "QUANT_CHUNK", 64)
    x = torch.cat([norm_extremes(), torch.randn(3000, generator=torch.Generator().manual_seed(2))])
    r = torch.randn(x.numel(), generator=torch.Generator().manual_seed(3))
    r[:600] = 0.0
    for threads in (1, 3):
        with K.use_threads(threads):
            for bucket in (7, 512):
                outs = [(m.qsgd_quantize_feedback(x, r, 1.0, 7, bucket, 11, new := torch.empty(x.numel())), new)
                        for m in (R, nb)]
                assert_bitwise(outs[1], outs[0], f"qsgd bucket={bucket} threads={threads}")
                assert bool(outs[0][0][2])
            outs = [(m.terngrad_quantize_feedback(x, r, 1.0, 11, new := torch.empty(x.numel())), new) for m in (R, nb)]
            assert_bitwise(outs[1], outs[0], f"terngrad threads={threads}")
    y = x.clone()
    y[1234] = float("nan")
    for m in (R, nb):
        assert not bool(m.qsgd_quantize_feedback(y, r, 1.0, 7, 64, 1, torch.empty(y.numel()))[2])
        assert not bool(m.terngrad_quantize_feedback(y, r, 1.0, 1, torch.empty(y.numel()))[2])


@pytest.mark.parametrize("offset", [0, 1, 5, 16])
def test_level_quantize_feedback_out_offsets(monkeypatch, offset):
    """The fused kernels (their prefetches ``_AHEAD`` entries on, up to the end of the arrays): bitwise
    the reference for a new residual at any alignment, buckets of any size, several chunks and
    threads, in place or not."""
    monkeypatch.setattr(nb, "MIN_CHUNK", 64)
    monkeypatch.setattr(nb, "QUANT_CHUNK", 64)
    g = torch.Generator().manual_seed(offset)
    n = 5000 + offset
    x = torch.randn(n, generator=g)
    r = torch.randn(n, generator=g)
    for threads in (1, 3):
        with K.use_threads(threads):
            for bucket in (7, 16, 512, 3000):
                for inplace in (False, True):
                    outs = []
                    for m in (R, nb):
                        rs = r.clone()
                        new = rs if inplace else torch.full((n + offset,), 5.0)[offset:]
                        outs.append((m.qsgd_quantize_feedback(x, rs, 1.0, 7, bucket, 11, new), new))
                    assert_bitwise(outs[1], outs[0], f"qsgd bucket={bucket} threads={threads} inplace={inplace}")
            for inplace in (False, True):
                outs = []
                for m in (R, nb):
                    rs = r.clone()
                    new = rs if inplace else torch.full((n + offset,), 5.0)[offset:]
                    outs.append((m.terngrad_quantize_feedback(x, rs, 0.5, 11, new, 0.25), new))
                assert_bitwise(outs[1], outs[0], f"terngrad threads={threads} inplace={inplace}")


def test_sign_scale_rescue():
    """A finite chunk whose sum of |x| overflows gets the rescued, finite scale (the plain and the
    fused error-feedback kernels, both sums: level by level and streaming); an inf keeps +inf."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(70_000, generator=g).clamp(-3, 3) * 1e38
    x[::3] = 3.4e38
    x[1::5] *= -1
    for chunk in (1, 5, 64, 1024, 70_000):
        want = R.sign_pack(x, chunk)
        assert bool(torch.isfinite(want[1]).all())
        assert_bitwise(nb.sign_pack(x, chunk), want, f"sign_pack chunk={chunk}")
        if chunk % 8 == 0:
            new_ref, new_nb = torch.empty(x.numel()), torch.empty(x.numel())
            r = torch.zeros(x.numel())
            want = R.sign_pack_feedback(x, r, 1.0, chunk, new_ref)
            assert bool(want[2]) and bool(torch.isfinite(new_ref).all())
            assert_bitwise(nb.sign_pack_feedback(x, r, 1.0, chunk, new_nb), want, f"feedback chunk={chunk}")
            assert_bitwise(new_nb, new_ref, f"new residual chunk={chunk}")
    y = x[:64].clone()
    y[3] = float("inf")
    assert_bitwise(nb.sign_pack(y, 64), R.sign_pack(y, 64), "inf")
    assert R.sign_pack(y, 64)[1].item() == float("inf")


# ---------------------------------------------------------------- half-precision casts under error feedback
_HALF_EDGES = np.array([3.3895314e38, 3.3896e38, 3.3961e38, 3.4028235e38, -3.3961e38, 1.0 + 2.0 ** -8,
                        1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1e-40, -1e-45, -0.0, 0.0,
                        65504.0, 65519.99, 65520.0, -65536.0, 2.0 ** -14, 2.0 ** -14 * (1 - 2.0 ** -12),
                        2.0 ** -24, 1.5 * 2.0 ** -24, 2.5 * 2.0 ** -24, 2.0 ** -25, -2.0 ** -25 * 1.0001,
                        6.1e-5, -3.0e-6], dtype=np.float32)


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
@settings(max_examples=40)
@given(a=f32_arrays(max_size=200), b=f32_arrays(max_size=200), beta=st.sampled_from([1.0, 0.9]),
       scale=st.sampled_from([1.0, 0.5, 1 / 3, 2.0 ** -20]), residual=st.sampled_from(["none", "apart", "in place"]),
       wide=st.booleans())
def test_cast_feedback(wire, a, b, beta, scale, residual, wide):
    """The sent bits (any NaN for a NaN), the finite flag and (where finite) the new residual, bitwise
    the reference:
    round to nearest even (fp16's subnormals too), saturation at the dtype's largest value, inf kept,
    NaN as torch converts it, each product rounded on its own."""
    x = np.concatenate([a * np.float32(1e-4) if wide else a, _HALF_EDGES]).astype(np.float32)
    r = np.resize(np.concatenate([b, _HALF_EDGES[::-1]]), x.size).astype(np.float32)
    got = []
    for impl in (R.cast_feedback, nb.cast_feedback):
        out = torch.full((x.size,), 7.0)
        if residual == "in place":
            out.copy_(tensor(r))
        res = None if residual == "none" else (out if residual == "in place" else tensor(r))
        sent, finite = impl(tensor(x), res, beta, out, wire, scale)
        got.append((sent, bool(finite), out))
    (s0, f0, r0), (s1, f1, r1) = got
    assert_bitwise(s0, s1, "sent")   # a NaN's payload follows the arithmetic's operand order: any NaN
    assert f0 == f1
    if f0:
        assert_bitwise(r0, r1, "new residual")


def test_cast_feedback_every_fp16_code_round_trips():
    """Every finite fp16 value, and the midpoints between neighbours (ties to even), converts as torch does."""
    codes = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    codes = codes[torch.isfinite(codes)]
    mids = (codes[:-1].double() + codes[1:].double()).div(2).float()
    x = torch.cat([codes, mids])
    outs = [torch.empty(x.numel()), torch.empty(x.numel())]
    a = R.cast_feedback(x, None, 1.0, outs[0], torch.float16)
    b = nb.cast_feedback(x, None, 1.0, outs[1], torch.float16)
    assert torch.equal(a[0].view(torch.int16), b[0].view(torch.int16)) and bool(a[1]) == bool(b[1])
    assert_bitwise(outs[0], outs[1], "new residual")
