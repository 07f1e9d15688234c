"""``rows_allreduce``: the lossless sum of row-sparse tensors (``"allgather"`` and ZEN's
``"hashed"``), on 1 to 4 gloo ranks: bitwise the same on every rank, equal to the dense
all_reduce (exactly where rows do not overlap), no row dropped whatever the capacities
(0 and 1 included: the overflow round), the cost model's choice, bad input raising on every rank.

Each rank's data comes from :func:`_data` (seeded by rank and case), so the parent computes
the expected sums itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run

from commpress.collectives import CollectiveInputError, CommStats, set_cost_model
from commpress.ops.reference import hash_owner
from commpress.collectives.costmodel import CostModel
from commpress.collectives.rows import ROW_ALGORITHMS, nonzero_rows, row_bytes, row_costs, rows_allreduce

ROWS, D = 101, 6
#: how the ranks' rows relate: none shared, some shared, all the same rows
OVERLAPS = ("disjoint", "partial", "same")


def _data(rank: int, overlap: str, seed: int, dtype=torch.float32, touched: int = 9) -> torch.Tensor:
    """Rank ``rank``'s gradient: ``touched`` nonzero rows (disjoint: a rank's own stripe)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.zeros(ROWS, D, dtype=dtype)
    if overlap == "disjoint":
        rows = torch.arange(rank, ROWS, 4)[:touched]
    elif overlap == "same":
        rows = torch.arange(3, 3 + 2 * touched, 2)
    else:
        rows = torch.cat([torch.arange(0, 4), torch.randperm(ROWS, generator=g)[:touched - 4]]).unique()
    x[rows] = torch.randn(rows.numel(), D, generator=g).to(dtype)
    return x


def _dense_sum(world: int, overlap: str, seed: int, dtype=torch.float32) -> torch.Tensor:
    acc = torch.zeros(ROWS, D, dtype=torch.float64)
    for r in range(world):
        acc += _data(r, overlap, seed, dtype).double()
    return acc


#: (algorithm, capacity, owner_capacity, union_capacity): small ones overflow, 0 and 1 included
CASES = [("allgather", 0, None, None), ("allgather", 1, None, None), ("allgather", 9, None, None),
         ("allgather", 64, None, None), ("hashed", 0, 0, 0), ("hashed", 4, 1, 1), ("hashed", 4, 2, 40), ("hashed", 0, 9, 1),
         ("hashed", 36, 9, 36)]


def _sums(rank: int, world: int) -> list:
    torch.manual_seed(0)
    out = []
    for seed, overlap in enumerate(OVERLAPS):
        x = _data(rank, overlap, seed)
        dense = x.clone()
        if world > 1:
            dist.all_reduce(dense)
        for algorithm, cap, ocap, ucap in CASES:
            stats = CommStats()
            res = rows_allreduce(x, capacity=cap, owner_capacity=ocap, union_capacity=ucap, algorithm=algorithm,
                                 key=("t", algorithm, cap, ocap, ucap), stats=stats)
            again = res if overlap != "partial" else rows_allreduce(   # deterministic: the same bits again
                x, capacity=cap, owner_capacity=ocap, union_capacity=ucap, algorithm=algorithm,
                key=("t", algorithm, cap, ocap, ucap))
            out.append({"case": (overlap, algorithm, cap, ocap, ucap), "sum": res.sum, "dense": dense,
                        "again": torch.equal(res.sum.view(torch.int32), again.sum.view(torch.int32)),
                        "algorithm": res.algorithm, "counts": res.counts, "owner_counts": res.owner_counts,
                        "union": int(res.union), "overflow": res.overflow_rounds, "input_kept": torch.equal(
                            x, _data(rank, overlap, seed))})
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rows_sum_is_the_dense_sum_bitwise_alike_on_every_rank(world):
    results = run(_sums, world, timeout=110)
    for i, rec in enumerate(results[0]):
        overlap, algorithm, cap, *_ = rec["case"]
        seed = OVERLAPS.index(overlap)
        for other in results[1:]:   # bitwise the same on every rank
            assert torch.equal(other[i]["sum"].view(torch.int32), rec["sum"].view(torch.int32)), rec["case"]
            assert other[i]["overflow"] == rec["overflow"] and other[i]["counts"] == rec["counts"]
        assert rec["again"] and rec["input_kept"], rec["case"]
        want = _dense_sum(world, overlap, seed)
        if overlap == "disjoint" or world == 1:   # no row on two ranks: exactly the dense all_reduce
            assert torch.equal(rec["sum"], rec["dense"]), rec["case"]
        else:
            assert torch.allclose(rec["sum"].double(), want, rtol=1e-6, atol=1e-6), rec["case"]
            assert torch.allclose(rec["sum"], rec["dense"], rtol=1e-6, atol=1e-6), rec["case"]
        masks = [nonzero_rows(_data(r, overlap, seed)) for r in range(world)]
        assert rec["counts"] == [int(m.sum()) for m in masks], rec["case"]
        union = int(torch.stack(masks).any(0).sum())
        if world == 1:
            assert rec["algorithm"] == "local" and rec["overflow"] == 0
            continue
        assert rec["algorithm"] == algorithm
        owner = hash_owner(torch.arange(ROWS), world)
        per_owner = [torch.bincount(owner[m], minlength=world).tolist() for m in masks]
        assert rec["owner_counts"] == per_owner, rec["case"]
        if algorithm == "allgather":
            assert rec["union"] == union
            assert rec["overflow"] == int(max(rec["counts"]) > cap), rec["case"]
        else:
            ocap, ucap = rec["case"][3], rec["case"][4]
            owner_unions = torch.bincount(owner[torch.stack(masks).any(0)], minlength=world)
            sends_over = max(max(row) for row in per_owner) > ocap
            assert rec["overflow"] == int(sends_over or int(owner_unions.max()) > ucap), rec["case"]
            if not sends_over:
                assert rec["union"] == union, rec["case"]


def _special(rank: int, world: int) -> dict:
    """Half dtypes, NaN, all-zero input, the rounds and bytes of a call whose facts were agreed,
    and ``"auto"`` under fixed cost-model numbers."""
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        for algorithm in ROW_ALGORITHMS:
            res = rows_allreduce(_data(rank, "partial", 7, dtype), capacity=4, algorithm=algorithm, key=("h", algorithm))
            out[(str(dtype), algorithm)] = res.sum
    x = _data(rank, "disjoint", 8)
    if rank == world - 1:
        x[5, 2] = float("nan")   # rank r's stripe: row 5 is touched by rank 1 (or the only rank)
    out["nan"] = [rows_allreduce(x, capacity=2, algorithm=a, key=("nan", a)).sum for a in ROW_ALGORITHMS]
    out["zero"] = [rows_allreduce(torch.zeros(ROWS, D), capacity=c, algorithm=a, key=("z", a, c))
                   for a in ROW_ALGORITHMS for c in (0, 3)]
    x = _data(rank, "partial", 9)
    for algorithm, cap in (("allgather", 9), ("allgather", 2), ("hashed", 36), ("hashed", 4)):
        rows_allreduce(x, capacity=cap, algorithm=algorithm, key=("s", algorithm, cap))   # agrees the facts
        stats = CommStats()
        res = rows_allreduce(x, capacity=cap, algorithm=algorithm, key=("s", algorithm, cap), stats=stats)
        out[("stats", algorithm, cap)] = (stats.rounds, stats.bytes_sent, stats.calls, stats.last_algorithm,
                                         res.overflow_rounds)
    # out=: the input itself (only its own rows zeroed first) or another buffer, bitwise the new tensor's
    for algorithm, cap, dtype in (("allgather", 9, torch.float32), ("allgather", 2, torch.float32),
                                  ("hashed", 36, torch.float32), ("hashed", 4, torch.float32),
                                  ("hashed", 4, torch.bfloat16)):
        key = ("out", algorithm, cap, str(dtype))
        x = _data(rank, "partial", 10, dtype)
        fresh = rows_allreduce(x, capacity=cap, algorithm=algorithm, key=key).sum
        other = torch.full_like(x, 7.0)
        into = rows_allreduce(x, capacity=cap, algorithm=algorithm, key=key, out=other).sum
        inplace = rows_allreduce(x, capacity=cap, algorithm=algorithm, key=key, out=x).sum
        out[key] = (torch.equal(fresh, into) and into is other and torch.equal(fresh, inplace) and inplace is x)
    out["calibrated"] = rows_allreduce(x, capacity=9, key="calibrated").algorithm   # "auto", measured model
    set_cost_model(1e-5, 1e-9, 1e-9, 1e-10)
    for cap, ocap, ucap in ((40, 10, 10), (40, 40, 160), (9, 3, 3)):
        res = rows_allreduce(x, capacity=cap, owner_capacity=ocap, union_capacity=ucap, key=("auto", cap, ocap, ucap))
        out[("auto", cap, ocap, ucap)] = res.algorithm
    set_cost_model(None)
    return out


def _width(world: int, cap: int, meta: int) -> int:
    al = lambda b: -(-b // 8) * 8  # noqa: E731
    return 8 + al(8 * meta) + al(4 * cap) + al(4 * D * cap)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_rows_half_nan_zero_rounds_bytes_and_auto(world):
    results = run(_special, world, timeout=110)
    first = results[0]
    for res in results[1:]:
        for k, v in first.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v.view(torch.uint8), res[k].view(torch.uint8)), k
    for dtype in (torch.float16, torch.bfloat16):
        want = sum(_data(r, "partial", 7, dtype).float() for r in range(world))   # fp32 sum, rounded once
        for algorithm in ROW_ALGORITHMS:
            got = first[(str(dtype), algorithm)]
            assert got.dtype == dtype
            tol = 1e-2 if dtype == torch.float16 else 3e-2
            assert torch.allclose(got.float(), want, rtol=tol, atol=tol), (dtype, algorithm)
    for got in first["nan"]:   # the NaN propagates to its row only
        assert torch.isnan(got[5, 2]) and not torch.isnan(got[torch.arange(ROWS) != 5]).any()
    for res in first["zero"]:
        assert res.counts == [0] * world and not res.sum.any() and res.overflow_rounds == 0
    counts = [int(nonzero_rows(_data(r, "partial", 9)).sum()) for r in range(world)]
    rounds, sent, calls, algo, over = first[("stats", "allgather", 9)]
    assert (rounds, calls, algo, over) == (1, 1, "rows_allgather", 0)
    assert sent == (world - 1) * _width(world, 9, 1 + world)
    assert sent == row_bytes(world, ROWS, D, torch.float32, 9, 0, 0)["allgather"]
    rounds, sent, calls, algo, over = first[("stats", "allgather", 2)]
    assert (rounds, over) == (2, 1)
    extra = max(counts) - 2
    assert sent == (world - 1) * (_width(world, 2, 1 + world) + _width(world, extra, 0))
    rounds, sent, calls, algo, over = first[("stats", "hashed", 36)]
    assert (rounds, algo, over) == (2, "rows_hashed", 0)
    ocap = -(-36 // world)   # the default owner and union capacities: ceil(capacity / P)
    assert sent == (world - 1) * (_width(world, ocap, 1) + _width(world, ocap, 3 + world))
    assert sent == row_bytes(world, ROWS, D, torch.float32, 36, ocap, ocap)["hashed"]
    assert first[("stats", "hashed", 4)][0] == 3 and first[("stats", "hashed", 4)][4] == 1
    assert all(v for k, v in first.items() if k[0] == "out"), {k: v for k, v in first.items() if k[0] == "out"}
    if world == 2:   # the hashed path's messages, bytes and sums are all more at P=2: any model agrees
        assert first["calibrated"] == "allgather"
    model = CostModel(1e-5, 1e-9, 1e-9, 1e-10)
    for (cap, ocap, ucap) in ((40, 10, 10), (40, 40, 160), (9, 3, 3)):
        costs = row_costs(world, ROWS, D, cap, ocap, ucap, 4, 4, model)
        want = "hashed" if costs["hashed"] < costs["allgather"] else "allgather"
        assert first[("auto", cap, ocap, ucap)] == want


def test_row_costs_pick_hashed_where_rows_overlap_at_p4_and_allgather_at_p2():
    model = CostModel(alpha=1e-5, beta=1e-9)
    rows, dim, k = 100_000, 64, 2000
    for world in (2, 3, 4):   # every rank touches the same k rows: the owners' union is k/P each
        c = row_costs(world, rows, dim, k, -(-k // world), -(-k // world), 4, 4, model)
        assert (c["hashed"] < c["allgather"]) == (world > 2), (world, c)
        assert c["allgather"] < c["dense"]
    c = row_costs(4, rows, dim, k, -(-k // 4), k, 4, 4, model)   # disjoint rows: the union is P*k
    assert c["allgather"] < c["hashed"]


def _bad(rank: int, world: int) -> dict:
    """Each bad input on the last rank only: every rank must raise, and the group still works."""
    out = {}
    cases = {
        "1-D": lambda x: (x[:, 0].contiguous(), {}),
        "int": lambda x: (x.to(torch.int64), {}),
        "shape": lambda x: (torch.zeros(ROWS + 1, D), {}),
        "dtype": lambda x: (x.double(), {}),
        "capacity": lambda x: (x, {"capacity": -1}),
        "algorithm": lambda x: (x, {"algorithm": "ring"}),
    }
    for name, make in cases.items():
        x, kw = _data(rank, "partial", 0), {}
        if rank == world - 1:
            x, kw = make(x)
        try:
            rows_allreduce(x, key=("bad", name), **kw)
            out[name] = None
        except CollectiveInputError as exc:
            out[name] = str(exc)
    # steady state: agreed facts, then ranks disagree on the capacity (same message width)
    narrow = _data(rank, "partial", 0)[:, :1].contiguous()
    for cap in (1, 2):
        rows_allreduce(narrow, capacity=cap, algorithm="allgather", key="steady")
    try:
        rows_allreduce(narrow, capacity=1 + (rank == world - 1), algorithm="allgather", key="steady")
        out["steady"] = None
    except CollectiveInputError as exc:
        out["steady"] = str(exc)
    for cap in (1, 2):   # the same for the hashed path: its all_to_all pieces carry the status too
        rows_allreduce(narrow, owner_capacity=cap, union_capacity=cap, algorithm="hashed", key="steady-hashed")
    try:
        cap = 1 + (rank == world - 1)
        rows_allreduce(narrow, owner_capacity=cap, union_capacity=cap, algorithm="hashed", key="steady-hashed")
        out["steady-hashed"] = None
    except CollectiveInputError as exc:
        out["steady-hashed"] = str(exc)
    out["after"] = rows_allreduce(_data(rank, "disjoint", 0), algorithm="allgather", key="after").sum
    return out


@pytest.mark.timeout(90)
def test_bad_input_raises_on_every_rank():
    world = 3
    results = run(_bad, world, timeout=80)
    expect = {"1-D": "bad shape", "int": "unsupported dtype", "shape": "rows differs", "dtype": "dtype differs",
              "capacity": "compressor misuse", "algorithm": "compressor misuse", "steady": "capacities or algorithm differ",
              "steady-hashed": "capacities or algorithm differ"}
    for rank, res in enumerate(results):
        for name, text in expect.items():
            assert res[name] is not None and text in res[name], (rank, name, res[name])
        assert torch.equal(res["after"], _dense_sum(world, "disjoint", 0).float())
    assert "2-D" in results[-1]["1-D"] and "rank(s) [2]" in results[0]["1-D"]


def test_nonzero_rows_sees_nan_inf_and_subnormals_not_signed_zeros():
    x = torch.zeros(6, 3)
    x[0, 1], x[1, 2], x[2, 0], x[3, 1], x[4, 2] = float("nan"), float("-inf"), 1e-45, -0.0, -2.0
    assert nonzero_rows(x).tolist() == [True, True, True, False, True, False]
    assert nonzero_rows(torch.zeros(0, 3)).numel() == 0 and not nonzero_rows(torch.zeros(4, 0)).any()


def test_bad_input_on_one_rank_raises_a_value_error():
    for x, kw in ((torch.zeros(5), {}), (torch.zeros(4, 3, dtype=torch.int32), {}), (torch.zeros(4, 3), {"capacity": 1.5}),
                  (torch.zeros(4, 3), {"out": torch.zeros(4, 3, dtype=torch.float64)})):
        with pytest.raises(ValueError, match="rows_allreduce"):
            rows_allreduce(x, **kw)
