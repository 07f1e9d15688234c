"""The ``"cuda"`` backend: kernels from ``kernels/*.cu``, bitwise equal to :mod:`.reference`.

The ops here are written once against a *launcher*, which runs a named kernel of
``kernels/*.cu`` on a 1-D grid with raw pointers and typed scalars:

* :class:`CupyLauncher` (the backend users get): CUDA tensors.  The sources are compiled by
  NVRTC once per device (:func:`compile_image`, with :data:`NVRTC_OPTIONS`), each kernel is looked up once per
  ``(device, name)`` inside ``cupy.cuda.Device(index)`` (so a worker thread never touches
  another GPU), and launches go to torch's current stream of the tensor's device with
  ``data_ptr()`` arguments (no DLPack per launch).  Outputs are allocated by torch.
* :class:`HostLauncher` (CI): the same sources built for the host by ``kernels/host/build.py``
  (one fiber per CUDA thread, real barriers), run on CPU tensors.  It checks every
  argument against the kernel's signature, so the parity tests run *this* wrapper, not a copy.

Host synchronization: none in ``topk_compact`` (the k-th key is found by a radix select on the
device and the output has exactly ``k`` entries), ``scatter_add_`` and every other op, except
``threshold_compact``, whose output size is the data-dependent count (one read of it).  The
hot path's fixed-capacity threshold is ``topk_compact(x, C)`` then dropping the entries whose
magnitude key is below the threshold's: no read at all.

``scatter_add_`` checks its indices on the device first and then writes all or nothing.  A bad
index raises ``IndexError`` where reading the flag is free (the host launcher) or when
``COMMPRESS_CUDA_CHECK=1``; otherwise the failure is recorded on the device and
:func:`take_errors` returns (and clears) it.

Passes over the data: fp8 and MX quantize in one kernel (a group of lanes per block takes the
block's max, then codes it from cache; MX packs its codes with warp shuffles), every decode in one
kernel (unpack, scale, accumulate); QSGD reads ``x`` twice (bucket norms, then codes and
packing: the norm must be known first), TernGrad's scale is ``block_absmax(...).amax()``, and
signsgd with error feedback is one kernel (a warp per chunk, for chunks of whole bytes up to
8192) or else three (``c = x + beta*r`` and its sign bits; the chunk scales; the residual).

Without CuPy, without a CUDA device, or with an NVRTC that cannot compile (missing, or built
for another CUDA major version) this module imports fine and registers nothing, so
:mod:`commpress.ops` uses the torch reference on CUDA tensors.  Ops not covered here (bitmaps,
hash partition, magnitude keys) run as the reference on the device.  Every way to the reference
on a CUDA tensor is logged once (``logging.getLogger("commpress")``): the backend not registered,
an op without a kernel, arguments no kernel covers (:func:`_fallback`), or NVRTC failing on
these sources at the first launch (:class:`KernelsUnavailable`: every op then falls back);
:func:`commpress.ops.backends_used` names the backend each op last ran on.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.resources
import logging
import os
import threading
import warnings
from pathlib import Path

import numpy as np
import torch

from . import _usage
from . import reference as ref
from ._args import codes_u8, threshold_key_range, valid_bits, valid_block

log = logging.getLogger("commpress")

try:  # CuPy is optional (extra "cuda")
    import cupy as cp
except Exception as exc:  # ImportError, or a CuPy build that does not match the driver
    cp = None
    log.debug("cupy unavailable, cuda backend not registered: %r", exc)

SOURCES = ("commpress_ops.cu",)
#: Elements per warp in the selection kernels (a multiple of 128).
SEG = 4096
#: (shift, bits) of the three radix-select passes over the 31-bit magnitude key.
RADIX_PASSES = ((20, 11), (10, 10), (0, 10))
_RADIX_BINS = 2048
#: Largest chunk (32 groups of 256) of the one-pass sign_pack_feedback kernel.
FUSED_CHUNK_MAX = 8192
_MAX_KEY = 0x7FFFFFFF
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_i32, _i64, _u32, _u64 = np.int32, np.int64, np.uint32, np.uint64


def read_source(name: str) -> str:
    """The text of a CUDA source: package data first, then the repository's ``kernels/``."""
    try:
        return importlib.resources.files("commpress.kernels").joinpath(name).read_text()
    except (ModuleNotFoundError, FileNotFoundError, OSError):
        return (Path(__file__).resolve().parents[2] / "kernels" / name).read_text()


# ---------------------------------------------------------------- launchers
class CupyLauncher:
    """Launches on CUDA tensors through CuPy (NVRTC), on torch's current stream.

    Compiled modules, kernels and stream wrappers are shared by all instances (one compile per
    device per process); an instance only sets the block size and the grid cap.
    """

    threads = 256
    #: Reading a device value stalls the host (a synchronization): errors are recorded instead.
    reads_are_free = False
    _modules: dict[int, object] = {}
    _kernels: dict[tuple[int, str], object] = {}
    _streams: dict[tuple[int, int], object] = {}  # (device, torch stream) -> cupy ExternalStream
    _lock = threading.Lock()

    def __init__(self, max_grid: int = 65535):
        self.max_grid = max_grid

    def owns(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def _kernel(self, index: int, name: str):
        """The ``cupy.cuda.Function`` of ``name`` on device ``index`` (call inside its Device)."""
        fn = self._kernels.get((index, name))
        if fn is None:
            with self._lock:
                mod = self._modules.get(index)
                if mod is None:
                    src = "\n".join(read_source(s) for s in SOURCES)
                    try:
                        mod = cp.cuda.function.Module()
                        mod.load(compile_image(src, torch.cuda.get_device_capability(index)))
                    except KernelsUnavailable:
                        raise
                    except Exception as exc:  # a driver too old for the image, no CUDA context
                        raise KernelsUnavailable(f"cannot load the kernels of {SOURCES}: {exc!r}") from exc
                    self._modules[index] = mod
                fn = self._kernels[(index, name)] = mod.get_function(name)
        return fn

    def launch(self, device: torch.device, name: str, grid: int, args: tuple, threads: int) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        raw = tuple(None if a is None else _u64(a.data_ptr()) if isinstance(a, torch.Tensor) else a
                    for a in args)
        stream_ptr = torch.cuda.current_stream(index).cuda_stream
        stream = self._streams.get((index, stream_ptr))
        if stream is None:
            with warnings.catch_warnings():  # CuPy 14 deprecates it (once per stream here)
                warnings.simplefilter("ignore", DeprecationWarning)
                stream = cp.cuda.ExternalStream(stream_ptr, index)
            self._streams[(index, stream_ptr)] = stream
        with cp.cuda.Device(index):
            self._kernel(index, name)((grid,), (threads,), raw, 0, stream)


#: NVRTC options of kernels/*.cu (kernels/nvrtc_check.py compiles with these too).  Subnormals are
#: kept and no multiply-add is contracted, as the bitwise parity with the reference needs.  CuPy's
#: own compile (``cupy.RawModule``) appends ``-ftz=true``, which flushes subnormals to zero (the
#: first GPU run: 9 parity tests failed on subnormal inputs), so the backend compiles with NVRTC
#: itself (:func:`compile_image`) and loads the image with ``cupy.cuda.function.Module``.
NVRTC_OPTIONS = ("--std=c++14", "--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--fmad=false")


def compile_image(source: str, capability: tuple[int, int]) -> bytes:
    """The kernels of ``source`` for a device of compute ``capability``, with :data:`NVRTC_OPTIONS`:
    a CUBIN for ``sm_XY``, or, where this NVRTC does not know that architecture, PTX for the
    newest one it knows (the driver compiles it at load).  :class:`KernelsUnavailable` on failure."""
    nvrtc = cp.cuda.nvrtc
    cc = capability[0] * 10 + capability[1]
    tries = [(f"--gpu-architecture=sm_{cc}", nvrtc.getCUBIN)]
    tries += [(f"--gpu-architecture=compute_{a}", nvrtc.getPTX) for a in (90, 80) if a < cc]
    errors = []
    for arch, image in tries:
        prog = nvrtc.createProgram(source, "commpress_ops.cu", [], [])
        try:
            try:
                nvrtc.compileProgram(prog, [*NVRTC_OPTIONS, arch])
            except Exception as exc:  # NVRTCError: the log says why
                errors.append(f"{arch}: {exc!r}: {_program_log(nvrtc, prog)}")
                continue
            return image(prog)
        finally:
            nvrtc.destroyProgram(prog)
    raise KernelsUnavailable(f"NVRTC could not compile {SOURCES}: " + "; ".join(errors))


def _program_log(nvrtc, prog) -> str:
    try:
        log_text = nvrtc.getProgramLog(prog)
    except Exception as exc:  # no log to read
        return repr(exc)
    return (log_text.decode(errors="replace") if isinstance(log_text, bytes) else str(log_text)).strip()


_SCALARS = {"i32": np.int32, "i64": np.int64, "u32": np.uint32, "u64": np.uint64,
            "f32": np.float32, "f64": np.float64}
_CTYPES = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "u32": ctypes.c_uint32, "u64": ctypes.c_uint64,
           "f32": ctypes.c_float, "f64": ctypes.c_double}
_SIZES = {"i32": 4, "i64": 8, "u32": 4, "u64": 8, "f32": 4, "f64": 8, "u8": 1}


class HostLauncher:
    """Launches the host build of the kernels (``kernels/host/build.py``) on CPU tensors.

    ``threads`` per block (a multiple of 32; each is a fiber of the launching thread) and
    ``max_grid`` are small so that tests cover multi-warp blocks and grid-stride loops on small
    inputs.  With ``reads_are_free = False`` it behaves like the GPU for error reporting (tests of
    the no-sync path).
    """

    reads_are_free = True

    def __init__(self, library, threads: int = 64, max_grid: int = 4):
        self.threads, self.max_grid = threads, max_grid
        self.lib = ctypes.CDLL(str(library))
        self.lib.cuhost_launch.argtypes = [ctypes.c_char_p, ctypes.c_longlong, ctypes.c_int,
                                           ctypes.POINTER(ctypes.c_void_p)]
        self.lib.cuhost_launch.restype = ctypes.c_int
        self.lib.cuhost_signature.argtypes = [ctypes.c_char_p]
        self.lib.cuhost_signature.restype = ctypes.c_char_p
        self.launches: list[str] = []  # kernel names, in launch order (for tests)

    def owns(self, device: torch.device) -> bool:
        return device.type == "cpu"

    def launch(self, device: torch.device, name: str, grid: int, args: tuple, threads: int) -> None:
        sig = self.lib.cuhost_signature(name.encode())
        if sig is None:
            raise LookupError(f"no kernel named {name!r}")
        types = sig.decode().split(",") if sig else []
        if len(types) != len(args):
            raise TypeError(f"{name}: {len(args)} arguments for parameters {types}")
        keep = [_host_arg(name, i, t, a, device) for i, (t, a) in enumerate(zip(types, args))]
        argv = (ctypes.c_void_p * max(1, len(keep)))(*[ctypes.cast(ctypes.pointer(k), ctypes.c_void_p)
                                                        for k in keep])
        self.launches.append(name)
        rc = self.lib.cuhost_launch(name.encode(), grid, threads, argv)
        if rc:
            why = {-3: ": deadlock, threads wait at a barrier that some of them never reach"}.get(rc, "")
            raise RuntimeError(f"cuhost_launch({name!r}, grid={grid}, threads={threads}) returned {rc}{why}")


def _host_arg(name: str, i: int, ctype: str, a, device: torch.device):
    """A ctypes value for parameter ``i`` of type ``ctype``, checked like the GPU would need."""
    if ctype.endswith("*"):
        if a is None:
            return ctypes.c_void_p(None)
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"{name} arg {i}: {ctype} needs a tensor, got {type(a).__name__}")
        elem = _SIZES[ctype.replace("const ", "").rstrip("*")]
        if a.element_size() != elem or not a.is_contiguous() or a.device != device:
            raise TypeError(f"{name} arg {i}: {ctype} got {a.dtype} contiguous={a.is_contiguous()} "
                            f"on {a.device} (launch on {device})")
        return ctypes.c_void_p(a.data_ptr())
    want = _SCALARS[ctype]
    if type(a) is not want:
        raise TypeError(f"{name} arg {i}: {ctype} needs numpy.{want.__name__}, got {type(a).__name__}")
    return _CTYPES[ctype](a.item())


_launcher = CupyLauncher() if cp is not None else None


@contextlib.contextmanager
def use(launcher):
    """Run this module's ops with ``launcher`` (tests: a :class:`HostLauncher` on CPU tensors)."""
    global _launcher
    old, _launcher = _launcher, launcher
    try:
        yield launcher
    finally:
        _launcher = old


def _mine(*tensors) -> bool:
    """The launcher runs these tensors: all on one device it owns (else the reference decides)."""
    devices = {t.device for t in tensors if t is not None}
    return _launcher is not None and len(devices) == 1 and _launcher.owns(next(iter(devices)))


def _launch(device: torch.device, name: str, work: int, *args, threads: int | None = None) -> None:
    """Run ``name`` with enough blocks for ``work`` threads (at most the launcher's max grid)."""
    threads = threads or _launcher.threads
    grid = max(1, min(-(-int(work) // threads), _launcher.max_grid))
    _launcher.launch(device, name, grid, args, threads)


def _fallback(op: str, *args, reason: str | None = None, **kwargs):
    """Run the torch reference of ``op`` (no kernel covers these arguments), recorded and logged
    once per op and reason (:mod:`commpress.ops._usage`)."""
    if reason is None:
        tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        devices = sorted({str(a) for a in args if isinstance(a, torch.device)}
                         | {str(t.device) for t in tensors})
        reason = (f"arguments outside the kernels' range: devices {devices}, "
                  f"dtypes {sorted({str(t.dtype) for t in tensors})}")
    _usage.fallback(op, "cuda", reason)
    return getattr(ref, op)(*args, **kwargs)


class KernelsUnavailable(RuntimeError):
    """NVRTC could not compile kernels/*.cu at the first launch (the ops fall back to the reference)."""


_compile_failure: str | None = None


def _guarded(name: str, fn):
    """``fn``, falling back to the reference (logged) once NVRTC failed to compile the kernels."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        global _compile_failure
        if _compile_failure is None:
            try:
                return fn(*args, **kwargs)
            except KernelsUnavailable as exc:
                _compile_failure = str(exc)
                log.error("cuda backend: %s; every op now runs the torch reference on CUDA tensors",
                          _compile_failure)
        return _fallback(name, *args, reason=f"NVRTC failed: {_compile_failure}", **kwargs)

    return call


# ---------------------------------------------------------------- errors without host reads
_errors: dict[torch.device, torch.Tensor] = {}


def _report(flag: torch.Tensor, error: Exception) -> None:
    """Raise ``error`` if ``flag`` is set where that costs no synchronization, else record it."""
    if _launcher.reads_are_free or os.environ.get("COMMPRESS_CUDA_CHECK") == "1":
        if int(flag.item()):
            raise error
        return
    sticky = _errors.get(flag.device)
    if sticky is None:
        sticky = _errors[flag.device] = torch.zeros(1, dtype=torch.int32, device=flag.device)
    sticky.bitwise_or_(flag)


def take_errors(device) -> int:
    """Nonzero when an op on ``device`` refused bad input since the last call (reads the device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    sticky = _errors.get(device)
    if sticky is None:
        return 0
    value = int(sticky.item())
    sticky.zero_()
    return value


# ---------------------------------------------------------------- selection
def _flat_f32(x: torch.Tensor) -> torch.Tensor:
    flat = x.detach().reshape(-1)
    return (flat if flat.dtype == torch.float32 else flat.float()).contiguous()


def _fused_residual(flat: torch.Tensor, residual: torch.Tensor | None):
    """(mode, residual as int32) when the kernels can write the residual: 1 in place, 2 separate."""
    if residual is None:
        return None
    if (flat.dtype != torch.float32 or residual.dtype != torch.float32
            or residual.device != flat.device or not residual.is_contiguous()
            or residual.numel() != flat.numel() or residual.requires_grad):
        return None
    r = residual.view(-1)
    return (1 if r.data_ptr() == flat.data_ptr() else 2), r.view(torch.int32)


def _select(xi: torch.Tensor, sel: torch.Tensor | None, lo: int, hi: int, count: int | None, fused):
    """(indices, value bits) of the entries selected (see the kernels), in index order: by the
    device selection ``sel`` (top-k), or when ``sel`` is None by ``lo < key <= hi`` (threshold).

    ``count`` is the number selected when the caller knows it (top-k: exactly k); ``None``
    reads it from the device (threshold: the one host synchronization of this module).
    """
    n = xi.numel()
    dev = xi.device
    nseg = -(-n // SEG)
    mode, res = fused if fused is not None else (0, None)
    counts = torch.empty(2 * nseg, dtype=torch.int64, device=dev)
    if nseg:
        _launch(dev, "sel_count", nseg * 32, xi, _i64(n), _i64(SEG), sel, _i64(lo), _i64(hi), counts)
    rows = counts.view(2, nseg)
    incl = torch.cumsum(rows, 1)
    if count is None:
        count = int(rows[0].sum()) if nseg else 0
    idx_dtype = ref.index_dtype(n)
    idx = torch.empty(count, dtype=idx_dtype, device=dev)
    val = torch.empty(count, dtype=torch.int32, device=dev)
    if nseg and (count or mode == 2):
        name = "sel_write_i32" if idx_dtype == torch.int32 else "sel_write_i64"
        _launch(dev, name, nseg * 32, xi, _i64(n), _i64(SEG), sel, _i64(lo), _i64(hi), counts, incl, idx,
                val, res, _i32(mode))
    return idx, val


def _finish(x, flat, idx, val, residual, fused):
    values = val.view(torch.float32) if x.dtype == torch.float32 else flat[idx.to(torch.int64)].clone()
    if residual is not None and fused is None:
        r = residual.view(-1)
        if r.data_ptr() != flat.data_ptr():
            r.copy_(flat)
        r[idx.to(torch.int64)] = 0
    return idx, values


def threshold_compact(x: torch.Tensor, threshold: float, residual: torch.Tensor | None = None):
    """See :func:`commpress.ops.reference.threshold_compact` (one host read: the output size)."""
    if not _mine(x, residual) or x.dtype not in _FLOATS:
        return _fallback("threshold_compact", x, threshold, residual)
    flat = x.reshape(-1)
    xf = _flat_f32(flat)
    lo, hi = threshold_key_range(threshold)
    fused = _fused_residual(flat, residual)
    idx, val = _select(xf.view(torch.int32), None, lo - 1, hi, None, fused)
    return _finish(x, flat, idx, val, residual, fused)


def radix_select_state(xi: torch.Tensor, k: int) -> torch.Tensor:
    """Device int64[6] ``{T, need, T, max, T, need}``: the k-th largest key T of ``xi`` and how
    many entries equal to T the top-k takes (``1 <= k <= n``; no host read; 7 launches)."""
    dev = xi.device
    n = xi.numel()
    buf = torch.zeros(6 + len(RADIX_PASSES) * _RADIX_BINS, dtype=torch.int64, device=dev)
    state = buf[:6]
    for p, (shift, bits) in enumerate(RADIX_PASSES):
        h = buf[6 + p * _RADIX_BINS:6 + (p + 1) * _RADIX_BINS]
        first, last = _i32(p == 0), _i32(p == len(RADIX_PASSES) - 1)
        _launch(dev, "radix_hist", -(-n // 16), xi, _i64(n), state, first, _i32(shift), _i32(bits), h)
        _launch(dev, "radix_pick", 32, h, _i32(bits), first, last, _i64(k), state, threads=32)
    return state


def topk_compact(x: torch.Tensor, k: int, residual: torch.Tensor | None = None):
    """See :func:`commpress.ops.reference.topk_compact` (no host synchronization).

    A radix select over the magnitude keys (three passes of histogram + pick, on the device)
    finds the k-th largest key T and how many ties at T to keep; one count pass and one
    compaction pass then write exactly ``k`` entries in index order, and the residual with them.
    """
    if not _mine(x, residual) or x.dtype not in _FLOATS:
        return _fallback("topk_compact", x, k, residual)
    flat = x.reshape(-1)
    n = flat.numel()
    k = max(0, min(int(k), n))
    if k == 0:
        idx = torch.empty(0, dtype=ref.index_dtype(n), device=x.device)
        return _finish(x, flat, idx, torch.empty(0, dtype=torch.int32, device=x.device), residual, None)
    xi = _flat_f32(flat).view(torch.int32)
    fused = _fused_residual(flat, residual)
    state = radix_select_state(xi, k)
    idx, val = _select(xi, state[2:], 0, 0, k, fused)
    return _finish(x, flat, idx, val, residual, fused)


# ---------------------------------------------------------------- scatter-add, random, hash
def scatter_add_(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """See :func:`commpress.ops.reference.scatter_add_` (unique indices: bitwise equal).

    Each add is an IEEE add committed by compare-and-swap: subnormals are kept, and duplicate
    indices lose no update (they add in an unspecified order).  Indices are checked on the device
    before anything is written; with a bad one ``out`` is left untouched and the error is raised
    or recorded (module doc).  No host synchronization.
    """
    if (not _mine(out, indices, values) or out.dtype not in (torch.float32, torch.float64)
            or out.dim() != 1 or not out.is_contiguous() or indices.dim() != 1
            or indices.numel() != values.numel() or indices.is_floating_point() or out.requires_grad):
        return _fallback("scatter_add_", out, indices, values)
    idx = indices.to(torch.int64).contiguous()
    val = values.detach().reshape(-1).to(out.dtype).contiguous()
    m = idx.numel()
    if m:
        bad = torch.zeros(1, dtype=torch.int32, device=out.device)
        _launch(out.device, "scatter_check", m, idx, _i64(m), _i64(out.numel()), bad)
        name = "scatter_add_f32" if out.dtype == torch.float32 else "scatter_add_f64"
        _launch(out.device, name, m, out, idx, val, _i64(m), bad)
        _report(bad, IndexError(f"scatter_add_: an index is out of range for out of size {out.numel()}"))
    return out


def counter_bits(seed: int, start: int, n: int, device="cpu") -> torch.Tensor:
    """See :func:`commpress.ops.reference.counter_bits`."""
    device = torch.device(device)
    if _launcher is None or not _launcher.owns(device):
        return _fallback("counter_bits", seed, start, n, device)
    k0, k1 = ref.seed_words(seed)
    out = torch.empty(int(n), dtype=torch.int64, device=device)
    if n:
        _launch(device, "counter_bits_kernel", int(n), out, _u32(int(start) & ref.MASK32), _u32(k0),
                _u32(k1), _i64(n))
    return out


def counter_uniform(seed: int, start: int, n: int, device="cpu") -> torch.Tensor:
    """See :func:`commpress.ops.reference.counter_uniform`."""
    device = torch.device(device)
    if _launcher is None or not _launcher.owns(device):
        return _fallback("counter_uniform", seed, start, n, device)
    k0, k1 = ref.seed_words(seed)
    out = torch.empty(int(n), dtype=torch.float32, device=device)
    if n:
        _launch(device, "counter_uniform_kernel", int(n), out, _u32(int(start) & ref.MASK32),
                _u32(k0), _u32(k1), _i64(n))
    return out


def hash_owner(indices: torch.Tensor, world_size: int) -> torch.Tensor:
    """See :func:`commpress.ops.reference.hash_owner` (``world_size`` up to 2**64 - 1)."""
    if (not _mine(indices) or indices.is_floating_point()
            or not 1 <= int(world_size) <= 0xFFFFFFFFFFFFFFFF):
        return _fallback("hash_owner", indices, world_size)
    idx = indices.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty_like(idx)
    if idx.numel():
        _launch(idx.device, "hash_owner_kernel", idx.numel(), idx, out, _u64(int(world_size)),
                _i64(idx.numel()))
    return out.reshape(indices.shape)


# ---------------------------------------------------------------- bit packing, quantization
def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """See :func:`commpress.ops.reference.pack_bits`."""
    if not _mine(codes) or not valid_bits(bits) or codes.is_complex():
        return _fallback("pack_bits", codes, bits)
    bits = int(bits)
    c = codes_u8(codes, bits)
    n = c.numel()
    nbytes = (n * bits + 7) // 8
    packed = torch.empty(nbytes, dtype=torch.uint8, device=c.device)
    if n:
        _launch(c.device, "pack_bits_kernel", -(-n // 8), c, packed, _i32(bits), _i64(n), _i64(nbytes))
    return packed


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """See :func:`commpress.ops.reference.unpack_bits`."""
    numel = int(numel)
    if (not _mine(packed) or not valid_bits(bits) or packed.dtype != torch.uint8 or numel < 0
            or packed.numel() < (numel * int(bits) + 7) // 8):
        return _fallback("unpack_bits", packed, bits, numel)
    p = packed.reshape(-1).contiguous()
    codes = torch.empty(numel, dtype=torch.uint8, device=p.device)
    if numel:
        _launch(p.device, "unpack_bits_kernel", -(-numel // 8), p, codes, _i32(int(bits)), _i64(numel),
                _i64(p.numel()))
    return codes


def _absmax(xf: torch.Tensor, block: int, qmax: int = 0, want_inv: bool = False):
    """(scales, qmax/scales or None) per block of ``xf`` (fp32, contiguous)."""
    n = xf.numel()
    nblocks = -(-n // block)
    scales = torch.empty(nblocks, dtype=torch.float32, device=xf.device)
    inv = torch.empty(nblocks, dtype=torch.float32, device=xf.device) if want_inv else None
    if nblocks:
        width = 32 if block >= 32 else 1 << (block - 1).bit_length()  # lanes per block
        _launch(xf.device, "block_absmax_kernel", -(-nblocks // (32 // width)) * 32,
                xf.view(torch.int32), scales, inv, _i32(qmax), _i64(n), _i64(block), _i64(nblocks),
                _i32(width))
    return scales, inv


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """See :func:`commpress.ops.reference.block_absmax`."""
    if not _mine(x) or x.dtype not in _FLOATS or not valid_block(block):
        return _fallback("block_absmax", x, block)
    return _absmax(_flat_f32(x), int(block))[0]


def block_quantize(x: torch.Tensor, bits: int, block: int, stochastic: bool = False, seed: int = 0):
    """See :func:`commpress.ops.reference.block_quantize` (absmax + quantize-and-pack: 2 passes)."""
    if not _mine(x) or x.dtype not in _FLOATS or not valid_bits(bits) or not valid_block(block):
        return _fallback("block_quantize", x, bits, block, stochastic, seed)
    bits, block = int(bits), int(block)
    xf = _flat_f32(x)
    n = xf.numel()
    scales, inv = _absmax(xf, block, ref.qmax_for(bits), want_inv=True)
    nbytes = (n * bits + 7) // 8
    packed = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    k0, k1 = ref.seed_words(seed)
    if n:
        _launch(x.device, "block_quantize_kernel", -(-n // 8), xf, inv, packed, _i32(bits), _i64(block),
                _i64(n), _i64(nbytes), _i32(1 if stochastic else 0), _u32(k0), _u32(k1))
    return packed, scales


def _out_ok(out: torch.Tensor | None, numel: int) -> bool:
    return out is None or (out.dtype == torch.float32 and out.dim() == 1 and out.numel() == numel
                           and out.is_contiguous() and not out.requires_grad)


def block_dequantize(packed: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int,
                     out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """See :func:`commpress.ops.reference.block_dequantize` (unpack + scale + accumulate fused)."""
    numel = int(numel)
    if (not _mine(packed, scales, out) or not valid_bits(bits) or not valid_block(block)
            or packed.dtype != torch.uint8 or numel < 0
            or packed.numel() < (numel * int(bits) + 7) // 8
            or scales.numel() < -(-numel // int(block)) or not _out_ok(out, numel)):
        return _fallback("block_dequantize", packed, scales, bits, block, numel, out, accumulate)
    p = packed.reshape(-1).contiguous()
    s = scales.reshape(-1).float().contiguous()
    dst = out if out is not None else torch.empty(numel, dtype=torch.float32, device=p.device)
    if numel:
        _launch(p.device, "block_dequantize_kernel", -(-numel // 8), p, s, dst, _i32(int(bits)),
                _i64(int(block)), _i64(numel), _i64(p.numel()),
                _i32(1 if (accumulate and out is not None) else 0))
    return dst


def block_dequantize_sum(packed, scales, bits: int, block: int, numel: int,
                         out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """See :func:`commpress.ops.reference.block_dequantize_sum`: one :func:`block_dequantize`
    launch per payload, accumulating after the first (the reference's order)."""
    if (not isinstance(packed, (list, tuple)) or not isinstance(scales, (list, tuple))
            or len(packed) != len(scales) or not packed):
        return ref.block_dequantize_sum(packed, scales, bits, block, numel, out, accumulate)
    dst = block_dequantize(packed[0], scales[0], bits, block, numel, out, accumulate)
    for p, s in zip(packed[1:], scales[1:]):
        dst = block_dequantize(p, s, bits, block, numel, dst, True)
    return dst


def sign_pack(x: torch.Tensor, chunk: int):
    """See :func:`commpress.ops.reference.sign_pack` (scales: pairwise tree in groups of 256)."""
    if not _mine(x) or x.dtype not in _FLOATS or not valid_block(chunk):
        return _fallback("sign_pack", x, chunk)
    chunk = int(chunk)
    xf = _flat_f32(x)
    n = xf.numel()
    nbytes = (n + 7) // 8
    nchunks = -(-n // chunk)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    scales = torch.empty(nchunks, dtype=torch.float32, device=x.device)
    if n:
        _launch(x.device, "sign_bits_kernel", nbytes, xf, packed, _i64(n), _i64(nbytes))
        _tree(xf, chunk, 1, 1, scales)
        _sign_rescue(xf, chunk, scales)
    return packed, scales


def _sign_rescue(xf: torch.Tensor, chunk: int, scales: torch.Tensor) -> None:
    """The rescue of :func:`commpress.ops.reference.sign_pack` for the chunks whose scale came out
    +inf (a warp per chunk; the others return at once): no host read decides it."""
    _launch(xf.device, "sign_rescue_kernel", scales.numel() * 32, xf, scales, _i64(xf.numel()), _i64(chunk),
            _i64(scales.numel()))


def sign_unpack(bits: torch.Tensor, scales: torch.Tensor, chunk: int, numel: int,
                out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """See :func:`commpress.ops.reference.sign_unpack`."""
    numel = int(numel)
    if (not _mine(bits, scales, out) or not valid_block(chunk) or bits.dtype != torch.uint8
            or numel < 0 or bits.numel() < (numel + 7) // 8
            or scales.numel() < -(-numel // int(chunk)) or not _out_ok(out, numel)):
        return _fallback("sign_unpack", bits, scales, chunk, numel, out, accumulate)
    b = bits.reshape(-1).contiguous()
    s = scales.reshape(-1).float().contiguous()
    dst = out if out is not None else torch.empty(numel, dtype=torch.float32, device=b.device)
    if numel:
        _launch(b.device, "sign_unpack_kernel", numel, b, s, dst, _i64(int(chunk)), _i64(numel),
                _i32(1 if (accumulate and out is not None) else 0))
    return dst


# ---------------------------------------------------------------- minifloats: fp8 and MX
def _minifloat_args(fmt: str) -> tuple:
    """Kernel scalars ``(mbits, emin, sign bit, bits of max)`` of a minifloat format."""
    e_bits, m_bits, fmax, emin = ref.minifloat_params(fmt)
    key = int(np.array([fmax], np.float32).view(np.int32)[0])
    return _i32(m_bits), _i32(emin), _i32(1 << (e_bits + m_bits)), _i32(key)


_tables: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(kind: str, device: torch.device) -> torch.Tensor:
    """The reference's decoding table ``kind`` (a minifloat format or ``"e8m0"``) on ``device``,
    made once per device (steady state: no copy)."""
    t = _tables.get((kind, device))
    if t is None:
        t = ref.e8m0_table() if kind == "e8m0" else ref.minifloat_table(kind)
        t = _tables[(kind, device)] = t.to(device).contiguous()
    return t


def fp8_quantize(x: torch.Tensor, fmt: str, block: int, stochastic: bool = False, seed: int = 0):
    """See :func:`commpress.ops.reference.fp8_quantize` (one kernel: block max, then codes)."""
    if not _mine(x) or x.dtype not in _FLOATS or not valid_block(block) or fmt not in ("e4m3", "e5m2"):
        return _fallback("fp8_quantize", x, fmt, block, stochastic, seed)
    block = int(block)
    xf = _flat_f32(x)
    n = xf.numel()
    nblocks = -(-n // block)
    codes = torch.empty(n, dtype=torch.uint8, device=x.device)
    scales = torch.empty(nblocks, dtype=torch.float32, device=x.device)
    k0, k1 = ref.seed_words(seed)
    if n:
        width = 32 if block >= 32 else 1 << (block - 1).bit_length()
        _launch(x.device, "fp8_quantize_kernel", -(-nblocks // (32 // width)) * 32, xf, codes, scales,
                _i64(n), _i64(block), _i64(nblocks), _i32(width), *_minifloat_args(fmt),
                _i32(1 if stochastic else 0), _u32(k0), _u32(k1))
    return codes, scales


def _dequantize_table(packed, table, scales, scale_bytes, scale_table, out, bits, block, numel,
                      accumulate) -> torch.Tensor:
    p = packed.reshape(-1).contiguous()
    dst = out if out is not None else torch.empty(numel, dtype=torch.float32, device=p.device)
    if numel:
        _launch(p.device, "table_dequantize_kernel", -(-numel // 8), p, table, scales, scale_bytes,
                scale_table, dst, _i32(bits), _i64(block), _i64(numel), _i64(p.numel()),
                _i32(1 if (accumulate and out is not None) else 0))
    return dst


def fp8_dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: str, block: int, numel: int,
                   out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """See :func:`commpress.ops.reference.fp8_dequantize` (decode, scale, accumulate: one kernel)."""
    numel = int(numel)
    if (not _mine(codes, scales, out) or not valid_block(block) or fmt not in ("e4m3", "e5m2")
            or codes.element_size() != 1 or codes.is_complex() or numel < 0 or codes.numel() < numel
            or scales.numel() < -(-numel // int(block)) or not _out_ok(out, numel)):
        return _fallback("fp8_dequantize", codes, scales, fmt, block, numel, out, accumulate)
    c = codes.reshape(-1)
    c = c if c.dtype == torch.uint8 else c.view(torch.uint8)
    s = scales.reshape(-1).float().contiguous()
    return _dequantize_table(c, _table(fmt, c.device), s, None, None, out, 8, int(block), numel, accumulate)


def mx_quantize(x: torch.Tensor, element: str, stochastic: bool = False, seed: int = 0):
    """See :func:`commpress.ops.reference.mx_quantize` (one pass: a warp per block of 32)."""
    if not _mine(x) or x.dtype not in _FLOATS or element not in ref.MX_ELEMENTS:
        return _fallback("mx_quantize", x, element, stochastic, seed)
    fmt, bits, emax = ref.MX_ELEMENTS[element]
    xf = _flat_f32(x)
    n = xf.numel()
    nbytes = (n * bits + 7) // 8
    packed = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    scale_bytes = torch.empty(-(-n // ref.MX_BLOCK), dtype=torch.uint8, device=x.device)
    k0, k1 = ref.seed_words(seed)
    if n:
        _launch(x.device, "mx_quantize_kernel", scale_bytes.numel() * 32, xf, packed, scale_bytes, _i64(n),
                _i64(nbytes), _i32(bits), _i32(emax), *_minifloat_args(fmt), _i32(1 if stochastic else 0),
                _u32(k0), _u32(k1))
    return packed, scale_bytes


def mx_dequantize(packed: torch.Tensor, scales: torch.Tensor, element: str, numel: int,
                  out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """See :func:`commpress.ops.reference.mx_dequantize` (unpack, scale, accumulate: one kernel)."""
    numel = int(numel)
    if (not _mine(packed, scales, out) or element not in ref.MX_ELEMENTS or packed.dtype != torch.uint8
            or scales.dtype != torch.uint8 or numel < 0
            or packed.numel() < (numel * ref.MX_ELEMENTS[element][1] + 7) // 8
            or scales.numel() < -(-numel // ref.MX_BLOCK) or not _out_ok(out, numel)):
        return _fallback("mx_dequantize", packed, scales, element, numel, out, accumulate)
    fmt, bits, _ = ref.MX_ELEMENTS[element]
    dev = packed.device
    return _dequantize_table(packed, _table(fmt, dev), None, scales.reshape(-1).contiguous(),
                             _table("e8m0", dev), out, bits, ref.MX_BLOCK, numel, accumulate)


# ---------------------------------------------------------------- QSGD / TernGrad levels
def _valid_levels(levels) -> bool:
    return isinstance(levels, (int, np.integer)) and 1 <= int(levels) <= 127


def _tree(xf: torch.Tensor, chunk: int, leaf: int, finalize: int, out: torch.Tensor) -> None:
    """``out[c]`` = the reference's pairwise tree over chunk ``c`` of ``xf`` (leaves y, |y| or y*y:
    ``leaf`` 0, 1, 2), then its mean (``finalize`` 1) or fp64 square root (2: -1 where the sum of
    squares is outside ``[NORM_TINY, inf)``, for norm_rescue_kernel).  One launch of
    tree256_kernel per factor of 256 in the chunk (module doc of the kernel)."""
    n = xf.numel()
    nchunks = out.numel()
    src, size, seg = xf, n, chunk
    while True:
        groups = -(-seg // 256)
        final = groups == 1
        dst = out if final else torch.empty(nchunks * groups, dtype=torch.float32, device=xf.device)
        _launch(xf.device, "tree256_kernel", nchunks * groups * 32, src, dst, _i64(size), _i64(seg),
                _i64(nchunks), _i32(leaf), _i32(finalize if final else 0), _i64(chunk), _i64(n))
        if final:
            return
        src, size, seg, leaf = dst, nchunks * groups, groups, 0


def bucket_norms(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """See :func:`commpress.ops.reference.bucket_norms` (pairwise tree in groups of 256; then one
    warp per bucket whose sum of squares overflowed or is tiny sums it again scaled: the others
    cost that kernel one read of their norm)."""
    if not _mine(x) or x.dtype not in _FLOATS or not valid_block(bucket):
        return _fallback("bucket_norms", x, bucket)
    xf = _flat_f32(x)
    n = xf.numel()
    b = max(1, min(int(bucket), n))
    norms = torch.empty(-(-n // b), dtype=torch.float32, device=x.device)
    if n:
        _tree(xf, b, 2, 2, norms)
        _launch(x.device, "norm_rescue_kernel", norms.numel() * 32, xf, norms, _i64(n), _i64(b),
                _i64(norms.numel()))
    return norms


def level_quantize(x: torch.Tensor, scales: torch.Tensor, bucket: int, levels: int, seed: int):
    """See :func:`commpress.ops.reference.level_quantize` (codes and packing in one kernel)."""
    n = x.numel()
    b = max(1, min(int(bucket), n)) if valid_block(bucket) else 0
    if (not _mine(x, scales) or x.dtype not in _FLOATS or not b or not _valid_levels(levels)
            or scales.numel() < -(-n // b) or scales.is_complex()):
        return _fallback("level_quantize", x, scales, bucket, levels, seed)
    bits = ref.level_bits(int(levels))
    xf = _flat_f32(x)
    nbytes = (n * bits + 7) // 8
    packed = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    k0, k1 = ref.seed_words(seed)
    if n:
        s = scales.reshape(-1).float().contiguous()
        _launch(x.device, "level_quantize_kernel", -(-n // 8), xf, s, packed, _i32(bits), _i64(b),
                _i32(int(levels)), _i64(n), _i64(nbytes), _u32(k0), _u32(k1))
    return packed


def qsgd_quantize(x: torch.Tensor, levels: int, bucket: int, seed: int):
    """See :func:`commpress.ops.reference.qsgd_quantize`: the bucket norms (tree kernels: one
    read of ``x``), then codes and packing (a second read)."""
    if not _mine(x) or x.dtype not in _FLOATS or not valid_block(bucket) or not _valid_levels(levels):
        return _fallback("qsgd_quantize", x, levels, bucket, seed)
    norms = bucket_norms(x, bucket)
    return level_quantize(x, norms, bucket, levels, seed), norms


def level_dequantize(packed: torch.Tensor, scales: torch.Tensor, bucket: int, levels: int, numel: int,
                     out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """See :func:`commpress.ops.reference.level_dequantize` (unpack, scale, accumulate: one kernel)."""
    numel = int(numel)
    b = max(1, min(int(bucket), numel)) if valid_block(bucket) else 0
    if (not _mine(packed, scales, out) or not b or not _valid_levels(levels) or packed.dtype != torch.uint8
            or numel < 0 or packed.numel() < (numel * ref.level_bits(int(levels)) + 7) // 8
            or scales.numel() < -(-numel // b) or scales.is_complex() or not _out_ok(out, numel)):
        return _fallback("level_dequantize", packed, scales, bucket, levels, numel, out, accumulate)
    p = packed.reshape(-1).contiguous()
    s = scales.reshape(-1).float().contiguous()
    dst = out if out is not None else torch.empty(numel, dtype=torch.float32, device=p.device)
    if numel:
        _launch(p.device, "level_dequantize_kernel", -(-numel // 8), p, s, dst,
                _i32(ref.level_bits(int(levels))), _i64(b), _i32(int(levels)), _i64(numel), _i64(p.numel()),
                _i32(1 if (accumulate and out is not None) else 0))
    return dst


def sign_pack_feedback(x: torch.Tensor, residual: torch.Tensor, beta: float, chunk: int,
                       new_residual: torch.Tensor):
    """See :func:`commpress.ops.reference.sign_pack_feedback`.  Chunks of whole bytes up to
    :data:`FUSED_CHUNK_MAX`: one kernel, a warp per chunk (one pass over memory).  Otherwise ``c``
    and its sign bits (one kernel, ``c`` written to ``new_residual``), the chunk scales (tree
    kernels), then ``new_residual = c - (+-scale)`` (one kernel).  ``finite`` stays on the device."""
    n = x.numel()
    ok = (_mine(x, residual, new_residual) and x.dtype in _FLOATS and valid_block(chunk)
          and all(t.dtype == torch.float32 and t.is_contiguous() and t.numel() == n and not t.requires_grad
                  for t in (residual, new_residual)))
    if not ok:
        return _fallback("sign_pack_feedback", x, residual, beta, chunk, new_residual)
    chunk = int(chunk)
    xf = _flat_f32(x)
    r, c = residual.view(-1), new_residual.view(-1)
    nbytes = (n + 7) // 8
    packed = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    scales = torch.empty(-(-n // chunk), dtype=torch.float32, device=x.device)
    use_beta = _i32(float(beta) != 1.0)
    if n and chunk % 8 == 0 and chunk <= FUSED_CHUNK_MAX:
        _launch(x.device, "sign_feedback_fused_kernel", scales.numel() * 32, xf, r, np.float32(beta), use_beta,
                c, packed, scales, _i64(chunk), _i64(n))
    elif n:
        _launch(x.device, "feedback_sign_kernel", nbytes, xf, r, np.float32(beta), use_beta, c, packed,
                _i64(n), _i64(nbytes))
        _tree(c, chunk, 1, 1, scales)
        _sign_rescue(c, chunk, scales)
        _launch(x.device, "sign_residual_kernel", n, packed, scales, c, _i64(chunk), _i64(n))
    return packed, scales, torch.isfinite(scales).all()


OPS = {
    "threshold_compact": threshold_compact,
    "topk_compact": topk_compact,
    "scatter_add_": scatter_add_,
    "counter_bits": counter_bits,
    "counter_uniform": counter_uniform,
    "hash_owner": hash_owner,
    "pack_bits": pack_bits,
    "unpack_bits": unpack_bits,
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
    "sign_pack_feedback": sign_pack_feedback,
}
OPS = {name: _guarded(name, fn) for name, fn in OPS.items()}
globals().update(OPS)  # internal calls and ``cuda_backend.<op>`` are the guarded ops too


# ---------------------------------------------------------------- registration
def nvrtc_problem() -> str | None:
    """Why CuPy's NVRTC cannot compile (missing library, another CUDA major), or None.

    Compiles a one-line program for NVRTC's default virtual architecture: no GPU context is
    created, so every rank may call this at import.
    """
    try:
        nvrtc = cp.cuda.nvrtc
        nvrtc.getVersion()
        prog = nvrtc.createProgram('extern "C" __global__ void commpress_probe() {}', "probe.cu", [], [])
        try:
            nvrtc.compileProgram(prog, [])
        finally:
            nvrtc.destroyProgram(prog)
    except Exception as exc:  # ImportError, OSError (libnvrtc), CompileException, NVRTCError
        return repr(exc)
    return None


def available() -> bool:
    """CuPy imports, torch sees a CUDA device, and NVRTC compiles."""
    return cp is not None and torch.cuda.is_available() and nvrtc_problem() is None


def register() -> bool:
    """Register the backend when :func:`available`; otherwise log why and leave the reference."""
    import commpress.ops as ops

    if cp is None:
        ops.cuda_unavailable_reason = "CuPy is not installed (pip install commpress[cuda])"
        return False
    if not torch.cuda.is_available():
        ops.cuda_unavailable_reason = "torch sees no CUDA device"
        return False
    problem = nvrtc_problem()
    if problem is not None:
        ops.cuda_unavailable_reason = f"NVRTC cannot compile ({problem})"
        log.warning("cuda backend not registered, CUDA tensors use the torch reference: NVRTC "
                    "cannot compile (%s); install the nvidia-cuda-nvrtc matching CuPy's CUDA", problem)
        return False
    from . import register_backend

    register_backend("cuda", OPS)
    return True


register()
