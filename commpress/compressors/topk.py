"""``topk``: keep exactly the k largest-magnitude entries."""

from __future__ import annotations

from .. import ops
from ._sparse import SparseCompressor
from ._util import check_ratio, num_keep
from .base import register


@register("topk")
class TopK(SparseCompressor):
    """Exact top-k by magnitude, ``k = max(1, round(ratio*numel))`` (0 for an empty tensor).

    Magnitude order is :func:`commpress.ops.topk_compact`'s: NaN > inf > finite,
    ties to the lower index, so non-finite entries are always kept (up to ``k``).
    Wire: ``(indices int32, values)``, ``k * (4 + itemsize)`` bytes.  Biased: use
    with :class:`commpress.ErrorFeedback`.
    """

    #: every fixed-size slot holds a selected entry (never the padding index ``numel``)
    fills_capacity = True
    #: NaN/inf rank above every finite value, so a non-finite input always shows in the values
    keeps_nonfinite = True

    def __init__(self, ratio: float) -> None:
        self.ratio = check_ratio(ratio)

    def capacity(self, numel: int) -> int:
        return num_keep(self.ratio, numel)

    def select(self, flat, *, step, key):
        return ops.topk_compact(flat, num_keep(self.ratio, flat.numel()))

    def select_with_residual(self, flat, residual, *, step, key):
        return ops.topk_compact(flat, num_keep(self.ratio, flat.numel()), residual=residual)
