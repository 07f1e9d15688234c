"""Held calls (:mod:`commpress.collectives.joint`): calls encoded by :func:`joint.hold` and sent in a
later call's ``all_gather`` (``allreduce(..., passengers=)``), or in a flight of their own
(:func:`joint.gather_held`), give bitwise the results, riding dense sums and residuals of the same
calls run one by one, at P=2 and P=3, in one round; a NaN/inf on one rank poisons that call's result
on every rank and keeps the step's residuals; a kernel that raises on one rank while a call is held
makes every rank raise when it lands (nobody skips the shared round)."""

from __future__ import annotations

import pytest
import torch

from bitwise import same
from distributed import run

import commpress
from commpress.collectives import CollectiveInputError, CommStats, _comm, allreduce, joint, set_cost_model
from commpress.feedback import ResidualTransaction

SIZES = (3000, 5000, 4000)   # held blockquant, held topk, the carrier (blockquant or, uncarried, fp16)


def data(rank: int, step: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + rank + 7 * n))


def _codecs(carrier: str):
    last = (commpress.ErrorFeedback(commpress.get("blockquant", bits=4, block=64)) if carrier == "blockquant"
            else commpress.get("fp16"))   # the cast path ("sum"): cannot carry passengers
    return [commpress.ErrorFeedback(commpress.get("blockquant", bits=4, block=64)),
            commpress.ErrorFeedback(commpress.get("topk", ratio=0.02, density_warmup=0)), last]


def _steps(joined: bool, world: int, carrier: str, rider: bool, nan_rank: int | None = None) -> dict:
    """Three steps of the three calls, a transaction per step (as a DDP step): held and carried when
    ``joined``, else one by one.  Returns the results, dense sums, residuals and the rounds."""
    rank = torch.distributed.get_rank()
    codecs = _codecs(carrier)
    rounds = []
    results, dense_sums = [], []
    real_gather = _comm.all_gather
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_comm, "all_gather", lambda *a, **k: (rounds.append(1), real_gather(*a, **k))[1])
        for step in range(3):
            tx = ResidualTransaction()
            ts = [data(rank, step, n) for n in SIZES]
            if nan_rank == rank and step == 1:
                ts[0][17] = float("nan")
            ds = [data(rank, 50 + step, 37 + i) if rider else None for i in range(3)]
            stats = CommStats()
            if joined:
                held = []
                for t, ef, d, key in zip(ts[:2], codecs[:2], ds[:2], ("a", "b")):
                    h = joint.hold(t, ef, group=None, key=key, step=step, algorithm="auto", stats=stats,
                                   transaction=tx, dense=d)
                    assert h is not None, key
                    held.append(h)
                riders = joint.passengers(held)
                allreduce(ts[2], codecs[2], key="c", step=step, validate=False, transaction=tx, out=ts[2],
                          dense=ds[2], passengers=riders)
                rows = riders.rows if riders.carried else joint.gather_held(held, group=None, stats=stats)
                for h, got in zip(held, joint.rows_of(held, rows)):
                    h.land(got)
            else:
                for t, ef, d, key in zip(ts, codecs, ds, ("a", "b", "c")):
                    allreduce(t, ef, key=key, step=step, validate=False, transaction=tx, out=t, dense=d, stats=stats)
            tx.commit()
            results.append([t.clone() for t in ts])
            dense_sums.append([None if d is None else d.clone() for d in ds])
    residuals = [{k: v.clone() for k, v in getattr(ef, "_residuals", {}).items()} for ef in codecs]
    return {"results": results, "dense": dense_sums, "residuals": residuals, "rounds": len(rounds)}


def joint_worker(rank, world):
    set_cost_model(1.0, 0.0)   # "auto": gather_all in one message (the lanes' plans)
    out = {}
    cases = [("carried", "blockquant", world == 2), ("uncarried", "fp16", world == 2)]
    for name, carrier, rider in cases:
        out[name] = {"joined": _steps(True, world, carrier, rider), "alone": _steps(False, world, carrier, rider)}
    out["nan"] = {"joined": _steps(True, world, "blockquant", world == 2, nan_rank=1),
                  "alone": _steps(False, world, "blockquant", world == 2, nan_rank=1)}
    set_cost_model(None)
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3])
def test_held_calls_are_bitwise_the_calls_one_by_one(world):
    res = run(joint_worker, world, timeout=140)
    for r in res:
        for name in ("carried", "uncarried", "nan"):
            j, a = r[name]["joined"], r[name]["alone"]
            assert same(j["results"], a["results"]), (world, name)
            assert same(j["dense"], a["dense"]), (world, name)
            assert same(j["residuals"], a["residuals"]), (world, name)
            assert same(j["results"], res[0][name]["joined"]["results"]), (world, name)   # every replica alike
        # one all_gather a step when the carrier takes a lane; uncarried, the held two share one flight
        assert r["carried"]["joined"]["rounds"] == 3 and r["carried"]["alone"]["rounds"] == 9, r["carried"]
        assert r["uncarried"]["joined"]["rounds"] == r["uncarried"]["alone"]["rounds"] - 3, r["uncarried"]
        # the NaN on rank 1 at step 1: the held call's result all-NaN on every rank, the others finite,
        # and the step's residuals kept (the next step's results still equal the calls one by one)
        nan = r["nan"]["joined"]["results"][1]
        assert torch.isnan(nan[0]).all() and torch.isfinite(nan[1]).all() and torch.isfinite(nan[2]).all()
        assert torch.isfinite(r["nan"]["joined"]["results"][2][0]).all()


def failing_worker(rank, world):
    """Rank 1's blockquant kernel raises at step 1 while its call is held."""
    from commpress.ops import numba_backend

    set_cost_model(1.0, 0.0)
    codecs = _codecs("blockquant")
    real = numba_backend.quantize_feedback_into
    calls = []

    def flaky(*a, **k):
        calls.append(1)
        if rank == 1 and len(calls) == 5:   # step 1's held call (two chunks a call at P=2)
            raise RuntimeError("boom while held")
        return real(*a, **k)

    errors = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(numba_backend, "quantize_feedback_into", flaky)
        for step in range(3):
            tx = ResidualTransaction()
            ts = [data(rank, step, n) for n in SIZES]
            try:
                h = joint.hold(ts[0], codecs[0], group=None, key="a", step=step, algorithm="auto", stats=None,
                               transaction=tx)
                riders = joint.passengers([h])
                allreduce(ts[2], codecs[2], key="c", step=step, validate=False, transaction=tx, out=ts[2],
                          passengers=riders)
                h.land(riders.rows)
                tx.commit()
                errors.append(None)
            except CollectiveInputError as exc:
                tx.rollback()
                errors.append(str(exc))
    set_cost_model(None)
    return errors


@pytest.mark.timeout(120)
def test_a_held_call_that_fails_raises_on_every_rank_when_it_lands():
    a, b = run(failing_worker, 2, timeout=110)
    assert a[0] is None and b[0] is None and a[2] is None and b[2] is None, (a, b)
    assert a[1] is not None and b[1] is not None and "rank(s) [1]" in a[1], (a, b)
    assert "boom while held" in b[1], b


def test_hold_declines_what_no_lane_sends_in_one_message():
    """One rank, or a compressor without a steady lane: ``None`` (the caller runs the call at once)."""
    t = torch.randn(4000)
    tx = ResidualTransaction()
    ef = commpress.ErrorFeedback(commpress.get("blockquant", bits=4))
    assert joint.hold(t, ef, group=None, key="x", step=0, algorithm="auto", stats=None, transaction=tx) is None
    assert joint.hold(t, commpress.get("fp16"), group=None, key="x", step=0, algorithm="auto", stats=None,
                      transaction=tx) is None
