"""Train a small model sharded with FSDP2 and a compressed gradient reduce-scatter.

    torchrun --standalone --nproc_per_node=2 examples/fsdp_train.py --steps 30

Every ``fully_shard`` unit gets commpress's reduce-scatter (blockquant 8-bit here: each
chunk goes to its owner quantized, and the owner decodes and sums it in fp32).  With
``--all-gather`` the parameter all-gather is quantized too.  The hook state is per rank
(``state.state_dict()``, one file per rank), like the DDP example's.

``COMMPRESS_INIT_METHOD`` (default ``env://``) names another rendezvous, as in
``examples/ddp_train.py``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import commpress


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--all-gather", action="store_true", help="also quantize the parameter all-gather")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=os.environ.get("COMMPRESS_INIT_METHOD", "env://"),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = commpress.fsdp.register(model, "blockquant", bits=8,
                                    all_gather="blockquant" if args.all_gather else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    loss = torch.tensor(float("nan"))
    for step in range(args.steps):
        g = torch.Generator().manual_seed(10_000 * step + rank)
        x = torch.randn(64, 32, generator=g)
        y = (x[:, :8].sum(1) > 0).long() + 2 * (x[:, 8:16].sum(1) > 0).long()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    if rank == 0:
        print(f"step {args.steps} loss {float(loss.detach()):.4f} "
              f"ratio {state.stats.compression_ratio:.2f}x", flush=True)
    state.close()      # releases the hook (as the DDP example does)
    dist.barrier()     # no rank tears gloo down while a peer still has work in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
