"""What one collective round costs, and a small model's DDP step with one round or one per bucket.

``python -m benchmarks rounds`` (about a minute): 2 gloo ranks on loopback, one torch thread
each, pinned one core each (``--no-pin``: not pinned).

1. Per call of ``all_gather_single`` and ``all_reduce`` at several sizes: the median wall time
   and the process CPU (all threads: the caller and gloo's) per call.  A round's fixed cost is
   the small sizes' figure; it is what a step pays per bucket beyond its bytes.
2. The digits MLP (two DDP buckets by default: 4.2 MB and 0.26 MB of gradients) trained with
   DDP's default buckets, with ``bucket_cap_mb=25`` (one bucket: one round a step), with
   PyTorch's ``allreduce_hook`` (what a Python comm hook costs over DDP's C++ path, its
   ``1/P`` pass among it) and with commpress ``identity`` (the same path as an all-dense
   ``"auto"``); median step after a warm-up, the configurations interleaved step by step so
   that a slow moment of the machine hits them alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

SIZES = (64, 16384, 262144, 1048576)   # bytes per rank


def _rank(rank: int, world: int, store: str, pin: bool, calls: int, steps: int, warmup: int, results) -> None:
    import torch
    import torch.distributed as dist

    if pin and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {rank % (os.cpu_count() or 1)})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    rows = []
    for nbytes in SIZES:
        for op in ("all_gather", "all_reduce"):
            if op == "all_gather":
                t, out = torch.zeros(nbytes, dtype=torch.uint8), torch.empty(world * nbytes, dtype=torch.uint8)
                call = lambda: dist.all_gather_single(out, t)   # noqa: E731
            else:
                t = torch.zeros(nbytes // 4)
                call = lambda: dist.all_reduce(t)   # noqa: E731
            for _ in range(10):
                call()
            dist.barrier()
            walls = []
            c0 = time.process_time()
            for _ in range(calls):
                w0 = time.perf_counter()
                call()
                walls.append(time.perf_counter() - w0)
            cpu = (time.process_time() - c0) / calls
            rows.append({"op": op, "bytes": nbytes, "wall_ms": 1e3 * statistics.median(walls),
                         "mean_ms": 1e3 * statistics.fmean(walls), "cpu_ms": 1e3 * cpu})
    rows += _ddp_steps(rank, steps, warmup)
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def _ddp_steps(rank: int, steps: int, warmup: int) -> list[dict]:
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpress

    from .models import DigitsMLP

    configs = {"DDP default (2 buckets)": {}, "DDP bucket_cap_mb=25 (1 bucket)": {"bucket_cap_mb": 25},
               "PyTorch allreduce_hook (2 buckets)": "torch", "commpress identity (2 buckets)": "identity"}
    runs = []
    for label, kw in configs.items():
        torch.manual_seed(0)
        model = DDP(DigitsMLP(), **(kw if isinstance(kw, dict) else {}))
        state = None
        if kw == "torch":
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        elif kw == "identity":
            state = commpress.ddp.register(model, "identity")
        runs.append((label, model, torch.optim.SGD(model.parameters(), lr=0.01), state, []))
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    for s in range(warmup + steps):
        for label, model, opt, state, times in runs:
            t0 = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if s >= warmup:
                times.append(time.perf_counter() - t0)
    rows = []
    for label, model, opt, state, times in runs:
        rows.append({"op": label, "step_ms": 1e3 * statistics.median(times)})
        if state is not None:
            state.close()
    return rows


def run(calls: int = 300, steps: int = 200, pin: bool = True, warmup: int = 20) -> list[dict]:
    """Both parts on 2 spawned ranks; rank 0's rows: ``{op, bytes, wall_ms, mean_ms, cpu_ms}`` per
    (collective, size), then ``{op, step_ms}`` per DDP configuration."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="commpress-rounds-") as tmp:
        procs = [ctx.Process(target=_rank, args=(r, 2, os.path.join(tmp, "store"), pin, calls, steps, warmup,
                                                 results)) for r in range(2)]
        for proc in procs:
            proc.start()
        try:
            rows = results.get(timeout=900)
        finally:
            for proc in procs:
                proc.join(timeout=60)
                if proc.is_alive():
                    proc.kill()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks rounds", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=300, help="timed calls per (op, size) (default 300)")
    p.add_argument("--steps", type=int, default=200, help="timed DDP steps per configuration (default 200)")
    p.add_argument("--no-pin", action="store_true", help="do not pin the ranks to a core each")
    args = p.parse_args(argv)
    if args.calls < 1 or args.steps < 1:
        p.error("--calls and --steps must be >= 1")
    rows = run(args.calls, args.steps, not args.no_pin)
    pin = "not pinned" if args.no_pin else "pinned one core each"
    print(f"### One collective round (2 gloo ranks on loopback, {pin}; wall and process CPU per call)\n")
    print("| op | bytes per rank | median wall ms | mean wall ms | CPU ms |\n|---|---|---|---|---|")
    for r in rows:
        if "bytes" in r:
            print(f"| {r['op']} | {r['bytes']} | {r['wall_ms']:.3f} | {r['mean_ms']:.3f} | {r['cpu_ms']:.3f} |")
    print(f"\n### The digits MLP's DDP step ({pin}; median, interleaved)\n")
    base = next(r["step_ms"] for r in rows if "step_ms" in r)
    print("| configuration | step ms | vs DDP default |\n|---|---|---|")
    for r in rows:
        if "step_ms" in r:
            print(f"| {r['op']} | {r['step_ms']:.2f} | {r['step_ms'] / base:.3f} |")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nload average {load:.2f} at the end")
    return 0
