"""Joined buckets (``join_buckets``, :mod:`commpress.collectives.joint`): each bucket's message is held
until the next unit that runs carries it, so a step of a model in several DDP buckets makes one round
where every unit takes a steady lane, and trains bitwise as with a round per bucket: blockquant,
topk with the optimizer's momentum taken over, ``"auto"``, with the overlap worker and inline, across
DDP's bucket rebuild after the first step, at P=2 and P=3.  A NaN/inf in a held unit on one rank
poisons that unit on every rank and keeps the residuals, as without joining; a kernel that raises on
one rank while its unit is held fails the step on every rank (nobody hangs in the shared round)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from bitwise import same
from distributed import run
from nets import MLP3, train_step

import commpress
from commpress.collectives import set_cost_model

STEPS = 5
CASES = {   # (compressor, register keywords): the steady lanes, and "auto" choosing one of them
    "blockquant": ("blockquant", {"bits": 4}),
    "topk": ("topk", {"ratio": 0.05, "density_warmup": 0, "takeover": True}),
    # inside its density warm-up: the whole compensated gradient in 4-bit (steady.whole_plan_for), held alike
    "topk-warmup": ("topk", {"ratio": 0.05, "takeover": True}),
    "auto": ("auto", {"check_every": 2, "candidates": [("blockquant", 4)], "remeasure": False}),
}


def _train(rank, world, name, join, overlap=True, nan_step=None):
    compressor, kw = CASES[name]
    kw = dict(kw)
    torch.manual_seed(0)
    model = DDP(MLP3(), bucket_cap_mb=0.01)   # several buckets; rebuilt after the first step
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if kw.pop("takeover", False):
        kw["optimizer"] = opt
    if world > 2:   # no dense part (it would not ride in a gather_all at P=3: no lane, nothing held)
        kw.update(dense_1d=False, min_numel=0)
    else:
        kw.update(min_numel=256)
    state = commpress.ddp.register(model, compressor, warmup_steps=1 if compressor != "auto" else 0,
                                   join_buckets=join, overlap=overlap, **kw)
    if compressor == "auto":
        from commpress.auto import Network
        from commpress.collectives import CostModel

        state.codec.network = Network(world, CostModel(1e-4, 1e-4))   # a slow link: compress, whatever the load
    if nan_step is not None:
        def poison(g):
            if rank == 1 and state.step == nan_step:
                g = g.clone()
                g[0, 0] = float("nan")
            return g
        model.module.fc3.weight.register_hook(poison)   # in DDP's first bucket: a held unit
    rounds, grads, residuals = [], [], []
    for step in range(STEPS):
        if nan_step is not None and step == nan_step:
            residuals.append(state.residuals_by_param())
        train_step(model, opt, rank, step) if nan_step is None or step != nan_step else _no_step(model, rank, step)
        if nan_step is not None and step == nan_step:
            grads.append([p.grad.clone() for p in model.parameters()])
            residuals.append(state.residuals_by_param())
        rounds.append(state.stats.last_step["rounds"])
    out = {"params": [p.detach().clone() for p in model.parameters()], "rounds": rounds,
           "algorithms": sorted({u["algorithm"] for u in state.stats.last_step["units"].values()}),
           "units": len(state._layout.units), "grads": grads, "residuals": residuals,
           "choices": sorted({e["choice"] for e in state.stats.as_dict().get("auto", {}).values()})}
    state.close()
    return out


def _no_step(model, rank, step):
    """A step whose gradients are read, not applied (a NaN step: an AMP scaler would skip it)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()


def joint_worker(rank, world, names):
    set_cost_model(1.0, 0.0)   # "auto" algorithms: gather_all in one message at P=2 and 3
    out = {}
    for name in names:
        out[name] = {join: _train(rank, world, name, join) for join in (True, False)}
    if world == 2:
        out["inline"] = {join: _train(rank, world, "blockquant", join, overlap=False) for join in (True, False)}
        out["nan"] = {join: _train(rank, world, "blockquant", join, nan_step=3) for join in (True, False)}
        set_cost_model(1.0, 1e-5)   # 100 kB/s: a held message would spend longer than HOLD_MAX_WIRE_S on the wire
        out["slow"] = {join: _train(rank, world, "blockquant", join) for join in (True, False)}
        # ... unless join_buckets gives a wire limit of its own (inf: none): held, one round a step
        out["limit"] = {join: _train(rank, world, "blockquant", join) for join in (math.inf, False)}
    set_cost_model(None)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,names", [(2, ("blockquant", "topk", "topk-warmup", "auto")), (3, ("blockquant",))])
def test_joined_buckets_train_bitwise_in_one_round_a_step(world, names):
    res = run(joint_worker, world, names, timeout=230)
    for r in res:
        for name, got in r.items():
            on = math.inf if name == "limit" else True
            joined, alone = got[on], got[False]
            assert same(joined["params"], alone["params"]), (world, name)
            assert same(joined["params"], res[0][name][on]["params"]), (world, name)   # replicas alike
            if name == "nan":
                continue
            if name == "slow":   # nothing held: the rounds of every unit (pipelined here) either way
                assert joined["rounds"] == alone["rounds"] and alone["rounds"][-1] >= alone["units"] >= 2, got
                continue
            if name == "limit":   # held all the same (unpipelined), riding in the last unit's first message:
                # its 2 pipelined rounds, against 2 for every unit
                assert joined["rounds"][-1] == 2 and alone["rounds"][-1] == 2 * alone["units"] >= 4, got
                continue
            # the last steps (after DDP's rebuild): every unit's message in one all_gather, against one each
            assert alone["units"] >= 2 and alone["rounds"][-1] == alone["units"], (name, alone["rounds"])
            assert joined["rounds"][-2:] == [1, 1], (name, joined["rounds"])
            if name == "topk-warmup":
                assert joined["algorithms"] == ["whole_blockquant"], joined["algorithms"]
            if name == "auto":
                assert joined["choices"] == alone["choices"] == ["blockquant(bits=4)"], joined["choices"]
    if world == 2:
        for r in res:
            nan = r["nan"]
            assert same(nan[True]["grads"], nan[False]["grads"]) and same(nan[True]["residuals"], nan[False]["residuals"])
            grads = dict(zip(dict(MLP3().named_parameters()), nan[True]["grads"][0]))
            assert torch.isnan(grads["fc3.weight"]).all()        # the held unit poisoned on every rank
            assert torch.isfinite(grads["fc1.weight"]).all()     # the carrier's (DDP's last bucket) not
            before, after = nan[True]["residuals"]
            assert before and same(before, after)                        # and the residuals kept


def failing_worker(rank, world):
    """Rank 1's blockquant kernel raises at step 3's first call: DDP's first bucket, held."""
    from commpress.ops import numba_backend

    set_cost_model(1.0, 0.0)
    torch.manual_seed(0)
    model = DDP(MLP3(), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = commpress.ddp.register(model, "blockquant", bits=4, min_numel=256, join_buckets=True)
    real = numba_backend.quantize_feedback_into
    armed = {"on": False}

    def flaky(*a, **k):
        if rank == 1 and armed["on"]:
            armed["on"] = False
            raise RuntimeError("boom in a held unit")
        return real(*a, **k)

    errors = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(numba_backend, "quantize_feedback_into", flaky)
        for step in range(5):
            armed["on"] = step == 3
            try:
                train_step(model, opt, rank, step)
                errors.append(None)
            except RuntimeError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
    state.close()
    set_cost_model(None)
    return errors


@pytest.mark.timeout(120)
def test_a_held_unit_that_fails_fails_the_step_on_every_rank():
    a, b = run(failing_worker, 2, timeout=110)
    assert a[3] is not None and b[3] is not None, (a, b)
    assert "rank(s) [1]" in a[3] and "boom in a held unit" in b[3], (a, b)
    assert "HookError" in a[3] or "CollectiveInputError" in a[3], a
    assert a[4] is None and b[4] is None, (a, b)   # the next step runs (the failed one was rolled back)


def test_join_buckets_is_none_a_bool_or_a_wire_limit_and_fingerprinted_when_set():
    for bad in ("yes", 1):   # an int reads as a bool but would be a one-second limit: refused
        with pytest.raises(TypeError, match="join_buckets"):
            commpress.ddp.DDPState("topk", ratio=0.01, join_buckets=bad)
    for bad in (0.0, -1e-3, float("nan")):
        with pytest.raises(ValueError, match="join_buckets"):
            commpress.ddp.DDPState("topk", ratio=0.01, join_buckets=bad)
    assert commpress.ddp.DDPState("topk", ratio=0.01, join_buckets=0.005).config()["join_buckets"] == 0.005
    assert commpress.ddp.DDPState("topk", ratio=0.01, join_buckets=False).config()["join_buckets"] is False
    assert "join_buckets" not in commpress.ddp.DDPState("topk", ratio=0.01).config()   # older checkpoints load
