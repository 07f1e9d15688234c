"""Train a small model sharded with FSDP2 and a compressed gradient reduce-scatter; checkpoint and resume it.

    torchrun --standalone --nproc_per_node=2 examples/fsdp_train.py --steps 30
    torchrun --standalone --nproc_per_node=2 --max-restarts=1 examples/fsdp_train.py \\
             --steps 30 --ckpt /tmp/fsdp-ckpt --save-every 5

Every ``fully_shard`` unit gets commpress's reduce-scatter (blockquant 8-bit here: each
chunk goes to its owner quantized, and the owner decodes and sums it in fp32).  With
``--all-gather`` the parameter all-gather is quantized too.

Checkpoints are those of ``examples/ddp_train.py`` (its helpers: one file per rank,
written to a temporary name and renamed, the newest step complete on every rank
resumed), holding this rank's shards: the parameters' and the optimizer state's local
tensors (``DTensor.to_local()``), the rank's hook state, torch's RNG state and the step.
They load into the same world size and sharding (the hook state's residuals are per
rank anyway).  At the end rank 0 prints the step, loss, ratio and per-rank CRC-32s of
the parameter shards, the optimizer state and the hook state.

``COMMPRESS_INIT_METHOD`` (default ``env://``) names another rendezvous, as in
``examples/ddp_train.py``.
"""

from __future__ import annotations

import argparse
import os
import signal
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import commpress
from ddp_train import agreed_newest, ckpt_file, crc, write_checkpoint   # the sibling example's helpers


def local(obj: Any) -> Any:
    """``obj`` (a nested state dict) with every DTensor replaced by a copy of this rank's shard."""
    if isinstance(obj, DTensor):
        return obj.to_local().clone()
    if isinstance(obj, dict):
        return {k: local(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [local(v) for v in obj]
    return obj


def resume(folder: str, model: nn.Module, opt: torch.optim.Optimizer, state: Any) -> int:
    """Load this rank's shards of the newest complete checkpoint; the step to start at.

    Args:
        folder: the checkpoint folder.
        model: the ``fully_shard``-ed model.
        opt: its optimizer (built on ``model.parameters()``, one group).
        state: the commpress FSDP state.
    """
    step = agreed_newest(folder)
    if step is None:
        return 0
    ckpt = torch.load(ckpt_file(folder, step, dist.get_rank()), weights_only=True)
    params = list(model.parameters())
    with torch.no_grad():
        for p, saved in zip(params, ckpt["params"]):
            p.to_local().copy_(saved)
    opt_state = ckpt["opt"]
    for i, entry in opt_state["state"].items():      # shards back into DTensors shaped as their parameter
        p = params[int(i)]
        for k, v in entry.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                entry[k] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                              shape=p.shape, stride=p.stride())
    opt.load_state_dict(opt_state)
    state.load_state_dict(ckpt["commpress"])
    torch.set_rng_state(ckpt["rng"])
    return int(ckpt["step"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="train until this step (total, not more)")
    p.add_argument("--all-gather", action="store_true", help="also quantize the parameter all-gather")
    p.add_argument("--ckpt", default=None, help="checkpoint folder: resume from its newest complete checkpoint, "
                                                "save into it at the end (and every --save-every steps)")
    p.add_argument("--save-every", type=int, default=0, help="with --ckpt: also save every N steps")
    p.add_argument("--kill-at", type=int, default=None,
                   help="testing aid: on torchrun's first attempt the last rank SIGKILLs itself after this step")
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

    def save(step: int) -> None:
        write_checkpoint(args.ckpt, step, {"step": step, "params": [local(q) for q in model.parameters()],
                                           "opt": local(opt.state_dict()), "commpress": state.state_dict(),
                                           "rng": torch.get_rng_state()})

    first = resume(args.ckpt, model, opt, state) if args.ckpt else 0
    if first and rank == 0:
        print(f"resumed at step {first} (TORCHELASTIC_RESTART_COUNT={os.environ.get('TORCHELASTIC_RESTART_COUNT', '-')})",
              flush=True)
    kill = (args.kill_at is not None and rank == world - 1
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")

    loss = torch.tensor(float("nan"))
    for step in range(first, args.steps):
        g = torch.Generator().manual_seed(10_000 * step + rank)
        x = torch.randn(64, 32, generator=g)
        y = (x[:, :8].sum(1) > 0).long() + 2 * (x[:, 8:16].sum(1) > 0).long()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        done = step + 1
        if args.ckpt and args.save_every and done % args.save_every == 0 and done < args.steps:
            save(done)
        if kill and done == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)      # as a lost machine would: no cleanup, no goodbye
    if args.ckpt and first < args.steps:
        save(args.steps)

    mine = {"params": crc([local(q) for q in model.parameters()]), "opt": crc(local(opt.state_dict())),
            "hook": crc(state.state_dict())}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        cat = {k: ",".join(format(e[k], "08x") for e in every) for k in mine}
        print(f"step {args.steps} loss {float(loss.detach()):.4f} "
              f"ratio {state.stats.compression_ratio:.2f}x params-crc32 {cat['params']} opt-crc32 {cat['opt']} "
              f"hook-crc32 {cat['hook']}", flush=True)
    state.close()      # releases the hook (as the DDP example does)
    dist.barrier()     # no rank tears gloo down while a peer still has work in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
