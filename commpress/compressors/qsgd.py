"""``qsgd``: stochastic quantization of |x|/||x||_2 to ``levels`` levels (Alistarh et al., 2017)."""

from __future__ import annotations

import math

import torch

from .. import ops
from ._util import check_int, seed_from_generator, uniform
from .base import Compressor, Payload, register


def code_bits(levels: int) -> int:
    """Bits per entry for signed codes in ``[-levels, levels]``: ``ceil(log2(2*levels+1))``."""
    return max(1, math.ceil(math.log2(2 * levels + 1)))


def stochastic_codes(x: torch.Tensor, scale: torch.Tensor, levels: int, seed: int) -> torch.Tensor:
    """Unsigned codes ``sign(x)*floor(|x|/scale*levels + u) + levels`` (uint8).

    ``u`` from :func:`commpress.ops.counter_uniform`; ``E[code - levels] =
    x/scale*levels``.  A zero scale gives zero codes; a non-finite scale gives
    codes that decode (``code * scale``) to NaN, so non-finite input propagates.
    """
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = x.abs().mul_(float(levels) / safe)  # a non-finite scale: 0 or NaN here
    y.add_(uniform(seed, x.numel(), x.device)).floor_().clamp_(0, levels).nan_to_num_(0.0)
    return y.copysign_(x).add_(levels).to(torch.uint8)


def decode_codes(codes: torch.Tensor, scale: torch.Tensor, levels: int) -> torch.Tensor:
    """fp32 values ``(code - levels) * scale / levels``."""
    return (codes.float() - levels) * (scale.float() / levels)


def bucket_norms(x: torch.Tensor, bucket: int) -> torch.Tensor:
    """fp32 L2 norm of each ``bucket``-entry slice of the 1-D fp32 ``x`` (last one shorter)."""
    n = x.numel()
    full, rest = divmod(n, bucket)
    norms = x.new_empty(full + (1 if rest else 0))
    if full:
        torch.linalg.vector_norm(x[: full * bucket].view(full, bucket), dim=1, out=norms[:full])
    if rest:
        norms[full] = torch.linalg.vector_norm(x[full * bucket:])
    return norms


def per_entry(values: torch.Tensor, bucket: int, n: int) -> torch.Tensor:
    """Each bucket's value repeated for its entries (``n`` of them)."""
    return values.repeat_interleave(bucket)[:n] if values.numel() > 1 else values


@register("qsgd")
class QSGD(Compressor):
    """QSGD with ``levels`` levels (1..127, default 7 → 4 bits per entry) and one L2
    norm per ``bucket`` entries (default 512, as in the paper's experiments; a
    bucket >= numel gives a single norm for the whole tensor).

    Wire: ``ceil(numel/bucket)`` fp32 norms and one signed code per entry in
    ``[-levels, levels]`` bit-packed with ``ceil(log2(2*levels+1))`` bits
    (:func:`commpress.ops.pack_bits`).  Stochastic rounding with noise derived
    from ``generator`` makes it unbiased; per-entry variance is at most
    ``(norm/levels)**2 / 4``.  A non-finite entry makes its bucket's norm
    non-finite and the decoded bucket NaN.
    """

    aggregation = "gather"
    unbiased = True
    deterministic = False

    def __init__(self, levels: int = 7, bucket: int = 512) -> None:
        self.levels = check_int("levels", levels, 1, 127)
        self.bucket = check_int("bucket", bucket, 1)
        self.bits = code_bits(self.levels)

    def compress(self, tensor, *, step=0, key=0, generator=None) -> Payload:
        self.check_input(tensor)
        x = tensor.reshape(-1).float()
        norms = bucket_norms(x, self.bucket)
        scale = per_entry(norms, self.bucket, x.numel())
        codes = stochastic_codes(x, scale, self.levels, seed_from_generator(generator))
        return self.make_payload(tensor, (ops.pack_bits(codes, self.bits), norms))

    def decompress(self, payload: Payload) -> torch.Tensor:
        packed, norms = payload.tensors
        codes = ops.unpack_bits(packed, self.bits, payload.numel)
        scale = per_entry(norms, self.bucket, payload.numel)
        return decode_codes(codes, scale, self.levels).to(payload.dtype).reshape(payload.shape)
