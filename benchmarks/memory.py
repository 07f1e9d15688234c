"""``python -m benchmarks memory``: the memory commpress's hooks keep per parameter, reported and measured.

DESIGN.md, "The memory budget": ``state.stats.memory_overhead_bytes`` must count every byte
the hook keeps alive, and a benchmark holds it against measured memory.  This is that benchmark
on CPU (the RSS slope).

Model: 8 ``nn.Linear(W, W)`` (bias on, ReLU between), AdamW (``topk-opt``: SGD momentum 0.9 with
``optimizer=``, against plain DDP with the same SGD), ``--steps`` steps on random data (batch 32,
loss ``mean(out**2)``); 2 gloo ranks (FileStore, no ports), ``torch.set_num_threads(1)``.  Every
(config, W) runs in its own fresh rank processes, forked from a forkserver (torch and commpress
preloaded) that a driver process starts; the driver is spawned with
``MALLOC_MMAP_THRESHOLD_=65536`` and ``MALLOC_TRIM_THRESHOLD_=0`` in its environment, which
every rank inherits, so that glibc serves every tensor of 64 KiB or more with its own mmap and a
freed one leaves the RSS.

- **measured** B/param: each rank's RSS (``VmRSS``), sampled at the end of every step and once
  after the run, its maximum, averaged over the ranks; the config's RSS minus its baseline's
  (plain DDP / plain FSDP2, the same optimizer), as the slope between the model widths
  (``--sizes``, least squares over the parameter counts): fixed costs (libraries, JIT code, one
  bucket of scratch) drop out.  ``hwm`` B/param: the same with the kernel's peak (``VmHWM``),
  which also sees a step's transients.  A baseline's own row shows its total slope (its whole
  training state per parameter) in the note.
- **reported** B/param: ``state.stats.memory_overhead_bytes / n_params`` after the last step, at
  the largest width (PyTorch's PowerSGD hook: n/a; the bytes of its state's tensors are in the
  note).
- **released** B/param: the RSS each rank gets back when every buffer the hook's state keeps is
  dropped after the run, at the largest width: the direct check of the reported figure (the
  measured slope also holds whatever the hooked run and its baseline do differently besides).
- FSDP2 rows: the overhead as a fraction of the rank's sharded training state (params + grads,
  8/P bytes per parameter) at P=2, and projected to P=8 and P=64 from how the reported figure
  changes from P=2 to P=4 (one more run at P=4 and the smallest width, reported only; fitted as
  a + b/P per parameter; ``--scaling-world 0``: no such run, the projection assumes the
  overhead does not shrink with P).

Compressors with a density warm-up (topk, dgc) run with ``density_warmup=0`` (the steady state,
as the speed benchmarks).  The plain commpress configs keep register's default residual storage
(the DDP hook's int8); configs with ``residual_storage=`` (``-fp32res``, ``-bf16res``,
``-int8res``, ``-int4res``; ``-int8unit`` with ``rollback="unit"``) are added when ``commpress.ddp.register`` (``commpress.fsdp.register`` for the FSDP2 ones) takes it.

Writes ``results/memory-<timestamp>/`` (``results.json``, ``results.csv``, ``table.md``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import math
import multiprocessing as mp
import os
import queue as queue_mod
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

from .common import markdown_table, results_dir, steady_params, write_results
from .overhead import _context, _watch_parent

DEPTH = 8
BATCH = 32
SIZES = (1024, 2048)
STEPS = 6
WORLD = 2
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
PROJECT_P = (8, 64)

#: name -> spec: kind (ddp / fsdp), label, compressor (None: no commpress), params (the
#: compressor's), opt (adamw / sgdm), baseline (None: it is one), torch (a PyTorch hook),
#: takeover (``optimizer=``), options (register()'s own: ``residual_storage``)
CONFIGS: dict[str, dict[str, Any]] = {}


def _add(name: str, kind: str, label: str, compressor: str | None = None, params: dict | None = None, *,
         opt: str = "adamw", baseline: str | None = None, torch_hook: str | None = None,
         takeover: bool = False, ddp: dict | None = None) -> None:
    CONFIGS[name] = {"kind": kind, "label": label, "compressor": compressor, "params": dict(params or {}),
                     "opt": opt, "baseline": baseline, "torch": torch_hook, "takeover": takeover, "options": {},
                     "ddp": dict(ddp or {})}


_add("ddp", "ddp", "plain DDP (AdamW)")
_add("fsdp", "fsdp", "plain FSDP2 (AdamW)")
_add("ddp-sgdm", "ddp", "plain DDP (SGD momentum 0.9)", opt="sgdm")
_add("torch-powersgd", "ddp", "PyTorch powerSGD_hook r4", baseline="ddp", torch_hook="powersgd")
_add("torch-powersgd-batched", "ddp", "PyTorch batched_powerSGD_hook r4", baseline="ddp",
     torch_hook="powersgd_batched")
_add("identity", "ddp", "commpress identity", "identity", baseline="ddp")
_add("fp16", "ddp", "commpress fp16", "fp16", baseline="ddp")
_add("blockquant8", "ddp", "commpress blockquant 8-bit", "blockquant", {"bits": 8}, baseline="ddp")
_add("blockquant4", "ddp", "commpress blockquant 4-bit", "blockquant", {"bits": 4}, baseline="ddp")
_add("topk", "ddp", "commpress topk 1%", "topk", {"ratio": 0.01}, baseline="ddp")
_add("dgc", "ddp", "commpress dgc 1%", "dgc", {"ratio": 0.01}, baseline="ddp")
_add("powersgd", "ddp", "commpress powersgd", "powersgd", baseline="ddp")
_add("auto", "ddp", "commpress auto", "auto", baseline="ddp")
_add("topk-opt", "ddp", "commpress topk 1% optimizer= (SGD momentum)", "topk", {"ratio": 0.01}, opt="sgdm",
     baseline="ddp-sgdm", takeover=True)
_add("auto-opt", "ddp", "commpress auto optimizer= (SGD momentum)", "auto", opt="sgdm", baseline="ddp-sgdm",
     takeover=True)
# the gradients are the buckets: nothing to lend (commpress.loan), a pending residual per key instead
_add("ddp-viewgrads", "ddp", "plain DDP (AdamW) gradient_as_bucket_view", ddp={"gradient_as_bucket_view": True})
_add("blockquant4-viewgrads", "ddp", "commpress blockquant 4-bit, gradient_as_bucket_view", "blockquant", {"bits": 4},
     baseline="ddp-viewgrads", ddp={"gradient_as_bucket_view": True})
_add("fsdp-blockquant4", "fsdp", "commpress FSDP2 blockquant 4-bit", "blockquant", {"bits": 4}, baseline="fsdp")
_add("fsdp-topk", "fsdp", "commpress FSDP2 topk 1%", "topk", {"ratio": 0.01}, baseline="fsdp")
#: added only where register() takes residual_storage
RESIDUAL_CONFIGS = {f"{base}-{store}res": (base, store)
                    for base in ("blockquant4", "topk", "fsdp-blockquant4", "fsdp-topk")
                    for store in ("fp32", "bf16", "int8", "int4")}
for _name, (_base, _store) in RESIDUAL_CONFIGS.items():
    _b = CONFIGS[_base]
    _add(_name, _b["kind"], f"{_b['label']} residual_storage={_store}", _b["compressor"], _b["params"],
         baseline=_b["baseline"])
    CONFIGS[_name]["options"] = {"residual_storage": _store}   # register()'s, not the compressor's
#: int8 residuals committed per unit (rollback="unit": no pending copy between steps)
for _base in ("blockquant4", "topk", "topk-opt", "fsdp-blockquant4", "fsdp-topk"):
    _b = CONFIGS[_base]
    _name = f"{_base}-int8unit"
    RESIDUAL_CONFIGS[_name] = (_base, "int8")
    _add(_name, _b["kind"], f"{_b['label']} residual_storage=int8 rollback=unit", _b["compressor"],
         _b["params"], opt=_b.get("opt", "adamw"), baseline=_b["baseline"], takeover=_b.get("takeover", False))
    CONFIGS[_name]["options"] = {"residual_storage": "int8", "rollback": "unit"}
#: PyTorch's powerSGD_hook can deadlock on gloo with several buckets: the batched one then
FALLBACK = {"torch-powersgd": "torch-powersgd-batched"}
DEFAULT_CONFIGS = [n for n in CONFIGS if n != "torch-powersgd-batched"]


def residual_storage_supported(kind: str) -> bool:
    """Whether ``commpress.<kind>.register`` takes ``residual_storage=``."""
    import commpress
    import commpress.fsdp  # noqa: F401 - commpress.fsdp is not imported by ``import commpress``

    register = commpress.ddp.register if kind == "ddp" else commpress.fsdp.register
    return "residual_storage" in inspect.signature(register).parameters


def available_configs() -> list[str]:
    """The default configs, those with ``residual_storage=`` where register() takes it."""
    support = {k: residual_storage_supported(k) for k in ("ddp", "fsdp")}
    return [n for n in DEFAULT_CONFIGS if n not in RESIDUAL_CONFIGS or support[CONFIGS[n]["kind"]]]


# ============================================================== rank side
def _proc_status() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(line.split()[1]) * 1024
    return out


def _tensor_bytes(tensors) -> int:
    import torch

    total, seen = 0, set()
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def _train(rank: int, world: int, spec: dict[str, Any], width: int, steps: int, batch: int) -> dict[str, Any]:
    import torch
    from torch import nn

    import commpress

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(DEPTH):
        layers.append(nn.Linear(width, width))
        if i < DEPTH - 1:
            layers.append(nn.ReLU())
    model: nn.Module = nn.Sequential(*layers)
    n_params = sum(p.numel() for p in model.parameters())
    state: Any = None
    if spec["kind"] == "fsdp":
        import commpress.fsdp  # noqa: F401
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        # PyTorch's PowerSGD hooks: the whole model one bucket (after DDP's rebuild, before PowerSGD
        # starts); with several, powerSGD_hook's P / Q all_reduces of different buckets interleave in
        # a different order on each gloo rank (a collective mismatch).  The buckets' total is the same.
        cap = {"bucket_cap_mb": 4096} if spec["torch"] else {}
        model = nn.parallel.DistributedDataParallel(model, **cap, **spec.get("ddp", {}))
    if spec["opt"] == "sgdm":
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    comp = spec["compressor"]
    rss_before = _proc_status()["VmRSS"]
    if spec["torch"]:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
        model.register_comm_hook(state, psgd.powerSGD_hook if spec["torch"] == "powersgd"
                                 else psgd.batched_powerSGD_hook)
    elif comp is not None:
        params = {**steady_params(comp, spec["params"]), **spec["options"]}
        if spec["takeover"]:
            params["optimizer"] = opt
        register = commpress.ddp.register if spec["kind"] == "ddp" else commpress.fsdp.register
        state = register(model, comp, **params)
    register_bytes = _proc_status()["VmRSS"] - rss_before   # what registering took (before any step)

    rss_steps, reported = [], []
    for s in range(steps):
        g = torch.Generator().manual_seed(1000 * s + rank)
        x = torch.randn(batch, width, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        del x
        rss_steps.append(_proc_status()["VmRSS"])
        if comp is not None and not spec["torch"]:
            reported.append(int(state.stats.memory_overhead_bytes))
    gc.collect()
    end = _proc_status()
    out: dict[str, Any] = {"n_params": n_params, "rss_steps": rss_steps, "rss_end": end["VmRSS"],
                           "register_bytes": register_bytes,
                           "rss_peak": max(rss_steps + [end["VmRSS"]]), "hwm": end["VmHWM"]}
    if comp is not None and not spec["torch"]:
        out["reported_bytes"] = reported[-1]
        out["reported_max_bytes"] = max(reported)
        out["released_bytes"] = _release(state)
        if comp == "auto":
            try:
                out["auto_choices"] = sorted({str(v.get("choice", v)) if isinstance(v, dict) else str(v)
                                              for v in (state.stats.as_dict().get("auto") or {}).values()})
            except Exception:  # noqa: BLE001 - a label only
                pass
        state.close()
    elif spec["torch"]:   # what PyTorch's PowerSGD state keeps: its error feedback and warm-started P, Q
        out["torch_state_bytes"] = _tensor_bytes(list(state.error_dict.values()) + list(state.p_memory_dict.values())
                                                 + list(state.q_memory_dict.values()))
    return out


def _rank_entry(rank, world, store_path, parent_pid, results, spec, width, steps, batch, pg_timeout):
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        out = _train(rank, world, spec, width, steps, batch)
        out["malloc_env"] = {k: os.environ.get(k) for k in MALLOC_ENV}
        dist.barrier()
        results.put(("ok", rank, out))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put(("fail", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        results.close()
        results.join_thread()
        os._exit(1)


# ============================================================ parent side
_ENV_LOCK = threading.Lock()


def run_once(name: str, width: int, *, steps: int = STEPS, world: int = WORLD, batch: int = BATCH,
             timeout: float = 300.0) -> dict[str, Any]:
    """One run of config ``name`` at width ``width`` on ``world`` fresh rank processes (forked from
    the suite's forkserver, see :func:`run_suite`); ``{"status": "ok", "ranks": [per-rank dict]}``
    or ``{"status": "failed: ..."}``."""
    spec = CONFIGS[name]
    ctx = _context()
    results = ctx.Queue()
    procs = []
    got: dict[int, dict[str, Any]] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="commpress-memory-") as tmp:
        store = os.path.join(tmp, "store")
        try:
            for r in range(world):
                p = ctx.Process(target=_rank_entry, daemon=True,
                                args=(r, world, store, os.getpid(), results, spec, width, steps, batch,
                                      min(timeout, 120.0)))
                p.start()
                procs.append(p)
            while len(got) < world:
                if time.monotonic() - t0 > timeout:
                    return {"status": f"failed: no result within {timeout:.0f}s (hang)"}
                try:
                    kind, rank, payload = results.get(timeout=0.5)
                except queue_mod.Empty:
                    dead = [i for i, p in enumerate(procs) if i not in got and not p.is_alive()]
                    if dead and results.empty():
                        time.sleep(0.5)
                        if results.empty():
                            return {"status": f"failed: rank(s) {dead} died "
                                              f"(exit codes {[procs[i].exitcode for i in dead]})"}
                    continue
                if kind != "ok":
                    last = payload.strip().splitlines()
                    inner = payload.split("when running the callback: ")[-1].strip().splitlines()[0]
                    if inner.endswith(": "):   # a bare assert: say where it fired
                        inner += " ".join(x.strip() for x in last[-4:-2])
                    return {"status": f"failed: rank {rank}: {inner[:200]}", "traceback": "\n".join(last[-8:])}
                got[rank] = payload
            return {"status": "ok", "ranks": [got[r] for r in range(world)], "seconds": time.monotonic() - t0}
        finally:
            for p in procs:
                p.join(timeout=10 if len(got) == world else 0.1)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)


def _measure_all(names: list[str], sizes: list[int], steps: int, world: int, batch: int, scaling_world: int,
                 timeout: float, log: Callable[[str], None]) -> dict[str, Any]:
    """Every config at every width (its fresh rank processes each), the FSDP2 scaling runs; raw."""
    raw: dict[str, dict[str, Any]] = {}
    todo = list(names)
    while todo:
        name = todo.pop(0)
        runs, status, t0 = {}, "ok", time.monotonic()
        for w in sizes:
            res = run_once(name, w, steps=steps, world=world, batch=batch, timeout=timeout)
            if res["status"] != "ok":
                status = res["status"]
                log(f"[{name} W={w}] {status}" + (f"\n{res['traceback']}" if res.get("traceback") else ""))
                break
            runs[w] = res["ranks"]
        raw[name] = {"status": status, "runs": runs, "seconds": time.monotonic() - t0}
        log(f"[{name}] {status}, {raw[name]['seconds']:.0f}s")
        if status != "ok" and name in FALLBACK and FALLBACK[name] not in raw:
            log(f"[{name}] running {FALLBACK[name]} in its place")
            todo.insert(0, FALLBACK[name])
        spec = CONFIGS[name]
        if (status == "ok" and scaling_world and scaling_world != world and spec["kind"] == "fsdp"
                and spec["compressor"] is not None):
            t0 = time.monotonic()
            res = run_once(name, sizes[0], steps=steps, world=scaling_world, batch=batch, timeout=timeout)
            raw[name]["scaling"] = res
            log(f"[{name} P={scaling_world} W={sizes[0]}] {res['status']}, {time.monotonic() - t0:.0f}s")
    return raw


def _driver(out_queue, args: tuple, kwargs: dict) -> None:
    """The suite's driver process: started with :data:`MALLOC_ENV` in its environment, so the
    forkserver it starts, and every rank forked from it, has it too."""
    try:
        raw = _measure_all(*args, log=lambda m: out_queue.put(("log", m)), **kwargs)
        out_queue.put(("done", raw))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out_queue.put(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_suite(configs: list[str] | None = None, sizes=SIZES, *, steps: int = STEPS, world: int = WORLD,
              batch: int = BATCH, scaling_world: int = 4, timeout: float = 300.0,
              log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every config (and the baselines it needs) at every width; one row per config.

    The runs are made by one driver process spawned with :data:`MALLOC_ENV` in its environment
    (glibc reads it when a process starts); it starts its own forkserver (torch and commpress
    preloaded), from which each run forks its fresh rank processes."""
    sizes = sorted(set(int(s) for s in sizes))
    if len(sizes) < 2:
        raise ValueError("need at least two widths for a slope")
    names = _with_baselines(list(configs or available_configs()))
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configs {unknown} (known: {', '.join(CONFIGS)})")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with _ENV_LOCK:   # spawn execs with this process's environment
        saved = {k: os.environ.get(k) for k in MALLOC_ENV}
        os.environ.update(MALLOC_ENV)
        try:
            proc = ctx.Process(target=_driver, args=(q, (names, sizes, steps, world, batch, scaling_world),
                                                     {"timeout": timeout}))
            proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    raw = None
    try:
        while raw is None:
            try:
                kind, payload = q.get(timeout=1.0)
            except queue_mod.Empty:
                if not proc.is_alive() and q.empty():
                    raise RuntimeError(f"the memory suite's driver died (exit code {proc.exitcode})") from None
                continue
            if kind == "log":
                log(payload)
            elif kind == "error":
                raise RuntimeError(f"the memory suite's driver failed: {payload}")
            else:
                raw = payload
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    rows = [_row(name, raw, sizes, world) for name in raw]
    for row in rows:
        if "scaling" in raw[row["config"]]:
            _scaling(row, raw[row["config"]], sizes[0], scaling_world)
        if (row["kind"] == "fsdp" and row["baseline"] and row["status"] == "ok"
                and row.get("measured_bytes_per_param") is not None):
            _fsdp_fractions(row, world)
    return rows


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs``."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _with_baselines(configs: list[str]) -> list[str]:
    """``configs`` with the baselines they need first (each once)."""
    out: list[str] = []
    for name in configs:
        base = CONFIGS[name]["baseline"]
        if base and base not in out:
            out.append(base)
    return out + [n for n in configs if n not in out]


def _release(state: Any) -> int:
    """RSS the hook's state gives back when every buffer it keeps is dropped (the error feedbacks'
    tables, the units' gather pool, the plans' dense scratch, the collectives' caches): a direct
    check of the reported figure, free of the baseline's own differences."""
    import torch

    from commpress import collectives

    before = _proc_status()["VmRSS"]
    codec = state.codec
    for c in [codec, getattr(codec, "home", None), *getattr(codec, "codecs", {}).values()]:
        for table in ("_residuals", "_pending", "_open", "_velocity", "_velocity_pending", "_decode",
                      "_dense_velocity", "_dense_pending"):
            getattr(c, table, {}).clear()
    getattr(codec, "_carry", {}).clear()
    layout = getattr(state, "_layout", None)
    if layout is not None:
        layout.scratch = type(layout.scratch)()
        for plan in layout.plans.values():
            plan.dense_scratch = None
    collectives.clear_caches()
    del codec, layout
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return before - _proc_status()["VmRSS"]


def _row(name: str, raw: dict[str, dict[str, Any]], sizes: list[int], world: int) -> dict[str, Any]:
    spec = CONFIGS[name]
    r = raw[name]
    row: dict[str, Any] = {"config": name, "label": spec["label"], "kind": spec["kind"],
                           "baseline": spec["baseline"] or "", "status": r["status"], "world": world,
                           "sizes": sizes, "seconds": r["seconds"]}
    if r["status"] != "ok":
        return row
    runs = r["runs"]
    n = [runs[w][0]["n_params"] for w in sizes]
    rss = [_mean([k["rss_peak"] for k in runs[w]]) for w in sizes]
    hwm = [_mean([k["hwm"] for k in runs[w]]) for w in sizes]
    row.update(n_params=n, rss_peak=rss, hwm=hwm, rss_peak_per_rank=[[k["rss_peak"] for k in runs[w]] for w in sizes],
               total_bytes_per_param=_slope(n, rss), total_hwm_bytes_per_param=_slope(n, hwm),
               malloc_env=runs[sizes[0]][0].get("malloc_env"),
               rss_steps_rank0=[runs[w][0]["rss_steps"] + [runs[w][0]["rss_end"]] for w in sizes])
    if "reported_bytes" in runs[sizes[0]][0]:
        rep = [max(k["reported_bytes"] for k in runs[w]) for w in sizes]
        row.update(reported_bytes=rep, reported_bytes_per_param=rep[-1] / n[-1],
                   reported_max_bytes=[max(k["reported_max_bytes"] for k in runs[w]) for w in sizes])
        if "released_bytes" in runs[sizes[-1]][0]:
            row["released_bytes_per_param"] = _mean([k["released_bytes"] for k in runs[sizes[-1]]]) / n[-1]
    if "torch_state_bytes" in runs[sizes[0]][0]:
        row["torch_state_bytes_per_param"] = max(k["torch_state_bytes"] for k in runs[sizes[-1]]) / n[-1]
    if "auto_choices" in runs[sizes[-1]][0]:
        row["auto_choices"] = runs[sizes[-1]][0]["auto_choices"]
    base = spec["baseline"]
    if base is None:
        row["measured_bytes_per_param"] = 0.0   # by definition; its own total is total_bytes_per_param
        row["hwm_bytes_per_param"] = 0.0
    elif raw.get(base, {}).get("status") == "ok":
        b = _row(base, raw, sizes, world)
        row["measured_bytes_per_param"] = _slope(n, [a - c for a, c in zip(rss, b["rss_peak"])])
        row["hwm_bytes_per_param"] = _slope(n, [a - c for a, c in zip(hwm, b["hwm"])])
        row["measured_at"] = [(a - c) / m for a, c, m in zip(rss, b["rss_peak"], n)]   # naive, fixed costs in
        # the intercept: bytes over the baseline that do not grow with the model (threads, groups, scratch)
        row["fixed_bytes"] = rss[0] - b["rss_peak"][0] - row["measured_bytes_per_param"] * n[0]
        row["register_bytes"] = [_mean([k["register_bytes"] for k in runs[w]]) for w in sizes]
    return row


def _scaling(row: dict[str, Any], raw_row: dict[str, Any], width: int, p2: int) -> None:
    """How ``row``'s reported figure changes from P=world to P=``p2`` (same width): a + c/P per param."""
    res = raw_row["scaling"]
    if res["status"] != "ok":
        row["scaling_status"] = res["status"]
        return
    n = res["ranks"][0]["n_params"]
    b1 = max(k["reported_bytes"] for k in raw_row["runs"][width]) / n
    b2 = max(k["reported_bytes"] for k in res["ranks"]) / n
    p1 = row["world"]
    c = (b1 - b2) / (1 / p1 - 1 / p2)
    a = b1 - c / p1
    row.update(scaling_world=p2, reported_bytes_per_param_by_world={p1: b1, p2: b2}, scaling_a=a, scaling_c=c)


def _fsdp_fractions(row: dict[str, Any], world: int) -> None:
    """Overhead / the rank's sharded params + grads (8/P B/param) at P=world and projected."""
    m = row["measured_bytes_per_param"]
    row["sharded_state_bytes_per_param"] = 8.0 / world
    row["fraction_of_sharded_state"] = {world: m / (8.0 / world)}
    a, c = row.get("scaling_a"), row.get("scaling_c")
    for p in PROJECT_P:
        if a is not None and (a + c / world) > 0:
            mp_ = m * (a + c / p) / (a + c / world)   # the measured figure, scaled as the reported one
        else:
            mp_ = m   # assume it does not shrink with P
        row["fraction_of_sharded_state"][p] = mp_ / (8.0 / p)
    row["projection"] = "from P=2 and P=4 reported (a + c/P)" if a is not None else "assumes no shrink with P"


def _fmt(x: Any, digits: int = 2) -> str:
    return f"{x:.{digits}f}" if isinstance(x, float) and math.isfinite(x) else ("n/a" if x is None else str(x))


def _note(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return row["status"]
    parts = []
    if not row["baseline"]:
        parts.append(f"baseline; its total {_fmt(row['total_bytes_per_param'])} B/param "
                     f"(HWM {_fmt(row['total_hwm_bytes_per_param'])})")
    else:
        parts.append(f"vs {row['baseline']}")
    if "torch_state_bytes_per_param" in row:
        parts.append(f"its state's tensors {_fmt(row['torch_state_bytes_per_param'])} B/param")
    rep, meas = row.get("reported_bytes_per_param"), row.get("measured_bytes_per_param")
    if rep is not None and CONFIGS[row["config"]]["takeover"]:
        # the hook keeps the momentum; SGD, its momentum 0 now, allocates no buffer (4 B/param)
        rep -= 4.0
        parts.append(f"reported less the optimizer's momentum it takes over: {rep:.2f}")
    if rep is not None and meas is not None and abs(rep - meas) > max(0.5, 0.1 * abs(rep)):
        parts.append(f"measured - reported = {meas - rep:+.2f}")
    if abs(row.get("fixed_bytes", 0.0)) > 32e6:
        parts.append(f"fixed {row['fixed_bytes'] / 1e6:+.0f} MB (not per param)")
    if row.get("auto_choices"):
        parts.append("chose " + ", ".join(row["auto_choices"]))
    if "fraction_of_sharded_state" in row:
        f = row["fraction_of_sharded_state"]
        parts.append("of sharded params+grads: " + ", ".join(f"P={p} {100 * v:.0f}%" for p, v in f.items())
                     + f" ({row['projection']})")
    return "; ".join(parts)


def table(rows: list[dict[str, Any]]) -> str:
    cells = [{"config": r["config"],
              "reported B/param": _fmt(r.get("reported_bytes_per_param")),
              "measured B/param": _fmt(r.get("measured_bytes_per_param")),
              "HWM B/param": _fmt(r.get("hwm_bytes_per_param")),
              "released B/param": _fmt(r.get("released_bytes_per_param")),
              "note": _note(r)} for r in rows]
    return markdown_table(cells, ["config", "reported B/param", "measured B/param", "HWM B/param",
                                  "released B/param", "note"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks memory", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=None,
                   help=f"comma-separated subset (baselines are added); default: all of {','.join(DEFAULT_CONFIGS)}")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="model widths W (default 1024,2048)")
    p.add_argument("--steps", type=int, default=STEPS, help=f"training steps per run (default {STEPS})")
    p.add_argument("--scaling-world", type=int, default=4,
                   help="FSDP2: one more run at this P for the projection (default 4; 0: none)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it counts as hung")
    p.add_argument("--out", default="results", help="results root folder")
    args = p.parse_args(argv)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()] if args.configs else available_configs()
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        p.error(f"--configs: unknown {bad}; choose from {','.join(CONFIGS)}")
    skipped = [c for c in configs if c in RESIDUAL_CONFIGS and not residual_storage_supported(CONFIGS[c]["kind"])]
    if skipped:
        print(f"skipped (register() has no residual_storage=): {','.join(skipped)}")
        configs = [c for c in configs if c not in skipped]
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if len(set(sizes)) < 2 or min(sizes) < 1:
        p.error("--sizes needs at least two different widths")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    print(f"memory: {len(_with_baselines(configs))} configs at W={sizes}, {args.steps} steps, {WORLD} gloo ranks, "
          f"{MALLOC_ENV}", flush=True)
    t0 = time.time()
    rows = run_suite(configs, sizes, steps=args.steps, scaling_world=args.scaling_world, timeout=args.timeout,
                     log=lambda m: print(m, flush=True))
    wall = time.time() - t0
    n = [f"{r['n_params'][0] / 1e6:.1f}M..{r['n_params'][-1] / 1e6:.1f}M" for r in rows if "n_params" in r][:1]
    text = (table(rows) + f"\n\nB/param per rank; measured: slope of the step-end RSS peak over params "
            f"({', '.join(n)}) minus the baseline's; HWM: the same with VmHWM; {WORLD} ranks, {args.steps} steps; "
            f"{wall:.0f}s in total.")
    out = results_dir("memory", args.out)
    write_results(out, rows, {"suite": "memory", "argv": argv, "configs": configs, "sizes": sizes,
                              "steps": args.steps, "world": WORLD, "batch": BATCH, "depth": DEPTH,
                              "malloc_env": MALLOC_ENV, "wall_seconds": wall})
    (out / "table.md").write_text(text + "\n")
    print()
    print(text)
    print(f"results: {out}")
    return 0 if all(r["status"] == "ok" for r in rows if not r["config"].startswith("torch-")) else 1


if __name__ == "__main__":
    sys.exit(main())
