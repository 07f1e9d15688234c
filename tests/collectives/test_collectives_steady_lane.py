"""The steady-state lane of the quantized ``"gather_all"`` (:mod:`commpress.collectives.steady`) is the
general path's collective, bitwise: the same message bytes, sums, riding dense parts and residuals
on every rank, over several steps (the residual carried, the hook's ``1/P`` folded into the error
feedback), one message or pipelined, at P=2 and P=3; a NaN/inf on one rank poisons every rank's
result and keeps the residuals; a kernel that raises on one rank makes every rank raise in the same
call.  Momentum correction too (the velocity in the kernel's pass).  And it is the path the DDP
hook's blockquant steps take."""

from __future__ import annotations

import pytest
import torch

from bitwise import same
from distributed import run

import commpress
from commpress.collectives import CollectiveInputError, CommStats, _comm, allreduce, set_cost_model, steady, wire
from commpress.collectives.quantized import chunk_bounds
from commpress.feedback import ResidualTransaction
from commpress.ops import numba_backend as nb

N = 5000   # chunks of 2500 / 1667 elements at P=2 / 3: uneven, not multiples of the block


def data(rank: int, step: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + rank + 7 * n))


def _calls(lane: bool, world: int, pipelined: bool, rider: bool, bits: int, nan_at: int | None = None, n: int = N,
           momentum: float = 0.0, dense_nan: bool = False):
    """Four steps of one call each through ``allreduce(..., out=t)`` as the DDP hook makes it; the
    lane on or forced off.  Returns every message sent, every result, dense sum, residual and
    velocity (``momentum``: momentum correction)."""
    set_cost_model(1.0, 1e-5 if pipelined else 0.0)   # "auto": gather_all, pipelined or one message
    rank = torch.distributed.get_rank()
    ef = commpress.ErrorFeedback(commpress.get("blockquant", bits=bits, block=64), momentum=momentum)
    sent, results, dense_sums, ran = [], [], [], []
    real_start, real_gather, real_run = _comm.all_gather_start, _comm.all_gather, steady.run

    def start(t, *a, **k):
        sent.append(t.clone())
        return real_start(t, *a, **k)

    def gather(t, *a, **k):
        sent.append(t.clone())
        return real_gather(t, *a, **k)

    def lane_run(*a, **k):
        ran.append(True)
        return real_run(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_comm, "all_gather_start", start)
        mp.setattr(_comm, "all_gather", gather)
        mp.setattr(steady, "run", lane_run)
        if not lane:
            mp.setattr(steady, "plan_for", lambda *a, **k: None)
        for step in range(4):
            t = data(rank, step, n)
            if nan_at is not None and step == 2 and rank == 1:
                t[nan_at] = float("nan")
            dense = data(rank, 100 + step, 37) if rider else None
            if dense_nan and step == 2 and rank == 1:   # the riding dense part's NaN: the status carries it
                dense[5] = float("inf")
            tx = ResidualTransaction()
            # the hook's 1/P, folded into error feedback's pass (each chunk's)
            out = allreduce(t, ef, key="unit", step=step, validate=False, transaction=tx, out=t,
                            dense=dense, stats=CommStats(), prescale=1.0 / world)
            tx.commit()
            results.append(out.clone())
            dense_sums.append(None if dense is None else dense.clone())
    residuals = {k: v.clone() for k, v in ef._residuals.items()}
    residuals.update({("velocity", k): v.clone() for k, v in ef._velocity.items()})
    return {"sent": sent, "results": results, "dense": dense_sums, "residuals": residuals, "lane": len(ran)}


def regions(world: int, pipelined: bool, rider: bool, bits: int, n: int = N) -> list[list[tuple[int, int]]]:
    """The meaningful bytes of each message, from the general path's own layout (:class:`wire.Layout`
    of payload-shaped tensors): the status word and each tensor (padding is left unwritten)."""
    bounds = chunk_bounds(n, world, 64)
    tensors = []
    for r in range(world):
        m = bounds[r + 1] - bounds[r]
        tensors.append([torch.empty((m * bits + 7) // 8, dtype=torch.uint8), torch.empty(-(-m // 64))])
    dense = [torch.empty(37)] if rider else []
    groups = [tensors[r] + (dense if r == 0 else []) for r in range(world)] if pipelined \
        else [[t for ts in tensors for t in ts] + dense]
    out = []
    for ts in groups:
        lay = wire.Layout.of(ts)
        out.append([(0, wire.STATUS_BYTES)] + [(off, off + n) for _, _, off, n in lay.specs])
    return out


def meaningful(sent: list[torch.Tensor], world: int, pipelined: bool, rider: bool, bits: int,
               n: int = N) -> list[torch.Tensor]:
    layout = regions(world, pipelined, rider, bits, n)
    return [torch.cat([m[a:b] for a, b in layout[i % len(layout)]]) for i, m in enumerate(sent)]


def lane_worker(rank, world):
    out = {}
    for pipelined in (False, True):
        for rider in (False, True):
            if rider and world > 2:
                continue   # a dense part rides in gather_all at P <= 2 only
            for bits in (4, 8):
                key = f"pipe={pipelined} rider={rider} bits={bits}"
                lane = _calls(True, world, pipelined, rider, bits)
                general = _calls(False, world, pipelined, rider, bits)
                for res in (lane, general):
                    res["sent"] = meaningful(res["sent"], world, pipelined, rider, bits)
                out[key] = {"lane_ran": lane["lane"], "general_ran": general["lane"],
                            "same": {k: same(lane[k], general[k]) for k in ("sent", "results", "dense", "residuals")},
                            "messages": len(lane["sent"]), "result": lane["results"][-1]}
    # a chunk shorter than a block, an empty chunk (P=3: 100 = 64 + 36 + 0)
    cases = [(f"n={n}", dict(n=n)) for n in (100, 1)]
    cases.append(("momentum", dict(momentum=0.9)))      # the velocity computed in the kernel's pass
    for key, kw in cases:
        n = kw.get("n", N)
        lane, general = _calls(True, world, False, False, 4, **kw), _calls(False, world, False, False, 4, **kw)
        for res in (lane, general):
            res["sent"] = meaningful(res["sent"], world, False, False, 4, n)
        out[key] = {"lane_ran": lane["lane"], "general_ran": general["lane"],
                         "same": {k: same(lane[k], general[k]) for k in ("sent", "results", "dense", "residuals")},
                         "messages": len(lane["sent"]), "result": lane["results"][-1]}
    nan_lane = _calls(True, world, True, world == 2, 4, nan_at=3)
    nan_general = _calls(False, world, True, world == 2, 4, nan_at=3)
    out["nan"] = {"same": same({k: nan_lane[k] for k in ("results", "residuals")},
                               {k: nan_general[k] for k in ("results", "residuals")}),
                  "poisoned": bool(torch.isnan(nan_lane["results"][2]).all()),
                  "later_finite": bool(torch.isfinite(nan_lane["results"][3]).all())}
    if world == 2:   # a dense part rides at P <= 2 only
        lane, general = (_calls(use, world, False, True, 4, dense_nan=True) for use in (True, False))
        out["dense_nan"] = {"same": same({k: lane[k] for k in ("results", "residuals")},
                                         {k: general[k] for k in ("results", "residuals")}),
                            "status": [bytes(m[:8].numpy()) for m in lane["sent"]]
                            == [bytes(m[:8].numpy()) for m in general["sent"]],
                            "poisoned": bool(torch.isnan(lane["results"][2]).all()),
                            "lane_ran": lane["lane"]}
    set_cost_model(None)
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_the_lane_is_the_general_paths_collective_bitwise(world):
    results = run(lane_worker, world, timeout=170)
    for r, res in enumerate(results):
        for key, case in res.items():
            if key in ("nan", "dense_nan"):
                continue
            assert case["lane_ran"] == 4 and case["general_ran"] == 0, (r, key, case)
            assert all(case["same"].values()), (r, key, case["same"])
            assert case["messages"] == 4 * (world if "pipe=True" in key else 1), (r, key)
            assert torch.equal(case["result"], results[0][key]["result"]), (r, key)   # identical on every rank
        assert res["nan"]["same"] and res["nan"]["poisoned"] and res["nan"]["later_finite"], (r, res["nan"])
        if world == 2:   # an inf in one rank's riding dense part: the same status bytes, every rank poisoned
            d = res["dense_nan"]
            assert d["lane_ran"] == 4 and d["same"] and d["status"] and d["poisoned"], (r, d)


def failing_worker(rank, world):
    """Rank 1's kernel raises on its second chunk at step 1 (after the first chunk's message left)."""
    from commpress.ops import numba_backend

    set_cost_model(1.0, 1e-5)
    ef = commpress.ErrorFeedback(commpress.get("blockquant", bits=4, block=64))
    real = numba_backend.quantize_feedback_into
    calls = []

    def flaky(*a, **k):
        calls.append(1)
        if rank == 1 and len(calls) == 4:
            raise RuntimeError("boom in the kernel")
        return real(*a, **k)

    errors = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(numba_backend, "quantize_feedback_into", flaky)
        for step in range(3):
            t = data(rank, step, N)
            try:
                allreduce(t, ef, key="unit", step=step, validate=False, out=t)
                errors.append(None)
            except CollectiveInputError as exc:
                errors.append(str(exc))
    set_cost_model(None)
    return errors


@pytest.mark.timeout(120)
def test_a_kernel_that_raises_on_one_rank_raises_on_every_rank_in_the_same_call():
    a, b = run(failing_worker, 2, timeout=110)
    assert a[0] is None and b[0] is None and a[2] is None and b[2] is None
    assert a[1] is not None and b[1] is not None and "rank(s) [1]" in a[1], (a, b)
    assert "boom in the kernel" in b[1], b


def test_the_lane_takes_only_what_it_reproduces(monkeypatch):
    """No lane for a one-rank group, a stochastic blockquant, error feedback with ``clip``, another
    compressor, the torch backend, an output that is not the input's buffer, or a local error;
    momentum correction takes it where the kernels know how torch rounds its velocity."""
    flat = torch.randn(1000)
    bounds = [0, 512, 1000]
    ef = commpress.ErrorFeedback(commpress.get("blockquant", bits=4))
    args = dict(group=None, algorithm="gather_all", error=(0, ""), model=None, dense=None, bounds=bounds)
    assert steady.plan_for(flat, ef, out=flat, world=2, **args) is not None
    assert steady.plan_for(flat, ef, out=flat, world=1, **args) is None
    assert steady.plan_for(flat, ef, out=flat.clone(), world=2, **args) is None
    assert steady.plan_for(flat, ef, out=None, world=2, **args) is None
    assert steady.plan_for(flat, ef, out=flat, world=2, **{**args, "error": (6, "bad")}) is None
    assert steady.plan_for(flat, ef, out=flat, world=2, **{**args, "algorithm": "two_phase"}) is None
    for other in (commpress.ErrorFeedback(commpress.get("blockquant", bits=4, stochastic=True)),
                  commpress.ErrorFeedback(commpress.get("blockquant", bits=4), momentum=0.9, clip=1.0),
                  commpress.ErrorFeedback(commpress.get("signsgd")),
                  commpress.get("blockquant", bits=4)):
        assert steady.plan_for(flat, other, out=flat, world=2, **args) is None, other
    with_momentum = commpress.ErrorFeedback(commpress.get("blockquant", bits=4), momentum=0.9)
    assert (steady.plan_for(flat, with_momentum, out=flat, world=2, **args) is None) == (nb.velocity_mode() is None)
    monkeypatch.setattr(nb, "velocity_mode", lambda: None)
    assert steady.plan_for(flat, with_momentum, out=flat, world=2, **args) is None
    monkeypatch.setenv("COMMPRESS_BACKEND", "torch")
    assert steady.plan_for(flat, ef, out=flat, world=2, **args) is None


def hook_worker(rank, world):
    """The DDP hook's blockquant steps (default backend, dense part riding, 1/P folded) take the lane."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nets import MLP3, train_step

    ran = []
    real = steady.run
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(steady, "run", lambda *a, **k: (ran.append(1), real(*a, **k))[1])
        torch.manual_seed(0)
        model = DDP(MLP3())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        state = commpress.ddp.register(model, "blockquant", bits=4, min_numel=256)
        commpress.ops.backends_used(reset=True)
        for step in range(4):
            train_step(model, opt, rank, step)
        stats = state.stats.as_dict()
        state.close()
    used = commpress.ops.backends_used()
    return {"lane": len(ran), "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "used": {op: used.get(op) for op in ("block_quantize_feedback", "block_dequantize_sum")},
            "algorithms": stats.get("algorithms", {})}


@pytest.mark.timeout(120)
def test_the_ddp_hooks_blockquant_steps_take_the_lane():
    a, b = run(hook_worker, 2, timeout=110)
    assert a["lane"] >= 3 and b["lane"] == a["lane"], (a["lane"], b["lane"])   # every compressed step
    assert torch.equal(a["params"], b["params"])
    assert a["used"] == {"block_quantize_feedback": "numba", "block_dequantize_sum": "numba"}, a["used"]
