"""sparse_allreduce: every algorithm equals the dense sum exactly, bitwise identical on all ranks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distributed import run

from commpress.collectives import SPARSE_ALGORITHMS, CommStats, sparse_allreduce

ALGOS = SPARSE_ALGORITHMS + ("auto",)


def torch_backend():
    """Workers use the torch reference ops: the numba backend's per-process JIT/cache load
    (about a second per op) would dominate these small cases; backend parity is tested in tests/ops."""
    import os

    os.environ["COMMPRESS_BACKEND"] = "torch"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}


def _values(idx: list[int], rank: int, frac: bool = False) -> list[float]:
    # small integers: sums are exact in every dtype (|sum| <= 4 * 16 < 256).  With ``frac`` a
    # fraction is added so that the order of the additions shows in the bits (cross-rank check).
    return [float(((i * 7 + rank * 3) % 31) - 15) + (((i * 2654435761 + rank) % 1000) / 997.0 if frac else 0.0)
            for i in idx]


def named_patterns(world: int, numel: int, seed: int) -> list[tuple[str, list[list[int]]]]:
    rng = random.Random(seed)
    per = max(1, numel // (2 * world))
    out = []
    perm = rng.sample(range(numel), numel)
    out.append(("disjoint", [sorted(perm[r * per:(r + 1) * per]) for r in range(world)]))
    same = sorted(rng.sample(range(numel), per))
    out.append(("identical", [list(same) for _ in range(world)]))
    out.append(("partial", [sorted(set(same[: per // 2]) | set(rng.sample(range(numel), per)))
                            for _ in range(world)]))
    out.append(("one_empty", [[] if r == world - 1 else sorted(rng.sample(range(numel), per))
                              for r in range(world)]))
    out.append(("all_empty", [[] for _ in range(world)]))
    out.append(("full", [list(range(numel)) for _ in range(world)]))
    lo = rng.randrange(numel - 8)
    out.append(("clustered", [sorted(rng.sample(range(lo, lo + 8), rng.randint(1, 8))) for _ in range(world)]))
    out.append(("single_last", [[numel - 1] for _ in range(world)]))
    return out


def sparse_worker(rank, world, cases, algos):
    """For each (numel, supports, dtype, index dtype): run every algorithm; return raw bytes + stats."""
    from commpress.collectives import set_cost_model

    torch_backend()
    set_cost_model(5e-5, 1e-9)
    results = []
    for numel, supports, dname, iname, *frac in cases:
        idx = torch.tensor(supports[rank], dtype=getattr(torch, iname))
        vals = torch.tensor(_values(supports[rank], rank, bool(frac and frac[0])), dtype=DTYPES[dname])
        # not sorted on input: shuffle this rank's entries (the contract only asks for unique)
        perm = torch.randperm(idx.numel(), generator=torch.Generator().manual_seed(rank))
        idx, vals = idx[perm], vals[perm]
        row = {}
        for alg in algos:
            stats = CommStats()
            out = sparse_allreduce(idx, vals, numel, algorithm=alg, stats=stats)
            assert out.dtype == vals.dtype and out.shape == (numel,)
            row[alg] = (out.float().numpy().tobytes(), out.view(-1).numpy().tobytes() if dname != "bfloat16"
                        else out.view(torch.int16).numpy().tobytes(), stats.as_dict())
        results.append(row)
    return results


def _dense_sum(numel, supports, frac=False):
    out = np.zeros(numel, dtype=np.float64)
    for r, s in enumerate(supports):
        out[np.array(s, dtype=np.int64)] += np.array(_values(s, r, frac), dtype=np.float64)
    return out.astype(np.float32)


def check(world, cases, algos=ALGOS):
    results = run(sparse_worker, world, cases, algos, timeout=120)
    for c, (numel, supports, dname, _, *frac) in enumerate(cases):
        frac = bool(frac and frac[0])
        expect = _dense_sum(numel, supports, frac)
        for alg in algos:
            got = np.frombuffer(results[0][c][alg][0], dtype=np.float32)
            if frac:  # rounding depends on the order of additions: close, and bitwise equal across ranks
                assert np.allclose(got, expect, rtol=1e-5, atol=1e-5), (world, alg, c, dname)
            else:
                assert np.array_equal(got, expect), (world, alg, c, dname)
            raw0 = results[0][c][alg][1]
            for r in range(1, world):  # bitwise identical on every rank
                assert results[r][c][alg][1] == raw0, (world, alg, c, r)
            stats = results[0][c][alg][2]
            if world == 1:
                assert stats["bytes_sent"] == 0 and stats["bytes_received"] == 0 and stats["messages"] == 0
            else:
                assert stats["bytes_sent"] > 0 and stats["last_algorithm"] in SPARSE_ALGORITHMS
            assert stats["calls"] == 1
        chosen = {results[r][c]["auto"][2]["last_algorithm"] for r in range(world)} if "auto" in algos else set()
        assert len(chosen) <= 1  # every rank chose the same algorithm
    return results


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_named_patterns_every_algorithm(world):
    numel = 37 if world % 2 else 64
    cases = [(numel, sup, "float32", "int64") for _, sup in named_patterns(world, numel, seed=world * 100 + numel)]
    # fractional values: the bits depend on the order of additions, so this checks that every
    # rank adds in the same order (identical / partial overlap, full support)
    cases += [(numel, named_patterns(world, numel, 11)[j][1], "float32", "int64", True) for j in (1, 2, 5)]
    rng = random.Random(world)  # very sparse in a large space: the owners' sort-based reduce
    cases.append((4096, [sorted(rng.sample(range(4096), 5)) + [4095] for _ in range(world)], "float32", "int32"))
    cases += [(40, named_patterns(world, 40, 7)[2][1], d, i)
              for d, i in (("float16", "int32"), ("bfloat16", "int64"), ("float64", "int32"))]
    check(world, cases)


@st.composite
def supports(draw, world):
    numel = draw(st.integers(1, 300))
    kind = draw(st.sampled_from(["random", "overlap", "clustered", "dense"]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = random.Random(seed)
    sup = []
    base = rng.sample(range(numel), rng.randint(0, numel))
    for _ in range(world):
        if kind == "random":
            s = rng.sample(range(numel), rng.randint(0, numel))
        elif kind == "overlap":
            s = set(rng.sample(base, rng.randint(0, len(base)))) | set(rng.sample(range(numel), rng.randint(0, 3)))
        elif kind == "clustered":
            lo = rng.randrange(numel)
            s = range(lo, min(numel, lo + rng.randint(0, 16)))
        else:
            s = [i for i in range(numel) if rng.random() < 0.9]
        sup.append(sorted(set(s)))
    return numel, sup


@pytest.mark.timeout(170)
@settings(max_examples=3)
@given(data=st.data())
def test_hypothesis_patterns(data):
    # patterns drawn in the parent, a batch of 6 per multi-process run
    world = data.draw(st.sampled_from([2, 3, 4]))
    cases = [(n, sup, "float32", "int64") for n, sup in (data.draw(supports(world)) for _ in range(6))]
    check(world, cases)


def test_world_one_without_process_group():
    idx = torch.tensor([3, 1])
    vals = torch.tensor([2.0, -1.0])
    stats = CommStats()
    out = sparse_allreduce(idx, vals, 5, algorithm="split", stats=stats)
    assert out.tolist() == [0.0, -1.0, 0.0, 2.0, 0.0]
    assert stats.bytes_sent == stats.bytes_received == stats.messages == 0


@pytest.mark.timeout(90)
def test_allgather_bytes_follow_the_documented_model():
    numel, sup = 64, [[1, 2, 3], [5], [], [7, 8]]
    res = run(sparse_worker, 4, [(numel, sup, "float32", "int32")], ("allgather", "dense"), timeout=60)
    from commpress.collectives.wire import header_len
    header = header_len(4) * 8 * 3  # int64 header all-gathered: n*(P-1)
    for r in range(4):
        ag = res[r][0]["allgather"][2]
        assert ag["bytes_sent"] == header + 3 * 8 * 3  # kmax=3 entries of 4+4 bytes to 3 peers
        assert ag["bytes_received"] == ag["bytes_sent"]
        dense = res[r][0]["dense"][2]
        assert dense["bytes_sent"] == header + (2 * 64 * 4 * 3) // 4  # ring all_reduce


def test_reduce_helpers_sum_in_input_order():
    from commpress.collectives.sparse import _reduce_dense, merge_sorted, reduce_by_index

    idx = torch.tensor([5, 1, 5, 9, 1, 5])
    vals = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    u, s = reduce_by_index(idx, vals)
    assert u.tolist() == [1, 5, 9] and s.tolist() == [7.0, 10.0, 4.0]
    u2, s2 = _reduce_dense(idx, vals, 10)
    assert u2.tolist() == [1, 5, 9] and s2.tolist() == [7.0, 10.0, 4.0]
    # fp16 sums are taken in fp32: 2048 + 1 + 1 is 2050 (fp16 would round 2049 down to 2048 twice)
    _, s3 = reduce_by_index(torch.tensor([0, 0, 0]), torch.tensor([2048.0, 1.0, 1.0], dtype=torch.float16))
    assert s3.dtype == torch.float32 and s3.tolist() == [2050.0]
    i, v = merge_sorted(torch.tensor([1, 4, 7]), torch.tensor([1.0, 2.0, 3.0]),
                        torch.tensor([0, 4, 8]), torch.tensor([10.0, 20.0, 30.0]))
    assert i.tolist() == [0, 1, 4, 7, 8] and v.tolist() == [10.0, 1.0, 22.0, 3.0, 30.0]
    i, v = merge_sorted(torch.tensor([], dtype=torch.int64), torch.tensor([]), torch.tensor([3]), torch.tensor([1.0]))
    assert i.tolist() == [3] and v.tolist() == [1.0]
