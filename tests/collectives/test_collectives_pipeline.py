"""``"gather_all"`` as a pipeline: one ``all_gather`` per chunk, chunk ``r`` on the wire while
chunk ``r+1`` is compressed and the chunks before it are decoded.

It must be the same collective as the one-message ``"gather_all"``: bitwise the same sum,
dense part and residuals on every rank; a NaN/inf in a later chunk poisons the whole result
and keeps every residual; a rank that fails to compress a later chunk (after the first
chunk's message has left) makes every rank raise in the same call, and the next call works.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run

import commpress
from commpress.collectives import CollectiveInputError, CommStats, allreduce, set_cost_model
from commpress.collectives import quantized
from commpress.compressors.blockquant import BlockQuant
from commpress.feedback import ResidualTransaction

N, D = 5000, 37   # chunks of 2500 / 1667 elements: uneven, not block multiples at P=3

CASES = {
    "blockquant4+ef": lambda: commpress.ErrorFeedback(commpress.get("blockquant", bits=4)),
    "blockquant8-stochastic+ef": lambda: commpress.ErrorFeedback(commpress.get("blockquant", bits=8,
                                                                                stochastic=True)),
    "qsgd": lambda: commpress.get("qsgd"),
    "signsgd+ef": lambda: commpress.ErrorFeedback(commpress.get("signsgd")),
}


def data(rank: int, step: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + rank + 7 * n))


class FailsOnSecondChunk(BlockQuant):
    """blockquant that raises on this rank's second chunk at step 1 (after the first chunk's
    message has left)."""

    def compress_fixed(self, tensor, *, step=0, key=0, generator=None):
        if step == 1 and isinstance(key, tuple) and key[1] == 1:
            raise RuntimeError("boom on chunk 1")
        return super().compress_fixed(tensor, step=step, key=key, generator=generator)


def pipe(on: bool) -> None:
    """A cost model under which "auto" picks gather_all at P=2 and P=3 (a large α), its chunks'
    messages long enough on the wire to pipeline (β) or free (β = 0: one message)."""
    set_cost_model(1.0, 1e-5 if on else 0.0)


def _residuals(c) -> dict:
    return {k: v.clone() for k, v in getattr(c, "_residuals", {}).items()}


def pipeline_worker(rank, world):
    out = {}
    for name, make in CASES.items():
        for dtype in (torch.float32, torch.bfloat16):
            one, piped = make(), make()
            results = []
            for step in range(3):
                x = data(rank, step, N).to(dtype)
                got = {}
                for mode, codec in (("one", one), ("piped", piped)):
                    pipe(mode == "piped")
                    d = data(rank, step, D).to(dtype)
                    stats = CommStats()
                    tx = ResidualTransaction()
                    y = allreduce(x.clone(), codec, key="u", step=step, algorithm="auto", stats=stats,
                                  generator=17 + step, validate=False, transaction=tx, dense=d)
                    tx.commit()
                    assert stats.last_algorithm == "gather_all", stats.last_algorithm
                    got[mode] = (y, d, stats.rounds)
                results.append(dict(same=torch.equal(got["one"][0], got["piped"][0]),
                                    dense=torch.equal(got["one"][1], got["piped"][1]),
                                    rounds=(got["one"][2], got["piped"][2]), result=got["piped"][0]))
            res_one, res_piped = _residuals(one), _residuals(piped)
            out[f"{name}:{dtype}"] = dict(steps=results, residuals=res_one.keys() == res_piped.keys() and all(
                torch.equal(v, res_piped[k]) for k, v in res_one.items()))
    pipe(True)
    # a NaN in the last chunk of the last rank: all-NaN everywhere, every residual kept, next call clean
    ef = CASES["blockquant4+ef"]()
    allreduce(data(rank, 0, N), ef, key="nan", step=0, algorithm="auto", validate=False)
    before = _residuals(ef)
    x = data(rank, 1, N)
    if rank == world - 1:
        x[-5] = float("nan")
    got = allreduce(x, ef, key="nan", step=1, algorithm="auto", validate=False)
    kept = bool(before) and before.keys() == _residuals(ef).keys() and all(
        torch.equal(v, ef.residual(k)) for k, v in before.items())
    after = allreduce(data(rank, 2, N), ef, key="nan", step=2, algorithm="auto", validate=False)
    out["nan"] = (bool(torch.isnan(got).all()), kept, bool(torch.isfinite(after).all()))
    # rank 1 fails on its second chunk at step 1; then an unsupported dtype on rank 1 at step 2
    outcomes = []
    codec = FailsOnSecondChunk(bits=4) if rank == 1 else BlockQuant(bits=4)
    for step in range(4):
        x = data(rank, step, N)
        if rank == 1 and step == 2:
            x = x.double()
        try:
            allreduce(x, codec, key="err", step=step, algorithm="auto", validate=False,
                      dense=data(rank, step, D))
            outcomes.append("ok")
        except CollectiveInputError as exc:
            outcomes.append(f"raised: {exc}")
    out["errors"] = outcomes
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 3])
def test_pipelined_gather_all_is_the_one_message_collective(world):
    res = run(pipeline_worker, world, timeout=140)
    for rank in range(world):
        got = res[rank]
        for key, case in ((k, v) for k, v in got.items() if ":" in k):
            assert case["residuals"], key
            for step, s in enumerate(case["steps"]):
                assert s["same"], (key, step)
                if world == 2:  # the dense part rides (P <= 2), in the first chunk's message
                    assert s["dense"], (key, step)
                assert s["rounds"][1] == s["rounds"][0] + world - 1, (key, s["rounds"])   # one round per chunk
                assert torch.equal(s["result"], res[0][key]["steps"][step]["result"])   # bitwise on every rank
        assert got["nan"] == (True, True, True), got["nan"]
        ok, failed, bad_dtype, again = got["errors"]
        assert ok == "ok" and again == "ok", got["errors"]
        assert "rank(s) [1]" in failed and (rank != 1 or "boom on chunk 1" in failed), failed
        assert "rank(s) [1]" in bad_dtype, bad_dtype


def test_pipelines_when_a_chunk_is_long_enough_on_the_wire():
    from commpress.collectives.costmodel import CostModel

    gbit = CostModel(1.5e-4, 8e-9)   # ~1 Gbit/s
    limit = quantized.PIPELINE_MIN_WIRE_S / 8e-9
    assert quantized.pipelines(gbit, [int(limit) + 8, int(limit)])
    assert not quantized.pipelines(gbit, [int(limit) - 8] * 2)
    assert quantized.pipelines(gbit, [int(limit / 2) + 8] * 3)   # P-1 = 2 peers' worth of bytes
    assert not quantized.pipelines(CostModel(1e-5, 1e-10), [600_000, 600_000])   # loopback: never pays
    assert not quantized.pipelines(gbit, [10**9])   # one rank: nothing to overlap
