"""Where a training step's host CPU goes: per thread, against the step's wall time.

``python -m benchmarks cpu --net 1gbit --configs ddp,torch-fp16,blockquant-4bit``: 2 ranks of one
core each train the sweep's digits MLP (1.13M parameters, batch 32, SGD with momentum) on an
emulated link, one configuration after the other in the same processes.  Per configuration, over
``--steps`` steps after ``--warmup``: the median step (wall), and the mean host CPU per step of
the rank process split by thread (``/proc/self/task``, in clock ticks: 10 ms each, so use 100
steps or more):

* ``loop``: the training thread (forward, backward with DDP's own bucket copies, optimizer, the
  hook calls DDP makes on it);
* ``worker``: commpress's overlap worker (codec, collectives' Python, the wait for the wire);
* ``comm``: the communication library's threads (gloo's send/receive loops) and any other.

``kernels`` is the part of that CPU spent inside the numba backend's kernels, on any thread
(:class:`KernelClock`, ``time.thread_time`` around each outermost kernel call, installed after the
warm-up): what is left of ``worker`` beyond it is the framework, the Python and torch calls around
the kernels.

``--layers`` also times the hook's layers (:data:`LAYERS`: the bucket on the worker, the unit, the
collective call, the compressor kind's path, the steady-state lanes, the all_gather, the dense path
of DDP's own steps, and with joined rounds a held unit's encode and its landing, which runs inside
the carrying unit's collective call): the thread CPU per step inside each, inclusive, so the
difference between a layer and the next one inside it is that layer's own Python and torch calls.

``idle`` is the step less the process's CPU: time the core waited (for the wire, or for the peer).
A rank whose CPU is :data:`~benchmarks.common.CPU_BOUND` or more of its step is CPU-bound: its
bytes are hidden already, and only less host work shortens its step.  ``compute`` is the same
rank's step under ``no_sync`` (no gradient synchronisation); ``buckets``: the DDP buckets a
commpress hook received per step (``--bucket-cap-mb``: DDP's ``bucket_cap_mb`` for every config;
given explicitly, DDP drops its 1 MiB first bucket, and this model's 4.5 MB fit in one); ``rounds``:
the collective rounds of the hook's last step (joined rounds, ``join_buckets``, carry several buckets
in one);
``chose``: an ``"auto"`` config's choice per bucket.  Linux only (``/proc``; a thread that ends
inside the window is not counted, and the ones measured here live through it); a row is the
slower rank's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from typing import Any, Callable

from .common import cpu_bound, markdown_table, results_dir, write_results

COLUMNS = ["config", "step_ms", "cpu_ms", "idle_ms", "loop_ms", "worker_ms", "kernels_ms", "comm_ms", "compute_ms",
           "verdict", "buckets", "rounds", "chose"]

#: the numba backend's kernel entry points (what ``commpress.ops.numba_backend`` calls; none of them is
#: called from compiled code, so replacing the module attribute cannot change a kernel's typing)
KERNELS = ("block_absmax", "block_dequantize", "block_quantize", "block_quantize_feedback", "bitmap_count",
           "bitmap_encode", "bitmap_write", "bucket_norms", "compensate", "counter_bits", "counter_uniform",
           "fp8_dequantize", "fp8_quantize", "hash_owner", "hash_partition", "level_dequantize", "level_quantize",
           "magnitude_key", "mx_dequantize", "mx_quantize", "pack_bits", "qsgd_quantize", "restore_unselected",
           "sample_keys", "scatter_add", "select_chunks", "select_chunks_feedback", "select_gather", "sign_bits",
           "sign_pack_feedback", "sign_scales", "sign_unpack", "topk_finish", "unpack_bits", "zero_at")


class _ThreadClock:
    """Thread CPU spent inside wrapped functions, per label, summed over threads; only the outermost
    call of a label on a thread counts (so a label's nested or recursive calls are not counted
    twice).  Installed in a benchmark's rank, never in the library."""

    marker = "_thread_clock"   # set on every wrapper: a function is wrapped once

    def __init__(self, labels) -> None:
        self._total = {label: 0.0 for label in labels}
        self._lock = threading.Lock()
        self._depth = threading.local()

    def _timed(self, label: str, f: Callable) -> Callable:
        def timed(*args, **kwargs):
            depth = getattr(self._depth, label, 0)
            setattr(self._depth, label, depth + 1)
            t0 = time.thread_time() if depth == 0 else 0.0
            try:
                return f(*args, **kwargs)
            finally:
                setattr(self._depth, label, depth)
                if depth == 0:
                    used = time.thread_time() - t0
                    with self._lock:
                        self._total[label] += used

        setattr(timed, self.marker, True)
        timed.__wrapped__ = f
        return timed

    def _totals(self) -> dict[str, float]:
        with self._lock:
            return dict(self._total)


class KernelClock(_ThreadClock):
    """Thread CPU spent inside the numba kernels (:data:`KERNELS`), one label for them all: a kernel
    called from another counts once.  :meth:`install` wraps the module's entry points,
    :meth:`seconds` reads the total."""

    marker = "_kernel_clock"

    def __init__(self) -> None:
        super().__init__(("kernels",))

    def install(self) -> None:
        from commpress.ops import _numba_kernels as K

        for name in KERNELS:
            f = getattr(K, name, None)
            if f is not None and not getattr(f, self.marker, False):
                setattr(K, name, self._wrap(f))

    def _wrap(self, f: Callable) -> Callable:
        return self._timed("kernels", f)

    def seconds(self) -> float:
        return self._totals()["kernels"]


#: The hook's layers ``--layers`` times: (label, module, attribute).  Each is looked up through its
#: module at call time by its caller, so replacing the attribute times every call.
LAYERS = (
    ("bucket", "commpress.hooks.ddp", "_Executor.run"),
    ("unit", "commpress.hooks.ddp_step", "Step._run_unit"),
    ("allreduce", "commpress.hooks.ddp_step", "allreduce"),
    ("gather_kind", "commpress.collectives.quantized", "quantized_allreduce"),
    ("sparse_kind", "commpress.collectives.sparse", "fixed_sparse_allreduce"),
    ("steady_lane", "commpress.collectives.steady", "run"),
    ("sparse_lane", "commpress.collectives.steady_sparse", "run"),
    ("all_gather", "commpress.collectives._comm", "all_gather"),
    ("dense_path", "commpress.hooks.ddp", "_dense_async"),
    ("hold", "commpress.collectives.joint", "hold"),              # a held unit's encode (joined rounds)
    ("land_held", "commpress.hooks.ddp_step", "Step._land_held"),  # its landing (inside the carrier's call)
)


class LayerClock(_ThreadClock):
    """Inclusive thread CPU spent in each of :data:`LAYERS` (a call inside another layer counts in
    both; a layer's own recursion once)."""

    marker = "_layer_clock"

    def __init__(self) -> None:
        super().__init__(label for label, _, _ in LAYERS)

    def install(self) -> None:
        import importlib

        for label, module, attr in LAYERS:
            owner = importlib.import_module(module)
            *path, name = attr.split(".")
            for part in path:
                owner = getattr(owner, part)
            f = getattr(owner, name)
            if not getattr(f, self.marker, False):
                setattr(owner, name, self._wrap(label, f))

    def _wrap(self, label: str, f: Callable) -> Callable:
        return self._timed(label, f)

    def seconds(self) -> dict[str, float]:
        return self._totals()


def thread_cpu() -> dict[int, tuple[str, float]]:
    """``{tid: (name, CPU seconds)}`` of this process's threads (user + system, from ``/proc``)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:   # the thread ended
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
    return out


def split(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], loop: int,
          worker: int | None) -> dict[str, float]:
    """CPU seconds between two :func:`thread_cpu` readings, as ``loop`` / ``worker`` / ``comm``."""
    parts = {"loop": 0.0, "worker": 0.0, "comm": 0.0}
    for tid, (name, sec) in after.items():
        used = sec - before.get(tid, (name, 0.0))[1]
        part = "loop" if tid == loop else "worker" if tid == worker else "comm"
        parts[part] += max(0.0, used)
    return parts


def rank_main(rank: int, world_size: int, *, report: Callable[[dict], None] | None = None,
              configs: list[str], steps: int, warmup: int, bucket_cap_mb: float | None = None,
              layers: bool = False) -> list[dict[str, Any]]:
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from . import configs as C
    from .models import DigitsMLP

    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    loop = threading.get_native_id()
    clock = KernelClock()
    layer_clock = LayerClock() if layers else None
    rows = []
    for name in configs:
        cfg = C.BY_NAME[name]
        torch.manual_seed(0)
        cap = cfg.bucket_cap_mb if cfg.bucket_cap_mb is not None else bucket_cap_mb
        model = DDP(DigitsMLP(hidden=1024), bucket_cap_mb=cap)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        state = C.attach(model, cfg, seed=0, optimizer=opt)

        def step(sync: bool = True) -> None:
            opt.zero_grad(set_to_none=True)
            if sync:
                nn.functional.cross_entropy(model(x), y).backward()
            else:
                with model.no_sync():
                    nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        for _ in range(warmup):
            step()
        executor = getattr(state, "_executor", None)
        thread = getattr(executor, "_thread", None)
        worker = thread.native_id if thread is not None else None
        clock.install()   # after the warm-up: the kernels are compiled
        if layer_clock is not None:
            layer_clock.install()
        walls = []
        c0, p0, k0 = thread_cpu(), time.process_time(), clock.seconds()
        l0 = layer_clock.seconds() if layer_clock is not None else {}
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            walls.append(time.perf_counter() - t0)
        parts = split(c0, thread_cpu(), loop, worker)
        parts["kernels"] = clock.seconds() - k0
        spent = {f"layer_{k}": v - l0[k] for k, v in layer_clock.seconds().items()} if layer_clock else {}
        cpu = (time.process_time() - p0) / steps
        computes = []
        for _ in range(max(5, steps // 4)):
            t0 = time.perf_counter()
            step(sync=False)
            computes.append(time.perf_counter() - t0)
        report_auto = getattr(getattr(state, "stats", None), "auto_report", None)
        chose = ", ".join(f"{k}: {e['choice']}" for k, e in report_auto().items()) if report_auto else ""
        last = state.stats.last_step if getattr(state, "stats", None) is not None else None
        buckets, rounds = (len(last["units"]), last["rounds"]) if last is not None else (None, None)
        rows.append({"config": name, "step_s": statistics.median(walls), "cpu_s": cpu, "buckets": buckets,
                     "rounds": rounds,
                     **{f"{k}_s": v / steps for k, v in {**parts, **spent}.items()},
                     "compute_s": statistics.median(computes), "worker": worker is not None, "chose": chose})
        if state is not None and hasattr(state, "close"):
            state.close()
    return rows


def verdict(row: dict[str, Any]) -> str:
    """``"CPU-bound"`` (:func:`~benchmarks.common.cpu_bound`), else ``"waits"`` (the core idles:
    for the wire or the peer)."""
    return "CPU-bound" if cpu_bound(row["cpu_s"], row["step_s"]) else "waits"


def run_suite(configs: list[str], *, net: str | None, steps: int = 100, warmup: int = 20,
              bucket_cap_mb: float | None = None, layers: bool = False) -> list[dict[str, Any]]:
    """One launch: every config in turn on 2 pinned ranks; a row per config, the slower rank's.
    ``bucket_cap_mb``: DDP's for every config but PyTorch's PowerSGD hook (one bucket always);
    ``None``: DDP's default (a 1 MiB first bucket, then 25 MiB ones).  ``layers``: each row also
    holds ``layer_<label>_ms``, the thread CPU per step inside each of :data:`LAYERS` (inclusive)."""
    from .netem import launch

    res = launch("benchmarks.cpu:rank_main", 2, net=net, pin=True,
                 kwargs=dict(configs=configs, steps=steps, warmup=warmup, bucket_cap_mb=bucket_cap_mb,
                             layers=layers))
    rows = []
    for i, name in enumerate(configs):
        r = max((ranks[i] for ranks in res), key=lambda row: row["step_s"])
        row = {"config": name, **{k[:-2] + "_ms": round(1e3 * v, 2) for k, v in r.items() if k.endswith("_s")}}
        row["idle_ms"] = round(max(0.0, row["step_ms"] - row["cpu_ms"]), 2)
        row["verdict"], row["worker"], row["chose"] = verdict(r), r["worker"], r["chose"]
        row["buckets"] = r["buckets"] if r["buckets"] is not None else ""
        row["rounds"] = r["rounds"] if r["rounds"] is not None else ""
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks cpu", description=__doc__.split("\n")[0])
    p.add_argument("--net", default="1gbit", help="emulated link RATE[,DELAY] (benchmarks.netem), or 'loopback'")
    p.add_argument("--configs", default="ddp,torch-fp16,torch-powersgd-r1,blockquant-4bit",
                   help="comma-separated sweep configs (benchmarks.configs)")
    p.add_argument("--steps", type=int, default=100, help="measured steps per config")
    p.add_argument("--warmup", type=int, default=20, help="unmeasured steps first (JIT, bucket rebuild, warm-up)")
    p.add_argument("--bucket-cap-mb", type=float, default=None,
                   help="DDP's bucket_cap_mb for every config (default: DDP's own, a 1 MiB first bucket then "
                        "25 MiB; any value given makes DDP drop the small first bucket)")
    p.add_argument("--layers", action="store_true",
                   help="also time the hook's layers (thread CPU per step inside each, inclusive: LAYERS)")
    p.add_argument("--out", default="results", help="results root folder")
    args = p.parse_args(argv)
    from . import configs as C

    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [n for n in names if n not in C.BY_NAME]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {sorted(C.BY_NAME)}")
    net = None if args.net == "loopback" else args.net
    t0 = time.time()
    rows = run_suite(names, net=net, steps=args.steps, warmup=args.warmup, bucket_cap_mb=args.bucket_cap_mb,
                     layers=args.layers)
    out = results_dir("cpu", args.out)
    write_results(out, rows, {"suite": "cpu", "argv": argv, "net": args.net, "wall_seconds": time.time() - t0})
    table = markdown_table(rows, COLUMNS)
    if args.layers:
        table += "\n\nThread CPU per step inside each layer of the hook (ms, inclusive):\n\n" + markdown_table(
            rows, ["config", "worker_ms", "kernels_ms"] + [f"layer_{label}_ms" for label, _, _ in LAYERS])
    (out / "table.md").write_text(table + "\n")
    print(table)
    print(f"results: {out}")
    return 0
