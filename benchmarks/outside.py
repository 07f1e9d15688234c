"""Issue 55.8's training loop, written as a user would (``python -m benchmarks.outside``).

Not the sweep's harness: a ``64-1448-1448-10`` MLP on digits (2.21M parameters, one DDP
bucket), ``DDP(model)``, ``SGD(lr=0.05, momentum=0.9)``, batch 32 per rank, 200 steps, test
accuracy every 10 steps, target 0.90.  commpress is registered in one line
(``commpress.ddp.register(ddp, kind, optimizer=opt, **kw)``; ``optimizer=`` left out for the
configs named ``-nomc``).  Each config runs ``--rounds`` times, interleaved (config A, B, ...,
then again), on 2 ranks of one core each (loopback, or ``--net`` links; see
:mod:`benchmarks.netem`).  Printed per run: the median step (forward, backward, hook,
``opt.step()``), the step at which the test accuracy first reaches the target and the time to
it (the summed walls of the steps up to it), and what ``"auto"`` chose.  Ratios are to DDP's
run of the same round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

#: name -> (register's compressor, its keywords, pass ``optimizer=``); "ddp": no hook;
#: "torch-allreduce-hook": PyTorch's own ``allreduce_hook`` (the floor of a comm hook that averages in Python)
CONFIGS = {
    "ddp": None,
    "torch-allreduce-hook": None,
    "identity": ("identity", {}, False),
    "auto-opt": ("auto", {}, True),
    "auto": ("auto", {}, False),
    "auto-opt-inline": ("auto", {"overlap": False}, True),
    "auto-opt-fp32": ("auto", {"residual_storage": "fp32"}, True),   # residuals and velocities exact
    "identity-opt": ("identity", {}, True),
    "blockquant-4bit": ("blockquant", {"bits": 4}, False),
    "topk-1%-mc": ("topk", {"ratio": 0.01}, True),
    "powersgd-r4": ("powersgd", {"rank": 4}, False),
}


FIRST = 8   # the first steps' walls, printed with --walls (where a config's start-up goes)


def rank_main(rank: int, world_size: int, *, report, config: str, steps: int = 200, lr: float = 0.05,
              hidden: int = 1448, seed: int = 0, eval_every: int = 10, target: float = 0.90) -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpress

    from . import data

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    xtr, ytr, xte, yte = data.digits(seed)
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, 10))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    state = None
    if config == "torch-allreduce-hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    if CONFIGS[config] is not None:
        kind, kw, takeover = CONFIGS[config]
        state = commpress.ddp.register(ddp, kind, **({"optimizer": opt} if takeover else {}), **kw)
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    walls, hit, hit_s, accs = [], None, None, []
    for step in range(1, steps + 1):
        idx = torch.randint(0, len(xtr), (32,), generator=gen)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(xtr[idx]), ytr[idx]).backward()
        opt.step()
        walls.append(time.perf_counter() - t0)
        if step % eval_every == 0:
            with torch.no_grad():
                correct = (model(xte).argmax(1) == yte).sum().float()
            both = torch.stack([correct, torch.tensor(float(len(yte)))])
            torch.distributed.all_reduce(both)
            acc = float(both[0] / both[1])
            accs.append(acc)
            if hit is None and acc >= target:
                hit, hit_s = step, sum(walls)
    chose, switches = "", {}
    if state is not None and config.startswith("auto"):
        units = {u: r for u, r in state.stats.as_dict().get("auto", {}).items() if isinstance(r, dict)}
        chose = ", ".join(sorted({r.get("choice", "?") for r in units.values()}))
        switches = {u: r.get("switches", []) for u, r in units.items()}
    if state is not None:
        state.close()
    return {"median_ms": statistics.median(walls) * 1e3, "hit": hit, "hit_s": hit_s, "final_acc": accs[-1] if accs else None,
            "chose": chose, "switches": switches, "total_s": sum(walls), "first_ms": [round(w * 1e3, 1) for w in walls[:FIRST]]}


def main(argv: list[str] | None = None) -> int:
    from .netem import launch

    p = argparse.ArgumentParser(prog="python -m benchmarks.outside", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="ddp,auto-opt,auto,identity-opt", help=f"from {sorted(CONFIGS)}".replace("%", "%%"))
    p.add_argument("--net", default=None, help="emulated link, e.g. 1gbit or 100mbit (default: loopback)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--walls", action="store_true", help=f"also print each run's first {FIRST} step walls (ms) and auto's switches")
    args = p.parse_args(argv)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in names if c not in CONFIGS]
    if bad:
        raise SystemExit(f"unknown configs {bad}; choose from {sorted(CONFIGS)}")
    print(f"net {args.net or 'loopback'}, 2 ranks, seed {args.seed}, {args.steps} steps")
    print("| round | config | median step ms | vs DDP | steps to 0.90 | time to target s | final acc | auto chose |")
    print("|---|---|---|---|---|---|---|---|")
    for r in range(args.rounds):
        ddp_ms = None
        for name in names:
            out = launch("benchmarks.outside:rank_main", 2, net=args.net, pin=True,
                         kwargs={"config": name, "steps": args.steps, "seed": args.seed})[0]
            if name == "ddp":
                ddp_ms = out["median_ms"]
            ratio = f"{out['median_ms'] / ddp_ms:.2f}x" if ddp_ms else ""
            hit_s = f"{out['hit_s']:.2f}" if out["hit_s"] is not None else "not reached"
            print(f"| {r + 1} | {name} | {out['median_ms']:.1f} | {ratio} | {out['hit'] or '-'} | {hit_s} | "
                  f"{out['final_acc'] if out['final_acc'] is None else format(out['final_acc'], '.3f')} | {out['chose']} |",
                  flush=True)
            if args.walls:
                print(f"  first steps of {name} (ms): {out['first_ms']}", flush=True)
                if out["switches"]:
                    print(f"  switches of {name} (unit: [[step, choice], ...]): {out['switches']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
