"""Base class of the sparsifiers whose payload is ``(indices, values)`` (aggregation "sparse")."""

from __future__ import annotations

import torch

from .. import ops
from .base import Compressor, Payload


class SparseCompressor(Compressor):
    """Keeps some entries of the flattened tensor.

    Wire (:meth:`compress`): ``(indices, values)``: unique ascending indices
    (int32 when ``numel < 2**31``, else int64) and the kept values in the input
    dtype, so ``nbytes == count * (4 + itemsize)``.  Decompression scatters the
    values into zeros.  Subclasses implement :meth:`select`; they may override
    :meth:`select_with_residual` with a fused single pass.

    Fixed-size wire (:meth:`compress_fixed`, what the collectives send):
    exactly :meth:`capacity` slots; a slot that holds no entry has index
    ``numel`` (one past the end) and value 0.  Entries the capacity cannot hold
    are not sent; with error feedback they stay in the residual.  Subclasses
    whose count is data-dependent override :meth:`select_fixed`; the default is
    :meth:`select`, correct for a count that depends only on ``numel``.
    """

    aggregation = "sparse"
    unbiased = False

    def select(self, flat: torch.Tensor, *, step: int, key) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices, values)`` of the entries of the 1-D ``flat`` to keep."""
        raise NotImplementedError

    def capacity(self, numel: int, step: int | None = None) -> int:
        """Slots of the fixed-size wire format for a ``numel``-element tensor at ``step``
        (``None``: after any density warm-up, the steady state)."""
        raise NotImplementedError

    def select_with_residual(self, flat: torch.Tensor, residual: torch.Tensor, *, step: int, key
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`select`; ``residual`` (fp32, same numel, may be ``flat`` itself)
        receives ``flat`` with the kept entries zeroed, exactly ``flat - decompress(payload)``."""
        idx, values = self.select(flat, step=step, key=key)
        r = residual.view(-1)
        if r.data_ptr() != flat.data_ptr():
            r.copy_(flat)
        r[idx.long()] = 0
        return idx, values

    #: Entries that passed the selection but did not fit the capacity while no residual
    #: kept them (error feedback off): a 0-d int64 tensor on the device, summed over calls
    #: (``None`` before the first such call).  Read it when you want it; nothing reads it per step.
    dropped: torch.Tensor | None = None

    def _count_dropped(self, n: torch.Tensor) -> None:
        self.dropped = n if self.dropped is None else self.dropped + n.to(self.dropped.device)

    def select_fixed(self, flat: torch.Tensor, residual: torch.Tensor | None, *, step: int, key
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``capacity(numel, step)`` slots (padding: index ``numel``, value 0), sync-free;
        ``residual`` as in :meth:`select_with_residual`."""
        if residual is None:
            return self.select(flat, step=step, key=key)
        return self.select_with_residual(flat, residual, step=step, key=key)

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

    def compress_fixed(self, tensor, *, step=0, key=0, generator=None) -> Payload:
        self.check_input(tensor)
        idx, values = self.select_fixed(tensor.reshape(-1), None, step=step, key=key)
        return self.make_payload(tensor, (idx, values))

    def compress_fixed_with_residual(self, tensor: torch.Tensor, residual: torch.Tensor, *,
                                     step: int = 0, key=0) -> Payload:
        """:meth:`compress_fixed` that also writes the residual (see :meth:`select_with_residual`)."""
        self.check_input(tensor)
        idx, values = self.select_fixed(tensor.reshape(-1), residual, step=step, key=key)
        return self.make_payload(tensor, (idx, values))

    def decompress(self, payload: Payload) -> torch.Tensor:
        idx, values = payload.tensors
        n = payload.numel
        out = torch.zeros(n + 1, dtype=torch.float32, device=values.device)  # slot n: padding
        if idx.numel():
            ops.scatter_add_(out, idx, values.float())
        return out[:n].to(payload.dtype).reshape(payload.shape)


def capped_by_threshold(owner: SparseCompressor, flat: torch.Tensor, capacity: int,
                        threshold: torch.Tensor | float, residual: torch.Tensor | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``capacity`` largest-magnitude entries of ``flat`` whose ``|x|`` is not below
    ``threshold`` (NaN passes), in ``capacity`` fixed slots, without a host read.

    The top-``capacity`` entries hold every passing entry when at most
    ``capacity`` pass, and the ``capacity`` largest otherwise; the ones below the
    threshold become padding (index ``numel``, value 0) and are put back into
    ``residual``, so only what is sent leaves it.  Without a residual the entries
    that passed but did not fit are counted in ``owner.dropped`` (one more pass).
    """
    idx, values = ops.topk_compact(flat, capacity, residual=residual)
    if residual is None:
        below = values.float().abs() < threshold
        passing = (~(flat.float().abs() < threshold)).sum()
        owner._count_dropped(passing - (~below).sum())
        n = flat.numel()
        return torch.where(below, torch.full_like(idx, n), idx), torch.where(below, torch.zeros_like(values), values)
    return restore_below(residual, idx, values, threshold)


def restore_below(residual: torch.Tensor, idx: torch.Tensor, values: torch.Tensor,
                  threshold: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected ``(idx, values)`` of a ``residual`` (numel ``n``, zero at ``idx``) with
    the entries whose ``|value|`` is below ``threshold`` put back into ``residual``
    (``0 + value``) and made padding (index ``n``, value 0); NaN is never below."""
    n = residual.numel()
    below = values.float().abs() < threshold
    if idx.numel():
        if residual.is_contiguous() and residual.dtype == torch.float32:
            if residual.device.type == "cpu":
                # only the entries put back (host memory: finding them syncs no device); adding
                # the others' 0 to their zeroed slots changes nothing and costs a scattered write each
                put = below.nonzero().view(-1)
                ops.scatter_add_(residual.view(-1), idx[put], values[put].float())
            else:
                ops.scatter_add_(residual.view(-1), idx, torch.where(below, values.float(), 0.0))
        else:
            residual.view(-1).index_put_((idx.long(),), torch.where(below, values.float(), 0.0),
                                         accumulate=True)
    idx = torch.where(below, torch.full_like(idx, n), idx)
    values = torch.where(below, torch.zeros_like(values), values)
    return idx, values
