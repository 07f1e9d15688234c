"""``commpress.fsdp.register(model, "auto")`` on 2 gloo ranks (FSDP2 on CPU), and switching a unit.

One 2-rank run does the distributed checks in one worker (the harness's cost is per run):
the same choices on both ranks from their own timings, a slow (synthetic) network choosing
compressed kinds and a fast one dense again, every switch conserving residual and velocity
(momentum taken over from the optimizer), full parameters bitwise across ranks, a bitwise
resume up to the next check point, an all-dense plan bitwise FSDP2's default, a link model
made 100x too fast scaled back from the seconds inside the reduce-scatters, the options
refused on every rank, and a rank that fails to measure raising on both.
"""

from __future__ import annotations

import io
import time

import pytest
import torch

from distributed import run
from nets import fsdp_shard, small_net, train_step

import commpress
from commpress.auto import Candidate, Choice, Network
from commpress.auto.decide import BucketMeasure, Measurements, decide, reduce_scatter_terms
from commpress.auto.fsdp import ReduceScatterAutoCodec
from commpress.auto.runtime import AutoSpec, auto_spec
from commpress.auto.candidates import describe, prototype
from commpress.collectives.costmodel import CostModel

SLOW = CostModel(1e-3, 1e-4)     # 10 kB/s: compressing pays whatever the compute
FAST = CostModel(1e-7, 1e-13)    # nothing to gain: dense


def _net(world, model):
    return Network(world, model, collective="reduce_scatter")


def _owed(auto, codec, key, numel):
    """Residual and velocity a unit's codec still owes, in the unit's (input's) coordinates."""
    res, vel = torch.zeros(numel), torch.zeros(numel)
    for k, off, n in auto._unit_slots(codec, key, numel, owner=True):
        r, v = codec.residual(k), codec.velocity(k)
        if r is not None:
            res[off:off + n] += r.reshape(-1)
        if v is not None:
            vel[off:off + n] += v.reshape(-1)
    return res, vel


def _full(model):
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


def _local(model):
    return [p.to_local().detach().clone() for p in model.parameters()]


def _register(model, opt):
    return commpress.fsdp.register(model, "auto", optimizer=opt, check_every=2, every=2, margin=0.0)


def auto_worker(rank, world):
    out = {}
    model = fsdp_shard(small_net(), world)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = _register(model, opt)
    auto = state.codec
    auto.network = _net(world, SLOW)
    moved, history = [], []
    original = auto.switch

    def spy(key, numel, choice):
        before = _owed(auto, auto.codecs[key], key, numel)
        original(key, numel, choice)
        after = _owed(auto, auto.codecs[key], key, numel)
        moved.append((choice.candidate.kind, all(torch.equal(a, b) for a, b in zip(before, after)),
                      float(before[0].abs().sum() + before[1].abs().sum())))
    auto.switch = spy
    for step in range(4):                      # checks at the ends of steps 1 and 3: compress
        train_step(model, opt, rank, step)
    # a unit that switched again at step 3 (margin 0: timing decides) has its first call at step 4,
    # which is not measured (one-time costs): its report says so (measured None)
    fresh = set(auto._unmeasured)
    out["fresh"] = [name for u, name in zip(auto._units, auto._names(auto._units)) if u.key in fresh]
    train_step(model, opt, rank, 4)
    history.append(sorted(state.stats.as_dict()["auto"].items()))   # step 4's call times measured
    out["comm"] = {k: (m[0], m[2]) for k, m in auto._meas.items()}   # call and in-collective seconds
    out["algorithms"] = sorted(state.stats.last_step["units"][u]["algorithm"] for u in state._units)
    auto.network = _net(world, FAST)           # the network moved: dense again at the end of step 5
    train_step(model, opt, rank, 5)
    history.append(sorted(state.stats.as_dict()["auto"].items()))
    out["history"], out["moved"] = history, moved
    buf = io.BytesIO()
    torch.save({"hook": state.state_dict(), "params": _local(model), "opt": opt.state_dict()}, buf)
    for step in range(6, 8):                   # the next check point is the end of step 7
        train_step(model, opt, rank, step)
    out["params"] = _full(model)
    state.close()

    # resume from the end of step 5 (a weights_only round trip): bitwise through step 7
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    torch.manual_seed(1)
    model2 = fsdp_shard(torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.ReLU(), torch.nn.Linear(96, 8)), world)
    with torch.no_grad():
        for p, q in zip(model2.parameters(), ckpt["params"]):
            p.to_local().copy_(q)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9)
    opt2.load_state_dict(ckpt["opt"])
    state2 = _register(model2, opt2)
    state2.codec.network = _net(world, FAST)
    state2.load_state_dict(ckpt["hook"])
    out["resumed_choices"] = {k: str(c) for k, c in state2.codec.choices.items()} == \
        {k: str(c) for k, c in state.codec.choices.items()}
    for step in range(6, 8):
        train_step(model2, opt2, rank, step)
    out["resumed"] = _full(model2)
    state2.close()

    # no momentum, a fast network: every unit dense, FSDP2's own reduce-scatter: bitwise its default
    model3 = fsdp_shard(small_net(), world)
    opt3 = torch.optim.SGD(model3.parameters(), lr=0.05)
    state3 = commpress.fsdp.register(model3, "auto", check_every=2)
    state3.codec.network = _net(world, FAST)
    plain = fsdp_shard(small_net(), world)
    opt4 = torch.optim.SGD(plain.parameters(), lr=0.05)
    for step in range(4):
        train_step(model3, opt3, rank, step)
        train_step(plain, opt4, rank, step)
    out["dense"] = (sorted(e["choice"] for e in state3.stats.as_dict()["auto"].values()),
                    sorted({u["algorithm"] for u in state3.stats.last_step["units"].values()}),
                    torch.equal(_full(model3), _full(plain)))

    # no momentum: compressed on a slow network, then dense again; the first dense step runs the
    # units' error feedback (identity: it sends everything owed, exactly), the next FSDP2's own call
    model6 = fsdp_shard(small_net(), world)
    opt6 = torch.optim.SGD(model6.parameters(), lr=0.05)
    state6 = commpress.fsdp.register(model6, "auto", check_every=2, every=2)
    state6.codec.network = _net(world, SLOW)
    paths, owed = [], []
    for step in range(6):
        if step == 2:
            state6.codec.network = _net(world, FAST)
        train_step(model6, opt6, rank, step)
        paths.append(sorted({u["algorithm"] for u in state6.stats.last_step["units"].values()}))
        owed.append(sum(float(c.residual(k).abs().sum()) for c in state6.codec.codecs.values() for k in c._residuals))
    out["back_to_dense"] = paths, owed

    # the link tracked (remeasure, the default): a model that turns 100x too optimistic mid-run (as
    # if the link had slowed down 100x after registration) is corrected after two check windows
    # that read it so, from the seconds inside the units' reduce-scatters.  Dense only: one plan
    # throughout (a switch would start a new reference window, whatever the timings)
    # Each reduce-scatter is held 20 ms (a slow link): what is measured is then the link's, not the
    # loopback's microseconds, whose scheduling noise (a rank descheduled beside other tests) could
    # rescale the model on its own before the change
    import commpress.hooks.fsdp as fsdp_hook

    class SlowLink:
        def __getattr__(self, name):
            return getattr(torch.distributed, name)

        @staticmethod
        def reduce_scatter_single(*a, **k):
            time.sleep(0.02)
            return torch.distributed.reduce_scatter_single(*a, **k)

    fsdp_hook.dist = SlowLink()
    try:
        model8 = fsdp_shard(small_net(), world)
        opt8 = torch.optim.SGD(model8.parameters(), lr=0.05)
        state8 = commpress.fsdp.register(model8, "auto", check_every=1, candidates=[("dense",)])
        auto8 = state8.codec
        auto8.network = _net(world, CostModel(0.0, 1e-9, 0.0, 0.0))    # seconds per byte only
        for step in range(5):
            train_step(model8, opt8, rank, step)
        before = auto8.link.scale
        auto8.network = _net(world, CostModel(0.0, 1e-11, 0.0, 0.0))
        for step in range(5, 8):
            train_step(model8, opt8, rank, step)
        out["link"] = (before, auto8.link.scale, state8.stats.as_dict()["auto_network"])
        state8.close()
    finally:
        fsdp_hook.dist = torch.distributed

    # an optimizer attached after registration (Lightning): the unit codecs get its momentum
    model7 = fsdp_shard(small_net(), world)
    opt7 = torch.optim.SGD(model7.parameters(), lr=0.05, momentum=0.9)
    state7 = commpress.fsdp.register(model7, "auto", check_every=2)
    state7.attach_optimizer(opt7)
    for step in range(2):
        train_step(model7, opt7, rank, step)
    out["late"] = (state7.codec.momentum, sorted({c.momentum for c in state7.codec.codecs.values()}),
                   sorted(state7.stats.as_dict()["auto"]), opt7.param_groups[0]["momentum"])
    state7.close()
    # an adaptive optimizer: the sparsifiers leave the default candidates (attached late, too)
    model9 = fsdp_shard(small_net(), world)
    state9 = commpress.fsdp.register(model9, "auto", check_every=2)
    before = [c.kind for c in state9.codec.decider.candidates]
    state9.attach_optimizer(torch.optim.AdamW(model9.parameters()))
    out["adaptive"] = (before, [c.kind for c in state9.codec.decider.candidates],
                       state9.config()["compressor_params"]["candidates"])
    state9.close()

    # options: refused on every rank, before any collective
    errors = []
    for kwargs in ({"replicate_group": torch.distributed.group.WORLD}, {"ratio": 0.01},
                   {"candidates": [("powersgd", 1)]}):
        try:
            commpress.fsdp.register(fsdp_shard(small_net(), world), "auto", **kwargs)
        except ValueError as exc:
            errors.append(str(exc))
    out["errors"] = errors

    # a rank that fails to measure: both raise at the check point (no hang)
    model5 = fsdp_shard(small_net(), world)
    opt5 = torch.optim.SGD(model5.parameters(), lr=0.05)
    commpress.fsdp.register(model5, "auto", check_every=2)
    if rank == 0:
        from commpress.auto import fsdp as auto_fsdp

        def broken(*a, **k):
            raise OSError("no timer on this rank")
        auto_fsdp.codec_cost = broken
    try:
        for step in range(2):
            train_step(model5, opt5, rank, step)
        out["error"] = None
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


@pytest.mark.timeout(120)
def test_register_auto_on_two_ranks():
    a, b = run(auto_worker, 2, timeout=110)
    # both ranks made the same decisions, from their own timings; replicas identical
    assert [[(n, e["choice"]) for n, e in h] for h in a["history"]] == \
           [[(n, e["choice"]) for n, e in h] for h in b["history"]]
    assert torch.equal(a["params"], b["params"])
    first, second = ([e["choice"] for _, e in h] for h in a["history"])
    assert [n for n, _ in a["history"][0]] == ["0", "2"]                  # named by FSDP unit
    assert all(c != "dense" for c in first), first                        # the slow network: compressed
    assert all(c == "dense" for c in second), second                      # the fast one: dense again
    assert all(alg != "identity:reduce_scatter" for alg in a["algorithms"]), a["algorithms"]
    for name, e in a["history"][0]:
        assert e["predicted_ms"] > 0 and e["params"]
        assert (e["measured_ms"] is None) == (name in a["fresh"]), (name, e, a["fresh"])
    # a measured compressed call: the seconds inside its collective are part of the call's
    assert len(a["comm"]) == 2 - len(a["fresh"]) and all(0 < c <= s for s, c in a["comm"].values()), a["comm"]
    # the link tracked: the 100x too fast model scaled back, the same on both ranks
    before, after, net = a["link"]
    assert b["link"][:2] == a["link"][:2]
    assert after / before > 10, a["link"]
    assert net["calibrated"]["mb_per_s"] == pytest.approx(1e-6 / 1e-11)
    assert net["priced"]["mb_per_s"] == pytest.approx(1e-6 / (1e-11 * after)) and net["round_ms"] >= 0
    # every switch carried residual and velocity bitwise, non-zero ones included
    for r in (a, b):
        assert r["moved"] and all(ok for _, ok, _ in r["moved"])
        assert any(owed > 0 for _, _, owed in r["moved"])
    # resume: choices restored, bitwise up to the next check point
    assert a["resumed_choices"] and b["resumed_choices"]
    assert torch.equal(a["resumed"], a["params"]) and torch.equal(b["resumed"], b["params"])
    # all dense without momentum: FSDP2's own reduce-scatter, bitwise its default
    for r in (a, b):
        assert r["dense"] == (["dense", "dense"], ["identity:reduce_scatter"], True), r["dense"]
    # back to dense without momentum: one error-feedback step pays what was owed, then FSDP2's call
    paths, owed = a["back_to_dense"]
    assert all(p != ["identity:reduce_scatter"] for p in paths[2:4]), paths      # compressed
    assert owed[3] > 0 and paths[4] != ["identity:reduce_scatter"] and owed[4] == 0.0, (paths, owed)
    assert paths[5] == ["identity:reduce_scatter"], paths
    assert a["late"] == (0.9, [0.9], ["0", "2"], 0.0) and b["late"] == a["late"], a["late"]
    before, after, config = a["adaptive"]
    assert "topk" in before and "topk" not in after and "blockquant" in after and b["adaptive"] == a["adaptive"]
    assert not any(c.startswith("topk") for c in config)
    # options refused (each on both ranks)
    for r in (a, b):
        assert len(r["errors"]) == 3, r["errors"]
        assert "replicate_group" in r["errors"][0] and "options" in r["errors"][1]
        assert "powersgd" in r["errors"][2]
    assert "no timer on this rank" in a["error"]
    assert b["error"] is not None and "another rank failed" in b["error"]


def test_switch_keeps_each_chunks_residual_and_velocity(monkeypatch):
    """Every kind to another, world 2 rank 1: each (unit, chunk) residual and velocity is the
    same, in the input's coordinates, before and after; powersgd cannot be built."""
    monkeypatch.setenv("COMMPRESS_BACKEND", "torch")
    auto = ReduceScatterAutoCodec(auto_spec({}, exclude=("powersgd",)), momentum=0.9)
    auto.world, auto.rank = 2, 1
    auto.set_units([("u", ["w"], [(66, 48)])])
    info = auto.unit("u", 66 * 48, torch.float32)
    g = torch.Generator().manual_seed(3)
    kinds = [Choice(Candidate("topk", 0.1)), Choice(Candidate("blockquant", 4)), Choice(Candidate("bf16")),
             Choice(Candidate("blockquant", 8)), Choice(Candidate("dense"))]
    total = 0.0
    for choice in kinds:
        codec = auto.codec(info, torch.zeros(info.numel), None)
        slots = auto._unit_slots(codec, "u", info.numel, owner=True)
        assert [k for k, _, _ in slots] == [("u", 0), ("u", 1)]   # the keys the reduce-scatter uses
        for k, off, n in slots:
            codec.compress(torch.randn(n, generator=g), key=k)
        before = _owed(auto, codec, "u", info.numel)
        auto.switch("u", info.numel, choice)
        after = _owed(auto, auto.codecs["u"], "u", info.numel)
        assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1]), choice
        total += float(before[0].abs().sum() + before[1].abs().sum())
    assert total > 0 and auto.native("u") is False   # momentum: dense still runs under error feedback
    with pytest.raises(ValueError, match="powersgd"):
        auto.switch("u", info.numel, Choice(Candidate("powersgd", 1)))


def test_a_dense_units_excess_is_priced_by_its_bytes():
    """FSDP2's reduce_scatter is not the calibrated collective: what a dense unit took beyond
    the model, less the window's smallest per-round cost, is learned per second of its predicted
    collective and charged to that unit's dense candidate only (kept while the unit runs another
    kind, and in state_dict) where that collective is at least the per-round cost and 1 ms;
    every candidate pays the smallest per-round cost."""
    from commpress.auto.decide import codec_seconds, comm_seconds

    auto = ReduceScatterAutoCodec(AutoSpec())
    auto.world = 2
    net = _net(2, CostModel(0.0, 1e-9))                     # 1 GB/s, no latency
    bq = Candidate("blockquant", 8)
    dense = Choice(Candidate("dense"))

    class U:
        def __init__(self, key):
            self.key = key

    units = [U("a"), U("b"), U("c")]
    buckets = tuple(BucketMeasure(k, n, ((n,),), 0.0, {bq: 0.001}) for k, n in (("a", 4096), ("b", 1 << 20),
                                                                                  ("c", 8192)))
    comm = [comm_seconds(dense, b, net) for b in buckets]
    # every unit pays 1 ms a call; b's reduce_scatter (2 ms predicted) also runs at 2.5x, c's 0.5 ms more
    meas = (comm[0] + 0.001, 2.5 * comm[1] + 0.001, comm[2] + 0.001 + 0.0005)
    out = auto._with_round_cost(Measurements(net, buckets, 0.05, extra=meas), units)
    assert comm[1] > 0.002 and max(comm[0], comm[2]) < 1e-4
    assert auto.round_s == pytest.approx(0.001)
    assert auto.dense_rates == {"b": pytest.approx(1.5)}   # a and c: too small to read a rate from
    b = out.buckets[1]
    assert codec_seconds(dense, b, net) + comm[1] == pytest.approx(meas[1])   # dense priced as measured
    assert codec_seconds(Choice(bq), b, net) == pytest.approx(0.001 + 0.001)  # the others: per round only
    # b runs blockquant now (3 ms beyond its model): its learned dense rate stays
    auto.choices["b"] = Choice(bq)
    bq_meas = codec_seconds(Choice(bq), buckets[1], net) + \
        comm_seconds(Choice(bq), buckets[1], net) + 0.003
    out = auto._with_round_cost(Measurements(net, buckets, 0.05, extra=(meas[0], bq_meas, meas[2])), units)
    assert auto.round_s == pytest.approx(0.001) and auto.dense_rates["b"] == pytest.approx(1.5)
    assert codec_seconds(dense, out.buckets[1], net) == pytest.approx(0.001 + 1.5 * comm[1])
    restored = ReduceScatterAutoCodec(AutoSpec())
    restored.load_state_dict(auto.state_dict())
    assert restored.dense_rates == auto.dense_rates


def test_reduce_scatter_prediction_and_decision(monkeypatch):
    """Reduce-scatter terms (dense: FSDP2's own call; others: one all_to_all of a chunk's payload)
    and the decision on them: slow network compressed, fast dense; options checked."""
    monkeypatch.setenv("COMMPRESS_BACKEND", "torch")
    n, P = 4096, 2
    dense = reduce_scatter_terms(prototype(Candidate("dense")), n, P)
    assert dense == (1.0, 4.0 * n / 2, 0.0, float(n))
    bq = reduce_scatter_terms(prototype(Candidate("blockquant", 4)), n, P)
    assert bq[0] == 1.0 and 8 + n / 4 < bq[1] < dense[1] / 4
    tk = reduce_scatter_terms(prototype(Candidate("topk", 0.01)), n, P)
    assert tk[2] == P * prototype(Candidate("topk", 0.01)).capacity(n // P) and tk[1] < bq[1]
    spec = auto_spec({}, exclude=("powersgd",))
    assert all(c.kind != "powersgd" for c in spec.candidates) and not spec.user_candidates
    assert spec.config()["candidates"] == [describe(c) for c in spec.candidates]
    given = auto_spec({"candidates": [("blockquant", 4)]}, exclude=("powersgd",))
    assert given.user_candidates and given.candidates == (Candidate("blockquant", 4),)
    with pytest.raises(ValueError, match=r"\['powersgd.*cannot run in FSDP2"):
        auto_spec({"candidates": [("powersgd", 1), ("topk", 0.01)]}, exclude=("powersgd",), where="FSDP2")
    codec_s = {c: 1e-5 for c in spec.candidates if c.kind != "dense"}
    buckets = (BucketMeasure("a", n, codec_s=codec_s), BucketMeasure("b", n // 4, codec_s=codec_s))
    slow = decide(Measurements(_net(P, SLOW), buckets, 0.01), candidates=spec.candidates)
    fast = decide(Measurements(_net(P, FAST), buckets, 0.01), candidates=spec.candidates)
    assert all(c.candidate.kind != "dense" for c in slow.choices), slow.describe()
    assert all(c.candidate.kind == "dense" for c in fast.choices), fast.describe()
    with pytest.raises(ValueError, match="two-level"):
        Network(4, SLOW, 2, SLOW, SLOW, collective="reduce_scatter")
    with pytest.raises(ValueError, match="options"):
        commpress.fsdp.FSDPState("auto", ratio=0.01)
    with pytest.raises(ValueError, match="check_every"):
        commpress.fsdp.FSDPState("auto", check_every=0)
    with pytest.raises(ValueError, match="error_feedback"):
        commpress.fsdp.FSDPState("auto", error_feedback=False)
    with pytest.raises(ValueError, match="powersgd"):
        commpress.fsdp.FSDPState("auto", candidates=[("topk", 0.01), ("powersgd", 2)])
    state = commpress.fsdp.FSDPState("auto", candidates=[("topk", 0.01)], every=10)
    assert state.config()["compressor"] == "auto" and isinstance(state.compressor, AutoSpec)
    assert state.config()["compressor_params"]["candidates"] == ["topk(ratio=0.01)"]
