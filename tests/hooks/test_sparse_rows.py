"""``SparseRows``, the plan of the row-sparse path: validation of ``sparse_rows=`` (a tensor that
is not a parameter, a 1-D parameter, ``nn.Embedding(sparse=True)`` named and refused), the
capacity ladder, the path and capacities from what the rows calls saw, and on 2-3 gloo ranks a
short run of embedding gradients through :func:`rows_allreduce` under the plan: ``"auto"`` finds
the embedding, every rank takes the same path with the same capacities, sums equal the dense
all_reduce, overflow rounds are counted, a parameter whose rows stop being sparse goes dense and
comes back at a re-check.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import run

from commpress.collectives import RowsResult, rows_allreduce
from commpress.hooks.sparse_rows import SparseRows, capacity_ladder, check_no_sparse_embeddings, rows_cheaper


class Net(nn.Module):
    def __init__(self, rows: int = 400, dim: int = 8, sparse: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(rows, dim, sparse=sparse)
        self.fc = nn.Linear(dim, 3)


def test_sparse_rows_validation_names_the_bad_tensor():
    net = Net()
    with pytest.raises(ValueError, match=r"sparse_rows\[1\] \(a tensor of shape \(400, 8\)\) is not a parameter"):
        SparseRows(net, [net.emb.weight, torch.zeros(400, 8)])
    with pytest.raises(ValueError, match=r"'fc.bias' has shape \(3,\)"):
        SparseRows(net, [net.emb.weight, net.fc.bias])
    with pytest.raises(ValueError, match="'nope' is not a parameter name"):
        SparseRows(net, ["nope"])
    with pytest.raises(ValueError, match="'auto' or None"):
        SparseRows(net, "all")
    with pytest.raises(TypeError, match="list of parameters"):
        SparseRows(net, net.emb.weight)
    net.fc.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="'fc.weight' has no gradient"):
        SparseRows(net, ["fc.weight"])
    assert list(SparseRows(net, "auto").plans) == ["emb.weight"]   # 2-D and requiring grad
    plan = SparseRows(net, ["emb.weight"])
    assert plan.path(net.emb.weight) == "rows" and plan.capacities("emb.weight")["capacity"] == 0
    assert net.emb.weight in plan and net.fc.bias not in plan and len(SparseRows(net, None)) == 0


def test_sparse_embedding_is_refused_with_what_to_do():
    for module in (Net(sparse=True), nn.Sequential(nn.EmbeddingBag(10, 4, sparse=True))):
        with pytest.raises(ValueError, match=r"sparse=True.*sparse=False.*sparse_rows="):
            check_no_sparse_embeddings(module)
        with pytest.raises(ValueError, match="sparse=False"):
            SparseRows(module, "auto")
    check_no_sparse_embeddings(Net())


def test_capacity_ladder_holds_the_rows_with_little_room():
    sizes = [capacity_ladder(x) for x in range(0, 5000)]
    assert sizes[0] == 0 and sizes[1] == 1
    for x, c in enumerate(sizes):
        assert c >= x and (x < 2 or c <= x * 1.095 + 1), (x, c)
    assert sizes == sorted(sizes) and len(set(sizes)) < 120   # few distinct sizes: few header exchanges
    assert capacity_ladder(10.5) >= 11


def _result(counts, owner_counts, union, algorithm="allgather", overflow=0, owner_unions=()):
    return RowsResult(torch.zeros(1, 1), algorithm, list(counts), [list(r) for r in owner_counts],
                      torch.tensor(union), overflow, list(owner_unions))


def test_plan_follows_the_counts_it_is_given():
    net = Net(rows=1000, dim=16)
    plan = SparseRows(net, [net.emb.weight], window=2, headroom=0.1)
    plan.begin_step()
    plan.record("emb.weight", _result([40, 50], [[20, 20], [30, 20]], 80))
    caps = plan.capacities("emb.weight")
    assert caps["capacity"] == capacity_ladder(55) and caps["owner_capacity"] == capacity_ladder(33)
    assert caps["union_capacity"] == capacity_ladder(60 * 1.1)   # no union read yet: 2 owners' 30 each
    plan.end_step()
    plan.begin_step()   # the union (80) read a step later: 40 per owner, 50 with the skew
    assert plan.as_dict()["emb.weight"]["union_density"] == 0.08
    assert plan.capacities("emb.weight")["union_capacity"] == capacity_ladder(50 * 1.1)
    plan.record("emb.weight", _result([10, 12], [[5, 5], [6, 6]], 20, "hashed", 1, [11, 10]))
    plan.record("emb.weight", _result([10, 12], [[5, 5], [6, 6]], 20, "hashed", 0, [11, 10]))
    d = plan.as_dict()["emb.weight"]
    assert d["capacity"] == capacity_ladder(12 * 1.1) and d["overflow_rounds"] == 1 and d["rows_calls"] == 3
    assert d["union_capacity"] == capacity_ladder(11 * 1.1) and d["algorithm"] == "hashed" and d["path"] == "rows"
    assert d["density"] == 0.012
    plan.record("emb.weight", _result([900, 950], [[450, 450], [475, 475]], 999))   # no longer sparse
    assert plan.path("emb.weight") == "dense"
    state = plan.state_dict()
    torch.save(state, buf := __import__("io").BytesIO())
    other = SparseRows(net, [net.emb.weight], window=2)
    buf.seek(0)
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert other.as_dict()["emb.weight"]["capacity"] == plan.as_dict()["emb.weight"]["capacity"]
    assert other.path("emb.weight") == "dense"
    with pytest.raises(ValueError, match="tracks"):
        SparseRows(net, "auto").load_state_dict({"plans": {}})


def test_rows_cheaper_at_low_density_only():
    for world in (2, 3, 4):
        assert rows_cheaper(world, 100_000, 64, torch.float32, 2000, 1000, 1000)
        assert not rows_cheaper(world, 100_000, 64, torch.float32, 100_000, 100_000, 100_000)


ROWS, DIM = 300, 4


def _batch(rank: int, step: int, dense: bool) -> torch.Tensor:
    """Token ids of rank ``rank`` at ``step``: a few shared rows and some of its own; all rows when ``dense``."""
    if dense:
        return torch.arange(ROWS)
    g = torch.Generator().manual_seed(10 * step + rank)
    n = 6 + 4 * (step % 3)   # the count varies: capacities from the window, overflow when it grows
    return torch.cat([torch.arange(3), torch.randint(0, ROWS, (n,), generator=g)])


def _train(rank: int, world: int) -> list:
    torch.manual_seed(0)
    net = Net(ROWS, DIM)
    plan = SparseRows(net, "auto", warmup=1, recheck_every=4, window=3)
    log = []
    for step in range(10):
        dense = step in (5, 6)   # every row touched: the embedding stops being sparse
        net.zero_grad()
        net.fc(net.emb(_batch(rank, step, dense))).sum().backward()
        plan.begin_step()
        entry = {"step": step}
        for name, p in plan.items():
            entry[name] = plan.path(name)
            want = p.grad.clone()
            dist.all_reduce(want)
            if plan.path(name) == "rows":
                caps = plan.capacities(name)
                res = rows_allreduce(p.grad, key=name, **caps)
                plan.record(name, res)
                entry["caps"] = caps
                entry["sum_ok"] = torch.allclose(res.sum, want, rtol=1e-6, atol=1e-6)
                entry["sum"] = res.sum
            else:
                plan.observe(name, p.grad)
        plan.end_step()
        log.append(entry)
    log.append(plan.as_dict())
    return log


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 3])
def test_auto_plan_on_ranks_rows_then_dense_then_rows(world):
    results = run(_train, world, timeout=80)
    logs = results[0]
    for other in results[1:]:   # every rank: the same paths, capacities and sums
        for a, b in zip(logs[:-1], other[:-1]):
            assert a["emb.weight"] == b["emb.weight"] and a.get("caps") == b.get("caps")
            if "sum" in a:
                assert torch.equal(a["sum"], b["sum"])
        assert logs[-1] == other[-1]
    paths = [e["emb.weight"] for e in logs[:-1]]
    # step 0 measured (dense), rows from step 1; dense rows at step 5 -> dense from 6; the
    # re-check at step 8 finds them sparse again -> rows from step 9
    assert paths == ["dense"] + ["rows"] * 5 + ["dense"] * 3 + ["rows"], paths
    assert all(e["sum_ok"] for e in logs[:-1] if "sum_ok" in e)
    final = logs[-1]["emb.weight"]
    assert final["path"] == "rows" and final["rows_calls"] == 6 and 0 < final["density"] < 0.2
    assert final["overflow_rounds"] >= 1   # the rows grew past the capacity at least once, nothing lost
