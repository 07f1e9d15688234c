"""``"auto"`` never trades convergence it cannot win back (issue 55 item 8), on synthetic measurements.

The issue's case: a 2.2M-parameter MLP in one bucket, 2 ranks at 100 Mbit/s, SGD momentum passed
as ``optimizer=`` (momentum correction in the hook).  At its first check point (step 1) ``"auto"``
chose powersgd rank 1 and kept it; under momentum correction that kind did not reach the target in
200 steps (2.4x DDP's steps on the same MLP in two buckets, docs/results/auto.md).  Deterministic: no
timing, no process group.
"""

from __future__ import annotations

import math

import pytest

from commpress.auto import DEFAULT_CANDIDATES, BucketMeasure, Candidate, Decider, Measurements, Network, Prices
from commpress.auto.decide import critical_candidates
from commpress.auto.runtime import AutoCodec, AutoSpec, first_window_change
from commpress.collectives import CostModel

HIDDEN = 1448
SHAPES = ((HIDDEN, 64), (HIDDEN,), (HIDDEN, HIDDEN), (HIDDEN,), (10, HIDDEN), (10,))
NUMEL = sum(math.prod(s) for s in SHAPES)
MBIT100 = CostModel(alpha=2e-4, beta=8e-8)
# codec seconds at NUMEL on a loaded CPU core (the order the issue's run measured)
CODEC = {Candidate("bf16"): 0.004, Candidate("blockquant", 8): 0.012, Candidate("blockquant", 4): 0.012,
         Candidate("topk", 0.1): 0.03, Candidate("topk", 0.01): 0.02, Candidate("powersgd", 4): 0.008,
         Candidate("powersgd", 1): 0.004}


@pytest.fixture(autouse=True)
def _torch_ops(monkeypatch):
    monkeypatch.setenv("COMMPRESS_BACKEND", "torch")   # payload probes without numba's JIT


def issue_case(change: float) -> Measurements:
    bucket = BucketMeasure("b0", NUMEL, SHAPES, 0.0, dict(CODEC), change)
    return Measurements(Network(2, MBIT100), (bucket,), 0.012)


def first_plan(decider: Decider, change: float) -> str:
    plan, _ = decider.update(1, issue_case(change))
    return plan.describe()[0]


def test_the_old_first_decision_took_powersgd_rank_1():
    """What the issue saw: without the first window counted as critical and with powersgd priced as
    without momentum correction, the first plan is the aggressive low-rank kind."""
    assert first_plan(Decider(), 0.0) == "powersgd(rank=1)"


def test_momentum_correction_prices_the_low_ranks_of_powersgd():
    """With the optimizer's momentum taken over, each halving of powersgd's rank below 4 costs 1.0
    more (rank 1: 4.1 against 2.1); rank 4 and the other kinds keep their prices."""
    spec = AutoSpec()
    mc = AutoCodec(spec, momentum=0.9)
    assert mc.prices.momentum_correction and mc.decider.prices.momentum_correction
    assert mc.candidates == spec.candidates
    plain = AutoCodec(spec, momentum=0.0)   # the optimizer keeps its momentum: the priors as they are
    assert not plain.prices.momentum_correction and plain.decider.prices == spec.prices
    p, q = Prices(), Prices().with_momentum_correction()
    assert q.price(Candidate("powersgd", 1)) == pytest.approx(p.price(Candidate("powersgd", 1)) + 2.0)
    assert q.price(Candidate("powersgd", 2)) == pytest.approx(p.price(Candidate("powersgd", 2)) + 1.0)
    assert q.price(Candidate("powersgd", 8)) == p.price(Candidate("powersgd", 8))
    for c in DEFAULT_CANDIDATES:
        if c.kind != "powersgd" or c.param >= 4:
            assert q.price(c) == p.price(c), c


def test_under_momentum_correction_the_issue_case_does_not_take_powersgd_rank_1():
    prices = Prices().with_momentum_correction()
    for change in (0.0, first_window_change(0.5)):   # a calm window, and the first check point
        plan = first_plan(Decider(prices=prices), change)
        assert plan != "powersgd(rank=1)", (change, plan)


def test_the_first_check_point_is_a_critical_regime():
    """No window before the first check point: its norm change reads ``critical``, so the first plan
    is chosen among the gentle candidates (no powersgd rank 1, no topk 1%), with or without momentum
    correction; the next check point measures the change."""
    assert first_window_change(0.5) >= 0.5
    gentle = set(critical_candidates(DEFAULT_CANDIDATES, Prices()))
    assert Candidate("powersgd", 1) not in gentle and Candidate("topk", 0.01) not in gentle
    for prices in (Prices(), Prices().with_momentum_correction()):
        dec = Decider(prices=prices)
        plan, switched = dec.update(1, issue_case(first_window_change(dec.critical)))
        assert switched and plan.choices[0].candidate in gentle, plan.describe()


def test_prices_under_momentum_correction_are_validated():
    p = Prices()
    assert not p.momentum_correction and p.with_momentum_correction().momentum_correction
    with pytest.raises(ValueError, match="momentum_correction"):
        Prices(momentum_correction=1)
    with pytest.raises(ValueError, match="powersgd_mc_per_halving"):
        Prices(powersgd_mc_per_halving=-1.0)


def test_the_runtime_reads_its_first_check_point_as_critical():
    """AutoCodec's first check point (no process group: its own numbers are the agreed ones) hands the
    decider a critical norm change: the plan is a gentle one although powersgd rank 1 and topk 1% are
    predicted faster; with a window before it, the measured change is used."""
    from types import SimpleNamespace

    auto = AutoCodec(AutoSpec())
    auto.network = Network(2, CostModel(alpha=2e-4, beta=8e-6))   # 1 Mbit/s: compressing pays a lot
    auto._units = [SimpleNamespace(key="u0", numel=1 << 16, shapes=((256, 256),), names=["w"])]
    auto.check(1, None)
    plan = auto.decider.current.choices[0].candidate
    assert plan.kind != "dense" and plan not in (Candidate("powersgd", 1), Candidate("topk", 0.01)), plan
    calm = Decider().update(1, _measures_of(auto, change=0.0))[0]   # the same unit, a calm window
    assert calm.choices[0].candidate in (Candidate("powersgd", 1), Candidate("topk", 0.01)), calm.describe()
    assert auto._prev_norms is not None                           # the next check point measures the change


def _measures_of(auto, change):
    """A measurement of ``auto``'s one unit with the norm change ``change`` and fixed codec costs (0.1 ms
    each: the choice must not follow this machine's load; at 1 Mbit/s the wire decides)."""
    u = auto._units[0]
    codec = {c: 0.0 if c.kind == "dense" else 1e-4 for c in auto.candidates}
    return Measurements(auto.network, (BucketMeasure(u.key, u.numel, u.shapes, 0.0, codec, change),), 0.0)
