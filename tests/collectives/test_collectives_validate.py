"""Bad input raises the same exception on every rank (never a hang), and the ranks stay in step."""

from __future__ import annotations

import pytest
import torch

from distributed import run

import commpress
from commpress.collectives import CollectiveInputError, allreduce, sparse_allreduce


def torch_backend():
    import os

    os.environ["COMMPRESS_BACKEND"] = "torch"


def _good(rank):
    return torch.tensor([0, 3, 5]) + rank, torch.ones(3)


def _with_model(fixed, thunk):
    from commpress.collectives import set_cost_model

    set_cost_model(1e-5, 1e-9) if fixed else set_cost_model(None)
    try:
        return thunk()
    finally:
        set_cost_model(None)


def bad_cases(rank, world):
    """(name, thunk) pairs: each makes at least one rank's input bad or inconsistent."""
    last = world - 1
    n = 16

    def sp(idx, vals, numel=n, algorithm="allgather"):
        return lambda: sparse_allreduce(idx, vals, numel, algorithm=algorithm)

    i, v = _good(rank)
    cases = [
        ("out_of_range", sp(torch.tensor([n]) if rank == last else i, torch.ones(1) if rank == last else v)),
        ("negative_index", sp(torch.tensor([-1, 2]) if rank == 0 else i, torch.ones(2) if rank == 0 else v)),
        ("duplicates", sp(torch.tensor([2, 2]) if rank == 0 else i, torch.ones(2) if rank == 0 else v)),
        ("length_mismatch", sp(i, torch.ones(2) if rank == last else v)),
        ("numel_mismatch", sp(i, v, numel=n + 1 if rank == 0 else n)),
        ("dtype_mismatch", sp(i, v.half() if rank == 0 else v)),
        ("algorithm_mismatch", sp(i, v, algorithm="split" if rank == 0 else "hashed")),
        ("unknown_algorithm", sp(i, v, algorithm="bogus" if rank == last else "allgather")),
        ("not_a_tensor", sp(i.tolist() if rank == 0 else i, v)),
        ("compressor_mismatch", lambda: allreduce(torch.ones(8), commpress.get("fp16" if rank == 0 else "bf16"))),
        ("kind_mismatch", lambda: allreduce(torch.ones(8), commpress.get("topk", ratio=0.5) if rank == 0
                                            else commpress.get("fp16"))),
        ("gather_numel_mismatch", lambda: allreduce(torch.ones(8 + (rank == 0)), commpress.get("qsgd"))),
        ("gather_param_mismatch", lambda: allreduce(torch.ones(8), commpress.get("blockquant",
                                                                                 bits=8 if rank else 4))),
        ("lowrank_shape_mismatch", lambda: allreduce(torch.ones(16, 12 + (rank == last)),
                                                     commpress.get("powersgd", rank=1))),
        ("reduce_scatter_indivisible", lambda: commpress.collectives.reduce_scatter(
            torch.ones(world * 4 + 1), commpress.get("identity"))),
        ("sparse_value_dtype_int", sp(i, torch.ones(3, dtype=torch.int32) if rank == last else v)),
        ("cost_model_on_one_rank", lambda: _with_model(rank == 0, sp(i, v, algorithm="auto"))),
    ]
    return cases


def validate_worker(rank, world):
    torch_backend()
    out = {}
    for name, thunk in bad_cases(rank, world):
        try:
            thunk()
            out[name] = None
        except Exception as exc:  # noqa: BLE001
            out[name] = (type(exc).__name__, isinstance(exc, ValueError), str(exc))
    # still in step afterwards: a good call works and agrees
    i, v = _good(rank)
    out["after"] = sparse_allreduce(i, v, 16, algorithm="split").tolist()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 3])
def test_bad_input_raises_on_every_rank(world):
    res = run(validate_worker, world, timeout=80, pg_timeout=20)
    names = [name for name, _ in bad_cases(0, world)]
    for name in names:
        for r in range(world):
            got = res[r][name]
            assert got is not None, (name, r, "did not raise")
            assert got[0] == "CollectiveInputError" and got[1], (name, r, got)
    assert "numel differs" in res[0]["numel_mismatch"][2]
    assert "dtype differs" in res[1]["dtype_mismatch"][2]
    assert "algorithm differs" in res[0]["algorithm_mismatch"][2]
    assert "duplicate" in res[world - 1]["duplicates"][2]
    assert "out of range" in res[0]["out_of_range"][2]
    assert "configuration differs" in res[0]["compressor_mismatch"][2]
    assert "set_cost_model" in res[1]["cost_model_on_one_rank"][2]
    assert res[0]["after"] == res[world - 1]["after"]
    expect = [0.0] * 16
    for r in range(world):
        for j in (0, 3, 5):
            expect[j + r] += 1.0
    assert res[0]["after"] == expect


def test_world_one_raises_locally():
    with pytest.raises(ValueError, match="out of range"):
        sparse_allreduce(torch.tensor([4]), torch.ones(1), 4)
    with pytest.raises(ValueError, match="duplicate"):
        sparse_allreduce(torch.tensor([1, 1]), torch.ones(2), 4)
    with pytest.raises(ValueError, match="different lengths"):
        sparse_allreduce(torch.tensor([1]), torch.ones(2), 4)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        sparse_allreduce(torch.tensor([1]), torch.ones(1), 4, algorithm="nope")
    with pytest.raises(TypeError, match="torch.Tensor"):
        allreduce([1.0], commpress.get("identity"))
    # validate=False skips the O(k) checks (the caller vouches for the input)
    out = sparse_allreduce(torch.tensor([1, 2]), torch.ones(2), 4, validate=False)
    assert out.tolist() == [0.0, 1.0, 1.0, 0.0]
