"""``fp8``: FP8 (E4M3 or E5M2) codes with one fp32 scale per block, as FP8 training recipes send."""

from __future__ import annotations

import torch

from .. import ops
from ._util import check_bool, check_int, seed_from_generator
from .base import Compressor, Payload, register

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@register("fp8")
class FP8(Compressor):
    """Per block of ``block`` entries: scale ``s = max|x| / max(format)`` (fp32) and each
    entry ``x / s`` rounded to ``format`` (``"e4m3"``: ``torch.float8_e4m3fn``, max 448,
    3 mantissa bits; ``"e5m2"``: ``torch.float8_e5m2``, max 57344, 2 mantissa bits).

    Rounding is to nearest, ties to even (relative error at most ``2**-4`` for e4m3,
    ``2**-3`` for e5m2, plus half the smallest subnormal step ``s * 2**-10`` /
    ``s * 2**-17``), or with ``stochastic=True`` unbiased stochastic rounding
    with noise from ``generator`` (:func:`commpress.ops.fp8_quantize`).
    Wire: ``numel`` bytes of float8 codes (torch's float8 dtype) plus ``4*ceil(numel/block)``
    bytes of fp32 scales.  Aggregation ``"gather"``: owners decode and sum in fp32.
    A NaN/inf entry makes its block's scale non-finite and the decoded block NaN.
    On CUDA tensors the ops run as CUDA kernels (kernels/*.cu; not yet run on a GPU).
    """

    aggregation = "gather"

    def __init__(self, format: str = "e4m3", block: int = 128, stochastic: bool = False) -> None:
        if format not in FORMATS:
            raise ValueError(f"format must be one of {tuple(FORMATS)}, got {format!r}")
        self.format = format
        self.wire_dtype = FORMATS[format]
        self.block = check_int("block", block, 1)
        self.stochastic = check_bool("stochastic", stochastic)
        self.unbiased = stochastic
        self.deterministic = not stochastic

    @property
    def alignment(self) -> int:
        return self.block

    def compress(self, tensor, *, step=0, key=0, generator=None) -> Payload:
        self.check_input(tensor)
        seed = seed_from_generator(generator) if self.stochastic else 0
        codes, scales = ops.fp8_quantize(tensor.reshape(-1), self.format, self.block, self.stochastic, seed)
        return self.make_payload(tensor, (codes.view(self.wire_dtype), scales))

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        codes, scales = payload.tensors
        vals = ops.fp8_dequantize(codes, scales, self.format, self.block, payload.numel,
                                  out=self.decode_target(payload, out))
        return self.finish_decode(payload, vals, out)
