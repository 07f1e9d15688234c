"""Train a small model with DDP and a commpress hook; checkpoint it, resume it, survive a lost worker.

One process per rank, launched by ``torchrun`` (gloo on CPU)::

    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --steps 40
    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --steps 20 --ckpt /tmp/ckpt
    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --steps 40 --ckpt /tmp/ckpt  # resumes at 20

Elastic: with ``--save-every N`` a checkpoint is written every ``N`` steps, and
``torchrun --max-restarts=1`` restarts the workers when one dies; they resume from the
newest complete checkpoint and end bitwise equal to a run that never stopped::

    torchrun --standalone --nproc_per_node=2 --max-restarts=1 examples/ddp_train.py \\
             --steps 40 --ckpt /tmp/ckpt --save-every 5

Several machines: the same script on each node, e.g. two nodes of 4 ranks, with
``--hierarchy auto`` (dense inside a node, compressed between nodes, where it pays)::

    torchrun --nnodes=2 --nproc_per_node=4 --max-restarts=1 \\
             --rdzv_backend=c10d --rdzv_endpoint=<host of node 0>:29400 \\
             examples/ddp_train.py --hierarchy auto --ckpt /shared/ckpt --save-every 50

The hook state is built without the model (``DDPState("blockquant", bits=8)``), as
PyTorch's ``register_comm_hook`` and Lightning's ``DDPStrategy(ddp_comm_state=...)``
take it; ``state.bind(model)`` binds it before the first step.  A checkpoint is one
file per rank, ``<ckpt>/step<STEP>-rank<R>.pt``: model, optimizer, the rank's hook
state (error-feedback residuals are per rank), torch's RNG state and the step (the
data position: batches are a pure function of rank and step).  Each file is written
to a temporary name and renamed (``os.replace``); a step is complete when every rank's
file is there, and the newest complete step is the one resumed.  ``--ckpt`` must be
a folder every node sees (a shared file system).

At the end rank 0 prints one line: the step, loss, compression ratio, CRC-32s of the
parameters, the optimizer state and each rank's hook state, whether every replica's
parameters and optimizer state are identical, the hierarchy the hook runs (``2x2``: 2
nodes of 2 ranks; ``flat``) and rank 0's median step time.

``COMMPRESS_INIT_METHOD`` (default ``env://``, what torchrun sets up) can name
another rendezvous, e.g. ``file:///tmp/store`` with ``RANK`` and ``WORLD_SIZE`` set.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import time
import zlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress

CKPT_RE = re.compile(r"^step(\d+)-rank(\d+)\.pt$")


def batch(rank: int, step: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch at ``step``: a pure function of both, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    x = torch.randn(n, 32, generator=g)
    return x, (x[:, :8].sum(1) > 0).long() + 2 * (x[:, 8:16].sum(1) > 0).long()


def ckpt_file(folder: str, step: int, rank: int) -> str:
    """Path of ``rank``'s checkpoint at ``step``."""
    return os.path.join(folder, f"step{step:08d}-rank{rank}.pt")


def newest_complete(folder: str, world: int) -> int | None:
    """The newest step for which all ``world`` ranks' files exist in ``folder`` (None: none)."""
    if not os.path.isdir(folder):
        return None
    ranks: dict[int, set[int]] = {}
    for name in os.listdir(folder):
        m = CKPT_RE.match(name)
        if m:
            ranks.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    done = [s for s, have in ranks.items() if have >= set(range(world))]
    return max(done, default=None)


def write_checkpoint(folder: str, step: int, blob: dict[str, Any]) -> None:
    """Write this rank's ``blob`` as its checkpoint at ``step`` atomically, then (once every rank
    has written its own) delete this rank's older ones.  Collective (a barrier).

    Args:
        folder: the checkpoint folder (shared by every node).
        step: steps done.
        blob: what to save (tensors, numbers, strings, lists, dicts: ``weights_only`` loads it).
    """
    rank = dist.get_rank()
    os.makedirs(folder, exist_ok=True)
    path = ckpt_file(folder, step, rank)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(blob, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)           # a reader sees the whole file or none
    dist.barrier()                  # step is complete on every rank: older ones can go
    for name in os.listdir(folder):
        m = CKPT_RE.match(name)
        if m and int(m.group(2)) == rank and int(m.group(1)) < step:
            os.remove(os.path.join(folder, name))


def agreed_newest(folder: str) -> int | None:
    """The newest checkpoint step of ``folder`` complete for every rank, the same on every rank
    (an ``all_reduce`` MIN); None when there is none.  Collective.

    Args:
        folder: the checkpoint folder.
    """
    newest = newest_complete(folder, dist.get_world_size())
    agreed = torch.tensor([-1 if newest is None else newest])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return None if int(agreed) < 0 else int(agreed)


def save(folder: str, step: int, model: DDP, opt: torch.optim.Optimizer, state: Any) -> None:
    """This rank's checkpoint at ``step``: model, optimizer, hook state, RNG state, the step.

    Args:
        folder: the checkpoint folder (shared by every node).
        step: steps done.
        model: the DDP model.
        opt: its optimizer.
        state: the commpress hook state (``state_dict()`` per rank).
    """
    write_checkpoint(folder, step, {"step": step, "model": model.module.state_dict(), "opt": opt.state_dict(),
                                    "commpress": state.state_dict(), "rng": torch.get_rng_state()})


def resume(folder: str, model: DDP, opt: torch.optim.Optimizer, state: Any) -> int:
    """Load the newest complete checkpoint of ``folder`` (agreed by every rank); the step to start at.

    Args:
        folder: the checkpoint folder.
        model: the DDP model.
        opt: its optimizer.
        state: the commpress hook state (its own rank's state is loaded; applied when it binds).
    """
    step = agreed_newest(folder)
    if step is None:
        return 0
    ckpt = torch.load(ckpt_file(folder, step, dist.get_rank()), weights_only=True)
    model.module.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    # per rank; applied (and checked against this run's configuration) when the state binds
    state.load_state_dict(ckpt["commpress"])
    torch.set_rng_state(ckpt["rng"])
    return int(ckpt["step"])


def crc(obj: Any, acc: int = 0) -> int:
    """CRC-32 over every tensor and plain value of a (nested) state dict, in order."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy().tobytes(), zlib.crc32(str(t.dtype).encode(), acc))
    if isinstance(obj, dict):
        for k in obj:
            acc = crc(obj[k], zlib.crc32(repr(k).encode(), acc))
        return acc
    if isinstance(obj, (list, tuple)):
        for v in obj:
            acc = crc(v, acc)
        return acc
    return zlib.crc32(repr(obj).encode(), acc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="train until this step (total, not more)")
    p.add_argument("--ckpt", default=None, help="checkpoint folder: resume from its newest complete checkpoint, "
                                                "save into it at the end (and every --save-every steps)")
    p.add_argument("--save-every", type=int, default=0, help="with --ckpt: also save every N steps")
    p.add_argument("--compressor", default="blockquant")
    p.add_argument("--bits", type=int, default=8, help="blockquant bit width")
    p.add_argument("--hierarchy", default=None, choices=["auto"],
                   help="'auto': nodes from torchrun's LOCAL_WORLD_SIZE, dense inside a node where it pays")
    p.add_argument("--kill-at", type=int, default=None,
                   help="testing aid: on torchrun's first attempt the last rank SIGKILLs itself after this step")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=os.environ.get("COMMPRESS_INIT_METHOD", "env://"),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    params: dict[str, Any] = {"bits": args.bits} if args.compressor == "blockquant" else {}
    if args.hierarchy:
        params["hierarchy"] = args.hierarchy
    state = commpress.ddp.DDPState(args.compressor, **params)
    model.register_comm_hook(state, commpress.ddp.hook)

    first = resume(args.ckpt, model, opt, state) if args.ckpt else 0
    state.bind(model)   # on every rank, before the first step (a loaded state is checked and applied here)
    if first and rank == 0:
        # torchrun's restart count is per node: a node restarted for a peer's failure keeps its count
        print(f"resumed at step {first} (TORCHELASTIC_RESTART_COUNT={os.environ.get('TORCHELASTIC_RESTART_COUNT', '-')})",
              flush=True)
    kill = (args.kill_at is not None and rank == world - 1
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")

    loss, times = torch.tensor(float("nan")), []
    for step in range(first, args.steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        x, y = batch(rank, step)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        done = step + 1
        if args.ckpt and args.save_every and done % args.save_every == 0 and done < args.steps:
            save(args.ckpt, done, model, opt, state)
        if kill and done == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)      # as a lost machine would: no cleanup, no goodbye

    if args.ckpt and first < args.steps:
        save(args.ckpt, args.steps, model, opt, state)
    report(args.steps, loss, model, opt, state, times)
    state.close()
    dist.destroy_process_group()


def report(step: int, loss: torch.Tensor, model: DDP, opt: torch.optim.Optimizer, state: Any,
           times: list[float]) -> None:
    """Rank 0 prints the result line (collective: every rank's checksums are gathered); ``times``:
    this attempt's step times (the median leaves out the first 3: DDP's bucket rebuild, binding)."""
    mine = {"params": crc([q for q in model.parameters()]), "opt": crc(opt.state_dict()),
            "hook": crc(state.state_dict()) if state.bound else 0}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        stats = state.stats.as_dict() if state.bound else {"compression_ratio": 1.0}
        h = state.hierarchy if state.bound else None
        levels = f"{h.nodes}x{h.local_size}" if h is not None else "flat"
        same = all(e["params"] == mine["params"] and e["opt"] == mine["opt"] for e in every)
        step_ms = 1e3 * statistics.median(times[3:] or times) if times else float("nan")
        print(f"step {step} loss {float(loss.detach()):.4f} ratio {stats['compression_ratio']:.2f}x "
              f"params-crc32 {mine['params']:08x} opt-crc32 {mine['opt']:08x} "
              f"hook-crc32 {','.join(format(e['hook'], '08x') for e in every)} "
              f"replicas-identical {same} hierarchy {levels} step-ms {step_ms:.2f}", flush=True)


if __name__ == "__main__":
    main()
