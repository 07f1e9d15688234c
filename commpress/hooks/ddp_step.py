"""One training step of the DDP hook: created at the step's first compressed
bucket, dropped at its end.

Per bucket (:meth:`Step.run_bucket`):

1. every value is scaled by ``1/world_size`` before its sum (as DDP's reducer
   does); identity/fp16/bf16 fold the scaling into their cast;
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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..collectives import CommStats, allreduce
from ..feedback import ResidualTransaction, nonfinite_flag
from .common import Timer, all_reduce_bytes
from .ddp_layout import Plan, gather_slices, scatter_slices, unit_input, unit_store

if TYPE_CHECKING:
    from .ddp import DDPState

log = logging.getLogger("commpress")


@dataclass
class Finished:
    """A bucket whose buffer holds its final average."""

    plan: Plan
    buf: torch.Tensor
    fut: torch.futures.Future
    units: set[int] = field(default_factory=set)


class Step:
    """The moving parts of one step (see the module doc)."""

    def __init__(self, state: "DDPState") -> None:
        self.state = state
        self.transaction = ResidualTransaction()
        self.ready: dict[str, tuple[torch.Tensor, int, int]] = {}   # name -> (bucket buffer, offset, numel)
        self.waiting: list[Finished] = []                          # buckets whose units span later buckets
        self.done_units: set[int] = set()

    # -- one bucket ---------------------------------------------------------
    def run_bucket(self, index: int, buf: torch.Tensor, params: list[torch.Tensor],
                   fut: torch.futures.Future) -> list[Finished]:
        state = self.state
        world = state.world_size
        with Timer() as total:
            plan = state.layout(index, params)
            dense_bytes = all_reduce_bytes(buf.numel() * buf.element_size(), world)
            dense, work = self._start_dense(plan, buf)
            sent = all_reduce_bytes(dense.numel() * dense.element_size(), world) if dense is not None else 0
            state.assign_units(plan)
            for nm, off, n in plan.compressed:
                self.ready[nm] = (buf, off, n)
            mine = {state.unit_of[nm] for nm, _, _ in plan.compressed}
            self.waiting.append(Finished(plan, buf, fut, mine - self.done_units))
            runnable = sorted(i for i in mine if i not in self.done_units
                              and all(nm in self.ready for nm in state.units[i].names))
            algorithms = []
            with Timer() as t_c:
                for i in runnable:
                    nbytes, algorithm = self._run_unit(i)
                    sent += nbytes
                    algorithms.append(algorithm)
            if work is not None:
                work.wait()
            if dense is not None:
                if state.uses_error_feedback:
                    self.transaction.mark_bad(nonfinite_flag(dense))
                if state.dense_momentum is not None:
                    state.dense_momentum.apply(plan, dense, self.transaction)
                scatter_slices(buf, plan.dense_slices, dense)
            finished = []
            for w in list(self.waiting):
                w.units -= self.done_units
                if not w.units:
                    self.waiting.remove(w)
                    finished.append(w)
        state.stats.record(plan.index, bytes_sent=sent, dense_bytes=dense_bytes,
                           algorithm="+".join(sorted(set(algorithms))) or ("waiting" if plan.compressed
                                                                           else "dense"),
                           compress_seconds=t_c.seconds, hook_seconds=total.seconds)
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
        if self.state.world_size == 1:
            return plan.dense_scratch, None
        plan.dense_scratch.mul_(1.0 / self.state.world_size)  # DDP averages: scale, then sum
        work = dist.all_reduce(plan.dense_scratch, group=self.state.process_group, async_op=True)
        return plan.dense_scratch, work

    def _run_unit(self, i: int) -> tuple[int, str]:
        state = self.state
        unit = state.units[i]
        pieces = [self.ready[nm] for nm in unit.names]
        t, is_view = unit_input(unit, pieces)
        cs = CommStats()
        shapes = unit.shapes if state.lowrank else None
        # DDP averages: 1/world before the sum, folded into the cast of identity/fp16/bf16
        prescale = None
        if state.world_size > 1:
            if state.fused_scale:
                prescale = 1.0 / state.world_size
            else:
                t.mul_(1.0 / state.world_size)
        out = allreduce(t, state.codec, group=state.process_group, key=unit.key, step=state.step,
                        algorithm=state.algorithm, stats=cs, generator=state.noise_seed(unit.key),
                        validate=False, transaction=self.transaction, shapes=shapes, out=t,
                        hierarchy=state.hierarchy, prescale=prescale)
        if not is_view or out is not t:  # the result goes back into the bucket's pieces
            unit_store(pieces, out)
        self.done_units.add(i)
        return cs.bytes_sent, cs.last_algorithm or state.inner.aggregation

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


class DenseMomentum:
    """SGD momentum for the parameters that travel dense when momentum correction is on.

    Momentum correction moves the momentum from the optimizer into error feedback
    (pair it with plain SGD), but dense parameters (biases, small ones) bypass error
    feedback.  They get ``v = m v + g; g = v`` here, on the averaged gradient (so
    identically on every rank), staged in the step's transaction like the residuals.
    """

    def __init__(self, momentum: float) -> None:
        self.momentum = momentum
        self.velocity: dict[str, torch.Tensor] = {}
        self._pending: dict[str, torch.Tensor] = {}

    def apply(self, plan: Plan, dense: torch.Tensor, transaction: ResidualTransaction) -> None:
        pos = 0
        for name, (_, n) in zip(plan.dense_names, plan.dense_slices):
            g = dense[pos:pos + n]
            pos += n
            pend = self._pending.get(name)
            if pend is None or pend.numel() != n:
                pend = self._pending[name] = torch.empty(n, dtype=torch.float32, device=g.device)
            live = self.velocity.get(name)
            if live is None or live.numel() != n:
                pend.copy_(g)
            else:
                torch.add(g, live, alpha=self.momentum, out=pend)
            g.copy_(pend)
            transaction.stage(self, name)

    def _apply(self, name: str, bad: torch.Tensor | None) -> None:
        """Commit (the transaction's protocol): velocity := pending unless ``bad``."""
        pend = self._pending[name]
        live = self.velocity.get(name)
        if live is None or live.numel() != pend.numel():
            live = self.velocity[name] = torch.zeros_like(pend)
        torch.where(bad, live, pend, out=live) if bad is not None else live.copy_(pend)
