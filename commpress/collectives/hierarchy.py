"""Two-level compressed allreduce: dense inside a node, compressed between nodes.

A :class:`Hierarchy` cuts the ``P`` ranks of a group into ``P / L`` nodes of
``L`` consecutive ranks (torchrun's layout: node ``i`` holds group ranks
``iL .. iL+L-1``).  ``allreduce(tensor, compressor, hierarchy=h)`` then runs
(BytePS two-level, Bagua hierarchical, ZeRO++ qgZ):

1. **intra reduce-scatter, dense**: the flat tensor is cut into ``L`` shards
   (:meth:`Hierarchy.bounds`); one ``all_to_all_single`` inside the node sends
   shard ``j`` of every local rank to local rank ``j``, which adds the ``L``
   pieces in fp32 (exact for fp32 input up to rounding; fp32 accumulation for
   fp16/bf16 input, sent in its own dtype).  Each piece carries two status
   slots: ``[ranks with bad input, ranks with a NaN/inf]``.
2. **inter compressed allreduce** of shard ``j`` among the ``P / L`` ranks with
   local rank ``j`` (:func:`commpress.collectives.allreduce` on the inter-node
   group, every compressor kind), under the key ``("shard", key, j)``: error
   feedback keeps one residual per shard, staged in the caller's
   :class:`~commpress.feedback.ResidualTransaction`.
3. **intra all-gather, dense** of the reduced shards (in the tensor's dtype).

What crosses nodes: only step 2, the payload of ``numel / L`` elements per
rank among ``P / L`` ranks, instead of a payload of ``numel`` among ``P``.

Step 2's result is bitwise identical across the inter group, and step 3
hands every rank of a node the same ``L`` shards, so every rank ends with
bitwise the same sum.  A NaN/inf anywhere (with error feedback) poisons every
shard before step 2, so the result is all-NaN on every rank and every residual
keeps its value; bad input on any rank raises on every rank (through the
status slots of step 1, then step 2's status).

``Hierarchy(L, mode="auto")`` picks flat or two-level per tensor from two
alpha-beta models (one calibrated inside the nodes, one between them; see
:meth:`Hierarchy.plan`), a pure function of static facts: every rank decides
alike with no exchange.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ..feedback import nonfinite_flag, owns_transaction
from . import _comm, costmodel, wire
from .wire import fingerprint, has_feedback, local_check, payload_bytes, unwrap
from .core import ALLREDUCE_ALGORITHMS
from .core import allreduce as flat_allreduce
from .costmodel import CostModel
from .quantized import alignment
from .validate import check_once

log = logging.getLogger("commpress")

MODES = ("two_level", "auto")
#: fp32 elements at which :meth:`Hierarchy.models` times the two-level path's intra phases
#: (256 KiB and 4 MiB: the bucket sizes between DDP's first and its default).
INTRA_FIT_SIZES = (1 << 16, 1 << 20)


class Hierarchy:
    """The node layout of ``group`` and its intra-node / inter-node process groups.

    Ranks ``[n·L, (n+1)·L)`` form node ``n``.  ``allreduce(..., hierarchy=h)`` then sums densely
    inside each node (a reduce-scatter by one ``all_to_all_single`` on the intra group),
    compresses only between nodes (each local rank's shard, on its inter group) and all-gathers
    inside the node: what crosses nodes is a payload of ``numel / L`` elements among ``P / L``
    ranks (the module doc).

    Collective: every rank of the default group constructs it, in the same order relative to
    other group creations (``dist.new_group``'s rule); it creates ``P / L`` intra groups then
    ``L`` inter groups, after one small ``all_gather`` that checks ``local_size``.

    Attributes:
        local_size: ranks per node ``L``.
        nodes: the number of nodes ``P / L``.
        local_rank: this rank's index inside its node.
        node: this rank's node.
        intra: this rank's intra-node process group.
        inter: this rank's inter-node process group (the ranks of the same local rank).

    Args:
        local_size: ranks per node ``L``: a positive int dividing ``P``, equal on every rank.
        group: the process group (``None``: the default group).
        mode: ``"two_level"`` (always) or ``"auto"`` (flat or two-level per tensor, by the
            intra/inter cost models).

    Raises:
        ValueError: a bad ``mode``, or a ``local_size`` that is not a positive int dividing
            ``P`` or differs across ranks (on every rank together).

    Example::

        >>> h = commpress.collectives.Hierarchy.from_env()        # torchrun's LOCAL_WORLD_SIZE
        >>> total = commpress.collectives.allreduce(grad, c, hierarchy=h)
    """

    def __init__(self, local_size: int, group=None, *, mode: str = "two_level") -> None:
        if mode not in MODES:
            raise ValueError(f"Hierarchy: mode must be one of {MODES}, got {mode!r}")
        self.group = group
        self.mode = mode
        self.world = _comm.world(group)
        me = _comm.rank(group)
        ok = isinstance(local_size, int) and not isinstance(local_size, bool) and local_size >= 1
        mine = int(local_size) if ok else -1
        if self.world > 1:
            dev = _comm.comm_device(group)
            table = _comm.all_gather(torch.tensor([mine], dtype=torch.int64, device=dev),
                                     group=group).reshape(-1).tolist()
        else:
            table = [mine]
        if len(set(table)) > 1:
            raise ValueError(f"Hierarchy: local_size differs across ranks: {table} (rank r gave entry r)")
        if mine < 1:
            raise ValueError(f"Hierarchy: local_size must be a positive int, got {local_size!r}")
        if self.world % mine:
            raise ValueError(f"Hierarchy: local_size={mine} must divide the group size {self.world}")
        self.local_size = mine
        self.nodes = self.world // mine
        self.local_rank = me % mine
        self.node = me // mine
        self.intra = self.inter = None
        self._models: tuple[CostModel, CostModel] | None = None
        self._plans: dict[tuple, str] = {}
        self._scratch: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        if self.world > 1 and dist.is_initialized() and not (mode == "auto" and mine in (1, self.world)):
            ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
            backend = dist.get_backend(group)
            L = mine
            for nd in range(self.nodes):
                g = dist.new_group([ranks[nd * L + j] for j in range(L)], backend=backend)
                if nd == self.node:
                    self.intra = g
            for j in range(L):
                g = dist.new_group([ranks[nd * L + j] for nd in range(self.nodes)], backend=backend)
                if j == self.local_rank:
                    self.inter = g

    @classmethod
    def from_env(cls, group=None, *, mode: str = "two_level") -> "Hierarchy":
        """``Hierarchy(int(os.environ["LOCAL_WORLD_SIZE"]))`` (set by torchrun); collective."""
        raw = os.environ.get("LOCAL_WORLD_SIZE")
        try:
            local = int(raw) if raw is not None else -1
        except ValueError:
            local = -1
        if local < 1:  # still a collective: let the constructor raise on every rank together
            log.warning("commpress Hierarchy.from_env: LOCAL_WORLD_SIZE=%r is not a positive int", raw)
        return cls(local if local >= 1 else 0, group, mode=mode)

    def allreduce(self, tensor: torch.Tensor, compressor: Any, **kwargs: Any) -> torch.Tensor:
        """``commpress.collectives.allreduce(tensor, compressor, hierarchy=self, **kwargs)``."""
        return allreduce(tensor, compressor, self, **kwargs)

    def __repr__(self) -> str:
        return f"Hierarchy(local_size={self.local_size}, nodes={self.nodes}, mode={self.mode!r})"

    def config(self) -> tuple:
        """What must agree across ranks (for configuration fingerprints)."""
        return ("hierarchy", self.local_size, self.nodes, self.mode)

    # -- shards ------------------------------------------------------------
    def scratch(self, rows: int, width: int, dtype: torch.dtype, device: torch.device):
        """The reduce-scatter's send and receive buffers ``[rows, width]`` and its fp32 sum
        ``[width]``: allocated once per size, reused by every later call (one call at a time)."""
        k = (rows, width, dtype, device)
        if k not in self._scratch:
            if len(self._scratch) >= 16:
                self._scratch.pop(next(iter(self._scratch)))
            self._scratch[k] = (torch.empty(rows, width, dtype=dtype, device=device),
                                torch.empty(rows, width, dtype=dtype, device=device),
                                torch.empty(width, dtype=torch.float32, device=device))
        return self._scratch[k]

    def bounds(self, numel: int, compressor: Any = None, shape: tuple[int, ...] | None = None,
               shapes: list[tuple[int, ...]] | None = None) -> list[int]:
        """Shard ``j`` is ``[b[j], b[j+1])`` of the flat tensor: equal cuts, aligned to a
        ``"gather"`` compressor's block; for ``"lowrank"`` cuts between the matrices of
        ``shapes``, or between row blocks of a single matrix, so each shard stays matrices."""
        return shard_bounds(numel, self.local_size, compressor, shape, shapes)

    def shard_shapes(self, bounds: list[int], j: int, shape: tuple[int, ...],
                     shapes: list[tuple[int, ...]] | None) -> list[tuple[int, ...]] | None:
        """The ``shapes`` argument of shard ``j`` (lowrank only)."""
        return shard_shapes(bounds, j, shape, shapes)

    # -- cost model ----------------------------------------------------------
    def set_models(self, intra: CostModel | None, inter: CostModel | None = None) -> None:
        """Fix the intra-node and inter-node models (``set_models(None)``: calibrate again).
        Must be the same on every rank (the choice is not exchanged)."""
        self._models = None if intra is None else (intra, inter if inter is not None else intra)
        self._plans.clear()

    def models(self) -> tuple[CostModel, CostModel]:
        """``(intra, inter)``: :func:`~commpress.collectives.set_cost_model` numbers when set, else
        a calibration on the intra group and one on the inter group (cached per group), made
        equal on every rank by one max ``all_reduce`` over ``group``.  The intra model is then
        refitted to the two-level path's own intra phases (:meth:`_time_intra_phases`): where
        they cost more than the bare link predicts (their copies, sums and status pass; ranks
        that share cores), its α and β grow to match.  Collective the first time."""
        if self._models is None:
            a = costmodel.get_cost_model(self.intra) if self.intra is not None else costmodel.get_cost_model(None)
            b = costmodel.get_cost_model(self.inter) if self.inter is not None else a
            if self.world > 1 and costmodel._OVERRIDE is None:
                phases = self._time_intra_phases()
                v = torch.tensor([a.alpha, a.beta, a.gamma, a.delta, b.alpha, b.beta, b.gamma, b.delta, *phases],
                                 dtype=torch.float64, device=_comm.comm_device(self.group))
                dist.all_reduce(v, op=dist.ReduceOp.MAX, group=self.group)
                x = v.cpu().tolist()
                a, b = CostModel(*x[:4]), CostModel(*x[4:8])
                if phases:
                    a = fit_intra(a, self.local_size, INTRA_FIT_SIZES, x[8:])
            self._models = (a, b)
        return self._models

    def _time_intra_phases(self) -> list[float]:
        """Seconds of the two-level path's intra phases (reduce-scatter, then all-gather, as
        :func:`allreduce` runs them, with the status pass error feedback adds) at each of
        :data:`INTRA_FIT_SIZES` fp32 elements: the median of ``COMMPRESS_CALIBRATION_REPS``
        runs after one untimed.  ``[]`` with one rank per node (no intra phase).  Collective on
        the intra group; its buffers are freed."""
        if self.intra is None or self.local_size == 1:
            return []
        dev = _comm.comm_device(self.group)
        sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
        reps = costmodel.calibration_reps(self.intra)
        L, j = self.local_size, self.local_rank
        out = []
        for n in INTRA_FIT_SIZES:
            flat = torch.zeros(n, dtype=torch.float32, device=dev)
            result = torch.empty(n, dtype=torch.float32, device=dev)
            bnd = shard_bounds(n, L)
            S = max(bnd[i + 1] - bnd[i] for i in range(L))
            mine = bnd[j + 1] - bnd[j]
            times = []
            for _ in range(reps + 1):
                sync()
                t0 = time.perf_counter()
                acc = _intra_reduce_scatter(self, flat, bnd, S, torch.float32, False, True, None)
                _intra_all_gather(self, acc[:mine], bnd, S, mine, result, None)
                sync()
                times.append(time.perf_counter() - t0)
            self._scratch.pop((L, S + wire.SUM_SLOTS, torch.float32, dev), None)
            out.append(statistics.median(times[1:]))
        return out

    def predict(self, numel: int, compressor: Any, dtype: torch.dtype = torch.float32,
                shape: tuple[int, ...] | None = None,
                shapes: list[tuple[int, ...]] | None = None) -> dict[str, float]:
        """Predicted seconds of ``{"flat", "two_level"}`` for one tensor.

        Flat: the kind's collective over ``P`` ranks, its bytes split between the
        ``P - L`` remote peers (inter model) and the ``L - 1`` local ones (intra model),
        messages likewise.  Two-level: intra all-to-all of ``numel`` and
        all-gather of ``numel / L`` (intra model), plus the kind's collective over
        ``P / L`` ranks of the largest shard (inter model).
        """
        intra, inter = self.models()
        return predict_paths(numel, compressor, self.world, self.local_size, intra, inter, dtype, shape, shapes)

    def plan(self, numel: int, compressor: Any, dtype: torch.dtype = torch.float32,
             shape: tuple[int, ...] | None = None, shapes: list[tuple[int, ...]] | None = None) -> str:
        """``"flat"`` or ``"two_level"`` for one tensor (cached; identical on every rank)."""
        if self.mode == "two_level":
            return "two_level"
        if self.local_size in (1, self.world):
            return "flat"
        k = (numel, fingerprint(compressor), str(dtype), shape, None if shapes is None else tuple(shapes))
        if k not in self._plans:
            c = self.predict(numel, compressor, dtype, shape, shapes)
            self._plans[k] = min(("flat", "two_level"), key=lambda a: (c[a], a))
        return self._plans[k]


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def shard_bounds(numel: int, local_size: int, compressor: Any = None, shape: tuple[int, ...] | None = None,
                 shapes: list[tuple[int, ...]] | None = None) -> list[int]:
    """:meth:`Hierarchy.bounds` for ``local_size`` ranks per node (a pure function)."""
    L = local_size
    kind = getattr(unwrap(compressor), "aggregation", None) if compressor is not None else None
    if kind == "lowrank":
        if shapes is not None:
            ends, pos = [0], 0
            for s in shapes:
                pos += _prod(s)
                ends.append(pos)
            cuts = [0]
            for j in range(1, L):  # the matrix boundary nearest to j*n/L, never going back
                target = j * numel / L
                best = min(ends, key=lambda e: (abs(e - target), e))
                cuts.append(max(best, cuts[-1]))
            return cuts + [numel]
        if shape is not None and len(shape) >= 2 and shape[0] > 0:
            cols = numel // shape[0]
            return [(j * shape[0] // L) * cols for j in range(L + 1)]
    align = alignment(compressor) if kind == "gather" else 1
    per = -(-numel // L)
    per = -(-per // align) * align
    return [min(numel, j * per) for j in range(L + 1)]


def shard_shapes(bounds: list[int], j: int, shape: tuple[int, ...],
                 shapes: list[tuple[int, ...]] | None) -> list[tuple[int, ...]] | None:
    """:meth:`Hierarchy.shard_shapes` (a pure function)."""
    lo, hi = bounds[j], bounds[j + 1]
    if shapes is not None:
        out, pos = [], 0
        for s in shapes:
            if lo <= pos < hi:
                out.append(tuple(s))
            pos += _prod(s)
        return out
    if len(shape) >= 2 and shape[0] > 0:
        cols = _prod(shape) // shape[0]
        return [((hi - lo) // cols,) + tuple(shape[1:])]
    return None


def predict_paths(numel: int, compressor: Any, world: int, local_size: int, intra: CostModel, inter: CostModel,
                  dtype: torch.dtype = torch.float32, shape: tuple[int, ...] | None = None,
                  shapes: list[tuple[int, ...]] | None = None) -> dict[str, float]:
    """:meth:`Hierarchy.predict` from the two models (a pure function: no group, no collective)."""
    P, L, M = world, local_size, world // local_size
    es = torch.empty((), dtype=dtype).element_size()
    m, b, e, d = kind_terms(compressor, numel, P, dtype, shape, shapes)
    remote = (P - L) / max(P - 1, 1)
    flat = inter.time(m * remote, b * remote, e, d) + intra.time(m * (1 - remote), b * (1 - remote))
    bnd = shard_bounds(numel, local_size, compressor, shape, shapes)
    big = max(range(L), key=lambda j: bnd[j + 1] - bnd[j])
    s = bnd[big + 1] - bnd[big]
    sm, sb, se, sd = kind_terms(compressor, s, M, dtype, None,
                                 shard_shapes(bnd, big, shape or (numel,), shapes))
    lm, lb, le = intra_phase_terms(numel, L, es, s)
    local = intra.time(lm, lb, 0, le)
    return {"flat": flat, "two_level": local + inter.time(sm, sb, se, sd)}


def intra_phase_terms(numel: int, local_size: int, es: int = 4, shard: int | None = None
                      ) -> tuple[float, float, float]:
    """(messages, bytes, elements) of the two-level path's intra phases for ``numel`` elements of
    ``es`` bytes, the largest shard ``shard`` (default: an equal cut) elements: what
    :func:`predict_paths` prices at the intra model."""
    L = local_size
    s = -(-numel // L) if shard is None else shard
    return 2.0 * (L - 1), float((L - 1) * (s + 2) * es + (L - 1) * s * es), 2.0 * numel


def fit_intra(model: CostModel, local_size: int, sizes: tuple[int, ...], seconds: list[float]) -> CostModel:
    """``model`` with α and β refitted so that the intra phases' terms (:func:`intra_phase_terms`)
    at the first and last of ``sizes`` (fp32 elements) cost the measured ``seconds``; never below
    ``model``'s own α and β (the bare link's, the best of its repetitions).

    Args:
        model: the intra group's calibrated model (its γ and δ are kept).
        local_size: ranks per node.
        sizes: the element counts timed, ascending.
        seconds: the measured seconds at each of ``sizes``.
    """
    (m1, b1, e1), (m2, b2, e2) = intra_phase_terms(sizes[0], local_size), intra_phase_terms(sizes[-1], local_size)
    t1, t2 = seconds[0] - model.delta * e1, seconds[-1] - model.delta * e2
    beta = (t2 - t1) / (b2 - b1) if b2 > b1 else model.beta
    alpha = (t1 - beta * b1) / m1 if m1 else model.alpha
    if alpha < model.alpha:   # the line through both points would price small messages below the link
        alpha = model.alpha
        beta = (t2 - alpha * m2) / b2
    return CostModel(alpha, max(beta, model.beta), model.gamma, model.delta)


def _host_status(t: torch.Tensor) -> bool:
    """Whether the node's status may be read on the host now: only where that is free (CPU)."""
    return t.device.type == "cpu"


#: How the node's intra status is judged: on the host (``_host_status``: CPU tensors) or on the
#: device through the inter call's status.  Tests set ``lambda t: False`` to run the CUDA logic on CPU.
HOST_STATUS = _host_status



def kind_terms(compressor: Any, numel: int, P: int, dtype: torch.dtype, shape, shapes
                ) -> tuple[float, float, float, float]:
    """(messages, bytes, entries, elements) of the kind's default collective on ``P`` ranks."""
    if P <= 1 or numel == 0:
        return 0.0, 0.0, 0.0, float(numel)
    inner = unwrap(compressor)
    kind = inner.aggregation
    n = numel
    if kind == "sparse":
        c = inner.capacity(n)
        v = torch.empty((), dtype=dtype).element_size()
        b = costmodel.fixed_sparse_bytes(n, c, P, v, 4)
        if costmodel.choose_fixed_sparse(n, c, P, v, 4) == "allgather":
            return (P - 1), b["allgather"], P * c, n
        return 2 * (P - 1), b["dense"], c, n
    if kind == "gather":  # gather_all at P <= 2 (what the cost model always takes there), else two_phase
        # Its decoding is dense work (elements, at δ), not sparse entries: the caller measures one
        # compress + decompress as its codec cost, and the terms here hold the decoding beyond that
        # (gather_all: P-1 more chunks of n; two_phase: the owner's n/P re-compression and the
        # second decode of n).  Priced as γ entries, 3n made blockquant look slower than bf16.
        B = payload_bytes(inner, n, dtype)
        if P <= 2:
            return P - 1, B * (P - 1), 0, n + (P - 1) * n
        return 2 * (P - 1), 2 * B * (P - 1) / P, 0, n + n + n / P
    if kind == "lowrank":
        words = 0
        for s in (shapes if shapes is not None else [shape if shape is not None else (n,)]):
            ms = inner.matrix_shape(torch.empty(s, device="meta")) if len(s) >= 2 else None
            words += inner.rank * (ms[0] + ms[1]) if ms is not None else _prod(s)
        return 4 * (P - 1), 2 * 4 * words * (P - 1) / P, 0, n
    B = payload_bytes(inner, n, dtype)  # "sum"
    return 2 * (P - 1), 2 * B * (P - 1) / P, 0, n


# ---------------------------------------------------------------- the collective
@owns_transaction
def allreduce(tensor: torch.Tensor, compressor: Any, hierarchy: Hierarchy, *, group=None, key: Any = 0,
              step: int = 0, algorithm: str = "auto", stats=None, generator=None, validate: bool = True,
              transaction=None, shapes=None, out: torch.Tensor | None = None,
              prescale: float | None = None) -> torch.Tensor:
    """:func:`commpress.collectives.allreduce` through ``hierarchy`` (see the module doc).
    ``prescale``: sum ``tensor * prescale`` (``tensor`` unchanged), the multiplication done in
    the intra reduce-scatter's copy (no pass of its own)."""
    h = hierarchy
    if not isinstance(h, Hierarchy):
        raise TypeError(f"allreduce: hierarchy must be a commpress.collectives.Hierarchy or None, "
                        f"got {type(h).__name__}")
    if group is not None and group is not h.group:
        raise ValueError("allreduce: group must be None or the hierarchy's group when hierarchy is given")
    args = dict(key=key, step=step, algorithm=algorithm, stats=stats, generator=generator)
    shape = tuple(tensor.shape)
    if h.world == 1 or h.plan(tensor.numel(), compressor, tensor.dtype, shape, shapes) == "flat":
        return flat_allreduce(tensor, compressor, group=h.group, validate=validate, transaction=transaction,
                              shapes=shapes, out=out, prescale=prescale, **args)
    if out is not None and (out.shape != tensor.shape or out.dtype != tensor.dtype):
        raise ValueError(f"allreduce: out must have tensor's shape {tuple(tensor.shape)} and dtype "
                         f"{tensor.dtype}, got {tuple(out.shape)} {out.dtype}")
    inner = unwrap(compressor)
    kind = inner.aggregation

    wire.flush_deferred()
    err = local_check(tensor, compressor, algorithm, ALLREDUCE_ALGORITHMS[kind])
    n = tensor.numel()
    if validate:
        facts = ("two_level", kind, n, str(tensor.dtype), algorithm, fingerprint(compressor), h.config())
        check_once(h.group, key, facts, device=_comm.comm_device(h.group, tensor), error=err[0], numel=n,
                   dtype=tensor.dtype, algorithm=algorithm, kind=kind,
                   config=wire.signature(fingerprint(compressor), h.config()), stats=stats,
                   local_message=err[1], what="allreduce (two-level)")
    tx = transaction
    L, j = h.local_size, h.local_rank
    bnd = h.bounds(n, compressor, shape, shapes)
    S = max(bnd[i + 1] - bnd[i] for i in range(L))
    wdt = tensor.dtype if tensor.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64) \
        else torch.float32
    flat = tensor.reshape(-1)
    feedback = has_feedback(compressor)
    acc = _intra_reduce_scatter(h, flat, bnd, S, wdt, bool(err[0]), feedback, stats, prescale)
    mine = bnd[j + 1] - bnd[j]
    shard = acc[:mine].to(wdt)
    code, msg = err
    node_bad = None   # the node's verdict, on the device (CUDA: no host read)
    if not code and HOST_STATUS(acc) and float(acc[S]) != 0.0:
        code, msg = wire.E_MISUSE, f"bad input on {int(float(acc[S]))} rank(s) of node {h.node}"
    elif not code:
        node_bad = acc[S] != 0
    if feedback:
        wire.poison_(shard, acc[S + 1] != 0)
    # 2. inter compressed allreduce of my shard (a shard every node holds alike: same sizes, same key)
    if mine:
        if code:
            shard = torch.zeros(mine, dtype=torch.float32, device=tensor.device)
        # a node's bad rank rides in every status of the inter call (every inter group holds one
        # rank of that node, so every rank of every node raises together, here or deferred)
        # the shard is this call's own (a view of the node's sum, or zeros): it is the inner call's
        # output too, so error feedback's CPU lanes may compensate in it (:mod:`.steady`)
        with wire.device_error(node_bad):
            out_shard = flat_allreduce(shard, compressor, group=h.inter, validate=False, transaction=tx,
                                       shapes=h.shard_shapes(bnd, j, shape, shapes) if kind == "lowrank" else None,
                                       _error=(code, msg) if code else None,
                                       out=shard if kind != "lowrank" else None,
                                       **dict(args, key=("shard", key, j)))
    else:
        out_shard = shard
    # 3. intra all-gather of the reduced shards (``out`` may be ``tensor`` itself: no longer read)
    result = out if out is not None else torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    out = _intra_all_gather(h, out_shard, bnd, S, mine, result, stats)
    if stats is not None:
        stats.add(algorithm=f"two_level+{stats.last_algorithm or kind}")
    return out.reshape(shape)


def _intra_reduce_scatter(h: Hierarchy, flat: torch.Tensor, bnd: list[int], S: int, wdt: torch.dtype,
                          error: bool, feedback: bool, stats, scale: float | None = None) -> torch.Tensor:
    """1. Row ``i`` (``[shard i | pad | error, non-finite]``) goes to local rank ``i``, times
    ``scale`` when given (in the copy); returns this rank's fp32 sum over the node, status slots at
    ``S`` and ``S + 1``."""
    L = h.local_size
    send, recv, acc = h.scratch(L, S + wire.SUM_SLOTS, wdt, flat.device)
    for i in range(L):
        m = bnd[i + 1] - bnd[i] if not error else 0
        if m and scale is not None:
            torch.mul(flat[bnd[i]:bnd[i + 1]], scale, out=send[i, :m])
        elif m:
            send[i, :m].copy_(flat[bnd[i]:bnd[i + 1]])
        send[i, m:S].zero_()
    send[:, S].fill_(1.0 if error else 0.0)
    if feedback:   # what is sent (a finite value that the scale overflowed too)
        bad = nonfinite_flag(flat if scale is None else send[:, :S])
        send[:, S + 1:S + 2].copy_(bad.to(wdt).reshape(1, 1).expand(L, 1))
    _comm.all_to_all_(recv, send, group=h.intra, stats=stats)
    if wdt == torch.float32:
        torch.sum(recv, 0, out=acc)
    else:
        torch.sum(recv.float(), 0, out=acc)
    return acc


def _intra_all_gather(h: Hierarchy, out_shard: torch.Tensor, bnd: list[int], S: int, mine: int,
                      result: torch.Tensor, stats) -> torch.Tensor:
    """3. Every local rank's reduced shard into ``result`` (straight into it when the shards
    are equal and it is contiguous)."""
    L, n, dtype, dev = h.local_size, result.numel(), result.dtype, result.device
    if n == L * S and result.is_contiguous():
        piece = out_shard.reshape(-1).to(dtype).contiguous()
        _comm.all_gather_into(result.view(-1), piece, group=h.intra, stats=stats)
        return result
    piece = torch.zeros(S, dtype=dtype, device=dev)
    piece[:mine].copy_(out_shard.reshape(-1))
    gathered = _comm.all_gather(piece, group=h.intra, stats=stats)
    flat_out = result.view(-1) if result.is_contiguous() else torch.empty(n, dtype=dtype, device=dev)
    for i in range(L):
        flat_out[bnd[i]:bnd[i + 1]].copy_(gathered[i, :bnd[i + 1] - bnd[i]])
    if flat_out.data_ptr() != result.data_ptr() or not result.is_contiguous():
        result.copy_(flat_out.view(result.shape))
    return result
