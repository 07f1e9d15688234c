"""A DDPState built without its model binds at its first bucket (PyTorch's and Lightning's way)."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from distributed import run
from test_ddp import batch, fast_ops, loss_of, make_ddp

import commpress
from commpress.hooks.ddp import DDPState, hook


def _train(model, opt, rank, first, steps):
    for step in range(first, first + steps):
        opt.zero_grad()
        loss_of(model, *batch(rank, step, seed=7)).backward()
        opt.step()


def _lazy_vs_eager(rank, world, overlap, algorithm):
    fast_ops()
    eager = make_ddp(seed=3)
    lazy = make_ddp(seed=3)
    s_eager = commpress.ddp.register(eager, "topk", ratio=0.05, overlap=overlap, algorithm=algorithm)
    s_lazy = DDPState("topk", ratio=0.05, overlap=overlap, algorithm=algorithm)
    lazy.register_comm_hook(s_lazy, hook)
    bound_before = s_lazy.bound
    o_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    o_l = torch.optim.SGD(lazy.parameters(), lr=0.1)
    # one model steps, then the other: the lazy state binds (collectives) while the
    # eager one's overlap worker is idle, as in a program that trains two models
    for step in range(4):
        _train(eager, o_e, rank, step, 1)
        _train(lazy, o_l, rank, step, 1)
    same = all(torch.equal(a, b) for a, b in zip(eager.parameters(), lazy.parameters()))
    flat = torch.cat([p.detach().reshape(-1) for p in lazy.parameters()])
    s_lazy.close()
    s_eager.close()
    return (bound_before, s_lazy.bound, s_lazy.overlap, same, s_lazy.step,
            s_lazy.stats.compression_ratio, flat.numpy().copy(), sorted(s_lazy.compressed_param_names))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "inline"])
def test_lazy_state_binds_at_first_bucket_and_matches_register(overlap):
    res = run(_lazy_vs_eager, 2, overlap, "allgather", timeout=100)
    for bound_before, bound, got_overlap, same, step, ratio, _, names in res:
        assert not bound_before and bound
        assert got_overlap == overlap
        assert same  # bitwise the run of commpress.ddp.register
        assert step == 4 and ratio > 1.0
        assert names == ["fc1.weight", "fc2.weight"]
    assert (res[0][6] == res[1][6]).all()


@pytest.mark.timeout(120)
def test_lazy_state_calibrates_the_cost_model_inside_the_first_bucket():
    # algorithm="auto": the calibration is a collective run from the hook call on every rank
    res = run(_lazy_vs_eager, 2, True, "auto", timeout=100)
    assert all(r[1] and r[4] == 4 for r in res)
    assert (res[0][6] == res[1][6]).all()  # replicas agree


def _mismatch(rank, world):
    fast_ops()
    model = make_ddp()
    state = DDPState("topk", ratio=0.01 if rank == 0 else 0.02)
    model.register_comm_hook(state, hook)
    try:
        loss_of(model, *batch(rank, 0)).backward()
    except Exception as exc:  # noqa: BLE001 - returned to the parent
        return type(exc).__name__, str(exc), state.bound
    return None


@pytest.mark.timeout(120)
def test_lazy_config_mismatch_raises_from_backward_on_every_rank():
    res = run(_mismatch, 2, timeout=100, pg_timeout=20)
    for got in res:
        assert got is not None, "a mismatched configuration trained silently"
        assert "compressor_params.ratio" in got[1]
        assert got[2] is False


def _resume_lazy(rank, world):
    fast_ops()
    full = make_ddp(seed=5)
    s_full = commpress.ddp.register(full, "topk", ratio=0.05)
    o_full = torch.optim.SGD(full.parameters(), lr=0.1, momentum=0.9)
    _train(full, o_full, rank, 0, 6)

    a = make_ddp(seed=5)
    s_a = DDPState("topk", ratio=0.05)
    a.register_comm_hook(s_a, hook)
    o_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    _train(a, o_a, rank, 0, 3)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": o_a.state_dict(), "hook": s_a.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)

    b = make_ddp(seed=99)
    b.load_state_dict(ckpt["model"])
    s_b = DDPState("topk", ratio=0.05)
    s_b.load_state_dict(ckpt["hook"])       # before binding: kept, checked at the first bucket
    b.register_comm_hook(s_b, hook)
    o_b = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    o_b.load_state_dict(ckpt["opt"])
    _train(b, o_b, rank, 3, 3)
    return s_b.step, all(torch.equal(x, y) for x, y in zip(full.parameters(), b.parameters()))


@pytest.mark.timeout(120)
def test_lazy_state_resumes_a_checkpoint_loaded_before_binding():
    for step, same in run(_resume_lazy, 2, timeout=100):
        assert step == 6 and same


def test_lazy_state_builds_without_a_process_group():
    state = DDPState("topk", ratio=0.01)
    assert not state.bound and state.world_size == 1
    with pytest.raises(RuntimeError, match="not bound"):
        state.state_dict()
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        DDPState(nn.Linear(2, 2), "topk", ratio=0.01)
    with pytest.raises(TypeError, match="compressor"):
        DDPState()
    with pytest.raises(ValueError, match="warmup_steps"):
        DDPState("topk", ratio=0.01, warmup_steps=-1)
    state.close()
