"""DDP with the commpress hook on the GPU: the sync check and the training checks of gpu_check.sh.

    python -m benchmarks.gpu_ddp sync   [--dry-run] [--out FILE.json]
    python -m benchmarks.gpu_ddp shared [--dry-run] [--out FILE.json] [--steps 60]
    python -m benchmarks.gpu_ddp nccl   [--out FILE.json] [--steps 60]

* ``sync``: one process (gloo, world 1, so no collective runs in the step and any
  synchronization is commpress's), for every registered compressor (:data:`CONFIGS`): DDP with
  the hook (``overlap=True``), a few warm-up steps, then steady-state steps under
  ``torch.cuda.set_sync_debug_mode("error")``.  Records, per compressor, whether a step
  synchronized and which backend ran each op (:func:`commpress.ops.backends_used`).
* ``shared``: 2 ranks sharing the one GPU over gloo with CUDA tensors, overlap on: plain DDP,
  then the hook with identity (must end bitwise equal to plain DDP), topk 1%, blockquant 4-bit
  and powersgd (must train: lower the mean loss of the last 5 steps below the first 5's by at
  least half as much as plain DDP does; replicas bitwise equal across ranks).
* ``nccl``: the same runs over NCCL on 2 GPUs (says skipped with fewer).

``--dry-run``: CPU tensors and the host build of the kernels (benchmarks/gpu_common.py), a
smaller model and fewer steps.  Exit status 1 on a failed check.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

#: (label, compressor, parameters): every registered compressor at least once.
CONFIGS = [
    ("plain DDP (no hook)", None, {}),  # baseline: a sync here is DDP's or torch's, not commpress's
    ("identity", "identity", {}),
    ("fp16", "fp16", {}),
    ("bf16", "bf16", {}),
    ("fp8 e4m3", "fp8", {}),
    ("fp8 e5m2 stochastic", "fp8", {"format": "e5m2", "stochastic": True}),
    ("mx fp8", "mx", {}),
    ("mx fp4 stochastic", "mx", {"element": "fp4_e2m1", "stochastic": True}),
    ("blockquant 8b", "blockquant", {}),
    ("blockquant 4b stochastic", "blockquant", {"bits": 4, "block": 64, "stochastic": True}),
    ("qsgd", "qsgd", {}),
    ("terngrad", "terngrad", {}),
    ("signsgd (EF)", "signsgd", {}),
    ("topk 1%", "topk", {"ratio": 0.01}),
    ("randomk 1%", "randomk", {"ratio": 0.01}),
    ("dgc 1%", "dgc", {"ratio": 0.01}),
    ("threshold", "threshold", {"threshold": 0.01}),
    ("powersgd r4", "powersgd", {"rank": 4}),
    ("sparseloco", "sparseloco", {}),
]
#: The training runs of ``shared`` / ``nccl`` (None: plain DDP).
RUNS = [("plain", None, {}), ("identity", "identity", {}), ("topk", "topk", {"ratio": 0.01}),
        ("blockquant", "blockquant", {"bits": 4, "block": 64}), ("powersgd", "powersgd", {"rank": 4})]
TRAINS = ("topk", "blockquant", "powersgd")


def _model(dry_run: bool) -> nn.Module:
    """An MLP: 1.2M parameters on the GPU; 4k on the dry run (the host build runs each CUDA thread
    as a fiber on one core: slow), one layer of which is compressed (min_numel 1024)."""
    width = 24 if dry_run else 1024
    return nn.Sequential(nn.Linear(128, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


#: What a synchronization raises: torch's sync debug mode, or the dry run's stand-in.
SYNC_MESSAGE = "synchronizing CUDA operation"


def _batch(step: int, rank: int, device, batch: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(1000 * step + rank)
    x = torch.randn(batch, 128, generator=g)
    teacher = torch.Generator(device="cpu").manual_seed(12345)
    w = torch.randn(128, 10, generator=teacher)
    return x.to(device), (x @ w).argmax(1).to(device)


def _ddp(model: nn.Module, device: torch.device):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)


def _step(model, opt, x, y) -> torch.Tensor:
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


# ---------------------------------------------------------------- sync check (one process)
def check_coverage() -> list[str]:
    """Registered compressors missing from :data:`CONFIGS` (a new one must be added there)."""
    from commpress.compressors import base

    return sorted(set(base.available()) - {name for _, name, _ in CONFIGS if name})


def sync_check(env, warm: int = 3, steps: int = 2) -> dict:
    """Every compressor's steady-state DDP step under ``env.no_syncs()``; one result per config."""
    import commpress
    import commpress.ops as ops

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            for label, name, params in CONFIGS:
                torch.manual_seed(0)
                row = {"config": label, "compressor": name, "params": params}
                state = None
                try:
                    model = _ddp(_model(env.dry_run), env.device)
                    if name is not None:
                        state = commpress.ddp.register(model, name, overlap=True, **params)
                    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                    for s in range(warm):
                        _step(model, opt, *_batch(s, 0, env.device, 64))
                    batches = [_batch(warm + s, 0, env.device, 64) for s in range(steps)]
                    env.synchronize()
                    ops.backends_used(reset=True)
                    try:
                        with env.no_syncs():
                            for x, y in batches:
                                _step(model, opt, x, y)
                        row["sync_free"] = True
                    except Exception as exc:  # a sync (possibly wrapped by the collective), or a crash
                        where = traceback.format_exc()
                        if SYNC_MESSAGE not in where:
                            raise
                        row["sync_free"] = False
                        row["sync_error"] = f"{exc}"[:400]
                        row["where"] = where[-3000:]
                    env.synchronize()
                    row["backends"] = ops.backends_used(reset=True)
                    row["ok"] = True
                except Exception:  # a crash (not a sync): a failure of the check
                    row["ok"] = False
                    row["error"] = traceback.format_exc()[-2000:]
                finally:
                    if state is not None:
                        state.close()
                results.append(row)
                status = ("ok, sync-free" if row.get("sync_free") else "ok, SYNCS") if row["ok"] else "FAILED"
                on_torch = sorted(op for op, b in row.get("backends", {}).items() if b != "cuda")
                print(f"gpu_ddp sync: {label:28s} {status}"
                      + (f"  (ops on the reference: {', '.join(on_torch)})" if on_torch else ""))
                if not row["ok"]:
                    print(row["error"])
                elif not row["sync_free"]:
                    print(f"  {row['sync_error']}\n{row['where']}")
        finally:
            dist.destroy_process_group()
    missing = check_coverage()
    if missing:
        print(f"gpu_ddp sync: FAILED: compressors without a config in CONFIGS: {missing}")
    return {"device": env.name, "dry_run": env.dry_run, "rows": results, "missing_configs": missing,
            "ok": not missing and all(r["ok"] for r in results)}


# ---------------------------------------------------------------- training on 2 ranks
def _worker(rank: int, world: int, store_path: str, steps: int, mode: str, dry_run: bool, queue) -> None:
    try:
        import commpress

        torch.set_num_threads(1)
        if dry_run:
            from benchmarks.gpu_common import setup

            device = setup(True).device
        elif mode == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:  # every rank on the one GPU
            torch.cuda.set_device(0)
            device = torch.device("cuda", 0)
        store = dist.FileStore(store_path, world)
        backend = "nccl" if mode == "nccl" else "gloo"
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kwargs)
        report = {}
        for label, name, params in RUNS:
            torch.manual_seed(0)
            model = _ddp(_model(dry_run), device)
            state = commpress.ddp.register(model, name, overlap=True, **params) if name else None
            opt = torch.optim.SGD(model.parameters(), lr=0.3 if dry_run else 0.1, momentum=0.9)
            losses = [_step(model, opt, *_batch(s, rank, device, 64 if dry_run else 256)) for s in range(steps)]
            if state is not None:
                state.close()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            gathered = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(gathered, flat)
            replicas_equal = all(torch.equal(gathered[0].view(torch.int32), g.view(torch.int32))
                                 for g in gathered)
            report[label] = {"params": flat.cpu().numpy(), "losses": torch.stack(losses).cpu().tolist(),
                             "replicas_equal": replicas_equal,
                             "overlap": bool(state.overlap) if state is not None else None}
        dist.barrier()
        dist.destroy_process_group()
        if rank == 0:
            queue.put(("ok", report))
    except Exception:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


def train_check(mode: str, dry_run: bool, steps: int, world: int = 2, timeout: float = 240.0) -> dict:
    """The runs of :data:`RUNS` on ``world`` ranks (``mode`` "shared": one GPU over gloo; "nccl")."""
    import numpy as np

    if mode == "nccl" and (dry_run or torch.cuda.device_count() < world):
        msg = ("dry run: NCCL needs GPUs (the workers are the shared step's, with backend nccl)" if dry_run
               else f"needs {world} GPUs, found {torch.cuda.device_count()}")
        print(f"gpu_ddp {mode}: skipped ({msg})")
        return {"mode": mode, "skipped": msg, "ok": True, "checks": []}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(r, world, store, steps, mode, dry_run, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            status, payload = queue.get(timeout=timeout)
        except Exception:
            status, payload = "error", f"no result within {timeout:.0f} s (hang?)"
        for p in procs:
            p.join(10 if status == "ok" else 1)
            if p.is_alive():
                p.kill()
    if status != "ok":
        print(f"gpu_ddp {mode}: FAILED\n{payload}")
        return {"mode": mode, "ok": False, "error": payload, "checks": []}
    checks = []

    def check(cond: bool, what: str) -> None:
        checks.append({"check": what, "ok": bool(cond)})
        print(f"gpu_ddp {mode}: {'PASS' if cond else 'FAIL'} {what}")

    plain = payload["plain"]
    check(np.array_equal(payload["identity"]["params"].view(np.int32), plain["params"].view(np.int32)),
          "identity hook ends bitwise equal to plain DDP")
    losses = {}
    for label, run in payload.items():
        check(run["replicas_equal"], f"{label}: replicas bitwise equal across {world} ranks")
        if run["overlap"] is not None:
            check(run["overlap"], f"{label}: the hook ran with overlap on")
        first, last = float(np.mean(run["losses"][:5])), float(np.mean(run["losses"][-5:]))
        losses[label] = [first, last]
        if label in TRAINS:  # at least half of plain DDP's loss reduction
            p_first, p_last = float(np.mean(plain["losses"][:5])), float(np.mean(plain["losses"][-5:]))
            check(first - last >= 0.5 * (p_first - p_last) > 0,
                  f"{label} trains (loss {first:.3f} -> {last:.3f}; plain DDP {p_first:.3f} -> {p_last:.3f})")
    return {"mode": mode, "world": world, "steps": steps, "dry_run": dry_run, "losses": losses,
            "checks": checks, "ok": all(c["ok"] for c in checks)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["sync", "shared", "nccl"])
    ap.add_argument("--dry-run", action="store_true", help="CPU, host build of the kernels")
    ap.add_argument("--steps", type=int, default=None, help="training steps (default 60; 10 dry)")
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from benchmarks.gpu_common import setup, write_json

    if args.what == "sync":
        result = sync_check(setup(args.dry_run), *((2, 1) if args.dry_run else (3, 2)))
    else:
        steps = args.steps or (10 if args.dry_run else 60)
        result = train_check(args.what, args.dry_run, steps, timeout=args.timeout)
    write_json(args.out, result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
