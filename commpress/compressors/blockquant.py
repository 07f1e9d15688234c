"""``blockquant``: absmax block-wise quantization to 2/4/8-bit codes (ZeRO++ / 8-bit optimizers style)."""

from __future__ import annotations

import torch

from .. import ops
from ._util import check_bool, check_int, seed_from_generator
from .base import Compressor, Payload, register

ALLOWED_BITS = (2, 4, 8)


@register("blockquant")
class BlockQuant(Compressor):
    """Per block of ``block`` entries: scale ``s = max|x|`` (fp32), codes
    ``round(x * qmax / s)`` in ``[-qmax, qmax]`` (``qmax = 2**(bits-1) - 1``).

    Rounding is to nearest (deterministic, error <= half a step ``s/qmax/2``) or,
    with ``stochastic=True``, unbiased stochastic rounding with noise derived
    from ``generator``.  Wire (:func:`commpress.ops.block_quantize`): the codes
    bit-packed, ``ceil(numel*bits/8)`` bytes, plus ``4*ceil(numel/block)`` bytes
    of scales.  A NaN/inf entry makes its block's scale non-finite and the
    decoded block NaN.
    """

    aggregation = "gather"

    def __init__(self, bits: int = 8, block: int = 256, stochastic: bool = False) -> None:
        if isinstance(bits, bool) or bits not in ALLOWED_BITS:
            raise ValueError(f"bits must be one of {ALLOWED_BITS}, got {bits!r}")
        self.bits = int(bits)
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
        packed, scales = ops.block_quantize(tensor.reshape(-1), self.bits, self.block,
                                            self.stochastic, seed)
        return self.make_payload(tensor, (packed, scales))

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        packed, scales = payload.tensors
        vals = ops.block_dequantize(packed, scales, self.bits, self.block, payload.numel,
                                    out=self.decode_target(payload, out))
        return self.finish_decode(payload, vals, out)

    fused_feedback = True
    fused_velocity = True

    def fuses_feedback(self, tensor: torch.Tensor, fixed: bool = True) -> bool:
        """Round to nearest, fp32 on the CPU: error feedback runs :meth:`compress_feedback` (on a
        GPU the separate kernels stay: the fused op has no CUDA kernel yet)."""
        return not self.stochastic and tensor.dtype == torch.float32 and tensor.device.type == "cpu"

    def compress_feedback(self, tensor: torch.Tensor, residual: torch.Tensor | None, beta: float,
                          new_residual: torch.Tensor, *, step: int = 0, key=0, fixed: bool = False,
                          scale: float = 1.0, velocity=None) -> tuple[Payload, torch.Tensor]:
        """Error feedback in one pass (:func:`commpress.ops.block_quantize_feedback`): the payload
        of ``tensor * scale + beta * residual`` and, in ``new_residual``, what it did not send.
        Returns ``(payload, finite)``; ``new_residual`` is only valid when ``finite`` (0-dim
        bool) is True.  The same payload and residual as compensating, quantizing and decoding
        in turn (bitwise for ``beta = 1``).  ``velocity``: momentum correction in the same pass."""
        self.check_input(tensor)
        packed, scales, finite = ops.block_quantize_feedback(tensor.reshape(-1), residual, beta, self.bits,
                                                             self.block, new_residual, scale, velocity=velocity)
        return self.make_payload(tensor, (packed, scales)), finite

    def decompress_add(self, payload: Payload, out: torch.Tensor) -> torch.Tensor:
        """``out += decompress(payload)`` in one pass (``out``: flat contiguous fp32 of
        ``payload.numel``); the added values are exactly :meth:`decompress`'s."""
        packed, scales = payload.tensors
        return ops.block_dequantize(packed, scales, self.bits, self.block, payload.numel, out=out,
                                    accumulate=True)

    def decompress_sum(self, payloads: list[Payload], out: torch.Tensor) -> torch.Tensor:
        """``out = decompress(payloads[0]) + decompress(payloads[1]) + ...``, added in this order
        (bitwise :meth:`decompress` then :meth:`decompress_add` of each later one), two payloads
        per pass over ``out`` (:func:`commpress.ops.block_dequantize_sum`; ``out``: flat
        contiguous fp32 of the payloads' common ``numel``)."""
        return ops.block_dequantize_sum([p.tensors[0] for p in payloads], [p.tensors[1] for p in payloads],
                                        self.bits, self.block, payloads[0].numel, out=out)
