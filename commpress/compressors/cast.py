"""Dense compressors: ``identity`` and the half-precision casts ``fp16`` / ``bf16``."""

from __future__ import annotations

import torch

from .base import Compressor, Payload, register


@register("identity")
class Identity(Compressor):
    """Sends the tensor as it is (flattened, contiguous). Wire: ``numel`` elements of the input dtype."""

    aggregation = "sum"
    casts = True
    cast_to: torch.dtype | None = None   # the input's own dtype

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


@register("fp16")
class FP16(_Cast):
    """Round to IEEE half precision. Wire: ``2*numel`` bytes. Values beyond ±65504 become ±inf."""

    wire_dtype = torch.float16


@register("bf16")
class BF16(_Cast):
    """Round to bfloat16 (fp32's range, 8 bits of mantissa). Wire: ``2*numel`` bytes."""

    wire_dtype = torch.bfloat16
