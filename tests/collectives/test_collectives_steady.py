"""Steady-state allreduce: payload messages only, status inside the payload, device-side verdicts.
(The sparsifiers run without their density warm-up here: these tests are about the steady state.)

These workers run the product's real path: the default ops backend (numba on CPU),
the default environment, one torch thread per rank.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distributed import run

import commpress
from commpress.collectives import CommStats, CollectiveInputError, allreduce

N = 4096


def data(rank: int, step: int, n: int = N) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + rank))


def ring(nbytes: int, world: int) -> int:
    return 2 * nbytes * (world - 1) // world


def sparse_message(slots: int) -> int:
    """Status word, int32 indices, fp32 values, each part starting 8-aligned."""
    a8 = lambda b: (b + 7) // 8 * 8  # noqa: E731
    return a8(a8(8 + 4 * slots) + 4 * slots)


def steady_bytes_worker(rank, world):
    import numba.np.ufunc.parallel as pool

    from commpress import ops

    assert ops.resolve("topk_compact", torch.device("cpu")).__module__.endswith("numba_backend")
    cases = {
        "topk": (commpress.ErrorFeedback(commpress.get("topk", ratio=0.01, density_warmup=0)), "allgather"),
        "dgc": (commpress.ErrorFeedback(commpress.get("dgc", ratio=0.01, density_warmup=0)), "allgather"),
        "topk_dense": (commpress.ErrorFeedback(commpress.get("topk", ratio=0.01, density_warmup=0)), "dense"),
        "blockquant": (commpress.ErrorFeedback(commpress.get("blockquant", bits=8)), "two_phase"),
        "gather_all": (commpress.get("blockquant", bits=4), "gather_all"),
        "fp16": (commpress.get("fp16"), "auto"),
        "powersgd": (commpress.ErrorFeedback(commpress.get("powersgd", rank=2)), "auto"),
    }
    out = {}
    for name, (c, algorithm) in cases.items():
        x = data(rank, 0).reshape(64, 64) if name == "powersgd" else data(rank, 0)
        allreduce(x, c, key=name, algorithm=algorithm)  # first call: the header exchange
        stats = CommStats()
        for step in (1, 2):
            allreduce(x, c, key=name, step=step, algorithm=algorithm, stats=stats)
        out[name] = stats.as_dict()
    out["pool_started"] = bool(pool._is_initialized)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_steady_state_sends_only_the_payload(world):
    res = run(steady_bytes_worker, world, timeout=110)
    k = 41  # round(0.01 * 4096)
    per_call = {
        # status word + k int32 indices + k fp32 values, one all-gather
        "topk": (sparse_message(k) * (world - 1), world - 1),
        "dgc": (sparse_message(51) * (world - 1), world - 1),  # capacity floor(1.25 k) = 51
        # the densified slots (+ padding slot + two status slots), one ring all_reduce
        "topk_dense": (ring((N + 3) * 4, world), 2 * (world - 1)),
        # fp16 payload plus two status slots, one all_reduce
        "fp16": (ring((N + 2) * 2, world), 2 * (world - 1)),
    }
    for rank in range(world):
        stats = res[rank]
        for name, (nbytes, messages) in per_call.items():
            assert stats[name]["bytes_sent"] == 2 * nbytes, (name, stats[name])
            assert stats[name]["messages"] == 2 * messages, name
        # two-phase: one all-to-all + one all-gather per call; gather_all: one all-gather
        assert stats["blockquant"]["messages"] == 2 * 2 * (world - 1)
        assert stats["gather_all"]["messages"] == 2 * (world - 1)
        # PowerSGD on one matrix: two all_reduces per call
        assert stats["powersgd"]["messages"] == 2 * 2 * 2 * (world - 1)
        assert not stats["pool_started"]  # one torch thread: numba's pool never woke up


def fixed_sparse_worker(rank, world, name, params, algorithm):
    c = commpress.get(name, **params)
    results, decoded = [], []
    for step in range(2):
        x = data(rank, step) * (1 + step)
        decoded.append(c.decompress(c.compress_fixed(x, step=step, key="s")).numpy())
        results.append(allreduce(x, c, key="s", step=step, algorithm=algorithm).numpy())
    return results, decoded


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,params", [("topk", {"ratio": 0.02, "density_warmup": 0}), ("dgc", {"ratio": 0.02, "density_warmup": 0}),
                                         ("threshold", {"threshold": 1.5, "max_ratio": 0.05})])
@pytest.mark.parametrize("algorithm", ["allgather", "dense"])
def test_fixed_sparse_sum_is_exact_and_identical(name, params, algorithm):
    world = 3
    res = run(fixed_sparse_worker, world, name, params, algorithm, timeout=110)
    for step in range(2):
        expect = np.zeros(N, dtype=np.float32)
        for r in range(world):  # rank order
            expect = expect + res[r][1][step]
        for r in range(world):
            assert np.array_equal(res[r][0][step].view(np.int32), res[0][0][step].view(np.int32))
            np.testing.assert_allclose(res[r][0][step], expect, rtol=1e-6, atol=1e-6)


def whole_dense_worker(rank, world):
    out = {}
    for momentum in (0.0, 0.9):
        ef = commpress.ErrorFeedback(commpress.get("topk", ratio=0.01, density_warmup=0), momentum=momentum,
                                     masking=True)
        allreduce(data(rank, 0), ef, key="w", step=0, algorithm="allgather")  # leaves a residual
        e = ef.residual("w").clone()
        u = ef.velocity("w").clone() if momentum else None
        x = data(rank, 1)
        v = torch.add(x, u, alpha=momentum) if momentum else x               # the velocity, as EF rounds it
        sent = torch.add(v, e, alpha=1.0)                                     # what the rank sends whole
        got = allreduce(x, ef, key="w", step=1, algorithm="dense")
        again = allreduce(x, ef, key="w", step=2)                             # "auto" at 1%: the selection
        out[momentum] = (sent, got, bool(e.abs().sum() > 0), bool(ef.residual("w").abs().sum() > 0),
                         again)
    # "auto" takes it by bytes alone (sparse.whole_choice): at P=2 in 4-bit blockquant when the
    # gathered slots would be the larger message (25% and 8% of 4096), the selection at 6%; in
    # bf16 where the whole tensor's ring all_reduce is the smallest message (P >= 8; forced here)
    from commpress.collectives import sparse
    for ratio in (0.25, 0.08, 0.06, "bf16"):
        wide = commpress.ErrorFeedback(commpress.get("topk", ratio=0.25 if ratio == "bf16" else ratio,
                                                     density_warmup=0))
        stats = CommStats()
        choose = sparse.whole_choice
        if ratio == "bf16":
            sparse.whole_choice = lambda *a: "bf16"
        try:
            summed = allreduce(data(rank, 3), wide, key="v", step=1, stats=stats)
        finally:
            sparse.whole_choice = choose
        out[ratio] = (data(rank, 3), summed, stats.last_algorithm, wide.residual("v").clone())
    return out


@pytest.mark.timeout(60)
def test_dense_with_error_feedback_sends_the_whole_compensated_tensor():
    """With error feedback the "dense" algorithm all-reduces x + e itself (no bytes saved by
    dropping coordinates): the sum is exact and the residual empties."""
    res = run(whole_dense_worker, 2, timeout=55)
    for momentum in (0.0, 0.9):
        (s0, got0, had0, left0, a0), (s1, got1, had1, left1, a1) = res[0][momentum], res[1][momentum]
        assert had0 and had1                                    # there was a residual to send
        assert torch.equal(got0, got1) and torch.equal(got0, s0 + s1)
        # the step after: the residual started from zero, so the selection's sum keeps <= 2k entries
        assert torch.equal(a0, a1) and 0 < int((a0 != 0).sum()) <= 2 * 41
        assert left0 and left1                                  # and left a new residual
    q = commpress.get("blockquant", bits=4)
    for ratio in (0.25, 0.08):
        (x0, s0, alg0, e0), (x1, s1, _, e1) = res[0][ratio], res[1][ratio]
        assert alg0 == "whole_blockquant" and torch.equal(s0, s1)
        d0, d1 = (q.decompress(q.compress_fixed(x)) for x in (x0, x1))
        assert torch.equal(s0, d0 + d1)                            # the 4-bit messages, summed in fp32
        assert torch.equal(e0, x0 - d0) and torch.equal(e1, x1 - d1)  # the rounding, kept
    assert res[0][0.06][2] == "allgather"
    (x0, s0, alg0, e0), (x1, s1, _, e1) = res[0]["bf16"], res[1]["bf16"]
    assert alg0 == "dense" and torch.equal(s0, s1)
    b0, b1 = x0.to(torch.bfloat16), x1.to(torch.bfloat16)
    assert torch.equal(s0, (b0 + b1).float())                  # the bf16 messages, summed in bf16
    assert torch.equal(e0, x0 - b0.float()) and torch.equal(e1, x1 - b1.float())  # the rounding, kept


def capacity_worker(rank, world, steps):
    ef = commpress.ErrorFeedback(commpress.get("threshold", threshold=0.5, max_ratio=0.01))
    total = torch.zeros(N, dtype=torch.float64)
    for step in range(steps):
        total += allreduce(data(rank, step), ef, key="t", step=step).double()
    return total.numpy(), ef.residual("t").double().numpy()


@pytest.mark.timeout(60)
def test_capacity_overflow_stays_in_the_residual():
    world, steps = 2, 3
    res = run(capacity_worker, world, steps, timeout=50)
    true = sum(data(r, t).double().numpy() for r in range(world) for t in range(steps))
    total = res[0][0] + sum(res[r][1] for r in range(world))
    np.testing.assert_allclose(total, true, atol=1e-4)
    # far more than 1% of the entries pass |x| >= 0.5: most of them had to wait in the residuals
    assert np.abs(res[0][1]).max() >= 0.5


def nonfinite_worker(rank, world, name, params, algorithm, shape):
    ef = commpress.ErrorFeedback(commpress.get(name, **params))
    x0 = data(rank, 0).reshape(shape)
    allreduce(x0, ef, key="k", step=0, algorithm=algorithm)
    keys = [k for k in ef._residuals]
    before = {k: ef.residual(k).clone() for k in keys}
    x1 = data(rank, 1).reshape(shape)
    if rank == world - 1:
        x1.view(-1)[7] = float("inf")
    out = allreduce(x1, ef, key="k", step=1, algorithm=algorithm)
    kept = all(torch.equal(before[k], ef.residual(k)) for k in keys)
    x2 = data(rank, 2).reshape(shape)
    after = allreduce(x2, ef, key="k", step=2, algorithm=algorithm)
    return bool(torch.isnan(out).all()), kept, len(keys), bool(torch.isfinite(after).all())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,params,algorithm,shape", [
    ("topk", {"ratio": 0.01, "density_warmup": 0}, "allgather", (N,)),
    ("topk", {"ratio": 0.01, "density_warmup": 0}, "dense", (N,)),
    ("blockquant", {"bits": 8}, "two_phase", (N,)),
    ("signsgd", {}, "gather_all", (N,)),
    ("fp16", {}, "auto", (N,)),
    ("powersgd", {"rank": 2}, "auto", (64, 64)),
])
def test_nonfinite_on_one_rank_poisons_every_rank_and_keeps_residuals(name, params, algorithm, shape):
    world = 3
    res = run(nonfinite_worker, world, name, params, algorithm, shape, timeout=110)
    for poisoned, kept, nkeys, recovered in res:
        assert poisoned and kept and nkeys >= 1 and recovered


class Flaky(commpress.Compressor):
    """fp16 whose compress raises on one rank at one step."""

    aggregation = "sum"
    name = "flaky"

    def __init__(self, bad_rank, bad_step):
        self.inner = commpress.get("fp16")
        self.bad_rank, self.bad_step = bad_rank, bad_step

    broken = False  # set: fails at every step, on zeros too (the error path must not compress again)

    def compress(self, tensor, *, step=0, key=0, generator=None):
        import torch.distributed as dist

        if dist.get_rank() == self.bad_rank and (step == self.bad_step or self.broken):
            raise RuntimeError("boom")
        return self.inner.compress(tensor, step=step, key=key)

    def decompress(self, payload):
        return self.inner.decompress(payload)


def error_worker(rank, world, kind):
    if kind in ("sum", "sum_broken"):
        c = Flaky(bad_rank=1, bad_step=1)
    elif kind == "sparse":
        c = commpress.get("topk", ratio=0.1, density_warmup=0)
    else:
        c = commpress.get("blockquant", bits=8)
    outcomes = []
    for step in range(3):
        x = data(rank, step)
        if kind == "sum_broken":
            c.broken = step == 1
        elif kind != "sum" and rank == 1 and step == 1:
            x = x.double()  # unsupported dtype on one rank, found by the local check
        try:
            allreduce(x, c, key="e", step=step, validate=False)
            outcomes.append("ok")
        except CollectiveInputError as exc:
            outcomes.append("raised" + (":mine" if "this rank" in str(exc) else ""))
    return outcomes


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["sum", "sum_broken", "sparse", "gather"])
def test_bad_input_raises_on_every_rank_in_the_same_call(kind):
    res = run(error_worker, 3, kind, timeout=80)
    for rank, outcomes in enumerate(res):
        assert outcomes[0] == "ok" and outcomes[2] == "ok"  # the ranks stay in step
        assert outcomes[1] == ("raised:mine" if rank == 1 else "raised")
