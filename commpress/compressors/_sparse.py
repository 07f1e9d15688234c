"""Base class of the sparsifiers whose payload is ``(indices, values)`` (aggregation "sparse")."""

from __future__ import annotations

import torch

from .. import ops
from .base import Compressor, Payload


class SparseCompressor(Compressor):
    """Keeps some entries of the flattened tensor.

    Wire: ``(indices, values)``: ``k`` unique ascending indices (int32 when
    ``numel < 2**31``, else int64) and the ``k`` kept values in the input dtype,
    so ``nbytes == k * (4 + itemsize)``.  Decompression scatters the values into
    zeros.  Subclasses implement :meth:`select`; they may override
    :meth:`select_with_residual` with a fused single pass.
    """

    aggregation = "sparse"
    unbiased = False

    def select(self, flat: torch.Tensor, *, step: int, key) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices, values)`` of the entries of the 1-D ``flat`` to keep."""
        raise NotImplementedError

    def select_with_residual(self, flat: torch.Tensor, residual: torch.Tensor, *, step: int, key
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`select`; ``residual`` (fp32, same numel) receives ``flat`` with the
        kept entries zeroed, which is exactly ``flat - decompress(payload)``."""
        idx, values = self.select(flat, step=step, key=key)
        r = residual.view(-1)
        r.copy_(flat)
        r[idx.long()] = 0
        return idx, values

    def compress(self, tensor, *, step=0, key=0, generator=None) -> Payload:
        self.check_input(tensor)
        idx, values = self.select(tensor.reshape(-1), step=step, key=key)
        return self.make_payload(tensor, (idx, values))

    def compress_with_residual(self, tensor: torch.Tensor, residual: torch.Tensor, *,
                               step: int = 0, key=0) -> Payload:
        """:meth:`compress` that also writes ``tensor - decompress(payload)`` into
        ``residual`` (used by error feedback for fp32 input)."""
        self.check_input(tensor)
        idx, values = self.select_with_residual(tensor.reshape(-1), residual, step=step, key=key)
        return self.make_payload(tensor, (idx, values))

    def decompress(self, payload: Payload) -> torch.Tensor:
        idx, values = payload.tensors
        out = torch.zeros(payload.numel, dtype=torch.float32, device=values.device)
        if idx.numel():
            ops.scatter_add_(out, idx, values.float())
        return out.to(payload.dtype).reshape(payload.shape)
