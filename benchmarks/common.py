"""Shared benchmark plumbing: result folders, JSON/CSV writing, timing."""

from __future__ import annotations

import csv
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch


#: a rank of one core whose process CPU is this share of its step (wall) or more is CPU-bound
CPU_BOUND = 0.85


def cpu_bound(cpu_s: float, step_s: float) -> bool:
    """Whether a rank that used ``cpu_s`` of host CPU in a ``step_s`` step is CPU-bound
    (:data:`CPU_BOUND`): its bytes are hidden already, only less host work shortens its step."""
    return cpu_s >= CPU_BOUND * step_s


def earlier_choices(entry: dict[str, Any]) -> str:
    """An ``auto`` report entry's choices before its current one (``state.stats.as_dict()["auto"][unit]``):
    ``"blockquant(bits=8) from step 1, ..."``, or ``""`` when it never switched away from its first."""
    return ", ".join(f"{c} from step {st}" for st, c in (entry.get("switches") or [])[:-1])


def results_dir(suite: str, root: str | Path = "results") -> Path:
    """A fresh ``results/<suite>-<timestamp>/`` folder."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(root) / f"{suite}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = Path(root) / f"{suite}-{stamp}-{n}"
    path.mkdir(parents=True)
    return path


def environment() -> dict[str, Any]:
    """Facts that make a result reproducible (printed into every results.json)."""
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_results(path: Path, rows: list[dict[str, Any]], meta: dict[str, Any] | None = None) -> None:
    """Write ``results.json`` (meta + rows) and ``results.csv`` (rows) into ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    doc = {"meta": {**environment(), **(meta or {})}, "rows": rows}
    (path / "results.json").write_text(json.dumps(doc, indent=2, default=str))
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    with open(path / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def time_call(fn: Callable[[], Any], *, repeat: int = 5, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` over ``repeat`` runs (after ``warmup``)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memcpy_seconds(tensor: torch.Tensor, repeat: int = 5) -> float:
    """Median time of ``dst.copy_(tensor)``: the baseline every kernel ratio uses."""
    dst = torch.empty_like(tensor)
    return time_call(lambda: dst.copy_(tensor), repeat=repeat)


def markdown_table(rows: Iterable[dict[str, Any]], columns: list[str], floatfmt: str = ".3g") -> str:
    """A GitHub markdown table of ``columns`` from ``rows``."""
    def fmt(v: Any) -> str:
        return format(v, floatfmt) if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(fmt(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def steady_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with ``density_warmup=0`` for a compressor that has a density warm-up
    (topk, dgc, randomk): the speed benchmarks measure the steady state's payloads, not
    the larger ones of the first steps.  ``params`` as they are otherwise."""
    import commpress

    if name not in commpress.available() or "density_warmup" in params:
        return dict(params)
    if "density_warmup" in commpress.get(name, **params).config():
        return {**params, "density_warmup": 0}
    return dict(params)
