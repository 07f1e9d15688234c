"""DDP's gradients, lent to error feedback until the step's verdict (:mod:`commpress.loan`).

With ``gradient_as_bucket_view=False`` (DDP's default) a parameter's ``.grad`` is a tensor of
its own: DDP copies it into its bucket before the comm hook runs and copies the bucket's result
back into it only after the step's last hook (``Reducer::finalize_backward``).  Between the two,
that memory is not read: a unit's hook call may keep its residuals' old codes there until the
step's verdict, instead of a pending store as large as the residuals.  :func:`unlendable` names
what breaks that window; :func:`grad_loan` lends one unit's gradients.

The window needs every bucket's result to land after the step's verdict: the overlap worker
then completes the step's futures together at its end (DDP's finalize waits for them anyway).
"""

from __future__ import annotations

from typing import Any

import torch

from ..loan import Loan, byte_view


#: DDP's settings under which a gradient is not free until the step's end: (attribute, why)
_NOT_FREE = (
    ("gradient_as_bucket_view", "gradient_as_bucket_view=True (the gradients are the buckets)"),
    ("find_unused_parameters", "find_unused_parameters=True (DDP leaves an unused parameter's gradient as it was)"),
    ("static_graph", "static_graph=True (DDP may leave an unused parameter's gradient as it was)"),
    ("_use_python_reducer", "DDP's Python reducer"),
)


def unlendable(model: Any) -> str | None:
    """Why ``model``'s (a DDP model) gradients cannot be lent (``None``: they can)."""
    return next((why for attr, why in _NOT_FREE if getattr(model, attr, False)), None)


def grad_loan(grads: list[torch.Tensor | None], bucket: torch.Tensor) -> Loan | None:
    """A :class:`~commpress.loan.Loan` of ``grads`` (one unit's parameters' ``.grad``, the largest
    first), or ``None`` where one is missing, is not a plain contiguous tensor on ``bucket``'s
    device, or shares ``bucket``'s memory (a view of it)."""
    views = []
    shared = bucket.untyped_storage().data_ptr()
    for g in grads:
        if g is None or g.device != bucket.device or g.requires_grad:
            return None
        view = byte_view(g)
        if view is None or g.untyped_storage().data_ptr() == shared:
            return None
        views.append(view)
    # the largest first: a unit's lean stores (about a quarter of its gradients' bytes) then fill
    # a piece or two, so that saving and restoring them is a copy or two, not one per parameter
    views.sort(key=lambda v: -v.numel())
    return Loan(views) if views else None
