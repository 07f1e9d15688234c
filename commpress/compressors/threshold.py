"""``threshold``: keep every entry with ``|x| >= threshold`` (and every NaN)."""

from __future__ import annotations

import torch

from .. import ops
from ._sparse import SparseCompressor, capped_by_threshold
from ._util import check_nonneg, check_ratio, num_keep
from .base import register
from ..ops.reference import index_dtype


def has_nan(flat: torch.Tensor) -> bool:
    """True when ``flat`` may hold a NaN (one fp32 sum; inf - inf also answers True)."""
    return bool(torch.isnan(flat.sum(dtype=torch.float32)))


def nan_inclusive_select(flat: torch.Tensor, threshold: float):
    """Indices/values of ``|x| >= threshold`` or NaN: the rare path for NaN input."""
    mask = (flat.float().abs() >= threshold) | torch.isnan(flat)
    idx = mask.nonzero().reshape(-1)
    return idx.to(index_dtype(flat.numel())), flat[idx].clone()


@register("threshold")
class Threshold(SparseCompressor):
    """Keeps ``|x| >= threshold`` (computed in fp32) via :func:`commpress.ops.threshold_compact`.

    NaN entries are kept too (so they reach the receiver); detecting them costs
    one extra reduction pass.  The kept count depends on the data.  Wire:
    ``(indices int32, values)``, ``count * (4 + itemsize)`` bytes.  Biased.

    In the collectives (fixed-size wire) at most ``max_ratio * numel`` entries
    are sent per tensor, the largest first; the rest stay in the error-feedback
    residual (without error feedback they are dropped, and counted when
    ``count_overflow`` is on).
    """

    def __init__(self, threshold: float, max_ratio: float = 0.05) -> None:
        self.threshold = check_nonneg("threshold", threshold)
        self.max_ratio = check_ratio(max_ratio, "max_ratio")

    def capacity(self, numel: int, step: int | None = None) -> int:
        return num_keep(self.max_ratio, numel)

    def select_fixed(self, flat, residual, *, step, key):
        return capped_by_threshold(self, flat, self.capacity(flat.numel()), self.threshold, residual)

    def select(self, flat, *, step, key):
        if has_nan(flat):
            return nan_inclusive_select(flat, self.threshold)
        return ops.threshold_compact(flat, self.threshold)

    def select_with_residual(self, flat, residual, *, step, key):
        if has_nan(flat):
            return super().select_with_residual(flat, residual, step=step, key=key)
        return ops.threshold_compact(flat, self.threshold, residual=residual)
