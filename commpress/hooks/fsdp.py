"""FSDP2 integration: compressed reduce-scatter of gradients, optionally quantized all-gather of parameters.

One call, on a model already wrapped with ``torch.distributed.fsdp.fully_shard``::

    state = commpress.fsdp.register(model, "blockquant", bits=8)
    state = commpress.fsdp.register(model, "topk", ratio=0.01)            # + error feedback ("auto")
    state = commpress.fsdp.register(model, "identity", all_gather="blockquant")   # ZeRO++ qwZ style

Every submodule that is an ``FSDPModule`` with parameters (an *FSDP unit*) gets a
:class:`CompressedReduceScatter` through ``FSDPModule.set_custom_reduce_scatter``
(and, with ``all_gather``, a :class:`QuantizedAllGather` through
``set_custom_all_gather``).

What FSDP2 hands the reduce-scatter
-----------------------------------
A flat buffer of ``P·m`` elements in the reduce dtype: gradient chunk ``j``
(``input[j·m:(j+1)·m]``, padding included) belongs to rank ``j``; the output is
rank ``r``'s ``m`` elements of the reduced chunk ``r``.  FSDP2 also passes the
reduce op: ``AVG`` (fp32 / bf16 reduction: the backend divides by ``P``),
``SUM`` (fp16 reduction: FSDP pre/post-divides itself) or
``PREMUL_SUM(1/f)`` (``set_gradient_divide_factor(f)``).  The compressed paths
apply the same scaling, so the gradient the optimizer sees is what default FSDP2
produces up to compression error.

What goes on the wire, per aggregation kind of the compressor
-------------------------------------------------------------
``"sum"`` (identity, fp16, bf16, shared-seed random-k)
    each chunk ``j`` is compressed (key ``(unit, j)``, so shared random choices
    agree across ranks); the wire tensors of the ``P`` chunks are concatenated
    and reduce-scattered with FSDP's own op (one ``reduce_scatter`` per wire
    tensor), then decompressed.  With ``identity`` this is exactly FSDP2's
    default call.  Wire: ``(P−1)/P`` of the compressed buffer.
``"gather"`` (quantizers: blockquant, qsgd, terngrad, signsgd) and ``"sparse"`` (topk, threshold, dgc)
    the quantized / sparse reduce-scatter (first phase of the two-phase
    allreduce): chunk ``j`` is compressed and sent to its owner ``j`` only; the
    owner decodes the ``P`` contributions and sums them in fp32 in rank order.
    Wire: one ``all_gather`` of a small header (``P·(1+T)`` int64 per rank: a
    mode flag and the element count of each of the ``T`` wire tensors per
    destination), then one ``all_to_all`` of the packed payload bytes
    (``Σ_{j≠r} payload_j.nbytes``).  For a sparsifier that is
    ``k·(4+itemsize)·(P−1)/P`` bytes instead of a sparse allreduce's
    ``k·(4+itemsize)·(P−1)``.
``"lowrank"`` (PowerSGD)
    not supported: FSDP's reduce-scatter input is a flat buffer of many
    parameters' shards; ``register`` raises ``ValueError``.

Non-finite gradients: on the owner path a rank whose input holds NaN/inf sends
that step's chunks dense (mode flag 1, raw values in the reduce dtype), bypassing
compression and error feedback, so the NaN/inf land exactly where default FSDP2
puts them (and ``GradScaler`` skips the step), and that rank's residuals are left
as they were.  On the "sum" path the NaN/inf travel in the cast values
(identity, fp16, bf16) or by the compressor's own propagation contract, and
``ErrorFeedback`` keeps a residual unchanged whenever its input is non-finite.
On the owner path every rank defers its error-feedback update until the header
exchange has shown every peer's mode: when any rank sent dense (an overflow step,
which ``GradScaler`` skips) no rank updates its residuals, so the skipped step
leaves all of them untouched.  Error feedback residuals live in the ``ErrorFeedback`` codec keyed by
``(unit name, chunk index)``; they are allocated at the first step and reused.

The optional quantized all-gather (``all_gather="blockquant"``): each rank
compresses its flat parameter shard, the packed codes are all-gathered (one
``all_gather`` of ``payload.nbytes`` per rank) and every rank, itself included,
decodes all ``P`` shards, so all ranks compute with identical (quantized)
unsharded parameters while the sharded fp32 parameters the optimizer updates
stay exact.  Shards whose all-gather dtype the compressor does not support (a
``uint8`` mixed-dtype buffer) go dense.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ..collectives import _comm
from ..collectives.accounting import CommStats
from ..compressors import Compressor, Payload
from ..feedback import ErrorFeedback
from .common import HookState, Timer, resolve_compressor, tensor_bytes

log = logging.getLogger("commpress")

__all__ = ["register", "FSDPState", "CompressedReduceScatter", "QuantizedAllGather", "fsdp_units"]

_ATTR = "_commpress_fsdp_state"
_RedOpType = dist.ReduceOp.RedOpType
_MODE_COMPRESSED = 0
_MODE_DENSE = 1


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


# ------------------------------------------------------------------ wire helpers
# Thin wrappers over commpress.collectives._comm that return the bytes sent.  Bytes are charged by the direct model of commpress.collectives.accounting: an
# all_gather of s bytes per rank sends s*(P-1), an all_to_all sends what goes to
# other ranks.  The data a rank keeps for itself is never counted.
def _gather_rows(t: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, int]:
    """All-gather a flat tensor of the same size from every rank: ``([P, n], bytes sent)``."""
    cs = CommStats()
    return _comm.all_gather(t.reshape(-1), group, cs), cs.bytes_sent


def _all_to_all(buf: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup
                ) -> tuple[torch.Tensor, int]:
    """All-to-all of a uint8 buffer cut into ``send[r]`` bytes per rank: ``(received, bytes sent)``."""
    cs = CommStats()
    return _comm.all_to_all_bytes(buf, send, recv, group, cs), cs.bytes_sent


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ------------------------------------------------------------------ reduce op
def _op_scale(op: Any, world: int) -> float | None:
    """The factor the backend applies after summing for ``op`` (``None``: op not supported).

    ``AVG`` → ``1/world``; ``SUM`` → 1; ``PREMUL_SUM(f)`` → ``f``.
    """
    kind = op if isinstance(op, _RedOpType) else getattr(op, "op", None)
    if kind == _RedOpType.AVG:
        return 1.0 / world
    if kind == _RedOpType.SUM:
        return 1.0
    if kind == _RedOpType.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if isinstance(factor, torch.Tensor):
            factor = float(factor.item())
        return None if factor is None else float(factor)
    return None


# ------------------------------------------------------------------ state
@dataclass
class _Unit:
    """Book-keeping of one FSDP unit."""

    name: str
    module: FSDPModule
    calls: int = 0
    input_numel: int = 0


class FSDPState(HookState):
    """What :func:`register` returns: codec, units, step counter, :class:`~.common.Stats`.

    ``state.stats`` counts, per step (one backward pass) and cumulatively, the
    bytes this rank handed to ``torch.distributed`` in the reduce-scatters (and
    the all-gathers when ``all_gather`` is set) against what FSDP2's dense
    collectives would have sent, by the direct model of
    :mod:`commpress.collectives.accounting` (a reduce-scatter of ``n`` bytes
    sends ``n·(P−1)/P``; an all-gather of ``s`` bytes per rank sends
    ``s·(P−1)``).  ``state_dict()`` / ``load_state_dict()`` save and restore
    the step counter, the residuals and the noise generator of this rank.
    """

    kind = "fsdp"

    def __init__(self, compressor: Compressor | str, *, error_feedback: bool | str = "auto",
                 all_gather: Compressor | str | None = None,
                 process_group: dist.ProcessGroup | None = None,
                 units: Sequence[tuple[str, FSDPModule]] = (),
                 **compressor_params: Any) -> None:
        super().__init__(compressor, error_feedback=error_feedback, process_group=process_group,
                         **compressor_params)
        if self.compressor.aggregation == "lowrank":
            raise ValueError(
                f"compressor {self.compressor.name!r} (aggregation 'lowrank') is not supported with "
                "FSDP2: the reduce-scatter input is a flat buffer of many parameters' shards; use a "
                "'sum', 'sparse' or 'gather' compressor"
            )
        self.all_gather_compressor: Compressor | None = None
        if all_gather is not None:
            ag = resolve_compressor(all_gather)
            if ag.aggregation not in ("gather", "sum"):
                raise ValueError(
                    f"all_gather must name a fixed-size compressor (aggregation 'gather' or 'sum', "
                    f"e.g. 'blockquant' or 'bf16'), got {ag.name!r} with aggregation {ag.aggregation!r}"
                )
            self.all_gather_compressor = ag
        self.units: dict[str, _Unit] = {name: _Unit(name, m) for name, m in units}
        self.generator = torch.Generator().manual_seed(0x5EED + 7919 * self.rank)
        self._step_open = False
        self._reduced: set[str] = set()

    # -- configuration ------------------------------------------------------
    def config(self) -> dict[str, Any]:
        cfg = super().config()
        ag = self.all_gather_compressor
        cfg["all_gather"] = None if ag is None else {"compressor": ag.name, "params": ag.config()}
        cfg["units"] = {name: _unit_layout(u.module) for name, u in self.units.items()}
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
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.end_step)
        except RuntimeError:
            # Not inside a backward pass (a collective called by hand): the step is
            # closed by the next reduce-scatter of the same unit or by end_step().
            log.debug("commpress.fsdp: reduce-scatter outside backward; step closes lazily")

    def end_step(self) -> None:
        """Close the current step (called automatically at the end of each backward pass)."""
        if not self._step_open:
            return
        self._step_open = False
        self._reduced.clear()
        self.step += 1
        # residual buffers (fp32, one per (unit, chunk)); read in place, no copy
        self.stats.memory_overhead_bytes = tensor_bytes(list(getattr(self.codec, "_residuals", {}).values()))
        self.stats.end_step()

    # -- checkpoints --------------------------------------------------------
    def _extra_state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(),
                "unit_calls": {name: int(u.calls) for name, u in self.units.items()}}

    def _load_extra_state_dict(self, extra: dict[str, Any], state: dict[str, Any]) -> None:
        if "generator" in extra:
            self.generator.set_state(extra["generator"])
        for name, calls in extra.get("unit_calls", {}).items():
            if name in self.units:
                self.units[name].calls = int(calls)


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

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> None:
        st = self.state
        unit = st.units[self.unit]
        world = group.size()
        scale = _op_scale(op, world)
        m = output_tensor.numel()
        dense_bytes = m * input_tensor.element_size() * (world - 1)
        st._touch_step(self.unit)
        with Timer() as t:
            if scale is None or world == 1:
                log.warning("commpress.fsdp: reduce op %s not supported, unit %r goes dense", op, self.unit)
                dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op)
                sent, algorithm = dense_bytes, "dense"
            else:
                if unit.input_numel != input_tensor.numel():
                    if unit.input_numel:
                        log.info("commpress.fsdp: unit %r reduce-scatter size changed %d -> %d",
                                 self.unit, unit.input_numel, input_tensor.numel())
                    unit.input_numel = input_tensor.numel()
                if st.compressor.aggregation == "sum":
                    sent, algorithm = self._sum_path(output_tensor, input_tensor, group, op, world)
                else:
                    sent, algorithm = self._owner_path(output_tensor, input_tensor, group, world, scale)
            unit.calls += 1
        st.stats.record(self.unit, bytes_sent=sent, dense_bytes=dense_bytes, algorithm=algorithm,
                        compress_seconds=t.seconds, hook_seconds=t.seconds)
        return None

    # -- "sum" compressors: reduce-scatter of the concatenated wire tensors ----
    def _sum_path(self, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
                  op: Any, world: int) -> tuple[int, str]:
        st = self.state
        chunks = inp.view(world, -1)
        payloads = [st.codec.compress(chunks[j], step=st.step, key=(self.unit, j),
                                      generator=st.generator) for j in range(world)]
        me = group.rank()
        sent = 0
        reduced = []
        for i, mine in enumerate(payloads[me].tensors):
            wire = torch.cat([p.tensors[i].reshape(-1) for p in payloads])
            recv = torch.empty(mine.numel(), dtype=mine.dtype, device=mine.device)
            dist.reduce_scatter_single(recv, wire, group=group, op=op)
            sent += recv.numel() * recv.element_size() * (world - 1)
            reduced.append(recv.reshape(mine.shape))
        p = payloads[me]
        summed = Payload(tuple(reduced), p.shape, p.dtype, p.numel, dict(p.meta))
        out.copy_(st.codec.decompress(summed).reshape(-1))
        return sent, f"{st.compressor.name}:reduce_scatter"

    def _compress_chunks(self, chunks: torch.Tensor) -> tuple[list[Payload], list[tuple[Any, torch.Tensor, Payload]]]:
        """Compress each destination's chunk; with error feedback, the residual updates
        are returned for later (``(key, compensated, payload)``) instead of applied."""
        st = self.state
        keys = [(self.unit, j) for j in range(chunks.shape[0])]
        if not isinstance(st.codec, ErrorFeedback):
            return [st.codec.compress(chunks[j], step=st.step, key=key, generator=st.generator)
                    for j, key in enumerate(keys)], []
        payloads, deferred = [], []
        for j, key in enumerate(keys):
            compensated = st.codec.compensate(chunks[j], key)
            payload = st.codec.compressor.compress(compensated.to(chunks.dtype), step=st.step, key=key,
                                                   generator=st.generator)
            payloads.append(payload)
            deferred.append((key, compensated, payload))
        return payloads, deferred

    # -- "gather" / "sparse": compressed chunks to their owners, decoded there ---
    def _owner_path(self, out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup,
                    world: int, scale: float) -> tuple[int, str]:
        st = self.state
        me = group.rank()
        chunks = inp.view(world, -1)
        m = chunks.shape[1]
        dense = not bool(torch.isfinite(inp).all())
        if dense:
            payloads = [Payload((chunks[j].contiguous(),), chunks[j].shape, inp.dtype, m)
                        for j in range(world)]
        else:
            payloads, deferred = self._compress_chunks(chunks)
        # decode structure (wire dtypes, fixed shapes, meta) of a chunk of m elements
        template = _template(st, chunks[me]) if dense else payloads[me]
        ntensors = len(template.tensors)
        # per destination: mode, then the element count of each wire tensor (dense: one)
        mode = _MODE_DENSE if dense else _MODE_COMPRESSED
        rows = [[mode] + [t.numel() for t in p.tensors] + [0] * (ntensors - len(p.tensors))
                for p in payloads]
        header = torch.tensor(rows, dtype=torch.int64, device=inp.device)  # NCCL: device tensors
        headers, sent = _gather_rows(header, group)
        headers = headers.cpu().view(world, world, -1)    # [source, destination, field]
        if not dense and not bool((headers[:, :, 0] == _MODE_DENSE).any()):
            for key, compensated, payload in deferred:  # no rank overflowed: keep the residuals
                st.codec.update(key, compensated, st.codec.compressor.decompress(payload))
        blobs = [_comm.to_bytes(*p.tensors) for p in payloads]
        send_sizes = [b.numel() for b in blobs]
        specs_from = []
        for src in range(world):
            row = headers[src, me].tolist()
            if row[0] == _MODE_DENSE:
                specs_from.append([(inp.dtype, (m,))])
            else:
                specs_from.append([(t.dtype, _shape_for(t, n))
                                   for t, n in zip(template.tensors, row[1:])])
        recv_sizes = [_spec_bytes(sp) for sp in specs_from]
        buf, sent_a2a = _all_to_all(torch.cat(blobs), send_sizes, recv_sizes, group)
        acc = torch.zeros(m, dtype=torch.float32, device=out.device)
        offset = 0
        any_dense = dense
        for src in range(world):
            tensors = _comm.from_bytes(buf[offset:offset + recv_sizes[src]], specs_from[src])
            offset += recv_sizes[src]
            if int(headers[src, me, 0]) == _MODE_DENSE:
                any_dense = True
                acc += tensors[0].float()
            else:
                payload = Payload(tuple(tensors), torch.Size([m]), inp.dtype, m, dict(template.meta))
                acc += st.codec.decompress(payload).reshape(-1).float()
        acc.mul_(scale)
        out.copy_(acc)
        algorithm = f"{st.compressor.name}:{st.compressor.aggregation}_reduce_scatter"
        if any_dense:
            algorithm += "+nonfinite_dense"
        return sent + sent_a2a, algorithm


def _template(st: FSDPState, like: torch.Tensor) -> Payload:
    """A payload of the right structure for ``like``'s size (dtypes, shapes, meta), from zeros."""
    inner = st.compressor
    return inner.compress(torch.zeros_like(like), step=st.step, key=("template",),
                          generator=torch.Generator().manual_seed(0))


def _shape_for(t: torch.Tensor, n: int) -> tuple[int, ...]:
    """Template tensor ``t``'s shape when it has ``n`` elements, else 1-D (variable-size payloads)."""
    return tuple(t.shape) if t.numel() == n else (n,)


def _spec_bytes(specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> int:
    return sum(math.prod(shape) * _itemsize(dtype) for dtype, shape in specs)


class QuantizedAllGather(_CommBase, AllGather):
    """FSDP2 ``AllGather`` that sends each rank's parameter shard compressed (ZeRO++ qwZ style).

    Wire: one ``all_gather`` of the packed payload bytes (``payload.nbytes`` per
    rank, e.g. ``n + 4·ceil(n/256)`` for 8-bit blockquant of ``n`` fp32
    elements instead of ``4n``).  Every rank decodes all shards, its own too.
    """

    def __init__(self, state: FSDPState, unit: str) -> None:
        self.state = state
        self.unit = unit

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> None:
        st = self.state
        comp = st.all_gather_compressor
        assert comp is not None
        world = group.size()
        n = input_tensor.numel()
        dense_bytes = n * input_tensor.element_size() * (world - 1)
        name = f"{self.unit}/all_gather"
        with Timer() as t:
            if input_tensor.dtype not in comp.supported_dtypes or world == 1:
                dist.all_gather_single(output_tensor, input_tensor, group=group)
                sent, algorithm = dense_bytes, "dense"
            else:
                payload = comp.compress(input_tensor, step=st.step, key=(self.unit, "all_gather"),
                                        generator=st.generator)
                rows, sent = _gather_rows(_comm.to_bytes(*payload.tensors), group)
                specs = [(x.dtype, tuple(x.shape)) for x in payload.tensors]
                out = output_tensor.view(world, n)
                for r in range(world):
                    got = Payload(tuple(_comm.from_bytes(rows[r], specs)), payload.shape, payload.dtype,
                                  payload.numel, dict(payload.meta))
                    out[r].copy_(comp.decompress(got).reshape(-1))
                algorithm = f"{comp.name}:all_gather"
        st.stats.record(name, bytes_sent=sent, dense_bytes=dense_bytes, algorithm=algorithm,
                        compress_seconds=t.seconds, hook_seconds=t.seconds)
        return None


# ------------------------------------------------------------------ registration
def register(module: torch.nn.Module, compressor: Compressor | str, *,
             error_feedback: bool | str = "auto", all_gather: Compressor | str | None = None,
             recurse: bool = True, **compressor_params: Any) -> FSDPState:
    """Compress the gradient reduce-scatter of every FSDP2 unit in ``module``'s tree.

    ``module``: a model (or submodule) wrapped with ``fully_shard``; every
    ``FSDPModule`` with parameters in its tree is handled (only ``module``
    itself with ``recurse=False``).  ``compressor``: a
    :class:`~commpress.Compressor` or a registry name with
    ``**compressor_params``.  ``error_feedback``: ``True``, ``False`` or
    ``"auto"`` (on for biased compressors).  ``all_gather``: ``None`` (dense
    parameter all-gather) or a fixed-size compressor (name or instance, e.g.
    ``"blockquant"``) used to all-gather parameters quantized.

    Collective: exchanges a configuration fingerprint over the units' process
    group (compressor, parameters, options, world size, unit names and
    parameter shapes); a mismatch raises ``ValueError`` on every rank.
    Raises ``TypeError`` when ``module`` is not an FSDP2 module (and holds
    none), ``RuntimeError`` when commpress is already registered on one of its
    units.  Returns the :class:`FSDPState` (``.stats``, ``.state_dict()``).
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
    pg = groups[0]._reduce_scatter_process_group
    state = FSDPState(compressor, error_feedback=error_feedback, all_gather=all_gather,
                      process_group=pg, units=units, **compressor_params)
    state.check_config()
    for name, m in units:
        m.set_custom_reduce_scatter(CompressedReduceScatter(state, name))
        if state.all_gather_compressor is not None:
            m.set_custom_all_gather(QuantizedAllGather(state, name))
        setattr(m, _ATTR, state)
    log.info("commpress.fsdp: %s on %d FSDP unit(s), error feedback %s, all_gather %s",
             state.compressor, len(units), state.uses_error_feedback, state.all_gather_compressor)
    return state
