"""One training step of the DDP hook: created at the step's first compressed
bucket, dropped at its end.

Per bucket (:meth:`Step.run_bucket`):

1. every value is scaled by ``1/world_size`` before its sum (as DDP's reducer
   does); identity/fp16/bf16 fold the scaling into their cast, and a sparsifier's
   error feedback into its compensation pass;
2. its **dense part** (1-D, small and skipped parameters) is packed into one
   buffer and all-reduced *asynchronously*, concurrently with the payloads;
3. every unit this bucket completes runs :func:`commpress.collectives.allreduce`
   with the step's :class:`~commpress.feedback.ResidualTransaction` (payload
   messages only; status inside; a NaN/inf on any rank poisons that unit);
4. the dense part is waited for and scattered back; a NaN/inf in it marks the
   transaction bad (on the device);
5. buckets whose units are all done are returned to complete their futures.

At the step's end the transaction commits: every residual takes its new value,
or keeps the old one when any rank saw a NaN/inf anywhere in the step, decided
on the device.  On an error the transaction rolls back and the step is dropped.

A step reads only its :class:`StepContext`: the :class:`HookConfig` frozen at
binding, the model's :class:`~.ddp_layout.ModelLayout`, the stats it records
into and the step's number.  It never calls back into the hook's state.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..collectives import CommStats, allreduce
from ..compressors import Compressor
from ..compressors._util import mix_seed, stable_hash
from ..feedback import ErrorFeedback, ResidualTransaction, nonfinite_flag
from .common import Stats, Timer, all_reduce_bytes
from .ddp_layout import ModelLayout, Plan, gather_slices, scatter_slices, unit_input, unit_store

log = logging.getLogger("commpress")


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

    def noise_seed(self, step: int, key: Any) -> int:
        """The seed of this rank's stochastic rounding for ``key`` at ``step``: a pure function
        of ``(seed, rank, step, key)`` (nothing to read, nothing to checkpoint)."""
        return mix_seed(self.seed, self.rank, step, stable_hash(key))


def _scale_in_feedback(cfg: HookConfig) -> bool:
    """Whether the unit's ``1/P`` is folded into error feedback (:meth:`ErrorFeedback.scaled_input`)
    instead of a ``mul_`` pass: a sparsifier's error feedback without a hierarchy, where the
    collective compresses the unit's key exactly once (the gather kinds compress chunk keys,
    and a hierarchy compresses the node's sum)."""
    codec = cfg.codec
    return (isinstance(codec, ErrorFeedback) and cfg.hierarchy is None
            and getattr(codec.compressor, "aggregation", None) == "sparse")


@dataclass
class StepContext:
    """The small context a :class:`Step` gets: the frozen configuration, the model's layout,
    where to record, and the step's number."""

    config: HookConfig
    layout: ModelLayout
    stats: Stats
    step: int


@dataclass
class Finished:
    """A bucket whose buffer holds its final average."""

    plan: Plan
    buf: torch.Tensor
    fut: torch.futures.Future
    units: set[int] = field(default_factory=set)


class Step:
    """The moving parts of one step (see the module doc)."""

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self.transaction = ResidualTransaction()
        self.ready: dict[str, tuple[torch.Tensor, int, int]] = {}   # name -> (bucket buffer, offset, numel)
        self.waiting: list[Finished] = []                          # buckets whose units span later buckets
        self.done_units: set[int] = set()
        self._dense_issue = 0.0                                    # seconds to issue the dense all_reduce

    # -- one bucket ---------------------------------------------------------
    def run_bucket(self, index: int, buf: torch.Tensor, params: list[torch.Tensor],
                   fut: torch.futures.Future) -> list[Finished]:
        cfg, layout = self.ctx.config, self.ctx.layout
        world = cfg.world_size
        with Timer() as total:
            plan = layout.plan(index, params)
            dense_bytes = all_reduce_bytes(buf.numel() * buf.element_size(), world)
            dense, work = self._start_dense(plan, buf)
            sent = all_reduce_bytes(dense.numel() * dense.element_size(), world) if dense is not None else 0
            layout.assign_units(plan)
            for nm, off, n in plan.compressed:
                self.ready[nm] = (buf, off, n)
            mine = {layout.unit_of[nm] for nm, _, _ in plan.compressed}
            self.waiting.append(Finished(plan, buf, fut, mine - self.done_units))
            runnable = sorted(i for i in mine if i not in self.done_units
                              and all(nm in self.ready for nm in layout.units[i].names))
            algorithms = []
            cs = CommStats()  # rounds, time in collectives and codec passes, for the step's account
            if work is not None:
                cs.add(rounds=1, seconds=self._dense_issue)
            with Timer() as t_c:
                for i in runnable:
                    algorithms.append(self._run_unit(i, cs))
            sent += cs.bytes_sent
            if work is not None:
                with Timer() as t_w:
                    work.wait()
                cs.add(seconds=t_w.seconds)
            if dense is not None:
                self._finish_dense(plan, buf, dense)
            finished = []
            for w in list(self.waiting):
                w.units -= self.done_units
                if not w.units:
                    self.waiting.remove(w)
                    finished.append(w)
        self.ctx.stats.record(plan.index, bytes_sent=sent, dense_bytes=dense_bytes,
                              algorithm="+".join(sorted(set(algorithms))) or ("waiting" if plan.compressed
                                                                              else "dense"),
                              compress_seconds=t_c.seconds, hook_seconds=total.seconds, rounds=cs.rounds,
                              comm_seconds=cs.comm_seconds, codec_seconds=cs.codec_seconds)
        return finished

    def _start_dense(self, plan: Plan, buf: torch.Tensor):
        """Pack the dense part and start its all_reduce (``None`` when the bucket has none)."""
        n = sum(k for _, k in plan.dense_slices)
        if n == 0:
            return None, None
        if (plan.dense_scratch is None or plan.dense_scratch.dtype != buf.dtype
                or plan.dense_scratch.device != buf.device):
            plan.dense_scratch = torch.empty(n, dtype=buf.dtype, device=buf.device)
        gather_slices(buf, plan.dense_slices, plan.dense_scratch)
        cfg = self.ctx.config
        if cfg.world_size == 1:
            return plan.dense_scratch, None
        plan.dense_scratch.mul_(cfg.scale)  # DDP averages: scale, then sum
        with Timer() as t:
            work = dist.all_reduce(plan.dense_scratch, group=cfg.group, async_op=True)
        self._dense_issue = t.seconds
        return plan.dense_scratch, work

    def _finish_dense(self, plan: Plan, buf: torch.Tensor, dense: torch.Tensor) -> None:
        """The summed dense part: its NaN/inf verdict, plain momentum, back into the bucket."""
        cfg = self.ctx.config
        if cfg.feedback:
            self.transaction.mark_bad(nonfinite_flag(dense))
        if cfg.momentum:  # momentum correction: the dense parameters get plain momentum here
            pos = 0
            for name, (_, n) in zip(plan.dense_names, plan.dense_slices):
                cfg.codec.dense_momentum(dense[pos:pos + n], name, self.transaction)
                pos += n
        scatter_slices(buf, plan.dense_slices, dense)

    def _run_unit(self, i: int, cs: CommStats) -> str:
        """Run unit ``i`` (its traffic, rounds and times added to ``cs``); returns its algorithm."""
        cfg = self.ctx.config
        unit = self.ctx.layout.units[i]
        pieces = [self.ready[nm] for nm in unit.names]
        t, is_view = unit_input(unit, pieces)
        cs.last_algorithm = ""
        prescale = None
        scaled = contextlib.nullcontext()
        if cfg.world_size > 1:
            if cfg.fold_scale:
                prescale = cfg.scale
            elif _scale_in_feedback(cfg):  # the 1/P rides in error feedback's compensation pass
                scaled = cfg.codec.scaled_input(unit.key, cfg.scale)
            else:
                t.mul_(cfg.scale)
        with scaled:
            out = allreduce(t, cfg.codec, group=cfg.group, key=unit.key, step=self.ctx.step,
                            algorithm=cfg.algorithm, stats=cs, generator=cfg.noise_seed(self.ctx.step, unit.key),
                            validate=False, transaction=self.transaction,
                            shapes=unit.shapes if cfg.lowrank else None, out=t,
                            hierarchy=cfg.hierarchy, prescale=prescale)
        if not is_view or out is not t:  # the result goes back into the bucket's pieces
            unit_store(pieces, out)
        self.done_units.add(i)
        return cs.last_algorithm or cfg.codec.aggregation

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
