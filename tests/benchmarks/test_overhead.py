"""The overhead suite end to end with tiny settings: result structure and sane ratios (no timing goals)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import overhead  # noqa: E402
from benchmarks.__main__ import SUITES  # noqa: E402

TINY = {"ddp": ["ddp", "torch_allreduce", "cp_topk", "cp_auto"], "allreduce": ["dense", "cp_blockquant"], "fsdp": ["fsdp", "cp_identity"]}


def _positive_finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_registered():
    assert "overhead" in SUITES


@pytest.mark.timeout(120)
def test_tiny_run_structure_and_ratios():
    logs: list[str] = []
    rows = overhead.run_suite(overhead.SECTIONS, (2,), steps=3, warmup=2, sizes=(16, 128, 8), batch=4,
                              numel=4096, configs=TINY, stall_timeout=30.0, log=logs.append)
    assert [(r["section"], r["config"]) for r in rows] == [(s, c) for s in overhead.SECTIONS for c in TINY[s]]
    for r in rows:
        assert r["world"] == 2 and r["status"] == "ok", (r, logs)
        assert _positive_finite(r["ms"]), r
        assert _positive_finite(r["ratio_vs_baseline"]), r
        assert _positive_finite(r["bytes_per_step"]) and _positive_finite(r["dense_bytes_per_step"]), r
        if r["config"] == overhead.BASELINE[r["section"]]:
            assert r["ratio_vs_baseline"] == 1.0
    by = {(r["section"], r["config"]): r for r in rows}
    # (16x128 and 128x8 weights reach commpress's min_numel, so they are compressed)
    # compressed configs send less than dense; identity under FSDP2 sends exactly what FSDP2 does
    assert by["ddp", "cp_topk"]["bytes_per_step"] < by["ddp", "ddp"]["bytes_per_step"]
    assert by["allreduce", "cp_blockquant"]["bytes_per_step"] < by["allreduce", "dense"]["bytes_per_step"]
    assert by["fsdp", "cp_identity"]["bytes_per_step"] == by["fsdp", "fsdp"]["bytes_per_step"]
    text = overhead.tables(rows)
    assert text.count("### ") == 3 and "commpress topk 1%" in text
    # auto's row says what it chose per bucket, and is set against PyTorch's plain allreduce_hook (the floor)
    auto = by["ddp", "cp_auto"]
    assert auto["label"].startswith("commpress auto (bucket ") and ": " in auto["label"], auto["label"]
    assert _positive_finite(auto["ratio_vs_torch_hook"]), auto
    assert by["ddp", "torch_allreduce"]["bytes_per_step"] == by["ddp", "ddp"]["bytes_per_step"]


@pytest.mark.timeout(60)
def test_pin_gives_each_rank_one_core():
    kw = dict(steps=2, warmup=2, sizes=(8, 16, 4), batch=4, seed=0, stall_timeout=30.0, log=lambda m: None)
    pinned = overhead.measure("ddp", 2, ["ddp", "cp_identity"], pin=True, **kw)
    assert [r["status"] for r in pinned] == ["ok", "ok"] and {r["cores"] for r in pinned} == {1}, pinned
    free = overhead.measure("ddp", 2, ["ddp"], **kw)
    assert free[0]["cores"] == len(os.sched_getaffinity(0)), free


def test_failing_config_is_reported_and_the_rest_still_run():
    # PyTorch's bf16 hook raises on CPU/gloo (it needs CUDA/NCCL): the failure is reported, DDP still runs
    rows = overhead.measure("ddp", 2, ["ddp", "torch_bf16"], steps=2, warmup=2, sizes=(8, 16, 4), batch=4,
                            seed=0, stall_timeout=30.0, log=lambda m: None)
    by = {r["config"]: r for r in rows}
    assert by["ddp"]["status"] == "ok" and _positive_finite(by["ddp"]["ms"])
    assert by["torch_bf16"]["status"].startswith("failed")


def _interleave_order(rank, world, n, rounds, block=1, warmup=1):
    order: list[tuple[int, int]] = []

    class Progress:
        def at(self, i):
            pass

    # each step records (config, step); "mark" returns how many steps the config had run
    fns = [(lambda s, i=i: order.append((i, s)) if s != "mark" else sum(c == i for c, _ in order))
           for i in range(n)]
    medians, marks = overhead._interleave(rank, world, Progress(), [f"c{i}" for i in range(n)], fns, warmup,
                                          rounds - warmup, block)
    return order, medians, marks


@pytest.mark.timeout(60)
def test_interleave_rotates_the_order_so_no_config_always_follows_another():
    """Each round starts one configuration later: every configuration takes every place in a round
    equally often (a fixed order made the last one always the step after the second last)."""
    from distributed import run

    n, rounds, warmup = 3, 7, 1
    order, medians, _ = run(_interleave_order, 1, n, rounds, 1, warmup)[0]
    order = [i for i, _ in order]
    assert len(order) == n * rounds and len(medians) == n
    assert order[:n] == list(range(n))          # the warm-up step of each
    per_round = [order[n + k * n:n + (k + 1) * n] for k in range(rounds - warmup)]
    for s, r in enumerate(per_round):
        assert r == [(s + j) % n for j in range(n)]
    for cfg in range(n):
        places = [r.index(cfg) for r in per_round]
        assert sorted(places) == sorted(list(range(n)) * ((rounds - warmup) // n))


@pytest.mark.timeout(60)
def test_interleave_runs_each_warm_up_back_to_back_then_blocks_and_marks_each_warm_up_end():
    """Each configuration's warm-up steps run back to back (``"auto"`` decides on them: its compute
    is the time from one of its steps to the next); then ``block=k``: k consecutive timed steps of
    one configuration (the last block short), rounds rotated as with single steps; each
    configuration's mark is taken just before its first timed step, whatever the others have run."""
    from distributed import run

    n, total, block, warmup = 3, 11, 3, 4
    order, medians, marks = run(_interleave_order, 1, n, total, block, warmup)[0]
    assert len(order) == n * total and len(medians) == n
    want = [(i, s) for i in range(n) for s in range(warmup)]
    for r in range(3):   # rounds of 3, 3 and 1 timed steps
        for i in [(r + j) % n for j in range(n)]:
            want += [(i, s) for s in range(warmup + r * block, min(total, warmup + (r + 1) * block))]
    assert order == want
    assert marks == {f"c{i}": warmup for i in range(n)}
