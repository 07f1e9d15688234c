"""The cpu suite: its per-thread split (unit) and a tiny run on loopback (structure, no timing goals)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import cpu  # noqa: E402
from benchmarks.__main__ import SUITES  # noqa: E402


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_split_charges_each_thread_to_its_part():
    worker = threading.Thread(target=_spin, args=(0.06,), name="worker")
    other = threading.Thread(target=_spin, args=(0.03,), name="other")
    before = cpu.thread_cpu()
    worker.start()
    other.start()
    _spin(0.04)
    worker.join()
    other.join()
    # threads that ended are gone from /proc and not counted (the suite's threads outlive its window)
    loop = threading.get_native_id()
    after = cpu.thread_cpu()
    parts = cpu.split(before, after, loop, None)
    # /proc counts CPU in 10 ms ticks, sampled: 40 ms spun can read as 30 (CI saw 0.0299999...)
    assert parts["loop"] >= 0.02 and parts["worker"] == 0.0
    assert set(parts) == {"loop", "worker", "comm"}
    # a thread named as the worker is charged to it, any other to comm
    fake_before = {1: ("python", 1.0), 2: ("python", 0.5), 3: ("gloo_tcp_loop", 0.0)}
    fake_after = {1: ("python", 1.5), 2: ("python", 0.75), 3: ("gloo_tcp_loop", 0.1), 4: ("pt_gloo_runloop", 0.05)}
    assert cpu.split(fake_before, fake_after, 1, 2) == pytest.approx({"loop": 0.5, "worker": 0.25, "comm": 0.15})


def test_verdict_names_a_cpu_bound_rank():
    assert cpu.verdict({"cpu_s": 0.029, "step_s": 0.030}) == "CPU-bound"
    assert cpu.verdict({"cpu_s": 0.020, "step_s": 0.050}) == "waits"


@pytest.mark.timeout(150)
def test_tiny_run_splits_each_config(tmp_path):
    assert "cpu" in SUITES
    # every bucket held (join_buckets=inf): the default holds one only while the calibrated link says
    # it fits 1.5 ms of wire, which a loopback calibrated under the test run's load may not
    rows = cpu.run_suite(["ddp", "blockquant-4bit-joinall"], net=None, steps=6, warmup=3, layers=True)
    assert [r["config"] for r in rows] == ["ddp", "blockquant-4bit-joinall"]
    for r in rows:
        assert r["step_ms"] > 0 and r["cpu_ms"] > 0 and r["compute_ms"] > 0, r
        assert r["loop_ms"] > 0 and r["verdict"] in ("CPU-bound", "waits"), r
        assert r["idle_ms"] == pytest.approx(max(0.0, r["step_ms"] - r["cpu_ms"]), abs=0.02)
    ddp, bq = rows
    assert ddp["worker_ms"] == 0 and ddp["worker"] is False          # DDP's own path: no commpress worker
    assert bq["worker"] is True                                        # the overlap worker ran the buckets
    assert ddp["kernels_ms"] == 0 and 0 < bq["kernels_ms"] <= bq["cpu_ms"], (ddp, bq)   # numba's share
    assert ddp["buckets"] == "" and bq["buckets"] == 2               # DDP's 1 MiB first bucket, then the rest
    assert ddp["rounds"] == "" and bq["rounds"] == 1, bq             # the two buckets' messages in one round
    # --layers: DDP's own path has no hook layer; blockquant + EF on the CPU takes the steady lane, and
    # each layer holds the ones inside it (inclusive), all within the process's CPU
    labels = [label for label, _, _ in cpu.LAYERS]
    assert all(ddp[f"layer_{k}_ms"] == 0 for k in labels), ddp
    got = [bq[f"layer_{k}_ms"] for k in ("bucket", "unit", "allreduce", "gather_kind", "steady_lane")]
    assert all(v > 0 for v in got) and got == sorted(got, reverse=True), got
    assert bq["layer_all_gather_ms"] > 0 and bq["layer_dense_path_ms"] == 0, bq
    assert bq["layer_sparse_kind_ms"] == 0 and bq["layer_sparse_lane_ms"] == 0, bq
    assert bq["layer_bucket_ms"] <= bq["cpu_ms"] + 0.02, bq


@pytest.mark.timeout(150)
def test_an_explicit_bucket_cap_gives_the_digits_model_one_bucket():
    """``bucket_cap_mb`` given explicitly: DDP drops its small first bucket (its rule: an explicit cap
    caps the first bucket too), and the 4.5 MB model's gradient reaches the hook as one bucket."""
    (row,) = cpu.run_suite(["blockquant-4bit"], net=None, steps=3, warmup=3, bucket_cap_mb=25)
    assert row["buckets"] == 1, row


def test_kernel_clock_counts_each_outermost_kernel_call_once(monkeypatch):
    import torch

    from commpress import ops
    from commpress.ops import _numba_kernels as K

    clock = cpu.KernelClock()
    inner = clock._wrap(lambda: _spin(0.02))
    outer = clock._wrap(lambda: (_spin(0.02), inner()))
    outer()
    assert 0.04 <= clock.seconds() < 0.055                             # the nested call is not added twice
    for name in cpu.KERNELS:                                           # every entry point exists (restored after)
        monkeypatch.setattr(K, name, getattr(K, name))
    x = torch.randn(5000)
    before = ops.block_quantize(x, 4, 64, False, 0, backend="numba")
    clock.install()
    clock.install()                                                    # idempotent: no wrapper around a wrapper
    assert all(getattr(getattr(K, n), "_kernel_clock", False) for n in cpu.KERNELS)
    assert not getattr(K.block_quantize.__wrapped__, "_kernel_clock", False)
    start = clock.seconds()
    after = ops.block_quantize(x, 4, 64, False, 0, backend="numba")
    assert all(torch.equal(a, b) for a, b in zip(before, after)) and clock.seconds() > start


def test_layer_clock_counts_a_layer_once_however_deep_it_recurses():
    clock = cpu.LayerClock()
    calls = []

    def nested(n):
        calls.append(n)
        end = time.thread_time() + 0.002
        while time.thread_time() < end:
            pass
        return nested_timed(n - 1) if n else 0

    nested_timed = clock._wrap("bucket", nested)
    nested_timed(3)
    spent = clock.seconds()
    assert calls == [3, 2, 1, 0]
    assert 0.008 <= spent["bucket"] < 0.03            # four 2 ms spins, counted once (not 2+4+6+8 ms)
    assert spent["unit"] == 0.0
