"""The ``"cuda"`` backend: kernels from ``kernels/*.cu`` run through CuPy, bitwise equal to :mod:`.reference`.

The CUDA sources ship as package data of ``commpress.kernels`` (read with
:mod:`importlib.resources`, falling back to the repository's ``kernels/``) and
are compiled at first use per device with ``cupy.RawModule`` (NVRTC).  Kernels
run on torch's current stream (``cupy.cuda.ExternalStream``) and read and
write torch tensors zero-copy through DLPack; outputs are allocated by torch.

Without CuPy or without a CUDA device this module imports fine and registers
nothing, so :mod:`commpress.ops` uses the torch reference on CUDA tensors.
Ops not covered here (bitmaps, hash partition, magnitude keys) run as the
reference on the device.
"""

from __future__ import annotations

import importlib.resources
import logging
import math
from pathlib import Path

import numpy as np
import torch

from . import reference as ref
from ._args import codes_u8, threshold_key_range, valid_bits, valid_block

log = logging.getLogger("commpress")

try:  # CuPy is optional (extra "cuda")
    import cupy as cp
except Exception as exc:  # ImportError, or a CuPy build that does not match the driver
    cp = None
    log.debug("cupy unavailable, cuda backend not registered: %r", exc)

SOURCES = ("commpress_ops.cu",)
_THREADS = 256
_MAX_GRID = 65535
_MAX_KEY = 0x7FFFFFFF
#: Strided sample size used by top-k to estimate its candidate threshold.
TOPK_SAMPLE = 1 << 16

_modules: dict[int, object] = {}


def read_source(name: str) -> str:
    """The text of a CUDA source: package data first, then the repository's ``kernels/``."""
    try:
        return importlib.resources.files("commpress.kernels").joinpath(name).read_text()
    except (ModuleNotFoundError, FileNotFoundError, OSError):
        return (Path(__file__).resolve().parents[2] / "kernels" / name).read_text()


def _module(device: torch.device):
    """The compiled RawModule for ``device`` (compiled once per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    mod = _modules.get(index)
    if mod is None:
        src = "\n".join(read_source(name) for name in SOURCES)
        with cp.cuda.Device(index):
            mod = cp.RawModule(code=src, options=("--std=c++14",))
            mod.compile()
        _modules[index] = mod
    return mod


def _arr(t: torch.Tensor):
    """A CuPy view of a contiguous CUDA tensor (zero-copy, DLPack)."""
    return cp.from_dlpack(t.detach())


def _launch(device: torch.device, name: str, grid: int, args: tuple, threads: int = _THREADS) -> None:
    """Run kernel ``name`` on torch's current stream of ``device``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    kernel = _module(device).get_function(name)
    stream = torch.cuda.current_stream(device)
    with cp.cuda.Device(index), cp.cuda.ExternalStream(stream.cuda_stream):
        kernel((max(1, min(grid, _MAX_GRID)),), (threads,), args)


def _grid(n: int, threads: int = _THREADS) -> int:
    return -(-n // threads)


def _cuda(*tensors) -> bool:
    return all(t is None or t.device.type == "cuda" for t in tensors)


_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_i32, _i64, _u32, _f32 = np.int32, np.int64, np.uint32, np.float32


def _flat_f32(x: torch.Tensor) -> torch.Tensor:
    flat = x.detach().reshape(-1)
    return (flat if flat.dtype == torch.float32 else flat.float()).contiguous()


def _fused_residual(flat: torch.Tensor, residual: torch.Tensor | None):
    if residual is None:
        return None
    if (flat.dtype != torch.float32 or residual.dtype != torch.float32
            or residual.device != flat.device or not residual.is_contiguous()
            or residual.numel() != flat.numel() or residual.requires_grad):
        return None
    r = residual.view(-1)
    return (1 if r.data_ptr() == flat.data_ptr() else 2), r


def _select(xi: torch.Tensor, lo: int, hi: int, res: torch.Tensor, mode: int):
    """(indices, value bits) of entries whose key is in ``[lo, hi]``: count pass + compaction pass."""
    n = xi.numel()
    dev = xi.device
    clen = max(4096, -(-n // 4096))
    clen = -(-clen // _THREADS) * _THREADS
    nch = -(-n // clen)
    counts = torch.empty(nch, dtype=torch.int64, device=dev)
    if nch:
        _launch(dev, "select_count", nch, (_arr(xi), _i32(lo), _i32(hi), _i64(n), _i64(clen), _arr(counts)))
    offsets = torch.cumsum(counts, 0) - counts
    total = int(counts.sum()) if nch else 0
    idx_dtype = ref.index_dtype(n)
    idx = torch.empty(total, dtype=idx_dtype, device=dev)
    val = torch.empty(total, dtype=torch.int32, device=dev)
    if nch and (total or mode >= 2):
        name = "select_write_i32" if idx_dtype == torch.int32 else "select_write_i64"
        _launch(dev, name, nch, (_arr(xi), _i32(lo), _i32(hi), _i64(n), _i64(clen), _arr(offsets),
                                 _arr(idx), _arr(val), _arr(res), _i32(mode)))
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
    """See :func:`commpress.ops.reference.threshold_compact`."""
    if not _cuda(x, residual) or x.dtype not in _FLOATS:
        return ref.threshold_compact(x, threshold, residual)
    flat = x.reshape(-1)
    xf = _flat_f32(flat)
    xi = xf.view(torch.int32)
    lo, hi = threshold_key_range(threshold)
    fused = _fused_residual(flat, residual)
    mode, res = fused if fused is not None else (0, xf)
    idx, val = _select(xi, lo, hi, res.view(torch.int32), mode)
    return _finish(x, flat, idx, val, residual, fused)


def topk_compact(x: torch.Tensor, k: int, residual: torch.Tensor | None = None):
    """See :func:`commpress.ops.reference.topk_compact`.

    Candidates above a threshold estimated from a strided sample are compacted
    by the fused kernels (lowering the threshold if fewer than ``k`` pass); the
    exact selection (stable sort of the candidates' keys) runs on them only.
    """
    if not _cuda(x, residual) or x.dtype not in _FLOATS:
        return ref.topk_compact(x, k, residual)
    flat = x.reshape(-1)
    n = flat.numel()
    k = max(0, min(int(k), n))
    if k == 0:
        idx = torch.empty(0, dtype=ref.index_dtype(n), device=x.device)
        return _finish(x, flat, idx, torch.empty(0, dtype=torch.int32, device=x.device), residual, None)
    xf = _flat_f32(flat)
    xi = xf.view(torch.int32)
    fused = _fused_residual(flat, residual)
    res = fused[1] if fused is not None else xf
    mode = 3 if fused is not None and fused[0] == 2 else 0
    thresholds = [0]
    m = TOPK_SAMPLE
    if n >= 4 * m:
        stride = n // m
        sample = (xi[: stride * m: stride] & _MAX_KEY).to(torch.int64)
        expected = k * m / n
        ranks = []
        r = int(expected + 4.0 * math.sqrt(expected) + 8)
        while r < m // 2:
            ranks.append(r)
            r *= 4
        if ranks:
            top = torch.topk(sample, ranks[-1]).values.cpu()
            thresholds = [int(top[r - 1]) for r in ranks] + [0]
    for lo in thresholds:
        cidx, cval = _select(xi, lo, _MAX_KEY, res.view(torch.int32), mode)
        if cidx.numel() >= k:
            break
    keys = cval & _MAX_KEY
    order = torch.sort(keys, descending=True, stable=True).indices[:k]
    pick = torch.sort(order).values
    idx, val = cidx[pick], cval[pick]
    if fused is not None:
        res.view(-1)[idx.to(torch.int64)] = 0
    return _finish(x, flat, idx, val, residual, fused)


def scatter_add_(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """See :func:`commpress.ops.reference.scatter_add_` (unique indices: bitwise equal)."""
    if (not _cuda(out, indices, values) or out.dtype not in (torch.float32, torch.float64)
            or out.dim() != 1 or not out.is_contiguous() or indices.dim() != 1
            or indices.numel() != values.numel() or indices.is_floating_point() or out.requires_grad):
        return ref.scatter_add_(out, indices, values)
    idx = indices.to(torch.int64).contiguous()
    val = values.detach().reshape(-1).to(out.dtype).contiguous()
    bad = torch.zeros(1, dtype=torch.int32, device=out.device)
    m = idx.numel()
    if m:
        name = "scatter_add_f32" if out.dtype == torch.float32 else "scatter_add_f64"
        _launch(out.device, name, _grid(m), (_arr(out), _arr(idx), _arr(val), _i64(m),
                                             _i64(out.numel()), _arr(bad)))
        if int(bad.item()):
            raise IndexError(f"scatter_add_: an index is out of range for out of size {out.numel()}")
    return out


def counter_bits(seed: int, start: int, n: int, device="cpu") -> torch.Tensor:
    """See :func:`commpress.ops.reference.counter_bits`."""
    device = torch.device(device)
    if device.type != "cuda":
        return ref.counter_bits(seed, start, n, device)
    k0, k1 = ref.seed_words(seed)
    out = torch.empty(int(n), dtype=torch.int64, device=device)
    if n:
        _launch(device, "counter_bits_kernel", _grid(int(n)),
                (_arr(out), _u32(int(start) & ref.MASK32), _u32(k0), _u32(k1), _i64(n)))
    return out


def counter_uniform(seed: int, start: int, n: int, device="cpu") -> torch.Tensor:
    """See :func:`commpress.ops.reference.counter_uniform`."""
    device = torch.device(device)
    if device.type != "cuda":
        return ref.counter_uniform(seed, start, n, device)
    k0, k1 = ref.seed_words(seed)
    out = torch.empty(int(n), dtype=torch.float32, device=device)
    if n:
        _launch(device, "counter_uniform_kernel", _grid(int(n)),
                (_arr(out), _u32(int(start) & ref.MASK32), _u32(k0), _u32(k1), _i64(n)))
    return out


def hash_owner(indices: torch.Tensor, world_size: int) -> torch.Tensor:
    """See :func:`commpress.ops.reference.hash_owner`."""
    if not _cuda(indices) or indices.is_floating_point() or int(world_size) < 1:
        return ref.hash_owner(indices, world_size)
    idx = indices.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty_like(idx)
    if idx.numel():
        _launch(idx.device, "hash_owner_kernel", _grid(idx.numel()),
                (_arr(idx), _arr(out), _u32(int(world_size)), _i64(idx.numel())))
    return out.reshape(indices.shape)




def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """See :func:`commpress.ops.reference.pack_bits`."""
    if not _cuda(codes) or not valid_bits(bits) or codes.is_complex():
        return ref.pack_bits(codes, bits)
    bits = int(bits)
    c = codes_u8(codes, bits)
    n = c.numel()
    nbytes = (n * bits + 7) // 8
    packed = torch.empty(nbytes, dtype=torch.uint8, device=c.device)
    if n:
        _launch(c.device, "pack_bits_kernel", _grid(-(-n // 8)),
                (_arr(c), _arr(packed), _i32(bits), _i64(n), _i64(nbytes)))
    return packed


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """See :func:`commpress.ops.reference.unpack_bits`."""
    numel = int(numel)
    if (not _cuda(packed) or not valid_bits(bits) or packed.dtype != torch.uint8 or numel < 0
            or packed.numel() < (numel * int(bits) + 7) // 8):
        return ref.unpack_bits(packed, bits, numel)
    p = packed.reshape(-1).contiguous()
    codes = torch.empty(numel, dtype=torch.uint8, device=p.device)
    if numel:
        _launch(p.device, "unpack_bits_kernel", _grid(numel),
                (_arr(p), _arr(codes), _i32(int(bits)), _i64(numel), _i64(p.numel())))
    return codes


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """See :func:`commpress.ops.reference.block_absmax`."""
    if not _cuda(x) or x.dtype not in _FLOATS or not valid_block(block):
        return ref.block_absmax(x, block)
    xf = _flat_f32(x)
    n, block = xf.numel(), int(block)
    nblocks = -(-n // block)
    scales = torch.empty(nblocks, dtype=torch.float32, device=x.device)
    if nblocks:
        _launch(x.device, "block_absmax_kernel", _grid(nblocks * 32),
                (_arr(xf.view(torch.int32)), _arr(scales), _i64(n), _i64(block), _i64(nblocks)))
    return scales


def block_quantize(x: torch.Tensor, bits: int, block: int, stochastic: bool = False, seed: int = 0):
    """See :func:`commpress.ops.reference.block_quantize`."""
    if not _cuda(x) or x.dtype not in _FLOATS or not valid_bits(bits) or not valid_block(block):
        return ref.block_quantize(x, bits, block, stochastic, seed)
    bits, block = int(bits), int(block)
    xf = _flat_f32(x)
    n = xf.numel()
    scales = block_absmax(xf, block)
    nbytes = (n * bits + 7) // 8
    packed = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    k0, k1 = ref.seed_words(seed)
    if n:
        _launch(x.device, "block_quantize_kernel", _grid(-(-n // 8)),
                (_arr(xf), _arr(scales), _arr(packed), _i32(bits), _i64(block), _i64(n), _i64(nbytes),
                 _i32(1 if stochastic else 0), _u32(k0), _u32(k1)))
    return packed, scales


def _out_ok(out: torch.Tensor | None, numel: int) -> bool:
    return out is None or (out.dtype == torch.float32 and out.dim() == 1 and out.numel() == numel
                           and out.is_contiguous() and not out.requires_grad)


def block_dequantize(packed: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int,
                     out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """See :func:`commpress.ops.reference.block_dequantize` (unpack + scale + accumulate fused)."""
    numel = int(numel)
    if (not _cuda(packed, scales, out) or not valid_bits(bits) or not valid_block(block)
            or packed.dtype != torch.uint8 or numel < 0
            or packed.numel() < (numel * int(bits) + 7) // 8
            or scales.numel() < -(-numel // int(block)) or not _out_ok(out, numel)):
        return ref.block_dequantize(packed, scales, bits, block, numel, out, accumulate)
    p = packed.reshape(-1).contiguous()
    s = scales.reshape(-1).float().contiguous()
    dst = out if out is not None else torch.empty(numel, dtype=torch.float32, device=p.device)
    if numel:
        _launch(p.device, "block_dequantize_kernel", _grid(numel),
                (_arr(p), _arr(s), _arr(dst), _i32(int(bits)), _i64(int(block)), _i64(numel),
                 _i64(p.numel()), _i32(1 if (accumulate and out is not None) else 0)))
    return dst


def sign_pack(x: torch.Tensor, chunk: int):
    """See :func:`commpress.ops.reference.sign_pack`."""
    if not _cuda(x) or x.dtype not in _FLOATS or not valid_block(chunk):
        return ref.sign_pack(x, chunk)
    chunk = int(chunk)
    xf = _flat_f32(x)
    n = xf.numel()
    nbytes = (n + 7) // 8
    nchunks = -(-n // chunk)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    scales = torch.empty(nchunks, dtype=torch.float32, device=x.device)
    if n:
        _launch(x.device, "sign_bits_kernel", _grid(nbytes), (_arr(xf), _arr(packed), _i64(n), _i64(nbytes)))
        _launch(x.device, "sign_scales_kernel", nchunks,
                (_arr(xf), _arr(scales), _i64(n), _i64(chunk), _i64(nchunks)))
    return packed, scales


def sign_unpack(bits: torch.Tensor, scales: torch.Tensor, chunk: int, numel: int,
                out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """See :func:`commpress.ops.reference.sign_unpack`."""
    numel = int(numel)
    if (not _cuda(bits, scales, out) or not valid_block(chunk) or bits.dtype != torch.uint8
            or numel < 0 or bits.numel() < (numel + 7) // 8
            or scales.numel() < -(-numel // int(chunk)) or not _out_ok(out, numel)):
        return ref.sign_unpack(bits, scales, chunk, numel, out, accumulate)
    b = bits.reshape(-1).contiguous()
    s = scales.reshape(-1).float().contiguous()
    dst = out if out is not None else torch.empty(numel, dtype=torch.float32, device=b.device)
    if numel:
        _launch(b.device, "sign_unpack_kernel", _grid(numel),
                (_arr(b), _arr(s), _arr(dst), _i64(int(chunk)), _i64(numel),
                 _i32(1 if (accumulate and out is not None) else 0)))
    return dst


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
    "sign_pack": sign_pack,
    "sign_unpack": sign_unpack,
}


def available() -> bool:
    """CuPy imports and torch sees a CUDA device."""
    return cp is not None and torch.cuda.is_available()


if available():
    from . import register_backend

    register_backend("cuda", OPS)
