"""``"auto"`` never trades convergence it cannot win back (issue 55 item 8), on synthetic measurements.

The issue's case: a 2.2M-parameter MLP in one bucket, 2 ranks at 100 Mbit/s, SGD momentum passed
as ``optimizer=`` (momentum correction in the hook).  At its first check point (step 1) ``"auto"``
chose powersgd rank 1 and kept it; under momentum correction that kind did not reach the target in
200 steps.  Deterministic: no timing, no process group.
"""

from __future__ import annotations

import math

import pytest

from commpress.auto import DEFAULT_CANDIDATES, BucketMeasure, Candidate, Decider, Measurements, Network, Prices
from commpress.auto.candidates import MC_EXCLUDED, under_momentum
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


def test_momentum_correction_leaves_powersgd_out_of_the_default_candidates():
    spec = AutoSpec()
    mc = AutoCodec(spec, momentum=0.9)
    assert not any(c.kind in MC_EXCLUDED for c in mc.candidates)
    assert set(mc.decider.candidates) == set(mc.candidates) < set(spec.candidates)
    assert mc.prices.momentum_correction and mc.decider.prices.momentum_correction
    plain = AutoCodec(spec, momentum=0.0)   # the optimizer keeps its momentum: every candidate
    assert plain.candidates == spec.candidates and not plain.prices.momentum_correction
    # candidates the user gave stay, priced for momentum correction
    given = AutoCodec(AutoSpec(candidates=[("dense", None), ("powersgd", 1)]), momentum=0.9)
    assert Candidate("powersgd", 1) in given.candidates
    assert given.prices.price(Candidate("powersgd", 1)) == pytest.approx(1.6 * Prices().price(Candidate("powersgd", 1)))
    assert under_momentum(DEFAULT_CANDIDATES, user=True) == DEFAULT_CANDIDATES


def test_under_momentum_correction_the_issue_case_does_not_take_powersgd():
    cands = under_momentum(DEFAULT_CANDIDATES, user=False)
    prices = Prices().with_momentum_correction()
    plan = first_plan(Decider(candidates=cands, prices=prices), 0.0)
    assert not plan.startswith("powersgd"), plan


def test_the_first_check_point_is_a_critical_regime():
    """No window before the first check point: its norm change reads ``critical``, so the first plan
    is chosen among the gentle candidates (no powersgd rank 1, no topk 1%), with or without momentum
    correction; the next check point measures the change."""
    assert first_window_change(0.5) >= 0.5
    gentle = set(critical_candidates(DEFAULT_CANDIDATES, Prices()))
    assert Candidate("powersgd", 1) not in gentle and Candidate("topk", 0.01) not in gentle
    dec = Decider()
    plan, switched = dec.update(1, issue_case(first_window_change(dec.critical)))
    assert switched and plan.choices[0].candidate in gentle, plan.describe()
    mc = Decider(candidates=under_momentum(DEFAULT_CANDIDATES, user=False), prices=Prices().with_momentum_correction())
    plan, _ = mc.update(1, issue_case(first_window_change(mc.critical)))
    assert plan.describe() == ["blockquant(bits=4)"]   # the issue's case: the near-lossless kind


def test_prices_under_momentum_correction_are_validated_and_kept():
    p = Prices()
    assert not p.momentum_correction
    assert p.with_momentum_correction().price(Candidate("topk", 0.01)) == p.price(Candidate("topk", 0.01))
    assert p.with_momentum_correction().price(Candidate("powersgd", 4)) == pytest.approx(1.7 * 1.6)
    with pytest.raises(ValueError, match="momentum_correction"):
        Prices(momentum_correction=1)
    with pytest.raises(ValueError, match="powersgd_mc_factor"):
        Prices(powersgd_mc_factor=-1.0)
