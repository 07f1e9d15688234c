"""Switching a bucket's compressor without losing what error feedback still owes.

A bucket that leaves a kind with error feedback (topk, blockquant, powersgd) holds a
residual: what this rank computed but did not send yet (and, with momentum
correction, a velocity).  :func:`take_residual` removes it from the old
:class:`~commpress.feedback.ErrorFeedback` as a flat :class:`Carry` of the bucket's
size; :func:`fold_residual` then hands it to the new kind:

* new kind with error feedback on the flat path: added to its residual under the
  bucket's key, so its next compress sends ``x + beta * (old residual)``;
* otherwise (dense, bf16, or the two-level path whose residuals are per shard):
  returned, and the caller adds it to the bucket's next gradient before sending.

Either way ``sum of what was sent + residual left`` equals ``sum of the inputs + the
residual carried in`` on every rank (``beta = 1``), so nothing is lost.  A velocity
can only go to a new kind with momentum correction (the optimizer has none):
``ValueError`` otherwise.  Keys: the flat path keeps a bucket's residual under its
key, the two-level path under ``("shard", key, j)`` for the shard ``j`` this rank owns
(pass ``offset`` = the shard's start, :func:`commpress.collectives.hierarchy.shard_bounds`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..feedback import ErrorFeedback


@dataclass
class Carry:
    """A bucket's residual and velocity on the way to its new compressor: flat fp32
    tensors of the bucket's numel (zeros where nothing was owed), or ``None``."""

    residual: torch.Tensor | None = None
    velocity: torch.Tensor | None = None


def _place(dst: torch.Tensor | None, src: torch.Tensor, numel: int, offset: int) -> torch.Tensor:
    flat = src.detach().reshape(-1).float()
    if offset < 0 or offset + flat.numel() > numel:
        raise ValueError(f"take_residual: {flat.numel()} entries at offset {offset} do not fit a bucket of {numel}")
    if dst is None:
        dst = torch.zeros(numel, dtype=torch.float32, device=flat.device)
    dst[offset:offset + flat.numel()].add_(flat.to(dst.device))
    return dst


def take_residual(feedback: ErrorFeedback | None, key: Any, numel: int, offset: int = 0,
                  into: Carry | None = None) -> Carry:
    """Remove ``key``'s residual and velocity from ``feedback`` and add them into ``into``
    (a new :class:`Carry` when ``None``) at ``offset`` of a bucket of ``numel`` elements.
    ``feedback=None`` (the old kind had no error feedback) carries nothing."""
    carry = into if into is not None else Carry()
    if feedback is None:
        return carry
    if not isinstance(feedback, ErrorFeedback):
        raise TypeError(f"take_residual: feedback must be an ErrorFeedback or None, got {type(feedback).__name__}")
    residual, velocity = feedback.take(key)
    if residual is not None:
        carry.residual = _place(carry.residual, residual, numel, offset)
    if velocity is not None:
        carry.velocity = _place(carry.velocity, velocity, numel, offset)
    return carry


def fold_residual(carry: Carry, feedback: ErrorFeedback | None, key: Any = None) -> torch.Tensor | None:
    """Hand ``carry`` to the new kind; returns what the caller must add to the bucket's next
    gradient (``None`` when everything went into ``feedback``'s residual under ``key``).

    ``feedback``: the new kind's error feedback on the flat path, or ``None`` (dense, bf16,
    two-level: the residual is returned).  A velocity needs ``feedback`` with momentum
    correction: ``ValueError`` otherwise (the momentum would be lost).
    """
    if carry.velocity is not None and (feedback is None or not feedback.momentum):
        raise ValueError("fold_residual: the old compressor kept a momentum-correction velocity; the new one "
                         "must be an ErrorFeedback with momentum > 0 on the flat path, or the momentum is lost")
    if feedback is None:
        return carry.residual
    if not isinstance(feedback, ErrorFeedback):
        raise TypeError(f"fold_residual: feedback must be an ErrorFeedback or None, got {type(feedback).__name__}")
    feedback.absorb(key, carry.residual, carry.velocity)
    return None
