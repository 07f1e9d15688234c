"""Small models shared by the multi-process hook tests (importable by the rank workers)."""

from __future__ import annotations

import torch
from torch import nn


class MLP3(nn.Module):
    """Three linear layers (32 -> 96 -> 64 -> 8): weights of 3072, 6144 and 512 elements."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 96)
        self.fc2 = nn.Linear(96, 64)
        self.fc3 = nn.Linear(64, 8)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def small_net() -> nn.Module:
    """32 -> 96 -> 8 with ReLU, seeded (identical on every rank)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Linear(96, 8))


def train_step(model, opt, rank: int, step: int) -> None:
    """One classification step on this rank's batch of ``step`` (16 x 32, 8 classes)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def fsdp_shard(model: nn.Module, world_size: int) -> nn.Module:
    """FSDP2 on CPU / gloo: each ``Linear`` of a ``Sequential`` its own unit, plus the root.

    Sets the torch reference ops (a fresh worker would otherwise JIT-compile the numba
    kernels: seconds per process; their parity with the reference is tested in tests/ops)."""
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ["COMMPRESS_BACKEND"] = "torch"
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def with_params(net: nn.Module, params) -> nn.Module:
    """``net`` with its parameters overwritten by ``params`` (a saved list, in order): a resumed replica."""
    with torch.no_grad():
        for p, q in zip(net.parameters(), params):
            p.copy_(q)
    return net
