"""Cross-rank checks: bad input raises the same exception on every rank, never a hang.

The steady-state collectives carry their status inside the payload
(:mod:`commpress.collectives.wire`).  The *header* below is exchanged only
where static facts must first be agreed: the first call of a collective for a
given key and signature (:func:`check_once`: numel, dtype, algorithm, kind,
compressor configuration and the cost model for ``"auto"``), and every call of
the variable-size sparse algorithms (``"split"``, ``"hashed"``,
``"recursive_doubling"`` of :func:`~commpress.collectives.sparse.sparse_allreduce`),
which also need the counts.  One small fixed-size int64 header per rank, one
``all_gather``.  The header holds:

====  =====================================================================
slot  content
====  =====================================================================
0     error code of this rank's local checks (0 = ok, see :data:`ERRORS`)
1     ``numel``
2     dtype code of the values / tensor
3     algorithm code (index in :data:`ALGORITHM_CODES`)
4     kind of collective (sparse / sum / gather / lowrank / reduce_scatter)
5     CRC32 of the compressor's name and configuration
6     this rank's entry count ``k`` (sparse) or payload size (gather)
7     cost-model state for ``"auto"`` (see :func:`~commpress.collectives.costmodel.model_state`)
8..   per-call extras: per-owner counts, payload sizes, a union sketch
====  =====================================================================

Its length, ``HEADER_FIXED + 4*P + SKETCH``, depends only on the group size, so
ranks that disagree about everything else still complete the exchange.  Then
every rank applies the same test to the same gathered table and, when any rank
reported bad input or any field differs between ranks, all ranks raise
``ValueError`` together.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _comm
from .accounting import CommStats
from .costmodel import model_state
from .wire import (E_DTYPE, E_DUPLICATE, E_LENGTH, E_RANGE, E_SHAPE, ERRORS, HEADER_FIXED, SKETCH,
                   CollectiveInputError)

__all__ = ["ERRORS", "HEADER_FIXED", "SKETCH", "CollectiveInputError", "check_once", "exchange_header",
           "make_header", "header_len", "check_sparse_local", "dtype_code"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64,
          torch.int32, torch.int64, torch.uint8, torch.int8, torch.int16)

ALGORITHM_CODES = ("auto", "allgather", "recursive_doubling", "split", "hashed", "dense",
                   "two_phase", "gather_all", "allreduce", "powersgd", "local")

KINDS = ("sparse", "sum", "gather", "lowrank", "reduce_scatter")


def dtype_code(dtype: Any) -> int:
    return DTYPES.index(dtype) if dtype in DTYPES else -1


def header_len(world: int) -> int:
    return HEADER_FIXED + 4 * world + SKETCH


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
    h[0] = error
    h[1] = numel
    h[2] = dtype_code(dtype)
    h[3] = ALGORITHM_CODES.index(algorithm) if algorithm in ALGORITHM_CODES else -1
    h[4] = KINDS.index(kind)
    h[5] = config
    h[6] = count
    if algorithm == "auto":
        h[7] = model_state(group)
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
    errs = table[:, 0].tolist()
    bad = [r for r, e in enumerate(errs) if e]
    if bad:
        detail = "; ".join(f"rank {r}: {ERRORS.get(int(errs[r]), 'error')}" for r in bad)
        mine = f" (this rank: {local_message})" if errs[me] and local_message else ""
        raise CollectiveInputError(f"{what}: bad input on rank(s) {bad}: {detail}{mine}")
    names = {1: "numel", 2: "dtype", 3: "algorithm", 4: "collective kind", 5: "compressor/configuration"}
    for slot, name in names.items():
        col = table[:, slot].tolist()
        if len(set(col)) > 1:
            shown = col
            if slot == 2:
                shown = [str(DTYPES[c]) if 0 <= c < len(DTYPES) else "?" for c in col]
            elif slot == 3:
                shown = [ALGORITHM_CODES[c] if 0 <= c < len(ALGORITHM_CODES) else "?" for c in col]
            elif slot == 4:
                shown = [KINDS[c] for c in col]
            raise CollectiveInputError(f"{what}: {name} differs across ranks: {shown}")


# ---------------------------------------------------------------- once per signature
_CHECKED = _comm.BoundedCache(4096)   # (group key, key, facts) -> every rank's cost-model state


def check_once(group, key: Any, facts: tuple, *, device: torch.device, error: int = 0, numel: int = 0,
               dtype: Any = None, algorithm: str = "auto", kind: str = "sparse", config: int = 0,
               stats: CommStats | None = None, local_message: str = "", what: str = "collective"
               ) -> list[int] | None:
    """The header exchange, the first time ``(group, key, facts)`` is seen (a collective).

    Returns every rank's cost-model state (slot 7) when the exchange ran, ``None``
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
    states = table[:, 7].tolist()
    _CHECKED.put(k, states)
    return states
