"""Cross-rank checks: bad input raises the same exception on every rank, never a hang.

The steady-state collectives carry their status inside the payload
(:mod:`commpress.collectives.wire`).  The *header* below is exchanged only
where static facts must first be agreed: the first call of a collective for a
given key and signature (:func:`check_once`: numel, dtype, algorithm, kind,
compressor configuration and the cost model for ``"auto"``), and every call of
the variable-size sparse algorithms (``"split"``, ``"hashed"``,
``"recursive_doubling"`` of :func:`~commpress.collectives.sparse.sparse_allreduce`),
which also need the counts.  One small fixed-size int64 header per rank, one
``all_gather``; its layout (slots, codes, extras) is :mod:`commpress.collectives.wire`'s.
Every rank applies the same test to the same gathered table and, when any rank
reported bad input or any field differs between ranks, all ranks raise
:class:`~commpress.collectives.wire.CollectiveInputError` (a ``ValueError``) together.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _comm
from .accounting import CommStats
from .costmodel import model_state
from .wire import (ALGORITHM_CODES, DTYPES, E_DTYPE, E_DUPLICATE, E_LENGTH, E_RANGE, E_SHAPE, ERRORS,
                   H_ALGORITHM, H_CONFIG, H_COUNT, H_DTYPE, H_ERROR, H_KIND, H_MODEL, H_NUMEL, HEADER_FIXED,
                   KINDS, SKETCH, CollectiveInputError, dtype_code, header_len)

__all__ = ["ERRORS", "HEADER_FIXED", "SKETCH", "CollectiveInputError", "check_once", "exchange_header",
           "make_header", "header_len", "check_sparse_local", "dtype_code"]


def check_sparse_local(indices: Any, values: Any, numel: Any, check_contents: bool = True) -> tuple[int, str]:
    """Local checks of one rank's sparse input: ``(error code, message)``; code 0 when fine.

    ``check_contents`` adds the O(k) range and uniqueness checks (one host sync).
    """
    if not isinstance(indices, torch.Tensor) or not isinstance(values, torch.Tensor):
        return E_DTYPE, "indices and values must be torch.Tensor"
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        return E_SHAPE, f"numel must be a non-negative int, got {numel!r}"
    if indices.dtype not in (torch.int32, torch.int64):
        return E_DTYPE, f"indices must be int32 or int64, got {indices.dtype}"
    if values.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        return E_DTYPE, f"values must be float32, float16, bfloat16 or float64, got {values.dtype}"
    if indices.dim() != 1 or values.dim() != 1:
        return E_SHAPE, f"indices and values must be 1-D, got shapes {tuple(indices.shape)} and {tuple(values.shape)}"
    if indices.numel() != values.numel():
        return E_LENGTH, f"len(indices)={indices.numel()} != len(values)={values.numel()}"
    if indices.device != values.device:
        return E_DTYPE, f"indices on {indices.device} but values on {values.device}"
    if check_contents and indices.numel():
        lo, hi = torch.aminmax(indices)
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= numel:
            return E_RANGE, f"indices must lie in [0, {numel}), got min {lo} max {hi}"
        if torch.unique(indices).numel() != indices.numel():
            return E_DUPLICATE, "indices must be unique within a rank"
    return 0, ""


def make_header(world: int, device: torch.device, *, error: int = 0, numel: int = 0,
                dtype: Any = None, algorithm: str = "auto", kind: str = "sparse",
                config: int = 0, count: int = 0, group=None) -> torch.Tensor:
    """A zeroed header with the fixed slots filled in (extras left zero)."""
    h = torch.zeros(header_len(world), dtype=torch.int64)
    h[H_ERROR] = error
    h[H_NUMEL] = numel
    h[H_DTYPE] = dtype_code(dtype)
    h[H_ALGORITHM] = ALGORITHM_CODES.index(algorithm) if algorithm in ALGORITHM_CODES else -1
    h[H_KIND] = KINDS.index(kind)
    h[H_CONFIG] = config
    h[H_COUNT] = count
    if algorithm == "auto":
        h[H_MODEL] = model_state(group)
    return h.to(device)


def exchange_header(header: torch.Tensor, *, group=None, stats: CommStats | None = None,
                    local_message: str = "", what: str = "collective") -> torch.Tensor:
    """All-gather the headers, then raise on every rank if any is bad or they disagree.

    Returns the gathered table as a CPU int64 tensor ``[P, L]``.
    """
    table = _comm.all_gather(header, group=group, stats=stats).cpu()
    check_table(table, local_message=local_message, what=what, me=_comm.rank(group))
    return table


def check_table(table: torch.Tensor, *, local_message: str = "", what: str = "collective", me: int = 0) -> None:
    """Raise :class:`CollectiveInputError` (same decision on every rank) for bad tables."""
    errs = table[:, H_ERROR].tolist()
    bad = [r for r, e in enumerate(errs) if e]
    if bad:
        detail = "; ".join(f"rank {r}: {ERRORS.get(int(errs[r]), 'error')}" for r in bad)
        mine = f" (this rank: {local_message})" if errs[me] and local_message else ""
        raise CollectiveInputError(f"{what}: bad input on rank(s) {bad}: {detail}{mine}")
    names = {H_NUMEL: "numel", H_DTYPE: "dtype", H_ALGORITHM: "algorithm", H_KIND: "collective kind",
             H_CONFIG: "compressor/configuration"}
    for slot, name in names.items():
        col = table[:, slot].tolist()
        if len(set(col)) > 1:
            shown = col
            if slot == H_DTYPE:
                shown = [str(DTYPES[c]) if 0 <= c < len(DTYPES) else "?" for c in col]
            elif slot == H_ALGORITHM:
                shown = [ALGORITHM_CODES[c] if 0 <= c < len(ALGORITHM_CODES) else "?" for c in col]
            elif slot == H_KIND:
                shown = [KINDS[c] for c in col]
            raise CollectiveInputError(f"{what}: {name} differs across ranks: {shown}")


# ---------------------------------------------------------------- once per signature
_CHECKED = _comm.BoundedCache(4096)   # (group key, key, facts) -> every rank's cost-model state


def check_once(group, key: Any, facts: tuple, *, device: torch.device, error: int = 0, numel: int = 0,
               dtype: Any = None, algorithm: str = "auto", kind: str = "sparse", config: int = 0,
               stats: CommStats | None = None, local_message: str = "", what: str = "collective"
               ) -> list[int] | None:
    """The header exchange, the first time ``(group, key, facts)`` is seen (a collective).

    Returns every rank's cost-model state (slot ``H_MODEL``) when the exchange ran, ``None``
    when it was done before.  Later calls with the same facts send nothing: their
    status travels in the payload.  A key whose facts change on one rank only
    must not be used (the ranks would disagree on whether to exchange); the hooks
    never do that.
    """
    k = (_comm.group_key(group), repr(key), facts)
    if k in _CHECKED and not error:
        return None
    if _comm.world(group) == 1:
        if error:
            raise CollectiveInputError(f"{what}: {local_message}")
        return None
    h = make_header(_comm.world(group), device, error=error, numel=numel, dtype=dtype, algorithm=algorithm,
                    kind=kind, config=config, group=group)
    table = exchange_header(h, group=group, stats=stats, local_message=local_message, what=what)
    states = table[:, H_MODEL].tolist()
    _CHECKED.put(k, states)
    return states
