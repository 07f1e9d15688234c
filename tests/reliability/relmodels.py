"""Tiny models, batches and gradient hashes shared by the reliability tests."""

from __future__ import annotations

import hashlib

import torch
from torch import nn


class Net(nn.Module):
    """Weights of 1024, 4096 (``hidden=64``) and 512 elements; biases 64, ``hidden``, 8."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, hidden)
        self.fc3 = nn.Linear(hidden, 8)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def make_ddp(seed: int = 0, bucket_cap_mb: float = 0.001, **kw):
    """``DDP(Net())``; the default bucket cap gives every weight its own bucket."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    return DDP(Net(), bucket_cap_mb=bucket_cap_mb, **kw)


def make_fsdp(world: int, seed: int = 0, per_layer: bool = True, mesh=None, **kw):
    """``Net`` under FSDP2 on a CPU mesh: each Linear its own unit (``per_layer``) plus the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Net()
    mesh = mesh if mesh is not None else init_device_mesh("cpu", (world,))
    if per_layer:
        for m in (model.fc1, model.fc2, model.fc3):
            fully_shard(m, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def batch(rank: int, i: int, n: int = 8):
    g = torch.Generator().manual_seed(100 * i + rank)
    return torch.randn(n, 16, generator=g), torch.randint(0, 8, (n,), generator=g)


def step(model, rank: int, i: int) -> None:
    """zero_grad + forward + backward on this rank's batch of step ``i``."""
    x, y = batch(rank, i)
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()


def digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.detach().contiguous().view(torch.uint8).numpy().tobytes(),
                           digest_size=8).hexdigest()


def grad_hashes(model) -> dict[str, str | None]:
    """A hash of every parameter's gradient (DTensor gradients: of the full tensor)."""
    module = getattr(model, "module", model)
    out = {}
    for n, p in module.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[n] = None if g is None else digest(g)
    return out
