"""``commpress.fsdp.register(model, "auto")``: the FSDP2 side of ``"auto"``.

Each FSDP2 unit (the gradient reduce-scatter of one ``FSDPModule``) is one unit of
:class:`~commpress.auto.runtime.AutoCodec`: its own :class:`~commpress.ErrorFeedback`
of the kind chosen for it, the same check points (one agreed ``all_reduce``), the same
decider (hysteresis, ``every``, ``drift``), the same switch (residual and velocity
carried) and the same ``state_dict``.  What differs from DDP
(:class:`ReduceScatterAutoCodec`):

* **Candidates**: what FSDP2's reduce-scatter can run: dense, bf16, blockquant,
  topk (aggregation ``"sum"``, ``"gather"`` and ``"sparse"``); powersgd (``"lowrank"``)
  is left out of the default set and refused when named.
* **The call**: a unit that chose dense, owes no carried residual and has no momentum
  correction runs FSDP2's own ``reduce_scatter`` (bitwise FSDP2's default); every other
  choice runs :func:`commpress.collectives.reduce_scatter` under error feedback
  (``"two_phase"``: one ``all_to_all`` of each chunk's fixed-size payload).  A first call
  of a new choice re-validates (one header round, at switch steps only).
* **Residuals**: per (unit, chunk): ``(unit name, r)`` for the ``r``-th of the ``P`` equal
  chunks of the flat reduce-scatter input (padding included), for every kind.
  :meth:`ReduceScatterAutoCodec._unit_slots` gives the switch these offsets, so a switch
  moves each chunk's residual and velocity to the same chunk of the new codec, bitwise.
* **Prediction**: :class:`~commpress.auto.decide.Network` with ``collective="reduce_scatter"``
  (:func:`~commpress.auto.decide.reduce_scatter_terms`: one round; the dense one FSDP2's
  ``reduce_scatter``, the others an ``all_to_all`` of ``P−1`` payloads of a chunk); codec
  seconds are ``P`` passes over a chunk of ``m`` elements (compress every chunk, decode
  every piece at the owner), measured on this device in the reduce dtype.
* **What is measured**: each unit's reduce-scatter call (host seconds; ``measured_ms``,
  the per-round cost beyond the α-β model, and for a dense unit the rest of its excess per
  second of its predicted reduce-scatter: :meth:`ReduceScatterAutoCodec._per_round`) and the
  seconds inside its collective, against
  their prediction (:class:`~commpress.auto.decide.LinkTracker`, ``remeasure``: the link as DDP
  tracks it), the gradient norm per unit (on the device,
  read at check points), and the step's compute seconds: wall time between two step ends
  (the end of backward) less the time inside the units' reduce-scatter calls.
  **Not measured: overlap.** The hook's call runs on the backward's thread and, with gloo
  (and for the codec on any backend), the backward waits for it; so every unit's hidden
  window is taken as 0 (its codec and collective are predicted exposed).  On CUDA with
  NCCL, FSDP2 runs the reduce-scatter on its own stream and part of it may be hidden:
  the prediction is then conservative (it may compress where dense would have hidden).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..feedback import ErrorFeedback
from .candidates import DENSE, Candidate, Choice, describe, prototype
from .measure import CODEC_SAMPLE, codec_cost
from .runtime import AutoCodec, AutoSpec

#: the kinds FSDP2's reduce-scatter cannot run (a flat buffer of many parameters' shards)
EXCLUDED_KINDS = ("powersgd",)


@dataclass(frozen=True)
class FSDPUnit:
    """One FSDP2 unit as ``"auto"`` sees it: ``key`` (its module name), the reduce-scatter
    input's ``numel`` (``P·m``, 0 before its first call) and ``dtype`` (the reduce dtype), and
    its parameters' ``names`` and global ``shapes``."""

    key: str
    numel: int = 0
    dtype: torch.dtype = torch.float32
    names: tuple[str, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()


#: the least predicted reduce_scatter seconds a dense unit's measured excess is read per second of
#: (:meth:`ReduceScatterAutoCodec._per_round`)
RATE_MIN_S = 1e-3


class ReduceScatterAutoCodec(AutoCodec):
    """:class:`~commpress.auto.runtime.AutoCodec` for FSDP2's gradient reduce-scatter (see the
    module doc).  The hook calls :meth:`unit`, :meth:`native`, :meth:`codec` and
    :meth:`measured` per unit and call, :meth:`end_step` at the end of each backward pass."""

    def __init__(self, spec: AutoSpec, momentum: float = 0.0, masking: bool = False, storage: str = "fp32",
                 hold_pending: bool = True) -> None:
        super().__init__(spec, momentum, masking, storage, hold_pending)
        self.order: list[str] = []            # the units, in the order decisions list them (set at binding)
        self.infos: dict[str, FSDPUnit] = {}

    # -- the units -------------------------------------------------------------
    def set_units(self, units: list[tuple[str, list[str], list[tuple[int, ...]]]]) -> None:
        """``(name, parameter names, parameter shapes)`` of every unit, in the order of the
        registration (the same on every rank): the decision's order."""
        self.order = [name for name, _, _ in units]
        for name, names, shapes in units:
            old = self.infos.get(name)
            self.infos[name] = FSDPUnit(name, old.numel if old else 0, old.dtype if old else torch.float32,
                                        tuple(names), tuple(tuple(s) for s in shapes))
        self._units = [self.infos[k] for k in self.order]

    def unit(self, key: str, numel: int, dtype: torch.dtype) -> FSDPUnit:
        """The unit ``key`` with the size and dtype of this call's input (recorded; a call that
        changes either validates again and, like a new codec's first call, is not measured)."""
        info = self.infos.get(key)
        if info is None or info.numel != numel or info.dtype != dtype:
            if info is not None and info.numel:
                self._unmeasured.add(key)
            info = self.infos[key] = replace(info or FSDPUnit(key), numel=int(numel), dtype=dtype)
            self._units = [self.infos.get(k, FSDPUnit(k)) for k in self.order]
        return info

    def native(self, key: str) -> bool:
        """Whether unit ``key`` runs FSDP2's own reduce-scatter this call: it chose dense, owes
        no carried residual (it ran one fp32 step since it switched) and there is no momentum
        correction.  Agreed state only: the same on every rank.  Ask before :meth:`codec`."""
        return not self.momentum and key not in self._fresh and self.choices.get(key, DENSE) == DENSE

    def measured(self, unit: Any, seconds: float, comm_seconds: float = 0.0) -> None:
        """Host seconds of the unit's reduce-scatter call (also taken out of the compute) and of
        those the seconds inside its collectives (the link's tracking)."""
        super().measured(unit, seconds, comm_seconds)
        self._busy += seconds

    # -- what differs from DDP ---------------------------------------------------
    def _build(self, choice: Choice) -> ErrorFeedback:
        if choice.candidate.kind in EXCLUDED_KINDS:
            raise ValueError(f"auto: {describe(choice)} cannot run in FSDP2's reduce-scatter")
        return super()._build(choice)

    def _unit_slots(self, codec: ErrorFeedback, key: Any, numel: int, owner: bool) -> list[tuple[Any, int, int]]:
        """``((key, r), r·m, m)`` for the ``P`` equal chunks of the input (every kind: the
        reduce-scatter compresses chunk by chunk, no owner-side residual); one rank:
        ``((key, 0), 0, numel)``."""
        if self.world <= 1:
            return [((key, 0), 0, numel)]
        per = numel // self.world
        return [((key, r), r * per, per) for r in range(self.world)] if per else []

    def _rounds_of(self, candidate: Candidate) -> int:
        return 1   # FSDP2's reduce_scatter, or one all_to_all

    def _per_round(self, rows: list[tuple[Any, Choice, float, float, int]]) -> float:
        """The per-round cost every call pays: the window's smallest excess per round; and, per dense
        unit, the rest of its excess per second of its predicted reduce_scatter (``dense_rates``,
        kept while the unit runs another kind).  FSDP2's reduce_scatter is not the collective the
        α-β model was calibrated on (all_reduce and all_gather), and on gloo it costs more than an
        all_reduce of the same input, in proportion to its bytes: averaged into a per-round cost,
        that excess was charged to every candidate's round, and a unit stayed dense where
        blockquant 8-bit measured 0.85-0.94x FSDP2's step.  Learned only where the predicted
        collective is at least the per-round cost and :data:`RATE_MIN_S`: a small unit's call is
        mostly its fixed cost, and its excess per predicted second would be noise."""
        floor = min(max(0.0, e) / r for *_, e, _, r in rows)
        for key, choice, e, comm, r in rows:
            if choice == DENSE and comm >= max(floor * r, RATE_MIN_S):
                self.dense_rates[key] = max(0.0, e - floor * r) / comm
        return floor

    def _codec_cost(self, c: Candidate, unit: Any, device: torch.device) -> float | None:
        """``P`` passes over one chunk (compress each chunk, decode each piece at the owner);
        ``None`` (not a candidate for this unit) when ``c`` does not take the reduce dtype: the
        hook would send that unit dense."""
        if unit.dtype not in prototype(c).supported_dtypes:
            return None
        p = max(1, self.world)
        m = -(-unit.numel // p)
        return p * codec_cost(c, m, device, dtype=unit.dtype, reps=2 if unit.numel > (1 << 22) else 3,
                              sample=CODEC_SAMPLE, storage=self.storage)

    def _names(self, units: list[Any]) -> list[str]:
        return [u.key for u in units]

    def fast(self, step: int) -> str | None:
        return None   # per unit instead: native()

    # -- the step's end -------------------------------------------------------------
    def end_step(self, step: int, layout: Any = None, group: Any = None) -> None:
        """Account step ``step`` (its residual updates committed); at a check point measure,
        agree, decide and switch (a collective: every rank at the same step)."""
        now = time.perf_counter()
        if self._last_step == step - 1 and self._last_end is not None:
            self._compute.append(max(0.0, now - self._last_end - self._busy))
        elif self._last_step != step - 1:
            self._wall_mark = None
        self._mark_step(now)
        self._last_step = step
        self._busy = 0.0
        if self.is_check(step):
            if self.network is not None and self.network.collective != "reduce_scatter":
                self.network = replace(self.network, collective="reduce_scatter", local_size=1,
                                       intra=None, inter=None)
            self._units = [self.infos.get(k, FSDPUnit(k)) for k in self.order]
            self.check(step, group)
        self._last_end = time.perf_counter()   # the check's own time is not the next step's compute
