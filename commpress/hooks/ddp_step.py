"""One training step of the DDP hook: created at the step's first compressed
bucket, dropped at its end.

Per bucket (:meth:`Step.run_bucket`):

0. with a loss scaler attached (:meth:`~commpress.hooks.common.HookState.attach_scaler`) the
   bucket is multiplied by ``1/S`` on arrival (one in-place pass, on the device; ``S`` the
   scaler's scale at the step's first bucket), so residuals and velocities hold unscaled
   values, and every finished bucket by ``S`` again (step 5);
1. every value is scaled by ``1/world_size`` before its sum (as DDP's reducer
   does); identity/fp16/bf16 fold the scaling into their cast, and a sparsifier's
   error feedback into its compensation pass;
2. its **dense part** (1-D, small and skipped parameters) is packed into one
   buffer; where the first unit this bucket runs can carry it
   (:meth:`HookConfig.unit_rides`: the sparse kinds at P=2, the gather kinds; with
   ``"auto"`` by the codec the unit chose) it
   rides in that unit's messages (``allreduce(..., dense=)``: one round per bucket
   at P=2),
   else it is all-reduced *asynchronously*, concurrently with the payloads;
3. every unit this bucket completes runs :func:`commpress.collectives.allreduce`
   with the step's :class:`~commpress.feedback.ResidualTransaction` (payload
   messages only; status inside; a NaN/inf on any rank poisons that unit); with
   :attr:`HookConfig.joins` (``join_buckets``: a CPU rank) a unit on a steady lane in a
   bucket that is not the step's last is *held* instead (:mod:`commpress.collectives.joint`):
   encoded now, its message carried by the next unit that runs, which lands it (at the
   step's last bucket at the latest): one round per step;
4. the dense part is waited for and scattered back; a NaN/inf in it marks the
   transaction bad (on the device; a riding one through its unit's status);
5. buckets whose units are all done are returned to complete their futures.

At the step's end the transaction commits: every residual takes its new value,
or keeps the old one when any rank saw a NaN/inf anywhere in the step, decided
on the device.  On an error the transaction rolls back and the step is dropped.

A step reads only its :class:`StepContext`: the :class:`HookConfig` frozen at
binding, the model's :class:`ModelLayout`, the stats it records into and the
step's number.  It never calls back into the hook's state.

The model's layout (first section below): which parameters go dense, how buckets
and units lie.  Plain records and pure functions; no communication.
:class:`ModelLayout` holds them for one model: what the hook binds (names,
shapes, the dense set) and what it learns from DDP's buckets (plans, units).
A *plan* is one DDP bucket as laid out now: its dense slices and its
compressible parameters.  A *unit* is one compressed collective call: the
compressible parameters of a bucket as DDP laid it out at the first compressed
step, concatenated.  Units are part of the hook's state (and its checkpoints),
so the result does not depend on DDP's bucket layout: not on its rebuild after
the first iteration, nor on a resumed run's other ``bucket_cap_mb``.
"""

from __future__ import annotations

import ctypes
import logging
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..collectives import CommStats, allreduce, carries_dense, joint
from ..collectives.rows import rows_allreduce
from ..collectives.core import folds_scale
from .._pool import BufferPool
from ..compressors import Compressor
from ..compressors._util import mix_seed, stable_hash
from ..feedback import ResidualTransaction, nonfinite_flag
from .common import Stats, Timer, all_reduce_bytes, loss_scales
from .ddp_loan import grad_loan

log = logging.getLogger("commpress")


# ------------------------------------------------------------------ the model's layout
@dataclass
class Unit:
    """One compressed call: a key and the parameters it concatenates (in order)."""

    key: Any
    names: list[str]
    sizes: list[int]
    shapes: list[tuple[int, ...]]
    #: its last call's algorithm could not carry a dense part (at P=2: an all_reduce of its own
    #: then, issued concurrently rather than after the call; the sum is the same either way)
    declines_dense: bool = False

    @property
    def numel(self) -> int:
        return sum(self.sizes)


@dataclass
class Plan:
    """One DDP bucket as laid out now."""

    index: int
    param_ids: tuple[int, ...]
    names: list[str]
    dense_slices: list[tuple[int, int]]              # (offset, numel) in the bucket buffer
    compressed: list[tuple[str, int, int]]           # (name, offset, numel)
    dense_names: list[str] = field(default_factory=list)   # the parameters of dense_slices
    dense_scratch: torch.Tensor | None = None
    #: the parameters tracked by ``sparse_rows`` (:class:`~.sparse_rows.SparseRows`): in no unit,
    #: summed as rows or, on their "dense" path, in this step's dense part
    rows: list[tuple[str, int, int]] = field(default_factory=list)   # (name, offset, numel)
    #: this step's dense part: ``dense_slices`` and the rows parameters on their dense path
    live_slices: list[tuple[int, int]] = field(default_factory=list)
    live_names: list[str] = field(default_factory=list)
    #: the units of the compressed parameters, each with its parts here ``(name, offset, numel)`` in
    #: the unit's order and whether they are the whole unit (``"auto"``'s dense steps under momentum
    #: correction)
    unit_parts: list[tuple[Unit, list[tuple[str, int, int]], bool]] | None = None


def unit_key(names: list[str]) -> str:
    """A key naming a unit by its parameters (stable across processes and restarts)."""
    return "ddp:%08x:%d" % (zlib.crc32("\0".join(names).encode()), len(names))


def goes_dense(name: str, p: torch.Tensor, inner: Compressor, *, dense_1d: bool, min_numel: int,
               uses_error_feedback: bool, skip: Callable[[str], bool] | None) -> bool:
    """The policy: 1-D parameters (with ``dense_1d``), small ones, skipped ones, and the
    ones the compressor would send as they are anyway travel in the dense part.

    Elementwise casts (fp16, bf16: compressors that declare ``casts``) are the exception
    to ``dense_1d`` / ``min_numel``: they send every parameter of a bucket in one
    message, as PyTorch's fp16/bf16 hooks do; a separate dense collective would cost
    more than it keeps (measured: 1.59x against 1.30x DDP on a 2.2M MLP at P=2).
    """
    if inner.name == "identity" and not uses_error_feedback:
        return True  # nothing to compress: one dense all_reduce, exactly DDP's
    if skip is not None and skip(name):
        return True
    if inner.casts:
        return False
    if (dense_1d and p.dim() <= 1) or p.numel() < min_numel:
        return True
    return not inner.is_compressed(torch.empty(p.shape, device="meta"))


def make_plan(index: int, params: list[torch.Tensor], names_by_id: dict[int, str],
              dense_names: set[str], rows_names: set[str] | frozenset = frozenset()) -> Plan:
    """The plan of a bucket holding ``params`` (in DDP's order): ``rows_names`` (the
    ``sparse_rows`` parameters) go in neither the dense part nor a unit."""
    names, dense, compressed, rows = [], [], [], []
    offset = 0
    for p in params:
        name = names_by_id.get(id(p))
        if name is None:
            raise RuntimeError(f"bucket {index} holds a parameter of shape {tuple(p.shape)} "
                               "that the model did not have at registration")
        names.append(name)
        if name in rows_names:
            rows.append((name, offset, p.numel()))
        elif name in dense_names:
            dense.append((offset, p.numel()))
        else:
            compressed.append((name, offset, p.numel()))
        offset += p.numel()
    return Plan(index=index, param_ids=tuple(id(p) for p in params), names=names, dense_slices=dense,
                compressed=compressed, dense_names=[nm for nm in names if nm in dense_names and nm not in rows_names],
                rows=rows)


def new_unit(plan: Plan, assigned: dict[str, int], shapes: dict[str, torch.Size]) -> Unit | None:
    """A unit for the compressible parameters of ``plan`` that have none yet (``None`` if all have)."""
    fresh = [(nm, n) for nm, _, n in plan.compressed if nm not in assigned]
    if not fresh:
        return None
    names = [nm for nm, _ in fresh]
    return Unit(key=unit_key(names), names=names, sizes=[n for _, n in fresh],
                shapes=[tuple(shapes[nm]) for nm in names])


def gather_slices(buf: torch.Tensor, slices: list[tuple[int, int]], out: torch.Tensor) -> None:
    pos = 0
    for off, n in slices:
        out[pos:pos + n].copy_(buf[off:off + n])
        pos += n


def scatter_slices(buf: torch.Tensor, slices: list[tuple[int, int]], src: torch.Tensor) -> None:
    pos = 0
    for off, n in slices:
        buf[off:off + n].copy_(src[pos:pos + n])
        pos += n


Pieces = list[tuple[torch.Tensor, int, int]]   # (bucket buffer, offset, numel) of a unit's parameters


def unit_input(unit: Unit, pieces: Pieces, packable: bool = False,
               pool: BufferPool | None = None) -> tuple[torch.Tensor, Callable | None]:
    """``(input, store)``: the unit's parameters concatenated, and ``store(result)``, which puts
    a result of that shape back into the bucket's pieces (``None``: the input is a view of one
    bucket buffer, where a result written into it already is).

    * pieces adjacent in one buffer: that view;
    * ``packable`` (the caller's word that the gaps between the pieces hold nothing but values
      it has saved, the bucket's dense part): the pieces are moved next to their largest run of
      adjacent pieces, which stays in place (:func:`packing`); the input is then a view and
      ``store`` moves them back.  The DDP buckets of an MLP (weights between biases) move at
      most half the unit instead of copying it twice into a buffer of its size;
    * else the pieces copied into a buffer of ``pool`` (a new one without); ``store`` copies back
      and returns the buffer to the pool.
    """
    buf, start, pos = pieces[0][0], pieces[0][1], pieces[0][1]
    for b, off, n in pieces:
        if b is not buf or off != pos:
            break
        pos += n
    else:
        return buf[start:pos], None
    plan = packing(pieces) if packable else None
    if plan is not None:
        begin, moves = plan
        for src, dst, n in moves:
            _move(buf, src, dst, n)
        span = buf[begin:begin + unit.numel]

        def unpack(result: torch.Tensor) -> None:
            if result is not span:
                span.copy_(result.reshape(-1))
            for src, dst, n in reversed(moves):
                _move(buf, dst, src, n)
        return span, unpack
    ref = pieces[0][0]
    gathered = (pool.take(unit.numel, ref.dtype, ref.device) if pool is not None
                else torch.empty(unit.numel, dtype=ref.dtype, device=ref.device))
    pos = 0
    for b, off, n in pieces:
        gathered[pos:pos + n].copy_(b[off:off + n])
        pos += n

    def store(result: torch.Tensor) -> None:
        unit_store(pieces, result)
        if pool is not None:
            pool.give(gathered)
    return gathered, store


def packing(pieces: Pieces) -> tuple[int, list[tuple[int, int, int]]] | None:
    """``(start, moves)`` that make ``pieces`` (one buffer, increasing offsets) one span from
    ``start``: the largest run of adjacent pieces stays, the other runs move next to it in
    order (``moves``: ``(from, to, numel)``); ``None`` when they are not so laid out.  Moving
    them there and back copies fewer elements than a scratch copy of the unit would (twice
    the unit) and keeps no buffer of its size (:func:`_move`)."""
    buf = pieces[0][0]
    runs: list[list[int]] = []
    for b, off, n in pieces:
        if b is not buf or (runs and off < runs[-1][1]):
            return None
        if runs and off == runs[-1][1]:
            runs[-1][1] += n
        else:
            runs.append([off, off + n])
    anchor = max(range(len(runs)), key=lambda i: runs[i][1] - runs[i][0])
    start = runs[anchor][0] - sum(e - s for s, e in runs[:anchor])
    moves, pos = [], start
    for i, (s, e) in enumerate(runs):
        if i != anchor:
            moves.append((s, pos, e - s))
        pos += e - s
    return start, moves


def _move(buf: torch.Tensor, src: int, dst: int, n: int) -> None:
    """``buf[dst:dst+n] = buf[src:src+n]``; where the two overlap, a ``memmove`` on the CPU (no
    copy of the piece), else through a copy (freed at once)."""
    piece = buf[src:src + n]
    if abs(dst - src) >= n:
        buf[dst:dst + n].copy_(piece)
    elif buf.device.type == "cpu" and buf.is_contiguous():
        size = buf.element_size()
        ctypes.memmove(buf.data_ptr() + dst * size, buf.data_ptr() + src * size, n * size)
    else:
        buf[dst:dst + n].copy_(piece.clone())


def unit_store(pieces: Pieces, result: torch.Tensor) -> None:
    flat = result.reshape(-1)
    pos = 0
    for b, off, n in pieces:
        b[off:off + n].copy_(flat[pos:pos + n])
        pos += n


class ModelLayout:
    """The parameters of one bound model, its bucket plans and its units.

    Built at binding (names, shapes, the dense set: fixed from then on); plans and
    units are added by the executor as buckets arrive (units once, plans again when
    DDP rebuilds its buckets).  Units are checkpointed (:meth:`units_state`).
    """

    def __init__(self, names: dict[int, str], shapes: dict[str, torch.Size], dense: set[str]) -> None:
        self.names = names
        self.shapes = shapes
        #: each parameter's place in the model (registration order): the canonical order of the dense
        #: parts summed together at the step's end (:meth:`Step._sum_deferred`)
        self.order = {name: i for i, name in enumerate(shapes)}
        self.dense = dense
        #: the ``sparse_rows`` parameters kept out of the units for good (:meth:`set_rows`)
        self.rows: set[str] = set()
        #: whether :attr:`rows` is final (``sparse_rows="auto"``: at the first compressed step)
        self.rows_settled = True
        self.plans: dict[int, Plan] = {}
        self.units: list[Unit] = []
        self.unit_of: dict[str, int] = {}
        #: the units were formed on a layout predicted before DDP made it (``"auto"``'s warm-up
        #: step): the first plans built afterwards say whether it came out so (:meth:`plan`)
        self.predicted = False
        #: the units' gather buffers, shared: as many as units in flight at once (one, or the held
        #: units of a joint round), each of the largest unit's size, not one per unit (the model's size)
        self.scratch = BufferPool()

    def plan(self, index: int, params: list[torch.Tensor]) -> Plan:
        """The plan of bucket ``index`` (rebuilt when DDP changed the bucket's parameters)."""
        plan = self.plans.get(index)
        if plan is None or plan.param_ids != tuple(id(p) for p in params):
            if plan is not None:
                log.info("commpress ddp: bucket %d changed layout (DDP bucket rebuild)", index)
            plan = self.plans[index] = make_plan(index, params, self.names, self.dense, self.rows)
            if self.predicted:
                self._check_predicted(plan)
        return plan

    def _check_predicted(self, plan: Plan) -> None:
        """Warn once where a unit formed on the predicted layout is not this bucket's compressible
        parameters in their order (correct all the same: a unit completes with its last piece)."""
        here = [nm for nm, _, _ in plan.compressed]
        for i in sorted({self.unit_of[nm] for nm in here if nm in self.unit_of}):
            names = self.units[i].names
            at = [here.index(nm) for nm in names if nm in here]
            if len(at) != len(names) or at != list(range(at[0], at[0] + len(at))):
                log.warning("commpress auto: DDP's bucket %d is not the layout predicted at the warm-up step "
                            "(unit %s: %s); the units stay as formed, each waiting for its last piece",
                            plan.index, i, list(names))
                self.predicted = False
                return

    def set_rows(self, names: set[str]) -> None:
        """Keep ``names`` out of the units for good (before any unit holds them); plans are rebuilt."""
        taken = sorted(nm for nm in names if nm in self.unit_of)
        if taken:
            raise ValueError(f"sparse_rows: {taken} are already in compressed units")
        self.rows, self.rows_settled = set(names), True
        self.plans = {}

    def assign_units(self, plan: Plan) -> None:
        """Give the compressible parameters of ``plan`` that have no unit yet one new unit."""
        unit = new_unit(plan, self.unit_of, self.shapes)
        if unit is not None:
            for nm in unit.names:
                self.unit_of[nm] = len(self.units)
            self.units.append(unit)

    def scratch_bytes(self) -> int:
        """Bytes of the plans' and units' scratch buffers."""
        return sum(_nbytes(p.dense_scratch) for p in self.plans.values()) + sum(
            _nbytes(b) for b in self.scratch.buffers())

    def units_state(self) -> list[dict[str, Any]]:
        return [{"key": u.key, "names": list(u.names), "sizes": list(u.sizes)} for u in self.units]

    def load_units(self, saved: list[dict[str, Any]]) -> None:
        """Restore :meth:`units_state`; ``ValueError`` when a unit does not fit this model."""
        units = []
        for u in saved:
            names, sizes = [str(n) for n in u["names"]], [int(n) for n in u["sizes"]]
            for nm, n in zip(names, sizes):
                if nm not in self.shapes or self.shapes[nm].numel() != n or nm in self.dense or nm in self.rows:
                    raise ValueError(f"checkpoint unit for parameter {nm!r} ({n} elements) does not "
                                     "match this model's compressed parameters")
            units.append(Unit(key=u["key"], names=names, sizes=sizes,
                              shapes=[tuple(self.shapes[nm]) for nm in names]))
        self.units = units
        self.unit_of = {nm: i for i, u in enumerate(units) for nm in u.names}


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


# ------------------------------------------------------------------ one step


@dataclass(frozen=True)
class HookConfig:
    """What binding decided, frozen: every fact a step reads (nothing else is consulted).

    ``scale`` is the one place the hook decides how it averages: every value is
    multiplied by it before its sum (``1/world``; 1 with one rank), as DDP's reducer
    does.  ``fold_scale``: the compressor folds that multiplication into its cast
    (identity / fp16 / bf16 without error feedback, flat), to the dtype ``cast_to``.
    """

    codec: Compressor
    compressor_name: str
    group: Any
    world_size: int
    rank: int
    algorithm: str
    hierarchy: Any
    seed: int
    scale: float
    fold_scale: bool
    cast_to: torch.dtype | None
    feedback: bool
    momentum: bool
    lowrank: bool
    verify_every: int
    #: with ``register(model, "auto")``: the :class:`~commpress.auto.runtime.AutoCodec` that gives
    #: each unit its own codec (``codec`` is then that object too, for the dense momentum)
    auto: Any = None
    #: hold a unit's message until the next unit that runs carries it (``join_buckets``;
    #: :mod:`commpress.collectives.joint`): one round per step where every unit takes a steady lane
    joins: bool = False
    #: the held messages' wire limit (seconds, by the calibrated link) where ``join_buckets`` gave
    #: one; ``None``: :data:`~commpress.collectives.joint.HOLD_MAX_WIRE_S`
    hold_max_wire_s: float | None = None
    #: AMP's ``torch.amp.GradScaler`` (``state.attach_scaler``): each compressed step divides its
    #: buckets by the loss scale on arrival and multiplies the averages back (:meth:`Step.run_bucket`)
    scaler: Any = None
    #: ``rollback="unit"``: each unit's residual updates commit as soon as its collective judged
    #: them (under the step's bad flag so far), not at the step's end
    unit_commits: bool = False
    #: ``sparse_rows``: the :class:`~.sparse_rows.SparseRows` plan (the path and capacities of
    #: each rows parameter, updated by the steps); ``None``: none
    sparse_rows: Any = None
    #: lend each unit's parameters' ``.grad`` to the step's transaction while the unit runs
    #: (:mod:`.ddp_loan`): lean residuals are then stored over the live ones, their old codes
    #: kept there until the step's verdict, with no pending store
    lend_grads: bool = False

    @property
    def dense_rides(self) -> bool:
        """Whether a bucket's dense part rides in its first unit's message
        (:func:`~commpress.collectives.carries_dense`: the sparse kinds at P=2, the gather kinds,
        no hierarchy, not ``"auto"``), instead of an all_reduce of its own."""
        return (self.auto is None and not self.lowrank
                and carries_dense(self.codec, world=self.world_size, algorithm=self.algorithm,
                                  hierarchy=self.hierarchy))

    def unit_rides(self, unit: Unit) -> bool:
        """Whether a bucket's dense part rides in ``unit``'s message: :attr:`dense_rides`, or with
        ``"auto"`` by the codec in force for the unit (chosen at the last check point: the same on
        every rank and every step until the next one)."""
        if self.auto is None:
            return self.dense_rides
        codec = self.auto.codecs.get(unit.key)
        return (codec is not None and codec.aggregation != "lowrank"
                and carries_dense(codec, world=self.world_size, algorithm=self.algorithm,
                                  hierarchy=self.auto.hierarchy_of(unit)))

    def noise_seed(self, step: int, key: Any) -> int:
        """The seed of this rank's stochastic rounding for ``key`` at ``step``: a pure function
        of ``(seed, rank, step, key)`` (nothing to read, nothing to checkpoint)."""
        return mix_seed(self.seed, self.rank, step, stable_hash(key))


def _scale_in_feedback(cfg: HookConfig, codec: Any = None, hierarchy: Any = None) -> float | None:
    """The unit's ``1/P`` when it is folded into error feedback's compensation pass (passed as
    ``allreduce(prescale=)``: :func:`~commpress.collectives.core.folds_scale`) instead of a
    ``mul_`` pass: a sparsifier or a gather kind under error feedback, without a hierarchy (which
    compresses the node's sum); ``None``: not folded.  ``codec`` / ``hierarchy``: the unit's own
    with ``"auto"`` (else the configuration's)."""
    if codec is None:
        codec, hierarchy = cfg.codec, cfg.hierarchy
    if hierarchy is not None or not folds_scale(codec):
        return None
    return cfg.scale


@dataclass
class StepContext:
    """The small context a :class:`Step` gets: the frozen configuration, the model's layout,
    where to record, and the step's number."""

    config: HookConfig
    layout: ModelLayout
    stats: Stats
    step: int


@dataclass
class HeldUnit:
    """A unit whose message waits for a later unit's flight (:mod:`commpress.collectives.joint`):
    what lands it and puts its result (and its bucket's riding dense part) back."""

    index: int
    call: Any                                   # its joint.Held
    out: torch.Tensor                           # the unit's input, where the sum lands
    store: Callable | None                      # puts ``out`` back into the bucket (None: a view of it)
    dense: tuple[Plan, torch.Tensor, torch.Tensor] | None   # (plan, bucket, dense part) riding in it
    seconds: float = 0.0                        # its encode's (with "auto": its call's, less the flight)
    staged: int = 0                             # the step's transaction position after its encode


@dataclass
class Finished:
    """A bucket whose buffer holds its final average."""

    plan: Plan
    buf: torch.Tensor
    fut: torch.futures.Future
    units: set[int] = field(default_factory=set)


#: the marker of a bucket whose dense part waits for :meth:`Step._sum_deferred` (not a unit index)
DENSE_DEFERRED = -1


class Step:
    """The moving parts of one step (see the module doc)."""

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self.transaction = ResidualTransaction()
        self.ready: dict[str, tuple[torch.Tensor, int, int]] = {}   # name -> (bucket buffer, offset, numel)
        self.grads: dict[str, torch.Tensor | None] = {}            # name -> its .grad (lend_grads)
        self.waiting: list[Finished] = []                          # buckets whose units span later buckets
        self.done_units: set[int] = set()
        self._dense_issue = 0.0                                    # seconds to issue the dense all_reduce
        self._bucket = -1                                          # the bucket being run
        self._buf: torch.Tensor | None = None                      # and its buffer
        self.held: list[HeldUnit] = []                             # units waiting for a later flight
        self._landing_s = 0.0                                      # held units landed inside a carrier's call
        self._scales: tuple[torch.Tensor, torch.Tensor] | None = None   # (S, 1/S) of the loss scaler
        self._scales_read = False
        #: buckets whose dense part waits for the step's one canonical all_reduce: (plan, buffer, dense)
        self._deferred: list[tuple[Plan, torch.Tensor, torch.Tensor]] = []

    # -- one bucket ---------------------------------------------------------
    def run_bucket(self, index: int, buf: torch.Tensor, params: list[torch.Tensor],
                   fut: torch.futures.Future, last: bool = True) -> list[Finished]:
        """Run bucket ``index`` (``last``: DDP's ``is_last()``; units held for a joint flight are
        sent by then); returns the buckets it finished."""
        cfg, layout = self.ctx.config, self.ctx.layout
        world = cfg.world_size
        self._bucket, self._buf = index, buf
        with Timer(cpu=True) as total:
            scales = self._loss_scales(buf) if cfg.scaler is not None else None
            if scales is not None:   # residuals and velocities are kept in unscaled units
                buf.mul_(scales[1])
            plan = layout.plan(index, params)
            dense_bytes = all_reduce_bytes(buf.numel() * buf.element_size(), world)
            as_rows, dense_rows = self._rows_paths(plan, buf) if plan.rows else ([], [])
            layout.assign_units(plan)
            for nm, off, n in plan.compressed:
                self.ready[nm] = (buf, off, n)
            if cfg.lend_grads:
                compressed = {nm for nm, _, _ in plan.compressed}
                self.grads.update((nm, p.grad) for nm, p in zip(plan.names, params) if nm in compressed)
            mine = {layout.unit_of[nm] for nm, _, _ in plan.compressed}
            self.waiting.append(Finished(plan, buf, fut, mine - self.done_units))
            runnable = sorted(i for i in mine if i not in self.done_units
                              and all(nm in self.ready for nm in layout.units[i].names))
            rides = (bool(runnable) and cfg.unit_rides(layout.units[runnable[0]])  # no round of its own
                     and not (world == 2 and layout.units[runnable[0]].declines_dense))
            # at P >= 3 a ring all_reduce's sum order depends on where an element sits in the message,
            # and DDP lays its buckets out anew after the first iteration (and after a restart): the
            # dense parts that do not ride wait for one all_reduce of them all in the model's order at
            # the step's last bucket, so the sums (and a resume) do not depend on the bucket layout
            defer = not rides and world >= 3
            dense, work = self._start_dense(plan, buf, send=not rides and not defer, extra=dense_rows)
            if defer and dense is not None:
                self._deferred.append((plan, buf, dense))
                self.waiting[-1].units.add(DENSE_DEFERRED)
            sent = all_reduce_bytes(dense.numel() * dense.element_size(), world) if work is not None else 0
            algorithms = []
            cs = CommStats()  # rounds, time in collectives and codec passes, for the step's account
            if work is not None:
                cs.add(rounds=1, seconds=self._dense_issue)
            held_dense = False
            with Timer() as t_c:
                for j, i in enumerate(runnable):
                    carried = dense if rides and j == 0 else None
                    algorithms.append(self._run_unit(i, cs, carried, hold=not last))
                    held_dense = held_dense or (carried is not None and i not in self.done_units)
                if last and self.held:   # nothing ran after them: a flight of their own
                    self._fly_held(cs)
                for name, off, n in as_rows:   # after the units' and the dense part's collectives started
                    algorithms.append(self._run_rows(name, buf, off, n, cs))
                if last and self._deferred:
                    sent += self._sum_deferred(cs)
            sent += cs.bytes_sent
            if work is not None:
                with Timer() as t_w:
                    work.wait()
                cs.add(seconds=t_w.seconds)
            if dense is not None and not held_dense and not (defer and dense is not None):
                self._finish_dense(plan, buf, dense, judged=rides)
            finished = []
            for w in list(self.waiting):
                w.units -= self.done_units
                if not w.units:
                    self.waiting.remove(w)
                    finished.append(w)
                    if self._scales is not None:   # back in the scaler's units for unscale_ / step
                        w.buf.mul_(self._scales[0])
        self.ctx.stats.record(plan.index, bytes_sent=sent, dense_bytes=dense_bytes,
                              algorithm="+".join(sorted(set(algorithms))) or ("waiting" if plan.compressed
                                                                              else "dense"),
                              compress_seconds=t_c.seconds, hook_seconds=total.seconds, rounds=cs.rounds,
                              hook_cpu_seconds=total.cpu_seconds,
                              comm_seconds=cs.comm_seconds, codec_seconds=cs.codec_seconds)
        return finished

    def _loss_scales(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(S, 1/S)`` of the attached scaler, read (on the device) once per step."""
        if not self._scales_read:
            self._scales = loss_scales(self.ctx.config.scaler, buf.device)
            self._scales_read = True
        return self._scales

    def _rows_paths(self, plan: Plan, buf: torch.Tensor) -> tuple[list[tuple[str, int, int]],
                                                                   list[tuple[int, int, str]]]:
        """The bucket's ``sparse_rows`` parameters by this step's path: ``(name, offset, numel)`` of
        those summed as rows, ``(offset, numel, name)`` of those in the dense part (counted on the
        device on a measuring step: :meth:`~.sparse_rows.SparseRows.observe`)."""
        tracker, shapes = self.ctx.config.sparse_rows, self.ctx.layout.shapes
        as_rows, dense = [], []
        for name, off, n in plan.rows:
            if tracker.path(name) == "rows":
                as_rows.append((name, off, n))
            else:
                tracker.observe(name, buf[off:off + n].view(shapes[name][0], -1))
                dense.append((off, n, name))
        return as_rows, dense

    def _run_rows(self, name: str, buf: torch.Tensor, off: int, n: int, cs: CommStats) -> str:
        """Sum one ``sparse_rows`` parameter's slice of the bucket in place as rows
        (:func:`~commpress.collectives.rows_allreduce`: lossless, bitwise the same on every rank),
        averaged as DDP does (``1/P`` before the sum); a NaN/inf in the sum marks the step bad."""
        cfg = self.ctx.config
        tracker = cfg.sparse_rows
        flat = buf[off:off + n]
        view = flat.view(self.ctx.layout.shapes[name][0], -1)
        if cfg.world_size > 1:
            view.mul_(cfg.scale)
        result = rows_allreduce(view, out=view, key=f"ddp-rows:{name}", group=cfg.group, stats=cs,
                                **tracker.capacities(name))
        tracker.record(name, result)
        if cfg.feedback:
            self.transaction.mark_bad(nonfinite_flag(flat))
        if cfg.momentum:   # plain momentum, as every parameter the compressor does not send
            cfg.codec.dense_momentum(flat, name, self.transaction)
        return "rows_" + result.algorithm

    def _start_dense(self, plan: Plan, buf: torch.Tensor, send: bool = True,
                     extra: list[tuple[int, int, str]] | None = None):
        """Pack and scale the dense part (with ``extra``: the rows parameters on their dense path
        this step) and, with ``send``, start its all_reduce (``None`` when the bucket has none);
        without, it rides in a unit's message (:meth:`_run_unit`)."""
        if extra:
            live = sorted([(off, k, nm) for (off, k), nm in zip(plan.dense_slices, plan.dense_names)] + extra)
            plan.live_slices, plan.live_names = [(o, k) for o, k, _ in live], [nm for _, _, nm in live]
        else:
            plan.live_slices, plan.live_names = plan.dense_slices, plan.dense_names
        n = sum(k for _, k in plan.live_slices)
        if n == 0:
            return None, None
        if (plan.dense_scratch is None or plan.dense_scratch.dtype != buf.dtype
                or plan.dense_scratch.device != buf.device or plan.dense_scratch.numel() != n):
            plan.dense_scratch = torch.empty(n, dtype=buf.dtype, device=buf.device)
        gather_slices(buf, plan.live_slices, plan.dense_scratch)
        cfg = self.ctx.config
        if cfg.world_size == 1:
            return plan.dense_scratch, None
        plan.dense_scratch.mul_(cfg.scale)  # DDP averages: scale, then sum
        if not send:
            return plan.dense_scratch, None
        with Timer() as t:
            work = dist.all_reduce(plan.dense_scratch, group=cfg.group, async_op=True)
        self._dense_issue = t.seconds
        return plan.dense_scratch, work

    def _sum_deferred(self, cs: CommStats) -> int:
        """The deferred dense parts (P >= 3) in one all_reduce per dtype, each parameter at its place
        in the model's order (the same message whatever DDP's bucket layout), then finished into
        their buckets; returns the bytes sent."""
        cfg, order = self.ctx.config, self.ctx.layout.order
        deferred, self._deferred = self._deferred, []
        parts: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
        for plan, _, dense in deferred:
            pos = 0
            for name, (_, n) in zip(plan.live_names, plan.live_slices):
                parts.setdefault(dense.dtype, []).append((order[name], dense[pos:pos + n]))
                pos += n
        sent = 0
        for pieces in parts.values():
            pieces.sort(key=lambda p: p[0])
            message = torch.cat([t for _, t in pieces])
            with Timer() as t:
                dist.all_reduce(message, group=cfg.group)
            cs.add(rounds=1, seconds=t.seconds)
            sent += all_reduce_bytes(message.numel() * message.element_size(), cfg.world_size)
            at = 0
            for _, piece in pieces:
                piece.copy_(message[at:at + piece.numel()])
                at += piece.numel()
        for plan, buf, dense in deferred:
            self._finish_dense(plan, buf, dense)
        self.done_units.add(DENSE_DEFERRED)
        return sent

    def _finish_dense(self, plan: Plan, buf: torch.Tensor, dense: torch.Tensor, judged: bool = False) -> None:
        """The summed dense part: its NaN/inf verdict (``judged``: the unit's call that carried it
        gave it), plain momentum, back into the bucket."""
        cfg = self.ctx.config
        if cfg.feedback and not judged:
            self.transaction.mark_bad(nonfinite_flag(dense))
        if cfg.momentum:  # momentum correction: the dense parameters get plain momentum here
            pos = 0
            for name, (_, n) in zip(plan.live_names, plan.live_slices):
                cfg.codec.dense_momentum(dense[pos:pos + n], name, self.transaction)
                pos += n
        scatter_slices(buf, plan.live_slices, dense)

    def _run_unit(self, i: int, cs: CommStats, dense: torch.Tensor | None = None, hold: bool = False) -> str:
        """Run unit ``i`` (its traffic, rounds and times added to ``cs``); returns its algorithm.  With
        ``hold`` and :attr:`HookConfig.joins` its message may wait for the next unit that runs (which
        carries every held message and lands them: :meth:`_land_held`); it is then not done yet.
        ``dense``: the bucket's scaled dense part, summed in place within the unit's call.  With
        :attr:`HookConfig.lend_grads` the unit's gradients are lent to the step's transaction
        while it runs (its residuals' old codes wait there until the step's verdict)."""
        if not self.ctx.config.lend_grads:
            return self._unit_call(i, cs, dense, hold)
        names = self.ctx.layout.units[i].names
        with self.transaction.lending(grad_loan([self.grads.get(nm) for nm in names], self._buf)):
            return self._unit_call(i, cs, dense, hold)

    def _unit_call(self, i: int, cs: CommStats, dense: torch.Tensor | None, hold: bool) -> str:
        """:meth:`_run_unit`'s work: the unit's input, codec and path, and its collective call."""
        cfg = self.ctx.config
        unit = self.ctx.layout.units[i]
        pieces = [self.ready[nm] for nm in unit.names]
        plan = self.ctx.layout.plans.get(self._bucket)
        # the bucket's gaps between the unit's pieces hold only its dense part (saved by _start_dense)
        # (not with rows parameters: their slices in those gaps are not saved)
        packable = plan is not None and not plan.rows and [nm for nm, _, _ in plan.compressed] == unit.names
        t, store = unit_input(unit, pieces, packable, self.ctx.layout.scratch)
        cs.last_algorithm = ""
        prescale = None   # the 1/P folded into the call's first pass (a cast's, error feedback's)
        codec, lowrank, hierarchy = cfg.codec, cfg.lowrank, cfg.hierarchy
        if cfg.auto is not None:  # "auto": the unit's own codec and path, chosen at the last check point
            codec, hierarchy = cfg.auto.in_force(unit), cfg.auto.hierarchy_of(unit)
        folded = 1.0
        if cfg.world_size > 1:
            if cfg.fold_scale:
                prescale = cfg.scale
            elif codec is not None and _scale_in_feedback(cfg, codec, hierarchy) is not None:
                prescale = folded = cfg.scale   # rides in error feedback's compensation pass
            elif hierarchy is not None and codec is not None and cfg.auto is None:
                # rides in the two-level path's intra-node copy; not under "auto", whose codec() adds a
                # path switch's carry to t already scaled (and samples t's norm in those units)
                prescale = cfg.scale
            else:
                t.mul_(cfg.scale)
        if cfg.auto is not None:
            codec = cfg.auto.codec(unit, t, self._bucket, self.transaction, scale=folded, step=self.ctx.step)
            lowrank = codec.aggregation == "lowrank"
        if hold and cfg.joins and not cfg.fold_scale and hierarchy is None:
            with Timer() as timer:
                held = joint.hold(t, codec, group=cfg.group, key=unit.key, step=self.ctx.step,
                                  algorithm=cfg.algorithm, stats=cs, transaction=self.transaction, dense=dense,
                                  held_bytes=sum(h.call.message.numel() for h in self.held),
                                  max_wire_s=(joint.HOLD_MAX_WIRE_S if cfg.hold_max_wire_s is None
                                              else cfg.hold_max_wire_s), scale=folded)
            if held is not None:
                bucket = (plan, self._buf, dense) if dense is not None else None
                self.held.append(HeldUnit(i, held, t, store, bucket, timer.seconds,
                                          staged=self.transaction.position()))
                return held.algorithm
        # the held units ride in this call, and land as soon as their rows arrive
        riders = joint.passengers([h.call for h in self.held], self._land_held) if self.held else None
        in_comm, self._landing_s = cs.comm_seconds, 0.0
        with Timer() as timer:
            out = allreduce(t, codec, group=cfg.group, key=unit.key, step=self.ctx.step,
                            algorithm=cfg.algorithm, stats=cs, generator=cfg.noise_seed(self.ctx.step, unit.key),
                            validate=False, transaction=self.transaction,
                            shapes=unit.shapes if lowrank else None, out=t,
                            hierarchy=hierarchy, prescale=prescale, dense=dense, passengers=riders)
        if cfg.auto is not None:
            cfg.auto.measured(unit, timer.seconds - self._landing_s, cs.comm_seconds - in_comm)
        if cfg.unit_rides(unit):  # "auto" may have picked an algorithm that cannot carry it (a sparse all_reduce)
            unit.declines_dense = not carries_dense(codec, world=cfg.world_size, hierarchy=hierarchy,
                                                    algorithm=cs.last_algorithm or cfg.algorithm)
        if store is not None:  # the result goes back into the bucket's pieces
            store(out)
        elif out is not t:
            unit_store(pieces, out)
        self.done_units.add(i)
        if riders is not None and not riders.carried:   # not carried: a flight of their own
            self._fly_held(cs)
        if cfg.unit_commits and not self.held:   # judged on every rank (held ones too): commit
            self.transaction.commit_through(self.transaction.position())
        return cs.last_algorithm or codec.aggregation

    def _fly_held(self, cs: CommStats) -> None:
        """The held units in one ``all_gather`` of their own (no later unit carried them), landed."""
        self._land_held(joint.gather_held([h.call for h in self.held], group=self.ctx.config.group, stats=cs))

    def _land_held(self, rows: torch.Tensor) -> None:
        """The held units' gathered messages (``rows``, in holding order): each decoded and judged
        (an error raises on every rank), its result put back into its bucket, its bucket's riding
        dense part scattered back."""
        held, self.held = self.held, []
        auto = self.ctx.config.auto
        for h, got in zip(held, joint.rows_of([h.call for h in held], rows)):
            with Timer() as timer:
                h.call.land(got)
            self._landing_s += timer.seconds
            if auto is not None:   # its encode and decode (the shared flight is the carrying unit's)
                auto.measured(self.ctx.layout.units[h.index], h.seconds + timer.seconds)
            if h.store is not None:
                h.store(h.out)
            self.done_units.add(h.index)
            if h.dense is not None:
                self._finish_dense(*h.dense, judged=True)
        if held and self.ctx.config.unit_commits:   # landed and judged: their updates commit
            self.transaction.commit_through(held[-1].staged)

    # -- the step's end -----------------------------------------------------
    def commit(self) -> None:
        if self.waiting:  # cannot happen with DDP (every parameter is in some bucket of every step)
            names = [w.plan.index for w in self.waiting]
            raise RuntimeError(f"commpress ddp: buckets {names} still wait for parameters at the end of the step")
        self.transaction.commit()

    def abort(self) -> list[torch.futures.Future]:
        """Drop the step's residual updates; return the futures still waiting."""
        self.transaction.rollback()
        return [w.fut for w in self.waiting]
