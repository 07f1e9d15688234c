"""The PowerSGD protocol (Vogels et al., 2019) for ``"lowrank"`` compressors.

For a matrix-shaped tensor ``M`` (the compressor decides through
``is_compressed(tensor)``; the answer depends only on the shape, so it is the
same on every rank):

1. ``P = compressor.begin(M, key)``  — ``M Q`` with the warm-started ``Q`` of ``key``;
2. ``all_reduce(P)`` (sum);
3. ``Q = compressor.middle(M, P, key)`` — orthogonalizes ``P`` in place, returns ``Mᵀ P̂``;
4. ``all_reduce(Q)`` (sum);
5. ``compressor.end(P̂, Q, key, shape, dtype)`` — ``P̂ Qᵀ``, the **sum** over ranks of
   the rank-r approximations ``P̂ P̂ᵀ M_i`` (it also keeps ``Q`` as the warm start).

On the wire: two all_reduces of ``(n + m) r`` fp32 words in total for an
``n x m`` matrix.  Tensors the compressor does not compress (vectors, small
matrices) are all-reduced as they are.

Error feedback (``compressor`` a :class:`commpress.ErrorFeedback`):
``M = compensate(tensor, key)`` before step 1 and ``update(key, M, out / P)``
after step 5, i.e. the residual is ``M_i - aggregate / P`` (what PyTorch's
``powerSGD_hook`` keeps; summed over ranks it is exactly the mass the
aggregate missed, so no gradient is lost).  The paper's per-rank alternative
``M_i - P̂ Q_iᵀ`` would need a second reconstruction per step.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _comm
from .accounting import CommStats
from .core import ALLREDUCE_ALGORITHMS, _header_check, _is_feedback, unwrap


def powersgd_allreduce(tensor: torch.Tensor, compressor: Any, *, group=None, key: Any = 0, step: int = 0,
                       algorithm: str = "auto", stats: CommStats | None = None,
                       validate: bool = True) -> torch.Tensor:
    """Summed rank-r approximation of ``tensor`` over ranks via the PowerSGD protocol (see module doc).

    Returns ``tensor``'s shape and dtype, identical on every rank.
    """
    _header_check(tensor, compressor, "lowrank", algorithm, ALLREDUCE_ALGORITHMS["lowrank"], group, stats,
                  validate, "powersgd_allreduce")
    world = _comm.world(group)
    inner = unwrap(compressor)
    ef = compressor if _is_feedback(compressor) else None
    if not inner.is_compressed(tensor):
        out = tensor.detach().clone().contiguous()
        _comm.all_reduce_(out, group=group, stats=stats)
        if stats is not None:
            stats.add(calls=1, algorithm="allreduce" if world > 1 else "local")
        return out
    m = ef.compensate(tensor, key) if ef is not None else tensor
    p = inner.begin(m, key)
    _comm.all_reduce_(p, group=group, stats=stats)
    q = inner.middle(m, p, key)
    _comm.all_reduce_(q, group=group, stats=stats)
    out = inner.end(p, q, key, tensor.shape, tensor.dtype)
    if ef is not None:
        ef.update(key, m, out / world)
    if stats is not None:
        stats.add(calls=1, algorithm="powersgd" if world > 1 else "local")
    return out
