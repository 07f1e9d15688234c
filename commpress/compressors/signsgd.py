"""``signsgd``: 1 bit per entry plus one scale (mean |x|) per chunk (1-bit Adam style)."""

from __future__ import annotations

import torch

from .. import ops
from ._util import check_int
from .base import Compressor, Payload, register


@register("signsgd")
class SignSGD(Compressor):
    """Scaled sign: entry ``i`` of chunk ``c`` decodes to ``±mean(|x|)`` over chunk ``c``.

    Wire (:func:`commpress.ops.sign_pack`): ``ceil(numel/8)`` bytes of sign bits
    (bit set when ``not x < 0``) and ``ceil(numel/chunk)`` fp32 scales.  Biased:
    meant for :class:`commpress.ErrorFeedback`.  A NaN/inf entry makes its
    chunk's scale non-finite, so it shows in the decoded chunk.
    """

    aggregation = "gather"
    unbiased = False
    deterministic = True

    def __init__(self, chunk: int = 1024) -> None:
        self.chunk = check_int("chunk", chunk, 1)

    @property
    def alignment(self) -> int:
        return self.chunk

    def compress(self, tensor, *, step=0, key=0, generator=None) -> Payload:
        self.check_input(tensor)
        bits, scales = ops.sign_pack(tensor.reshape(-1), self.chunk)
        return self.make_payload(tensor, (bits, scales))

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        bits, scales = payload.tensors
        vals = ops.sign_unpack(bits, scales, self.chunk, payload.numel, out=self.decode_target(payload, out))
        return self.finish_decode(payload, vals, out)

    fused_feedback = True

    def compress_feedback(self, tensor: torch.Tensor, residual: torch.Tensor | None, beta: float,
                          new_residual: torch.Tensor, *, step: int = 0, key=0, fixed: bool = False,
                          scale: float = 1.0) -> tuple[Payload, torch.Tensor]:
        """Error feedback in one pass (:func:`commpress.ops.sign_pack_feedback`): the payload of
        ``tensor * scale + beta * residual`` and, in ``new_residual``, what it did not send.

        Returns ``(payload, finite)``; ``new_residual`` is only valid when ``finite``
        (0-dim bool) is True.  ``residual`` (``None``: zero) / ``new_residual``: fp32,
        ``tensor``'s numel.  The wire format is the same with ``fixed``; a ``scale`` other
        than 1 costs a multiplication of its own.
        """
        self.check_input(tensor)
        if residual is None:
            residual = torch.zeros_like(new_residual)
        if scale != 1.0:
            tensor = tensor * scale
        bits, scales, finite = ops.sign_pack_feedback(tensor.reshape(-1), residual, beta, self.chunk,
                                                      new_residual)
        return self.make_payload(tensor, (bits, scales)), finite
