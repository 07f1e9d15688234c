"""Hybrid sharding on 4 gloo ranks: 2 replicas x 2 shards, the replica all-reduce compressed.

torch 2.13's FSDP2 gives no hook to replace the all-reduce of native HSDP (2-D mesh), so
commpress shards each replica with the 1-D shard mesh and all-reduces across replicas in
FSDP2's all-reduce hook (``register(..., replicate_group=...)``).  Native 2-D HSDP is the
dense reference.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from distributed import run

import commpress


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def shard(model, mesh):
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 16, generator=g)
    return x, torch.tanh(x[:, :4] - x[:, 4:8])


def train(model, rank, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for s in range(steps):
        x, y = batch(rank, s)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def local(model):
    return torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()]).tolist()


def _hsdp(rank, world):
    os.environ["COMMPRESS_BACKEND"] = "torch"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ref = shard(make_model(), mesh)                       # native HSDP, dense all-reduce
    ref_losses = train(ref, rank, 30)
    out = {"ref": (local(ref), ref_losses)}
    for name, comp, params in (("identity", "identity", {}), ("topk", "topk", {"ratio": 0.25})):
        model = shard(make_model(), mesh["shard"])
        state = commpress.fsdp.register(model, comp, replicate_group=mesh["replicate"].get_group(), **params)
        losses = train(model, rank, 30)
        algorithms = set(state.stats.as_dict().get("algorithms", {}).values())
        out[name] = (local(model), losses, sorted(algorithms), state.stats.as_dict().get("compression_ratio"))
    # a 2-D mesh cannot have its replica all-reduce replaced: a clear error, on every rank
    try:
        commpress.fsdp.register(shard(make_model(), mesh), "topk", ratio=0.1,
                                replicate_group=mesh["replicate"].get_group())
        out["2d_error"] = None
    except ValueError as exc:
        out["2d_error"] = str(exc)
    return out


@pytest.mark.timeout(120)
def test_hsdp_with_compressed_replica_all_reduce():
    res = run(_hsdp, 4, timeout=110)
    for r in range(4):
        ref_params, ref_losses = res[r]["ref"]
        ident, _, algos, _ = res[r]["identity"]
        assert algos == ["identity:replica_allreduce"]
        assert torch.allclose(torch.tensor(ident), torch.tensor(ref_params), atol=1e-5), \
            "identity replica all-reduce != native HSDP"
        topk, losses, algos, ratio = res[r]["topk"]
        assert algos == ["topk:replica_allreduce"]
        assert losses[-1] < 0.5 * losses[0], losses
        assert ratio > 1.0
        assert "1-D shard mesh" in res[r]["2d_error"]
    for name in ("identity", "topk"):  # the two replicas of each shard hold bitwise the same parameters
        assert res[0][name][0] == res[2][name][0]
        assert res[1][name][0] == res[3][name][0]
