"""PNG plots of a sweep (matplotlib, Agg backend): time-to-target, frontier, step-time breakdown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

KIND_STYLE = {"ddp": ("black", "-"), "torch_fp16": ("tab:gray", "--"), "torch_powersgd": ("tab:purple", "--"),
              "commpress": (None, "-")}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

def _panels(plt, n: int):
    """One 7x5-inch panel per task, side by side: ``(fig, axes[1][n])``."""
    return plt.subplots(1, n, figsize=(7 * n, 5), squeeze=False)


def _save(plt, fig, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "curve" in r]


def time_to_target(path: Path, rows_by_task: dict[str, list[dict]], meta: dict[str, Any]) -> Path:
    """Metric vs training wall time per configuration, the target as a dotted line."""
    plt = _plt()
    tasks = list(rows_by_task)
    fig, axes = _panels(plt, len(tasks))
    for ax, task in zip(axes[0], tasks):
        for r in _ok(rows_by_task[task]):
            color, ls = KIND_STYLE.get(r["kind"], (None, "-"))
            xs = [p["time"] for p in r["curve"]]
            ys = [p[r["metric"]] for p in r["curve"]]
            ax.plot(xs, ys, ls, color=color, label=r["config"], lw=2 if r["kind"] == "ddp" else 1.2)
        tgt = meta.get("targets", {}).get(task)
        if tgt:
            ax.axhline(tgt["target"], color="red", ls=":", lw=1, label="target")
            if tgt["metric"] == "val_loss":
                lo = min(p["val_loss"] for r in _ok(rows_by_task[task]) for p in r["curve"])
                ax.set_ylim(lo * 0.97, tgt["target"] * 1.6)
            else:
                ax.set_ylim(max(0.0, tgt["target"] - 0.15), 1.0)
        metric = tgt["metric"] if tgt else "metric"
        ax.set_xlabel("training wall time (s)")
        ax.set_ylabel(metric)
        ax.set_title(f"{task}: {metric} vs time ({meta.get('network', '')[:60]})", fontsize=9)
        ax.legend(fontsize=6, ncol=2)
        ax.grid(alpha=0.3)
    return _save(plt, fig, path / "time_to_target.png")


def frontier(path: Path, rows_by_task: dict[str, list[dict]], meta: dict[str, Any]) -> Path:  # noqa: ARG001
    """Bytes per step (log) vs final metric: the trade-off frontier."""
    plt = _plt()
    tasks = list(rows_by_task)
    fig, axes = _panels(plt, len(tasks))
    for ax, task in zip(axes[0], tasks):
        for r in _ok(rows_by_task[task]):
            color, _ = KIND_STYLE.get(r["kind"], (None, "-"))
            ax.scatter(max(r["bytes_sent"], 1), r["final"], color=color or "tab:blue", s=25)
            ax.annotate(r["config"], (max(r["bytes_sent"], 1), r["final"]), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("bytes sent per rank per step")
        ax.set_ylabel("final " + (_ok(rows_by_task[task])[0]["metric"] if _ok(rows_by_task[task]) else "metric"))
        ax.set_title(f"{task}: traffic vs final quality", fontsize=9)
        ax.grid(alpha=0.3, which="both")
    return _save(plt, fig, path / "frontier.png")


def step_breakdown(path: Path, rows_by_task: dict[str, list[dict]], meta: dict[str, Any]) -> Path:  # noqa: ARG001
    """Stacked bars: median step time = compute + compression + communication."""
    plt = _plt()
    tasks = list(rows_by_task)
    fig, axes = _panels(plt, len(tasks))
    for ax, task in zip(axes[0], tasks):
        rows = _ok(rows_by_task[task])
        names = [r["config"] for r in rows]
        comp = [1000 * r["compute_s"] for r in rows]
        codec = [1000 * r["compression_s"] for r in rows]
        comm = [1000 * r["comm_s"] for r in rows]
        x = range(len(rows))
        ax.bar(x, comp, label="compute", color="tab:blue")
        ax.bar(x, codec, bottom=comp, label="compression", color="tab:orange")
        ax.bar(x, comm, bottom=[a + b for a, b in zip(comp, codec)], label="communication", color="tab:green")
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("ms per step (median)")
        ax.set_title(f"{task}: step time breakdown", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    return _save(plt, fig, path / "step_time.png")


def make_all(path: Path, rows_by_task: dict[str, list[dict]], meta: dict[str, Any]) -> list[Path]:
    """All three plots; returns their paths."""
    return [time_to_target(path, rows_by_task, meta), frontier(path, rows_by_task, meta),
            step_breakdown(path, rows_by_task, meta)]
