"""``python -m benchmarks.lean_cost``: what a lean residual store costs a step on the CPU.

Per-step process CPU time of rank 0 (2 gloo ranks, one thread each, ``time.process_time()``
around forward, backward and the optimizer step, steps 6..15 of each run, three runs per config,
interleaved) for plain DDP and blockquant 4-bit / topk 1% with ``residual_storage`` ``"fp32"``,
``"int8"`` (with ``rollback="step"``, the default, and ``"unit"``) and ``"int4"``, on the demo's models (digits: ``DigitsMLP``, batch
128; LM: ``CharLM``, 16 x 64 tokens), SGD momentum 0.9.  CPU time rather than wall time: a
machine shared with other work changes it less.  Prints min / quartile / median per config.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from .models import CharLM, DigitsMLP

LEAN = {"residual_storage": "int8", "rollback": "unit"}
CONFIGS = {
    "ddp": (None, {}),
    "blockquant4 fp32": ("blockquant", {"bits": 4, "residual_storage": "fp32"}),
    "blockquant4 int8": ("blockquant", {"bits": 4, "residual_storage": "int8"}),
    "blockquant4 int8+unit": ("blockquant", {"bits": 4, **LEAN}),
    "blockquant4 int4": ("blockquant", {"bits": 4, "residual_storage": "int4"}),
    "topk1% fp32": ("topk", {"ratio": 0.01, "residual_storage": "fp32"}),
    "topk1% int8": ("topk", {"ratio": 0.01, "residual_storage": "int8"}),
    "topk1% int8+unit": ("topk", {"ratio": 0.01, **LEAN}),
    "topk1% int4": ("topk", {"ratio": 0.01, "residual_storage": "int4"}),
}


def _batch(task: str):
    if task == "digits":
        return torch.randn(128, 64), torch.randint(0, 10, (128,))
    x = torch.randint(0, 256, (16, 64))
    return x, x


def _loss(task: str, model, x, y):
    out = model(x)
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _worker(rank: int, world: int, path: str, task: str, reps: int, steps: int, q) -> None:
    import commpress

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(path, world), rank=rank, world_size=world)
    seen: dict[str, list[float]] = {k: [] for k in CONFIGS}
    for _ in range(reps):
        for label, (name, params) in CONFIGS.items():
            torch.manual_seed(0)
            model = DDP(DigitsMLP() if task == "digits" else CharLM())
            opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
            state = commpress.ddp.register(model, name, **params) if name else None
            for step in range(steps):
                x, y = _batch(task)
                t0 = time.process_time()
                opt.zero_grad()
                _loss(task, model, x, y).backward()
                opt.step()
                if step >= 6:
                    seen[label].append(time.process_time() - t0)
            if state is not None:
                state.close()
    if rank == 0:
        q.put(json.dumps({k: sorted(v) for k, v in seen.items()}))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lean_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="digits,lm", help="comma-separated: digits, lm")
    p.add_argument("--reps", type=int, default=3, help="runs per config (interleaved)")
    p.add_argument("--steps", type=int, default=16, help="steps per run (the first 6 not timed)")
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    for task in args.tasks.split(","):
        q = ctx.SimpleQueue()
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(2, f"{tmp}/store", task, args.reps, args.steps, q), nprocs=2)
        for label, v in json.loads(q.get()).items():
            print(f"{task:6s} {label:22s} step CPU ms: min {v[0] * 1e3:.2f}  q25 {v[len(v) // 4] * 1e3:.2f}  "
                  f"median {v[len(v) // 2] * 1e3:.2f}")


if __name__ == "__main__":
    main()
