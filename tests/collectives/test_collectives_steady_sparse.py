"""The steady-state lane of the fixed-size sparse ``"allgather"`` (:mod:`commpress.collectives.steady_sparse`)
is the general path's collective, bitwise: the same message bytes, sums, riding dense parts, residuals and
velocities on every rank, over several steps (the residual carried, the hook's ``1/P`` folded into the
error feedback), at P=2 and P=3, with momentum correction and with a density warm-up (whose first stages
send the whole tensor on the general path); a NaN/inf on one rank poisons every rank's result and keeps
the residuals; a selection that raises on one rank makes every rank raise in the same call.  And it is
the path the DDP hook's topk steps take."""

from __future__ import annotations

import pytest
import torch

from bitwise import same
from distributed import run

import commpress
from commpress.collectives import CollectiveInputError, CommStats, _comm, allreduce, steady, steady_sparse, wire
from commpress.collectives.sparse import whole_choice
from commpress.feedback import ResidualTransaction
from commpress.ops import numba_backend as nb

N = 5000
STEPS = 4


def data(rank: int, step: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + rank + 7 * n))


def _calls(lane: bool, world: int, rider: bool, n: int = N, momentum: float = 0.0, warmup: int = 0,
           nan_at: int | None = None, dense_nan: bool = False, masking: bool = False) -> dict:
    """``STEPS`` calls of ``allreduce(..., out=t)`` as the DDP hook makes them, the lanes (the
    selection's, and the whole send's of a warm-up's early stages) on or forced off: every message's
    meaningful bytes, every result and dense sum, the residuals and velocities."""
    rank = torch.distributed.get_rank()
    ef = commpress.ErrorFeedback(commpress.get("topk", ratio=0.02, density_warmup=warmup), momentum=momentum,
                                 masking=masking)
    sent, results, dense_sums, ran, whole, selections = [], [], [], [], [], 0
    real_gather, real_run, real_whole = _comm.all_gather, steady_sparse.run, steady.run

    def lane_run(*a, **k):
        ran.append(True)
        return real_run(*a, **k)

    def whole_run(plan, *a, **k):
        whole.append(plan.whole)
        return real_whole(plan, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_comm, "all_gather", lambda t, *a, **k: (sent.append(t.clone()), real_gather(t, *a, **k))[1])
        mp.setattr(steady_sparse, "run", lane_run)
        mp.setattr(steady, "run", whole_run)
        if not lane:
            mp.setattr(steady_sparse, "plan_for", lambda *a, **k: None)
            mp.setattr(steady, "whole_plan_for", lambda *a, **k: None)
        for step in range(STEPS):
            t = data(rank, step, n)
            if nan_at is not None and step == 2 and rank == 1:
                t[nan_at] = float("nan")
            dense = data(rank, 100 + step, 37) if rider else None
            if dense_nan and step == 2 and rank == 1:
                dense[5] = float("inf")
            k = ef.compressor.capacity(n, step)
            tx = ResidualTransaction()
            # the hook's 1/P, folded into error feedback's pass
            out = allreduce(t, ef, key="b", step=step, validate=False, transaction=tx, out=t, dense=dense,
                            stats=CommStats(), prescale=1.0 / world)
            tx.commit()
            # the selection's message, its meaningful bytes; a whole-tensor send's, its width
            sent[-1] = (_meaningful(sent[-1], k, dense) if sent[-1].numel() == _selection_width(k, dense)
                        else sent[-1].numel())
            selections += whole_choice(t, ef.compressor, step, world) == "selection"
            results.append(out.clone())
            dense_sums.append(None if dense is None else dense.clone())
    state = {key: v.clone() for key, v in ef._residuals.items()}
    state.update({("velocity", key): v.clone() for key, v in ef._velocity.items()})
    return {"sent": sent, "results": results, "dense": dense_sums, "state": state, "lane": len(ran),
            "selections": selections, "whole": sum(whole)}


def _layout(k: int, dense) -> wire.Layout:
    parts = [torch.empty(k, dtype=torch.int32), torch.empty(k)] + ([] if dense is None else [dense])
    return wire.Layout.of(parts)


def _selection_width(k: int, dense) -> int:
    return _layout(k, dense).width


def _meaningful(message: torch.Tensor, k: int, dense) -> torch.Tensor:
    """The status word and each tensor's bytes (the alignment padding is left unwritten)."""
    spans = [(0, wire.STATUS_BYTES)] + [(off, off + size) for _, _, off, size in _layout(k, dense).specs]
    return torch.cat([message[a:b] for a, b in spans])


def lane_worker(rank, world):
    cases = {"plain": {}, "momentum": dict(momentum=0.9), "n=64": dict(n=64), "warm-up": dict(warmup=3),
             "warm-up+masking": dict(warmup=3, momentum=0.9, masking=True)}
    if world == 2:   # a dense part rides at P <= 2 only
        cases.update({"rider": dict(rider=True), "rider+momentum": dict(rider=True, momentum=0.9),
                      "warm-up+rider": dict(warmup=3, rider=True, momentum=0.9)})
    out = {}
    for name, kw in cases.items():
        kw = {"rider": False, **kw}
        lane, general = _calls(True, world, **kw), _calls(False, world, **kw)
        out[name] = {"lane_ran": lane["lane"], "general_ran": general["lane"] + general["whole"],
                     "selections": lane["selections"], "whole_ran": lane["whole"],
                     "same": {k: same(lane[k], general[k]) for k in ("sent", "results", "dense", "state")},
                     "result": lane["results"][-1]}
    nan = [_calls(use, world, rider=world == 2, nan_at=3) for use in (True, False)]
    out["nan"] = {"same": same([nan[0][k] for k in ("results", "state")], [nan[1][k] for k in ("results", "state")]),
                  "poisoned": bool(torch.isnan(nan[0]["results"][2]).all()),
                  "later_finite": bool(torch.isfinite(nan[0]["results"][3]).all()), "lane_ran": nan[0]["lane"]}
    if world == 2:
        inf = [_calls(use, world, rider=True, dense_nan=True) for use in (True, False)]
        out["dense_inf"] = {"same": same([inf[0][k] for k in ("sent", "results", "state")],
                                         [inf[1][k] for k in ("sent", "results", "state")]),
                            "poisoned": bool(torch.isnan(inf[0]["results"][2]).all())}
        out["raises"] = _raising(rank)
    return out


def _raising(rank: int) -> list[str | None]:
    """Rank 1's selection raises at step 1: every rank raises in that call, the others run."""
    ef = commpress.ErrorFeedback(commpress.get("topk", ratio=0.02, density_warmup=0))
    real, calls, errors = nb.topk_feedback_arrays, [], []

    def flaky(*a, **k):
        calls.append(1)
        if rank == 1 and len(calls) == 2:
            raise RuntimeError("boom in the selection")
        return real(*a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nb, "topk_feedback_arrays", flaky)
        for step in range(3):
            t = data(rank, step, N)
            try:
                allreduce(t, ef, key="b", step=step, validate=False, out=t)
                errors.append(None)
            except CollectiveInputError as exc:
                errors.append(str(exc))
    return errors


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_the_sparse_lane_is_the_general_paths_collective_bitwise(world):
    results = run(lane_worker, world, timeout=170)
    for r, res in enumerate(results):
        for name, case in res.items():
            if name in ("nan", "dense_inf", "raises"):
                continue
            assert case["general_ran"] == 0 and all(case["same"].values()), (r, name, case)
            # every step that sends its selection takes the lane (a warm-up's first stages send the whole tensor)
            assert case["lane_ran"] == case["selections"], (r, name, case)
            assert case["selections"] == STEPS or (name.startswith("warm-up") and 0 < case["selections"] < STEPS), \
                (r, name)
            # the warm-up's whole sends take the whole lane, bitwise the general path's (_whole_quantized)
            assert case["whole_ran"] == STEPS - case["selections"], (r, name, case)
            assert torch.equal(case["result"], results[0][name]["result"]), (r, name)   # identical on every rank
        nan = res["nan"]
        assert nan["lane_ran"] == STEPS and nan["same"] and nan["poisoned"] and nan["later_finite"], (r, nan)
        if world == 2:
            assert res["dense_inf"]["same"] and res["dense_inf"]["poisoned"], (r, res["dense_inf"])
            errors = res["raises"]
            assert errors[0] is None and errors[2] is None and errors[1] is not None, (r, errors)
            assert "rank(s) [1]" in errors[1] and (r == 0 or "boom in the selection" in errors[1]), (r, errors)


def test_the_sparse_lane_takes_only_what_it_reproduces(monkeypatch):
    """No lane for a one-rank group, another sparsifier, error feedback with ``clip``, no error
    feedback, the torch backend, an output that is not the input's buffer, a local error, another
    algorithm, or a step whose selection would be the larger message (the warm-up's whole tensor)."""
    flat = torch.randn(10000)
    ef = commpress.ErrorFeedback(commpress.get("topk", ratio=0.01, density_warmup=0))
    args = dict(group=None, algorithm="auto", step=10, error=(0, ""), dense=None, whole_choice=whole_choice)
    assert steady_sparse.plan_for(flat, ef, out=flat, world=2, **args) is not None
    assert steady_sparse.plan_for(flat, ef, out=flat, world=2, **{**args, "algorithm": "allgather"}) is not None
    assert steady_sparse.plan_for(flat, ef, out=flat, world=1, **args) is None
    assert steady_sparse.plan_for(flat, ef, out=flat.clone(), world=2, **args) is None
    assert steady_sparse.plan_for(flat, ef, out=None, world=2, **args) is None
    assert steady_sparse.plan_for(flat, ef, out=flat, world=2, **{**args, "error": (6, "bad")}) is None
    for algorithm in ("dense", "split"):
        assert steady_sparse.plan_for(flat, ef, out=flat, world=2, **{**args, "algorithm": algorithm}) is None
    warm = commpress.ErrorFeedback(commpress.get("topk", ratio=0.01, density_warmup=200))   # a density warm-up
    assert steady_sparse.plan_for(flat, warm, out=flat, world=2, **{**args, "step": 0}) is None
    assert steady_sparse.plan_for(flat, warm, out=flat, world=2, **{**args, "step": 10**6}) is not None
    for other in (commpress.ErrorFeedback(commpress.get("randomk", ratio=0.01)),
                  commpress.ErrorFeedback(commpress.get("topk", ratio=0.01), clip=1.0),
                  commpress.get("topk", ratio=0.01)):
        assert steady_sparse.plan_for(flat, other, out=flat, world=2, **args) is None, other
    with_momentum = commpress.ErrorFeedback(commpress.get("topk", ratio=0.01, density_warmup=0), momentum=0.9)
    assert ((steady_sparse.plan_for(flat, with_momentum, out=flat, world=2, **args) is None)
            == (nb.velocity_mode() is None))
    monkeypatch.setenv("COMMPRESS_BACKEND", "torch")
    assert steady_sparse.plan_for(flat, ef, out=flat, world=2, **args) is None


def hook_worker(rank, world):
    """The DDP hook's topk steps (default backend, dense part riding, 1/P folded) take the lane."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from nets import MLP3, train_step

    ran, real = [], steady_sparse.run
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(steady_sparse, "run", lambda *a, **k: (ran.append(1), real(*a, **k))[1])
        torch.manual_seed(0)
        model = DDP(MLP3())
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        state = commpress.ddp.register(model, "topk", ratio=0.05, density_warmup=0, min_numel=256, optimizer=opt)
        commpress.ops.backends_used(reset=True)
        for step in range(4):
            train_step(model, opt, rank, step)
        state.close()
    used = commpress.ops.backends_used()
    return {"lane": len(ran), "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "used": {op: used.get(op) for op in ("topk_compact_feedback", "scatter_add_")}}


@pytest.mark.timeout(120)
def test_the_ddp_hooks_topk_steps_take_the_sparse_lane():
    a, b = run(hook_worker, 2, timeout=110)
    assert a["lane"] >= 3 and b["lane"] == a["lane"], (a["lane"], b["lane"])
    assert torch.equal(a["params"], b["params"])
    assert a["used"] == {"topk_compact_feedback": "numba", "scatter_add_": "numba"}, a["used"]
