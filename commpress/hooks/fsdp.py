"""FSDP2 integration: compressed reduce-scatter of gradients, optionally quantized all-gather of parameters.

One call, on a model already wrapped with ``torch.distributed.fsdp.fully_shard``::

    state = commpress.fsdp.register(model, "blockquant", bits=8)
    state = commpress.fsdp.register(model, "topk", ratio=0.01)            # + error feedback ("auto")
    state = commpress.fsdp.register(model, "identity", all_gather="blockquant")   # ZeRO++ qwZ style
    state = commpress.fsdp.register(model, "auto")     # a compressor per unit, chosen from measurements

Every submodule that is an ``FSDPModule`` with parameters (an *FSDP unit*) gets a
:class:`CompressedReduceScatter` through ``FSDPModule.set_custom_reduce_scatter``
(and, with ``all_gather``, a :class:`QuantizedAllGather` through
``set_custom_all_gather``).  Both are thin clients of :mod:`commpress.collectives`.

What FSDP2 hands the reduce-scatter
-----------------------------------
A flat buffer of ``P·m`` elements in the reduce dtype: gradient chunk ``j``
(``input[j·m:(j+1)·m]``, padding included) belongs to rank ``j``; the output is
rank ``r``'s ``m`` elements of the reduced chunk ``r``.  FSDP2 also passes the
reduce op: ``AVG`` (fp32 / bf16 reduction: the backend divides by ``P``),
``SUM`` (fp16 reduction: FSDP pre/post-divides itself) or
``PREMUL_SUM(1/f)`` (``set_gradient_divide_factor(f)``).  The compressed paths
apply the same scaling (after the sum, in the reduce dtype), so the gradient the
optimizer sees is what default FSDP2 produces up to compression error.

What goes on the wire, per aggregation kind of the compressor
-------------------------------------------------------------
Bytes are what one rank sends per unit and step (the direct model of
:mod:`commpress.collectives.accounting`); ``align8(n)`` rounds up to a multiple of 8.

``identity``
    FSDP2's own call: one ``reduce_scatter`` of the input with FSDP's op.
    ``4m·(P−1)`` bytes for fp32 (``itemsize·m·(P−1)``), bitwise FSDP2's default.
``"sum"`` without error feedback (fp16, bf16, shared-seed random-k)
    :func:`commpress.collectives.reduce_scatter` with ``algorithm="reduce_scatter"``:
    chunk ``j`` is compressed with key ``(unit, j)`` (shared random choices agree
    across ranks; fp16 / bf16 are cast straight into the message); piece ``j`` of the
    message is chunk ``j``'s payload followed by the two status slots of
    :mod:`commpress.collectives.wire` (error, NaN/inf count), and ONE sum
    ``reduce_scatter`` adds the pieces on the wire; the owner decodes its piece and
    applies the op's scale.  A rank that fails raises on every rank together.
    ``(b + 2·itemsize)·(P−1)`` bytes, ``b`` a chunk's payload: ``2m`` for fp16 / bf16,
    ``k·itemsize`` for random-k; the first call of a unit adds the validation round below.
``"gather"`` (blockquant, qsgd, terngrad, signsgd), ``"sparse"`` (topk, threshold, dgc), and ``"sum"`` with error feedback
    :func:`commpress.collectives.reduce_scatter`: ONE ``all_to_all_single``.
    Chunk ``j``'s fixed-size payload (``compress_fixed``, key ``(unit, j)``) goes
    to its owner ``j`` behind the 8-byte status word of :mod:`commpress.collectives.wire`
    (NaN/inf flag, error code, a signature of the static facts), each tensor
    starting 8-aligned; the owner decodes the P pieces, sums them in fp32 in
    rank order and applies the op's scale.  ``w·(P−1)`` bytes, with
    ``w = 8 + Σ align8(tensor bytes)``:

    - blockquant ``bits=8`` of fp32: ``8 + align8(m) + align8(4·ceil(m/256))``
      (codes, one fp32 scale per 256-element block);
    - topk: ``8 + align8(4k) + align8(k·itemsize)``, ``k = max(1, round(ratio·m))``
      (int32 indices, values in the reduce dtype); dgc and threshold the same with
      their fixed capacity in place of ``k``.  With error feedback, where that selection
      would be no smaller than the chunk block-quantized to 4 bits (a density warm-up's
      25% and 8.5% stages, ratios above about 6%), the chunk goes whole in 4 bits instead
      (the blockquant ``bits=4`` payload; the residual keeps the rounding).

    The first call of each unit (and of a unit whose input size or dtype changed),
    on this path and the one above, adds one validation ``all_gather`` of ``HEADER_FIXED + 4P + SKETCH`` int64 per
    rank (:mod:`commpress.collectives.validate`): the reduce dtype (the
    ``MixedPrecisionPolicy``) and the set of parameters that have gradients fix
    the message sizes but are not part of the registration fingerprint, so they
    are agreed once, by a round that raises on every rank, before any
    size-mismatched ``all_to_all``.  Later calls have no round but the payload's.
``"lowrank"`` (PowerSGD)
    not supported: FSDP's reduce-scatter input is a flat buffer of many
    parameters' shards; ``register`` raises ``ValueError``.

``"auto"``
    each unit runs the codec chosen for it at the last check point
    (:mod:`commpress.auto.fsdp`): dense, bf16, blockquant or topk, always under error
    feedback, on the ``"two_phase"`` path above; a unit that chose dense and owes nothing
    (no carried residual, no momentum correction) runs FSDP2's own ``reduce_scatter``.
    The first call after a switch validates again (one header round).  Check points (one
    ``all_reduce``) run at the end of a backward pass, every ``check_every`` steps.

Naturally sparse rows (``sparse_rows=``)
---------------------------------------
A ``sparse_rows`` parameter (2-D, sharded on dim 0: an ``nn.Embedding`` weight) sits in each
chunk of its unit's input as its shard, ``ceil(rows/P)`` rows from a fixed offset, so a row's
owner is known from its index.  On its rows path it is cut out of the input and summed by
:func:`commpress.collectives.rows.rows_reduce_scatter`: ONE ``all_to_all`` in which each rank
sends owner ``j`` only its nonzero rows of chunk ``j`` (int32 local index + the row) behind the
status word, its counts per owner and a NaN flag; the owner adds them in rank order and applies
FSDP's scale.  ``(P−1)·(8 + 8(P+1) + align8(4c) + c·D·itemsize)`` bytes, ``c`` the capacity per
(rank, owner) from the counts of earlier steps (:class:`~commpress.hooks.sparse_rows.SparseRows`);
rows beyond it go in one more ``all_to_all`` (never dropped).  Lossless: the dense
reduce-scatter's sum up to fp32 summation order (bitwise at P = 2), deterministic.  The rest of
the unit (every other parameter, packed) goes by the configured path above, so its payloads and
residuals are those of a unit without the rows parameter.  A rows parameter whose rows are not
sparse (its message no smaller than the dense reduce-scatter's) goes by an exact
``reduce_scatter`` (with the rest when that is FSDP2's own call), measured again every 100 steps.
With momentum taken over (``optimizer=``) the rows parameters get plain SGD momentum on this rank's
shard after the sum (:meth:`~commpress.feedback.ErrorFeedback.dense_momentum`).
Host reads: the received counts, one per call, as DDP's rows path.

Non-finite gradients and error feedback
---------------------------------------
Residuals live in the ``ErrorFeedback`` codec keyed by ``(unit name, chunk
index)``, allocated at the first step and reused.  Every residual update of a
step (all units, all chunks) is staged in one
:class:`~commpress.feedback.ResidualTransaction` (the state's) and
committed when the backward pass ends (:meth:`FSDPState.end_step`).  When any
rank's input to any unit holds a NaN/inf, its status word marks the transaction
bad on every rank and that unit's output is all-NaN on every rank (so
``GradScaler`` skips the step); the commit then keeps every residual of every
rank as it was.  Both decisions are ``torch.where`` on the device.  Without error
feedback the NaN/inf travel in the payload by the compressor's own contract
(casts and quantizers keep them; top-k ranks them first).
With ``scaler=`` (AMP's ``GradScaler``) a compressed call divides its input by the loss
scale and multiplies its output back (0-d device tensors, no host read), so residuals are
kept in unscaled units whatever the scale does (:meth:`FSDPState.attach_scaler`).

Host reads: none in the steady state.  Nothing in the hook path calls
``.item()``, ``.tolist()``, ``bool()`` / ``int()`` / ``float()`` of a tensor or
``.cpu()``; sizes come from ``numel`` and the configuration, statuses are
judged by the collectives (free on CPU tensors, deferred on CUDA).

The optional quantized all-gather (``all_gather="blockquant"``): each rank
compresses its flat parameter shard (fixed-size payload), and
:func:`commpress.collectives.all_gather` sends it behind the status word (one
``all_gather`` of ``8 + Σ align8(tensor bytes)`` per rank, e.g.
``8 + align8(n) + align8(4·ceil(n/256))`` for 8-bit blockquant of ``n`` fp32
elements instead of ``4n``; a rank that fails to compress makes every rank raise
:class:`~commpress.collectives.CollectiveInputError`) and every rank, itself included, decodes all ``P`` shards, so all ranks
compute with identical (quantized) unsharded parameters while the sharded fp32
parameters the optimizer updates stay exact.  Shards whose all-gather dtype the
compressor does not support (a ``uint8`` mixed-dtype buffer) go dense.

Hybrid sharding: a compressed all-reduce across replicas
--------------------------------------------------------
torch 2.13's FSDP2 cannot replace the replica all-reduce of *native* HSDP (a 2-D
mesh): ``foreach_reduce`` calls ``dist.all_reduce`` on the replicate group
unconditionally, ``set_all_reduce_hook`` runs *after* it, and
``set_requires_all_reduce(False)`` returns before the hook (and before the
gradients are assigned); ``_fsdp_api`` has no ``AllReduce`` extension point.
What it does support is the "custom HSDP" it documents for that hook: shard each
replica with a 1-D mesh (the shard dimension) and all-reduce across replicas in
the hook.  ``register(model, compressor, replicate_group=pg)`` does that: every
unit's reduce-scatter output (already averaged over the shard group by FSDP) is
summed over ``pg`` by :func:`commpress.collectives.allreduce` (key
``(unit, "replicas")``, error feedback per unit, residual updates in the step's
transaction), then divided by the number of replicas.  The reduce-scatter inside
the shard group stays FSDP's dense one unless ``reduce_scatter=True``.  With a
2-D mesh, ``register`` raises and names this route.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from .. import collectives
from ..storage import HOOK_DEFAULT
from ..compressors._sparse import SparseCompressor
from ..collectives.accounting import CommStats
from ..compressors import Compressor
from ..compressors._util import mix_seed, stable_hash
from ..collectives.rows import rows_reduce_scatter
from ..collectives.wire import DTYPES as _ROW_DTYPES
from ..feedback import ResidualTransaction
from .common import HookState, Timer, codec_memory, loss_scales, resolve_compressor
from .optimizer import TakeoverMixin
from .sparse_rows import SparseRows

log = logging.getLogger("commpress")

__all__ = ["register", "FSDPState", "CompressedReduceScatter", "QuantizedAllGather", "fsdp_units"]

_ATTR = "_commpress_fsdp_state"
_RedOpType = dist.ReduceOp.RedOpType


# ------------------------------------------------------------------ module tree
def _param_groups(module: FSDPModule) -> list[Any]:
    return list(module._get_fsdp_state()._fsdp_param_groups)


def fsdp_units(module: torch.nn.Module, *, recurse: bool = True) -> list[tuple[str, FSDPModule]]:
    """``(name, module)`` of every FSDP2 unit with parameters in ``module``'s tree.

    ``name`` is the submodule's qualified name (``""`` for ``module`` itself).
    With ``recurse=False`` only ``module`` itself is considered.
    """
    candidates = module.named_modules() if recurse else [("", module)]
    return [(name, m) for name, m in candidates
            if isinstance(m, FSDPModule) and _param_groups(m)]


def _unit_layout(module: FSDPModule) -> list[list[Any]]:
    """Names and global shapes of one unit's parameters (part of the fingerprinted configuration)."""
    mine = {id(fp.sharded_param) for g in _param_groups(module) for fp in g.fsdp_params}
    return [[name, list(p.shape)] for name, p in module.named_parameters() if id(p) in mine]


@dataclass
class _RowsParam:
    """Where a ``sparse_rows`` parameter sits in its unit's reduce-scatter input: each of the ``P``
    chunks holds its shard as ``rows x dim`` elements from ``offset`` (FSDP2 shards on dim 0)."""

    name: str
    offset: int
    rows: int      # rows per shard (padded: ceil(rows / P))
    dim: int

    def region(self) -> tuple[int, int]:
        return self.offset, self.offset + self.rows * self.dim


def _rows_layout(module: FSDPModule, world: int, tracked: dict[int, str]) -> tuple[int, list[_RowsParam]] | None:
    """``(chunk numel, places of the tracked parameters)`` of a unit's reduce-scatter input, laid out
    as ``foreach_reduce_scatter_copy_in`` does (each parameter padded on dim 0 to a multiple of
    ``P``, chunk ``j`` = every parameter's shard ``j`` in order); ``None`` without a tracked one."""
    groups = _param_groups(module)
    found, off = [], 0
    for fp in (fp for g in groups for fp in g.fsdp_params):
        size = fp._orig_size
        shard_rows = -(-size[0] // world) if len(size) else 1
        name = tracked.get(id(fp.sharded_param))
        if name is not None and len(size) == 2 and fp.fsdp_placement.dim == 0 and len(groups) == 1:
            found.append(_RowsParam(name, off, shard_rows, size[1]))
        off += shard_rows * (size[1:].numel() if len(size) else 1)
    return (off, found) if found else None


def _complement(regions: list[tuple[int, int]], m: int) -> list[tuple[int, int]]:
    """The parts of ``[0, m)`` outside the sorted, disjoint ``regions``."""
    out, at = [], 0
    for a, b in regions:
        if a > at:
            out.append((at, a))
        at = b
    return out + ([(at, m)] if at < m else [])


def _pack(x: torch.Tensor, slices: list[tuple[int, int]]) -> torch.Tensor:
    """``x`` (``[P, m]``) cut to ``slices`` of each chunk, contiguous (``[P * k]``)."""
    return torch.cat([x[:, a:b] for a, b in slices], dim=1).reshape(-1)


def _unpack(out: torch.Tensor, slices: list[tuple[int, int]], packed: torch.Tensor) -> None:
    """Write ``packed`` (one chunk of :func:`_pack`) back into ``out``'s ``slices``."""
    at = 0
    for a, b in slices:
        out[a:b].copy_(packed[at:at + b - a])
        at += b - a


# ------------------------------------------------------------------ reduce op
def _op_scale(op: Any, world: int) -> float | torch.Tensor | None:
    """The factor the backend applies after summing for ``op`` (``None``: op not supported).

    ``AVG`` → ``1/world``; ``SUM`` → 1; ``PREMUL_SUM(f)`` → ``f`` (a 0-d tensor
    factor is returned as it is and applied on its device: no host read).
    """
    kind = op if isinstance(op, _RedOpType) else getattr(op, "op", None)
    if kind == _RedOpType.AVG:
        return 1.0 / world
    if kind == _RedOpType.SUM:
        return 1.0
    if kind == _RedOpType.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        return factor if factor is None or isinstance(factor, torch.Tensor) else float(factor)
    return None


# ------------------------------------------------------------------ state
@dataclass
class _Unit:
    """Book-keeping of one FSDP unit."""

    name: str
    module: FSDPModule
    calls: int = 0
    input_numel: int = 0
    validated: tuple[Any, ...] | None = None   # (numel, dtype, "auto" choice) agreed across ranks


class FSDPState(TakeoverMixin, HookState):
    """State of the commpress FSDP2 hooks: what :func:`register` returns (build it through that).

    What users need of it: :attr:`stats`, :meth:`state_dict` / :meth:`load_state_dict` (one file
    per rank), :meth:`close`, :meth:`attach_optimizer`, :meth:`attach_scaler`, and
    :meth:`config`, the configuration every rank agreed on at registration.  Everything else is
    the hooks'.

    What goes on the wire: each unit's gradient reduce-scatter sends the compressor's payloads
    (:func:`commpress.collectives.reduce_scatter`: one ``all_to_all`` of fixed-size payloads, or
    one ``reduce_scatter`` for a ``"sum"`` compressor without error feedback), and with
    ``all_gather`` each parameter all-gather one ``all_gather`` of fixed-size payloads
    (:func:`commpress.collectives.all_gather`).  ``stats`` counts, per step (one backward pass)
    and cumulatively, the bytes this rank handed to ``torch.distributed`` against what FSDP2's
    dense collectives would have sent, by the direct model of
    :mod:`commpress.collectives.accounting` (a reduce-scatter of ``n`` bytes sends
    ``n·(P−1)/P``; an all-gather of ``s`` bytes per rank sends ``s·(P−1)``).  The step's staged
    residual updates are committed at the end of each backward pass (:meth:`end_step`), unless
    some rank saw a NaN/inf.  The stochastic rounding's noise is a function of rank, step and
    unit: nothing to save.

    Attributes:
        stats: a :class:`~commpress.hooks.common.Stats` (``stats.as_dict()``: bytes, ratio,
            algorithm per unit, ``memory_overhead_bytes``).
        step: backward passes synchronized so far; checkpointed.

    Args:
        compressor: a :class:`~commpress.Compressor` or a registry name with
            ``**compressor_params``, or ``"auto"`` (each unit's compressor chosen from
            measurements, :mod:`commpress.auto.fsdp`).  A quantizer given by name without
            ``stochastic=`` rounds stochastically and runs without error feedback.
        error_feedback: ``"auto"`` (on for biased compressors), ``True`` or ``False``.
        all_gather: ``None`` (dense parameter all-gather) or a fixed-size compressor (name or
            instance, aggregation ``"gather"`` or ``"sum"``) for the parameter all-gather.
        process_group: the reduce-scatter's process group.
        units: ``(name, FSDPModule)`` pairs, the units the hooks serve.
        scaler: AMP's ``torch.amp.GradScaler``: the compressed reduce-scatter (and replica
            all-reduce) divides its input by the loss scale and multiplies its output back, so
            residuals and velocities stay in unscaled units (:meth:`attach_scaler`).  The
            unscaled values are held in the reduce dtype: with an fp16 reduce dtype the smallest
            gradients may underflow there (an fp32 or bf16 reduce dtype does not).
        residual_storage: ``"int8"``, ``"int4"``, ``"bf16"`` or ``"fp32"`` (:mod:`commpress.storage`);
            ``None`` (default): ``"int4"`` for a sparsifier without momentum correction
            (:data:`SPARSIFIER_STORAGE`), ``"int8"`` otherwise and once ``optimizer=`` brings momentum.
        rollback: ``"step"`` or ``"unit"``, as in :func:`commpress.ddp.register`.
        momentum: momentum correction's factor (0: off), as in :func:`register`.
        momentum_masking: momentum factor masking (with ``momentum``).
        auto: the options of ``"auto"``, a ``commpress.auto.Options`` (the keyword spelling
            still works, deprecated).
        **compressor_params: the compressor's parameters (with a registry name).

    Raises:
        TypeError: a bad ``scaler``, compressor or ``auto``.
        ValueError: a low-rank compressor (not supported with FSDP2), an ``all_gather``
            compressor that is not fixed-size, ``error_feedback=False`` with ``"auto"``,
            ``auto=`` with another compressor or with options also given as keywords.

    Example::

        >>> fully_shard(model)
        >>> state = commpress.fsdp.register(model, "blockquant", bits=4)   # an FSDPState
        >>> torch.save(state.state_dict(), f"hook-rank{rank}.pt")
    """

    kind = "fsdp"

    def __init__(self, compressor: Compressor | str, *, error_feedback: bool | str = "auto",
                 all_gather: Compressor | str | None = None,
                 process_group: dist.ProcessGroup | None = None,
                 units: Sequence[tuple[str, FSDPModule]] = (),
                 scaler: torch.amp.GradScaler | None = None, residual_storage: str | None = None,
                 rollback: str = "step", momentum: float = 0.0, momentum_masking: bool = False,
                 auto: Any = None, **compressor_params: Any) -> None:
        self.auto = isinstance(compressor, str) and compressor == "auto"
        if self.auto:  # a compressor per unit, chosen from measurements (commpress.auto.fsdp)
            from ..auto.fsdp import EXCLUDED_KINDS
            from .ddp import _auto_spec

            compressor = _auto_spec(compressor_params, auto, algorithm="auto", error_feedback=error_feedback,
                                    exclude=EXCLUDED_KINDS, where="FSDP2's reduce-scatter", hook="commpress.fsdp",
                                    spelled="commpress.auto.Options")
        elif auto is not None:
            raise ValueError(f"auto= (the options of compressor 'auto') was given with compressor {compressor!r}")
        elif (isinstance(compressor, str) and error_feedback == "auto" and "stochastic" not in compressor_params
              and _takes(compressor, "stochastic")):
            # FSDP2's default for a quantizer: unbiased stochastic rounding and no residual (ZeRO++
            # qgZ's choice), so no rank keeps a full-size residual; stochastic=False brings error feedback
            compressor_params = {**compressor_params, "stochastic": True}
            log.info("commpress.fsdp: %s with stochastic rounding and no error feedback (no residual "
                     "kept); stochastic=False keeps a residual of the whole model on every rank", compressor)
        self._storage_defaulted = residual_storage is None
        if residual_storage is None:
            residual_storage = _default_storage(compressor, compressor_params, self.auto, momentum)
        super().__init__(compressor, error_feedback=error_feedback, process_group=process_group,
                         residual_storage=residual_storage, rollback=rollback, momentum=momentum,
                         momentum_masking=momentum_masking, **compressor_params)
        if self.auto:
            self._new_auto_codec()
        if self.compressor.aggregation == "lowrank":
            raise ValueError(
                f"compressor {self.compressor.name!r} (aggregation 'lowrank') is not supported with "
                "FSDP2: the reduce-scatter input is a flat buffer of many parameters' shards; use a "
                "'sum', 'sparse' or 'gather' compressor"
            )
        self._all_gather_compressor: Compressor | None = None
        if all_gather is not None:
            ag = resolve_compressor(all_gather)
            if ag.aggregation not in ("gather", "sum"):
                raise ValueError(
                    f"all_gather must name a fixed-size compressor (aggregation 'gather' or 'sum', "
                    f"e.g. 'blockquant' or 'bf16'), got {ag.name!r} with aggregation {ag.aggregation!r}"
                )
            self._all_gather_compressor = ag
        self._units: dict[str, _Unit] = {name: _Unit(name, m) for name, m in units}
        self._transaction = ResidualTransaction()
        self._replicate: int | None = None   # register(replicate_group=): the replicas' count
        self._step_open = False
        self._reduced: set[str] = set()
        #: ``sparse_rows`` (:meth:`_bind_rows`): the plan, each unit's layout, the parameters kept out
        #: of their unit's compressed part for good (declared ones; ``"auto"``'s once settled)
        self._sparse_rows: SparseRows | None = None
        self._sparse_rows_config: dict[str, Any] | None = None
        self._rows_units: dict[str, tuple[int, list[_RowsParam]]] = {}
        self._rows_settled: set[str] = set()
        self._rows_all_settled = True
        self.attach_scaler(scaler)

    # internals that were public before issue 51: read-only, deprecated
    units = property(lambda self: _private_read(self, "units"), doc="Deprecated: internal (``_units``).")
    transaction = property(lambda self: _private_read(self, "transaction"),
                           doc="Deprecated: internal (``_transaction``).")
    all_gather_compressor = property(lambda self: _private_read(self, "all_gather_compressor"),
                                     doc="Deprecated: internal (``_all_gather_compressor``).")
    replicate = property(lambda self: _private_read(self, "replicate"), doc="Deprecated: internal (``_replicate``).")

    # -- "auto" ----------------------------------------------------------------
    def _new_auto_codec(self) -> None:
        """The :class:`~commpress.auto.fsdp.ReduceScatterAutoCodec` of ``"auto"`` (again after a
        momentum taken over: what binding set is kept)."""
        from ..auto.fsdp import ReduceScatterAutoCodec

        old = getattr(self, "_auto_codec", None)
        self.codec = self._auto_codec = ReduceScatterAutoCodec(self.compressor, self.momentum, self.momentum_masking,
                                                               self.residual_storage, self.rollback == "step")
        self.uses_error_feedback = True   # every choice runs under error feedback
        if old is not None:
            for name in ("network", "first_check", "world", "rank", "order", "infos", "_units"):
                setattr(self.codec, name, getattr(old, name))
        if self.stats.auto_report is not None:
            self._report_auto()   # the reports follow the new codec

    def _bind_auto(self) -> None:
        """``"auto"``: the α-β model of the group (calibrated now: a collective), the units in
        registration order, the check points, the report."""
        from ..auto.decide import Network
        from ..collectives.costmodel import CostModel

        if self.world_size > 1:
            from ..collectives import get_cost_model

            self.stats.cost_model = get_cost_model(self.process_group)
        auto = self._auto_codec
        flat = self.stats.cost_model if self.stats.cost_model is not None else CostModel(0.0, 0.0)
        auto.network = Network(max(1, self.world_size), flat, collective="reduce_scatter")
        auto.first_check = 1          # every unit starts dense: the first check ends the second step
        auto.world, auto.rank = self.world_size, self.rank
        layouts = {name: _unit_layout(u.module) for name, u in self._units.items()}
        auto.set_units([(name, [n for n, _ in lay], [tuple(s) for _, s in lay]) for name, lay in layouts.items()])
        self._report_auto()

    def _storage_with_momentum(self) -> str:
        """The storage once momentum correction is on (``optimizer=``): the default int4 of a
        sparsifier's residuals becomes int8 (:data:`SPARSIFIER_STORAGE`: an int4 velocity costs
        accuracy)."""
        if self._storage_defaulted and self.residual_storage == SPARSIFIER_STORAGE:
            self.residual_storage = HOOK_DEFAULT
            log.info("commpress.fsdp: optimizer= brings momentum correction: residuals and velocities in %s "
                     "(the int4 default of a sparsifier's residuals is for error feedback without momentum)",
                     HOOK_DEFAULT)
        return self.residual_storage

    def _takeover_memory_note(self) -> str | None:
        """FSDP2 shards the optimizer's momentum (4/P bytes per parameter); momentum correction's
        velocity is of every unit's whole gradient, on every rank, kept as the residuals are
        (``residual_storage``: live, and a pending copy with ``rollback="step"``)."""
        from ..storage import bytes_per_element

        copies = 2 if self.rollback == "step" else 1
        per = copies * bytes_per_element(self.residual_storage)
        return (f"commpress.fsdp: optimizer= keeps momentum correction's velocity of every unit's whole "
                f"gradient on every rank: {per:.2f} bytes per parameter of the model "
                f"({self.residual_storage}, {'live + pending' if copies == 2 else 'live'}), where the "
                f"optimizer's own momentum was sharded (4/P); without optimizer= the optimizer keeps its momentum")

    def _codec_changed(self) -> None:
        if self.auto:
            self._new_auto_codec()   # the per-unit codecs get the momentum, the decider the candidates

    def _covered_parameter_ids(self) -> set[int]:
        """The parameters whose momentum the hook takes over: every unit's."""
        return {id(p) for u in self._units.values() for p in u.module.parameters()}

    # -- sparse_rows ----------------------------------------------------------
    def _bind_rows(self, module: torch.nn.Module, sparse_rows: Any) -> None:
        """``register(sparse_rows=...)``: the plan (:class:`SparseRows`, by reduce-scatter bytes) and
        where each tracked parameter sits in its unit's reduce-scatter input.

        Raises:
            ValueError: (from :class:`SparseRows`) a tensor that is not a parameter of ``module``, a
                1-D parameter, an unknown name; a declared parameter no unit of this registration
                shards on dim 0; compressor ``"auto"`` or ``replicate_group``.
        """
        tracker = SparseRows(module, sparse_rows, group=self.process_group, collective="reduce_scatter")
        if not len(tracker):
            return
        if self.auto or self._replicate:
            what = "compressor 'auto'" if self.auto else "replicate_group="
            raise ValueError(f"sparse_rows is not supported with {what} under FSDP2 yet; register without "
                             f"sparse_rows or without {what}")
        tracked = {id(p): name for name, p in tracker.items()}
        for name, u in self._units.items():
            layout = _rows_layout(u.module, self.world_size, tracked)
            if layout is not None:
                self._rows_units[name] = layout
        placed = {rp.name for _, rps in self._rows_units.values() for rp in rps}
        missing = [n for n, _ in tracker.items() if n not in placed]
        declared_missing = [n for n in missing if tracker.plans[n].declared]
        if declared_missing:
            raise ValueError(f"sparse_rows: {declared_missing} are not sharded on dim 0 by a single-group FSDP2 "
                             f"unit of this registration (fully_shard the module that holds them)")
        tracker.drop(missing)
        if not len(tracker):
            return
        self._sparse_rows = tracker
        self._sparse_rows_config = tracker.config()
        self._rows_settled = {n for n, _ in tracker.items() if tracker.plans[n].declared}
        self._rows_all_settled = len(self._rows_settled) == len(tracker)
        self.stats.sparse_rows_report = tracker.as_dict

    def _begin_rows(self) -> None:
        """At a step's first reduce-scatter: apply what the last step measured (long gathered), and
        for ``"auto"`` at the end of the warm-up keep the parameters found sparse as rows for good
        (their units' compressed part is laid out without them from then on: its residual starts
        anew once); the others are no longer tracked."""
        tracker = self._sparse_rows
        tracker.begin_step()
        if not self._rows_all_settled and tracker.step >= tracker.warmup:
            keep = self._rows_settled | {n for n, _ in tracker.items() if tracker.path(n) == "rows"}
            tracker.drop([n for n, _ in list(tracker.items()) if n not in keep])
            self._rows_settled, self._rows_all_settled = keep, True
            log.info("commpress.fsdp: sparse_rows='auto' settled: %s as rows", sorted(keep) or "none")

    # -- configuration ------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """The configuration every rank agreed on at registration (fingerprinted; in :meth:`state_dict`).

        Returns:
            A JSON-able dict: the compressor and its parameters, error feedback, momentum, world
            size, the ``all_gather`` compressor, each unit's parameter names and shapes, the
            replica count.
        """
        cfg = super().config()
        ag = self._all_gather_compressor
        cfg["all_gather"] = None if ag is None else {"compressor": ag.name, "params": ag.config()}
        cfg["units"] = {name: _unit_layout(u.module) for name, u in self._units.items()}
        if self._replicate:  # absent without replicas: older checkpoints still load
            cfg["replicas"] = self._replicate
        if self._sparse_rows_config is not None:   # as declared ("auto" settles later: in the state dict)
            cfg["sparse_rows"] = self._sparse_rows_config
        return cfg

    # -- step accounting ----------------------------------------------------
    def _touch_step(self, unit: str) -> None:
        """Open a step at the first reduce-scatter of a backward pass; close it when backward ends.

        A unit reducing twice within one open step means the previous step was never
        closed (no backward callback ran): it is closed then.
        """
        if self._step_open and unit in self._reduced:
            self.end_step()
        self._reduced.add(unit)
        if self._step_open:
            return
        self._step_open = True
        if self._sparse_rows is not None:
            self._begin_rows()
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.end_step)
        except RuntimeError:
            # Not inside a backward pass (a collective called by hand): the step is
            # closed by the next reduce-scatter of the same unit or by end_step().
            log.debug("commpress.fsdp: reduce-scatter outside backward; step closes lazily")

    def end_step(self) -> None:
        """Close the current step (called automatically at the end of each backward pass):
        commit its residual updates, unless some rank saw a NaN/inf (decided on the device)."""
        if not self._step_open:
            return
        self._step_open = False
        self._reduced.clear()
        self._transaction.commit()
        collectives.flush_deferred()   # this step's CUDA statuses that have landed (no wait)
        if self._sparse_rows is not None:   # the max of this step's measurements, not waited for
            self._sparse_rows.end_step()
        if self.auto:  # a check point every check_every steps (collective: every rank at this step)
            self.codec.end_step(self.step, group=self.process_group)
        self.step += 1
        if self.stats.memory_source is None:   # counted when asked: metadata only, no tensor is read
            self.stats.track_memory(lambda: codec_memory(self.codec) | {"collectives": collectives.cached_bytes()}
                                    | ({"sparse_rows": self._sparse_rows.memory_bytes()}
                                       if self._sparse_rows is not None else {}),
                                    *self._param_counts())
        self.stats.end_step()

    def _param_counts(self) -> tuple[int, int]:
        """``(params, sharded_bytes)``: the units' parameters (whole, each counted once) and this
        rank's shards of them with their gradients, in bytes (twice the parameter shards)."""
        seen: dict[int, torch.Tensor] = {}
        for u in self._units.values():
            for p in u.module.parameters():
                seen.setdefault(id(p), p)
        local = [getattr(p, "to_local", lambda p=p: p)() for p in seen.values()]
        return (sum(p.numel() for p in seen.values()),
                2 * sum(t.numel() * t.element_size() for t in local))

    def noise_seed(self, key: Any) -> int:
        """The seed of this rank's stochastic rounding for ``key`` at the current step: a pure
        function of ``(rank, step, key)``, handed to the collectives as an int (no generator is
        read on the host, nothing to checkpoint)."""
        return mix_seed(0x5EED, self.rank, self.step, stable_hash(key))

    # -- checkpoints --------------------------------------------------------
    def _extra_state_dict(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"unit_calls": {name: int(u.calls) for name, u in self._units.items()}}
        if self._sparse_rows is not None:
            extra["sparse_rows"] = {"settled": sorted(self._rows_settled), "all_settled": self._rows_all_settled,
                                    "plan": self._sparse_rows.state_dict()}
        return extra

    def _load_extra_state_dict(self, extra: dict[str, Any], state: dict[str, Any]) -> None:
        self._transaction.rollback()     # staged updates refer to the buffers being replaced
        # (an older checkpoint's "generator" is ignored: the noise is a function of the step now)
        for name, calls in extra.get("unit_calls", {}).items():
            if name in self._units:
                self._units[name].calls = int(calls)
        rows = extra.get("sparse_rows")
        if self._sparse_rows is not None and rows is not None:
            if rows.get("all_settled"):   # "auto" settled in the saved run: the same parameters here
                settled = set(rows.get("settled", []))
                self._sparse_rows.drop([n for n, _ in list(self._sparse_rows.items()) if n not in settled])
                self._rows_settled, self._rows_all_settled = settled, True
            self._sparse_rows.load_state_dict(rows["plan"])


# ------------------------------------------------------------------ comms
class _CommBase:
    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CompressedReduceScatter(_CommBase, ReduceScatter):
    """FSDP2 ``ReduceScatter`` that sends compressed chunks (see the module docstring for the wire)."""

    def __init__(self, state: FSDPState, unit: str) -> None:
        self.state = state
        self.unit = unit
        self._warned = False

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> None:
        st = self.state
        st._touch_step(self.unit)
        layout = st._rows_units.get(self.unit) if st._sparse_rows is not None else None
        world = group.size()
        if layout is not None and world > 1 and _op_scale(op, world) is not None and input_tensor.dtype in _ROW_DTYPES:
            if layout[0] * world == input_tensor.numel():
                return self._with_rows(output_tensor, input_tensor, group, op, layout)
            if not self._warned:   # some parameter of the unit has no gradient this step: another layout
                log.warning("commpress.fsdp: unit %r reduce-scatter input of %d elements, not the %d of all its "
                            "parameters: its sparse_rows parameters go with the rest of the unit this time",
                            self.unit, input_tensor.numel(), layout[0] * world)
                self._warned = True
        return self._send(output_tensor, input_tensor, group, op)

    def _rest_native(self) -> bool:
        """Whether the unit's part beside its rows goes by FSDP2's own reduce_scatter (identity
        without error feedback)."""
        st = self.state
        return st.compressor.name == "identity" and not st.uses_error_feedback

    def _with_rows(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                   op: Any, layout: tuple[int, list[_RowsParam]]) -> None:
        """A unit holding ``sparse_rows`` parameters: those on the rows path go by
        :func:`~commpress.collectives.rows.rows_reduce_scatter` (their nonzero rows to their
        owners); the rest of the unit (with the rows parameters on their dense path) as configured,
        cut out of the input.  A dense-path rows parameter is measured on measuring steps."""
        st, tracker, world = self.state, self.state._sparse_rows, group.size()
        m, params = layout
        x = input_tensor.view(world, m)
        measuring = tracker.measuring()
        for rp in params:
            if rp.name in tracker and tracker.path(rp.name) == "dense" and measuring:
                a, b = rp.region()
                tracker.observe_count(rp.name, _count_rows(x[:, a:b].view(world, rp.rows, rp.dim)))
        out_of_rest = sorted((rp for rp in params if rp.name in st._rows_settled), key=lambda rp: rp.offset)
        as_rows = [rp for rp in out_of_rest if tracker.path(rp.name) == "rows"]
        native = self._rest_native()
        if not out_of_rest or (native and not as_rows):   # the unit as FSDP2 laid it out
            return self._send(output_tensor, input_tensor, group, op)
        # the rest: every chunk but the rows parameters kept out (and, when it is FSDP2's own call,
        # those on their dense path with it: one reduce_scatter)
        apart = [rp for rp in out_of_rest if rp in as_rows or not native]
        rest = _complement([rp.region() for rp in apart], m)
        if rest:
            self._send_slices(output_tensor, x, rest, group, op)
        dense_rows = [rp.region() for rp in apart if rp not in as_rows]
        cs = CommStats()
        with Timer(cpu=True) as t:
            if dense_rows:   # rows parameters on their dense path, beside a compressed rest: exact
                packed = _pack(x, dense_rows)
                got = torch.empty(packed.numel() // world, dtype=packed.dtype, device=packed.device)
                with Timer() as call:
                    dist.reduce_scatter_single(got, packed, group=group, op=op)
                cs.add(got.numel() * got.element_size() * (world - 1), rounds=1, seconds=call.seconds)
                _unpack(output_tensor, dense_rows, got)
            scale = _op_scale(op, world)
            for rp in as_rows:
                self._run_rows(rp, x, output_tensor, group, scale, cs)
            if st.momentum:   # the optimizer's momentum is taken over: theirs here, on this rank's shard
                self._momentum(output_tensor, apart)
        n = sum(b - a for rp in apart for a, b in [rp.region()])
        st.stats.record(f"{self.unit}/sparse_rows", bytes_sent=cs.bytes_sent,
                        dense_bytes=n * input_tensor.element_size() * (world - 1),
                        algorithm="+".join(["rows_scatter"] * bool(as_rows) + ["dense"] * bool(dense_rows)),
                        compress_seconds=t.seconds, hook_seconds=t.seconds, hook_cpu_seconds=t.cpu_seconds,
                        **_account(cs))
        return None

    def _momentum(self, output_tensor: torch.Tensor, apart: list[_RowsParam]) -> None:
        """Plain SGD momentum (:meth:`~commpress.feedback.ErrorFeedback.dense_momentum`) on the
        shards of the parameters sent apart from the error-feedback path, in unscaled units (a loss
        scaler's), staged in the step's transaction; the velocity is of the shard: 4/P bytes a row
        parameter."""
        st = self.state
        scales = loss_scales(st.scaler, output_tensor.device)
        for rp in apart:
            a, b = rp.region()
            piece = output_tensor[a:b]
            if scales is not None:
                piece.mul_(scales[1])
            st.codec.dense_momentum(piece, f"fsdp-rows:{rp.name}", st._transaction)
            if scales is not None:
                piece.mul_(scales[0])

    def _send_slices(self, output_tensor: torch.Tensor, x: torch.Tensor, slices: list[tuple[int, int]],
                     group: dist.ProcessGroup, op: Any) -> None:
        """The unit's ``slices`` of every chunk, packed, through the configured path (:meth:`_send`)."""
        packed = _pack(x, slices)
        got = torch.empty(packed.numel() // x.shape[0], dtype=packed.dtype, device=packed.device)
        self._send(got, packed, group, op)
        _unpack(output_tensor, slices, got)

    def _run_rows(self, rp: _RowsParam, x: torch.Tensor, output_tensor: torch.Tensor, group: dist.ProcessGroup,
                  scale: float | torch.Tensor, cs: CommStats) -> None:
        """One rows parameter: its nonzero rows to their owners, summed exactly, FSDP's scale after."""
        st, tracker, world = self.state, self.state._sparse_rows, group.size()
        a, b = rp.region()
        out = output_tensor[a:b].view(rp.rows, rp.dim)
        result = rows_reduce_scatter(x[:, a:b].view(world, rp.rows, rp.dim), out=out, group=group,
                                     key=f"fsdp-rows:{rp.name}", stats=cs,
                                     capacity=tracker.capacities(rp.name)["owner_capacity"])
        tracker.record(rp.name, result)
        if not (isinstance(scale, float) and scale == 1.0):
            out.mul_(scale)
        if result.nonfinite and st.uses_error_feedback:   # judged alike on every rank (gathered flags)
            st._transaction.mark_bad(torch.ones((), dtype=torch.bool, device=out.device))

    def _send(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
              group: dist.ProcessGroup, op: Any) -> None:
        """The configured path for ``input_tensor`` (the unit's whole input, or its part beside
        its rows parameters)."""
        st = self.state
        unit = st._units[self.unit]
        world = group.size()
        scale = _op_scale(op, world)
        dense_bytes = output_tensor.numel() * input_tensor.element_size() * (world - 1)
        if unit.input_numel != input_tensor.numel():
            if unit.input_numel:
                log.info("commpress.fsdp: unit %r reduce-scatter size changed %d -> %d",
                         self.unit, unit.input_numel, input_tensor.numel())
            unit.input_numel = input_tensor.numel()
        cs = CommStats()
        codec, own_call, tag = st.codec, False, None
        # with a loss scaler: (S, 1/S) on the device; the input is divided by S before anything
        # compresses it or adds a residual to it (residuals are in unscaled units)
        scales = loss_scales(st.scaler, input_tensor.device) if scale is not None and world > 1 else None
        unscaled = False
        if st.auto:  # the unit's own codec, chosen at the last check point (the same on every rank)
            auto = st.codec
            info = auto.unit(self.unit, input_tensor.numel(), input_tensor.dtype)
            own_call = auto.native(self.unit)   # dense, nothing owed, no momentum: FSDP2's own call
            if scales is not None and not own_call:   # a carry it adds is unscaled
                input_tensor.mul_(scales[1])
                unscaled = True
            codec = auto.codec(info, input_tensor, None)
            tag = auto.choices[self.unit]
        with Timer(cpu=True) as t:
            comp = codec.compressor if st.auto else st.compressor
            native = False
            if scale is None or world == 1 or input_tensor.dtype not in comp.supported_dtypes:
                if unit.calls == 0:
                    log.warning("commpress.fsdp: unit %r goes dense (reduce op %s, dtype %s, world size %d)",
                                self.unit, op, input_tensor.dtype, world)
                with Timer() as native_call:
                    dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op)
                cs.add(dense_bytes, rounds=1, seconds=native_call.seconds)
                algorithm, native = "dense", True
            elif own_call or (comp.name == "identity" and not st.uses_error_feedback):
                with Timer() as call:
                    dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op)
                cs.add(dense_bytes, rounds=1, seconds=call.seconds)
                algorithm, native = "identity:reduce_scatter", True
            else:
                if scales is not None:
                    if not unscaled:
                        input_tensor.mul_(scales[1])
                    scale = scales[0] * scale   # the output back in the scaler's units, with FSDP's scale
                if comp.aggregation == "sum" and not st.uses_error_feedback:
                    self._reduce_scatter(output_tensor, input_tensor, group, scale, cs, "reduce_scatter")
                    algorithm = f"{comp.name}:reduce_scatter"
                else:
                    self._reduce_scatter(output_tensor, input_tensor, group, scale, cs, "two_phase", codec, tag)
                    algorithm = f"{comp.name}:{comp.aggregation}_reduce_scatter"
            if native and unscaled:   # divided for "auto"'s codec, then sent by FSDP2's own call
                output_tensor.mul_(scales[0])
            unit.calls += 1
        if st.auto:
            st.codec.measured(info, t.seconds, cs.comm_seconds)
        st.stats.record(self.unit, bytes_sent=cs.bytes_sent, dense_bytes=dense_bytes, algorithm=algorithm,
                        compress_seconds=t.seconds, hook_seconds=t.seconds, hook_cpu_seconds=t.cpu_seconds,
                        **_account(cs))
        return None

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
                        scale: float | torch.Tensor, cs: CommStats, algorithm: str, codec: Any = None,
                        tag: Any = None) -> None:
        """:func:`commpress.collectives.reduce_scatter` (one all_to_all for ``"two_phase"``, one
        reduce_scatter for ``"reduce_scatter"``; status inside either way), the residual updates
        staged in the step's transaction, then FSDP's scale.  ``codec``: the unit's own
        (``"auto"``; ``tag`` its choice, so the first call after a switch validates again)."""
        st = self.state
        unit = st._units[self.unit]
        facts = (inp.numel(), inp.dtype, tag)
        summed = collectives.reduce_scatter(inp, st.codec if codec is None else codec, group=group, key=self.unit,
                                            step=st.step, stats=cs,
                                            generator=st.noise_seed(self.unit), validate=unit.validated != facts,
                                            transaction=st._transaction, algorithm=algorithm,
                                            scratch=True)   # FSDP2 frees its input after the call
        unit.validated = facts
        if st.rollback == "unit":   # judged on every rank: the unit's residual updates commit now
            st._transaction.commit_through(st._transaction.position())
        if isinstance(scale, float) and scale == 1.0:
            out.copy_(summed)
        else:
            torch.mul(summed, scale, out=out)


def _count_rows(chunks: torch.Tensor) -> torch.Tensor:
    """Nonzero rows of ``chunks`` (``[P, rows, D]``, a strided view), a 0-d device tensor."""
    if not chunks.numel():
        return torch.zeros((), dtype=torch.int64, device=chunks.device)
    return ((chunks.amax(dim=2) != 0) | (chunks.amin(dim=2) != 0)).sum()


def _private_read(state: Any, name: str) -> Any:
    """An internal that was public, read through its old name: deprecated."""
    from .ddp import deprecated

    deprecated(f"commpress.fsdp: FSDPState.{name} is internal and private now (FSDPState._{name}); users "
               "need stats, state_dict/load_state_dict, close, attach_optimizer, attach_scaler and config()")
    return getattr(state, "_" + name)


def _takes(name: str, param: str) -> bool:
    """Whether the compressor registered as ``name`` takes the parameter ``param``."""
    import inspect

    from ..compressors.base import _REGISTRY

    cls = _REGISTRY.get(name)
    return cls is not None and param in inspect.signature(getattr(cls.__init__, "__wrapped__", cls.__init__)).parameters


class ReplicaAllReduce:
    """FSDP2 all-reduce hook (``FSDPModule.set_all_reduce_hook``): compressed sum of the unit's
    reduce-scatter output over the replicate group, divided by its size (see the module doc).

    Wire: one :func:`commpress.collectives.allreduce` of the shard's payload among the
    ``R`` replicas (e.g. topk: one all-gather of ``capacity`` entries).
    """

    def __init__(self, state: FSDPState, unit: str, group: dist.ProcessGroup) -> None:
        self.state = state
        self.unit = unit
        self.group = group
        self.validated: tuple[int, torch.dtype] | None = None

    def __call__(self, reduce_output: torch.Tensor) -> None:
        st = self.state
        replicas = self.group.size()
        dense_bytes = 2 * reduce_output.numel() * reduce_output.element_size() * (replicas - 1) // replicas
        st._touch_step(f"{self.unit}/replicas")
        cs = CommStats()
        facts = (reduce_output.numel(), reduce_output.dtype)
        with Timer(cpu=True) as t:
            scales = loss_scales(st.scaler, reduce_output.device)
            factor: float | torch.Tensor = 1.0 / replicas
            if scales is not None:   # residuals in unscaled units; the output back in the scaler's
                reduce_output.mul_(scales[1])
                factor = scales[0] * factor
            summed = collectives.allreduce(reduce_output, st.codec, group=self.group, key=(self.unit, "replicas"),
                                           step=st.step, stats=cs, generator=st.noise_seed((self.unit, "replicas")),
                                           validate=self.validated != facts, transaction=st._transaction)
            self.validated = facts
            if st.rollback == "unit":
                st._transaction.commit_through(st._transaction.position())
            torch.mul(summed, factor, out=reduce_output)
        st.stats.record(f"{self.unit}/replicas", bytes_sent=cs.bytes_sent, dense_bytes=dense_bytes,
                        algorithm=f"{st.compressor.name}:replica_allreduce", compress_seconds=t.seconds,
                        hook_seconds=t.seconds, hook_cpu_seconds=t.cpu_seconds,
                        **_account(cs))


class QuantizedAllGather(_CommBase, AllGather):
    """FSDP2 ``AllGather`` that sends each rank's parameter shard compressed (ZeRO++ qwZ style).

    Wire: :func:`commpress.collectives.all_gather`, one ``all_gather`` of the status
    word and the packed payload (``8 + Σ align8(tensor bytes)`` per rank, e.g.
    ``8 + align8(n) + align8(4·ceil(n/256))`` for 8-bit blockquant of ``n`` fp32
    elements instead of ``4n``; the first call of a unit adds one validation header).
    Every rank decodes all shards, its own too.
    No host reads: the payload's size depends only on ``n`` and the configuration.
    """

    def __init__(self, state: FSDPState, unit: str) -> None:
        self.state = state
        self.unit = unit
        self.validated: tuple[int, torch.dtype] | None = None

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> None:
        st = self.state
        comp = st._all_gather_compressor
        assert comp is not None
        world = group.size()
        n = input_tensor.numel()
        dense_bytes = n * input_tensor.element_size() * (world - 1)
        name = f"{self.unit}/all_gather"
        cs = CommStats()
        with Timer(cpu=True) as t:
            if input_tensor.dtype not in comp.supported_dtypes or world == 1:
                with Timer() as native:
                    dist.all_gather_single(output_tensor, input_tensor, group=group)
                cs.add(dense_bytes, rounds=1, seconds=native.seconds)
                algorithm = "dense"
            else:
                facts = (n, input_tensor.dtype)
                collectives.all_gather(input_tensor, comp, group=group, key=(self.unit, "all_gather"),
                                       step=st.step, stats=cs, out=output_tensor,
                                       generator=st.noise_seed((self.unit, "all_gather")),
                                       validate=self.validated != facts)
                self.validated = facts
                algorithm = f"{comp.name}:all_gather"
        st.stats.record(name, bytes_sent=cs.bytes_sent, dense_bytes=dense_bytes, algorithm=algorithm,
                        compress_seconds=t.seconds, hook_seconds=t.seconds, hook_cpu_seconds=t.cpu_seconds,
                        **_account(cs))
        return None


def _account(cs: CommStats) -> dict[str, Any]:
    """What one call adds to the step-time account (:class:`~.common.Stats`): its collective
    rounds, the seconds inside them and its codec passes."""
    return {"rounds": cs.rounds, "comm_seconds": cs.comm_seconds, "codec_seconds": cs.codec_seconds}


#: FSDP2's default storage of a sparsifier's residuals without momentum correction: int4 keeps the
#: NaN rule's two copies in 1.12 bytes per parameter (FSDP2 frees its unsharded gradients at each
#: reduce-scatter: nothing to lend, :mod:`commpress.loan`); topk 1% on the LM, 600 steps, was
#: within 1% of fp32 on both seeds, while int4 velocities cost digits accuracy
#: (docs/results/memory.md).  Elsewhere :data:`~commpress.storage.HOOK_DEFAULT`.
SPARSIFIER_STORAGE = "int4"


def _default_storage(compressor: Compressor | str, params: dict[str, Any], auto: bool, momentum: float) -> str:
    """``residual_storage``'s default: :data:`SPARSIFIER_STORAGE` for a sparsifier (by name or
    instance) without momentum correction, else :data:`~commpress.storage.HOOK_DEFAULT` (also where
    the compressor does not resolve: the state's constructor then raises its own error)."""
    if auto or momentum:
        return HOOK_DEFAULT
    try:
        inner = resolve_compressor(compressor, params)
    except (TypeError, ValueError):
        return HOOK_DEFAULT
    return SPARSIFIER_STORAGE if isinstance(inner, SparseCompressor) else HOOK_DEFAULT


# ------------------------------------------------------------------ registration
def register(module: torch.nn.Module, compressor: Compressor | str, *,
             error_feedback: bool | str = "auto", all_gather: Compressor | str | None = None,
             recurse: bool = True, replicate_group: dist.ProcessGroup | None = None,
             reduce_scatter: bool | None = None, optimizer: torch.optim.Optimizer | None = None,
             scaler: torch.amp.GradScaler | None = None, residual_storage: str | None = None,
             rollback: str = "step", momentum: float = 0.0, momentum_masking: bool = False,
             auto: Any = None, sparse_rows: Sequence[torch.nn.Parameter | str] | str | None = None,
             **compressor_params: Any) -> FSDPState:
    """Compress the gradient reduce-scatter of every FSDP2 unit in ``module``'s tree.

    Collective: exchanges a configuration fingerprint over the units' process
    group (compressor, parameters, options, world size, unit names and
    parameter shapes); a mismatch raises ``ValueError`` on every rank.

    Args:
        module: a model (or submodule) wrapped with ``fully_shard``; every
            ``FSDPModule`` with parameters in its tree is handled (only ``module``
            itself with ``recurse=False``).
        compressor: a :class:`~commpress.Compressor` or a registry name with
            ``**compressor_params``, or ``"auto"``: each unit's compressor chosen and
            re-chosen from measurements (:mod:`commpress.auto.fsdp`; its options
            ``candidates``, ``check_every``, ``every``, ``margin``, ``drift``,
            ``critical``, ``prices``, ``remeasure`` as for DDP; not with
            ``replicate_group`` or ``reduce_scatter=False``;
            ``state.stats.as_dict()["auto"]`` shows the choices).  A quantizer given by
            name (``"blockquant"``, ``"fp8"``, ``"mx"``) without ``stochastic=`` rounds
            stochastically and runs without error feedback (see below).
        error_feedback: ``True``, ``False`` or ``"auto"`` (on for biased compressors).
        all_gather: ``None`` (dense parameter all-gather) or a fixed-size compressor
            (name or instance, e.g. ``"blockquant"``) used to all-gather parameters
            quantized.
        recurse: handle every ``FSDPModule`` with parameters in ``module``'s tree
            (default ``True``); ``False``: only ``module`` itself.
        replicate_group: hybrid sharding with a 1-D shard mesh per replica: the
            reduce-scatter output is all-reduced across this group compressed (see
            "Hybrid sharding" in the module doc).
        reduce_scatter: with ``replicate_group``, whether the shard group's
            reduce-scatter is compressed too.  Default (``None``): ``False`` with
            ``replicate_group``, ``True`` without it.
        optimizer: a ``torch.optim.SGD`` whose momentum the hook takes over (momentum
            correction in the error feedback, the optimizer's momentum 0 until
            ``state.close()``; Adam or SGD without momentum: one log line, nothing
            changes; see :mod:`commpress.hooks.optimizer`); ``state.attach_optimizer(opt)``
            for an optimizer made later.
        scaler: AMP's ``torch.amp.GradScaler`` when the loss is scaled: residuals and
            velocities are kept in unscaled units, the outputs stay scaled for
            ``scaler.step`` (:meth:`FSDPState.attach_scaler`, also for a scaler made
            later; ``TypeError`` for anything but a GradScaler or ``None``).
        residual_storage: how error feedback keeps its residuals (and velocities) between steps,
            ``"int8"``, ``"int4"``, ``"bf16"`` or ``"fp32"`` (:mod:`commpress.storage`; as in
            :func:`commpress.ddp.register`); ``None`` (default): ``"int4"`` for a sparsifier
            (topk, dgc, randomk, threshold) without momentum correction, whose residuals and pending
            copies then keep 1.12 bytes per parameter (FSDP2 has no memory to lend them,
            :mod:`commpress.loan`), ``"int8"`` otherwise and once ``optimizer=`` brings momentum.
        rollback: ``"step"`` or ``"unit"`` (no pending residual kept between steps; a
            NaN/inf keeps the residuals of the unit that saw it and of the later
            ones), as in :func:`commpress.ddp.register`.
        momentum: momentum correction's factor in the hook's error feedback (0: off;
            ``optimizer=`` sets it from SGD's momentum).
        momentum_masking: momentum factor masking (with ``momentum``).
        auto: the options of compressor ``"auto"``, a ``commpress.auto.Options`` (the same
            as :class:`commpress.auto.runtime.AutoSpec`); only with ``compressor="auto"``.
            Given as keywords they still work, with a ``DeprecationWarning``.
        sparse_rows: parameters whose gradients are naturally row-sparse (an ``nn.Embedding``
            weight): a list of 2-D parameters of ``module`` (or their names), or ``"auto"`` (every
            2-D parameter measured in the first 2 steps, those found sparse kept).  Their nonzero
            rows go to the ranks owning them in the reduce-scatter layout
            (:func:`commpress.collectives.rows.rows_reduce_scatter`: one ``all_to_all``, lossless,
            deterministic); the rest of their unit as configured.  A parameter whose rows stop
            being sparse goes dense (an exact ``reduce_scatter``) and is re-checked every 100 steps.
            ``state.stats.as_dict()["sparse_rows"]`` shows each one's density and path.  With
            ``optimizer=`` their momentum is plain SGD momentum on this rank's shard.  Not with
            compressor ``"auto"`` or ``replicate_group`` (``ValueError``).
        **compressor_params: the compressor's parameters (with a registry name); the
            sparsifiers' density warm-up (``density_warmup=``, ``density_start=``) is
            one.

    Returns:
        The :class:`FSDPState` (``.stats``, ``.state_dict()``).

    Raises:
        TypeError: when ``module`` is not an FSDP2 module (and holds none), or for a
            bad ``scaler``.
        RuntimeError: when commpress is already registered on one of its units.
        ValueError: when the configuration differs between ranks (on every rank), for
            ``"auto"`` with ``replicate_group`` or ``reduce_scatter=False``, for a
            ``replicate_group`` on a 2-D mesh, a low-rank compressor, an
            ``all_gather`` compressor that is not fixed-size, or a ``sparse_rows`` entry that is
            not a 2-D parameter of ``module`` (named, on every rank).

    Example:
        >>> fully_shard(model)
        >>> state = commpress.fsdp.register(model, "blockquant", all_gather="blockquant")
        >>> ...  # train as usual
        >>> print(state.stats.as_dict())

    A quantizer given by name (``"blockquant"``, ``"fp8"``, ``"mx"``) without ``stochastic=``
    rounds stochastically and runs without error feedback: unbiased, and no rank keeps a residual
    of the whole model (with ``stochastic=False``: error feedback, 8 bytes per parameter of the
    model on every rank in fp32; see the README's FSDP2 memory table).
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module wrapped with fully_shard (FSDP2), "
                        f"got {type(module).__name__}")
    units = fsdp_units(module, recurse=recurse)
    if not units:
        has_fsdp = any(isinstance(m, FSDPModule) for m in module.modules())
        hint = ("its FSDP modules hold no parameters" if has_fsdp else
                "call torch.distributed.fsdp.fully_shard(module) first; DDP models use commpress.ddp")
        raise TypeError(f"module must be an FSDP2 module (torch.distributed.fsdp.FSDPModule, from "
                        f"fully_shard) with parameters, got {type(module).__name__}: {hint}")
    for name, m in units:
        if getattr(m, _ATTR, None) is not None:
            raise RuntimeError(f"commpress.fsdp is already registered on FSDP unit {name or '<root>'!r} "
                               f"({type(m).__name__}); register once per model")
    groups = [g for _, m in units for g in _param_groups(m)]
    if replicate_group is not None and any(g._is_hsdp for g in groups):
        raise ValueError(
            "replicate_group: the model is sharded with a 2-D (replicate x shard) mesh, whose replica "
            "all-reduce torch 2.13's FSDP2 runs itself with no hook to replace it; shard each replica "
            "with the 1-D shard mesh (mesh['shard']) and pass replicate_group=mesh['replicate'].get_group()")
    if isinstance(compressor, str) and compressor == "auto" and (replicate_group is not None or not reduce_scatter
                                                                  and reduce_scatter is not None):
        raise ValueError("compressor 'auto' chooses each unit's reduce-scatter: replicate_group= and "
                         "reduce_scatter=False are not supported with it; give a fixed compressor")
    if reduce_scatter is None:
        reduce_scatter = replicate_group is None
    pg = groups[0]._reduce_scatter_process_group
    state = FSDPState(compressor, error_feedback=error_feedback, all_gather=all_gather,
                      process_group=pg if replicate_group is None or reduce_scatter else dist.group.WORLD,
                      units=units, scaler=scaler, residual_storage=residual_storage,
                      rollback=rollback, momentum=momentum, momentum_masking=momentum_masking, auto=auto,
                      **compressor_params)
    state._replicate = None if replicate_group is None else replicate_group.size()
    if optimizer is not None:
        state.attach_optimizer(optimizer)  # before the fingerprint: the momentum is part of it
    if sparse_rows is not None:   # bad entries raise here, on every rank (the same model), before any collective
        state._bind_rows(module, sparse_rows)
    state.check_config()
    if state.auto:
        state._bind_auto()
    for name, m in units:
        if reduce_scatter:
            m.set_custom_reduce_scatter(CompressedReduceScatter(state, name))
        if replicate_group is not None:
            m.set_all_reduce_hook(ReplicaAllReduce(state, name, replicate_group))
        if state._all_gather_compressor is not None:
            m.set_custom_all_gather(QuantizedAllGather(state, name))
        setattr(m, _ATTR, state)
    log.info("commpress.fsdp: %s on %d FSDP unit(s), error feedback %s, all_gather %s",
             state.compressor, len(units), state.uses_error_feedback, state._all_gather_compressor)
    return state
