"""``register(model, "auto", hierarchy=2)`` on 4 gloo ranks (an emulated 2 x 2 topology).

One 4-rank run: with synthetic network models, a slow inter-node link (fast inside a node)
makes some unit take the two-level path, a fast network everywhere brings every unit back to
the flat path; every rank makes the same choices; replicas stay bitwise equal; a path switch
keeps what error feedback owes (this rank's residual slots + its carry for the next input,
bitwise); a resume with a carry pending is bitwise up to the next check point.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run
from nets import train_step, with_params

import commpress
from commpress.auto import Network
from commpress.collectives.costmodel import CostModel

def Net():
    # no biases: a dense part is summed by gloo in an order that depends on DDP's bucket layout,
    # which differs in a fresh model's first step (last-bit differences at 4 ranks, flat hooks too)
    return nn.Sequential(nn.Linear(32, 96, bias=False), nn.ReLU(), nn.Linear(96, 64, bias=False), nn.ReLU(),
                         nn.Linear(64, 8, bias=False))


SLOW = CostModel(1e-3, 1e-4)     # 10 kB/s: far above the per-round framework time, even loaded
FAST = CostModel(1e-7, 1e-13)


def _owed(auto, key, numel):
    """What this rank owes for a unit: its codec's residual slots on the unit's path, plus the
    carry waiting for the unit's next input (unit coordinates)."""
    res = torch.zeros(numel)
    codec, path = auto.codecs[key], auto.choices[key].path
    for k, off, n in auto._path_slots(codec, key, numel, path, owner=True):
        r = codec.residual(k)
        if r is not None:
            res[off:off + n] += r.reshape(-1)
    c = auto.carried(key)
    if c is not None:
        res += c
    return res


def _train(model, opt, rank, steps):
    for step in steps:
        train_step(model, opt, rank, step)


def _register(model):
    return commpress.ddp.register(model, "auto", hierarchy=2, min_numel=256, check_every=2, every=2, margin=0.0)


def _net(world, intra, inter):
    return Network(world, inter, local_size=2, intra=intra, inter=inter)


def two_level_worker(rank, world):
    os.environ["COMMPRESS_BACKEND"] = "torch"
    commpress.collectives.set_cost_model(1e-4, 1e-9)   # no calibration at binding (the test sets the models)
    out = {}
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = _register(model)
    auto = state.codec
    moved, history = [], []
    original = auto.switch

    def spy(key, numel, choice):
        old_path = auto.choices[key].path
        before = _owed(auto, key, numel)
        original(key, numel, choice)
        after = _owed(auto, key, numel)
        moved.append((old_path, choice.path, torch.equal(before, after), float(before.abs().sum())))
    auto.switch = spy
    auto.network = _net(world, SLOW, SLOW)        # both links slow: compress on the flat path
    _train(model, opt, rank, range(1))            # check point at the end of step 0 (the warm-up step)
    history.append(sorted((n, e["choice"]) for n, e in state.stats.as_dict()["auto"].items()))
    auto.network = _net(world, FAST, SLOW)        # a slow link between nodes: the two-level path pays
    _train(model, opt, rank, range(1, 3))         # check point at the end of step 2
    history.append(sorted((n, e["choice"]) for n, e in state.stats.as_dict()["auto"].items()))
    out["carry"] = sorted(auto._carry)            # flat -> two-level: the rest of this rank's residual waits
    saved = (state.state_dict(), [p.detach().clone() for p in model.parameters()], opt.state_dict())
    auto.network = _net(world, FAST, FAST)        # fast everywhere: flat (from the check at the end of step 4)
    _train(model, opt, rank, [3])                 # sends the carries
    out["carry_after"] = sorted(auto._carry)
    out["algorithms"] = sorted(set(state.stats.algorithms.values()))   # step 3 ran the two-level choices
    _train(model, opt, rank, [4])
    history.append(sorted((n, e["choice"]) for n, e in state.stats.as_dict()["auto"].items()))
    out["history"], out["moved"] = history, moved
    out["params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    state.close()

    # resume from the end of step 2 (carries pending): bitwise through step 4
    hook_state, params, opt_state = saved
    torch.manual_seed(1)
    model2 = DDP(with_params(Net(), params), bucket_cap_mb=0.01)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05)
    opt2.load_state_dict(opt_state)
    state2 = _register(model2)
    state2.codec.network = _net(world, FAST, FAST)
    state2.load_state_dict(hook_state)
    _train(model2, opt2, rank, range(3, 5))
    out["resumed"] = torch.cat([p.detach().reshape(-1) for p in model2.parameters()])
    state2.close()

    # hierarchy="auto" (torchrun's LOCAL_WORLD_SIZE): the hook's hierarchy keeps its mode, the auto
    # codec's two-level units get a two-level one; with momentum correction the decision stays flat
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    model3 = DDP(Net(), bucket_cap_mb=0.01)
    opt3 = torch.optim.SGD(model3.parameters(), lr=0.05, momentum=0.9)
    state3 = commpress.ddp.register(model3, "auto", hierarchy="auto", optimizer=opt3, min_numel=256,
                                    check_every=2, every=2, margin=0.0, remeasure=False)
    auto3 = state3.codec
    out["auto_modes"] = (state3.hierarchy.mode, auto3.hierarchy.mode, auto3.network.local_size, auto3.momentum)
    auto3.network = _net(world, FAST, SLOW)
    _train(model3, opt3, rank, range(3))
    out["momentum_choices"] = sorted(e["choice"] for e in state3.stats.as_dict()["auto"].values())
    state3.close()
    commpress.collectives.set_cost_model(None)
    return out


@pytest.mark.timeout(150)
def test_register_auto_two_by_two():
    res = run(two_level_worker, 4, timeout=140)
    a = res[0]
    for r in res[1:]:   # every rank made the same choices, replicas stayed bitwise identical
        assert r["history"] == a["history"]
        assert torch.equal(r["params"], a["params"])
        assert torch.equal(r["resumed"], r["params"])   # resume with carries pending: bitwise
    slow, split, fast = ([c for _, c in h] for h in a["history"])
    assert all(not c.endswith("+two_level") for c in slow) and any(c != "dense" for c in slow), slow
    assert any(c.endswith("+two_level") for c in split), split
    assert any(x.startswith("two_level+") for x in a["algorithms"]), a["algorithms"]
    assert all(not c.endswith("+two_level") for c in fast), fast
    assert torch.equal(a["resumed"], a["params"])
    assert a["auto_modes"] == ("auto", "two_level", 2, 0.9)
    assert a["momentum_choices"] and all(not c.endswith("+two_level") for c in a["momentum_choices"])
    assert any(c != "dense" for c in a["momentum_choices"]), a["momentum_choices"]   # the slow link was seen
    for r in res:
        # every switch kept what is owed bitwise (residual slots + carry), across paths too
        assert r["moved"] and all(ok for *_, ok, _ in r["moved"]), r["moved"]
        crossed = [(p, q, owed) for p, q, _, owed in r["moved"] if p != q]
        assert {(p, q) for p, q, _ in crossed} == {("flat", "two_level"), ("two_level", "flat")}, crossed
        assert any(owed > 0 for *_, owed in crossed)
        assert r["carry"] and not r["carry_after"], (a["history"], r["moved"])   # a carry waits after the switch, sent by the next step


def test_two_level_needs_a_hierarchy_and_no_momentum():
    """The two-level path is refused without a node layout, and with momentum correction (a
    velocity cannot be split across paths: the check point then decides on the flat network)."""
    from commpress.auto import Candidate, Choice
    from commpress.auto.runtime import AutoCodec, AutoSpec

    with pytest.raises(ValueError, match="hierarchy"):
        AutoCodec(AutoSpec())._build(Choice(Candidate("bf16"), "two_level"))
    auto = AutoCodec(AutoSpec(), momentum=0.9)
    auto.hierarchy = object()
    with pytest.raises(ValueError, match="momentum"):
        auto._build(Choice(Candidate("bf16"), "two_level"))


def test_switch_across_paths_keeps_what_is_owed(monkeypatch):
    """Every kind on both paths, one after another (a 2 x 2 layout seen from local rank 1 of node
    0): this rank's residual slots + its carry are bitwise the same before and after each switch,
    including two-level kinds whose shards differ (powersgd cuts between matrices)."""
    from commpress.auto import Candidate, Choice
    from commpress.auto.runtime import AutoCodec, AutoSpec
    from commpress.collectives.hierarchy import shard_bounds

    monkeypatch.setenv("COMMPRESS_BACKEND", "torch")

    class H:   # what the switch reads of a Hierarchy(2) on 4 ranks, at group rank 1
        local_size, nodes, local_rank, node = 2, 2, 1, 0

        def bounds(self, numel, compressor=None, shape=None, shapes=None):
            return shard_bounds(numel, 2, compressor, shape, shapes)

    class U:
        key, shapes, names = "u", [(96, 32), (64, 96)], ["a", "b"]
        numel = 96 * 32 + 64 * 96

    auto = AutoCodec(AutoSpec())
    auto.world, auto.rank, auto.hierarchy, auto._units = 4, 1, H(), [U]
    g = torch.Generator().manual_seed(5)
    plan = [("topk", 0.1, "flat"), ("blockquant", 4, "two_level"), ("powersgd", 1, "two_level"),
            ("topk", 0.1, "two_level"), ("bf16", None, "flat"), ("blockquant", 8, "flat"),
            ("blockquant", 8, "two_level"), ("dense", None, "two_level"), ("dense", None, "flat")]
    carried = 0
    for kind, param, path in plan:
        codec = auto.codec(U, torch.zeros(U.numel), 0)
        for k, off, n in auto._path_slots(codec, U.key, U.numel, auto.choices[U.key].path, owner=True):
            codec.compress(torch.randn(n, generator=g), key=k)    # something owed in every slot
        before = _owed(auto, U.key, U.numel)
        auto.switch(U.key, U.numel, Choice(Candidate(kind, param), path))
        assert torch.equal(before, _owed(auto, U.key, U.numel)), (kind, param, path)
        c = auto.carried(U.key)
        carried += 0 if c is None else int((c != 0).sum())
        auto._carry.clear()   # as if the next step sent it
    assert carried > 0


def test_carry_is_sent_once_and_kept_by_a_bad_step():
    """A carry goes into the unit's next input (after the hook's 1/P), committed with the step:
    dropped by a clean commit, kept by a step with a NaN/inf (as a residual) or a rollback."""
    from commpress.auto.runtime import AutoCodec, AutoSpec
    from commpress.feedback import ResidualTransaction

    class U:
        key, numel, shapes, names = "u", 8, [(8,)], ["w"]

    auto = AutoCodec(AutoSpec())
    owed = torch.arange(8, dtype=torch.float32)
    for outcome in ("rollback", "bad", "clean"):
        auto._carry[U.key] = owed.clone()
        t = torch.ones(8)
        tx = ResidualTransaction()
        auto.codec(U, t, 0, tx)
        assert torch.equal(t, 1 + owed)
        if outcome == "rollback":
            tx.rollback()
        else:
            tx.commit(torch.tensor(outcome == "bad"))
        kept = auto.carried(U.key)
        assert (kept is not None and torch.equal(kept, owed)) == (outcome != "clean"), outcome
