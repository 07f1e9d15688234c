"""``qsgd``: stochastic quantization of |x|/||x||_2 to ``levels`` levels (Alistarh et al., 2017)."""

from __future__ import annotations

import torch

from .. import ops
from ..ops.reference import level_bits
from ._util import check_int, seed_from_generator
from .base import Compressor, Payload, register


def code_bits(levels: int) -> int:
    """Bits per entry for signed codes in ``[-levels, levels]``: ``ceil(log2(2*levels+1))``."""
    return level_bits(levels)


@register("qsgd")
class QSGD(Compressor):
    """QSGD with ``levels`` levels (1..127, default 7 → 4 bits per entry) and one L2
    norm per ``bucket`` entries (default 512, as in the paper's experiments; a
    bucket >= numel gives a single norm for the whole tensor).

    Wire: ``ceil(numel/bucket)`` fp32 norms and one signed code per entry in
    ``[-levels, levels]`` bit-packed with ``ceil(log2(2*levels+1))`` bits
    (:func:`commpress.ops.qsgd_quantize`: norms, codes and packing in one pass).  Stochastic rounding with noise derived from ``generator`` makes it
    unbiased; per-entry variance is at most ``(norm/levels)**2 / 4``.  A non-finite
    entry makes its bucket's norm non-finite and the decoded bucket NaN.  A finite bucket always
    gets a finite norm: where its squares would overflow fp32 (``|x|`` above ~1.8e19) or
    underflow, the norm is summed again on ``x`` scaled by an exact power of two
    (:func:`commpress.ops.reference.bucket_norms`), and a norm above the fp32 range saturates at
    its maximum (still ``>= max|x|``, so the codes stay unbiased).
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
        packed, norms = ops.qsgd_quantize(tensor.reshape(-1), self.levels, self.bucket,
                                          seed_from_generator(generator))
        return self.make_payload(tensor, (packed, norms))

    fused_feedback = True

    #: fp32 on the CPU (on a GPU the separate kernels stay: the fused op has no CUDA kernel yet)
    fused_feedback_devices = ("cpu",)

    def compress_feedback(self, tensor: torch.Tensor, residual: torch.Tensor | None, beta: float,
                          new_residual: torch.Tensor, *, step: int = 0, key=0, fixed: bool = False,
                          scale: float = 1.0, generator=None) -> tuple[Payload, torch.Tensor]:
        """Error feedback in one pass (:func:`commpress.ops.qsgd_quantize_feedback`): the payload of
        ``c = tensor * scale + beta * residual`` with the noise of ``generator`` (as :meth:`compress`)
        and, in ``new_residual``, ``c - decompress(payload)``; each bucket is compensated, summed,
        coded and its residual written while it is in cache.  Returns ``(payload, finite)``;
        ``new_residual`` is only valid when ``finite`` (0-dim bool: every norm finite) is True.  The
        same payload and residual as compensating, compressing and decoding in turn (bitwise for
        ``beta = 1``)."""
        self.check_input(tensor)
        packed, norms, finite = ops.qsgd_quantize_feedback(tensor.reshape(-1), residual, beta, self.levels,
                                                           self.bucket, seed_from_generator(generator),
                                                           new_residual, scale)
        return self.make_payload(tensor, (packed, norms)), finite

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        packed, norms = payload.tensors
        vals = ops.level_dequantize(packed, norms, self.bucket, self.levels, payload.numel,
                                    out=self.decode_target(payload, out))
        return self.finish_decode(payload, vals, out)
