"""``terngrad``: ternary {-1, 0, 1}·max|x| with stochastic rounding (Wen et al., 2017)."""

from __future__ import annotations

import torch

from .. import ops
from ._util import seed_from_generator
from .base import Compressor, Payload, register

_ABSMAX_BLOCK = 1 << 16  # partial maxima, reduced on the device (max is exact in any order)


@register("terngrad")
class TernGrad(Compressor):
    """TernGrad: ``s = max|x|``, entry ``i`` becomes ``sign(x_i)*s`` with probability
    ``|x_i|/s`` and 0 otherwise, so it is unbiased (variance ``|x_i|(s-|x_i|)``).

    Wire: ``s`` as fp32 (4 bytes) and 2 bits per entry (codes 0, 1, 2 from
    :func:`commpress.ops.level_quantize` with one level, packed in the same pass):
    ``ceil(numel/4) + 4`` bytes.  Noise comes from ``generator``.  A NaN/inf entry
    makes ``s`` non-finite and the decoded tensor NaN.  (The paper's layer-wise
    clipping is left to the caller.)
    """

    aggregation = "gather"
    unbiased = True
    deterministic = False

    def __init__(self) -> None:
        pass

    def compress(self, tensor, *, step=0, key=0, generator=None) -> Payload:
        self.check_input(tensor)
        x = tensor.reshape(-1)
        n = x.numel()
        if n:
            scale = ops.block_absmax(x, _ABSMAX_BLOCK).amax().reshape(1)
        else:
            scale = torch.zeros(1, dtype=torch.float32, device=x.device)
        packed = ops.level_quantize(x, scale, max(n, 1), 1, seed_from_generator(generator))
        return self.make_payload(tensor, (packed, scale))

    fused_feedback = True

    #: fp32 on the CPU (on a GPU the separate kernels stay: the fused op has no CUDA kernel yet)
    fused_feedback_devices = ("cpu",)

    def compress_feedback(self, tensor: torch.Tensor, residual: torch.Tensor | None, beta: float,
                          new_residual: torch.Tensor, *, step: int = 0, key=0, fixed: bool = False,
                          scale: float = 1.0, generator=None) -> tuple[Payload, torch.Tensor]:
        """Error feedback in two passes (:func:`commpress.ops.terngrad_quantize_feedback`): ``s`` of
        ``c = tensor * scale + beta * residual``, then the payload of ``c`` with the noise of
        ``generator`` (as :meth:`compress`) and, in ``new_residual``, ``c - decompress(payload)``;
        ``c`` itself is never stored.  Returns ``(payload, finite)``; ``new_residual`` is only valid
        when ``finite`` (0-dim bool: ``s`` finite) is True.  The same payload and residual as
        compensating, compressing and decoding in turn (bitwise for ``beta = 1``)."""
        self.check_input(tensor)
        packed, s, finite = ops.terngrad_quantize_feedback(tensor.reshape(-1), residual, beta,
                                                           seed_from_generator(generator), new_residual, scale)
        return self.make_payload(tensor, (packed, s)), finite

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        packed, scale = payload.tensors
        vals = ops.level_dequantize(packed, scale, max(payload.numel, 1), 1, payload.numel,
                                    out=self.decode_target(payload, out))
        return self.finish_decode(payload, vals, out)
