"""``topk``: keep exactly the k largest-magnitude entries."""

from __future__ import annotations

import torch

from .. import ops
from ._sparse import SparseCompressor
from ._util import (DEFAULT_DENSITY_START, check_ratio, check_warmup, num_keep,
                    warmup_ratio)
from .base import register


@register("topk")
class TopK(SparseCompressor):
    """Exact top-k by magnitude, ``k = max(1, round(ratio*numel))`` (0 for an empty tensor).

    Magnitude order is :func:`commpress.ops.topk_compact`'s: NaN > inf > finite,
    ties to the lower index, so non-finite entries are always kept (up to ``k``).
    Wire: ``(indices int32, values)``, ``k * (4 + itemsize)`` bytes.  Biased: use
    with :class:`commpress.ErrorFeedback`.

    Density warm-up (DGC), off by default (``density_warmup=0``: every call sends
    ``ratio``): during the first ``density_warmup`` steps the ratio is
    :func:`~commpress.compressors._util.warmup_ratio` of the step, falling
    exponentially in stages from ``density_start`` (25%) to ``ratio``, so the
    early steps, whose gradients change fastest, are not starved; ``k`` (and the
    fixed wire's capacity) at a step is a pure function of ``(ratio, step, numel)``.
    The DDP and FSDP2 hooks turn it on (200 steps) for a sparsifier they build from
    a name, unless ``density_warmup=`` is given.
    """

    #: every fixed-size slot holds a selected entry (never the padding index ``numel``)
    fills_capacity = True
    #: NaN/inf rank above every finite value, so a non-finite input always shows in the values
    keeps_nonfinite = True

    def __init__(self, ratio: float, density_warmup: int = 0,
                 density_start: float = DEFAULT_DENSITY_START) -> None:
        self.ratio = check_ratio(ratio)
        self.density_warmup, self.density_start = check_warmup(density_warmup, density_start)

    def ratio_at(self, step: int) -> float:
        """The density at ``step`` (``ratio`` after the warm-up)."""
        return warmup_ratio(self.ratio, step, self.density_warmup, self.density_start)

    def capacity(self, numel: int, step: int | None = None) -> int:
        return num_keep(self.ratio if step is None else self.ratio_at(step), numel)

    def select(self, flat, *, step, key):
        return ops.topk_compact(flat, self.capacity(flat.numel(), step))

    def select_with_residual(self, flat, residual, *, step, key):
        return ops.topk_compact(flat, self.capacity(flat.numel(), step), residual=residual)

    fused_feedback = True
    fused_velocity = True

    #: fp32 on the CPU (:func:`commpress.ops.topk_compact_feedback`); CUDA keeps the
    #: compensate-then-select path of its kernels
    fused_feedback_devices = ("cpu",)

    def compress_feedback(self, tensor: torch.Tensor, residual: torch.Tensor | None, beta: float,
                          pending: torch.Tensor, *, step: int = 0, key=0, fixed: bool = False,
                          scale: float = 1.0, velocity=None):
        """Error feedback in one pass (:func:`commpress.ops.topk_compact_feedback`): the payload
        of ``c = tensor*scale + beta*residual`` (``residual`` ``None``: zero), and ``pending``
        := ``c`` with the sent entries zeroed.  The fixed-size wire is the same (every slot
        filled).  Returns ``(payload, finite)``: a NaN/inf in ``c`` is always among the
        values sent, so ``finite`` (0-d bool) reads the ``k`` values only.  ``velocity``: momentum
        correction in the same pass (``tensor*scale`` becomes the velocity first).
        """
        self.check_input(tensor)
        flat = tensor.reshape(-1)
        idx, values = ops.topk_compact_feedback(flat, residual, beta, self.capacity(flat.numel(), step),
                                                pending, scale=scale, velocity=velocity)
        finite = torch.isfinite(values.sum(dtype=torch.float32))
        return self.make_payload(tensor, (idx, values)), finite
