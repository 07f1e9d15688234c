"""register(..., momentum=m) in the DDP and FSDP2 hooks: DGC momentum correction in the error feedback, plain momentum
for the parameters DDP sends dense, all of it in the checkpoint."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run
from nets import small_net as _net, train_step as _step

import commpress


def momentum_worker(rank, world):
    model = DDP(_net(), bucket_cap_mb=0.01)
    state = commpress.ddp.register(model, "topk", ratio=0.05, momentum=0.9, min_numel=256)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = {"ef_momentum": state.codec.momentum, "dense": sorted(state.dense_param_names)}
    prev = None
    for step in range(5):
        _step(model, opt, rank, step)
        if step >= 1:
            vel = {k: v.clone() for k, v in state.dense_momentum.velocity.items()}
            grads = dict(model.module.named_parameters())
            out.setdefault("grad_is_velocity", True)
            out["grad_is_velocity"] &= all(torch.equal(grads[k].grad.view(-1), v) for k, v in vel.items())
            if prev is not None:
                out["velocity_moves"] = any(not torch.equal(prev[k], vel[k]) for k in vel)
            prev = vel
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    out["saved_keys"] = sorted(saved["extra"])
    out["has_velocities"] = "velocities" in saved["codec"]
    model2 = DDP(_net(), bucket_cap_mb=0.01)
    state2 = commpress.ddp.register(model2, "topk", ratio=0.05, momentum=0.9, min_numel=256)
    state2.load_state_dict(saved)
    out["dense_restored"] = all(torch.equal(state2.dense_momentum.velocity[k], v)
                                for k, v in state.dense_momentum.velocity.items())
    state.close()
    state2.close()
    return out


@pytest.mark.timeout(120)
def test_momentum_correction_through_the_hook():
    for out in run(momentum_worker, 2, timeout=110):
        assert out["ef_momentum"] == 0.9
        assert out["dense"] == ["0.bias", "2.bias"]
        assert out["grad_is_velocity"] and out["velocity_moves"]
        assert "dense_velocity" in out["saved_keys"] and out["has_velocities"]
        assert out["dense_restored"]


def test_momentum_needs_error_feedback():
    from commpress.hooks.common import wrap_error_feedback

    with pytest.raises(ValueError, match="needs error feedback"):
        wrap_error_feedback(commpress.get("topk", ratio=0.1), False, momentum=0.9)
    codec, used = wrap_error_feedback(commpress.get("fp16"), "auto", momentum=0.5)
    assert used and codec.momentum == 0.5


def fsdp_momentum_worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2], model):
        fully_shard(layer, mesh=mesh)
    state = commpress.fsdp.register(model, "topk", ratio=0.05, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(3):
        _step(model, opt, rank, step)
    codec = state.codec
    return codec.momentum, len(codec._velocity), all(bool(torch.isfinite(p).all()) for p in model.parameters())


@pytest.mark.timeout(120)
def test_momentum_correction_through_the_fsdp2_hook():
    for momentum, n_velocities, finite in run(fsdp_momentum_worker, 2, timeout=110):
        assert momentum == 0.9 and n_velocities > 0 and finite
