"""The DDP hook's step-time account (issue 17): its structure, its rounds and its bytes.

Timing itself is never asserted (the machine is shared): the parts exist, are
non-negative, add up to the step by construction, and the rounds and bytes the
account charges are the ``torch.distributed`` calls a counter sees during one
steady-state step, per compressor kind.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run

import commpress
from commpress.collectives.accounting import all_gather_cost, all_reduce_cost
from commpress.hooks.common import Stats, Timer

PARTS = ("step", "compute_wait", "codec_total", "wire", "latency", "comm", "comm_wait", "framework")


class Calls:
    """Count the collective calls (and the bytes each hands to torch.distributed) made while active."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []

    def __enter__(self):
        # torch's flat all-gather, as commpress.collectives looks it up at call time
        self._ag_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        self._ar, self._ag, self._a2a = dist.all_reduce, getattr(dist, self._ag_name), dist.all_to_all_single

        def all_reduce(t, *a, **k):
            self.calls.append(("all_reduce", t.numel() * t.element_size()))
            return self._ar(t, *a, **k)

        def all_gather(out, t, *a, **k):
            self.calls.append(("all_gather", t.numel() * t.element_size()))
            return self._ag(out, t, *a, **k)

        def all_to_all(out, t, *a, **k):  # bytes this rank sends to the others
            p, me = dist.get_world_size(k.get("group")), dist.get_rank(k.get("group"))
            sizes = k.get("input_split_sizes") or [t.numel() // p] * p
            sent = sum(n for r, n in enumerate(sizes) if r != me) * t.element_size()
            self.calls.append(("all_to_all", sent))
            return self._a2a(out, t, *a, **k)

        dist.all_reduce, dist.all_to_all_single = all_reduce, all_to_all
        setattr(dist, self._ag_name, all_gather)
        return self

    def __exit__(self, *exc):
        dist.all_reduce, dist.all_to_all_single = self._ar, self._a2a
        setattr(dist, self._ag_name, self._ag)

    def bytes_sent(self, world: int) -> int:
        cost = {"all_reduce": all_reduce_cost, "all_gather": all_gather_cost, "all_to_all": lambda n, p: (n,)}
        return sum(cost[kind](n, world)[0] for kind, n in self.calls)


def _account_worker(rank, world):
    torch.manual_seed(0)
    commpress.collectives.set_cost_model(1e-4, 1e-9)  # fixed numbers: no calibration (test time)
    out = {}
    # (compressor, params, algorithm, overlap): one sparse, one gather (both algorithms), one lowrank
    # kind, inline; one on the overlap worker (its hook_cpu is the worker thread's)
    cases = [("topk", {"ratio": 0.05}, "auto", False), ("blockquant", {"bits": 4}, "two_phase", False),
             ("powersgd", {"rank": 2}, "auto", False), ("blockquant", {"bits": 8}, "gather_all", True)]
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 32, generator=g), torch.randn(8, 8, generator=g)
    for comp, params, algorithm, overlap in cases:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Linear(96, 64), nn.ReLU(), nn.Linear(64, 8)),
                    bucket_cap_mb=0.02)  # several buckets
        state = commpress.ddp.register(model, comp, overlap=overlap, algorithm=algorithm, **params)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        for _ in range(2):
            step()
        with Calls() as calls:
            step()
        last = state.stats.last_step
        mean = state.stats.as_dict()["account"]
        out[f"{comp}-{algorithm}"] = {
            "account": last["account"], "rounds": last["rounds"], "bytes_sent": last["bytes_sent"],
            "calls": [k for k, _ in calls.calls], "counted_bytes": calls.bytes_sent(world),
            "mean_keys": sorted(mean), "mean_steps": mean.get("steps"),
            "buckets": len(state._layout.plans), "algorithms": dict(state.stats.algorithms),
        }
        state.close()
    commpress.collectives.set_cost_model(None)
    return out


def test_account_rounds_and_bytes_match_the_collective_calls():
    results = run(_account_worker, 2, timeout=120)
    for rank_out in results:
        for case, r in rank_out.items():
            acc = r["account"]
            for part in PARTS:
                assert acc[part] >= 0.0, (case, part, acc)
            assert set(acc["codec"]) >= {"compress", "decompress"}, (case, acc["codec"])
            assert all(v >= 0.0 for v in acc["codec"].values())
            assert acc["calibrated"] is True
            # host CPU: the process's during the step, the hook's thread's part of it (inline: this thread)
            assert acc["cpu"] > 0.0 and 0.0 < acc["hook_cpu"] <= acc["cpu"] + 1e-3, (case, acc)
            # the parts add up to the step: unexplained is what is left, by definition
            total = sum(acc[p] for p in PARTS[1:] if p != "comm") + acc["unexplained"]
            assert abs(total - acc["step"]) < 1e-9, (case, acc)
            # rounds and bytes: what the hook charged is what torch.distributed was handed
            assert r["rounds"] == len(r["calls"]) == acc["rounds"], (case, r["calls"], r["rounds"])
            assert r["bytes_sent"] == r["counted_bytes"], case
            assert r["mean_steps"] >= 2 and "framework" in r["mean_keys"] and "codec" in r["mean_keys"]
        topk = rank_out["topk-auto"]
        assert set(topk["calls"]) <= {"all_gather", "all_reduce"}
        # powersgd: two all_reduce rounds per compressed unit
        assert rank_out["powersgd-auto"]["calls"].count("all_reduce") >= 2
        # two_phase: an all_to_all and an all_gather per unit (gather_all: tests/collectives/test_collectives_direct.py)
        assert "all_to_all" in rank_out["blockquant-two_phase"]["calls"]


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_account_cpu_is_the_process_host_time_and_hook_cpu_the_hooks_thread():
    """``cpu`` counts host CPU spent anywhere in the process during the step (here a spin outside
    the hook, and another thread's); ``hook_cpu`` only what the hook recorded for its own thread."""
    stats = Stats()
    stats.end_step()                        # opens the first interval
    with Timer(cpu=True) as t:
        _spin(0.02)
    worker = threading.Thread(target=_spin, args=(0.03,))
    worker.start()
    worker.join()
    _spin(0.01)                             # the "compute" between buckets: not the hook's
    stats.record(0, bytes_sent=8, dense_bytes=16, algorithm="x", hook_seconds=t.seconds,
                 hook_cpu_seconds=t.cpu_seconds)
    stats.end_step()
    acc = stats.last_step["account"]
    assert t.cpu_seconds == pytest.approx(0.02, abs=0.01) and t.seconds >= t.cpu_seconds - 1e-3
    assert acc["hook_cpu"] == t.cpu_seconds
    assert acc["cpu"] >= 0.06 - 0.005       # the hook's 20 ms, the other thread's 30, the rest's 10
    assert stats.account()["cpu"] == acc["cpu"] and stats.account()["hook_cpu"] == acc["hook_cpu"]
    assert Timer().__enter__().cpu_seconds == 0.0   # without cpu=True no thread clock is read
