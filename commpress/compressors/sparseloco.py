"""``sparseloco``: chunk-wise top-k, the kept values quantized to 2 bits (SparseLoCo, Sarfi et al. 2025)."""

from __future__ import annotations

import torch

from ._util import check_int, check_ratio, num_keep
from .base import Compressor, Payload, register

ALLOWED_BITS = (2, 4, 8)
_MAX_INT16_CHUNK = 2 ** 15


@register("sparseloco")
class SparseLoCo(Compressor):
    """Top-k per chunk of ``chunk`` entries, the kept values coded in ``bits`` bits.

    The flat tensor is cut into chunks of ``c = min(chunk, numel)`` entries (the
    last one zero-padded); each keeps its ``k = max(1, round(ratio*c))``
    largest-magnitude entries.  A kept value is a sign bit and ``bits - 1`` bits
    of magnitude: ``L = 2**(bits-1)`` equal bins between the chunk's smallest
    and largest kept magnitude ``lo``, ``hi`` (fp32), decoded to the bin centre
    (deterministic; the error goes to the error-feedback residual).

    Wire per chunk: ``k`` in-chunk indices (uint8 for chunks up to 256, int16 up to 32768,
    else int32),
    ``ceil(k*bits/8)`` bytes of packed codes, 8 bytes of ``lo``/``hi``.  At the
    defaults (4096, 3%, 2 bits) that is 283 bytes for 16 KiB of fp32: 58x.
    Aggregation ``"gather"`` (the codes are decoded before they are summed): a
    fixed-size payload, so the collectives need no size exchange.  Biased: use
    it inside :class:`commpress.ErrorFeedback` (SparseLoCo's accumulator is
    ``ErrorFeedback(c, beta=β)``, see :class:`commpress.diloco.DiLoCo`).
    A NaN/inf among the kept values makes its chunk decode to non-finite values.
    """

    aggregation = "gather"
    unbiased = False

    def __init__(self, ratio: float = 0.03, chunk: int = 4096, bits: int = 2) -> None:
        self.ratio = check_ratio(ratio)
        self.chunk = check_int("chunk", chunk, 1)
        if isinstance(bits, bool) or bits not in ALLOWED_BITS:
            raise ValueError(f"bits must be one of {ALLOWED_BITS}, got {bits!r}")
        self.bits = int(bits)

    # -- layout: a pure function of numel and the configuration ---------------
    def layout(self, numel: int) -> tuple[int, int, int]:
        """``(chunks, chunk length, k per chunk)`` for a ``numel``-entry tensor."""
        if numel == 0:
            return 0, 0, 0
        c = min(self.chunk, numel)
        return -(-numel // c), c, num_keep(self.ratio, c)

    def compress(self, tensor, *, step=0, key=0, generator=None) -> Payload:
        self.check_input(tensor)
        n = tensor.numel()
        chunks, c, k = self.layout(n)
        if n == 0:
            empty = torch.zeros(0, dtype=torch.uint8, device=tensor.device)
            return self.make_payload(tensor, (empty.to(torch.int16), empty, empty.float()))
        flat = tensor.reshape(-1).float()
        x = torch.zeros(chunks * c, dtype=torch.float32, device=tensor.device)
        x[:n] = flat
        x = x.view(chunks, c)
        mag = x.abs()
        if chunks * c > n:  # padding is chosen last
            mag.view(-1)[n:] = -1.0
        _, idx = torch.topk(mag, k, dim=1, sorted=False)
        idx, _ = torch.sort(idx, dim=1)  # ascending: the payload is the same whatever topk's order
        vals = torch.gather(x, 1, idx)
        a = vals.abs()
        lo = a.amin(dim=1, keepdim=True)
        hi = a.amax(dim=1, keepdim=True)
        # a NaN anywhere must reach the decode: amin/amax propagate it into lo/hi
        bad = torch.isnan(a).any(dim=1, keepdim=True)
        lo = torch.where(bad, torch.full_like(lo, float("nan")), lo)
        levels = 2 ** (self.bits - 1)
        width = hi - lo
        t = torch.nan_to_num((a - lo) / torch.where(width > 0, width, torch.ones_like(width)), nan=0.0)
        mcode = torch.clamp(torch.floor(t * levels), 0, levels - 1).to(torch.uint8)
        codes = mcode | ((vals < 0).to(torch.uint8) << (self.bits - 1))
        packed = _pack(codes, self.bits)
        itype = torch.uint8 if c <= 256 else torch.int16 if c <= _MAX_INT16_CHUNK else torch.int32
        scales = torch.cat([lo, hi], dim=1)
        return self.make_payload(tensor, (idx.to(itype), packed, scales))

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        idx, packed, scales = payload.tensors
        n = payload.numel
        chunks, c, k = self.layout(n)
        dense = torch.zeros(chunks, c, dtype=torch.float32, device=packed.device)
        if k:
            codes = _unpack(packed, self.bits, k)
            levels = 2 ** (self.bits - 1)
            lo, hi = scales[:, 0:1], scales[:, 1:2]
            # the bin centre as a fraction of the width first (exact: levels is a power of two), so
            # lo + (hi - lo) * f <= hi never overflows
            mag = lo + (hi - lo) * (((codes & (levels - 1)).float() + 0.5) / levels)
            vals = torch.where((codes >> (self.bits - 1)) != 0, -mag, mag)
            dense.scatter_(1, idx.long(), vals)
        target = self.decode_target(payload, out)
        flat = dense.view(-1)[:n]
        if target is not None:
            target.copy_(flat)
            flat = target
        return self.finish_decode(payload, flat, out)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[rows, k]`` codes of ``bits`` bits -> ``[rows, ceil(k*bits/8)]`` bytes, little end first."""
    per = 8 // bits
    rows, k = codes.shape
    width = -(-k // per)
    padded = torch.zeros(rows, width * per, dtype=torch.uint8, device=codes.device)
    padded[:, :k] = codes
    padded = padded.view(rows, width, per)
    out = torch.zeros(rows, width, dtype=torch.uint8, device=codes.device)
    for i in range(per):
        out |= padded[:, :, i] << (bits * i)
    return out


def _unpack(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    per = 8 // bits
    mask = (1 << bits) - 1
    parts = [(packed >> (bits * i)) & mask for i in range(per)]
    return torch.stack(parts, dim=2).reshape(packed.shape[0], -1)[:, :k]
