"""``allreduce(tensor, compressor)``: compress, run the collective the compressor's
aggregation kind needs, decompress; returns the **sum** over ranks (not the mean),
bitwise identical on every rank.

========== ================================================================
aggregation collective
========== ================================================================
``sum``     ``all_reduce`` of each wire tensor of the payload, then ``decompress``
``sparse``  :func:`~commpress.collectives.sparse.sparse_allreduce` of (indices, values)
``gather``  :func:`~commpress.collectives.quantized.quantized_allreduce` (two-phase or all-gather)
``lowrank`` :func:`~commpress.collectives.lowrank.powersgd_allreduce`
========== ================================================================

Error feedback: ``compressor`` may be a :class:`commpress.ErrorFeedback` wrapping
the real compressor.  For ``sum``, ``sparse`` and ``gather`` its own ``compress``
runs (worker-side feedback: residual = compensated input - what this rank sent);
for ``lowrank`` see :mod:`~commpress.collectives.lowrank`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..compressors.base import Compressor, Payload
from . import _comm
from .accounting import CommStats
from .validate import CollectiveInputError, config_hash, exchange_header, make_header

ALLREDUCE_ALGORITHMS = {
    "sum": ("auto", "allreduce"),
    "gather": ("auto", "two_phase", "gather_all"),
    "lowrank": ("auto", "powersgd"),
}


def unwrap(compressor: Any) -> Any:
    """The real compressor behind an error-feedback wrapper (or the compressor itself)."""
    inner = compressor
    while _is_feedback(inner):
        inner = inner.compressor
    return inner


def _is_feedback(c: Any) -> bool:
    return all(hasattr(c, a) for a in ("compressor", "compensate", "update"))


def fingerprint(compressor: Any) -> int:
    """A hash of the compressor chain's names and configurations (compared across ranks)."""
    parts = []
    c = compressor
    while True:
        cfg = c.config() if hasattr(c, "config") else {}
        parts.append((type(c).__name__, getattr(c, "name", ""), sorted((k, repr(v)) for k, v in cfg.items())))
        if not _is_feedback(c):
            break
        c = c.compressor
    return config_hash(*parts)


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except RuntimeError:
        return False


def allreduce(tensor: torch.Tensor, compressor: Compressor, *, group=None, key: Any = 0, step: int = 0,
              algorithm: str = "auto", stats: CommStats | None = None,
              generator: torch.Generator | None = None, validate: bool = True) -> torch.Tensor:
    """Compressed sum of ``tensor`` over the ranks of ``group``, identical on every rank.

    ``key`` names the tensor (bucket index, parameter name) for per-tensor state:
    error-feedback residuals, PowerSGD warm starts, shared random seeds; ``step``
    is the training step.  ``algorithm`` is ``"auto"`` or one of the kind's
    algorithms (sparse: :data:`~commpress.collectives.sparse.SPARSE_ALGORITHMS`;
    gather: ``"two_phase"``, ``"gather_all"``; sum: ``"allreduce"``; lowrank:
    ``"powersgd"``).  ``validate=False`` skips the O(k) input checks and, for the
    ``sum`` and ``lowrank`` kinds, the cross-rank header exchange.
    Returns a tensor of ``tensor``'s shape and dtype.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"allreduce: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    inner = unwrap(compressor)
    kind = getattr(inner, "aggregation", None)
    if kind == "sparse":
        return _sparse_path(tensor, compressor, group, key, step, algorithm, stats, generator, validate)
    if kind == "gather":
        from .quantized import quantized_allreduce
        return quantized_allreduce(tensor, compressor, group=group, key=key, step=step, algorithm=algorithm,
                                   stats=stats, generator=generator, validate=validate)
    if kind == "lowrank":
        from .lowrank import powersgd_allreduce
        return powersgd_allreduce(tensor, compressor, group=group, key=key, step=step, algorithm=algorithm,
                                  stats=stats, validate=validate)
    if kind != "sum":
        raise TypeError(f"allreduce: compressor must be a commpress Compressor with aggregation in "
                        f"('sum', 'sparse', 'gather', 'lowrank'), got {compressor!r}")
    return _sum_path(tensor, compressor, group, key, step, algorithm, stats, generator, validate)


def _try_compress(compressor, tensor, step, key, generator):
    """``compressor.compress`` with its exception turned into an error report (raised on all ranks)."""
    try:
        return compressor.compress(tensor, step=step, key=key, generator=generator), (0, "")
    except Exception as exc:  # noqa: BLE001 - re-raised on every rank by the header check
        return None, (6, f"compress failed: {type(exc).__name__}: {exc}")


def _header_check(tensor, compressor, kind, algorithm, allowed, group, stats, validate, what, err=(0, "")):
    """Local checks + (when ``validate``) the cross-rank header exchange; raises together."""
    code, msg = err
    if code:
        pass
    elif algorithm not in allowed:
        code, msg = 6, f"algorithm must be one of {allowed}, got {algorithm!r}"
    elif tensor.dtype not in unwrap(compressor).supported_dtypes:
        code, msg = 4, f"dtype {tensor.dtype} not supported by {unwrap(compressor).name}"
    world = _comm.world(group)
    if world == 1 or not validate:
        if code:
            raise CollectiveInputError(f"{what}: {msg}")
        return
    h = make_header(world, _comm.comm_device(group, tensor), error=code, numel=tensor.numel(),
                    dtype=tensor.dtype, algorithm=algorithm, kind=kind, config=fingerprint(compressor),
                    group=group)
    exchange_header(h, group=group, stats=stats, local_message=msg, what=what)


def _sum_path(tensor, compressor, group, key, step, algorithm, stats, generator, validate):
    payload, err = _try_compress(compressor, tensor, step, key, generator)
    _header_check(tensor, compressor, "sum", algorithm, ALLREDUCE_ALGORITHMS["sum"], group, stats,
                  validate, "allreduce", err)
    wire = []
    for t in payload.tensors:
        t = t.contiguous()
        if _aliases(t, tensor):
            t = t.clone()
        wire.append(_comm.all_reduce_(t, group=group, stats=stats))
    summed = Payload(tuple(wire), payload.shape, payload.dtype, payload.numel, payload.meta)
    out = unwrap(compressor).decompress(summed)
    if stats is not None:
        stats.add(calls=1, algorithm="allreduce" if _comm.world(group) > 1 else "local")
    return out.to(tensor.dtype).reshape(tensor.shape)


def _sparse_path(tensor, compressor, group, key, step, algorithm, stats, generator, validate):
    from .sparse import sparse_allreduce

    payload, err = _try_compress(compressor, tensor, step, key, generator)
    if payload is None:
        indices, values = None, None
    else:
        indices, values = payload.tensors[0], payload.tensors[1]
        if values.dtype != tensor.dtype:
            values = values.to(tensor.dtype)
    out = sparse_allreduce(indices, values, tensor.numel(), group=group, algorithm=algorithm, stats=stats,
                           validate=validate, config=fingerprint(compressor), _error=err)
    return out.reshape(tensor.shape)
