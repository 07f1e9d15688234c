"""One collective round per bucket at P=2 (issue 17): the dense part (biases, small weights)
rides in the bucket's first unit's message instead of an all_reduce of its own.

The same training with the dense part forced back onto its own all_reduce (the path before)
gives bitwise the same parameters at P=2, where both add the two contributions alike.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run
from nets import MLP3, train_step

import commpress
from commpress.hooks import ddp_step

# (label, compressor, params): in its density warm-up's first stage (25%) topk's "auto" sends the
# whole compensated gradient in 4-bit blockquant (the gathered slots would be the larger message),
# in one all_gather which carries the dense part too
CASES = [("topk", "topk", {"ratio": 0.05, "momentum": 0.9, "density_warmup": 0}), ("blockquant", "blockquant", {"bits": 4}),
         ("topk-warmup", "topk", {"ratio": 0.05})]
STEPS = 3


def _train(name, params, rank):
    torch.manual_seed(0)
    model = DDP(MLP3(), bucket_cap_mb=0.02)  # several buckets, each with its biases
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # join_buckets=False: a round per bucket (joined rounds: test_ddp_joint.py)
    state = commpress.ddp.register(model, name, overlap=False, warmup_steps=0, min_numel=256, join_buckets=False,
                                   **params)
    rounds, algorithms = [], []
    for step in range(STEPS):
        train_step(model, opt, rank, step)
        rounds.append(state.stats.last_step["rounds"])
        algorithms.append(sorted({u["algorithm"] for u in state.stats.last_step["units"].values()}))
    out = {"params": [p.detach().clone() for p in model.parameters()], "rounds": rounds, "algorithms": algorithms,
           "buckets": len(state._layout.plans), "dense": sum(bool(p.dense_slices) for p in state._layout.plans.values()),
           "rides": state._executor.config.dense_rides,
           "declines": [u.declines_dense for u in state._layout.units]}
    state.close()
    return out


def _oneround_worker(rank, world):
    commpress.collectives.set_cost_model(1e-4, 1e-9)  # fixed numbers: no calibration (test time)
    out = {}
    for label, name, params in CASES:
        riding = _train(name, params, rank)
        saved = ddp_step.HookConfig.dense_rides
        ddp_step.HookConfig.dense_rides = property(lambda self: False)  # the path before: its own all_reduce
        try:
            separate = _train(name, params, rank)
        finally:
            ddp_step.HookConfig.dense_rides = saved
        out[label] = (riding, separate)
    commpress.collectives.set_cost_model(None)
    return out


def test_one_round_per_bucket_and_the_same_result():
    res = run(_oneround_worker, 2, timeout=120)
    for name, _, _ in CASES:
        riding, separate = res[0][name]
        assert riding["rides"] and not separate["rides"]
        assert riding["buckets"] >= 2 and riding["dense"] == riding["buckets"], riding  # biases in every bucket
        assert separate["rounds"][-1] == 2 * separate["buckets"], (name, separate["rounds"])
        if name == "topk-warmup":  # every step after the first (dense) sends the whole compensated gradient (4-bit)
            assert all(a == ["whole_blockquant"] for a in riding["algorithms"][1:] + separate["algorithms"][1:]), \
                riding["algorithms"]
        # steady state: one round per bucket, against two before (the dense part's all_reduce)
        assert not any(riding["declines"]), riding
        assert riding["rounds"][-1] == riding["buckets"], (name, riding["rounds"])
        for a, b in zip(riding["params"], separate["params"]):
            assert torch.equal(a, b), name  # bitwise the result of the separate all_reduce
        for a, b in zip(riding["params"], res[1][name][0]["params"]):
            assert torch.equal(a, b), name  # replicas identical


def _auto_worker(rank, world):
    from commpress.auto import Network
    from commpress.collectives import CostModel

    commpress.collectives.set_cost_model(1e-4, 1e-9)
    torch.manual_seed(0)
    model = DDP(MLP3(), bucket_cap_mb=0.02)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = commpress.ddp.register(model, "auto", overlap=False, min_numel=256, check_every=2,
                                   candidates=[("blockquant", 4)], remeasure=False, join_buckets=False)
    state.codec.network = Network(world, CostModel(1e-4, 1e-4))   # 10 kB/s: compress, whatever the load
    rounds = []
    for step in range(5):   # dense warm-up, two measured steps, the choice from step 3 on
        train_step(model, opt, rank, step)
        rounds.append(state.stats.last_step["rounds"])
    out = {"rounds": rounds, "buckets": len(state._layout.plans),
           "dense": sum(bool(p.dense_slices) for p in state._layout.plans.values()),
           "choices": sorted({e["choice"] for e in state.stats.as_dict()["auto"].values()}),
           "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}
    state.close()
    commpress.collectives.set_cost_model(None)
    return out


def test_auto_units_carry_the_dense_part_too():
    """With "auto", a bucket whose unit chose a kind that carries the dense part (blockquant at P=2)
    makes one round, as the fixed compressor does."""
    a, b = run(_auto_worker, 2, timeout=120)
    assert a["choices"] == ["blockquant(bits=4)"], a["choices"]
    assert a["buckets"] >= 2 and a["dense"] == a["buckets"]
    assert a["rounds"][-1] == a["buckets"], a["rounds"]
    assert torch.equal(a["params"], b["params"])
