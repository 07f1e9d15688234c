"""Train a small model with DDP and a commpress hook; checkpoint and resume it.

One process per rank, launched by ``torchrun`` (gloo on CPU)::

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --steps 40
    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --steps 20 --ckpt /tmp/ckpt
    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --steps 40 --ckpt /tmp/ckpt  # resumes at 20

Several machines: the same script on each node, e.g. two nodes of 4 ranks::

    torchrun --nnodes=2 --nproc_per_node=4 --node_rank=<0|1> \\
             --rdzv_backend=c10d --rdzv_endpoint=<host of node 0>:29400 examples/ddp_train.py

The hook state is built without the model (``DDPState("blockquant", bits=8)``), as
PyTorch's ``register_comm_hook`` and Lightning's ``DDPStrategy(ddp_comm_state=...)``
take it; it binds to the model at the first synchronized bucket.  A checkpoint is
the model and optimizer (rank 0's copy) plus one hook state per rank (error-feedback
residuals are per rank).  A resumed run continues bitwise as if never stopped.

``COMMPRESS_INIT_METHOD`` (default ``env://``, what torchrun sets up) can name
another rendezvous, e.g. ``file:///tmp/store`` with ``RANK`` and ``WORLD_SIZE`` set.
"""

from __future__ import annotations

import argparse
import os
import zlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress


def batch(rank: int, step: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch at ``step``: a pure function of both, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(n, 32, generator=g)
    return x, (x[:, :8].sum(1) > 0).long() + 2 * (x[:, 8:16].sum(1) > 0).long()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="train until this step (total, not more)")
    p.add_argument("--ckpt", default=None, help="checkpoint folder: resume from it if present, save into it at the end")
    p.add_argument("--compressor", default="blockquant")
    p.add_argument("--bits", type=int, default=8, help="blockquant bit width")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=os.environ.get("COMMPRESS_INIT_METHOD", "env://"),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    params = {"bits": args.bits} if args.compressor == "blockquant" else {}
    state = commpress.ddp.DDPState(args.compressor, **params)
    model.register_comm_hook(state, commpress.ddp.hook)

    first = 0
    if args.ckpt and os.path.exists(os.path.join(args.ckpt, "train.pt")):
        ckpt = torch.load(os.path.join(args.ckpt, "train.pt"), weights_only=True)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        # per rank; applied (and checked against this run's configuration) when the state binds
        state.load_state_dict(torch.load(os.path.join(args.ckpt, f"hook-rank{rank}.pt"), weights_only=True))
        first = ckpt["step"]

    loss = torch.tensor(float("nan"))
    for step in range(first, args.steps):
        opt.zero_grad()
        x, y = batch(rank, step)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    if args.ckpt:
        os.makedirs(args.ckpt, exist_ok=True)
        torch.save(state.state_dict(), os.path.join(args.ckpt, f"hook-rank{rank}.pt"))
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": args.steps},
                       os.path.join(args.ckpt, "train.pt"))
        dist.barrier()
    if rank == 0:
        flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
        checksum = zlib.crc32(flat.numpy().tobytes())
        stats = state.stats.as_dict() if state.bound else {"compression_ratio": 1.0}
        print(f"step {args.steps} loss {float(loss.detach()):.4f} ratio {stats['compression_ratio']:.2f}x "
              f"params-crc32 {checksum:08x}", flush=True)
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
