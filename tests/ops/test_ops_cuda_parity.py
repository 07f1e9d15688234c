"""The CUDA backend matches the torch reference bit for bit.

Every test runs twice: on the host build of kernels/*.cu (CPU tensors, g++; runs in CI) and on a
GPU (``gpu`` mark, skipped without one).  Both drive the same wrapper, cuda_backend.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

from commpress.ops import cuda_backend
from commpress.ops import reference as R

from hypothesis import given, settings
from hypothesis import strategies as st

from cuda_targets import gpu_target, host_target  # noqa: E402
from opcheck import assert_bitwise, f32_arrays, messy_large, tensor  # noqa: E402

HOST_SIZES = [0, 1, 7, 1000, 4500]  # 4500 > one selection segment (4096)
GPU_SIZES = [0, 1, 7, 1000, 65537, 1_000_003]
SPECIAL = [float("nan"), -0.0, 1.0, -1.0, float("inf"), 0.5, -2.0, 1e-45, -3e-39, float("-inf")]


@pytest.fixture(scope="module", params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def target(request):
    return host_target() if request.param == "host" else gpu_target()


@pytest.fixture
def cb(target):
    """cuda_backend running on the target's default launcher."""
    with cuda_backend.use(target.launcher()) as launcher:
        yield cuda_backend


def sizes(target):
    return HOST_SIZES if target.name == "host" else GPU_SIZES


def _x(n: int) -> torch.Tensor:
    if n < 20:
        return torch.tensor(SPECIAL * 2)[:n]
    return messy_large(n, seed=n)


def _launched(cb) -> bool:
    """The op ran kernels (on the host launcher, which records them), not the reference."""
    launcher = cuda_backend._launcher
    if not isinstance(launcher, cuda_backend.HostLauncher):
        return True
    ran = bool(launcher.launches)
    launcher.launches.clear()
    return ran


def check_selection(cb, target, op, x, arg, dtype=torch.float32):
    x = x.to(dtype)
    for res in ("none", "separate", "inplace"):
        xr, xg = x.clone(), target.to(x.clone())
        rr = rg = None
        if res == "separate":
            rr, rg = torch.full_like(xr, 7.0), target.to(torch.full_like(xr, 7.0))
        elif res == "inplace":
            rr, rg = xr, xg
        want = getattr(R, op)(xr, arg, rr)
        got = getattr(cb, op)(xg, arg, rg)
        assert_bitwise(got, want, f"{op}({arg}) residual={res}")
        if rr is not None:
            assert_bitwise(rg, rr, f"{op} residual={res}")
        assert _launched(cb) or x.numel() == 0 or (op == "topk_compact" and arg == 0), f"{op}: no kernel ran"


@pytest.mark.parametrize("op,arg", [("threshold_compact", 1.5), ("threshold_compact", 0.0),
                                    ("topk_compact", 0.01), ("topk_compact", 0.3), ("topk_compact", 1.0)])
def test_selection(cb, target, op, arg):
    for n in sizes(target):
        a = max(1, int(arg * n)) if op == "topk_compact" else arg
        check_selection(cb, target, op, _x(n), a)


@settings(max_examples=25)
@given(a=f32_arrays(1, 300), frac=st.floats(0, 1), thr=st.sampled_from([0.0, 1e-40, 0.5, 1.0, 3e38]),
       bits=st.integers(1, 8), block=st.integers(1, 70))
def test_property_parity(target, a, frac, thr, bits, block):
    """Arbitrary fp32 (NaN, inf, -0.0, subnormals, ties): selection, quantization and signs."""
    x = tensor(a)
    with cuda_backend.use(target.launcher()):
        check_selection(cuda_backend, target, "topk_compact", x, max(1, int(frac * x.numel())))
        check_selection(cuda_backend, target, "threshold_compact", x, thr)
        want = R.block_quantize(x, bits, block, True, 5)
        assert_bitwise(cuda_backend.block_quantize(target.to(x), bits, block, True, 5), want, "quantize")
        assert_bitwise(cuda_backend.block_dequantize(*target.to(want), bits, block, x.numel()),
                       R.block_dequantize(*want, bits, block, x.numel()), "dequantize")
        assert_bitwise(cuda_backend.sign_pack(target.to(x), block), R.sign_pack(x, block), "sign_pack")


def test_topk_ties_at_the_kth_key(cb, target):
    # keys repeat (1 and -1 share a key); k cuts each tie group in its middle
    base = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 1.0, -2.0, 0.25])
    x = base.repeat(300)
    for k in (1, 2, 3, 100, 301, 600, 601, 1000, 2399, 2400):
        check_selection(cb, target, "topk_compact", x, k)
    check_selection(cb, target, "topk_compact", torch.full((777,), -3.0), 400)  # all tie
    nan = torch.full((500,), float("nan"))
    nan[::7] = 1.0
    check_selection(cb, target, "topk_compact", nan, 450)  # ties among NaN keys


def test_topk_kth_key_below_the_top_buckets(cb, target):
    """The radix select lowers its candidate range when the top buckets hold fewer than k:
    the k-th key is decided by each of the three passes in turn (bits 30-20, 19-10, 9-0)."""
    g = torch.Generator().manual_seed(5)
    big = torch.randn(3000, generator=g) * 1e6
    small = torch.randn(3000, generator=g) * 1e-6
    x = torch.cat([small[:2000], big[:20], small[2000:]])  # 20 huge: k=50 digs into the small ones
    for k in (20, 21, 50, 4000):
        check_selection(cb, target, "topk_compact", x, k)
    ulps = (torch.randperm(3000, generator=g) + 0x3F800000).to(torch.int32).view(torch.float32)  # 1.0 + i ulp
    for k in (1, 5, 1500, 2999):  # same top 21 bits: pass 3 decides; then top 11 bits only
        check_selection(cb, target, "topk_compact", ulps, k)
        check_selection(cb, target, "topk_compact", ulps * (1 + torch.arange(3000) % 3 * 2**-13), k)


def test_int64_indices(cb, target, monkeypatch):
    """Tensors of 2**31 or more entries get int64 indices (sel_write_i64); forced here on small ones."""
    monkeypatch.setattr(R, "index_dtype", lambda numel: torch.int64)
    x = _x(5000)
    check_selection(cb, target, "topk_compact", x, 77)
    check_selection(cb, target, "threshold_compact", x, 1.0)
    assert cb.topk_compact(target.to(x), 5)[0].dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_selection_other_dtypes(cb, target, dtype):
    x = _x(1000)
    check_selection(cb, target, "topk_compact", x, 37, dtype)
    check_selection(cb, target, "threshold_compact", x, 1.0, dtype)


def test_non_contiguous_inputs(cb, target):
    x2 = _x(2000).reshape(40, 50)
    for x in (x2.t(), x2[:, ::3], x2[::2]):
        xg = target.to(x)
        assert_bitwise(cb.topk_compact(xg, 25), R.topk_compact(x, 25), "topk")
        assert_bitwise(cb.threshold_compact(xg, 1.0), R.threshold_compact(x, 1.0), "threshold")
        assert_bitwise(cb.block_quantize(xg, 4, 33), R.block_quantize(x, 4, 33), "quantize")
        assert_bitwise(cb.sign_pack(xg, 100), R.sign_pack(x, 100), "sign")
        assert_bitwise(cb.block_absmax(xg, 7), R.block_absmax(x, 7), "absmax")
        for dtype in (torch.float16, torch.bfloat16):
            assert_bitwise(cb.block_quantize(target.to(x.to(dtype)), 8, 64, True, 3),
                           R.block_quantize(x.to(dtype), 8, 64, True, 3), f"quantize {dtype}")
            assert_bitwise(cb.sign_pack(target.to(x.to(dtype)), 300), R.sign_pack(x.to(dtype), 300))


@pytest.mark.parametrize("bits", range(1, 9))
def test_quantize_dequantize_every_width(cb, target, bits):
    for n in sizes(target):
        x = _x(n)
        for block, sto in ((1, False), (3, True), (32, False), (33, True), (256, True)):
            want = R.block_quantize(x, bits, block, sto, 77)
            got = cb.block_quantize(target.to(x), bits, block, sto, 77)
            assert_bitwise(got, want, f"quantize bits={bits} block={block}")
            assert_bitwise(cb.block_absmax(target.to(x), block), want[1], "absmax")
            base = torch.randn(n)
            for acc in (False, True):
                o_ref, o_dev = base.clone(), target.to(base)
                R.block_dequantize(*want, bits, block, n, o_ref, acc)
                cb.block_dequantize(*target.to(want), bits, block, n, o_dev, acc)
                assert_bitwise(o_dev, o_ref, f"dequantize bits={bits} block={block} acc={acc}")
            assert_bitwise(cb.block_dequantize(*target.to(want), bits, block, n),
                           R.block_dequantize(*want, bits, block, n), "dequantize new")
        pieces = [R.block_quantize(x * k, bits, 32) for k in (1.0, -3.0, 0.5)]
        packed, scales = [p for p, _ in pieces], [s for _, s in pieces]
        base = torch.randn(n)
        o_ref, o_dev = base.clone(), target.to(base)
        R.block_dequantize_sum(packed, scales, bits, 32, n, o_ref, True)
        cb.block_dequantize_sum(target.to(packed), target.to(scales), bits, 32, n, o_dev, True)
        assert_bitwise(o_dev, o_ref, f"dequantize_sum bits={bits}")
        codes = torch.randint(0, 256, (n,), dtype=torch.uint8)
        packed = R.pack_bits(codes, bits)
        assert_bitwise(cb.pack_bits(target.to(codes), bits), packed, f"pack {bits}")
        assert_bitwise(cb.unpack_bits(target.to(packed), bits, n), R.unpack_bits(packed, bits, n))


def test_sign(cb, target):
    for n in sizes(target):
        x = _x(n)
        for chunk in (1, 5, 37, 256, 257, 1024, 70000, max(n, 1)):
            if chunk < 8 and n > 1000:
                continue  # one warp per chunk: slow on the host build, covered by smaller n
            want = R.sign_pack(x, chunk)
            assert_bitwise(cb.sign_pack(target.to(x), chunk), want, f"sign_pack n={n} chunk={chunk}")
            base = torch.randn(n)
            o_ref, o_dev = base.clone(), target.to(base)
            R.sign_unpack(*want, chunk, n, o_ref, True)
            cb.sign_unpack(*target.to(want), chunk, n, o_dev, True)
            assert_bitwise(o_dev, o_ref, f"sign_unpack {chunk}")


def test_rng(cb, target):
    for n in sizes(target):
        for seed, start in ((0, 0), (2**64 - 1, 2**32 - 5), (12345, 99)):
            assert_bitwise(cb.counter_bits(seed, start, n, target.device), R.counter_bits(seed, start, n))
            assert_bitwise(cb.counter_uniform(seed, start, n, target.device),
                           R.counter_uniform(seed, start, n))


def test_hash_owner_any_world_size(cb, target):
    g = torch.Generator().manual_seed(1)
    idx = torch.cat([torch.randint(-2**62, 2**62, (500,), generator=g), torch.arange(-5, 300),
                     torch.tensor([2**32 - 1, 2**32, 2**32 + 7, -1, 2**63 - 1])])
    for world in (1, 2, 5, 2**31 - 1, 2**32 - 1, 2**32, 2**32 + 1, 2**63 + 5):
        assert_bitwise(cb.hash_owner(target.to(idx), world), R.hash_owner(idx, world) if world < 2**63
                       else (R._mix32(idx & R.MASK32)), f"world={world}")
        assert _launched(cb)
    assert_bitwise(cb.hash_owner(target.to(idx.to(torch.int32).reshape(5, -1)), 7),
                   R.hash_owner(idx.to(torch.int32).reshape(5, -1), 7), "int32 2-D")


def test_scatter_add_keeps_subnormals(cb, target):
    tiny = torch.tensor(1e-45)  # smallest fp32 subnormal: flushed by float atomicAdd
    out = torch.tensor([1e-45, -1e-45, 3e-39, 0.0, 1.0, -0.0, 5e-39, 2.0] * 50)
    idx = torch.randperm(out.numel(), generator=torch.Generator().manual_seed(2))[:300]
    vals = torch.cat([tiny.repeat(100), torch.full((100,), -2e-39), torch.randn(100)])
    want = R.scatter_add_(out.clone(), idx, vals)
    got = cb.scatter_add_(target.to(out), target.to(idx), target.to(vals))
    assert_bitwise(got, want, "scatter_add_ f32")
    assert bool(((want != 0) & (want.abs() < 1.2e-38)).any())  # the test does hold subnormals
    out64 = out.double() * 1e-280
    want64 = R.scatter_add_(out64.clone(), idx, vals.double() * 1e-290)
    assert_bitwise(cb.scatter_add_(target.to(out64), target.to(idx), target.to(vals.double() * 1e-290)),
                   want64, "scatter_add_ f64")
    for n in sizes(target):  # int32 indices, values of another dtype
        o = torch.randn(max(n, 1))
        i = torch.randperm(max(n, 1))[: n // 3].to(torch.int32)
        v = torch.randn(i.numel()).to(torch.bfloat16)
        assert_bitwise(cb.scatter_add_(target.to(o), target.to(i), target.to(v)),
                       R.scatter_add_(o.clone(), i, v))


def test_scatter_add_duplicate_indices_lose_nothing(cb, target):
    idx = torch.arange(3000) % 7  # 7 slots, ~430 adds each: exact in any order (small integers)
    vals = (torch.arange(3000) % 5 - 2).float()
    out = torch.full((7,), 0.5)
    assert_bitwise(cb.scatter_add_(target.to(out), target.to(idx), target.to(vals)),
                   R.scatter_add_(out.clone(), idx, vals))


def test_scatter_add_bad_index_writes_nothing(cb, target, monkeypatch):
    monkeypatch.setenv("COMMPRESS_CUDA_CHECK", "1")
    out = torch.randn(100)
    for bad in (100, -1, 2**40):
        got = target.to(out)
        with pytest.raises(IndexError, match="out of range"):
            cb.scatter_add_(got, target.to(torch.tensor([3, bad, 5])), target.to(torch.ones(3)))
        assert_bitwise(got, out, "out untouched")
    if target.name == "cuda":  # without the check: recorded on the device, no exception
        monkeypatch.delenv("COMMPRESS_CUDA_CHECK")
        got = target.to(out)
        cb.scatter_add_(got, target.to(torch.tensor([3, 100])), target.to(torch.ones(2)))
        assert cb.take_errors(got.device) == 1 and cb.take_errors(got.device) == 0
        assert_bitwise(got, out, "out untouched")


def test_hot_ops_never_read_the_device(target, monkeypatch):
    """top-k, scatter_add_ (also with a bad index), quantize/dequantize, sign, hash: no host read
    of a tensor's data (the syncs a GPU would pay).  threshold_compact reads its output size once."""
    if target.name != "host":
        pytest.skip("the GPU twin is test_no_synchronization_on_gpu")
    launcher = target.launcher()
    launcher.reads_are_free = False  # report errors the GPU way
    x, out = _x(3000), torch.randn(3000)
    idx = torch.randperm(3000)[:30]

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of device data")

    with cuda_backend.use(launcher):
        for name in ("item", "tolist", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__"):
            monkeypatch.setattr(torch.Tensor, name, forbidden)
        got = cuda_backend.topk_compact(x, 30, torch.empty_like(x))
        cuda_backend.scatter_add_(out, idx, x[:30])
        cuda_backend.scatter_add_(out, torch.tensor([1, 3000]), x[:2])  # bad: recorded, not raised
        q = cuda_backend.block_quantize(x, 4, 64, True, 1)
        cuda_backend.block_dequantize(*q, 4, 64, 3000, out, True)
        cuda_backend.sign_unpack(*cuda_backend.sign_pack(x, 512), 512, 3000, out, True)
        cuda_backend.hash_owner(idx, 2**32)
        with pytest.raises(AssertionError, match="host read"):
            cuda_backend.threshold_compact(x, 1.0)
        monkeypatch.undo()
        assert cuda_backend.take_errors(out.device) == 1 and cuda_backend.take_errors(out.device) == 0
    assert_bitwise(got, R.topk_compact(x, 30, torch.empty_like(x)))


@pytest.mark.gpu
def test_no_synchronization_on_gpu():
    gpu_target()
    x = _x(1_000_003).cuda()
    out = torch.zeros_like(x)
    with cuda_backend.use(cuda_backend.CupyLauncher()):
        cuda_backend.topk_compact(x, 100)  # compile and allocate first
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            idx, vals = cuda_backend.topk_compact(x, 10_000, torch.empty_like(x))
            cuda_backend.scatter_add_(out, idx, vals)
            q = cuda_backend.block_quantize(x, 8, 256)
            cuda_backend.block_dequantize(*q, 8, 256, x.numel(), out, True)
            cuda_backend.sign_pack(x, 4096)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_grid_stride_loops(cb, target, monkeypatch):
    """Grids of one and two blocks: every kernel loops over work past its grid."""
    monkeypatch.setattr(cuda_backend, "SEG", 128)
    x = _x(3000)
    for threads, max_grid in ((32, 1), (64, 2)):
        with cuda_backend.use(target.launcher(threads=threads, max_grid=max_grid)):
            check_selection(cb, target, "topk_compact", x, 100)
            check_selection(cb, target, "threshold_compact", x, 0.7)
            for bits, block in ((8, 16), (3, 5), (5, 300)):
                want = R.block_quantize(x, bits, block, True, 9)
                assert_bitwise(cb.block_quantize(target.to(x), bits, block, True, 9), want)
                assert_bitwise(cb.block_dequantize(*target.to(want), bits, block, x.numel()),
                               R.block_dequantize(*want, bits, block, x.numel()))
            for chunk in (64, 700, 3000):
                assert_bitwise(cb.sign_pack(target.to(x), chunk), R.sign_pack(x, chunk), f"sign {chunk}")
            assert_bitwise(cb.counter_uniform(4, 10, 3000, target.device), R.counter_uniform(4, 10, 3000))
            idx = torch.randperm(3000)[:2500]
            assert_bitwise(cb.hash_owner(target.to(idx), 2**32), R.hash_owner(idx, 2**32))
            out = torch.randn(3000)
            assert_bitwise(cb.scatter_add_(target.to(out), target.to(idx), target.to(x[:2500])),
                           R.scatter_add_(out.clone(), idx, x[:2500]))


def test_call_from_a_worker_thread(cb, target):
    x = _x(3000)
    results, errors = {}, []

    def work():
        try:
            results["topk"] = cb.topk_compact(target.to(x), 30)
            results["q"] = cb.block_quantize(target.to(x), 4, 64)
        except Exception as exc:  # reported below
            errors.append(exc)

    t = threading.Thread(target=work)
    t.start()
    t.join(120)
    assert not errors, errors
    assert_bitwise(results["topk"], R.topk_compact(x, 30))
    assert_bitwise(results["q"], R.block_quantize(x, 4, 64))


def test_every_op_runs_kernels(cb, target):
    """Each op of the backend launches kernels for a supported input (no silent fallback)."""
    if target.name != "host":
        pytest.skip("launch log is a host-launcher feature")
    x = target.to(_x(100))
    calls = {
        "threshold_compact": lambda: cb.threshold_compact(x, 1.0),
        "topk_compact": lambda: cb.topk_compact(x, 3),
        "scatter_add_": lambda: cb.scatter_add_(x.clone(), torch.arange(3), x[:3]),
        "counter_bits": lambda: cb.counter_bits(1, 0, 10, x.device),
        "counter_uniform": lambda: cb.counter_uniform(1, 0, 10, x.device),
        "hash_owner": lambda: cb.hash_owner(torch.arange(10), 3),
        "pack_bits": lambda: cb.pack_bits(torch.arange(10, dtype=torch.uint8), 4),
        "unpack_bits": lambda: cb.unpack_bits(torch.arange(10, dtype=torch.uint8), 4, 20),
        "block_absmax": lambda: cb.block_absmax(x, 8),
        "block_quantize": lambda: cb.block_quantize(x, 4, 8),
        "block_dequantize": lambda: cb.block_dequantize(*cb.block_quantize(x, 4, 8), 4, 8, 100),
        "block_dequantize_sum": lambda: cb.block_dequantize_sum(*zip(cb.block_quantize(x, 4, 8),
                                                                      cb.block_quantize(x * 2, 4, 8)), 4, 8, 100),
        "sign_pack": lambda: cb.sign_pack(x, 8),
        "sign_unpack": lambda: cb.sign_unpack(*cb.sign_pack(x, 8), 8, 100),
        "fp8_quantize": lambda: cb.fp8_quantize(x, "e4m3", 8),
        "fp8_dequantize": lambda: cb.fp8_dequantize(*R.fp8_quantize(x.cpu(), "e4m3", 8), "e4m3", 8, 100),
        "mx_quantize": lambda: cb.mx_quantize(x, "fp4_e2m1"),
        "mx_dequantize": lambda: cb.mx_dequantize(*R.mx_quantize(x.cpu(), "fp4_e2m1"), "fp4_e2m1", 100),
        "bucket_norms": lambda: cb.bucket_norms(x, 16),
        "level_quantize": lambda: cb.level_quantize(x, torch.ones(7), 16, 3, 1),
        "qsgd_quantize": lambda: cb.qsgd_quantize(x, 3, 16, 1),
        "level_dequantize": lambda: cb.level_dequantize(*R.qsgd_quantize(x.cpu(), 3, 16, 1), 16, 3, 100),
        "sign_pack_feedback": lambda: cb.sign_pack_feedback(x, torch.zeros(100), 1.0, 8, torch.empty(100)),
    }
    assert set(calls) == set(cuda_backend.OPS)
    for name, call in calls.items():
        _launched(cb)
        call()
        assert _launched(cb), f"{name} ran no kernel"


def test_tensors_on_two_devices_go_to_the_reference(cb, target, monkeypatch):
    """Mixed devices never reach a kernel (it would dereference another device's pointer)."""
    seen = []
    monkeypatch.setattr(R, "scatter_add_", lambda out, i, v: seen.append("ref") or out)
    other = torch.device("meta")
    cb.scatter_add_(target.to(torch.zeros(4)), torch.arange(2, device=other), target.to(torch.ones(2)))
    assert seen == ["ref"]


def test_host_launcher_checks_arguments(target):
    """Wrapper bugs that would corrupt memory on a GPU (wrong scalar width, wrong element size,
    a non-contiguous tensor) are errors on the host launcher."""
    if target.name != "host":
        pytest.skip("host launcher only")
    import numpy as np

    launcher = target.launcher()
    cpu = torch.device("cpu")
    out = torch.empty(4, dtype=torch.int64)
    idx = torch.arange(4)
    launcher.launch(cpu, "hash_owner_kernel", 1, (idx, out, np.uint64(3), np.int64(4)), 32)
    assert_bitwise(out, R.hash_owner(idx, 3))
    bad_calls = [
        (idx, out, np.uint32(3), np.int64(4)),  # world must be 64-bit
        (idx.to(torch.int32), out, np.uint64(3), np.int64(4)),  # i64* given int32
        (torch.arange(8)[::2], out, np.uint64(3), np.int64(4)),  # not contiguous
        (idx, out, np.uint64(3)),  # missing argument
    ]
    for args in bad_calls:
        with pytest.raises(TypeError):
            launcher.launch(cpu, "hash_owner_kernel", 1, args, 32)
    with pytest.raises(LookupError):
        launcher.launch(cpu, "no_such_kernel", 1, (), 32)
    with pytest.raises(RuntimeError):  # block size must be a multiple of 32
        launcher.launch(cpu, "hash_owner_kernel", 1, (idx, out, np.uint64(3), np.int64(4)), 48)


# ---------------------------------------------------------------- GPU only
@pytest.mark.gpu
def test_tensor_on_the_second_gpu():
    gpu_target()
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    x = _x(100_003)
    dev = torch.device("cuda", 1)
    before = torch.cuda.current_device()
    with cuda_backend.use(cuda_backend.CupyLauncher()):
        for call in (lambda: (cuda_backend.topk_compact(x.to(dev), 99), R.topk_compact(x, 99)),
                     lambda: (cuda_backend.block_quantize(x.to(dev), 4, 64), R.block_quantize(x, 4, 64)),
                     lambda: (cuda_backend.sign_pack(x.to(dev), 4096), R.sign_pack(x, 4096))):
            got, want = call()
            assert all(t.device == dev for t in got)
            assert_bitwise(got, want)
        done = {}
        t = threading.Thread(target=lambda: done.setdefault("r", cuda_backend.topk_compact(x.to(dev), 7)))
        t.start()
        t.join(120)
        assert_bitwise(done["r"], R.topk_compact(x, 7), "from a worker thread (its current device is 0)")
    assert torch.cuda.current_device() == before


@pytest.mark.gpu
def test_runs_on_the_current_stream():
    """A side stream holds a long sleep then a write of the input; kernels launched on that stream
    must see the written values (on any other stream they would read the old ones)."""
    gpu_target()
    n = 1_000_003
    y = _x(n)
    with cuda_backend.use(cuda_backend.CupyLauncher()):
        x = torch.zeros(n, device="cuda")
        y_dev = y.cuda()
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of the write
            x.copy_(y_dev)
            idx, vals = cuda_backend.topk_compact(x, 1000)
            p, sc = cuda_backend.block_quantize(x, 8, 256)
            out = torch.zeros_like(x)
            cuda_backend.block_dequantize(p, sc, 8, 256, n, out, True)
            acc = torch.zeros_like(x)
            cuda_backend.scatter_add_(acc, idx.long(), vals)
        s.synchronize()
    assert_bitwise((idx.cpu(), vals.cpu()), R.topk_compact(y, 1000))
    assert_bitwise(out.cpu(), R.block_dequantize(*R.block_quantize(y, 8, 256), 8, 256, n))
    assert_bitwise(acc.cpu(), R.scatter_add_(torch.zeros(n), *R.topk_compact(y, 1000)))


@pytest.mark.gpu
def test_dispatch_picks_cuda():
    gpu_target()
    import commpress.ops as ops

    x = _x(1000).cuda()
    assert ops.resolve("topk_compact", x.device) is cuda_backend.topk_compact
    assert_bitwise(ops.topk_compact(x, 10), R.topk_compact(x.cpu(), 10))
    assert_bitwise(ops.counter_uniform(3, 0, 100, device=x.device).cpu(), R.counter_uniform(3, 0, 100))
