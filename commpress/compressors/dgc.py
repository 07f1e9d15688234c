"""``dgc``: Deep-Gradient-Compression-style top-k with a sampled threshold (Lin et al., 2018)."""

from __future__ import annotations

import math

import torch

from .. import ops
from ._sparse import SparseCompressor, capped_by_threshold, restore_below
from ._util import (DEFAULT_DENSITY_START, check_ratio, check_warmup, mix_seed,
                    num_keep, stable_hash, warmup_ratio)
from .base import register
from .threshold import has_nan

#: The sample is made big enough that about this many sampled entries pass the
#: threshold, so the estimate's relative error is ~1/sqrt(64) = 12.5% or less.
MIN_SAMPLE_HITS = 64


@register("dgc")
class DGC(SparseCompressor):
    """Approximate top-k: keeps ``c`` entries with ``ceil(0.8k) <= c <= floor(1.25k)``.

    ``k = max(1, round(ratio*numel))``.  The threshold is the k-th largest
    ``|x|`` of a strided sample of ``m = max(sample_ratio*numel, 64*numel/k)``
    entries (start offset a pure function of ``(step, key)``), scaled to the
    sample size; entries ``>= threshold`` are selected with
    :func:`commpress.ops.threshold_compact`.  Refinement keeps the count in range:

    * too many candidates: exact top-k among the candidates (exactly ``k`` kept);
    * too few: retry with the sample's ``2x``-quantile threshold (then top-k among
      its candidates if needed); if still too few, exact top-k.

    So the kept count is always within ±20% of ``k`` (for ``k < 5`` that means
    exactly ``k``).  When the sample would be at least half the tensor, or the
    tensor holds a NaN (which never passes a threshold), exact top-k is used.
    Wire: ``(indices int32, values)``.  Deterministic, biased.

    Fixed-size wire (the collectives): ``capacity = floor(1.25 k)`` slots, the
    largest entries at or above the sampled threshold (computed on the device);
    no refinement round, so fewer than ``0.8 k`` may be sent when the estimate
    is high.  What is not sent stays in the error-feedback residual.

    Density warm-up: as :class:`~commpress.compressors.topk.TopK`, ``k`` follows
    ``ratio_at(step)`` during the first ``density_warmup`` steps (from
    ``density_start`` down to ``ratio``); ``density_warmup=0`` (the default) turns it off;
    the hooks turn it on for a sparsifier built from a name.
    """

    def __init__(self, ratio: float, sample_ratio: float = 0.01, density_warmup: int = 0,
                 density_start: float = DEFAULT_DENSITY_START) -> None:
        self.ratio = check_ratio(ratio)
        self.sample_ratio = check_ratio(sample_ratio, "sample_ratio")
        self.density_warmup, self.density_start = check_warmup(density_warmup, density_start)

    def ratio_at(self, step: int) -> float:
        """The density at ``step`` (``ratio`` after the warm-up)."""
        return warmup_ratio(self.ratio, step, self.density_warmup, self.density_start)

    def _k(self, numel: int, step: int | None) -> int:
        return num_keep(self.ratio if step is None else self.ratio_at(step), numel)

    def capacity(self, numel: int, step: int | None = None) -> int:
        k = self._k(numel, step)
        return min(numel, max(k, math.floor(1.25 * k)))

    def _sample(self, flat, k: int, step, key, residual=None, beta: float = 1.0,
                scale: float = 1.0, velocity=None) -> tuple[torch.Tensor | None, int]:
        """The strided sample of ``|x|`` (``None`` when it would be half the tensor) and its hit
        count; with ``residual`` (error feedback fused) of ``|x*scale + beta*residual|``; with
        ``velocity`` (momentum correction fused) of ``|u + beta*residual|``, ``u`` the sampled
        entries' velocity, computed as the whole tensor's is
        (:func:`commpress.ops.reference.accumulate_velocity`)."""
        n = flat.numel()
        m = min(n, max(math.ceil(self.sample_ratio * n), math.ceil(MIN_SAMPLE_HITS * n / k)))
        if 2 * m >= n:
            return None, 0
        stride = n // m
        offset = mix_seed(step, stable_hash(key)) % stride
        xs = flat[offset::stride][:m]
        if velocity is not None:
            live, momentum, _ = velocity   # contiguous copies: torch's ops round them as the whole tensor
            live = None if live is None else live.view(-1)[offset::stride][:m].contiguous()
            xs = ops.reference.accumulate_velocity(xs.contiguous(), scale, live, momentum,
                                                   torch.empty(m, device=flat.device))
            scale = 1.0
        if residual is None and scale == 1.0:
            return xs.float().abs(), max(1, round(k * m / n))
        r = None if residual is None else residual[offset::stride][:m]
        c = ops.reference.compensated(xs, r, beta, scale)
        return c.abs(), max(1, round(k * m / n))

    fused_feedback = True
    fused_velocity = True

    def fuses_feedback(self, tensor: torch.Tensor, fixed: bool = True) -> bool:
        """The fixed-size wire of fp32 CPU input: the compensation is fused into its
        top-``capacity`` pass (:func:`commpress.ops.topk_compact_feedback`); CUDA keeps its
        kernels' path, and the variable-size wire (threshold refinement) the generic one."""
        return (self.fused_feedback and fixed and tensor.dtype == torch.float32
                and tensor.device.type == "cpu")

    def compress_feedback(self, tensor: torch.Tensor, residual: torch.Tensor | None, beta: float,
                          pending: torch.Tensor, *, step: int = 0, key=0, fixed: bool = False,
                          scale: float = 1.0, velocity=None):
        """Error feedback: the payload of ``c = tensor*scale + beta*residual`` (``None``: zero)
        and ``pending`` := ``c`` minus what was sent; returns ``(payload, finite)``.

        Fixed-size wire: one pass (:func:`commpress.ops.topk_compact_feedback` for the
        ``capacity`` largest, the threshold from a sample compensated on its own); a NaN/inf
        of ``c`` always ranks in the capacity and is never below the threshold, so ``finite``
        reads the sent values.  The variable-size wire compensates into ``pending`` first
        and scans it for the verdict (error feedback does not fuse it: :meth:`fuses_feedback`).
        ``velocity``: momentum correction in the same pass (fixed-size wire only).
        """
        self.check_input(tensor)
        flat = tensor.reshape(-1)
        pend = pending.view(-1)
        if not fixed:
            if velocity is not None:
                raise ValueError("dgc: the velocity is fused on the fixed-size wire only (fuses_velocity)")
            pend.copy_(ops.reference.compensated(flat, residual, beta, scale))
            idx, values = self.select_with_residual(pend, pend, step=step, key=key)
            finite = torch.isfinite(pend.sum(dtype=torch.float32))
            return self.make_payload(tensor, (idx, values)), finite
        n = flat.numel()
        k = self._k(n, step)
        cap = self.capacity(n, step)
        r = None if residual is None else residual.view(-1)
        sample, hits = self._sample(flat, k, step, key, r, beta, scale, velocity) if k else (None, 0)
        if sample is None:  # small tensor: exact top-k, padded to the capacity
            idx, values = ops.topk_compact_feedback(flat, r, beta, k, pend, scale=scale, velocity=velocity)
            pad = cap - idx.numel()
            idx = torch.cat([idx, torch.full((pad,), n, dtype=idx.dtype, device=idx.device)])
            values = torch.cat([values, values.new_zeros(pad)])
        else:
            t = torch.topk(torch.nan_to_num(sample, nan=float("inf")), hits).values[hits - 1]
            idx, values = ops.topk_compact_feedback(flat, r, beta, cap, pend, scale=scale, velocity=velocity)
            idx, values = restore_below(pend, idx, values, t)
        finite = torch.isfinite(values.sum(dtype=torch.float32))
        return self.make_payload(tensor, (idx, values)), finite

    def select_fixed(self, flat, residual, *, step, key):
        n = flat.numel()
        k = self._k(n, step)
        cap = self.capacity(n, step)
        sample, hits = self._sample(flat, k, step, key) if k else (None, 0)
        if sample is None:  # small tensor: exact top-k, padded to the capacity
            idx, values = ops.topk_compact(flat, k, residual=residual)
            pad = cap - idx.numel()
            return (torch.cat([idx, torch.full((pad,), n, dtype=idx.dtype, device=idx.device)]),
                    torch.cat([values, values.new_zeros(pad)]))
        # the hits-th largest sampled magnitude (NaN sorts first: then nothing is below it)
        t = torch.topk(torch.nan_to_num(sample, nan=float("inf")), hits).values[hits - 1]
        return capped_by_threshold(self, flat, cap, t, residual)

    def select(self, flat, *, step, key):
        n = flat.numel()
        k = self._k(n, step)
        if k == 0:
            return ops.topk_compact(flat, 0)
        sample, hits = self._sample(flat, k, step, key)
        if sample is None or has_nan(flat):
            return ops.topk_compact(flat, k)
        lo, hi = math.ceil(0.8 * k), math.floor(1.25 * k)
        top = torch.topk(sample, min(sample.numel(), 2 * hits + 8)).values
        for t in (top[hits - 1], top[-1]):
            idx, values = ops.threshold_compact(flat, float(t))
            count = idx.numel()
            if count > hi:
                keep, values = ops.topk_compact(values, k)
                return idx[keep.long()], values
            if count >= lo:
                return idx, values
        return ops.topk_compact(flat, k)
