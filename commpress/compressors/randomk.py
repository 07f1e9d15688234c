"""``randomk``: k shared-random entries, scaled by numel/k (unbiased)."""

from __future__ import annotations

from collections import OrderedDict

import torch

from .. import ops
from ..ops.reference import index_dtype
from ._util import (DEFAULT_DENSITY_START, check_int, check_ratio, check_warmup, mix_seed,
                    num_keep, propagate_nonfinite, stable_hash, warmup_ratio)
from .base import Compressor, Payload, register

_CACHE_SIZE = 32


def random_indices(seed64: int, numel: int, k: int, device: torch.device) -> torch.Tensor:
    """``k`` distinct indices in ``[0, numel)``, ascending, uniform over k-subsets.

    A pure function of ``(seed64, numel, k)``: draws come from
    :func:`commpress.ops.counter_bits` (48 bits per draw), duplicates are dropped
    keeping the first occurrence, more draws are made until ``k`` are distinct.
    For ``k > numel/2`` the ``numel - k`` excluded indices are drawn instead.
    """
    return _to_device(_host_indices(seed64, numel, k), torch.device(device))


def _to_device(idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The host-drawn indices on ``device``: through pinned memory without a wait on CUDA
    (a pageable copy would synchronise the host with the device at every step)."""
    if device.type == "cuda":
        return idx.pin_memory().to(device, non_blocking=True)
    return idx.to(device)


def _host_indices(seed64: int, numel: int, k: int) -> torch.Tensor:
    """:func:`random_indices` on the host (CPU tensors: the loop's counts read no device)."""
    if 2 * k > numel:
        drop = _host_indices(seed64, numel, numel - k)
        keep = torch.ones(numel, dtype=torch.bool)
        keep[drop.long()] = False
        return keep.nonzero().reshape(-1).to(index_dtype(numel))
    if k == 0:
        return torch.zeros(0, dtype=index_dtype(numel))
    drawn = torch.zeros(0, dtype=torch.int64)
    start, need = 0, k
    while True:
        m = need + need // 8 + 16
        bits = ops.counter_bits(seed64, 2 * start, 2 * m).reshape(m, 2)
        drawn = torch.cat([drawn, ((bits[:, 0] << 24) | bits[:, 1]) % numel])
        start += m
        values, positions = torch.sort(drawn, stable=True)
        first = torch.ones_like(values, dtype=torch.bool)
        first[1:] = values[1:] != values[:-1]
        distinct = int(first.sum())
        if distinct >= k:
            values, positions = values[first], positions[first]  # distinct, ascending
            if distinct > k:  # keep the k whose first draw came earliest
                kth = torch.kthvalue(positions, k).values
                values = values[positions <= kth]
            return values.to(index_dtype(numel))
        need = k - distinct


@register("randomk")
class RandomK(Compressor):
    """Random-k with shared indices: ``k = max(1, round(ratio*numel))`` (0 when empty).

    The indices are a pure function of ``(seed, step, key, numel)`` (``key`` hashed
    with ``zlib.crc32(repr(key))``), identical on every rank, so they are not
    sent: wire = the ``k`` values ``x[indices]`` in the input dtype, ``k*itemsize``
    bytes, and payloads add elementwise (aggregation ``"sum"``).  The receiver
    recomputes the indices from ``payload.meta`` (``seed``, ``step``, ``key``, ``k``)
    and scales by ``numel/k``, so ``E[decompress] = x`` (a product beyond the fp32 range
    saturates at its maximum).  If the tensor holds a NaN/inf, every sent value becomes NaN
    (one extra reduction pass), so non-finite gradients are never hidden.

    Density warm-up: as :class:`~commpress.compressors.topk.TopK`, ``k`` follows
    ``ratio_at(step)`` during the first ``density_warmup`` steps (from
    ``density_start`` down to ``ratio``; fewer early steps with a 100x variance);
    ``density_warmup=0`` (the default) turns it off;
    the hooks turn it on for a sparsifier built from a name.
    """

    aggregation = "sum"
    unbiased = True
    deterministic = True

    def __init__(self, ratio: float, seed: int = 0, density_warmup: int = 0,
                 density_start: float = DEFAULT_DENSITY_START) -> None:
        self.ratio = check_ratio(ratio)
        self.seed = check_int("seed", seed, 0, 2**63 - 1)
        self.density_warmup, self.density_start = check_warmup(density_warmup, density_start)
        self._cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def ratio_at(self, step: int) -> float:
        """The density at ``step`` (``ratio`` after the warm-up)."""
        return warmup_ratio(self.ratio, step, self.density_warmup, self.density_start)

    def indices(self, numel: int, *, step: int, key, device=torch.device("cpu")) -> torch.Tensor:
        """The shared indices for a ``numel``-element tensor at ``(step, key)``."""
        k = num_keep(self.ratio_at(step), numel)
        seed64 = mix_seed(self.seed, step, stable_hash(key))
        cache_key = (seed64, numel, k, str(device))
        idx = self._cache.get(cache_key)
        if idx is None:
            idx = random_indices(seed64, numel, k, torch.device(device))
            self._cache[cache_key] = idx
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return idx

    def compress(self, tensor, *, step=0, key=0, generator=None) -> Payload:
        self.check_input(tensor)
        flat = tensor.reshape(-1)
        idx = self.indices(flat.numel(), step=step, key=key, device=flat.device)
        values = propagate_nonfinite(flat[idx.long()], flat) if idx.numel() else flat[:0].clone()
        return self.make_payload(tensor, (values,), seed=self.seed, step=step, key=key,
                                 k=idx.numel())

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        (values,) = payload.tensors
        n = payload.numel
        dst = self.decode_target(payload, out)
        dst = dst.zero_() if dst is not None else torch.zeros(n, dtype=torch.float32, device=values.device)
        if n:
            idx = self.indices(n, step=payload.meta["step"], key=payload.meta["key"],
                               device=values.device)
            ops.scatter_add_(dst, idx, _scaled(values.float(), n / idx.numel()))
        return self.finish_decode(payload, dst, out)


def _scaled(values: torch.Tensor, factor: float) -> torch.Tensor:
    """``values * factor`` (fp32), saturated at the fp32 maximum where a finite value's product
    overflows (so a finite payload decodes finite, and error feedback keeps the excess in its
    residual); NaN/inf values stay as they are.  Elementwise over the ``k`` values, decided on the
    device (no host read)."""
    out = values * factor
    big = torch.finfo(torch.float32).max
    return torch.where(torch.isinf(out) & torch.isfinite(values), out.clamp(-big, big), out)
