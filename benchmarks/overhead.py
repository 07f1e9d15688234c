"""``python -m benchmarks overhead``: what commpress costs on loopback, side by side with the baselines.

On gloo over loopback compression has nothing to gain, so every difference to
plain DDP / PyTorch's own hooks / a dense ``all_reduce`` / plain FSDP2 is the
hot path's overhead (see DESIGN.md, "The hot path's budget").  Three sections,
each measured in ONE set of rank processes per world size: each configuration's
warm-up steps back to back (``"auto"`` takes its first decisions there), then the
timed steps interleaved step by step (so a change of machine load hits all of them
alike; ``--block K``: K consecutive steps of each at a time, as training runs them):

``ddp``
    an MLP 64-2048-1024-10 (about 2.2M parameters), batch 32, SGD; one DDP model
    per configuration (same seed): DDP default, PyTorch's ``allreduce_hook`` (what any
    Python comm hook costs over DDP's built-in all_reduce), ``fp16_compress_hook``,
    ``bf16_compress_hook`` and ``powerSGD_hook`` (rank 4, ``start_powerSGD_iter=2``),
    and ``commpress.ddp.register`` with identity, fp16, bf16, topk 1%, blockquant
    8-bit, powersgd rank 4 and ``"auto"`` (default arguments otherwise).  Median step time
    (slowest rank per step) after the warm-up, bytes sent per rank per step.
``allreduce``
    ``commpress.collectives.allreduce`` of a 2**20 fp32 tensor (fp16, topk 1% +
    ErrorFeedback, blockquant 8-bit with and without ErrorFeedback) against
    ``dist.all_reduce`` of the same tensor; a call's time is the slowest rank's.
``fsdp``
    the same MLP with every Linear ``fully_shard``-ed and then the root (P=2):
    plain FSDP2 against ``commpress.fsdp.register`` with identity, blockquant
    8-bit, topk 1% and ``"auto"``.

Ranks: one process each (forkserver), a FileStore in a temporary folder, gloo,
``torch.set_num_threads(1)`` as under torchrun, not pinned to cores (``--pin``: rank r
on core r mod the cores, set before the process starts any thread, so that every
gloo group's threads, the default one's and a hook's own, share the rank's core),
and no ``OMP_*`` / ``NUMBA_*`` variables set.  A configuration that raises or hangs
is reported as failed; the ranks are killed and the remaining configurations
run again in fresh processes.  If PyTorch's ``powerSGD_hook`` fails (it can
deadlock on gloo with several buckets), ``batched_powerSGD_hook`` runs instead.

Writes ``results/overhead-<timestamp>/`` (``results.json``, ``results.csv``,
``table.md``).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import queue as queue_mod
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from .common import earlier_choices, markdown_table, results_dir, steady_params, write_results

SIZES = (64, 2048, 1024, 10)
BATCH = 32
NUMEL = 2**20
SECTIONS = ("ddp", "allreduce", "fsdp")

#: name -> (label, compressor name, parameters); names starting "cp_" are commpress.
DDP_CONFIGS: dict[str, tuple[str, str | None, dict[str, Any]]] = {
    "ddp": ("DDP default", None, {}),
    "torch_allreduce": ("PyTorch allreduce_hook", None, {}),
    "torch_fp16": ("PyTorch fp16_compress_hook", None, {}),
    "torch_bf16": ("PyTorch bf16_compress_hook", None, {}),
    "torch_powersgd": ("PyTorch powerSGD_hook r4", None, {}),
    "cp_identity": ("commpress identity", "identity", {}),
    "cp_fp16": ("commpress fp16", "fp16", {}),
    "cp_bf16": ("commpress bf16", "bf16", {}),
    "cp_topk": ("commpress topk 1%", "topk", {"ratio": 0.01}),
    "cp_blockquant": ("commpress blockquant 8-bit", "blockquant", {"bits": 8}),
    "cp_powersgd": ("commpress powersgd r4", "powersgd", {"rank": 4}),
    "cp_auto": ("commpress auto", "auto", {}),
}
#: used in place of torch_powersgd when that one fails or hangs
DDP_FALLBACK = {"torch_powersgd": "torch_powersgd_batched"}
DDP_EXTRA = {"torch_powersgd_batched": ("PyTorch batched_powerSGD_hook r4", None, {})}

ALLREDUCE_CONFIGS: dict[str, tuple[str, str | None, dict[str, Any], bool]] = {
    "dense": ("dist.all_reduce (dense fp32)", None, {}, False),
    "cp_fp16": ("commpress fp16", "fp16", {}, False),
    "cp_topk_ef": ("commpress topk 1% + EF", "topk", {"ratio": 0.01}, True),
    "cp_blockquant": ("commpress blockquant 8-bit", "blockquant", {"bits": 8}, False),
    "cp_blockquant_ef": ("commpress blockquant 8-bit + EF", "blockquant", {"bits": 8}, True),
}

FSDP_CONFIGS: dict[str, tuple[str, str | None, dict[str, Any]]] = {
    "fsdp": ("FSDP2 default", None, {}),
    "cp_identity": ("commpress identity", "identity", {}),
    "cp_blockquant": ("commpress blockquant 8-bit", "blockquant", {"bits": 8}),
    "cp_topk": ("commpress topk 1%", "topk", {"ratio": 0.01}),
    "cp_auto": ("commpress auto", "auto", {}),
}

BASELINE = {"ddp": "ddp", "allreduce": "dense", "fsdp": "fsdp"}
#: commpress config -> the PyTorch hook it is compared with
#: (PyTorch's ``allreduce_hook``: the cost of any Python comm hook, the floor of identity and of
#: an all-dense ``"auto"``)
TORCH_PEER = {"cp_fp16": "torch_fp16", "cp_bf16": "torch_bf16", "cp_powersgd": "torch_powersgd",
              "cp_identity": "torch_allreduce", "cp_auto": "torch_allreduce"}

#: (section, world size, config, ratio column, limit)
GOALS = [
    ("ddp", 2, "cp_fp16", "ratio_vs_torch_hook", 1.05),
    ("ddp", 2, "cp_identity", "ratio_vs_baseline", 1.03),
    ("ddp", 2, "cp_topk", "ratio_vs_baseline", 1.15),
    ("ddp", 2, "cp_blockquant", "ratio_vs_baseline", 1.15),
    ("ddp", 4, "cp_topk", "ratio_vs_baseline", 1.5),
    ("ddp", 2, "cp_auto", "ratio_vs_baseline", 1.05),   # on loopback: never slower than not compressing
    ("allreduce", None, "cp_topk_ef", "ratio_vs_baseline", 0.5),
    ("allreduce", None, "cp_blockquant", "ratio_vs_baseline", 0.5),
    ("allreduce", None, "cp_blockquant_ef", "ratio_vs_baseline", 0.5),
    ("fsdp", 2, "cp_blockquant", "ratio_vs_baseline", 1.2),
    ("fsdp", 2, "cp_topk", "ratio_vs_baseline", 1.2),
]


def _labels(section: str) -> dict[str, str]:
    table = {"ddp": {**DDP_CONFIGS, **DDP_EXTRA}, "allreduce": ALLREDUCE_CONFIGS, "fsdp": FSDP_CONFIGS}[section]
    return {k: v[0] for k, v in table.items()}


# ============================================================== rank side
def make_mlp(sizes=SIZES):
    import torch

    layers: list[torch.nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _batches(rank: int, sizes, batch: int, n: int = 4):
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(batch, sizes[0], generator=g), torch.randint(0, sizes[-1], (batch,), generator=g))
            for _ in range(n)]


def _ring_bytes(nbytes: float, world: int) -> float:
    """Bytes one rank sends in a ring all_reduce of ``nbytes`` (commpress's accounting convention)."""
    return 2.0 * nbytes * (world - 1) / world


class _Progress:
    """Where this rank is: the configuration index and a step counter, in shared memory."""

    def __init__(self, array, rank: int) -> None:
        self.array, self.rank = array, rank

    def at(self, index: int) -> None:
        self.array[2 * self.rank] = index
        self.array[2 * self.rank + 1] += 1


def _interleave(rank, world, progress, names, step_fns, warmup, steps, block=1):
    """Run ``warmup`` steps of each configuration back to back (its one-time costs, and
    ``"auto"``'s first decisions, whose compute is the time from one of its steps to the next,
    see its own steps only, as in training), then ``steps`` steps of every configuration,
    ``block`` consecutive steps of one before the next (1: step by step; more: as training runs
    them, each model's data warm in the caches); returns the per-config median of the slowest
    rank's step time (seconds) and what each step function returned for ``"mark"`` at the end of
    its warm-up (before its first timed step).  Round ``r`` starts at configuration ``r mod N`` (the same order on every
    rank): each configuration takes every place in a round equally often, so none is always
    the one after DDP's default or the first after the loop's own work."""
    import torch
    import torch.distributed as dist

    times = torch.zeros(len(names), steps, dtype=torch.float64)
    marks = {}
    n = len(step_fns)
    for i, fn in enumerate(step_fns):   # each configuration's warm-up back to back, as training runs it
        progress.at(i)
        for s in range(warmup):
            fn(s)
    for r in range(-(-steps // block)):
        for i in [(r + j) % n for j in range(n)]:
            fn = step_fns[i]
            progress.at(i)
            for s in range(warmup + r * block, warmup + min(steps, (r + 1) * block)):
                if s == warmup:
                    marks[names[i]] = fn("mark")
                t0 = time.perf_counter()
                fn(s)
                times[i, s - warmup] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # slowest rank per step, once after the loop
    return [statistics.median(times[i].tolist()) for i in range(len(names))], marks


def _ddp_rank(rank, world, progress, *, configs, steps, warmup, sizes, batch, seed, block=1):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    import commpress

    table = {**DDP_CONFIGS, **DDP_EXTRA}
    data = _batches(rank, sizes, batch)
    runs = []
    for i, name in enumerate(configs):
        progress.at(i)
        torch.manual_seed(seed)
        model = DDP(make_mlp(sizes))
        numel = sum(p.numel() for p in model.parameters())
        state: Any = None
        if name == "torch_allreduce":
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        elif name == "torch_fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif name == "torch_bf16":
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif name in ("torch_powersgd", "torch_powersgd_batched"):
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
            model.register_comm_hook(state, psgd.powerSGD_hook if name == "torch_powersgd"
                                     else psgd.batched_powerSGD_hook)
        elif name.startswith("cp_"):
            _, comp, params = table[name]
            state = commpress.ddp.register(model, comp, **steady_params(comp, params))
        elif name != "ddp":
            raise ValueError(f"unknown ddp config {name!r}")
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        runs.append((name, model, opt, state, numel))

    def make_step(name, model, opt, state, numel):
        def sent_so_far() -> float:
            """Bytes this rank has sent so far (cumulative), by the ring convention."""
            if name.startswith("cp_"):
                return float(state.stats.bytes_sent)
            if state is not None:  # PyTorch PowerSGD: all its all_reduces are fp32
                return _ring_bytes(4.0 * state.total_numel_after_compression, world)
            return float("nan")

        def step(s):
            if s == "mark":
                return sent_so_far()
            x, y = data[s % len(data)]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        step.sent_so_far = sent_so_far
        return step

    fns = [make_step(*r) for r in runs]
    medians, marks = _interleave(rank, world, progress, configs, fns, warmup, steps, block)
    sent = []
    for (name, model, opt, state, numel), fn in zip(runs, fns):
        if name in ("ddp", "torch_allreduce", "torch_fp16", "torch_bf16"):
            sent.append(_ring_bytes(numel * (4 if name in ("ddp", "torch_allreduce") else 2), world))
        else:
            sent.append((fn.sent_so_far() - marks[name]) / steps)
    sent_t = torch.tensor(sent, dtype=torch.float64)
    dist.all_reduce(sent_t, op=dist.ReduceOp.MAX)
    rows = []
    for (name, model, opt, state, numel), sec, b in zip(runs, medians, sent_t.tolist()):
        row = {"ms": 1e3 * sec, "bytes_per_step": b, "dense_bytes_per_step": _ring_bytes(4 * numel, world),
               "params": numel}
        if name.startswith("cp_"):
            row["algorithms"] = "+".join(sorted(set(state.stats.algorithms.values())))
        if name == "cp_auto":   # what it chose, and when (a plan that compressed on loopback is the finding)
            row["label"] = _auto_label(state, "bucket")
        rows.append(row)
    return rows


def _auto_label(state, unit: str = "unit") -> str:
    """``commpress auto (bucket 0: dense; bucket 1: blockquant(bits=8), before: ...)``: each unit's
    choice in the end and the ones it switched from."""
    report = state.stats.as_dict().get("auto") or {}
    return "commpress auto (" + "; ".join(
        f"{unit} {b}: {e['choice']}" + (f", before: {earlier_choices(e)}" if earlier_choices(e) else "")
        for b, e in report.items()) + ")"


def _allreduce_rank(rank, world, progress, *, configs, steps, warmup, numel, seed, block=1):
    import torch
    import torch.distributed as dist

    import commpress
    from commpress.collectives import CommStats, allreduce

    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed + rank))
    buf = torch.empty_like(x)
    fns = []
    for i, name in enumerate(configs):
        progress.at(i)
        _, comp, params, ef = ALLREDUCE_CONFIGS[name]
        stats = CommStats()
        if comp is None:
            def call(s, stats=stats):
                if s == "mark":
                    return stats.bytes_sent
                buf.copy_(x)
                dist.barrier()
                dist.all_reduce(buf)
                stats.add(int(_ring_bytes(4 * numel, world)))
        else:
            c = commpress.get(comp, **steady_params(comp, params))
            if ef:
                c = commpress.ErrorFeedback(c)

            def call(s, c=c, stats=stats, name=name):
                if s == "mark":
                    return stats.bytes_sent
                dist.barrier()
                allreduce(x, c, key=name, step=s, stats=stats)
        call.stats = stats
        fns.append(call)
    # the barrier inside each call is timed too, but it is the same for all of them
    medians, marks = _interleave(rank, world, progress, configs, fns, warmup, steps, block)
    sent = torch.tensor([(fn.stats.bytes_sent - marks[name]) / steps for name, fn in zip(configs, fns)],
                        dtype=torch.float64)
    dist.all_reduce(sent, op=dist.ReduceOp.MAX)
    return [{"ms": 1e3 * sec, "bytes_per_step": b, "dense_bytes_per_step": _ring_bytes(4 * numel, world),
             "numel": numel, "algorithms": fn.stats.last_algorithm or "all_reduce"}
            for sec, b, fn in zip(medians, sent.tolist(), fns)]


def _fsdp_rank(rank, world, progress, *, configs, steps, warmup, sizes, batch, seed, block=1):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import commpress

    mesh = init_device_mesh("cpu", (world,))
    data = _batches(rank, sizes, batch)
    runs = []
    for i, name in enumerate(configs):
        progress.at(i)
        torch.manual_seed(seed)
        model = make_mlp(sizes)
        # FSDP2 pads every parameter's dim 0 to a multiple of P; a reduce-scatter of n bytes sends n(P-1)/P
        padded = sum(math.ceil(p.shape[0] / world) * world * (p.numel() // p.shape[0]) for p in model.parameters())
        numel = sum(p.numel() for p in model.parameters())
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        state = None
        _, comp, params = FSDP_CONFIGS[name]
        if comp is not None:
            state = commpress.fsdp.register(model, comp, **steady_params(comp, params))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        runs.append((name, model, opt, state, padded, numel))

    def make_step(name, model, opt, state, padded, numel):
        def step(s):
            if s == "mark":
                return float(state.stats.bytes_sent) if state is not None else 0.0
            x, y = data[s % len(data)]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        step.state = state
        return step

    fns = [make_step(*r) for r in runs]
    medians, marks = _interleave(rank, world, progress, configs, fns, warmup, steps, block)
    dense = [4.0 * r[4] * (world - 1) / world for r in runs]
    sent = torch.tensor([dense[j] if fn.state is None else (fn.state.stats.bytes_sent - marks[name]) / steps
                         for j, (name, fn) in enumerate(zip(configs, fns))], dtype=torch.float64)
    dist.all_reduce(sent, op=dist.ReduceOp.MAX)
    rows = []
    for r, sec, b, d, fn in zip(runs, medians, sent.tolist(), dense, fns):
        row = {"ms": 1e3 * sec, "bytes_per_step": b, "dense_bytes_per_step": d, "params": r[5]}
        if fn.state is not None:
            row["algorithms"] = "+".join(sorted(set(fn.state.stats.algorithms.values())))
        if r[0] == "cp_auto":   # what it chose per FSDP unit, and when
            row["label"] = _auto_label(fn.state)
        rows.append(row)
    return rows


RANK_FNS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "ddp": _ddp_rank, "allreduce": _allreduce_rank, "fsdp": _fsdp_rank,
}


def _watch_parent(parent_pid: int) -> None:
    """Exit this rank when the launching process is gone (no orphans if it is killed)."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(3)
        except PermissionError:
            pass


def _rank_entry(section, rank, world, store_path, parent_pid, progress_array, results, pg_timeout, kwargs,
                pin=False):
    if pin:   # before any thread of this process starts (forked: none of the server's survived)
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    progress = _Progress(progress_array, rank)
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # as torchrun does; nothing else about threads is set
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        rows = RANK_FNS[section](rank, world, progress, **kwargs)
        for row in rows or []:   # the cores rank 0 could run on (1 with --pin)
            row["cores"] = len(os.sched_getaffinity(0))
        results.put(("ok", rank, rows if rank == 0 else None, ""))
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the results are already out
            pass
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        index = progress_array[2 * rank]
        where = ""
        if not str(exc):  # a bare assert: say where it fired
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            where = f"(empty message) at {os.path.basename(frame.filename)}:{frame.lineno} in {frame.name}"
        results.put(("fail", rank, index, f"{type(exc).__name__}: {exc}{where}\n{traceback.format_exc()}"))
        results.close()
        results.join_thread()  # flushed; then leave at once (peers blocked on us see the socket close)
        os._exit(1)


# ============================================================ parent side
def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process ``pid`` (all its threads), from /proc; None where unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class Attempt:
    rows: list[dict[str, Any]] | None = None
    failed_index: int | None = None  # -1: before any configuration (setup)
    reason: str = ""
    messages: list[str] = field(default_factory=list)


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "commpress", "commpress.fsdp"])
    return ctx


def _attempt(section: str, world: int, kwargs: dict[str, Any], *, stall_timeout: float,
             pg_timeout: float, idle_window: float = 10.0, pin: bool = False) -> Attempt:
    """One set of ``world`` rank processes running ``kwargs["configs"]``; kills them on any failure.

    A hang is no progress for ``stall_timeout`` seconds, or, sooner, no progress for
    ``idle_window`` seconds while all ranks together used under 2% of a core (a
    deadlock: every rank blocked; a rank compiling kernels or starved of CPU still runs).
    """
    ctx = _context()
    results = ctx.Queue()
    progress = ctx.Array("q", [-1, 0] * world, lock=False)
    procs = []
    out = Attempt()
    with tempfile.TemporaryDirectory(prefix="commpress-overhead-") as tmp:
        store_path = os.path.join(tmp, "store")
        try:
            for r in range(world):
                p = ctx.Process(target=_rank_entry, daemon=True,
                                args=(section, r, world, store_path, os.getpid(), progress, results,
                                      pg_timeout, kwargs, pin))
                p.start()
                procs.append(p)
            done: set[int] = set()
            fails: list[tuple[int, int, str]] = []
            last_counts, last_change = None, time.monotonic()
            cpu_samples: list[tuple[float, float]] = []  # (time, CPU seconds of all ranks) while stalled
            while len(done) < world:
                try:
                    kind, rank, payload, text = results.get(timeout=0.25)
                    if kind == "ok":
                        done.add(rank)
                        if rank == 0:
                            out.rows = payload
                    else:
                        fails.append((rank, payload, text))
                except queue_mod.Empty:
                    pass
                if fails:
                    # a peer of the failing rank may report its own (later) error: give it a moment
                    end = time.monotonic() + 1.0
                    while time.monotonic() < end:
                        try:
                            kind, rank, payload, text = results.get(timeout=0.1)
                            if kind == "fail":
                                fails.append((rank, payload, text))
                        except queue_mod.Empty:
                            pass
                    rank, index, text = min(fails, key=lambda f: f[1])
                    # PyTorch nests a callback's error in "Got the following error when running the callback: "
                    inner = text.split("when running the callback: ")[-1].strip().splitlines()[0]
                    out.failed_index, out.reason = index, f"rank {rank}: {inner[:200]}"
                    out.messages = [f"--- rank {r} (config {i}):\n{t}" for r, i, t in fails]
                    out.rows = None
                    return out
                counts = tuple(progress[1::2])
                now = time.monotonic()
                if counts != last_counts:
                    last_counts, last_change = counts, now
                    cpu_samples = []
                elif now - last_change > 1.0:
                    cpus = [_cpu_seconds(p.pid) for p in procs]
                    if None not in cpus:
                        cpu_samples.append((now, sum(cpus)))
                        old = [c for t, c in cpu_samples if t <= now - idle_window]
                        if old and cpu_samples[-1][1] - old[-1] < 0.02 * idle_window:
                            out.failed_index = min(progress[0::2])
                            out.reason = (f"hang: no progress for {now - last_change:.0f}s with every rank idle "
                                          "(deadlock)")
                            out.rows = None
                            return out
                if now - last_change > stall_timeout:
                    out.failed_index = min(progress[0::2])
                    out.reason = f"no progress for {stall_timeout:.0f}s (hang)"
                    out.rows = None
                    return out
                dead = [i for i, p in enumerate(procs) if i not in done and not p.is_alive()]
                if dead and results.empty():
                    time.sleep(0.5)
                    if results.empty():
                        out.failed_index = min(progress[0::2])
                        out.reason = f"rank(s) {dead} died (exit codes {[procs[i].exitcode for i in dead]})"
                        out.rows = None
                        return out
            return out
        finally:
            for p in procs:
                p.join(timeout=5 if out.rows is not None else 0.1)
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)


def measure(section: str, world: int, configs: list[str], *, stall_timeout: float = 45.0,
            pg_timeout: float | None = None, log: Callable[[str], None] = print, pin: bool = False,
            **kwargs: Any) -> list[dict[str, Any]]:
    """Run ``configs`` of ``section`` on ``world`` ranks, side by side; one row per config.

    A failing or hanging configuration gets a row with ``status`` ``"failed: ..."``; the others
    run again in fresh processes.  Failed ``torch_powersgd`` is replaced by ``torch_powersgd_batched``.
    """
    if section not in RANK_FNS:
        raise ValueError(f"unknown section {section!r} (one of {', '.join(SECTIONS)})")
    labels = _labels(section)
    unknown = [c for c in configs if c not in labels]
    if unknown:
        raise ValueError(f"unknown {section} configs {unknown} (known: {', '.join(labels)})")
    pg_timeout = pg_timeout or stall_timeout
    remaining = list(configs)
    done: dict[str, dict[str, Any]] = {}
    attempts = 0
    while remaining:
        attempts += 1
        t0 = time.monotonic()
        res = _attempt(section, world, {**kwargs, "configs": remaining}, stall_timeout=stall_timeout,
                       pg_timeout=pg_timeout, pin=pin)
        wall = time.monotonic() - t0
        if res.rows is not None:
            for name, row in zip(remaining, res.rows):
                done[name] = {**row, "status": "ok", "attempt": attempts, "attempt_seconds": wall}
            break
        if res.failed_index is None or res.failed_index < 0:
            for name in remaining:
                done[name] = {"status": f"failed: {res.reason}", "attempt": attempts}
            log(f"[{section} P={world}] setup failed: {res.reason}")
            for m in res.messages:
                log(m)
            break
        bad = remaining[res.failed_index]
        done[bad] = {"status": f"failed: {res.reason}", "attempt": attempts}
        log(f"[{section} P={world}] {bad} failed after {wall:.0f}s: {res.reason}")
        for m in res.messages[:1]:
            log("\n".join(m.rstrip().splitlines()[-8:]))
        remaining = [c for c in remaining if c != bad]
        fallback = DDP_FALLBACK.get(bad) if section == "ddp" else None
        if fallback and fallback not in done and fallback not in remaining:
            log(f"[{section} P={world}] running {fallback} in place of {bad}")
            remaining.append(fallback)
    order = list(configs) + [c for c in done if c not in configs]
    return [{"section": section, "world": world, "config": c, "label": labels[c], **done[c]} for c in order]


def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``ratio_vs_baseline`` (to DDP / dense / FSDP2 of the same section and world size),
    ``ratio_vs_torch_hook`` (commpress fp16/bf16/powersgd vs PyTorch's hook), goals."""
    by = {(r["section"], r["world"], r["config"]): r for r in rows}
    for r in rows:
        if r.get("status") != "ok":
            continue
        base = by.get((r["section"], r["world"], BASELINE[r["section"]]))
        if base is not None and base.get("status") == "ok":
            r["ratio_vs_baseline"] = r["ms"] / base["ms"]
        peer = TORCH_PEER.get(r["config"]) if r["section"] == "ddp" else None
        if peer is not None:
            p = by.get((r["section"], r["world"], peer))
            if p is None and peer == "torch_powersgd":
                p = by.get((r["section"], r["world"], "torch_powersgd_batched"))
            if p is not None and p.get("status") == "ok":
                r["ratio_vs_torch_hook"] = r["ms"] / p["ms"]
                r["torch_hook"] = p["config"]
        if r.get("bytes_per_step") and r.get("dense_bytes_per_step"):
            r["bytes_vs_dense"] = r["bytes_per_step"] / r["dense_bytes_per_step"]
    for section, world, config, column, limit in GOALS:
        for r in rows:
            if r["section"] == section and r["config"] == config and (world is None or r["world"] == world):
                what = {"ratio_vs_baseline": {"ddp": "DDP", "allreduce": "dense", "fsdp": "FSDP2"}[section],
                        "ratio_vs_torch_hook": "PyTorch hook"}[column]
                r["goal"] = f"<= {limit:g}x {what}"
                value = r.get(column)
                r["meets_goal"] = "n/a" if value is None else ("yes" if value <= limit else "NO")
    return rows


COLUMNS = {
    "ddp": ["world", "label", "ms", "ratio_vs_baseline", "ratio_vs_torch_hook", "goal", "meets_goal",
            "bytes_per_step", "bytes_vs_dense", "status"],
    "allreduce": ["world", "label", "ms", "ratio_vs_baseline", "goal", "meets_goal", "bytes_per_step",
                  "bytes_vs_dense", "algorithms", "status"],
    "fsdp": ["world", "label", "ms", "ratio_vs_baseline", "goal", "meets_goal", "bytes_per_step",
             "bytes_vs_dense", "status"],
}
TITLES = {
    "ddp": "DDP step time (ms/step, median; ratio_vs_baseline: to DDP default; ratio_vs_torch_hook: "
           "commpress vs PyTorch's fp16 / bf16 / PowerSGD hook; bytes sent per rank per step)",
    "allreduce": "allreduce of a 2**20 fp32 tensor (ms/call, slowest rank, median; ratio to dist.all_reduce)",
    "fsdp": "FSDP2 step time (ms/step, median; ratio to plain FSDP2; reduce-scatter bytes per rank per step)",
}


def tables(rows: list[dict[str, Any]]) -> str:
    parts = []
    for section in SECTIONS:
        sec = [{**r, "bytes_per_step": int(r["bytes_per_step"]) if isinstance(r.get("bytes_per_step"), float)
                and math.isfinite(r["bytes_per_step"]) else r.get("bytes_per_step", "")}
               for r in rows if r["section"] == section]
        if sec:
            parts.append(f"### {TITLES[section]}\n\n" + markdown_table(sec, COLUMNS[section]))
    return "\n\n".join(parts)


def run_suite(sections=SECTIONS, world_sizes=(2, 4), *, steps: int = 30, warmup: int = 6,
              calls: int | None = None, sizes=SIZES, batch: int = BATCH, numel: int = NUMEL,
              fsdp_world_sizes=(2,), configs: dict[str, list[str]] | None = None, seed: int = 0,
              stall_timeout: float = 45.0, log: Callable[[str], None] = print,
              pin: bool = False, block: int = 1) -> list[dict[str, Any]]:
    """Every requested section at every world size; returns the rows with ratios and goals."""
    configs = configs or {}
    rows: list[dict[str, Any]] = []
    if "fsdp" in sections and not set(world_sizes) & set(fsdp_world_sizes):
        log(f"[fsdp] skipped: it runs at P in {sorted(fsdp_world_sizes)} only")
    for world in world_sizes:
        for section in sections:
            if section == "fsdp" and world not in fsdp_world_sizes:
                continue
            names = configs.get(section) or list({"ddp": DDP_CONFIGS, "allreduce": ALLREDUCE_CONFIGS,
                                                  "fsdp": FSDP_CONFIGS}[section])
            kw: dict[str, Any] = {"steps": steps, "warmup": warmup, "seed": seed, "block": block}
            if section == "allreduce":
                kw.update(numel=numel, steps=calls or steps)
            else:
                kw.update(sizes=tuple(sizes), batch=batch)
            t0 = time.monotonic()
            rows += measure(section, world, names, stall_timeout=stall_timeout, log=log, pin=pin, **kw)
            log(f"[{section} P={world}] {time.monotonic() - t0:.1f}s")
    return add_ratios(rows)


def _goal_column(row: dict[str, Any]) -> str:
    return "ratio_vs_torch_hook" if "PyTorch" in row.get("goal", "") else "ratio_vs_baseline"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks overhead", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="P=2 only, few steps (well under 90 s)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=None, help="DDP / allreduce world sizes "
                   "(default 2 4; quick: 2); FSDP runs at P=2 only")
    p.add_argument("--steps", type=int, default=None, help="timed steps / calls per config (default 30; quick 8)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per config (default 6; quick 5; >= 5)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: ddp,allreduce,fsdp")
    p.add_argument("--stall-timeout", type=float, default=45.0,
                   help="seconds without progress before a configuration counts as hung (default 45)")
    p.add_argument("--pin", action="store_true",
                   help="one core per rank (rank r on core r mod the cores), set before any thread starts")
    p.add_argument("--block", type=int, default=1,
                   help="consecutive steps of one configuration before the next (default 1: step by step; "
                        "more: as training runs them, each model warm in the caches)")
    p.add_argument("--out", default="results", help="results root folder")
    args = p.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad or not sections:
        p.error(f"--sections: unknown {bad}; choose from {','.join(SECTIONS)}")
    worlds = args.world_sizes or ([2] if args.quick else [2, 4])
    if any(w < 2 for w in worlds):
        p.error("--world-sizes must be >= 2")
    steps = args.steps or (8 if args.quick else 30)
    warmup = args.warmup if args.warmup is not None else (5 if args.quick else 6)
    if args.block < 1:
        p.error("--block must be >= 1")
    if steps < 1 or warmup < 5:
        p.error("--steps must be >= 1 and --warmup >= 5 (past commpress's dense warm-up and DDP's bucket rebuild)")
    calls = steps

    cores = _cores()
    load0 = os.getloadavg()
    order = "step by step" if args.block == 1 else f"{args.block} consecutive steps of each at a time"
    print(f"overhead: sections {','.join(sections)}, world sizes {worlds}, {warmup} warm-up + {steps} timed "
          f"steps, each warm-up back to back, the timed steps interleaved {order}, {cores} cores, load average "
          f"{load0[0]:.2f}", flush=True)
    t0 = time.time()
    rows = run_suite(sections, worlds, steps=steps, warmup=warmup, calls=calls,
                     stall_timeout=args.stall_timeout, log=lambda m: print(m, flush=True), pin=args.pin,
                     block=args.block)
    wall = time.time() - t0
    load1 = os.getloadavg()
    notes = []
    over = [w for w in worlds if w > cores]
    if over:
        notes.append(f"Note: {', '.join(map(str, over))} ranks on this {cores}-core machine are oversubscribed "
                     f"(ranks share cores, so those figures include scheduling contention).")
    pinned = "ranks pinned one core each" if args.pin else "ranks not pinned"
    notes.append(f"gloo over loopback, torch.set_num_threads(1) per rank, {pinned}, each configuration's "
                 f"warm-up back to back, the timed steps interleaved {order}; load average "
                 f"{load0[0]:.2f} at start, {load1[0]:.2f} at end; {wall:.0f}s in total.")
    goals = [r for r in rows if "goal" in r]
    met = sum(r["meets_goal"] == "yes" for r in goals)
    notes.insert(0, f"Goals met: {met}/{len(goals)}" + "".join(
        f"\n- {r['section']} P={r['world']} {r['label']}: "
        + (f"{r[c]:.2f}x ({r['goal']}) {r['meets_goal']}" if (c := _goal_column(r)) in r else r["status"])
        for r in goals) + "\n")
    text = tables(rows) + "\n\n" + "\n".join(notes)
    out = results_dir("overhead", args.out)
    write_results(out, rows, {"suite": "overhead", "argv": argv, "sections": sections, "world_sizes": worlds,
                              "steps": steps, "warmup": warmup, "block": args.block, "cores": cores,
                              "load_start": load0, "load_end": load1, "wall_seconds": wall, "sizes": SIZES,
                              "batch": BATCH, "numel": NUMEL, "notes": notes})
    (out / "table.md").write_text(text + "\n")
    print()
    print(text)
    print(f"results: {out}")
    # PyTorch's own hooks may not run on CPU/gloo at all (bf16 needs NCCL, powerSGD_hook deadlocks): reported, not fatal
    return 0 if all(r.get("status") == "ok" for r in rows if not r["config"].startswith("torch_")) else 1


if __name__ == "__main__":
    sys.exit(main())
