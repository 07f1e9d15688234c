"""The pure decision of ``"auto"`` on synthetic measurements, one regime per test."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from commpress.auto import (DEFAULT_CANDIDATES, BucketMeasure, Candidate, Choice, Decider, Measurements, Network,
                            Prices, decide, describe, exposed_seconds, gentlest, stats_record)
from commpress.auto.decide import REVERT_FLOOR, comm_seconds, critical_candidates, window_tolerance
from commpress.collectives import CostModel

N = 1 << 18                       # 1 MB fp32 buckets
SHAPES = ((512, 512),)
# synthetic codec seconds per candidate at N elements (the order of a loaded 2-core CPU)
CODEC = {c: t / 4 for c, t in {
    Candidate("bf16"): 1e-3, Candidate("blockquant", 8): 4e-3, Candidate("blockquant", 4): 4e-3,
    Candidate("topk", 0.1): 8e-3, Candidate("topk", 0.01): 5e-3, Candidate("powersgd", 4): 6e-3,
    Candidate("powersgd", 1): 3e-3}.items()}
LOOPBACK = CostModel(alpha=5e-5, beta=5e-10)          # ~2 GB/s
GBIT = CostModel(alpha=1e-4, beta=8e-9)               # 1 Gbit/s
MBIT100 = CostModel(alpha=2e-4, beta=8e-8)            # 100 Mbit/s


@pytest.fixture(autouse=True)
def _torch_ops(monkeypatch):
    # the cost model probes payload sizes by compressing zeros: the reference ops give the
    # same bytes without the numba backend's JIT compilation
    monkeypatch.setenv("COMMPRESS_BACKEND", "torch")


def buckets(hidden, codec=CODEC, change=0.0, numel=N):
    return tuple(BucketMeasure(f"b{i}", numel, SHAPES, h, dict(codec), change) for i, h in enumerate(hidden))


def measures(model, hidden, compute=0.05, world=2, **kw):
    return Measurements(Network(world, model), buckets(hidden, **kw), compute)


def dense_step(m):
    return decide(m, candidates=(Candidate("dense"),)).step_s


def kinds(d):
    return [c.candidate.kind for c in d.choices]


def test_fast_network_stays_dense_or_bf16_and_never_slower():
    m = measures(LOOPBACK, [0.03, 0.02, 0.01, 0.0])
    d = decide(m)
    assert set(kinds(d)) <= {"dense", "bf16"}, d.describe()
    assert d.step_s <= dense_step(m) + 1e-15
    assert d.objective <= dense_step(m) + 1e-15
    queued = Measurements(m.network, m.buckets, m.compute_s, codec_inline=False)
    assert decide(queued).step_s <= dense_step(queued) + 1e-15


def test_slow_network_compresses_aggressively():
    m = measures(MBIT100, [0.003, 0.002, 0.001, 0.0])   # almost nothing hidden
    d = decide(m)
    assert not set(kinds(d)) & {"dense", "bf16"}, d.describe()
    dense = Choice(Candidate("dense"))
    for c, b in zip(d.choices, m.buckets):   # each sends at most a quarter of dense's time
        assert comm_seconds(c, b, m.network) < 0.25 * comm_seconds(dense, b, m.network), d.describe()
    assert d.step_s < 0.25 * dense_step(m)


def test_quantized_decoding_is_priced_as_dense_work():
    """A gather kind's decoding is element work (δ), not sparse entries (γ): with the γ this
    machine's calibration fits under load (76 ns an entry), blockquant 4-bit at 100 Mbit/s is
    still predicted at its bytes' worth, and chosen over bf16 (the demo's LM, which it wins)."""
    model = CostModel(alpha=1e-6, beta=8.45e-8, gamma=7.6e-8, delta=5e-10)
    m = Measurements(Network(2, model), buckets([0.0], numel=133120), 0.03)
    bq4, bf16 = Choice(Candidate("blockquant", 4)), Choice(Candidate("bf16"))
    b = m.buckets[0]
    assert comm_seconds(bq4, b, m.network) < 0.3 * comm_seconds(bf16, b, m.network)
    d = decide(m, candidates=(Candidate("dense"), Candidate("bf16"), Candidate("blockquant", 4)))
    assert kinds(d) == ["blockquant"], d.describe()


def test_hidden_buckets_stay_dense_exposed_bucket_compressed():
    m = measures(GBIT, [0.3, 0.2, 0.0], compute=0.1)
    d = decide(m)
    assert kinds(d)[:2] == ["dense", "dense"], d.describe()
    assert kinds(d)[2] not in ("dense",), d.describe()
    # the model: a hidden dense bucket costs nothing, the exposed one all of its collective
    comm = [comm_seconds(Choice(Candidate("dense")), b, m.network) for b in m.buckets]
    assert exposed_seconds([0.3, 0.2, 0.0], [0.0] * 3, comm) == pytest.approx(comm[2])


def test_exposed_seconds_queue():
    # 3 collectives of 1 s arriving 2.5, 2, 1 s before the backward end: each alone would be
    # hidden, but the third waits for the second until 0.5 s before the end
    assert exposed_seconds([2.5, 2.0, 1.0], [0, 0, 0], [1.0, 1.0, 1.0]) == pytest.approx(0.5)
    assert exposed_seconds([2.5, 1.0, 0.0], [0, 0, 0], [1.0, 1.0, 1.0]) == pytest.approx(1.0)
    # codec in the hook delays every later arrival and the backward end
    assert exposed_seconds([5.0, 0.0], [0.5, 0.25], [0.0, 0.0]) == pytest.approx(0.75)
    assert exposed_seconds([], [], []) == 0.0
    # codec queued on the communication thread: hidden too when the window is long enough
    assert exposed_seconds([5.0, 0.0], [0.5, 0.25], [0.0, 0.0], inline=False) == pytest.approx(0.25)
    assert exposed_seconds([2.5, 2.0, 1.0], [0.5] * 3, [0.5] * 3, inline=False) == pytest.approx(0.5)


def test_two_by_two_picks_two_level_when_it_pays():
    quant = (Candidate("dense"), Candidate("bf16"), Candidate("blockquant", 8), Candidate("blockquant", 4))
    hidden = [0.0, 0.0]
    slow_inter = Network(4, GBIT, local_size=2, intra=LOOPBACK, inter=MBIT100)
    d = decide(Measurements(slow_inter, buckets(hidden), 0.05), candidates=quant)
    assert [c.path for c in d.choices] == ["two_level", "two_level"], d.describe()
    uniform = Network(4, LOOPBACK, local_size=2, intra=LOOPBACK, inter=LOOPBACK)
    d = decide(Measurements(uniform, buckets(hidden), 0.05), candidates=quant)
    assert [c.path for c in d.choices] == ["flat", "flat"], d.describe()
    flat_only = decide(Measurements(Network(4, MBIT100), buckets(hidden), 0.05), candidates=quant)
    assert {c.path for c in flat_only.choices} == {"flat"}


def test_critical_regime_keeps_the_gentlest_and_the_near_lossless():
    # the gentle members code slowly here, so a calm bucket takes an aggressive one
    codec = dict(CODEC)
    for c in (Candidate("powersgd", 4), Candidate("topk", 0.1), Candidate("blockquant", 8)):
        codec[c] = 0.03
    codec[Candidate("blockquant", 4)] = 0.1
    aggressive = {Candidate("topk", 0.01), Candidate("powersgd", 1)}
    allowed = set(gentlest(DEFAULT_CANDIDATES)) | {Candidate("blockquant", 4)}   # priced 1.05 <= critical_max
    assert critical_candidates(DEFAULT_CANDIDATES, Prices()) == tuple(c for c in DEFAULT_CANDIDATES if c in allowed)
    m = measures(MBIT100, [0.0, 0.0], change=0.6, codec=codec)
    d = decide(m)
    assert all(c.candidate in allowed for c in d.choices), d.describe()
    calm = decide(measures(MBIT100, [0.0, 0.0], change=0.1, codec=codec))
    assert any(c.candidate in aggressive for c in calm.choices), calm.describe()
    # blockquant 4-bit near-lossless: a critical bucket keeps it where it is the best allowed
    codec[Candidate("blockquant", 4)] = CODEC[Candidate("blockquant", 4)]
    m = measures(MBIT100, [0.0, 0.0], change=0.6, codec=codec)
    assert kinds(decide(m)) == ["blockquant", "blockquant"] and decide(m).choices[0].candidate.param == 4
    # a stricter bound gates it too: the gentlest of each family only
    strict = decide(m, prices=Prices(critical_max=1.0))
    assert all(c.candidate in set(gentlest(DEFAULT_CANDIDATES)) for c in strict.choices), strict.describe()


def test_hysteresis_margin():
    m1 = measures(MBIT100, [0.02, 0.0])
    cur = decide(m1)
    # the chosen candidate's codec gets dearer: another plan becomes better by some gain
    dear = {c: (t * 30 if c in {x.candidate for x in cur.choices} else t) for c, t in CODEC.items()}
    m2 = measures(MBIT100, [0.02, 0.0], codec=dear)
    best = decide(m2)
    kept = decide(m2, current=cur.choices, margin=0.99)
    assert kept.choices == cur.choices
    gain = (kept.objective - best.objective) / kept.objective
    assert gain > 0 and best.choices != cur.choices
    assert decide(m2, current=cur.choices, margin=gain * 1.01).choices == cur.choices
    assert decide(m2, current=cur.choices, margin=gain * 0.99).choices == best.choices


def test_decider_schedule_drift_and_state():
    dec = Decider(every=100, drift=0.25, margin=0.05)
    m = measures(MBIT100, [0.02, 0.0])
    plan, switched = dec.update(10, m)
    assert switched == (0, 1) and dec.decided_at == 10
    faster = measures(CostModel(alpha=2e-4, beta=8e-8 * 0.9), [0.02, 0.0])   # 10%: not a drift
    assert not dec.due(50, faster)
    assert dec.update(50, faster) == (plan, ())
    assert dec.due(110, faster)                                                # every N steps
    loopback = measures(LOOPBACK, [0.02, 0.0])
    assert dec.due(60, loopback)                                               # bandwidth moved
    assert dec.due(60, Measurements(m.network.scaled(1.5), m.buckets, m.compute_s))
    assert dec.due(60, measures(MBIT100, [0.02 + 0.3 * 0.05, 0.0]))            # overlap moved
    new, switched = dec.update(60, loopback)
    assert set(kinds(new)) <= {"dense", "bf16"} and switched
    again = Decider(every=100, drift=0.25, margin=0.05)
    again.load_state_dict(dec.state_dict())
    assert again.current == dec.current and again.decided_at == 60 and again.watched == dec.watched
    assert again.update(70, loopback) == dec.update(70, loopback)


def test_the_first_plan_needs_a_larger_gain_over_dense():
    """The first decision has no measured per-call cost yet: a plan predicted a little better than
    dense (between the margin and FIRST_MARGIN) waits for the next decision; a large gain does not."""
    from commpress.auto.decide import FIRST_MARGIN

    close = None
    for scale in (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0):   # a faster link: less to gain from compressing
        m = measures(CostModel(alpha=1e-4, beta=8e-9 / scale), [0.0, 0.0])
        gain = 1 - decide(m).objective / dense_step(m)
        if 0.05 < gain < FIRST_MARGIN:
            close = m
            break
    assert close is not None
    dec = Decider(every=1, drift=0.25, margin=0.05)
    plan, switched = dec.update(1, close)
    assert set(kinds(plan)) == {"dense"} and switched == ()
    plan, switched = dec.update(2, close)                      # the next decision: the usual margin
    assert switched and set(kinds(plan)) != {"dense"}
    far = measures(MBIT100, [0.0, 0.0])                        # a slow link: the first plan compresses
    assert set(kinds(Decider(margin=0.05).update(1, far)[0])) != {"dense"}


def _first_gain(m):
    return 1 - decide(m).objective / dense_step(m)


def test_a_modest_first_plan_waits_for_a_measured_dense_step_to_be_judged_by():
    """A first plan predicted to gain less than CONFIDENT_GAIN, at a check point with no measured
    step of the all-dense start, waits (all dense, nothing decided) for the next check point; there
    it switches on probation against the measured dense step, and is undone if it measures worse.
    With a measured step, or a large gain, the first plan starts at once; it never waits twice."""
    from commpress.auto.decide import CONFIDENT_GAIN, FIRST_MARGIN

    modest = None
    for scale in (1.0, 0.7, 0.5, 0.4, 0.3):   # a slower link: more to gain from compressing
        m = measures(CostModel(alpha=1e-4, beta=8e-9 / scale), [0.0, 0.0])
        if FIRST_MARGIN + 0.02 < _first_gain(m) < CONFIDENT_GAIN - 0.02:
            modest = m
            break
    assert modest is not None
    assert _first_gain(measures(MBIT100, [0.0, 0.0])) > CONFIDENT_GAIN       # the slow link: at once (above)

    dec = Decider(every=50, drift=0.25, margin=0.05, revert=0.2)
    plan, switched = dec.update(1, modest)                                  # no measured step yet
    assert set(kinds(plan)) == {"dense"} and switched == () and dec.decided_at is None and not dec.on_probation
    resumed = Decider(every=50, drift=0.25, margin=0.05, revert=0.2)
    resumed.load_state_dict(dec.state_dict())
    plan, switched = dec.update(5, modest, measured_s=0.050)               # the dense window measured
    assert switched and set(kinds(plan)) != {"dense"} and dec.on_probation and dec.previous_s == 0.050
    assert dec.decided_at == 5 and plan == decide(modest)
    assert resumed.update(5, modest, measured_s=0.050) == (plan, switched)  # a resume decides alike
    worse = 0.050 * 1.3 / plan.price
    back, undone = dec.update(9, modest, measured_s=worse)                  # judged: undone and barred
    assert set(kinds(back)) == {"dense"} and set(undone) == set(switched) and dec.last_revert == (9, worse, 0.050)

    measured = Decider(every=50, margin=0.05)                              # a measured step at the first check
    plan, switched = measured.update(1, modest, measured_s=0.050)
    assert switched and measured.on_probation
    twice = Decider(every=50, margin=0.05)
    twice.update(1, modest)
    plan, switched = twice.update(5, modest)                               # still unmeasured: decides anyway
    assert switched and twice.decided_at == 5 and twice.previous_s == 0.0   # no reference: cannot be judged


def test_determinism_and_never_slower_on_random_measurements():
    rng = random.Random(0)
    for _ in range(12):
        model = CostModel(alpha=rng.uniform(1e-5, 1e-3), beta=10 ** rng.uniform(-10, -7))
        nb = rng.randint(1, 5)
        hidden = [rng.uniform(0, 0.05) for _ in range(nb)]
        codec = {c: rng.uniform(1e-4, 1e-2) for c in CODEC}
        m = measures(model, sorted(hidden, reverse=True), compute=rng.uniform(0.01, 0.2), codec=codec,
                     change=rng.choice([0.0, 0.7]), numel=rng.choice([4096, N]))
        m = Measurements(m.network, m.buckets, m.compute_s, codec_inline=rng.random() < 0.5)
        d = decide(m)
        assert d == decide(m)
        shuffled = Measurements(m.network, tuple(BucketMeasure(b.name, b.numel, b.shapes, b.hidden_s,
                                                               dict(reversed(list(b.codec_s.items()))),
                                                               b.norm_change) for b in m.buckets), m.compute_s,
                                m.codec_inline)
        assert decide(shuffled) == d
        assert d.step_s <= dense_step(m) * (1 + 1e-12)


def test_prices_and_describe():
    p = Prices()
    assert p.price(Candidate("dense")) == 1.0
    assert p.price(Candidate("topk", 0.1)) == pytest.approx(1.5)
    assert p.price(Candidate("topk", 0.01)) == pytest.approx(2.5)
    assert p.price(Candidate("powersgd", 2)) == pytest.approx(1.9)
    assert p.price(Candidate("powersgd", 1)) > p.price(Candidate("powersgd", 4)) > 1
    assert describe(Choice(Candidate("topk", 0.01))) == "topk(ratio=0.01)"
    assert describe(Choice(Candidate("blockquant", 4), "two_level")) == "blockquant(bits=4)+two_level"
    assert describe(Candidate("dense")) == "dense"
    with pytest.raises(ValueError, match="ratio"):
        Candidate("topk", 2.0)
    with pytest.raises(ValueError, match="margin"):
        decide(measures(GBIT, [0.0]), margin=1.5)


def test_stats_record_shape():
    d = decide(measures(MBIT100, [0.0]))
    rec = stats_record(["bucket0"], d, {"bucket0": 0.012})
    assert list(rec) == ["bucket0"]
    assert rec["bucket0"]["choice"] == describe(d.choices[0])
    assert rec["bucket0"]["predicted_ms"] == pytest.approx(1e3 * d.predicted_s[0])
    assert rec["bucket0"]["measured_ms"] == pytest.approx(12.0)


def test_link_tracker_scales_the_link_after_two_windows_of_the_same_plan():
    """The link's factor moves only when two windows in a row of the same plan read the
    collectives more than ``drift`` slower (or faster) than the plan's first window; the decider,
    watching the network, then re-decides.  A noisy window, or a new plan, changes nothing."""
    from commpress.auto.decide import LinkTracker, link_seconds

    m = measures(GBIT, [0.02, 0.0])
    plan = [Choice(Candidate("blockquant", 4)), Choice(Candidate("dense"))]
    pred = [link_seconds(c, b, m.network) for c, b in zip(plan, m.buckets)]
    tr = LinkTracker(drift=0.25)
    seen = [tr.update(m.network, plan, m.buckets, [0.7 * p for p in pred])]   # reference: 0.7x the model
    seen.append(tr.update(m.network, plan, m.buckets, [1.4 * p for p in pred]))   # one window off: noise
    seen.append(tr.update(m.network, plan, m.buckets, [0.7 * p for p in pred]))
    assert all(n == m.network for n in seen) and tr.scale == 1.0
    slow = [link_seconds(c, b, m.network.scaled(3.0)) * 0.7 for c, b in zip(plan, m.buckets)]
    assert tr.update(m.network, plan, m.buckets, slow) == m.network              # the first slow window
    scaled = tr.update(m.network, plan, m.buckets, slow)                          # the second: 3x slower
    assert tr.scale == pytest.approx(3.0, rel=0.05) and scaled.flat.beta == pytest.approx(3 * GBIT.beta, rel=0.05)
    dec = Decider(every=100, drift=0.25)
    dec.update(10, m)
    assert dec.due(20, Measurements(scaled, m.buckets, m.compute_s))             # the bandwidth moved: re-decide
    # a new plan's first window is its reference, whatever it reads; unmeasured windows change nothing
    other = [Choice(Candidate("bf16")), Choice(Candidate("dense"))]
    assert tr.update(m.network, other, m.buckets, [5.0, 5.0]).flat.beta == pytest.approx(scaled.flat.beta)
    assert tr.update(m.network, other, m.buckets, [0.0, 0.0]).flat.beta == pytest.approx(scaled.flat.beta)
    state = tr.state_dict()
    again = LinkTracker()
    again.load_state_dict(state)
    assert again.state_dict() == state
    # not tracked: a hierarchy
    two = Network(4, GBIT, 2, GBIT, GBIT)
    assert LinkTracker().update(two, plan, m.buckets, slow) == two
    # FSDP2's reduce-scatter: tracked on its own prediction
    rs = Network(2, GBIT, collective="reduce_scatter")
    tr = LinkTracker(drift=0.25)
    base = [link_seconds(c, b, rs) for c, b in zip(plan, m.buckets)]
    slow = [link_seconds(c, b, rs.scaled(3.0)) for c, b in zip(plan, m.buckets)]
    assert [tr.update(rs, plan, m.buckets, t) for t in (base, slow)] == [rs, rs]
    assert tr.update(rs, plan, m.buckets, slow).flat.beta == pytest.approx(3 * GBIT.beta, rel=0.05)
    with pytest.raises(ValueError, match="drift"):
        LinkTracker(drift=0)


def test_a_switch_that_measures_worse_is_undone_and_barred():
    """The check point after a switch compares measured step × price of the new plan with the plan's
    before it: worse by more than ``revert`` undoes the switch and bars the plan until ``every`` steps
    passed or the network drifted (a moved overlap, measured under another plan, does not lift it);
    within ``revert``, or unmeasured, the switch stands."""
    slow = measures(MBIT100, [0.0, 0.0])                       # compressing is predicted to pay
    dec = Decider(every=50, drift=0.25, margin=0.05, revert=0.2)
    plan, switched = dec.update(10, slow, measured_s=0.050)   # the dense window measured 50 ms per step
    assert switched and set(kinds(plan)) != {"dense"} and dec.on_probation
    price = plan.price
    worse = 0.050 * 1.25 / price                               # step × price 25% above the dense window's
    back, undone = dec.update(14, slow, measured_s=worse)
    assert set(kinds(back)) == {"dense"} and set(undone) == set(switched) and not dec.on_probation
    assert dec.last_revert == (14, worse, 0.050)
    assert dec.update(20, slow, measured_s=0.050) == (back, ())        # not due: nothing re-decided
    dec.watched = None                                                 # due (as after a drift) ...
    kept, switched_again = dec.update(30, slow, measured_s=0.050)
    assert set(kinds(kept)) == {"dense"} and switched_again == ()     # ... but the plan is barred
    again, switched_again = dec.update(80, slow, measured_s=0.050)     # due again, the veto expired
    assert again.choices == plan.choices and switched_again and dec.on_probation
    dec.update(84, slow, measured_s=worse)                             # undone and barred again ...
    assert dec.vetoed and set(kinds(dec.current)) == {"dense"}
    hidden = measures(MBIT100, [0.02, 0.0])                            # the overlap moved by 40% of the
    kept, switched_again = dec.update(86, hidden, measured_s=0.050)    # compute (re-decided): still barred
    assert dec.vetoed and set(kinds(kept)) == {"dense"} and switched_again == ()
    slower = measures(CostModel(alpha=2e-4, beta=1.2e-7), [0.0, 0.0])  # ... until the link moved by 50%:
    moved, switched_again = dec.update(90, slower, measured_s=0.050)   # drift drops the veto
    assert not dec.vetoed and switched_again and set(kinds(moved)) != {"dense"}

    stands = Decider(every=50, margin=0.05, revert=0.2)
    plan2, _ = stands.update(10, slow, measured_s=0.050)
    assert stands.update(14, slow, measured_s=0.050 * 1.15 / plan2.price) == (plan2, ())   # within revert
    assert not stands.on_probation and not stands.vetoed
    unmeasured = Decider(every=50, margin=0.05)
    plan3, _ = unmeasured.update(10, slow, measured_s=0.0)            # no reference: cannot be judged
    assert unmeasured.update(14, slow, measured_s=1.0) == (plan3, ()) and not unmeasured.on_probation
    with pytest.raises(ValueError, match="revert"):
        Decider(revert=-0.1)


def test_window_tolerance_is_the_interval_of_a_windows_median():
    """The relative 95% half-width of a window's median step: t(n-1) × 1.25 × stdev / median / sqrt(n);
    not known (inf) below three steps or with a non-finite wall; narrower with more steps, wider
    with an outlier."""
    assert window_tolerance([]) == window_tolerance([0.1, 0.1]) == math.inf
    assert window_tolerance([0.1, float("nan"), 0.1]) == math.inf
    assert window_tolerance([0.05] * 5) == 0.0
    w = [0.10, 0.11, 0.09]
    assert window_tolerance(w) == pytest.approx(1.25 * 4.30 * statistics.stdev(w) / 0.10 / math.sqrt(3))
    many = [0.10, 0.11, 0.09] * 10
    assert window_tolerance(many) < window_tolerance(w) / 4
    assert window_tolerance(many + [0.5]) > 2 * window_tolerance(many)
    assert window_tolerance(list(reversed(many))) == window_tolerance(many)


def test_a_quiet_window_lowers_the_revert_limit():
    """Where both windows' steps were quiet the limit is their difference's interval, not below
    REVERT_FLOOR: a switch measured 10% worse is undone that ``revert`` (20%) would keep; a noisy
    window, or one whose spread is not known, keeps ``revert``; within the floor it stands."""
    slow = measures(MBIT100, [0.0, 0.0])

    def judged(before_tol, after_tol, worse):
        dec = Decider(every=50, margin=0.05, revert=0.2)
        plan, switched = dec.update(10, slow, measured_s=0.050, measured_tol=before_tol)
        assert switched and dec.on_probation
        out, back = dec.update(14, slow, measured_s=0.050 * worse / plan.price, measured_tol=after_tol)
        return dec, bool(back)

    dec, undone = judged(0.01, 0.01, 1.10)
    assert undone and dec.last_revert_limit == REVERT_FLOOR and dec.vetoed
    dec, undone = judged(0.05, 0.06, 1.10)                            # the limit: hypot(5%, 6%) = 7.8%
    assert undone and dec.last_revert_limit == pytest.approx(math.hypot(0.05, 0.06))
    assert judged(0.05, 0.06, 1.06)[1] is False
    assert judged(0.01, 0.01, 1.04)[1] is False                       # inside the floor: it stands
    assert judged(0.3, 0.01, 1.15)[1] is False                        # a noisy window: revert's 20%
    assert judged(math.inf, 0.01, 1.15)[1] is False                   # not known: revert's 20%
    assert judged(0.01, math.inf, 1.15)[1] is False
    assert judged(0.3, 0.01, 1.25)[1] is True
    assert Decider(revert=0.03).revert_limit(0.01, 0.01) == 0.03      # revert is the ceiling

    dec = Decider(every=50, margin=0.05)                                # the tolerance is kept in the state
    plan, _ = dec.update(10, slow, measured_s=0.050, measured_tol=0.01)
    resumed = Decider(every=50, margin=0.05)
    resumed.load_state_dict(dec.state_dict())
    assert resumed.previous_tol == 0.01
    assert resumed.update(14, slow, measured_s=0.055 / plan.price, measured_tol=0.01) == \
        dec.update(14, slow, measured_s=0.055 / plan.price, measured_tol=0.01)
    assert dec.vetoed and resumed.vetoed == dec.vetoed
    old = Decider(every=50, margin=0.05)
    old.update(10, slow, measured_s=0.050, measured_tol=0.01)
    state = old.state_dict()
    del state["probation"]["previous_tol"]                              # a checkpoint from before it
    older = Decider(every=50, margin=0.05)
    older.load_state_dict(state)
    assert older.previous_tol == math.inf
    assert older.update(14, slow, measured_s=0.055 / plan.price, measured_tol=0.01)[1] == ()


def test_decider_state_keeps_probation_and_vetoes():
    slow = measures(MBIT100, [0.0, 0.0])
    dec = Decider(every=50, margin=0.05)
    plan, _ = dec.update(10, slow, measured_s=0.05)
    on_probation = Decider(every=50, margin=0.05)
    on_probation.load_state_dict(dec.state_dict())
    assert on_probation.on_probation and on_probation.previous == dec.previous and on_probation.switched_at == 10
    assert on_probation.update(14, slow, measured_s=1.0) == dec.update(14, slow, measured_s=1.0)
    vetoed = Decider(every=50, margin=0.05)
    vetoed.load_state_dict(dec.state_dict())
    assert vetoed.vetoed == dec.vetoed and len(vetoed.vetoed) == 1 and not vetoed.on_probation
    old = dec.state_dict()                                    # a checkpoint from before outcome checks
    del old["probation"], old["vetoed"]
    older = Decider(every=50, margin=0.05)
    older.load_state_dict(old)
    assert older.current == dec.current and not older.vetoed and not older.on_probation


def test_a_switch_is_not_undone_into_a_choice_the_critical_regime_forbids():
    """The plan before the switch held a kind a critical regime now forbids (topk 1%: not the gentlest
    of its family): the switch stands (no veto, no revert), whatever it measured."""
    cands = (Candidate("topk", 0.1), Candidate("topk", 0.01), Candidate("blockquant", 8))
    costs = {c: 1e-4 for c in cands}
    calm = measures(CostModel(alpha=2e-4, beta=8e-6), [0.0, 0.0], codec=costs)   # 1 Mbit/s: topk 1% pays
    dec = Decider(candidates=cands, every=50, margin=0.0)
    plan, _ = dec.update(10, calm, measured_s=0.05)
    assert [c.candidate for c in plan.choices] == [Candidate("topk", 0.01)] * 2
    critical = measures(CostModel(alpha=2e-4, beta=8e-6), [0.0, 0.0], codec=costs, change=0.9)
    dec.watched = None   # topk's window measured 20 ms: × its price 2.5 within 20% of dense's 50, it stands
    gentle, switched = dec.update(20, critical, measured_s=0.02)
    assert switched and Candidate("topk", 0.01) not in [c.candidate for c in gentle.choices] and dec.on_probation
    assert dec.update(24, critical, measured_s=5.0) == (gentle, ())   # much slower, but topk 1% is gated
    assert not dec.vetoed and dec.last_revert is None


def test_a_sparse_candidate_is_predicted_as_it_is_sent():
    """Under error feedback a sparsifier whose selection would not be the smallest message sends
    the whole tensor: topk 10% in 4 bits at P=2 (one all-gather, the bytes of blockquant 4-bit) and
    in a bf16 ring at P=8; topk 1% its selection.  FSDP2's reduce-scatter alike, per chunk."""
    import torch

    from commpress.auto.candidates import prototype
    from commpress.auto.decide import flat_terms, reduce_scatter_terms
    from commpress.collectives.hierarchy import kind_terms

    n = 1 << 20
    t10, t1, bq4, bf16 = (prototype(Candidate(*c)) for c in (("topk", 0.1), ("topk", 0.01), ("blockquant", 4),
                                                            ("bf16",)))
    assert flat_terms(t10, n, 2) == kind_terms(bq4, n, 2, torch.float32, None, None)
    assert flat_terms(t10, n, 8) == kind_terms(bf16, n, 8, torch.float32, None, None)
    assert flat_terms(t1, n, 2) == kind_terms(t1, n, 2, torch.float32, None, None)
    assert reduce_scatter_terms(t10, n, 2) == reduce_scatter_terms(bq4, n, 2)
    assert reduce_scatter_terms(t1, n, 2)[2] > 0   # a selection: sparse entries to add
