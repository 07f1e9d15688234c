"""What the DDP hook keeps alive between steps: lean residual storage, and stats that tell the truth."""

from __future__ import annotations

import io

import pytest
import torch

from distributed import run

import commpress
from commpress.storage import bytes_per_element

from test_ddp import batch, loss_of, make_ddp   # noqa: E402  (tests/hooks is on the path)
from memory_walk import storages_bytes


def _train(rank, model, opt, steps, first=0):
    for step in range(first, first + steps):
        opt.zero_grad()
        loss_of(model, *batch(rank, step, seed=3)).backward()
        opt.step()


def _run(rank, world, compressor, params, storage, steps):
    model = make_ddp(seed=3, bucket_cap_mb=25)   # one bucket: the fused CPU lanes run it
    state = commpress.ddp.register(model, compressor, warmup_steps=1, residual_storage=storage, **params)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(rank, model, opt, steps)
    mem = state.stats.as_dict()["memory"]
    counted = storages_bytes(state, exclude=[p for p in model.parameters()] + [p.grad for p in model.parameters()])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, buf)
    # resume from the checkpoint into a new model and hook, then one more step each
    b = make_ddp(seed=9, bucket_cap_mb=25)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    b.load_state_dict(ckpt["model"])
    s_b = commpress.ddp.register(b, compressor, warmup_steps=1, residual_storage=storage, **params)
    o_b = torch.optim.SGD(b.parameters(), lr=0.1)
    o_b.load_state_dict(ckpt["opt"])
    s_b.load_state_dict(ckpt["hook"])
    _train(rank, model, opt, 2, steps)
    _train(rank, b, o_b, 2, steps)
    resumed = all(torch.equal(x, y) for x, y in zip(model.parameters(), b.parameters()))
    weights = [p.detach().numpy().copy() for p in model.parameters()]
    compressed = sum(p.numel() for p in model.parameters() if p.dim() > 1)
    state.close()
    s_b.close()
    return mem, counted, resumed, weights, compressed


@pytest.mark.timeout(200)
@pytest.mark.parametrize("compressor,params", [("topk", {"ratio": 0.05}), ("blockquant", {"bits": 4})])
def test_lean_storage_trains_identical_replicas_and_counts_what_it_keeps(compressor, params):
    figures = {}
    for storage in ("fp32", "int8"):
        res = run(_run, 2, compressor, params, storage, 4, timeout=180)
        (mem, counted, resumed, w0, compressed), (_, _, _, w1, _) = res
        assert all((a == b).all() for a, b in zip(w0, w1)), "replicas differ"
        assert resumed, "the resume from a checkpoint is not bitwise"
        assert mem["bytes"] == sum(mem["by_kind"].values()) == counted
        if storage == "fp32":   # one fp32 residual per compressed element (the small layers go dense)
            elements = mem["by_kind"]["residuals"] // 4
            assert 0 < elements <= compressed
        per = bytes_per_element(storage)
        assert per * elements <= mem["by_kind"]["residuals"] <= per * elements + 3 * 132   # int8: 3 padded blocks
        assert mem["by_kind"]["working"] == 0
        figures[storage] = mem["bytes"]
    assert figures["int8"] < 0.6 * figures["fp32"]


def test_residual_storage_is_checked():
    with pytest.raises(ValueError, match="residual_storage must be one of"):
        commpress.ddp.DDPState("topk", ratio=0.01, residual_storage="fp4")
    with pytest.raises(ValueError, match="residual_storage must be 'fp32' with compressor 'auto'"):
        commpress.ddp.DDPState("auto", residual_storage="int8")
