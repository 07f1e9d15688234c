"""The DDP hook with ``hierarchy=2`` on 4 gloo ranks (2 nodes x 2): training, replicas, resume."""

from __future__ import annotations

import io
import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run

import commpress


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(10 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x @ torch.linspace(-1, 1, 32 * 4, dtype=torch.float32).reshape(32, 4)


def make(seed=0):
    torch.manual_seed(seed)
    # no biases: a dense part is summed by gloo in an order that depends on DDP's bucket layout,
    # which differs in a fresh model's first step (last-bit differences, flat hooks too)
    return DDP(nn.Sequential(nn.Linear(32, 64, bias=False), nn.Tanh(), nn.Linear(64, 4, bias=False)),
               bucket_cap_mb=1)


def steps(model, opt, rank, first, last):
    losses = []
    for s in range(first, last):
        x, y = batch(rank, s)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _worker(rank, world, compressor, params):
    os.environ["COMMPRESS_BACKEND"] = "torch"
    model = make()
    state = commpress.ddp.register(model, compressor, hierarchy=2, min_numel=0, warmup_steps=1, **params)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = steps(model, opt, rank, 0, 12)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, buf)
    cont = steps(model, opt, rank, 12, 16)
    a = flat_params(model)
    algorithms = state.stats.as_dict().get("algorithms", {})
    state.close()
    # resume from the checkpoint in a fresh model and hook
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    model2 = make(seed=1)
    model2.load_state_dict(ck["model"])
    state2 = commpress.ddp.register(model2, compressor, hierarchy=2, min_numel=0, warmup_steps=1, **params)
    state2.load_state_dict(ck["hook"])
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05)
    opt2.load_state_dict(ck["opt"])
    cont2 = steps(model2, opt2, rank, 12, 16)
    b = flat_params(model2)
    codec = ck["hook"]["codec"]
    shard_keys = [k for k in codec["residuals"]["keys"] if "'shard'" in repr(k)] if "residuals" in codec else []
    state2.close()
    return (a.view(torch.int32).tolist(), torch.equal(a, b), losses[0], sum(cont) / len(cont), cont == cont2,
            sorted(algorithms.values()), len(shard_keys))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("compressor,params",
                         [("topk", {"ratio": 0.1}), ("powersgd", {"rank": 2}), ("blockquant", {"bits": 8})])
def test_ddp_two_level_trains_identical_replicas_and_resumes(compressor, params):
    res = run(_worker, 4, compressor, params, timeout=110)
    bits = [r[0] for r in res]
    assert all(b == bits[0] for b in bits), "replicas drifted apart"
    for _, same, first, last, same_losses, algorithms, nkeys in res:
        assert same and same_losses, "resume from the checkpoint diverged"
        assert last < 0.6 * first, (first, last)  # the mean loss of steps 12..15 against step 0's
        assert any(a.startswith("two_level") for a in algorithms), algorithms
        assert nkeys > 0


def _bad_worker(rank, world):
    model = make()
    commpress.ddp.register(model, "topk", ratio=0.1, hierarchy=3)


def test_ddp_hierarchy_not_dividing_the_world_raises_everywhere():
    res = run(_bad_worker, 4, timeout=60, return_exceptions=True)
    assert all(getattr(r, "type", None) == "ValueError" for r in res), res


def _auto_worker(rank, world):
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    model = make()
    state = commpress.ddp.register(model, "topk", ratio=0.1, hierarchy="auto", overlap=False)
    try:
        return repr(state.hierarchy), state.config()["hierarchy"]
    finally:
        state.close()


def test_ddp_hierarchy_auto_reads_local_world_size():
    res = run(_auto_worker, 4, timeout=60)
    assert res == [("Hierarchy(local_size=2, nodes=2, mode='auto')", "auto")] * 4
