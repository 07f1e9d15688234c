"""Error feedback: compress ``x + residual`` and remember what was not sent (Stich 2018, Karimireddy 2019)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from .compressors._sparse import SparseCompressor
from .compressors._util import all_finite, decode_keyed, encode_keyed
from .compressors.base import Compressor, Payload

log = logging.getLogger("commpress")


class ErrorFeedback(Compressor):
    """Wraps ``compressor``; itself a Compressor with the same wire format and aggregation.

    Per ``key``: ``c = x + beta * e`` (fp32 when ``x`` is half precision);
    the payload is ``compressor.compress(c)`` (``c`` cast back to ``x``'s dtype);
    then ``e = c - decompress(payload)``.  So ``decompress(payload) + e_after ==
    x + beta * e_before``.  Residuals are fp32, shaped like the input, allocated
    once per key and updated in place.  When ``c`` or the decoded payload holds a
    NaN/inf, the payload still carries it (so AMP's GradScaler sees it) and the
    residual keeps its old value.  For fp32 input to a sparsifier the residual
    is written in the same pass as the selection (same result as the generic path).
    """

    unbiased = False

    def __init__(self, compressor: Compressor, beta: float = 1.0) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a Compressor, got {type(compressor).__name__}")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be a number in [0, 1], got {beta!r}")
        self.compressor = compressor
        self.beta = float(beta)
        self.name = f"ef({compressor.name})"
        self.aggregation = compressor.aggregation
        self.deterministic = compressor.deterministic
        self.supported_dtypes = compressor.supported_dtypes
        self._config = {"compressor": compressor.name, "params": compressor.config(), "beta": beta}
        self._residuals: dict[Any, torch.Tensor] = {}

    def residual(self, key: Any) -> torch.Tensor | None:
        """The stored fp32 residual for ``key`` (the live buffer), or ``None``."""
        return self._residuals.get(key)

    def _buffer(self, key: Any, like: torch.Tensor) -> torch.Tensor:
        r = self._residuals.get(key)
        if r is None or r.numel() != like.numel() or r.device != like.device:
            if r is not None:
                log.debug("error feedback: key %r changed size; residual reset", key)
            r = self._residuals[key] = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
        elif r.shape != like.shape:
            r = self._residuals[key] = r.view(like.shape)
        return r

    def compensate(self, tensor: torch.Tensor, key: Any) -> torch.Tensor:
        """``tensor + beta * residual(key)``, same shape; fp32 for half-precision input."""
        r = self._residuals.get(key)
        t = tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor
        if r is None or r.numel() != tensor.numel() or r.device != tensor.device:
            return t
        return torch.add(t, r.view(tensor.shape), alpha=self.beta)

    def update(self, key: Any, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        """``residual(key) = compensated - sent`` in place, unless either is non-finite."""
        if not (all_finite(compensated) and all_finite(sent)):
            log.debug("error feedback: non-finite values for key %r; residual kept", key)
            return
        r = self._buffer(key, compensated)
        torch.sub(compensated.reshape(r.shape).float(), sent.reshape(r.shape).float(), out=r)

    def compress(self, tensor, *, step=0, key=0, generator=None) -> Payload:
        self.check_input(tensor)
        c = self.compensate(tensor, key)
        inner = self.compressor
        if isinstance(inner, SparseCompressor) and tensor.dtype == torch.float32:
            if all_finite(c):
                c = c.contiguous()
                return inner.compress_with_residual(c, self._buffer(key, c), step=step, key=key)
            log.debug("error feedback: non-finite values for key %r; residual kept", key)
            return inner.compress(c, step=step, key=key, generator=generator)
        payload = inner.compress(c.to(tensor.dtype), step=step, key=key, generator=generator)
        self.update(key, c, inner.decompress(payload))
        return payload

    def decompress(self, payload: Payload) -> torch.Tensor:
        return self.compressor.decompress(payload)

    def reset(self) -> None:
        """Forget every residual (the inner compressor's state is kept)."""
        self._residuals.clear()

    def state_dict(self) -> dict[str, Any]:
        """``{"beta", "residuals": {"keys", "tensors"}, "compressor": inner state}``."""
        return {"beta": self.beta, "residuals": encode_keyed(self._residuals),
                "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or set(state) != {"beta", "residuals", "compressor"}:
            raise ValueError("error feedback state must have keys 'beta', 'residuals', 'compressor'")
        residuals = decode_keyed(state["residuals"], "error feedback residuals")
        self.compressor.load_state_dict(state["compressor"])
        self._residuals = {k: r.float().clone() for k, r in residuals.items()}
