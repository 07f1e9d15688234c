"""The decision of ``"auto"``: one :class:`Choice` per bucket, a pure function of agreed measurements.

Inputs (:class:`Measurements`): the α-β model of each group (:class:`Network`),
and per bucket in hook arrival order (:class:`BucketMeasure`) its size, its
parameter shapes, the backward time still to run after its hook fires (the
window that can hide its communication), each candidate's codec seconds at
its size, and its gradient-norm change.  Every number must already be agreed
across ranks (:func:`commpress.auto.measure.agree`): then every rank computes
the same plan, with no exchange.

Predicted step time
-------------------
``T(plan) = compute_s + exposed(plan)``.  Buckets are taken in arrival order;
bucket ``b`` arrives ``hidden_b`` seconds before the backward pass ends (time 0);
its codec runs in the hook on the critical path (it delays every later arrival
and the backward end: conservative, decode included), then its collective
queues behind the previous one on the one communication channel::

    shift += codec_b;  start_b = max(shift - hidden_b, finish_{b-1});  finish_b = start_b + comm_b
    exposed = max(shift, finish_last)

With ``Measurements.codec_inline=False`` (DDP's overlap thread compresses, sends and
decodes each bucket in turn) the codec is queued with its collective instead:
``finish_b = max(-hidden_b, finish_{b-1}) + codec_b + comm_b``.  The DDP hook uses it only where
the thread has a core of its own beside the backward (a CUDA model, or a CPU rank with spare
cores; agreed over the ranks at binding): on a CPU rank whose cores the backward fills, the
thread's codec takes them from the backward, so it is priced inline.

``comm_b`` is the collective's predicted seconds from the cost model of
:mod:`commpress.collectives.costmodel` (messages, bytes, entries and elements of
the kind's collective, :func:`commpress.collectives.hierarchy.predict_paths` for
flat against two-level).  A bucket that arrives early enough is hidden and
costs nothing dense; the last bucket, which nothing hides, is exposed whole.

Convergence price
-----------------
Each candidate has a prior ``price(c) >= 1``: the steps to reach a target
relative to dense (:class:`Prices`).  A plan's price weighs each bucket by its
share of the gradient's elements: ``Π(plan) = 1 + Σ_b (n_b / N) (price(c_b) - 1)``.

Objective: **minimise** ``J(plan) = T(plan) × Π(plan)``, the predicted time to
reach a target.  Since dense has price 1 and is always a candidate, a plan
is only chosen when ``J <= J(all dense)``, so its predicted step is never slower
than not compressing.

Critical regimes (Accordion, Agarwal et al. 2021): a bucket whose gradient
norm changed by a fraction ``>= critical`` over the last window may only use
dense, bf16, the least aggressive member of each family, and the candidates whose
prior price is at most ``Prices.critical_max`` (:func:`critical_candidates`: a kind
priced as near-lossless is not an aggressive one).

Search: coordinate descent (one bucket at a time, best option given the others,
until no bucket moves) from the all-dense plan and from the three uniform plans
(one option for every bucket) of lowest ``J``; the lowest ``J`` wins; ties go to the earlier start and option (dense first).
Python floats only, a fixed order: bitwise the same plan for the same inputs.

Hysteresis (:class:`Decider`): the plan in use is replaced only when the new
one's ``J`` is lower by more than ``margin × J(current)`` (the first plan, from all
dense, by more than :data:`FIRST_MARGIN`; one predicted to gain less than
:data:`CONFIDENT_GAIN` waits for a check point that has measured the all-dense step, so that
its outcome can be judged).  It is
re-evaluated ``every`` steps, or sooner when the agreed bandwidth, latency or
overlap moved by more than ``drift`` (relative) since the last decision.

Outcomes, not only predictions (:meth:`Decider.update` with ``measured_s``): a switch is on
probation until the next check point, which compares the *measured* step of the new plan
(its window's median wall time, agreed) times its price with the plan's before it.  A new
plan that measures worse by more than ``revert`` is undone and barred (vetoed) until ``every``
steps have passed or the network drifted: a model that mispriced the switch (a
loaded machine, a link that behaves unlike its calibration) costs one short window, not a
whole period.  A moved overlap does not lift a veto: the overlap is measured under the plan in
use (on a CPU rank its codec shares the cores with the backward pass, and a bucket's hidden
window grows with it), so the restored plan's window reads another overlap than the vetoed
one's by construction, and lifting on it brought the vetoed plan back at the next check point.
``revert`` (20%) is set for a shared, noisy machine; where both windows' own
steps were quiet (:func:`window_tolerance`, agreed) the limit is their difference's 95%
half-width instead, down to :data:`REVERT_FLOOR` (5%): on a GPU cluster, whose steps vary by a
percent, a switch that measured 8% worse is undone.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch

from ..collectives.costmodel import CostModel
from ..collectives.hierarchy import payload_bytes, kind_terms, predict_paths
from ..collectives.sparse import WHOLE_CODEC, whole_choice, whole_per_chunk
from .candidates import DEFAULT_CANDIDATES, Candidate, Choice, describe, gentlest, prototype


# ---------------------------------------------------------------- inputs
#: what a bucket's (unit's) call runs: DDP's all-reduce or FSDP2's gradient reduce-scatter
COLLECTIVES = ("allreduce", "reduce_scatter")


@dataclass(frozen=True)
class Network:
    """The α-β(-γ-δ) models of the group: ``flat`` for the whole group of ``world`` ranks;
    with ``local_size`` ranks per node (``1 < local_size < world``) also ``intra`` (inside a
    node) and ``inter`` (between nodes), and the two-level path is a candidate path.

    ``collective``: what a bucket's call runs: ``"allreduce"`` (DDP: the kind's all-reduce,
    :func:`commpress.collectives.hierarchy.kind_terms`) or ``"reduce_scatter"`` (FSDP2: a
    unit's gradient reduce-scatter, :func:`reduce_scatter_terms`; flat only)."""

    world: int
    flat: CostModel
    local_size: int = 1
    intra: CostModel | None = None
    inter: CostModel | None = None
    collective: str = "allreduce"

    def __post_init__(self) -> None:
        if isinstance(self.world, bool) or not isinstance(self.world, int) or self.world < 1:
            raise ValueError(f"Network: world must be an int >= 1, got {self.world!r}")
        L = self.local_size
        if isinstance(L, bool) or not isinstance(L, int) or L < 1 or self.world % L:
            raise ValueError(f"Network: local_size must be a positive int dividing world={self.world}, got {L!r}")
        if self.hierarchical and (self.intra is None or self.inter is None):
            raise ValueError("Network: local_size between 1 and world needs both intra and inter models")
        if self.collective not in COLLECTIVES:
            raise ValueError(f"Network: collective must be one of {COLLECTIVES}, got {self.collective!r}")
        if self.collective == "reduce_scatter" and self.hierarchical:
            raise ValueError("Network: the reduce-scatter (FSDP2) has no two-level path: local_size must be 1")

    @property
    def hierarchical(self) -> bool:
        return 1 < self.local_size < self.world

    def scaled(self, factor: float) -> "Network":
        """Every model's seconds per byte times ``factor`` (a slower or faster link: the
        runtime tracks the flat one with :class:`LinkTracker`)."""
        if not (isinstance(factor, (int, float)) and factor > 0 and math.isfinite(factor)):
            raise ValueError(f"Network.scaled: factor must be a finite number > 0, got {factor!r}")

        def sc(mod: CostModel | None) -> CostModel | None:
            return None if mod is None else CostModel(mod.alpha, mod.beta * factor, mod.gamma, mod.delta)

        return Network(self.world, sc(self.flat), self.local_size, sc(self.intra), sc(self.inter), self.collective)


@dataclass(frozen=True)
class BucketMeasure:
    """One bucket, agreed across ranks.

    ``hidden_s``: backward seconds still to run after the bucket's hook fires, with the
    hooks' own time taken out (min over ranks; 0 for the last bucket).  ``codec_s``:
    compress + decompress seconds of each candidate at ``numel`` (max over ranks; a
    candidate missing here is not considered for this bucket; dense may be missing: 0).
    ``norm_change``: relative change of the gradient norm over the last window (max
    over ranks; see :func:`commpress.auto.measure.norm_change`).  ``call_s``: seconds per
    call of each candidate that do not scale with the elements (the runtime's per-round
    cost, :meth:`commpress.auto.runtime.AutoCodec._with_round_cost`): added whole on either
    path; ``round_s``: the same per collective round, charged for the two-level path's two
    intra-node rounds.
    """

    name: str
    numel: int
    shapes: tuple[tuple[int, ...], ...] = ()
    hidden_s: float = 0.0
    codec_s: Mapping[Candidate, float] = field(default_factory=dict)
    norm_change: float = 0.0
    dtype: torch.dtype = torch.float32
    call_s: Mapping[Candidate, float] = field(default_factory=dict)
    round_s: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.numel, bool) or not isinstance(self.numel, int) or self.numel < 0:
            raise ValueError(f"BucketMeasure {self.name!r}: numel must be an int >= 0, got {self.numel!r}")
        for what, v in (("hidden_s", self.hidden_s), ("norm_change", self.norm_change),
                        *((f"codec_s[{describe(c)}]", t) for c, t in self.codec_s.items())):
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"BucketMeasure {self.name!r}: {what} must be a finite number >= 0, got {v!r}")


@dataclass(frozen=True)
class Measurements:
    """Everything the decision reads: ``buckets`` in hook arrival order, the ``network``,
    and ``compute_s``, the step's seconds without communication (forward, backward,
    optimizer; max over ranks).  ``codec_inline``: the codec runs in the hook on the
    backward's thread (True), or on the communication thread before its collective
    (False: DDP's ``overlap=True`` executor); see :func:`exposed_seconds`."""

    network: Network
    buckets: tuple[BucketMeasure, ...]
    compute_s: float
    codec_inline: bool = True
    #: further agreed numbers a caller packed into the same collective (see ``agree_measurements``)
    extra: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.codec_inline, bool):
            raise ValueError(f"Measurements: codec_inline must be a bool, got {self.codec_inline!r}")
        if not (isinstance(self.compute_s, (int, float)) and self.compute_s >= 0 and math.isfinite(self.compute_s)):
            raise ValueError(f"Measurements: compute_s must be a finite number >= 0, got {self.compute_s!r}")


# ---------------------------------------------------------------- convergence price
@dataclass(frozen=True)
class Prices:
    """Prior steps-to-target of each kind relative to dense (>= 1: a conservative prior).

    Where the numbers come from (step counts to the target = time to target / median step,
    2 or 4 ranks, README and docs/results):

    * bf16: 1.00. LM at 100 Mbit/s, PyTorch fp16 reaches the target in the same number of
      steps as DDP (docs/results/sweep-100mbit.md: 28.6 s / 958 ms against 55.6 s / 1858 ms).
    * blockquant: 8 bits 1.03, 4 bits 1.05.  With error feedback the demos' 4-bit runs reach the
      target at DDP's step on digits (63 of 63 and 93 of 93, every seed of the demos of 2026-12-02
      and 12-03) and at step 108 against 104 on the LM (1.04; docs/results/demo/summary.md); an older
      100 Mbit/s sweep's LM needed 36 steps against 30 (1.19) (the prior was 1.10 until those
      demos); 8 bits loses about half as much.
    * topk: ``topk_base + topk_per_decade * log10(0.1 / ratio)``: 1.5 at 10 %, 2.5 at 1 %.
      At 1 % the 100 Mbit/s sweep's digits need 1.7x DDP's steps and its LM 4.4x; at 10 %
      the loopback digits need 0.9x, and the loopback LM misses the target at every ratio
      (docs/results/sweep.md).  Between the two tasks, leaning to the worse.
    * powersgd: ``powersgd_base + powersgd_per_halving * log2(4 / rank)``: 1.7 at rank 4,
      1.9 at rank 2, 2.1 at rank 1.  Rank 4 needs 1.1x (digits) and 1.7x (LM) DDP's steps at
      100 Mbit/s; the demo's LM rank 2 about 1.9x; PyTorch's rank 1 hook 1.2x (digits) and
      1.7x (LM) in the demo, and its loopback LM misses the target.

    ``critical_max`` (1.05) is not a price but a bound on them: in Accordion's critical regime
    (the gradient norm moving fast) a bucket keeps the gentlest member of each family and any
    candidate priced at most this (:func:`critical_candidates`).  blockquant 4-bit is one: the demos'
    runs reached the digits target at DDP's step with 4 bits from step 0, through the early steps
    whose norm moves most; gating it there had "auto" alternate between 4 and 8 bits on digits (the
    last layer's norm rose 84% in 20 steps, then fell) for no steps saved.

    * under momentum correction (the hook took over the optimizer's SGD momentum, ``optimizer=``) the
      velocity ``u = m u + g`` is what the low-rank kind approximates, and each halving of the rank
      below 4 costs ``powersgd_mc_per_halving`` (1.0) more: 1.7 at rank 4, 2.9 at 2, 4.1 at 1.  On the
      2.2M-parameter digits MLP at 100 Mbit/s (2 ranks, seed 0; docs/results/auto.md) rank 1 reached
      the target at 2.4x DDP's steps under momentum correction against 1.2x with the optimizer's own
      momentum (issue 55: at rank 1 in one bucket it did not reach it in 200 steps), while rank 4 on
      the large layer under momentum correction reached it at 1.2x.

    They are priors, not measurements of the user's model: override any field.
    ``momentum_correction``: the run applies the momentum in the hook (set by the runtime,
    :meth:`with_momentum_correction`).
    """

    bf16: float = 1.0
    blockquant8: float = 1.03
    blockquant4: float = 1.05
    blockquant2: float = 1.4
    topk_base: float = 1.5
    topk_per_decade: float = 1.0
    powersgd_base: float = 1.7
    powersgd_per_halving: float = 0.2
    #: in a critical regime, a candidate priced at most this stays allowed (:func:`critical_candidates`)
    critical_max: float = 1.05
    #: under momentum correction, powersgd's price per halving of the rank below 4, on top
    powersgd_mc_per_halving: float = 1.0
    momentum_correction: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.momentum_correction, bool):
            raise ValueError(f"Prices: momentum_correction must be a bool, got {self.momentum_correction!r}")
        for name in self.__dataclass_fields__:
            if name == "momentum_correction":
                continue
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"Prices: {name} must be a finite number >= 0, got {v!r}")

    def price(self, c: Candidate) -> float:
        """The candidate's price, never below 1 (dense is 1)."""
        if c.kind == "dense":
            p = 1.0
        elif c.kind == "bf16":
            p = self.bf16
        elif c.kind == "blockquant":
            p = {8: self.blockquant8, 4: self.blockquant4, 2: self.blockquant2}[int(c.param)]
        elif c.kind == "topk":
            p = self.topk_base + self.topk_per_decade * math.log10(0.1 / c.param)
        else:
            halvings = math.log2(4.0 / c.param)
            p = self.powersgd_base + self.powersgd_per_halving * halvings
            if self.momentum_correction:
                p += self.powersgd_mc_per_halving * max(0.0, halvings)
        return max(1.0, p)

    def with_momentum_correction(self) -> "Prices":
        """These prices for a run whose hook applies the momentum (``optimizer=`` taken over)."""
        return replace(self, momentum_correction=True)


def critical_candidates(candidates: tuple[Candidate, ...] | list[Candidate], prices: Prices) -> tuple[Candidate, ...]:
    """The candidates a bucket in a critical regime may use (order kept): dense, bf16, the least
    aggressive member of each family (:func:`~commpress.auto.candidates.gentlest`), and any
    candidate whose prior price is at most ``prices.critical_max``."""
    gentle = set(gentlest(candidates))
    return tuple(c for c in candidates if c in gentle or prices.price(c) <= prices.critical_max)


# ---------------------------------------------------------------- prediction
def reduce_scatter_terms(compressor: Any, numel: int, P: int, dtype: torch.dtype = torch.float32
                         ) -> tuple[float, float, float, float]:
    """(messages, bytes, entries, elements) of FSDP2's gradient reduce-scatter of ``numel``
    (``P·m``) elements through commpress (:mod:`commpress.hooks.fsdp`'s module doc):

    * identity (dense): FSDP2's own ``reduce_scatter``, ``m·itemsize·(P−1)`` bytes;
    * every other kind: one ``all_to_all`` of each chunk's fixed-size payload of ``m``
      elements behind the 8-byte status word, ``(P−1)·(8 + payload)`` bytes; the owner
      decodes and sums the ``P`` pieces (sparse kinds: ``P·capacity(m)`` entries, the
      capacity at the final density: a density warm-up sends more in its first steps; a
      chunk whose selection would be no smaller than it in 4 bits goes whole in 4 bits,
      as the runtime's error feedback sends it: :func:`~commpress.collectives.sparse.whole_per_chunk`).

    One round either way (the validation round of a unit's first call is not counted)."""
    if P <= 1 or numel == 0:
        return 0.0, 0.0, 0.0, float(numel)
    m = -(-numel // P)
    if compressor.name == "identity":
        return float(P - 1), float((P - 1) * m * torch.empty((), dtype=dtype).element_size()), 0.0, float(numel)
    if compressor.aggregation == "sparse" and whole_per_chunk(compressor, m, None, dtype):
        payload, entries = payload_bytes(WHOLE_CODEC, m, dtype), 0   # each chunk whole, in 4 bits
    elif compressor.aggregation == "sparse":   # int32 indices and values, each 8-aligned, at the final density
        c = compressor.capacity(m)
        item = torch.empty((), dtype=dtype).element_size()
        payload, entries = 8 * (-(-4 * c // 8)) + 8 * (-(-c * item // 8)), P * c
    else:
        payload, entries = payload_bytes(compressor, m, dtype), 0
    return float(P - 1), float((P - 1) * (8 + payload)), float(entries), float(numel)


def comm_seconds(choice: Choice, bucket: BucketMeasure, network: Network) -> float:
    """Predicted seconds of the bucket's collective for ``choice`` (the cost model's terms)."""
    c, n = choice.candidate, bucket.numel
    if network.world <= 1 or n == 0:
        return 0.0
    proto = prototype(c)
    if network.collective == "reduce_scatter":
        if choice.path != "flat" or proto.aggregation == "lowrank":
            raise ValueError(f"comm_seconds: FSDP2's reduce-scatter cannot run {describe(choice)}")
        return network.flat.time(*reduce_scatter_terms(proto, n, network.world, bucket.dtype))
    shapes = [tuple(s) for s in bucket.shapes] if c.kind == "powersgd" and bucket.shapes else None
    shape = None if shapes is not None else (n,)
    if network.hierarchical:
        paths = predict_paths(n, proto, network.world, network.local_size, network.intra, network.inter,
                              bucket.dtype, shape, shapes)
        return paths[choice.path]
    if choice.path != "flat":
        raise ValueError(f"comm_seconds: path {choice.path!r} needs a hierarchical network")
    return network.flat.time(*flat_terms(proto, n, network.world, bucket.dtype, shape, shapes))


def flat_terms(compressor: Any, numel: int, P: int, dtype: torch.dtype = torch.float32, shape=None,
               shapes=None) -> tuple[float, float, float, float]:
    """(messages, bytes, entries, elements) of the flat all-reduce of ``numel`` as ``"auto"`` runs
    it: :func:`~commpress.collectives.hierarchy.kind_terms`, except for a sparse kind whose
    selection (at its final density) would not be the smallest message: under the runtime's
    error feedback it sends the whole tensor instead (:func:`~commpress.collectives.sparse.whole_choice`),
    in 4 bits (one all-gather, P pieces decoded) or, at large P, in a bf16 ring all-reduce."""
    if P > 1 and numel and compressor.aggregation == "sparse":
        send = whole_choice(torch.empty(numel, dtype=dtype, device="meta"), compressor, None, P)
        if send == "blockquant":
            return P - 1, payload_bytes(WHOLE_CODEC, numel, dtype) * (P - 1), 0, numel + (P - 1) * numel
        if send == "bf16":
            return kind_terms(prototype(Candidate("bf16")), numel, P, dtype, shape, shapes)
    return kind_terms(compressor, numel, P, dtype, shape, shapes)


def link_seconds(choice: Choice, bucket: BucketMeasure, network: Network) -> float:
    """The part of :func:`comm_seconds` spent inside the collectives, what the hooks measure
    (``CommStats.comm_seconds``): latency and bytes (α, β) only; the local work the cost model
    also charges (γ per sparse entry, δ per dense element) runs outside them.  Flat path."""
    f = network.flat
    return comm_seconds(choice, bucket, replace(network, flat=CostModel(f.alpha, f.beta, 0.0, 0.0)))


#: Collective rounds of one call, by aggregation kind (:func:`kind_rounds`).
KIND_ROUNDS = {"sum": 1, "sparse": 1, "gather": 2, "lowrank": 2}


def kind_rounds(kind: str, world: int) -> int:
    """Collective rounds of one call of a compressor of aggregation ``kind`` on ``world`` ranks
    (flat): PowerSGD (``lowrank``) 2, the quantized kind (``gather``) 2 (two-phase) except at
    ``world <= 2``, where it runs one ``all_gather`` (what the cost model always takes there),
    the others 1.  What a per-round cost (``BucketMeasure.round_s``) is charged by: the runtime's
    ``call_s`` and :func:`commpress.advise.advise`'s ``round_ms``."""
    if kind not in KIND_ROUNDS:
        raise ValueError(f"kind_rounds: kind must be one of {tuple(KIND_ROUNDS)}, got {kind!r}")
    if kind == "gather" and world <= 2:
        return 1
    return KIND_ROUNDS[kind]


def codec_seconds(choice: Choice, bucket: BucketMeasure, network: Network) -> float:
    """The measured codec seconds; on the two-level path a rank codes one shard (``1/L``).
    Plus the per-call seconds ``call_s`` (and on the two-level path its two intra-node rounds
    at ``round_s``), which do not shrink with the shard."""
    t = bucket.codec_s.get(choice.candidate, 0.0)
    fixed = bucket.call_s.get(choice.candidate, 0.0)
    if choice.path == "two_level":
        return t / network.local_size + fixed + 2 * bucket.round_s
    return t + fixed


def exposed_seconds(hidden: list[float], codec: list[float], comm: list[float], inline: bool = True) -> float:
    """The pipeline of the module doc: seconds the step waits beyond the backward pass.

    ``inline=False``: the codec runs on the communication thread, queued with its collective
    (``start_b = max(-hidden_b, finish_{b-1})``, ``finish_b = start_b + codec_b + comm_b``) and
    the backward pass is not delayed."""
    shift, finish = 0.0, -math.inf
    for h, k, m in zip(hidden, codec, comm):
        if inline:
            shift += k
            finish = max(shift - h, finish) + m
        else:
            finish = max(-h, finish) + k + m
    return max(shift, finish, 0.0)


@dataclass(frozen=True)
class Decision:
    """A plan and its predictions: ``choices[b]`` for bucket ``b``; ``predicted_s[b]`` is its
    codec + collective seconds; ``step_s`` = ``T``, ``price`` = ``Π``, ``objective`` = ``J``."""

    choices: tuple[Choice, ...]
    predicted_s: tuple[float, ...]
    step_s: float
    price: float
    objective: float

    def describe(self) -> list[str]:
        return [describe(c) for c in self.choices]


class _Problem:
    """Per-bucket option tables and ``J`` of a plan (an index per bucket)."""

    def __init__(self, m: Measurements, candidates: tuple[Candidate, ...], prices: Prices, critical: float):
        net = m.network
        paths = ("flat", "two_level") if net.hierarchical else ("flat",)
        self.m = m
        self.hidden = [b.hidden_s for b in m.buckets]
        total = sum(b.numel for b in m.buckets) or 1
        self.options: list[list[Choice]] = []
        self.codec: list[list[float]] = []
        self.comm: list[list[float]] = []
        self.dprice: list[list[float]] = []
        for b in m.buckets:
            allowed = critical_candidates(candidates, prices) if b.norm_change >= critical else candidates
            # dense first (flat at index 0: the all-dense start), whether or not it was offered
            opts = [Choice(Candidate("dense"), p) for p in paths]
            opts += [Choice(c, p) for c in allowed if c.kind != "dense" and c in b.codec_s for p in paths]
            self.options.append(opts)
            self.codec.append([codec_seconds(o, b, net) for o in opts])
            self.comm.append([comm_seconds(o, b, net) for o in opts])
            self.dprice.append([(b.numel / total) * (prices.price(o.candidate) - 1.0) for o in opts])

    def index(self, b: int, choice: Choice) -> int | None:
        try:
            return self.options[b].index(choice)
        except ValueError:
            return None

    def parts(self, plan: list[int]) -> tuple[float, float]:
        """``(T, Π)`` of ``plan``: :func:`exposed_seconds` inlined (called in the search loop)."""
        shift, finish, price = 0.0, -math.inf, 1.0
        inline = self.m.codec_inline
        for b, i in enumerate(plan):
            k = self.codec[b][i]
            if inline:
                shift += k
                k = 0.0
            start = shift - self.hidden[b]
            finish = (start if start > finish else finish) + k + self.comm[b][i]
            price += self.dprice[b][i]
        return self.m.compute_s + max(shift, finish, 0.0), price

    def objective(self, plan: list[int]) -> float:
        step, price = self.parts(plan)
        return step * price

    def descend(self, plan: list[int]) -> list[int]:
        """Coordinate descent: move one bucket at a time to its best option (strictly lower
        ``J``; first option on ties) until no bucket moves (bounded passes)."""
        plan = list(plan)
        for _ in range(4 * len(plan) + 4):
            moved = False
            for b in range(len(plan)):
                keep = plan[b]
                best, best_j = keep, self.objective(plan)
                for i in range(len(self.options[b])):
                    if i != keep:
                        plan[b] = i
                        j = self.objective(plan)
                        if j < best_j:
                            best, best_j = i, j
                plan[b] = best
                moved = moved or best != keep
            if not moved:
                break
        return plan

    def decision(self, plan: list[int]) -> Decision:
        step, price = self.parts(plan)
        return Decision(tuple(self.options[b][i] for b, i in enumerate(plan)),
                        tuple(self.codec[b][i] + self.comm[b][i] for b, i in enumerate(plan)),
                        step, price, step * price)


_UNIFORM_STARTS = 3


def _best(p: _Problem) -> list[int]:
    dense = [0] * len(p.options)  # options are built dense first
    starts = [dense]
    kinds = []
    for opts in p.options:
        for o in opts:
            if o not in kinds:
                kinds.append(o)
    uniform = [[p.index(b, o) or 0 for b in range(len(p.options))] for o in kinds]  # dense where not offered
    ranked = sorted(range(len(uniform)), key=lambda k: (p.objective(uniform[k]), k))
    starts += [uniform[k] for k in ranked[:_UNIFORM_STARTS]]
    best, best_j = None, math.inf
    for s in starts:
        plan = p.descend(s)
        j = p.objective(plan)
        if j < best_j:
            best, best_j = plan, j
    return best


def decide(m: Measurements, *, candidates: tuple[Candidate, ...] = DEFAULT_CANDIDATES,
           prices: Prices | None = None, critical: float = 0.5, current: tuple[Choice, ...] | None = None,
           margin: float = 0.0) -> Decision:
    """The plan minimising ``J = T × Π`` for ``m`` (see the module doc); a pure function.

    With ``current`` (the plan in use), it is kept unless the best plan's ``J`` is lower by
    more than ``margin × J(current)``; a current choice no longer allowed (critical regime,
    candidate gone) is always replaced.
    """
    if not m.buckets:
        return Decision((), (), float(m.compute_s), 1.0, float(m.compute_s))
    if not (isinstance(margin, (int, float)) and 0 <= margin < 1):
        raise ValueError(f"decide: margin must be a number in [0, 1), got {margin!r}")
    if not (isinstance(critical, (int, float)) and critical > 0):
        raise ValueError(f"decide: critical must be a number > 0, got {critical!r}")
    cands = tuple(candidates)
    if not cands:
        raise ValueError("decide: candidates must not be empty")
    p = _Problem(m, cands, prices if prices is not None else Prices(), float(critical))
    best = _best(p)
    if current is not None:
        if len(current) != len(m.buckets):
            raise ValueError(f"decide: current has {len(current)} choices for {len(m.buckets)} buckets")
        cur = [p.index(b, c) for b, c in enumerate(current)]
        if all(i is not None for i in cur):
            if p.objective(cur) - p.objective(best) <= margin * p.objective(cur):
                return p.decision(cur)
    return p.decision(best)


# ---------------------------------------------------------------- the network, re-measured
class LinkTracker:
    """How much slower or faster the flat link has become since registration, from the seconds
    the buckets' collectives took (agreed across ranks), as a factor on the calibrated seconds
    per byte (:meth:`Network.scaled`).  DDP's all-reduce and FSDP2's reduce-scatter alike.

    Each check window gives ``ratio = Σ measured / Σ predicted`` over the buckets with a
    measurement, predicted by the model in use for the choice each ran (:func:`link_seconds`:
    the time inside the collectives, as measured).  The ratio is only
    compared between windows of the **same plan**: the first window of a plan is its reference
    (the absolute level is not trusted: the minimum over ranks misses what the first rank to
    arrive already sent, a shaper's burst passes small messages at line rate, so a compressed
    plan's messages and a dense plan's would read different links).  When two windows in a row
    moved the same way by more than ``drift`` from the reference, the link changed: the factor
    takes their geometric mean over the reference, and the decider, which watches the network's
    numbers (:func:`drifted`), re-decides.  One noisy window changes nothing.  Pure and
    deterministic on agreed numbers: the same on every rank; :meth:`state_dict` for a resume.
    """

    def __init__(self, drift: float = 0.25) -> None:
        if not (isinstance(drift, (int, float)) and drift > 0):
            raise ValueError(f"LinkTracker: drift must be a number > 0, got {drift!r}")
        self.drift = float(drift)
        self.scale = 1.0
        self.plan: tuple[str, ...] | None = None
        self.ref: float | None = None
        self.last: float | None = None

    def update(self, network: Network, plan: "list[Choice] | tuple[Choice, ...]",
               buckets: "tuple[BucketMeasure, ...]", comm_s: "list[float] | tuple[float, ...]") -> Network:
        """Feed one window (``plan``: the choice each bucket ran; ``comm_s``: its agreed seconds
        inside the collectives per call, 0 = not measured); returns ``network`` scaled by the
        factor (unchanged with a hierarchy: not tracked)."""
        if network.hierarchical or network.world <= 1:
            return network
        now = network.scaled(self.scale) if self.scale != 1.0 else network
        measured = predicted = 0.0
        for choice, b, t in zip(plan, buckets, comm_s):
            if t > 0 and math.isfinite(t) and b.numel > 0 and choice.path == "flat":
                measured += t
                predicted += link_seconds(choice, b, now)
        if measured <= 0 or predicted <= 0:
            return now
        ratio = measured / predicted
        key = tuple(describe(c) for c in plan)
        if key != self.plan or self.ref is None:   # a new plan: its first window is the reference
            self.plan, self.ref, self.last = key, ratio, None
            return now
        last, self.last = self.last, ratio
        ref, d = self.ref, self.drift
        if last is not None and all(abs(r / ref - 1.0) > d for r in (last, ratio)) and (last > ref) == (ratio > ref):
            self.scale *= math.sqrt(last * ratio) / ref   # the ratio against the rescaled model is the reference again
            self.last = None
            return network.scaled(self.scale)
        return now

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "plan": None if self.plan is None else list(self.plan),
                "ref": self.ref, "last": self.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or set(state) != {"scale", "plan", "ref", "last"}:
            raise ValueError("LinkTracker state must have keys ['last', 'plan', 'ref', 'scale']")
        self.scale = float(state["scale"])
        self.plan = None if state["plan"] is None else tuple(state["plan"])
        self.ref = None if state["ref"] is None else float(state["ref"])
        self.last = None if state["last"] is None else float(state["last"])


# ---------------------------------------------------------------- re-evaluation and hysteresis
@dataclass(frozen=True)
class Signature:
    """What re-evaluation watches: each model's latency and seconds per byte (``network``)
    and each bucket's hidden window as a fraction of the step's compute (``overlap``)."""

    network: tuple[float, ...]
    overlap: tuple[float, ...]


def signature(m: Measurements) -> Signature:
    net = m.network
    numbers = [net.flat.alpha, net.flat.beta]
    for mod in (net.intra, net.inter):
        if mod is not None:
            numbers += [mod.alpha, mod.beta]
    scale = m.compute_s if m.compute_s > 0 else 1.0
    return Signature(tuple(float(x) for x in numbers), tuple(float(b.hidden_s / scale) for b in m.buckets))


def drifted(old: Signature, new: Signature, fraction: float) -> bool:
    """True when a network number moved by more than ``fraction`` of itself, or a bucket's
    hidden window by more than ``fraction`` of the compute (or the layout changed)."""
    if len(old.network) != len(new.network) or len(old.overlap) != len(new.overlap):
        return True
    if any(abs(b - a) > fraction * abs(a) for a, b in zip(old.network, new.network)):
        return True
    return any(abs(b - a) > fraction for a, b in zip(old.overlap, new.overlap))


#: The margin of a :class:`Decider`'s first decision (the all-dense start to a plan), when larger than
#: its ``margin``.  The first decision is made before the runtime has measured any call's cost beyond
#: the α-β model, on the compute of the first, cold, compressed step: on loopback ranks sharing 2
#: cores it put dense and blockquant 4-bit 2–7% apart in four runs of four, and one overhead run kept
#: the compressing plan it started (1.39x DDP).  Where compressing pays, the gain is far larger
#: (digits at 1 Gbit/s: 55%), so the first plan still compresses; a closer call waits for the next
#: check point, which has the measured per-call cost.
FIRST_MARGIN = 0.15

#: The predicted gain over all dense (``1 - J(plan) / J(all dense)``) from which the first plan is
#: taken at the first check point even when no step of the all-dense start has been measured yet
#: (the first check point ends the first timed step: no window of two).  Below it, the first plan
#: waits for the next check point, which has the all-dense window's measured step: a switch is judged
#: by its outcome against the plan before it (``revert``), and without that step a first plan the
#: model mispriced (one overhead run on loopback kept a compressing plan at 1.39x DDP) would stand for
#: ``every`` steps.  Where compressing pays, the first plan gains more (digits at 1 Gbit/s: 55%) and
#: starts at once; a gain this small costs little while it waits (4 steps).
CONFIDENT_GAIN = 0.4

#: How much worse (relative) a new plan's measured ``step × price`` may be than the plan's before it
#: before the switch is undone (:meth:`Decider.update`).  Above the window-to-window noise of a shared
#: machine (its medians moved by up to 10–15% with nothing changed); below the misses it is there for:
#: a loaded run switched to bf16 measured 104 ms per call against 46 predicted, and a compressing plan
#: on loopback measured 1.39x DDP's step.
REVERT = 0.2

#: The lowest ``revert`` a quiet window lowers it to (:meth:`Decider.update`'s ``measured_tol``): the
#: windows of a GPU cluster's steps differ by a percent or two, and a plan measured 5% worse there
#: is worse; below this, window-to-window drift that a window's own spread does not show (a data
#: loader's pace, clocks) would undo sound switches.
REVERT_FLOOR = 0.05

#: Student's t at 97.5% by degrees of freedom (the interval of a window's measured step, from the
#: spread of its few steps: :func:`window_tolerance`); beyond the table ``1.96 + 2.4 / dof`` (2.04
#: at 30, 1.98 at 100: within 0.01 of the true values).
_T975 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13)


def window_tolerance(walls: list[float] | tuple[float, ...]) -> float:
    """The relative half-width of a 95% interval of a window's measured step (the median of its
    step walls): ``1.25 × t(n-1) × stdev / median / sqrt(n)`` (1.25: a median's standard error
    over a mean's, for normal steps); ``inf`` for fewer than three steps (not known).  Outliers
    widen it: a noisy window keeps the fixed ``revert``, a quiet one lowers it (:class:`Decider`)."""
    n = len(walls)
    if n < 3 or not all(math.isfinite(w) for w in walls):
        return math.inf
    med = statistics.median(walls)
    if not med > 0:
        return math.inf
    sd = statistics.stdev(walls)
    dof = n - 1
    t = _T975[dof - 1] if dof <= len(_T975) else 1.96 + 2.4 / dof
    return 1.25 * t * sd / med / math.sqrt(n)


class Decider:
    """The plan in use, with hysteresis and a re-evaluation schedule (same on every rank).

    Feed it agreed :class:`Measurements` with :meth:`update` at check points; it re-decides
    when ``every`` steps passed since the last decision, when :func:`drifted` by more than
    ``drift``, or at the first call; a new plan replaces the current one only when it is
    predicted better by more than ``margin`` (relative ``J``; the first decision, from all dense,
    by more than :data:`FIRST_MARGIN` when that is larger, and without a measured step of the
    all-dense start by at least :data:`CONFIDENT_GAIN`, else it waits for the next check point:
    :attr:`decided_at` stays ``None``).  Everything it keeps is in
    :meth:`state_dict` (Python numbers and strings: a resume decides bitwise alike).
    """

    def __init__(self, *, candidates: tuple[Candidate, ...] = DEFAULT_CANDIDATES, prices: Prices | None = None,
                 margin: float = 0.05, every: int = 1000, drift: float = 0.25, critical: float = 0.5,
                 revert: float = REVERT) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Decider: every must be an int >= 1, got {every!r}")
        if not (isinstance(drift, (int, float)) and drift > 0):
            raise ValueError(f"Decider: drift must be a number > 0, got {drift!r}")
        if not (isinstance(margin, (int, float)) and 0 <= margin < 1):
            raise ValueError(f"Decider: margin must be a number in [0, 1), got {margin!r}")
        if isinstance(revert, bool) or not (isinstance(revert, (int, float)) and revert >= 0
                                            and math.isfinite(revert)):
            raise ValueError(f"Decider: revert must be a finite number >= 0, got {revert!r}")
        self.candidates = tuple(candidates)
        self.prices = prices if prices is not None else Prices()
        self.margin, self.every, self.drift, self.critical = float(margin), every, float(drift), float(critical)
        self.revert = float(revert)
        self.current: Decision | None = None
        self.decided_at: int | None = None
        self.watched: Signature | None = None
        #: the switch on probation: the plan before it, that plan's measured step (seconds) and its
        #: tolerance (:func:`window_tolerance`; ``inf``: not known), and the check point that made it
        #: (``None`` when no switch waits for its outcome)
        self.previous: Decision | None = None
        self.previous_s: float = 0.0
        self.previous_tol: float = math.inf
        self.switched_at: int | None = None
        #: plans undone by their outcome: ``describe`` tuple -> (step, the signature then)
        self.vetoed: dict[tuple[str, ...], tuple[int, Signature]] = {}
        #: the last revert: ``(step, measured s of the undone plan, measured s of the plan restored)``
        self.last_revert: tuple[int, float, float] | None = None
        #: the relative limit that undid it (:meth:`revert_limit`)
        self.last_revert_limit: float | None = None

    def due(self, step: int, m: Measurements) -> bool:
        """Whether :meth:`update` at ``step`` with ``m`` re-decides."""
        if self.current is None or self.decided_at is None or self.watched is None:
            return True
        if step - self.decided_at >= self.every:
            return True
        return drifted(self.watched, signature(m), self.drift)

    @property
    def on_probation(self) -> bool:
        """Whether the last switch waits for its outcome (the next check point judges it)."""
        return self.switched_at is not None and self.previous is not None

    def revert_limit(self, tol_now: float, tol_before: float) -> float:
        """How much worse (relative) a switch may measure before it is undone: ``revert``, or less
        where both windows were quiet: the half-width of the two windows' difference
        (``hypot`` of their :func:`window_tolerance`; ``inf`` where one is not known), not below
        :data:`REVERT_FLOOR`."""
        return min(self.revert, max(REVERT_FLOOR, math.hypot(tol_now, tol_before)))

    def update(self, step: int, m: Measurements, measured_s: float = 0.0,
               measured_tol: float = math.inf) -> tuple[Decision, tuple[int, ...]]:
        """``(plan in use, indices of the buckets that switched)``; the plan is unchanged when
        not :meth:`due` or the predicted gain is within the margin.

        ``measured_s``: the measured (agreed) step seconds of the window that just ended, which ran
        the plan in use (0: not measured); ``measured_tol``: its agreed :func:`window_tolerance`
        (``inf``: not known).  A switch is judged by the window after it: when its measured
        ``step × price`` exceeds the previous plan's by more than :meth:`revert_limit` (relative),
        the previous plan comes back and the undone one is vetoed (see the module doc)."""
        measured_s = float(measured_s) if measured_s and math.isfinite(measured_s) and measured_s > 0 else 0.0
        measured_tol = float(measured_tol) if measured_s and measured_tol >= 0 else math.inf   # NaN: not known
        if self.on_probation:
            undone = self._judge(step, m, measured_s, measured_tol)
            if undone is not None:
                return undone
        if not self.due(step, m):
            return self.current, ()
        old = self.current.choices if self.current is not None else None
        if old is not None and len(old) != len(m.buckets):
            old = None
        # no plan decided yet (all dense, perhaps a first plan that waited), or a new layout
        first = old is None or self.decided_at is None
        dense = tuple(Choice(Candidate("dense")) for _ in m.buckets)
        new = decide(m, candidates=self.candidates, prices=self.prices, critical=self.critical,
                     current=old if old is not None else dense,
                     margin=max(self.margin, FIRST_MARGIN) if first else self.margin)
        if old is not None and self._barred(step, m, new.choices):
            new = self._kept(m, old)
        base = old if old is not None else dense
        switched = tuple(b for b, c in enumerate(new.choices) if c != base[b])
        if switched and self.current is None and measured_s <= 0.0:   # the very first decision
            start = self._kept(m, dense)
            if new.objective > (1.0 - CONFIDENT_GAIN) * start.objective:
                # a first plan of modest predicted gain, and no measured all-dense step to judge it
                # by: all dense until the next check point, which decides with that step measured
                self.current, self.decided_at, self.watched = start, None, None
                return start, ()
        if switched:   # on probation until the next check point (its window measures the new plan)
            before = self.current if old is not None else Decision(base, (0.0,) * len(base), 0.0, 1.0, 0.0)
            self.previous, self.previous_s, self.switched_at = before, measured_s, int(step)
            self.previous_tol = measured_tol
        self.current, self.decided_at, self.watched = new, int(step), signature(m)
        return new, switched

    def _judge(self, step: int, m: Measurements, measured_s: float,
               measured_tol: float) -> tuple[Decision, tuple[int, ...]] | None:
        """The outcome of the switch on probation: ``None`` when it stands (or cannot be judged:
        a window without a measured step, a layout that changed), else the restored plan and the
        buckets that switched back."""
        prev, before_s, before_tol = self.previous, self.previous_s, self.previous_tol
        self.previous, self.previous_s, self.previous_tol, self.switched_at = None, 0.0, math.inf, None
        cur = self.current
        if cur is None or prev is None or len(prev.choices) != len(cur.choices) or len(cur.choices) != len(m.buckets):
            return None
        if measured_s <= 0.0 or before_s <= 0.0:
            return None
        limit = self.revert_limit(measured_tol, before_tol)
        if measured_s * cur.price <= before_s * prev.price * (1.0 + limit):
            return None
        restored = self._kept(m, prev.choices)
        if restored.choices != prev.choices:   # a previous choice no longer allowed (critical regime)
            return None
        self.vetoed[tuple(describe(c) for c in cur.choices)] = (int(step), signature(m))
        self.last_revert = (int(step), measured_s, before_s)
        self.last_revert_limit = limit
        back = tuple(b for b, (c, p) in enumerate(zip(cur.choices, prev.choices)) if c != p)
        self.current, self.decided_at, self.watched = restored, int(step), signature(m)
        return restored, back

    def _kept(self, m: Measurements, choices: tuple[Choice, ...]) -> Decision:
        """``choices`` re-priced on ``m`` (a choice no longer allowed, in a critical regime, is replaced
        by the best plan's)."""
        return decide(m, candidates=self.candidates, prices=self.prices, critical=self.critical,
                      current=choices, margin=1.0 - 1e-12)

    def _barred(self, step: int, m: Measurements, choices: tuple[Choice, ...]) -> bool:
        """Whether ``choices`` is a plan vetoed by its outcome less than ``every`` steps ago, with
        the network within ``drift`` of what it was then (expired vetoes are dropped; the overlap
        is not compared: see the module doc)."""
        link = Signature(signature(m).network, ())
        for key, (at, sig) in list(self.vetoed.items()):
            if step - at >= self.every or drifted(Signature(sig.network, ()), link, self.drift):
                del self.vetoed[key]
        return tuple(describe(c) for c in choices) in self.vetoed

    # -- state -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "decided_at": self.decided_at,
            **_decision_state(self.current),
            "watched": _signature_state(self.watched),
            "probation": None if not self.on_probation else {
                "switched_at": self.switched_at, "previous_s": self.previous_s,
                "previous_tol": self.previous_tol, "previous": _decision_state(self.previous)},
            "vetoed": [[list(k), at, _signature_state(sig)] for k, (at, sig) in self.vetoed.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        keys = {"decided_at", "choices", "predicted_s", "step_s", "price", "watched"}
        optional = {"probation", "vetoed"}   # absent in checkpoints from before outcome checks
        if not isinstance(state, dict) or not (keys <= set(state) <= keys | optional):
            raise ValueError(f"Decider state must have keys {sorted(keys)} (and optionally {sorted(optional)})")
        self.current = _decision_from(state)
        self.decided_at = state["decided_at"]
        self.watched = _signature_from(state["watched"])
        probation = state.get("probation")
        self.previous = None if probation is None else _decision_from(probation["previous"])
        self.previous_s = 0.0 if probation is None else float(probation["previous_s"])
        # absent in checkpoints from before the windows' tolerance: the fixed revert
        self.previous_tol = math.inf if probation is None else float(probation.get("previous_tol", math.inf))
        self.switched_at = None if probation is None else int(probation["switched_at"])
        self.vetoed = {tuple(k): (int(at), _signature_from(sig)) for k, at, sig in state.get("vetoed", [])}


def _decision_state(d: Decision | None) -> dict[str, Any]:
    return {"choices": None if d is None else [[c.candidate.kind, c.candidate.param, c.path] for c in d.choices],
            "predicted_s": None if d is None else list(d.predicted_s),
            "step_s": None if d is None else d.step_s,
            "price": None if d is None else d.price}


def _decision_from(state: dict[str, Any]) -> Decision | None:
    if state["choices"] is None:
        return None
    choices = tuple(Choice(Candidate(k, p), path) for k, p, path in state["choices"])
    return Decision(choices, tuple(float(x) for x in state["predicted_s"]), float(state["step_s"]),
                    float(state["price"]), float(state["step_s"]) * float(state["price"]))


def _signature_state(sig: Signature | None) -> list[list[float]] | None:
    return None if sig is None else [list(sig.network), list(sig.overlap)]


def _signature_from(state: Any) -> Signature | None:
    return None if state is None else Signature(tuple(state[0]), tuple(state[1]))


def stats_record(names: list[str] | tuple[str, ...], decision: Decision,
                 measured_s: Mapping[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """The ``state.stats.as_dict()["auto"]`` entry: ``{bucket: {"choice": "topk(ratio=0.01)",
    "predicted_ms": codec + collective, "measured_ms": the hook's measured ms or None}}``."""
    if len(names) != len(decision.choices):
        raise ValueError(f"stats_record: {len(names)} names for {len(decision.choices)} choices")
    measured_s = measured_s or {}
    return {str(n): {"choice": describe(c), "predicted_ms": 1e3 * p,
                     "measured_ms": None if measured_s.get(n) is None else 1e3 * measured_s[n]}
            for n, c, p in zip(names, decision.choices, decision.predicted_s)}
