"""``register(model, "auto")`` at run time: one codec per unit, the measurements, the check points.

This module is the DDP hook's side; :mod:`commpress.auto.fsdp` subclasses :class:`AutoCodec` for
FSDP2's reduce-scatter (one unit per FSDP2 unit: residual slots per chunk, reduce-scatter prediction,
no overlap measure).  :func:`auto_spec` turns either hook's keywords into the :class:`AutoSpec`.

The DDP hook runs each unit (one compressed call: a bucket's compressible parameters)
through :meth:`AutoCodec.codec`, which returns the unit's own
:class:`~commpress.ErrorFeedback` of the kind chosen for it.  Every choice runs under
error feedback (dense and bf16 too: for them the residual is a rounding error or
zero), so a residual carried over from a switch, or a momentum-correction velocity,
always has a home and is never lost.

What it measures, without a host read in the steady state:

* per bucket, the hook's arrival and return times (host clock) and the backward
  end (the last bucket's arrival), for :class:`~commpress.auto.measure.OverlapRecorder`;
  the backward start is a forward hook on the DDP model;
* per unit, the gradient norm, accumulated on the device every :data:`NORM_EVERY`-th step
  (read at check points);
* per unit, the host seconds of its collective call (``measured_ms``), but for the first
  call of each codec it gets (its first, after a switch, after a resume: one-time costs of the
  new codec, kernel compilation, first-call plans and validation);
* the step's compute seconds: wall time between two step ends, less the time from
  the backward end to the step end (the exposed communication) and the hooks' own time
  (the median over the window's steps); for a step with no step end before it on the
  units' path (the first compressed one), from its forward's start (a forward pre-hook)
  to its backward's end, less the hooks' own time;
  a check point's own time (codec costs measured, the decision) is not charged to the next step.

**Check points** (:meth:`AutoCodec.end_step`, :meth:`AutoCodec.is_check`): at :attr:`first_check`
(DDP: the end of the warm-up step's backward, on DDP's own path, with the units of the layout DDP
makes at the next forward, :func:`commpress.hooks.ddp._before_first_check`; where that layout is not
known then, the end of the first compressed step, whose units run dense; its compute is timed from
its forward's start: no step ended before it on the units' path), :data:`EARLY_CHECK` steps later (the first window timed from step end to step end,
whose calls of the chosen codecs give the per-round cost the first decision had to do without),
and then every ``check_every`` steps from the first, on every rank at the same step.  One host
read of the norms, each candidate's codec cost at each unit's size
(measured once, cached), and **one** ``all_reduce`` of a float64 vector
(:func:`~commpress.auto.measure.agree_measurements`).  The :class:`~commpress.auto.decide.Decider`
then re-decides (every ``every`` steps, or when the overlap drifted) with hysteresis:
a pure function of the agreed numbers, so every rank switches the same units.  A unit
that switches hands its residual and velocity to its new codec (:meth:`AutoCodec.switch`).
A rank that fails to measure sends ``inf`` as its compute seconds: every rank then
raises at the same point (no rank waits in a collective the others left).

**All dense** (:meth:`AutoCodec.fast`): when every unit chose dense and nothing is owed, the steps
between check windows send every bucket as DDP does (one async ``all_reduce``; with momentum
correction each unit's velocity is applied in the pass that scales it by ``1/P``,
:meth:`AutoCodec.velocity_part`, as the units' path would); the two steps ending at each check
point run the units' own path, so their call times, norms and compute seconds are still measured.

Every number a decision reads is agreed: the α-β model calibrated at binding, the codec
costs (max over ranks), the hidden windows (min), the norm changes (max), the compute seconds
(max) and each unit's call seconds (min), from which a per-round cost is added to every
candidate (:meth:`AutoCodec._with_round_cost`: what the α-β model misses, framework time
and the wait at each round).

**Two-level path** (``register(model, "auto", hierarchy=L)``): the network is then
``Network(world, flat, local_size=L, intra, inter)`` from the hierarchy's calibrated models, and
each unit's choice is a kind **and** a path.  A two-level unit's call gets the hook's
:class:`~commpress.collectives.Hierarchy` forced to mode ``"two_level"`` (:meth:`AutoCodec.hierarchy_of`),
a flat one no hierarchy.  Its residuals are per shard (``("shard", key, j)``, owned by local
rank ``j`` of each node, for the node's sum).  A switch keeps what is owed
(:meth:`AutoCodec.switch`): within a path and from two-level to flat, slot by slot, bitwise;
from flat to two-level the part of this rank's residual outside its shard becomes the unit's
**carry**, added to its next input after the ``1/P`` scaling (the hook multiplies the unit's
input before :meth:`AutoCodec.codec` adds it), so it is sent once, rounded once; its commit is
staged in the step's residual transaction (:class:`_CarryCommit`): dropped when the step commits
clean, kept (like a residual) by a step with a NaN/inf or one that raised; in the checkpoint until then.
With momentum correction every unit stays flat (a velocity cannot be split between paths): the
check point decides on the flat network.  Codec seconds on the two-level path are a shard's
(``1/L``); the per-round cost measured from call times is charged whole, plus the path's two
intra-node rounds.

**Momentum correction** (``optimizer=`` took over SGD's momentum): every choice then runs with the
hook's velocity, which the sparsifiers need and powersgd's low ranks stand badly: they are priced for
it (:meth:`~commpress.auto.decide.Prices.with_momentum_correction`).  The first check point has no norm
window before it and is a critical regime (:func:`first_window_change`): the first plan is a gentle one.

**Checkpoints**: :meth:`AutoCodec.state_dict` holds each unit's choice and its codec's state
(residuals, velocities, PowerSGD warm starts), the decider (plan, when decided, what it
watches), the norm windows and the carries still to send.  A resume is bitwise until the
next check point: from there the plan depends on wall-clock timings, which differ between any two runs (resumed or not).

**The network, tracked**: each unit's seconds inside its collectives (agreed as the minimum over
ranks) against their prediction, compared between check windows of the same plan, tell how much
the flat link slowed down or sped up since binding (:class:`~commpress.auto.decide.LinkTracker`,
``remeasure=True``): two windows in a row off by more than twice ``drift`` scale the calibrated seconds
per byte, and the decider, which watches them, re-decides.  With a hierarchy the intra- and
inter-node calibrations made at binding stand.

Not measured: device time on CUDA (the clock is the host's).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import statistics
import time
from typing import Any, Callable

import torch

from ..collectives.costmodel import CostModel
from ..collectives.quantized import alignment, chunk_bounds
from ..compressors import base as _registry
from ..compressors.base import Compressor
from ..feedback import ErrorFeedback, _host_verdict
from .candidates import DEFAULT_CANDIDATES, DENSE, Candidate, Choice, describe, prototype
from .decide import (REVERT, BucketMeasure, Decider, LinkTracker, Measurements, Network, Prices, codec_seconds,
                     comm_seconds, critical_candidates, kind_rounds, window_tolerance)
from .measure import CODEC_SAMPLE, OverlapRecorder, agree_measurements, codec_cost, norm_change
from .switch import Carry, fold_residual, take_residual

log = logging.getLogger("commpress")

#: the keywords ``register(model, "auto", ...)`` takes besides the hook's own
AUTO_OPTIONS = ("candidates", "check_every", "every", "margin", "drift", "critical", "prices", "remeasure",
                "revert")
DEFAULT_CHECK_EVERY = 100
#: a window's gradient norm is sampled every this many steps (:meth:`AutoCodec.samples_norm`)
NORM_EVERY = 8
#: switches per unit that :meth:`AutoCodec.report` keeps (the latest)
SWITCHES_KEPT = 16
#: the second check point comes this many steps after the first (:meth:`AutoCodec.is_check`)
EARLY_CHECK = 4


def first_window_change(critical: float) -> float:
    """The gradient-norm change a check point with no window before it reads (the first): ``critical``,
    so that the start of training is a critical regime (Accordion's rule for the first epochs).  The
    early steps are where an aggressive kind loses most: powersgd rank 1, chosen at step 1 on the
    digits MLP at 100 Mbit/s, trailed DDP by 0.12 accuracy at step 45 and by 0.03 at step 90
    (docs/results/auto.md).

    Args:
        critical: the decider's ``critical`` threshold.
    """
    return float(critical)


def _candidate(c: Any) -> Candidate:
    if isinstance(c, Candidate):
        return c
    if isinstance(c, (tuple, list)) and 1 <= len(c) <= 2:
        return Candidate(*c)
    raise ValueError(f"auto: candidates must be commpress.auto.Candidate or (kind, param) pairs, got {c!r}")


class AutoSpec(Compressor):
    """The ``"auto"`` compressor argument: its options, fingerprinted across ranks.

    ``candidates``: what a unit may run (``None``: :data:`~commpress.auto.DEFAULT_CANDIDATES`;
    dense is always allowed); ``check_every``: steps between check points (one small
    ``all_reduce`` each); ``every``: steps between re-decisions; ``margin``: hysteresis
    (relative predicted gain needed to switch); ``drift``: re-decide sooner when a unit's
    hidden window moved by more than this fraction of the compute; ``critical``:
    Accordion's gradient-norm change threshold; ``prices``: a :class:`~commpress.auto.Prices`;
    ``remeasure``: track how much the link slowed down or sped up since registration from what
    the windows' collectives took (:class:`~commpress.auto.decide.LinkTracker`; ``False`` keeps
    the calibration made at registration as it is); ``revert``: a switch whose next window measures
    a step × price worse than the plan's before it by more than this (relative; less where both
    windows' steps were quiet: :meth:`~commpress.auto.decide.Decider.revert_limit`) is undone and
    the plan barred for ``every`` steps (:meth:`~commpress.auto.decide.Decider.update`).
    It never compresses anything itself (:class:`AutoCodec` runs the choices).
    """

    name = "auto"
    aggregation = "sum"
    unbiased = True

    def __init__(self, candidates: Any = None, check_every: int = DEFAULT_CHECK_EVERY,
                 every: int = 1000, margin: float = 0.05, drift: float = 0.25, critical: float = 0.5,
                 prices: Prices | None = None, remeasure: bool = True, revert: float = REVERT) -> None:
        cands = tuple(_candidate(c) for c in (DEFAULT_CANDIDATES if candidates is None else candidates))
        if not cands:
            raise ValueError("auto: candidates must not be empty")
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise ValueError(f"auto: check_every must be an int >= 1, got {check_every!r}")
        if prices is not None and not isinstance(prices, Prices):
            raise TypeError(f"auto: prices must be a commpress.auto.Prices or None, got {type(prices).__name__}")
        if not isinstance(remeasure, bool):
            raise TypeError(f"auto: remeasure must be a bool, got {remeasure!r}")
        self.candidates = cands
        #: whether the candidates are the user's (``candidates=``) rather than the defaults
        self.user_candidates = candidates is not None
        self.check_every = check_every
        self.remeasure = remeasure
        self.prices = prices if prices is not None else Prices()
        # validates every, margin, drift and critical
        self.decider_args = dict(margin=margin, every=every, drift=drift, critical=critical, revert=revert)
        Decider(candidates=cands, prices=self.prices, **self.decider_args)
        self._config = {"candidates": [describe(c) for c in cands], "check_every": check_every,
                        "prices": dataclasses.asdict(self.prices), "remeasure": remeasure, **self.decider_args}

    def sparse_candidates(self) -> tuple[Candidate, ...]:
        """The sparsifiers among the candidates (``topk``: each coordinate's accumulated
        gradient is sent only in the steps that select it)."""
        return tuple(c for c in self.candidates if prototype(c).aggregation == "sparse")

    def without_sparsifiers(self) -> AutoSpec:
        """A copy with the sparsifiers left out of the candidates (:meth:`sparse_candidates`),
        the fingerprinted configuration with them; ``self`` when there are none."""
        sparse = self.sparse_candidates()
        return self._keeping(lambda c: c not in sparse)

    def _keeping(self, keep: Callable[[Candidate], bool]) -> AutoSpec:
        """A copy with only the candidates ``keep`` accepts (its configuration with them);
        ``self`` when that is all of them."""
        kept = tuple(c for c in self.candidates if keep(c))
        if len(kept) == len(self.candidates):
            return self
        spec = copy.copy(self)
        spec.candidates = kept
        spec._config = dict(self._config, candidates=[describe(c) for c in kept])
        return spec

    def compress(self, tensor, *, step=0, key=0, generator=None):
        raise RuntimeError("the 'auto' compressor only chooses: each unit runs its own codec (AutoCodec)")

    def decompress(self, payload, out=None):
        raise RuntimeError("the 'auto' compressor only chooses: each unit runs its own codec (AutoCodec)")


def auto_spec(params: dict[str, Any], *, exclude: tuple[str, ...] = (), where: str = "the hook") -> AutoSpec:
    """The :class:`AutoSpec` of ``register(model, "auto", **params)``: its options are taken out
    of ``params`` (``momentum`` and ``momentum_masking`` stay: the hook's own).  ``ValueError``
    for an unknown option, naming :data:`AUTO_OPTIONS`.  Candidates of a kind in ``exclude``
    (what ``where`` cannot run) are left out of the default set and refused when given."""
    unknown = sorted(set(params) - set(AUTO_OPTIONS) - {"momentum", "momentum_masking"})
    if unknown:
        raise ValueError(f"compressor 'auto' takes the options {AUTO_OPTIONS} (and momentum, "
                         f"momentum_masking), got {unknown}")
    options = {k: params.pop(k) for k in AUTO_OPTIONS if k in params}
    return excluding(AutoSpec(**options), exclude, where)


def excluding(spec: AutoSpec, exclude: tuple[str, ...], where: str) -> AutoSpec:
    """``spec`` without the candidate kinds in ``exclude`` (what ``where`` cannot run): left out of
    the default set, ``ValueError`` when the user gave one."""
    if not exclude:
        return spec
    if spec.user_candidates:
        bad = [describe(c) for c in spec.candidates if c.kind in exclude]
        if bad:
            raise ValueError(f"auto: candidates {bad} cannot run in {where} (kinds {list(exclude)} "
                             "are not supported there)")
        return spec
    return spec._keeping(lambda c: c.kind not in exclude)


_BF16 = Choice(Candidate("bf16"))


def _rounds(candidate: Candidate, world: int) -> int:
    """Collective rounds of a candidate's call on ``world`` ranks (:func:`~commpress.auto.decide.kind_rounds`
    of its kind: PowerSGD 2, a quantized kind 2 except at ``world <= 2``, the others 1)."""
    return kind_rounds(prototype(candidate).aggregation, world)


def _two_level_slots(codec: ErrorFeedback, key: Any, numel: int, hierarchy: Any,
                     shapes: Any, owner: bool) -> list[tuple[Any, int, int]]:
    """``(residual key, offset, numel)`` of what ``codec`` keeps for unit ``key`` on the
    two-level path (:mod:`commpress.collectives.hierarchy`): the shard ``j`` this rank owns
    (its local rank), under ``("shard", key, j)`` at the shard's offset, chunked among the
    ``P / L`` nodes for a ``"gather"`` kind (:func:`_slots` on the inter group)."""
    h = hierarchy
    j = h.local_rank
    lowrank = codec.aggregation == "lowrank"
    bnd = h.bounds(numel, codec, (numel,), [tuple(s) for s in shapes] if lowrank and shapes else None)
    lo, n = bnd[j], bnd[j + 1] - bnd[j]
    if n <= 0:
        return []
    return [(k, lo + off, m) for k, off, m in _slots(codec, ("shard", key, j), n, h.nodes, h.node, owner)]


def _slots(codec: ErrorFeedback, key: Any, numel: int, world: int, rank: int,
           owner: bool) -> list[tuple[Any, int, int]]:
    """``(residual key, offset, numel)`` of every residual a codec keeps for a unit: one under
    ``key``, or for a ``"gather"`` kind one per chunk ``(key, r)`` (and, with ``owner``, the
    re-compressed sum of the chunk this rank owns, ``("owner", key, rank)``)."""
    if codec.aggregation != "gather":
        return [(key, 0, numel)]
    if world <= 1:
        return [((key, 0), 0, numel)]
    b = chunk_bounds(numel, world, alignment(codec))
    out = [((key, r), b[r], b[r + 1] - b[r]) for r in range(world)]
    if owner:
        out.append((("owner", key, rank), b[rank], b[rank + 1] - b[rank]))
    return [s for s in out if s[2] > 0]


class _CarryCommit:
    """The commit of the carries a step added to its units' inputs, staged in the step's
    :class:`~commpress.feedback.ResidualTransaction` like a residual: a good step drops the
    carry (it was sent), a step with a NaN/inf (the transaction's bad flag) keeps it, as error
    feedback keeps a residual; a rolled-back step keeps it too.  On CUDA the flag stays on the
    device: the carry becomes ``where(bad, carry, 0)`` and a zero carry is dropped at the next
    check point (:meth:`AutoCodec.check`, which reads the host anyway)."""

    def __init__(self, carry: dict[Any, torch.Tensor]) -> None:
        self.carry = carry

    def commit(self, key: Any, bad: torch.Tensor | None = None) -> None:
        verdict = _host_verdict(bad)
        if verdict is False:
            self.carry.pop(key, None)
        elif verdict is None and key in self.carry:
            c = self.carry[key]
            self.carry[key] = torch.where(bad, c, torch.zeros_like(c))

    def rollback(self, key: Any) -> None:
        pass


def _link_drift(spec: AutoSpec) -> float:
    """The link tracker's threshold: twice the decider's ``drift`` (50% by default).  On a shared
    machine a window's collective seconds swing by more than 25% with the load alone (measured:
    a 100 Mbit/s LM run read its link 1.5x slower for two windows with nothing changed)."""
    return 2.0 * spec.decider_args["drift"]


class AutoCodec:
    """The codec of a hook registered with ``"auto"``: a :class:`~commpress.ErrorFeedback` per
    unit, the decider, the measurements.  Changed only between steps (at check points, on
    the thread that runs the buckets); read by the step through :meth:`codec`.

    The dense parameters' plain momentum (with momentum correction) lives in ``home``.
    """

    name = "auto"

    def __init__(self, spec: AutoSpec, momentum: float = 0.0, masking: bool = False, storage: str = "fp32",
                 hold_pending: bool = True) -> None:
        self.spec = spec
        self.momentum = float(momentum)
        self.masking = masking
        #: every unit's error feedback keeps its residuals so (``register(residual_storage=, rollback=)``)
        self.storage, self.hold_pending = storage, hold_pending
        self.home = ErrorFeedback(_registry.get("identity"), momentum=self.momentum, masking=masking,
                                  storage=storage, hold_pending=hold_pending)
        #: what the decider chooses among, at what price: with momentum correction (the hook applies the
        #: optimizer's momentum) the low ranks of powersgd cost more (:meth:`Prices.with_momentum_correction`)
        self.candidates = spec.candidates
        self.prices = spec.prices.with_momentum_correction() if self.momentum else spec.prices
        self.decider = Decider(candidates=self.candidates, prices=self.prices, **spec.decider_args)
        self.codecs: dict[Any, ErrorFeedback] = {}
        self.choices: dict[Any, Choice] = {}
        # set at binding
        self.network: Network | None = None
        #: the two-level path's :class:`~commpress.collectives.Hierarchy` (mode ``"two_level"``), or None
        self.hierarchy: Any = None
        self.first_check = 1
        self.queued = False
        self.world, self.rank = 1, 0
        # measurements of the current window
        self.recorder = OverlapRecorder()
        self._started = False
        self._backward_end: float | None = None
        self._busy = 0.0
        self._last_end: float | None = None
        self._forward_start: float | None = None
        self._compute: list[float] = []         # this window's compute seconds, one per timed step
        self._walls: list[float] = []           # this window's step wall seconds (:meth:`_mark_step`)
        self._wall_mark: float | None = None    # where the next step's wall time starts (None: not timed)
        self._norms: dict[Any, torch.Tensor] = {}
        self._devices: dict[Any, torch.device] = {}   # where each unit's gradient lives (its codec timings')
        self._norm_steps: dict[Any, int] = {}   # steps summed into each norm this window
        self._prev_norms: list[float] | None = None
        self._changes: list[float] | None = None   # each unit's norm change at the last check point
        self._unit_bucket: dict[Any, int] = {}
        self._meas: dict[Any, list[float]] = {}
        self._last_meas: dict[Any, float] = {}
        #: per unit, the check points that switched it: ``[(step, choice), ...]`` (the last :data:`SWITCHES_KEPT`)
        self.switches: dict[Any, list[tuple[int, Choice]]] = {}
        self._units: list[Any] = []
        self._probes: dict | None = None         # a check point's codec-timing inputs (measure.codec_cost)
        self.checks = 0
        self.round_s = 0.0                      # measured seconds per collective round beyond the model
        #: per unit, what its dense call took beyond the model per second of its predicted collective
        #: (learned where that collective is not the calibrated one: FSDP2's reduce_scatter)
        self.dense_rates: dict[Any, float] = {}
        self._fresh: set[Any] = set()           # units switched to dense that have not run since
        self._unmeasured: set[Any] = set()      # units with a new codec, whose next call is not measured
        self._last_step: int | None = None
        self._round_s_decided: float | None = None
        # what a path switch handed to a unit's next input (this rank's share, scaled as the input)
        self._carry: dict[Any, torch.Tensor] = {}
        self._spent: set[Any] = set()           # units whose carry went into this step's input
        self._carry_commit = _CarryCommit(self._carry)
        #: how far the flat link moved since binding (the last check point priced it scaled by that)
        self.link = LinkTracker(_link_drift(spec))

    # -- what a step reads ------------------------------------------------------
    def in_force(self, unit: Any) -> ErrorFeedback | None:
        """The codec :meth:`codec` will return for ``unit`` with its input left as it is (no carry
        owed), or ``None``: what a hook may fold its ``1/P`` into (``allreduce(prescale=)``, folded into
        its compensation pass)."""
        return None if unit.key in self._carry else self.codecs.get(unit.key)

    def codec(self, unit: Any, t: torch.Tensor, bucket: int, transaction: Any = None,
              scale: float = 1.0, step: int | None = None) -> ErrorFeedback:
        """The unit's codec (dense until a decision); adds ``t``'s norm (times ``scale``: the
        hook's ``1/P`` when it is folded into the codec, not yet applied to ``t``) to the unit's
        accumulator on the device (no host read), at the steps that sample it (:meth:`samples_norm`;
        every call without ``step``).  A carry left by a path switch
        (:meth:`switch`) is added to ``t`` (already scaled by the hook's ``1/P``); its
        commit is staged in ``transaction`` (the step's: kept when the step is bad or rolled
        back, dropped when it commits clean), or without one dropped at :meth:`end_step`."""
        key = unit.key
        c = self._codec_of(key)
        if step is None or self.samples_norm(step):
            self._add_norm(key, torch.linalg.vector_norm(t), scale)
        owed = self._carry.get(key)
        if owed is not None:   # a path switch's carry: sent once, by this step (dropped at its commit)
            t.view(-1).add_(owed.to(device=t.device, dtype=t.dtype))
            if transaction is not None:
                transaction.stage(self._carry_commit, key)
            else:
                self._spent.add(key)
        self._unit_bucket[key] = bucket
        self._devices[key] = t.device
        if key in self._fresh and t.dtype == torch.float32:
            self._fresh.discard(key)   # an fp32 identity step sends all it owed: nothing left
        return c

    def _codec_of(self, key: Any) -> ErrorFeedback:
        """Unit ``key``'s codec; dense (and its first call not measured) until a decision."""
        c = self.codecs.get(key)
        if c is None:
            c = self.codecs[key] = self._build(DENSE)
            self.choices[key] = DENSE
            self._unmeasured.add(key)
        return c

    def warmup_unit(self, unit: Any, norms: list[torch.Tensor] | None, bucket: int, device: torch.device,
                    scale: float = 1.0) -> None:
        """Unit ``unit`` in the warm-up step that ends with the first check point (DDP's own path,
        :attr:`first_check` 0): its gradient's norm from its parameters' ``norms`` (times ``scale``,
        the hook's ``1/P``; ``None``: not sampled) joins the window, its bucket and device are noted."""
        key = unit.key
        self._codec_of(key)
        self._unit_bucket[key] = bucket
        self._devices[key] = device
        if norms:
            self._add_norm(key, torch.linalg.vector_norm(torch.stack(norms)), scale)

    def _add_norm(self, key: Any, norm: torch.Tensor, scale: float) -> None:
        """Unit ``key``'s gradient norm of one step (``norm * scale``, on the device) joins the window's."""
        acc = self._norms.get(key)
        if acc is None or acc.device != norm.device:
            acc = self._norms[key] = torch.zeros((), dtype=torch.float32, device=norm.device)
        acc.add_(norm, alpha=scale)
        self._norm_steps[key] = self._norm_steps.get(key, 0) + 1

    def samples_norm(self, step: int) -> bool:
        """Whether step ``step`` adds its gradient norms to the window's (Accordion's statistic):
        each check point's own step and every :data:`NORM_EVERY`-th step after it.  The window's
        mean over those steps estimates its mean over all of them; a norm is a full pass over the
        unit (0.27 ms for 1.1M fp32 elements on one CPU core), on the critical path of each step
        that takes it."""
        return self._phase(step) % NORM_EVERY == 0

    def _phase(self, step: int) -> int:
        """Steps since the last regular check point (0 at one: every ``check_every`` from the first)."""
        return (step - self.first_check) % self.spec.check_every

    def is_check(self, step: int) -> bool:
        """Whether a check point ends step ``step``: ``first_check`` (DDP: the warm-up step),
        :data:`EARLY_CHECK` steps later (the first window timed from one step end to the next,
        with the calls of the codecs the first decision chose: what learns the per-round cost;
        not a reference for the link's tracking) and every ``check_every`` steps from the first."""
        if step < self.first_check:
            return False
        return (self._phase(step) == 0 or step == self.first_check + EARLY_CHECK
                or (self.decider.on_probation and step == self.decider.switched_at + EARLY_CHECK))

    def fast(self, step: int) -> str | None:
        """``"dense"`` / ``"bf16"`` when step ``step`` sends every bucket as DDP does (one async
        ``all_reduce``, of the bucket cast to bf16 for ``"bf16"``, as PyTorch's bf16 hook), else
        ``None``.  Only when every unit chose dense (or every unit bf16, without momentum
        correction; with it the hook applies each unit's velocity in DDP's pass,
        :meth:`velocity_part`), no dense unit owes a carried residual (it ran one fp32 step
        since it switched), and ``step`` is neither a check point nor the step before it (those
        run the units' own path, to measure them, and send what the bf16 units' error feedback
        holds: delayed, not lost).  A
        function of agreed state and the step: the same on every rank and every bucket of a step."""
        if self._fresh or self._carry or not self.choices or step < self.first_check:
            return None
        if self.is_check(step) or self.is_check(step + 1):
            return None
        kinds = set(self.choices.values())
        if kinds == {DENSE}:
            return "dense"
        return "bf16" if kinds == {_BF16} and not self.momentum else None

    def velocity_part(self, unit: Any, name: str, part: torch.Tensor, scale: float, transaction: Any) -> None:
        """A step that :meth:`fast` sends DDP's way under momentum correction: parameter ``name``'s
        ``part`` of ``unit`` (in the DDP bucket) := its pending velocity ``m·u + part·scale``, as the
        unit's dense codec computes it on the units' path (its residual is zero: nothing owed, see
        :meth:`fast`); the unit's velocity is staged in ``transaction`` with its last part."""
        at = unit.names.index(name)
        codec = self.codecs[unit.key]
        codec.velocity_into(part, unit.key, unit.numel, sum(unit.sizes[:at]), scale=scale)
        if at == len(unit.names) - 1:
            codec.stage_velocity(unit.key, transaction)

    def velocity_unit(self, unit: Any, buf: torch.Tensor, parts: list[tuple[int, int]], scale: float,
                      transaction: Any) -> bool | None:
        """:meth:`velocity_part` for all of ``unit``'s parts (``(offset, numel)`` in ``buf``, in the
        unit's order) in one pass where its storage allows (:meth:`ErrorFeedback.velocity_unit`):
        whether its new velocity holds a NaN/inf; ``None``, nothing touched, elsewhere."""
        return self.codecs[unit.key].velocity_unit(buf, parts, unit.key, unit.numel, scale=scale,
                                                   transaction=transaction)

    def measured(self, unit: Any, seconds: float, comm_seconds: float = 0.0) -> None:
        """Host seconds of the unit's collective call this step, and of those the seconds
        inside its collectives (``comm_seconds``: what re-measures the bandwidth,
        :class:`~commpress.auto.decide.LinkTracker`).  The first call of each codec the unit
        gets (:meth:`codec`, :meth:`switch`, :meth:`load_state_dict`) is left out: it holds
        one-time costs of the new codec (kernel compilation, the first call's plans and
        validation), not what its steady state costs per call."""
        if unit.key in self._unmeasured:
            self._unmeasured.discard(unit.key)
            return
        m = self._meas.setdefault(unit.key, [0.0, 0, 0.0])
        m[0] += seconds
        m[1] += 1
        m[2] += comm_seconds

    def hierarchy_of(self, unit: Any) -> Any:
        """The ``hierarchy=`` of the unit's call: the two-level :class:`~commpress.collectives.Hierarchy`
        when its choice's path is ``"two_level"``, else ``None`` (flat)."""
        choice = self.choices.get(unit.key)
        return self.hierarchy if choice is not None and choice.path == "two_level" else None

    def _build(self, choice: Choice) -> ErrorFeedback:
        if choice.path not in ("flat", "two_level"):
            raise ValueError(f"auto: unknown path {choice.path!r}")
        if choice.path == "two_level":
            if self.hierarchy is None:
                raise ValueError("auto: the two-level path needs register(..., hierarchy=L) (no node layout here)")
            if self.momentum:
                raise ValueError("auto: the two-level path is not taken with momentum correction (a velocity "
                                 "cannot be split across paths): every unit stays flat")
        return ErrorFeedback(choice.candidate.build(), momentum=self.momentum, masking=self.masking,
                             storage=self.storage, hold_pending=self.hold_pending)

    # -- the dense parameters' momentum (DDP's _finish_dense) ---------------------
    def dense_momentum(self, tensor: torch.Tensor, name: str, transaction: Any = None) -> None:
        self.home.dense_momentum(tensor, name, transaction)

    def dense_velocities(self) -> dict[str, torch.Tensor]:
        return self.home.dense_velocities()

    def load_dense_velocities(self, velocities: dict[str, torch.Tensor]) -> None:
        self.home.load_dense_velocities(velocities)

    def memory(self) -> dict[str, int]:
        """Bytes kept alive, by kind: every candidate's error feedback (:meth:`ErrorFeedback.memory`,
        the home one's dense momentum included), ``carry``, the residuals a path switch still owes,
        and ``measures``, the units' gradient-norm accumulators (one number each)."""
        out: dict[str, int] = {}
        for c in [self.home, *self.codecs.values()]:
            for kind, n in c.memory().items():
                out[kind] = out.get(kind, 0) + n
        out["carry"] = sum(t.numel() * t.element_size() for t in self._carry.values())
        out["measures"] = sum(t.numel() * t.element_size() for t in self._norms.values())
        return out

    def memory_bytes(self) -> int:
        """The sum of :meth:`memory`."""
        return sum(self.memory().values())

    def residual(self, key: Any) -> torch.Tensor | None:
        for c in self.codecs.values():
            r = c.residual(key)
            if r is not None:
                return r
        return None

    # -- overlap, from the hook call (the backward's thread) --------------------
    def forward_start(self) -> None:
        """The forward pass starts (the first check point times its step from here: no step
        ended before it on the units' path)."""
        self._forward_start = time.perf_counter()

    def begin(self) -> None:
        """The forward pass ended: the backward starts."""
        self.recorder.begin()
        self._started = True
        self._busy = 0.0

    def arrive(self, bucket: int, last: bool) -> float:
        t = time.perf_counter()
        if last:   # one step from one backward end to the next, on every path (DDP's own too)
            self._mark_step(t)
        if self._started:
            self.recorder.arrive(str(bucket), t)
            if last:
                self.recorder.finish(t)
                self._backward_end = t
                self._started = False
        return t

    def leave(self, bucket: int, t0: float) -> None:
        if self._started:
            t = time.perf_counter()
            self.recorder.leave(str(bucket), t)
            self._busy += t - t0

    def _mark_step(self, t: float) -> None:
        """A step ended at ``t`` (DDP: its backward's end): its wall time since the last mark joins
        the window's (:meth:`_window_step`).  A check point clears the mark, so the step after it
        (the check's own time, a new codec's first call) is not timed."""
        if self._wall_mark is not None:
            self._walls.append(t - self._wall_mark)
        self._wall_mark = t

    def _window_step(self) -> float:
        """The window's measured step, the median of its timed steps' walls (0: fewer than two)."""
        return statistics.median(self._walls) if len(self._walls) >= 2 else 0.0

    # -- the step's end (the thread that runs the buckets) -----------------------
    def end_step(self, step: int, layout: Any, group: Any, timed_next: bool = True) -> None:
        """Account the step that just committed; at a check point measure, agree, decide, switch.
        ``timed_next=False`` (the warm-up step's backward, before its own all_reduce has landed):
        the next step's compute is timed from its forward's start, not from here."""
        now = time.perf_counter()
        for key in self._spent:   # the step that sent them committed
            self._carry.pop(key, None)
        self._spent.clear()
        self._units = list(layout.units)
        consecutive = self._last_step == step - 1   # steps sent DDP's way (fast) are not timed here
        self._last_step = step
        if (consecutive and self._last_end is not None and self._backward_end is not None
                and self._backward_end > self._last_end):
            wall = now - self._last_end
            exposed = now - self._backward_end
            self._compute.append(max(0.0, wall - exposed - self._busy))
        elif (not self._compute and self._forward_start is not None and self._backward_end is not None
              and self._backward_end > self._forward_start):
            # no step end before this one (the first check point's step): its forward and backward,
            # less the hooks' own time (the optimizer's step is left out: the next window has it)
            self._compute.append(max(0.0, self._backward_end - self._forward_start - self._busy))
        self._backward_end = None
        if self.is_check(step):
            self.check(step, group)
        # the check's own time is not the next step's compute
        self._last_end = time.perf_counter() if timed_next else None

    def check(self, step: int, group: Any) -> tuple[int, ...]:
        """One check point (collective: every rank at the same step); returns the switched units."""
        units = self._units
        cands = self.candidates
        error = None
        try:
            if self.network is None:
                raise RuntimeError("auto: the hook is not bound (no network model)")
            for key in [k for k, c in self._carry.items() if not bool(c.any())]:
                del self._carry[key]   # sent (a device-side commit left zeros)
            norms = self._read_norms(units)
            first = self._prev_norms is None
            change = (norm_change(self._prev_norms, norms) if not first
                      else [first_window_change(self.spec.decider_args["critical"])] * len(units))
            if not first and self._changes is not None and len(self._changes) == len(units):
                # a window that sampled no norm for a unit (the early check point's) reads no regime:
                # the unit stays in the last one it was seen in (the first window's: critical)
                change = [c if n is not None else last for c, n, last in zip(change, norms, self._changes)]
            self._changes = list(change)
            # a window that sampled no norm for a unit (the early check point's) keeps the one before
            prev = self._prev_norms or [None] * len(units)
            self._prev_norms = [n if n is not None else p for n, p in zip(norms, prev)]
            # a unit in a critical regime here (the first window on every rank: no norm before it; later,
            # this rank's own change at or above the threshold, which the agreement's max keeps) may
            # only use the candidates that regime allows: the others are not timed yet (their codec
            # cost is paid at a later check point, if ever; a candidate another rank timed and this one
            # did not stays out of that unit's choice, as the regime has it anyway)
            critical, gentle = self.spec.decider_args["critical"], critical_candidates(cands, self.prices)
            hidden = self.recorder.mean_hidden()
            measures = []
            self._probes = {}   # the candidates timed on a size share its input; dropped below
            for u, ch in zip(units, change):
                device = self._devices.get(u.key, torch.device("cpu"))
                timed = cands
                if first or ch >= critical:   # the choice in force is priced too (its cost is cached)
                    now = self.choices.get(u.key, DENSE).candidate
                    timed = gentle + ((now,) if now not in gentle and now in cands else ())
                codec_s = {c: t for c in timed if (t := self._codec_cost(c, u, device)) is not None}
                measures.append(BucketMeasure(u.key, u.numel, tuple(tuple(s) for s in u.shapes),
                                              hidden.get(str(self._unit_bucket.get(u.key, -1)), 0.0),
                                              codec_s, ch, getattr(u, "dtype", torch.float32)))
            self._probes = None
            compute = self._window_compute()
            wall, tol = self._window_step(), window_tolerance(self._walls)
            window = [self._meas.get(u.key, (0.0, 0, 0.0)) for u in units]
            measured = [s_ / n if n else 0.0 for s_, n, _ in window]
            comm = [c / n if n else 0.0 for _, n, c in window]
        except Exception as exc:  # noqa: BLE001 - told to every rank through the agreed numbers
            error = exc
            self._probes = None
            measures = [BucketMeasure(u.key, u.numel) for u in units]
            compute, measured, comm, wall, tol = math.inf, [0.0] * len(units), [0.0] * len(units), 0.0, math.inf
        try:
            network = self.network or Network(max(1, self.world), CostModel(0.0, 0.0))
            if network.hierarchical and (self.momentum or self.hierarchy is None):
                # momentum correction: a velocity cannot be split across paths (flat only)
                network = Network(network.world, network.flat, collective=network.collective)
            m = agree_measurements(network, measures, compute, cands, group, codec_inline=not self.queued,
                                   extra=[(x, "min") for x in measured + comm] + [(wall, "max"), (tol, "max")])
        except ValueError as exc:
            if error is not None:
                raise error from exc
            if "compute_s" in str(exc):
                raise RuntimeError(f"auto: another rank failed to measure at step {step} "
                                   "(its error is raised there)") from exc
            raise
        calls, comm = m.extra[:len(units)], m.extra[len(units):2 * len(units)]
        wall, tol = m.extra[-2], m.extra[-1]
        # the bandwidth the window's collectives moved their bytes at (the signature the decider
        # watches: a link that slowed down or sped up since the last decision re-decides)
        network = m.network
        if self.spec.remeasure:
            if self._phase(step):
                # the early window (a few steps right after the first switch) is no reference for the
                # link: its plan's later windows would be compared with it (one run that fed it priced
                # its 1 Gbit/s link at 50 MB/s and wandered to powersgd): no seconds fed
                comm = [0.0] * len(units)
            network = self.link.update(network, [self.choices.get(u.key, DENSE) for u in units], m.buckets, comm)
        m = self._with_round_cost(dataclasses.replace(m, network=network, extra=calls), units)
        reverts = self.decider.last_revert
        decision, switched = self.decider.update(step, m, measured_s=wall, measured_tol=tol)
        if self.decider.last_revert is not reverts:
            _, bad, good = self.decider.last_revert
            log.warning("commpress auto: step %d: the plan chosen at the last check point measured %.1f ms per "
                        "step against %.1f ms for the plan before it (worse by more than %.0f%%, with their "
                        "prices): undone, and barred for %d steps", step, 1e3 * bad, 1e3 * good,
                        100 * self.decider.last_revert_limit, self.decider.every)
        for b in switched:
            self.switch(units[b].key, units[b].numel, decision.choices[b])
            kept = self.switches.setdefault(units[b].key, [])
            kept.append((step, decision.choices[b]))
            del kept[:-SWITCHES_KEPT]
        if self.decider.decided_at == step:
            self._round_s_decided = self.round_s
        if switched:
            log.info("commpress auto: step %d: %s", step,
                     ", ".join(f"unit {b} -> {describe(decision.choices[b])}" for b in switched))
        # the window's means become the report; a unit that switched has none for its new choice
        for key, (s, n, _) in self._meas.items():
            if n:
                self._last_meas[key] = s / n
        for b in switched:
            self._last_meas.pop(units[b].key, None)
        self._meas.clear()
        self._clear_window()
        self.checks += 1
        return switched

    def _clear_window(self) -> None:
        """A new window: no overlap, compute, step wall or norm measured in it yet."""
        self.recorder.reset()
        self._compute = []
        self._walls = []
        self._wall_mark = None
        for acc in self._norms.values():
            acc.zero_()
        self._norm_steps.clear()

    def postpone_first_check(self, step: int) -> None:
        """The first check point ends step ``step`` instead (DDP: the units of the warm-up step's
        layout could not be known there); what the warm-up step measured is dropped."""
        self.first_check = step
        self._clear_window()

    def _codec_cost(self, c: Candidate, unit: Any, device: torch.device) -> float | None:
        """This rank's codec seconds of candidate ``c`` for ``unit`` (a DDP unit: one pass over
        its elements; powersgd by its matrices); ``None``: ``c`` cannot run on this unit."""
        return codec_cost(c, unit.numel, device, unit.shapes if c.kind == "powersgd" else None,
                          reps=2 if unit.numel > (1 << 22) else 3, sample=CODEC_SAMPLE, storage=self.storage,
                          probes=self._probes)

    def _rounds_of(self, candidate: Candidate) -> int:
        """Collective rounds of one call of ``candidate`` (DDP: :func:`_rounds` on the flat group)."""
        return _rounds(candidate, self.world)

    def _unit_slots(self, codec: ErrorFeedback, key: Any, numel: int, owner: bool) -> list[tuple[Any, int, int]]:
        """Where ``codec`` keeps unit ``key``'s residuals (DDP: :func:`_slots`)."""
        return _slots(codec, key, numel, self.world, self.rank, owner)

    def _names(self, units: list[Any]) -> list[str]:
        """The report's name of each unit: the DDP bucket that completes it (``"b/u"`` when a
        bucket completes several)."""
        buckets = [self._unit_bucket.get(u.key, -1) for u in units]
        return [str(b) if buckets.count(b) == 1 else f"{b}/{i}" for i, b in enumerate(buckets)]

    def _with_round_cost(self, m: Measurements, units: list[Any]) -> Measurements:
        """``m`` with each candidate's per-call seconds (``BucketMeasure.call_s``) set to
        ``round_s`` per collective round (the two-level path two rounds more: ``BucketMeasure.round_s``;
        not divided among the shards as its codec seconds are).

        ``round_s``: what the units' calls took beyond their prediction in the last window
        (codec + α-β collective of the choice in force; the agreed call seconds are the
        minimum over ranks), per round of those choices.  It holds what the bind-time α-β
        model does not: Python and framework time per call, and the wait at each round for
        the slower rank (:meth:`_per_round`).  Where a unit's dense call is priced by its bytes too
        (``dense_rates``, FSDP2), its dense candidate pays that rate per second of its predicted
        collective on top.  Pure on agreed numbers: the same on every rank.  A change by more
        than ``drift`` (relative) since the last decision re-decides.
        """
        rows = []   # (unit key, choice in force, seconds beyond the model, its collective's, rounds)
        for b, u in enumerate(units):
            meas = m.extra[b] if b < len(m.extra) else 0.0
            if meas <= 0.0:
                continue
            choice = self.choices.get(u.key, DENSE)
            bucket = m.buckets[b]
            comm = comm_seconds(choice, bucket, m.network)
            rows.append((u.key, choice, meas - codec_seconds(choice, bucket, m.network) - comm, comm,
                         self._rounds_of(choice.candidate) + (2 if choice.path == "two_level" else 0)))
        if rows:
            self.round_s = self._per_round(rows)
        watched = self._round_s_decided
        if watched is not None and abs(self.round_s - watched) > self.spec.decider_args["drift"] * max(watched, 1e-4):
            self.decider.watched = None   # the per-round cost moved: re-decide now
        buckets = []
        for b, u in zip(m.buckets, units, strict=True):   # one measure per unit (check())
            call = {c: self.round_s * self._rounds_of(c) for c in (*b.codec_s, DENSE.candidate)}
            rate = self.dense_rates.get(u.key, 0.0)
            if rate:
                call[DENSE.candidate] += rate * comm_seconds(DENSE, b, m.network)
            buckets.append(dataclasses.replace(b, call_s=call, round_s=self.round_s))
        return dataclasses.replace(m, buckets=tuple(buckets))

    def _per_round(self, rows: list[tuple[Any, Choice, float, float, int]]) -> float:
        """The per-round cost from a window's ``rows`` (:meth:`_with_round_cost`): the excess over
        all of them, per round (DDP: the dense all_reduce is the collective the model was calibrated
        on, so what it took beyond it is per call, as for the other kinds)."""
        return max(0.0, sum(e for _, _, e, _, _ in rows)) / sum(r for *_, r in rows)

    def _window_compute(self) -> float:
        """The window's compute seconds per step: the median of its timed steps (a step that also
        evaluated, saved a checkpoint or was preempted is not the model's compute)."""
        return statistics.median(self._compute) if self._compute else 0.0

    def _read_norms(self, units: list[Any]) -> list[float | None]:
        """Each unit's gradient norm per step over the window (the check point's one host read);
        ``None`` for a unit with no step in it (all-dense steps run DDP's own all_reduce): windows
        differ in length (the first after the dense warm-up, a unit dense for a while), and
        comparing their sums read a spurious critical regime."""
        accs = [self._norms.get(u.key) if self._norm_steps.get(u.key) else None for u in units]
        present = [a for a in accs if a is not None]
        if not present:
            return [None] * len(units)
        values = iter(torch.stack([a.float() for a in present]).cpu().tolist())
        return [next(values) / self._norm_steps[u.key] if a is not None else None for u, a in zip(units, accs)]

    def _path_slots(self, codec: ErrorFeedback, key: Any, numel: int, path: str,
                    owner: bool) -> list[tuple[Any, int, int]]:
        """Where ``codec`` keeps unit ``key``'s residuals on ``path`` (flat: :meth:`_unit_slots`;
        two-level: this rank's shard, :func:`_two_level_slots`)."""
        if path != "two_level":
            return self._unit_slots(codec, key, numel, owner)
        shapes = next((u.shapes for u in self._units if u.key == key), None)
        return _two_level_slots(codec, key, numel, self.hierarchy, shapes, owner)

    def switch(self, key: Any, numel: int, choice: Choice) -> None:
        """Give unit ``key`` the codec of ``choice``; what error feedback owes moves with it.

        Within a path, every residual and velocity slot of the old codec goes to the same
        place in the new one, bitwise (chunk by chunk for the two-phase kinds; the owner's
        residual of its chunk is added to this rank's part of that chunk; on the two-level
        path the shard this rank owns, ``("shard", key, j)``).  From the two-level path to the
        flat one the shard's residual (this rank's share of its node's sum) lands at its offset
        of this rank's flat residual, bitwise too.  What the new codec has no slot for on this
        rank (from the flat path to the two-level one: a flat residual covers the whole unit,
        a two-level one only this rank's shard; or two-level shard bounds that differ between
        the kinds) is kept as this unit's
        **carry** and added to its next input (after the ``1/P`` scaling, in the input's
        dtype), so the next step sends it once: the sum over ranks of residuals + carries
        is unchanged by the switch, bitwise; sending it rounds once (the fp32 add into the
        input).  A velocity cannot be carried that way: momentum correction keeps every
        unit on the flat path (``ValueError`` otherwise)."""
        old = self.codecs.get(key)
        old_path = self.choices.get(key, DENSE).path if old is not None else "flat"
        carry = Carry()
        held: list[tuple[int, int]] = []
        if old is not None:
            for k, off, n in self._path_slots(old, key, numel, old_path, owner=True):
                take_residual(old, k, numel, off, into=carry)
                held.append((off, n))
        new = self._build(choice)
        covered = torch.zeros(numel, dtype=torch.bool)   # host-side bookkeeping of the new slots
        ranges = []
        for k, off, n in self._path_slots(new, key, numel, choice.path, owner=False):
            covered[off:off + n] = True
            ranges.append((off, n))
            part = Carry(None if carry.residual is None else carry.residual[off:off + n],
                         None if carry.velocity is None else carry.velocity[off:off + n])
            if part.residual is not None or part.velocity is not None:
                fold_residual(part, new, k)
        if any(not bool(covered[off:off + n].all()) for off, n in held):
            if carry.velocity is not None:
                raise ValueError(f"auto: unit {key!r} cannot move its momentum-correction velocity from the "
                                 f"{old_path} path to the {choice.path} path")
            if carry.residual is not None:   # what the new codec has no slot for: the next input's
                rest = carry.residual.clone()
                for off, n in ranges:
                    rest[off:off + n] = 0.0
                prev = self._carry.get(key)
                self._carry[key] = rest if prev is None else prev.add_(rest)
        self.codecs[key] = new
        self.choices[key] = choice
        self._unmeasured.add(key)
        if choice == DENSE:
            self._fresh.add(key)

    def carried(self, key: Any) -> torch.Tensor | None:
        """What a path switch left for unit ``key``'s next input (this rank's share), or ``None``."""
        return self._carry.get(key)

    # -- the report: state.stats.as_dict()["auto"] --------------------------------
    def report(self) -> dict[str, dict[str, Any]]:
        """``{unit: {"choice", "predicted_ms", "measured_ms", "params", "switches"}}``: named by the
        DDP bucket that completes the unit (``"b/u"`` when a bucket completes several), or
        by the FSDP2 unit's module name (:meth:`_names`).  ``switches``: ``[[step, choice], ...]``,
        the check points that changed the unit's choice (the last :data:`SWITCHES_KEPT`; not
        checkpointed)."""
        units = self._units
        cur = self.decider.current
        out: dict[str, dict[str, Any]] = {}
        for i, (u, name) in enumerate(zip(units, self._names(units))):
            s, n, _ = self._meas.get(u.key, (0.0, 0, 0.0))
            meas = s / n if n else self._last_meas.get(u.key)
            pred = cur.predicted_s[i] if cur is not None and i < len(cur.predicted_s) else None
            out[name] = {"choice": describe(self.choices.get(u.key, DENSE)),
                         "predicted_ms": None if pred is None else 1e3 * pred,
                         "measured_ms": None if meas is None else 1e3 * meas,
                         "params": list(u.names),
                         "switches": [[st, describe(c)] for st, c in self.switches.get(u.key, [])]}
        return out

    def network_report(self) -> dict[str, Any]:
        """The flat link as calibrated at registration and as the last check point priced it
        (``"priced"``: scaled by :class:`~commpress.auto.decide.LinkTracker`, ``None`` before the first check
        point), in ms per message and MB/s, and the measured per-round cost beyond the model."""
        def link(mod: CostModel | None) -> dict[str, float] | None:
            if mod is None:
                return None
            return {"alpha_ms": 1e3 * mod.alpha, "mb_per_s": 1e-6 / mod.beta if mod.beta > 0 else math.inf}
        return {"calibrated": link(self.network.flat if self.network is not None else None),
                "priced": link(self.network.scaled(self.link.scale).flat
                               if self.network is not None and self.checks else None),
                "round_ms": 1e3 * self.round_s}

    # -- state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Each unit's choice (kind, param, path) and codec state (residuals, velocities, warm
        starts), the decider, the gradient-norm windows, the path switches' carries not sent
        yet (plain numbers, strings and tensors)."""
        keys = list(self.codecs)
        return {
            "keys": keys,
            "choices": [[self.choices[k].candidate.kind, self.choices[k].candidate.param,
                         self.choices[k].path] for k in keys],
            "codecs": [self.codecs[k].state_dict() for k in keys],
            "decider": self.decider.state_dict(),
            "prev_norms": self._prev_norms,
            "changes": self._changes,
            "norm_keys": list(self._norms),
            "norms": [t.clone() for t in self._norms.values()],
            "norm_steps": [self._norm_steps.get(k, 0) for k in self._norms],
            "fresh": [k for k in keys if k in self._fresh],
            "carry_keys": list(self._carry),
            "carry": [t.clone() for t in self._carry.values()],
            "link": self.link.state_dict(),
            "dense_rate_keys": list(self.dense_rates),
            "dense_rates": list(self.dense_rates.values()),
            "first_check": self.first_check,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        want = {"keys", "choices", "codecs", "decider", "prev_norms", "norm_keys", "norms", "fresh"}
        # absent in checkpoints from before the two-level path / link tracking / per-step norms
        extra = {"carry_keys", "carry", "link", "norm_steps", "dense_rate_keys", "dense_rates", "first_check",
                 "changes"}
        if not isinstance(state, dict) or not (want <= set(state) <= want | extra):
            raise ValueError(f"auto codec state must have keys {sorted(want | extra)}")
        codecs, choices = {}, {}
        for key, (kind, param, path), cs in zip(state["keys"], state["choices"], state["codecs"]):
            choice = Choice(Candidate(kind, param), path)
            codec = self._build(choice)
            codec.load_state_dict(cs)
            codecs[key], choices[key] = codec, choice
        self.decider.load_state_dict(state["decider"])
        self.codecs, self.choices = codecs, choices
        prev = state["prev_norms"]
        self._prev_norms = None if prev is None else [None if x is None else float(x) for x in prev]
        changes = state.get("changes")
        self._changes = None if changes is None else [float(x) for x in changes]
        self._norms = {k: t.float().clone() for k, t in zip(state["norm_keys"], state["norms"])}
        self._norm_steps = {k: int(n) for k, n in zip(state["norm_keys"], state.get("norm_steps", []))}
        self._fresh = set(state["fresh"])
        self._unmeasured = set(codecs)   # new codecs: their first calls hold one-time costs
        self._carry = {k: t.float().clone() for k, t in zip(state.get("carry_keys", []), state.get("carry", []))}
        self._carry_commit = _CarryCommit(self._carry)
        self._spent = set()
        self.link = LinkTracker(_link_drift(self.spec))
        if "link" in state:
            self.link.load_state_dict(state["link"])
        self.dense_rates = {k: float(r) for k, r in zip(state.get("dense_rate_keys", []), state.get("dense_rates", []))}
        if "first_check" in state:   # the check points' schedule of the run that saved it
            self.first_check = int(state["first_check"])
