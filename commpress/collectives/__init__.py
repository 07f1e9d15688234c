"""Collectives for compressed gradients, on torch.distributed primitives.

* :func:`all_gather` — every rank's tensor through a fixed-size compressor (a quantizer, or a
  sparsifier's capacity slots), status inside
  (FSDP2's quantized parameter all-gather).
* :func:`cast_message` — the one cast path of identity / fp16 / bf16 messages.
* :func:`allreduce` — compress → the collective the compressor needs → decompress;
  returns the **sum** over ranks, bitwise identical on every rank.  In steady
  state a call costs its payload's messages and nothing more (:mod:`.wire`); a
  ``dense=`` part rides in them where that costs no more bytes (:func:`carries_dense`).
  A sparsifier's fixed-size payload goes through :func:`.sparse.fixed_sparse_allreduce`; its
  hottest CPU case, topk under error feedback sending its selection, runs a cached plan per call
  site (:mod:`.steady_sparse`): the same bytes, without the general path's per-call Python.
* :func:`sparse_allreduce` and :data:`SPARSE_ALGORITHMS` — sparse sums of
  variable-size ``(indices, values)`` (allgather, recursive doubling, SparCML
  split, Zen hashed, dense, ``"auto"``), with a header exchange per call.
* :func:`quantized_allreduce` / :func:`reduce_scatter` — two-phase quantized
  aggregation for ``"gather"`` compressors (and the reduce-scatter half for FSDP2:
  one ``all_to_all``, or one sum ``reduce_scatter`` for ``"sum"`` compressors).
  Its hottest CPU case, blockquant under error feedback, runs a cached plan per call site
  (:mod:`.steady`): the same bytes, without the general path's per-call Python.
* :func:`powersgd_allreduce` — the PowerSGD protocol for ``"lowrank"`` compressors.
* :class:`Hierarchy` — nodes of ``L`` ranks: ``allreduce(..., hierarchy=h)`` reduces
  densely inside a node and compresses only between nodes (:mod:`.hierarchy`).
* :func:`set_fault_hook` — for tests: a callback before every torch.distributed call.
* :class:`CommStats` — bytes / messages / algorithm per rank (see
  :mod:`commpress.collectives.accounting` for how bytes are counted).
* :func:`set_cost_model`, :func:`calibrate`, :func:`get_cost_model` — the
  alpha-beta cost model behind ``algorithm="auto"``.

Bad input raises :class:`CollectiveInputError` (a ``ValueError``) on every rank
together; with one rank nothing is sent.
"""

from __future__ import annotations

from ..feedback import ResidualTransaction
from .accounting import CommStats
from .core import all_gather, allreduce, carries_dense
from .costmodel import CostModel, calibrate, get_cost_model, set_cost_model
from .hierarchy import Hierarchy
from .lowrank import powersgd_allreduce
from .quantized import quantized_allreduce, reduce_scatter
from .rows import ROW_ALGORITHMS, RowsResult, rows_allreduce
from .sparse import SPARSE_ALGORITHMS, sparse_allreduce
from ._comm import cached_bytes, clear_caches, comm_device, set_fault_hook
from .wire import CollectiveInputError, cast_message, fingerprint, flush_deferred, unwrap

__all__ = [
    "CommStats", "CollectiveInputError", "CostModel", "Hierarchy", "ResidualTransaction", "SPARSE_ALGORITHMS", "all_gather", "allreduce",
    "cached_bytes", "calibrate", "carries_dense", "clear_caches", "cast_message", "comm_device", "fingerprint", "flush_deferred", "get_cost_model", "powersgd_allreduce", "quantized_allreduce",
    "ROW_ALGORITHMS", "RowsResult", "reduce_scatter", "rows_allreduce", "set_cost_model", "set_fault_hook", "sparse_allreduce", "unwrap",
]
