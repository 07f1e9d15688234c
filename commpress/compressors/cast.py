"""Dense compressors: ``identity`` and the half-precision casts ``fp16`` / ``bf16``."""

from __future__ import annotations

import torch

from .. import ops
from .base import Compressor, Payload, register


@register("identity")
class Identity(Compressor):
    """Sends the tensor as it is (flattened, contiguous). Wire: ``numel`` elements of the input dtype."""

    aggregation = "sum"
    casts = True
    cast_to: torch.dtype | None = None   # the input's own dtype
    exact = True

    def __init__(self) -> None:
        pass

    def compress(self, tensor, *, step=0, key=0, generator=None) -> Payload:
        self.check_input(tensor)
        return self.make_payload(tensor, (tensor.reshape(-1).contiguous(),))

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        self.decode_target(payload, out)
        return self.finish_decode(payload, payload.tensors[0], out)


class _Cast(Compressor):
    aggregation = "sum"
    casts = True
    wire_dtype: torch.dtype

    @property
    def cast_to(self) -> torch.dtype:
        return self.wire_dtype

    def __init__(self) -> None:
        pass

    def compress(self, tensor, *, step=0, key=0, generator=None) -> Payload:
        self.check_input(tensor)
        return self.make_payload(tensor, (tensor.reshape(-1).to(self.wire_dtype).contiguous(),))

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        self.decode_target(payload, out)
        return self.finish_decode(payload, payload.tensors[0], out)

    fused_feedback = True

    def compress_feedback(self, tensor: torch.Tensor, residual: torch.Tensor | None, beta: float,
                          new_residual: torch.Tensor, *, step: int = 0, key=0, fixed: bool = False,
                          scale: float = 1.0) -> tuple[Payload, torch.Tensor]:
        """Error feedback: ``c = tensor * scale + beta * residual`` (fp32, each product rounded on its
        own, :func:`commpress.ops.reference.compensated`) cast with saturation
        (:func:`commpress.ops.cast_feedback`: one numba pass on the CPU): a finite ``c``
        beyond the wire dtype's largest value is sent as that value (``±65504`` for fp16) instead
        of ``±inf``, and ``new_residual = c - sent`` keeps the rest, so a finite input never
        leaves an infinite payload or residual; NaN/inf in ``c`` are sent as they are.  Returns
        ``(payload, finite)``; ``new_residual`` is only valid when ``finite`` (0-dim bool) is True.
        Bitwise the separate cast wherever it does not overflow (for ``beta = 1``)."""
        self.check_input(tensor)
        sent, finite = ops.cast_feedback(tensor, residual, beta, new_residual, self.wire_dtype, scale)
        return self.make_payload(tensor, (sent,)), finite


@register("fp16")
class FP16(_Cast):
    """Round to IEEE half precision. Wire: ``2*numel`` bytes. Values beyond ±65504 become ±inf,
    except under :class:`commpress.ErrorFeedback`, which sends them as ±65504 and keeps the rest
    in the residual (:meth:`compress_feedback`)."""

    wire_dtype = torch.float16


@register("bf16")
class BF16(_Cast):
    """Round to bfloat16 (fp32's range, 8 bits of mantissa). Wire: ``2*numel`` bytes."""

    wire_dtype = torch.bfloat16
