"""``allreduce(..., dense=)``: the DDP hook's dense part riding in the payload's message.

At P=2 the sparse ``"allgather"`` and the quantized ``"gather_all"`` message carry it (one round,
the sum in rank order, bitwise the same on every rank), and the quantized ``"two_phase"`` phases
at any P; at P=3 riding in an all_gather would cost more bytes than a ring all_reduce, so there
it takes an all_reduce of its own.  Its NaN/inf joins the status
(result poisoned, residuals kept) and an error anywhere raises on every rank.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run

import commpress
from commpress.collectives import CollectiveInputError, CommStats, allreduce, carries_dense

N, D = 4096, 37

CASES = {
    "topk": (lambda: commpress.ErrorFeedback(commpress.get("topk", ratio=0.01, density_warmup=0)), "allgather"),
    "blockquant": (lambda: commpress.ErrorFeedback(commpress.get("blockquant", bits=4)), "gather_all"),
    "two_phase": (lambda: commpress.ErrorFeedback(commpress.get("blockquant", bits=4)), "two_phase"),
    # the whole compensated tensor (the gathered slots would be the larger message): 4-bit
    # blockquant with "auto", fp32 with "dense"; at P=2 one all_gather carries the dense part too
    "whole": (lambda: commpress.ErrorFeedback(commpress.get("topk", ratio=0.25, density_warmup=0)), "auto"),
    "whole32": (lambda: commpress.ErrorFeedback(commpress.get("topk", ratio=0.01, density_warmup=0)), "dense"),
}


def data(rank: int, step: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + rank + 7 * n))


def rider_worker(rank, world):
    out = {}
    for name, (make, algorithm) in CASES.items():
        with_dense, without = make(), make()
        for dtype in (torch.float32, torch.bfloat16):
            key = f"{name}:{dtype}"
            for step in range(2):  # step 0 agrees the facts (a header), step 1 is the steady state
                x = data(rank, step, N)
                d = data(rank, step, D).to(dtype)
                expect = data(0, step, D).to(dtype).float()  # every rank's contribution, in rank order
                for r in range(1, world):
                    expect += data(r, step, D).to(dtype).float()
                s_with, s_without = CommStats(), CommStats()
                got = allreduce(x.clone(), with_dense, key=key, step=step, algorithm=algorithm,
                                stats=s_with, dense=d)
                ref = allreduce(x.clone(), without, key=key, step=step, algorithm=algorithm,
                                stats=s_without)
            out[key] = dict(same=torch.equal(got, ref), dense=d.clone(), exact=torch.equal(d, expect.to(dtype)),
                            close=torch.allclose(d.float(), expect, rtol=1e-2, atol=1e-2),
                            rounds=(s_with.rounds, s_without.rounds),
                            algorithms=(s_with.last_algorithm, s_without.last_algorithm),
                            extra=s_with.bytes_sent - s_without.bytes_sent)
    # a NaN in one rank's dense part: the result all-NaN, every residual kept, the next call clean
    out["nan"] = []
    for name in ("topk", "two_phase", "whole"):
        make, algorithm = CASES[name]
        ef = make()
        allreduce(data(rank, 0, N), ef, key="nan", step=0, algorithm=algorithm, dense=data(rank, 0, D))
        before = {k: ef.residual(k).clone() for k in ef._residuals}
        d = data(rank, 1, D)
        if rank == world - 1:
            d[3] = float("nan")
        got = allreduce(data(rank, 1, N), ef, key="nan", step=1, algorithm=algorithm, dense=d)
        kept = bool(before) and all(torch.equal(v, ef.residual(k)) for k, v in before.items())
        after = allreduce(data(rank, 2, N), ef, key="nan", step=2, algorithm=algorithm, dense=data(rank, 2, D))
        out["nan"].append((bool(torch.isnan(got).all()), bool(torch.isnan(d).any()), kept,
                           bool(torch.isfinite(after).all())))
    # bad input on one rank: every rank raises in the same call, and the next call works
    outcomes = []
    for name in ("topk", "blockquant", "two_phase", "whole"):
        c = CASES[name][0]()
        for step in range(3):
            x = data(rank, step, N)
            if rank == 1 and step == 1:
                x = x.double()  # unsupported dtype, found by the local check
            try:
                allreduce(x, c, key=f"err:{name}", step=step, algorithm=CASES[name][1], validate=False,
                          dense=data(rank, step, D))
                outcomes.append("ok")
            except CollectiveInputError:
                outcomes.append("raised")
    out["errors"] = outcomes
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_dense_part_summed_exactly_in_rank_order(world):
    res = run(rider_worker, world, timeout=110)
    for rank in range(world):
        got = res[rank]
        for name in CASES:
            for dtype in ("torch.float32", "torch.bfloat16"):
                r = got[f"{name}:{dtype}"]
                assert r["same"], (name, dtype)           # the payload's result does not change
                if name.startswith("whole"):  # the whole compensated tensor, not a selection
                    sent = "whole_blockquant" if name == "whole" else "dense"
                    assert r["algorithms"] == (sent, sent), r
                rides = world == 2 or name == "two_phase"
                # riding: the exact sum in rank order (fp32 for bf16); its own all_reduce: gloo's order
                assert r["exact"] if rides else r["close"], (name, dtype)
                assert torch.equal(r["dense"], res[0][f"{name}:{dtype}"]["dense"])  # bitwise on every rank
                nbytes = D * (4 if dtype == "torch.float32" else 2)
                ring = 2 * nbytes * (world - 1) // world
                if rides:  # no round of its own, the bytes of a ring all_reduce (+ alignment, rounding)
                    assert r["rounds"][0] == r["rounds"][1] == (2 if name == "two_phase" else 1), r
                    assert ring <= r["extra"] <= ring + 16 * (world - 1), r
                else:  # an all_gather would send more than a ring all_reduce: its own round
                    assert r["rounds"][0] == r["rounds"][1] + 1, r
                    assert r["extra"] == 2 * nbytes * (world - 1) // world, r
        for poisoned, dense_nan, kept, recovered in got["nan"]:
            assert poisoned and dense_nan and kept and recovered, got["nan"]
        assert got["errors"] == ["ok", "raised", "ok"] * 4


def test_carries_dense_and_argument_checks():
    topk = commpress.get("topk", ratio=0.01)
    bq = commpress.ErrorFeedback(commpress.get("blockquant", bits=4))
    assert carries_dense(topk, world=2) and carries_dense(bq, world=2)
    assert carries_dense(topk, world=2, algorithm="allgather")
    assert not carries_dense(topk, world=2, algorithm="dense")  # the densified selection's all_reduce
    ef_topk = commpress.ErrorFeedback(topk)  # its "dense": the whole compensated tensor, gathered at P=2
    assert carries_dense(ef_topk, world=2, algorithm="dense") and not carries_dense(ef_topk, world=3, algorithm="dense")
    # "auto"'s whole-tensor send in 4 bits carries it too, at P <= 2, with error feedback only
    assert carries_dense(ef_topk, world=2, algorithm="whole_blockquant")
    assert not carries_dense(ef_topk, world=3, algorithm="whole_blockquant")
    assert not carries_dense(topk, world=2, algorithm="whole_blockquant")
    assert carries_dense(bq, world=4, algorithm="two_phase") and carries_dense(bq, world=4)
    assert not carries_dense(bq, world=4, algorithm="gather_all")
    assert not carries_dense(topk, world=3) and not carries_dense(topk, world=1)
    assert not carries_dense(commpress.get("fp16"), world=2)
    assert not carries_dense(commpress.get("powersgd", rank=2), world=2)
    # one rank: the dense part is its own sum, left as it is
    d = torch.arange(5.0)
    allreduce(torch.randn(64), topk, dense=d)
    assert torch.equal(d, torch.arange(5.0))
    with pytest.raises(TypeError, match="dense"):
        allreduce(torch.randn(64), topk, dense=[1.0])
    with pytest.raises(ValueError, match="dense"):
        allreduce(torch.randn(64), topk, dense=torch.arange(5))
    with pytest.raises(ValueError, match="dense"):
        allreduce(torch.randn(64), topk, dense=torch.randn(4, 4).t())
