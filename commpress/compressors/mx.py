"""``mx``: OCP Microscaling (MX v1.0) blocks: 32 elements share one power-of-two E8M0 scale."""

from __future__ import annotations

import torch

from .. import ops
from ..ops.reference import MX_BLOCK, MX_ELEMENTS
from ._util import check_bool, seed_from_generator
from .base import Compressor, Payload, register


@register("mx")
class MX(Compressor):
    """Per block of 32 entries a shared exponent ``X = floor(log2 max|x|) - emax(element)``
    (clamped to -127; sent as one E8M0 byte, 255 when the block holds a NaN/inf) and
    each entry ``x / 2**X`` rounded to ``element``, saturating at its largest value:
    ``"fp8_e4m3"`` (max 448), ``"fp6_e2m3"`` (max 7.5), ``"fp4_e2m1"`` (0, 0.5, 1, 1.5, 2,
    3, 4, 6).  Entries above the element's max in the top binade are clipped, as in
    the OCP spec.

    Rounding is to nearest, ties to even, or with ``stochastic=True`` stochastic
    (unbiased except for those clipped entries, so ``unbiased`` is False) with noise from ``generator``.
    Wire (:func:`commpress.ops.mx_quantize`): the element codes bit-packed,
    ``ceil(numel*bits/8)`` bytes (bits = 8, 6, 4), plus ``ceil(numel/32)`` scale bytes:
    8.25, 6.25 or 4.25 bits per entry.  Aggregation ``"gather"``.  On CUDA tensors the
    ops run as CUDA kernels (kernels/*.cu; not yet run on a GPU).
    """

    aggregation = "gather"
    #: Stochastic rounding is unbiased below the clip, but the OCP scale clips the top
    #: binade (up to 25% for FP4), so the compressor is biased: pair it with error feedback.
    unbiased = False
    #: Entries per shared scale (also the two-phase collective's chunk alignment).
    block = MX_BLOCK

    def __init__(self, element: str = "fp8_e4m3", stochastic: bool = False) -> None:
        if element not in MX_ELEMENTS:
            raise ValueError(f"element must be one of {tuple(MX_ELEMENTS)}, got {element!r}")
        self.element = element
        self.bits = MX_ELEMENTS[element][1]
        self.stochastic = check_bool("stochastic", stochastic)
        self.deterministic = not stochastic

    @property
    def alignment(self) -> int:
        return self.block

    def compress(self, tensor, *, step=0, key=0, generator=None) -> Payload:
        self.check_input(tensor)
        seed = seed_from_generator(generator) if self.stochastic else 0
        packed, scales = ops.mx_quantize(tensor.reshape(-1), self.element, self.stochastic, seed)
        return self.make_payload(tensor, (packed, scales))

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        packed, scales = payload.tensors
        vals = ops.mx_dequantize(packed, scales, self.element, payload.numel,
                                 out=self.decode_target(payload, out))
        return self.finish_decode(payload, vals, out)
