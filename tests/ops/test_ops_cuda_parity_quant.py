"""The CUDA kernels of fp8, MX, QSGD/TernGrad levels and signsgd error feedback match the torch
reference bit for bit, on the host build of kernels/*.cu (CI) and on a GPU (``gpu`` mark).

Sizes are small on the host (each CUDA thread is a fiber of the host shim); the GPU twin runs larger ones.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import commpress.ops as ops
from commpress.ops import _usage, cuda_backend
from commpress.ops import reference as R

from cuda_targets import gpu_target, host_target  # noqa: E402
from opcheck import assert_bitwise, f32_arrays, messy_large, norm_extremes, tensor  # noqa: E402

HOST_SIZES = [0, 1, 7, 20, 700]
GPU_SIZES = [0, 1, 7, 1000, 65537, 1_000_003]
SPECIAL = [float("nan"), -0.0, 1.0, -1.0, float("inf"), 0.5, -2.0, 1e-45, -3e-39, float("-inf")]


@pytest.fixture(scope="module", params=["host", pytest.param("cuda", marks=pytest.mark.gpu)])
def target(request):
    return host_target() if request.param == "host" else gpu_target()


@pytest.fixture
def cb(target):
    with cuda_backend.use(target.launcher()):
        yield cuda_backend


def sizes(target):
    return HOST_SIZES if target.name == "host" else GPU_SIZES


def _x(n: int) -> torch.Tensor:
    if n <= 20:
        return torch.tensor(SPECIAL * 2)[:n]
    x = messy_large(n, seed=n)
    x[3::211] *= 1e-41  # subnormals: the minifloats' subnormal codes and the e8m0 floor
    x[4::307] *= 3e37  # near fp32 max: overflowing squares, saturation
    return x


def _ran_kernels() -> bool:
    launcher = cuda_backend._launcher
    if not isinstance(launcher, cuda_backend.HostLauncher):
        return True
    ran = bool(launcher.launches)
    launcher.launches.clear()
    return ran


def _decode_both(cb, target, op, payload, args, n):
    """``op`` decodes ``payload`` like the reference: new output, and accumulated into one."""
    assert_bitwise(getattr(cb, op)(*target.to(payload), *args, n), getattr(R, op)(*payload, *args, n), op)
    base = torch.randn(n)
    o_ref, o_dev = base.clone(), target.to(base)
    getattr(R, op)(*payload, *args, n, o_ref, True)
    getattr(cb, op)(*target.to(payload), *args, n, o_dev, True)
    assert_bitwise(o_dev, o_ref, f"{op} accumulate")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8(cb, target, fmt):
    for n in sizes(target):
        x = _x(n)
        for block, sto in ((1, False), (5, True), (128, False), (1000, True)):
            if block == 1 and n > 1000:
                continue
            want = R.fp8_quantize(x, fmt, block, sto, 21)
            assert_bitwise(cb.fp8_quantize(target.to(x), fmt, block, sto, 21), want, f"fp8 {fmt} {block} n={n}")
            assert _ran_kernels() or n == 0
            _decode_both(cb, target, "fp8_dequantize", want, (fmt, block), n)
        codes, scales = R.fp8_quantize(x, fmt, 64)  # codes as the float8 dtype the compressor sends
        wire = codes.view(torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2)
        assert_bitwise(cb.fp8_dequantize(target.to(wire), target.to(scales), fmt, 64, n),
                       R.fp8_dequantize(codes, scales, fmt, 64, n), "float8 codes")


@pytest.mark.parametrize("element", list(R.MX_ELEMENTS))
def test_mx(cb, target, element):
    for n in sizes(target) + ([33, 63] if target.name == "host" else []):
        x = _x(n)
        for sto in (False, True):
            want = R.mx_quantize(x, element, sto, 5)
            assert_bitwise(cb.mx_quantize(target.to(x), element, sto, 5), want, f"mx {element} n={n}")
            _decode_both(cb, target, "mx_dequantize", want, (element,), n)
    blocks = torch.tensor([3e-39, 1e-45] * 16 + [float("inf")] * 32 + [float("nan"), -1.0] * 16)
    assert_bitwise(cb.mx_quantize(target.to(blocks), element), R.mx_quantize(blocks, element), "special blocks")


def test_qsgd_and_terngrad_levels(cb, target):
    for n in sizes(target):
        x = _x(n)
        for levels, bucket in ((1, 1), (7, 512), (3, 5), (127, 300), (2, 10**9)):
            if bucket < 8 and target.name == "host" and n > 20:
                continue  # a warp per bucket: slow on the host build, covered by the small sizes
            want = R.qsgd_quantize(x, levels, bucket, 11)
            assert_bitwise(cb.qsgd_quantize(target.to(x), levels, bucket, 11), want, f"qsgd {levels}/{bucket}")
            assert_bitwise(cb.bucket_norms(target.to(x), bucket), want[1], "bucket_norms")
            _decode_both(cb, target, "level_dequantize", want, (bucket, levels), n)
        if n:  # TernGrad: one level, one scale for the whole tensor
            scale = R.block_absmax(x, 1 << 16).amax().reshape(1)
            want = R.level_quantize(x, scale, n, 1, 3)
            assert_bitwise(cb.level_quantize(target.to(x), target.to(scale), n, 1, 3), want, "terngrad")
            _decode_both(cb, target, "level_dequantize", (want, scale), (n, 1), n)



def test_level_quantize_extremes(cb, target):
    """Buckets whose sums of squares overflow or underflow fp32 (norm_rescue_kernel: one and
    several groups of 256 per bucket) and scales whose ``levels / s`` is not a normal fp32."""
    x = norm_extremes()
    for levels, bucket in ((7, 7), (3, 300), (127, 600), (1, 10**9)):
        want = R.qsgd_quantize(x, levels, bucket, 5)
        assert_bitwise(cb.qsgd_quantize(target.to(x), levels, bucket, 5), want, f"qsgd {levels}/{bucket}")
    for part in (x[100:200], x[300:400], x[450:]):  # TernGrad: one scale max|x|, huge or subnormal
        scale = part.abs().amax().reshape(1)
        assert_bitwise(cb.level_quantize(target.to(part), target.to(scale), part.numel(), 1, 3),
                       R.level_quantize(part, scale, part.numel(), 1, 3), "terngrad")

def test_sign_scale_rescue(cb, target):
    """Finite chunks whose sum of |x| overflows fp32 get the reference's rescued, finite scale
    (sign_rescue_kernel after the tree kernels; in place in the fused feedback kernel, chunks of
    one and several groups of 256, and in the unfused one); a chunk holding inf keeps +inf."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(700, generator=g).clamp(-3, 3) * 1e38
    x[::3] = 3.4e38
    x[1::5] *= -1
    x[650] = float("inf")   # its chunk keeps +inf: no rescue there
    for chunk in (5, 64, 300, 700, 9000):
        want = R.sign_pack(x, chunk)
        finite = torch.isfinite(want[1])
        assert not bool(finite[650 // chunk]) and int(finite.sum()) == finite.numel() - 1
        assert_bitwise(cb.sign_pack(target.to(x), chunk), want, f"sign_pack chunk={chunk}")
    for chunk in (64, 296, 9000):   # fused (whole bytes, <= 8192) and the unfused kernels
        r = torch.zeros(700)
        new_ref, new_dev = torch.empty(700), target.to(torch.empty(700))
        want = R.sign_pack_feedback(x[:600], r[:600], 1.0, chunk, new_ref[:600])
        got = cb.sign_pack_feedback(target.to(x[:600]), target.to(r[:600]), 1.0, chunk, new_dev[:600])
        assert bool(want[2]) and bool(torch.isfinite(new_ref[:600]).all())
        assert_bitwise(got, want, f"sign_pack_feedback chunk={chunk}")
        assert_bitwise(new_dev[:600], new_ref[:600], f"new residual chunk={chunk}")


def test_sign_pack_feedback(cb, target):
    for n in sizes(target):
        x = _x(n)
        r = torch.randn(n)
        for chunk in (1, 7, 256, 300, 1024):
            if chunk < 8 and n > (20 if target.name == "host" else 1000):
                continue
            for beta in (1.0, 0.9):
                new_ref, new_dev = torch.full((n,), 9.0), target.to(torch.full((n,), 9.0))
                want = R.sign_pack_feedback(x, r, beta, chunk, new_ref)
                got = cb.sign_pack_feedback(target.to(x), target.to(r), beta, chunk, new_dev)
                assert_bitwise(got, want, f"sign_pack_feedback n={n} chunk={chunk} beta={beta}")
                assert_bitwise(new_dev, new_ref, "new residual")
                assert _ran_kernels() or n == 0
        for chunk in (64, 300):  # the new residual written over the old one (each element read, then written)
            new_ref = torch.empty(n)
            want = R.sign_pack_feedback(x, r, 0.5, chunk, new_ref)
            r_dev = target.to(r)
            assert_bitwise(cb.sign_pack_feedback(target.to(x), r_dev, 0.5, chunk, r_dev), want, "aliased")
            assert_bitwise(r_dev, new_ref, f"aliased new residual chunk={chunk}")


@settings(max_examples=8, deadline=None)
@given(a=f32_arrays(1, 120), fmt=st.sampled_from(["e4m3", "e5m2"]), element=st.sampled_from(list(R.MX_ELEMENTS)),
       block=st.integers(1, 70), levels=st.integers(1, 127), sto=st.booleans())
def test_property_parity(target, a, fmt, element, block, levels, sto):
    """Arbitrary fp32 (NaN, inf, -0.0, subnormals, ties) through every new kernel."""
    x = tensor(a)
    n = x.numel()
    with cuda_backend.use(target.launcher()):
        cb = cuda_backend
        assert_bitwise(cb.fp8_quantize(target.to(x), fmt, block, sto, 7), R.fp8_quantize(x, fmt, block, sto, 7))
        assert_bitwise(cb.mx_quantize(target.to(x), element, sto, 7), R.mx_quantize(x, element, sto, 7))
        assert_bitwise(cb.qsgd_quantize(target.to(x), levels, block, 7), R.qsgd_quantize(x, levels, block, 7))
        new_ref, new_dev = torch.empty(n), target.to(torch.empty(n))
        r = torch.randn(n)
        assert_bitwise(cb.sign_pack_feedback(target.to(x), target.to(r), 0.5, block, new_dev),
                       R.sign_pack_feedback(x, r, 0.5, block, new_ref))
        assert_bitwise(new_dev, new_ref)


def test_grid_stride_loops(target):
    """Grids of one block of one warp, and two of two warps: every new kernel loops past its grid."""
    x = _x(700)
    r = torch.randn(700)
    for threads, max_grid in ((32, 1), (64, 2)):
        with cuda_backend.use(target.launcher(threads=threads, max_grid=max_grid)):
            cb = cuda_backend
            for block in (3, 100):
                assert_bitwise(cb.fp8_quantize(target.to(x), "e5m2", block, True, 1),
                               R.fp8_quantize(x, "e5m2", block, True, 1))
            assert_bitwise(cb.qsgd_quantize(target.to(x), 5, 300, 2), R.qsgd_quantize(x, 5, 300, 2))
            want = R.mx_quantize(x, "fp6_e2m3", True, 3)
            assert_bitwise(cb.mx_quantize(target.to(x), "fp6_e2m3", True, 3), want)
            assert_bitwise(cb.mx_dequantize(*target.to(want), "fp6_e2m3", 700), R.mx_dequantize(*want, "fp6_e2m3", 700))
            new_ref, new_dev = torch.empty(700), target.to(torch.empty(700))
            assert_bitwise(cb.sign_pack_feedback(target.to(x), target.to(r), 1.0, 64, new_dev),
                           R.sign_pack_feedback(x, r, 1.0, 64, new_ref))
            assert_bitwise(new_dev, new_ref)


def test_new_ops_never_read_the_device(target, monkeypatch):
    """No host read of tensor data in any new op (a GPU would pay a synchronization)."""
    if target.name != "host":
        pytest.skip("the GPU twin is benchmarks/gpu_check.sh's sync-debug step")
    x, r, new, out = _x(700), torch.randn(700), torch.empty(700), torch.zeros(700)

    def forbidden(*args, **kwargs):
        raise AssertionError("host read of device data")

    with cuda_backend.use(target.launcher()) as launcher:
        launcher.reads_are_free = False
        for name in ("item", "tolist", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__"):
            monkeypatch.setattr(torch.Tensor, name, forbidden)
        cb = cuda_backend
        cb.fp8_dequantize(*cb.fp8_quantize(x, "e4m3", 128, True, 1), "e4m3", 128, 700, out, True)
        cb.mx_dequantize(*cb.mx_quantize(x, "fp4_e2m1", True, 1), "fp4_e2m1", 700, out, True)
        cb.level_dequantize(*cb.qsgd_quantize(x, 7, 512, 1), 512, 7, 700, out, True)
        scale = cb.block_absmax(x, 1 << 16).amax().reshape(1)
        cb.level_dequantize(cb.level_quantize(x, scale, 700, 1, 2), scale, 700, 1, 700, out, True)
        cb.sign_pack_feedback(x, r, 0.9, 256, new)
        monkeypatch.undo()


def test_fallbacks_are_logged_once_and_reported(cb, target, caplog, monkeypatch):
    """Arguments no kernel covers run the reference: logged once per op, named in backends_used."""
    monkeypatch.setattr(_usage, "_logged", set())
    x = target.to(torch.arange(40, dtype=torch.int32))  # integer input: no kernel
    with caplog.at_level(logging.WARNING, logger="commpress"):
        for _ in range(3):
            assert_bitwise(cb.fp8_quantize(x, "e4m3", 8), R.fp8_quantize(x.cpu(), "e4m3", 8))
    assert caplog.text.count("ops.fp8_quantize") == 1 and "reference" in caplog.text
    assert _usage.used()["fp8_quantize"] == "torch"
    cb.fp8_quantize(x.float(), "e4m3", 8)
    assert _usage.used()["fp8_quantize"] == "torch"  # the dispatcher (not called here) notes kernels


def test_backends_used_names_the_dispatched_backend(monkeypatch, caplog):
    monkeypatch.setattr(_usage, "_logged", set())
    monkeypatch.setitem(ops._IMPLS, "numba", {"fp8_quantize": lambda *a, **k: "numba ran"})
    ops.backends_used(reset=True)
    x = torch.randn(100)
    assert ops.fp8_quantize(x, "e4m3", 32) == "numba ran"
    ops.block_quantize(x, 4, 32, backend="torch")
    used = ops.backends_used(reset=True)
    assert used["fp8_quantize"] == "numba"
    assert used["block_quantize"] == "torch" and ops.backends_used() == {}
    with caplog.at_level(logging.WARNING, logger="commpress"):  # a CUDA tensor with no kernel
        for _ in range(2):
            assert ops._resolve("bitmap_encode", torch.device("cuda", 0))[0] == "torch"
    assert caplog.text.count("ops.bitmap_encode") == 1


def test_nvrtc_failure_at_first_launch_falls_back(target, caplog, monkeypatch):
    """NVRTC failing on the real sources (first launch) sends every op to the reference, logged."""

    class Broken:
        reads_are_free = True
        threads, max_grid = 64, 4

        def owns(self, device):
            return True

        def launch(self, *args):
            raise cuda_backend.KernelsUnavailable("NVRTC could not compile: test")

    monkeypatch.setattr(cuda_backend, "_compile_failure", None)
    monkeypatch.setattr(_usage, "_logged", set())
    x = _x(100)
    with cuda_backend.use(Broken()), caplog.at_level(logging.WARNING, logger="commpress"):
        assert_bitwise(cuda_backend.mx_quantize(x, "fp8_e4m3"), R.mx_quantize(x, "fp8_e4m3"))
        assert_bitwise(cuda_backend.topk_compact(x, 5), R.topk_compact(x, 5))
    assert "NVRTC could not compile" in caplog.text and caplog.text.count("every op now runs") == 1
    assert _usage.used()["topk_compact"] == "torch"


@pytest.mark.gpu
def test_new_ops_never_synchronize_on_gpu():
    gpu_target()
    x = _x(1_000_003).cuda()
    r, new, out = torch.randn_like(x), torch.empty_like(x), torch.zeros_like(x)
    with cuda_backend.use(cuda_backend.CupyLauncher()):
        cb = cuda_backend
        cb.fp8_quantize(x, "e4m3", 128)  # compile, make the decode tables
        cb.mx_dequantize(*cb.mx_quantize(x, "fp4_e2m1"), "fp4_e2m1", x.numel())
        cb.fp8_dequantize(*cb.fp8_quantize(x, "e5m2", 128), "e5m2", 128, x.numel())
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            cb.fp8_dequantize(*cb.fp8_quantize(x, "e4m3", 128, True, 1), "e4m3", 128, x.numel(), out, True)
            cb.mx_dequantize(*cb.mx_quantize(x, "fp4_e2m1", True, 1), "fp4_e2m1", x.numel(), out, True)
            cb.level_dequantize(*cb.qsgd_quantize(x, 7, 512, 1), 512, 7, x.numel(), out, True)
            scale = cb.block_absmax(x, 1 << 16).amax().reshape(1)
            cb.level_quantize(x, scale, x.numel(), 1, 2)
            cb.sign_pack_feedback(x, r, 0.9, 1024, new)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
