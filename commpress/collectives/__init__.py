"""Collectives for compressed gradients, on torch.distributed primitives.

* :func:`allreduce` — compress → the collective the compressor needs → decompress;
  returns the **sum** over ranks, bitwise identical on every rank.
* :func:`sparse_allreduce` and :data:`SPARSE_ALGORITHMS` — sparse sums
  (allgather, recursive doubling, SparCML split, Zen hashed, dense, ``"auto"``).
* :func:`quantized_allreduce` / :func:`reduce_scatter` — two-phase quantized
  aggregation for ``"gather"`` compressors (and the reduce-scatter half for FSDP2).
* :func:`powersgd_allreduce` — the PowerSGD protocol for ``"lowrank"`` compressors.
* :class:`CommStats` — bytes / messages / algorithm per rank (see
  :mod:`commpress.collectives.accounting` for how bytes are counted).
* :func:`set_cost_model`, :func:`calibrate`, :func:`get_cost_model` — the
  alpha-beta cost model behind ``algorithm="auto"``.

Every collective validates its input across ranks first (one small all-gather)
and raises :class:`CollectiveInputError` (a ``ValueError``) on every rank
together; with one rank nothing is sent.
"""

from __future__ import annotations

from .accounting import CommStats
from .core import allreduce, fingerprint, unwrap
from .costmodel import CostModel, calibrate, get_cost_model, set_cost_model
from .lowrank import powersgd_allreduce
from .quantized import owner_feedback, quantized_allreduce, reduce_scatter
from .sparse import SPARSE_ALGORITHMS, sparse_allreduce
from .validate import CollectiveInputError

__all__ = [
    "CommStats", "CollectiveInputError", "CostModel", "SPARSE_ALGORITHMS", "allreduce", "calibrate",
    "fingerprint", "get_cost_model", "owner_feedback", "powersgd_allreduce", "quantized_allreduce",
    "reduce_scatter", "set_cost_model", "sparse_allreduce", "unwrap",
]
