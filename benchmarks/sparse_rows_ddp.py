"""What ``sparse_rows`` costs where the gradient is *not* sparse (issue 52's third goal).

``python -m benchmarks.sparse_rows_ddp`` (about a minute on 2 cores): a model with an embedding of
``--rows`` x ``--dim`` fp32 and a Linear head, every row of the embedding touched at every step (a
batch holding every token id), trained on ``--world`` gloo ranks on loopback (one torch thread
each).  Side by side in one process group, step by step in a rotating order (a shared machine's
drift falls on every configuration alike):

* ``ddp``: plain DDP, no hook (the baseline);
* ``torch_hook``: PyTorch's ``allreduce_hook`` (the floor of any Python comm hook: DDP's own
  all_reduce issued from a hook, 1.02-1.08x DDP in docs/results/overhead.md);
* ``identity``: ``commpress.ddp.register(model, "identity")`` (DDP's own path, through the hook);
* ``auto``: the same with ``sparse_rows="auto"``: the first steps measure every 2-D parameter's
  nonzero rows, find them dense, and keep DDP's path; a re-check every 100 steps counts them
  again (one pass over each on the device, an 8-byte all_reduce);
* ``declared``: ``sparse_rows=[emb.weight]``: its first rows call finds it dense and sends it in
  its bucket's dense part from then on (re-checked likewise).

Prints, per configuration, the mean and median step (forward, backward with the hook, SGD step)
over the steps after ``--skip``, the ratio of each mean to plain DDP's and to the identity hook's,
the median over the steps of the per-step ratio to DDP's (the configurations of one step run back
to back: a shared machine's drift cancels), the path each rows parameter ended on and the hook's
memory overhead (process-wide caches included, so the same figure for every hook of the
process); ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

CONFIGS = ("ddp", "torch_hook", "identity", "auto", "declared")


def _rank(rank: int, world: int, store: str, args, results) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpress

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(args.rows, args.dim)
            self.fc = nn.Linear(args.dim, 64)

        def forward(self, ids):
            return self.fc(self.emb(ids)).sum(1)

    models, opts, states = {}, {}, {}
    for name in CONFIGS:
        torch.manual_seed(0)
        model = DDP(Net())
        if name == "torch_hook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.allreduce_hook)
        elif name != "ddp":
            rows = {"identity": None, "auto": "auto", "declared": [model.module.emb.weight]}[name]
            states[name] = commpress.ddp.register(model, "identity", sparse_rows=rows)
        models[name], opts[name] = model, torch.optim.SGD(model.parameters(), lr=0.01)
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        ids = torch.randperm(args.rows, generator=g).reshape(-1, 100)   # every row touched
        order = CONFIGS[step % len(CONFIGS):] + CONFIGS[:step % len(CONFIGS)]
        for name in order:
            model, opt = models[name], opts[name]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            model(ids).pow(2).mean().backward()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    out = {"times": times, "rows": {}, "memory": {}}
    for name, state in states.items():
        report = state.stats.as_dict()
        out["rows"][name] = {k: v["path"] for k, v in report.get("sparse_rows", {}).items()}
        out["memory"][name] = report["memory_overhead_bytes"]
        state.close()
    results.put((rank, out))
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=50000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=230, help="steps per configuration (re-checks at 100, 200)")
    ap.add_argument("--skip", type=int, default=5, help="first steps left out (warm-up, the measuring steps)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, args.world, store, args, results)) for r in range(args.world)]
        for p in procs:
            p.start()
        got = dict(results.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join()
    r0 = got[0]
    base = statistics.fmean(r0["times"]["ddp"][args.skip:])
    summary = {"rows": args.rows, "dim": args.dim, "world": args.world, "steps": args.steps, "skip": args.skip,
               "configs": {}}
    print(f"embedding {args.rows} x {args.dim} fp32, every row touched; {args.world} gloo ranks, loopback; "
          f"{args.steps} steps each, the first {args.skip} left out (rank 0's clock)")
    ident = statistics.fmean(r0["times"]["identity"][args.skip:])
    print(f"{'config':10s} {'mean ms':>8s} {'median ms':>10s} {'mean/ddp':>9s} {'mean/identity':>14s} "
          f"{'median of step/ddp':>19s} {'step/identity':>14s}  paths, memory")
    for name in CONFIGS:
        t = r0["times"][name][args.skip:]
        mean, med = statistics.fmean(t), statistics.median(t)
        per_step = statistics.median(a / b for a, b in zip(t, r0["times"]["ddp"][args.skip:]))
        per_ident = statistics.median(a / b for a, b in zip(t, r0["times"]["identity"][args.skip:]))
        row = {"mean_ms": 1e3 * mean, "median_ms": 1e3 * med, "ratio": mean / base, "ratio_identity": mean / ident,
               "median_step_ratio": per_step, "median_step_ratio_identity": per_ident, "paths": r0["rows"].get(name, {}),
               "memory_overhead_bytes": r0["memory"].get(name)}
        summary["configs"][name] = row
        mem = row["memory_overhead_bytes"]
        print(f"{name:10s} {row['mean_ms']:8.2f} {row['median_ms']:10.2f} {row['ratio']:9.3f} "
              f"{row['ratio_identity']:14.3f} {per_step:19.3f} {per_ident:14.3f}  {row['paths'] or ''} {'' if mem is None else mem}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
