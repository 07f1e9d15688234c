"""``commpress.fsdp.register(..., sparse_rows=...)`` on gloo ranks (issue 52 item 5): a unit whose
reduce-scatter input holds a row-sparse parameter (an ``nn.Embedding`` weight) sends only its
nonzero rows to the ranks that own them (:func:`commpress.collectives.rows.rows_reduce_scatter`)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import run

import commpress
from commpress.collectives.accounting import CommStats
from commpress.collectives.rows import row_scatter_bytes, rows_reduce_scatter

ROWS, DIM = 301, 8      # 301: FSDP2 pads the shards at P = 2 and 3


# ------------------------------------------------------------------ the collective
def _chunks(rank: int, world: int, L: int, d: int, touched: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.zeros(world * L, d)
    rows = torch.randperm(world * L, generator=g)[:touched]
    x[rows] = torch.randn(touched, d, generator=g)
    return x.view(world, L, d)


def _scatter_matches_dense(rank, world, L, d, touched, capacity):
    x = _chunks(rank, world, L, d, touched, 7)
    dense = torch.empty(L, d)
    dist.reduce_scatter_single(dense, x.reshape(world * L, d).clone())
    res = rows_reduce_scatter(x, capacity=capacity, key="t")
    cs = CommStats()   # the second call: no header round, the message alone
    again = rows_reduce_scatter(x, capacity=capacity, stats=cs, key="t")
    return (torch.equal(res.sum, dense), torch.allclose(res.sum, dense, rtol=1e-6, atol=1e-6),
            torch.equal(res.sum, again.sum), res.overflow_rounds, res.counts, cs.bytes_sent,
            max(max(r) for r in res.owner_counts))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world,capacity", [(2, 40), (2, 0), (2, 3), (3, 20), (3, 2)])
def test_rows_reduce_scatter_equals_dense(world, capacity):
    L, d, touched = 50, 8, 30
    out = run(_scatter_matches_dense, world, L, d, touched, capacity)
    for bitwise, close, deterministic, overflow, counts, sent, per_owner in out:
        assert close and deterministic
        if world == 2:
            assert bitwise            # a + b in either order: the same bits
        assert counts == [touched] * world
        assert overflow == int(per_owner > capacity)   # rows beyond the capacity: one more round, none lost
    if capacity == 40:
        b = row_scatter_bytes(world, world * L, d, torch.float32, capacity)
        assert out[0][5] == b["scatter"] < b["dense"]


def _scatter_bad(rank, world, which):
    from commpress.collectives.wire import CollectiveInputError

    x = _chunks(rank, world, 10, 4, 5, 3)
    args = {"capacity": 4 + rank} if which == "capacity" else {"capacity": 4}
    if which == "shape" and rank == 1:
        x = x[:, :9]
    try:
        rows_reduce_scatter(x, key=which, **args)
    except CollectiveInputError as e:
        return str(e)
    return None


@pytest.mark.timeout(90)
@pytest.mark.parametrize("which,says", [("capacity", "capacity differs"), ("shape", "rows differs")])
def test_rows_reduce_scatter_mismatch_raises_on_every_rank(which, says):
    for msg in run(_scatter_bad, 2, which):
        assert msg is not None and says in msg


# ------------------------------------------------------------------ FSDP2
class EmbNet(nn.Module):
    """An embedding (301 x 8) and a Linear head; ``fully_shard`` each, then the root."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM)
        self.fc = nn.Linear(DIM, 16)

    def forward(self, ids):
        return self.fc(self.emb(ids)).sum(1)


def _shard(world: int, seed: int = 0, split: bool = True) -> nn.Module:
    """``split``: the embedding and the head their own units (else one unit, the root, holds both)."""
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ["COMMPRESS_BACKEND"] = "torch"
    torch.manual_seed(seed)
    model = EmbNet()
    mesh = init_device_mesh("cpu", (world,))
    if split:
        fully_shard(model.emb, mesh=mesh)
        fully_shard(model.fc, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _ids(rank: int, step: int, kind: str = "sparse") -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    if kind == "all":
        return torch.arange(ROWS).reshape(-1, 7)
    return torch.randint(0, ROWS, (4, 5), generator=g)


def _train(model, rank: int, steps: int, kind: str = "sparse") -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        model(_ids(rank, s, kind)).pow(2).mean().backward()
        opt.step()
    return [p.to_local().detach().clone() for p in model.parameters()]


def _fsdp_matches(rank, world, compressor, sparse_rows, kind, steps, split=True):
    ref = _shard(world, split=split)
    plain = _train(ref, rank, steps, kind)
    model = _shard(world, split=split)
    state = commpress.fsdp.register(model, compressor or "identity", sparse_rows=(
        [model.emb.weight] if sparse_rows == "declared" else sparse_rows))
    rows = _train(model, rank, steps, kind)
    d = state.stats.as_dict()
    return ([torch.equal(a, b) for a, b in zip(plain, rows)],
            [torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(plain, rows)],
            d["sparse_rows"], {k: v for k, v in d.items() if k in ("bytes_sent", "dense_bytes")},
            rows)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,split", [(2, True), (2, False), (3, True)])
def test_identity_with_rows_equals_plain_fsdp2(world, split):
    # split=False: the root unit holds the embedding and the head; the head goes by FSDP2's own
    # reduce_scatter, cut out of the unit's input, the embedding's rows by the all_to_all
    out = run(_fsdp_matches, world, None, "declared", "sparse", 4, split)
    for bitwise, close, report, totals, params in out:
        assert all(close)
        if world == 2:
            assert all(bitwise)   # a + b: the summation order of the dense reduce_scatter
        assert report["emb.weight"]["path"] == "rows" and report["emb.weight"]["rows_calls"] == 4
        assert report["emb.weight"]["density"] < 0.1 and report["emb.weight"]["overflow_rounds"] >= 1
        assert totals["bytes_sent"] < totals["dense_bytes"]
    assert all(torch.equal(a, b) for a, b in zip(out[0][4], _twice(world, split)))   # deterministic


def _again(rank, world, split):
    model = _shard(world, split=split)
    commpress.fsdp.register(model, "identity", sparse_rows=["emb.weight"])
    return _train(model, rank, 4)


def _twice(world, split):
    return run(_again, world, split)[0]


@pytest.mark.timeout(120)
def test_dense_gradient_goes_dense():
    # every row touched: the first call (declared: rows, capacity 0, exact) finds the rows' message
    # no cheaper than the dense reduce_scatter; from then on the embedding goes dense
    for bitwise, close, report, _, _ in run(_fsdp_matches, 2, None, "declared", "all", 3):
        assert all(bitwise)
        assert report["emb.weight"]["path"] == "dense" and report["emb.weight"]["rows_calls"] == 1
        assert report["emb.weight"]["density"] == 1.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["sparse", "all"])
def test_auto_finds_the_sparse_embedding(kind):
    # "auto": every 2-D parameter measured in the first 2 steps; the sparse embedding is kept as
    # rows, the head's weight (every row nonzero) is no longer tracked
    for bitwise, close, report, _, _ in run(_fsdp_matches, 2, None, "auto", kind, 5):
        assert all(bitwise)
        if kind == "sparse":
            assert list(report) == ["emb.weight"] and report["emb.weight"]["path"] == "rows"
            assert report["emb.weight"]["rows_calls"] == 3    # steps 2, 3 and 4
        else:
            assert report == {}


def _compressed_rest(rank, world, compressor, params, kind):
    out = []
    for split in (False, True):
        model = _shard(world, split=split)
        state = commpress.fsdp.register(model, compressor, sparse_rows=[model.emb.weight], **params)
        out.append((_train(model, rank, 4, kind), state.stats.as_dict()))
    (one, d_one), (two, _) = out
    return [torch.equal(a, b) for a, b in zip(one, two)], d_one["sparse_rows"], d_one["algorithms"]


@pytest.mark.timeout(120)
# fp32 residuals: the default int8 store's rounding noise is seeded by each residual's key, which
# differs between one unit and two
@pytest.mark.parametrize("compressor,params,kind", [("topk", {"ratio": 0.25, "residual_storage": "fp32"}, "sparse"),
                                                    ("topk", {"ratio": 0.25, "residual_storage": "fp32"}, "all"),
                                                    ("bf16", {}, "sparse")])
def test_rest_of_the_unit_goes_as_configured(compressor, params, kind):
    # one unit holding the embedding and the head sends the head exactly as the head's own unit
    # would (the compressor, its error feedback): the same parameters bit for bit, while the
    # embedding goes as rows (or, every row touched, by an exact reduce_scatter beside it)
    for same, report, algorithms in run(_compressed_rest, 2, compressor, params, kind):
        assert all(same)
        assert report["emb.weight"]["path"] == ("rows" if kind == "sparse" else "dense")
        assert algorithms[""].startswith(compressor)     # the root unit's rest: the compressor's path


def _bad(rank, world, which):
    model = _shard(world)
    entry = {"tensor": torch.zeros(ROWS, DIM), "1-D": model.fc.bias, "name": "emb.nope",
             "string": "all"}[which]
    try:
        commpress.fsdp.register(model, "identity", sparse_rows=entry if which == "string" else [entry])
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("which,named", [("tensor", "is not a parameter of the model"), ("1-D", "'fc.bias'"),
                                         ("name", "'emb.nope'"), ("string", "'all'")])
def test_bad_sparse_rows_raise_on_every_rank(which, named):
    for msg in run(_bad, 2, which):
        assert msg is not None and named in msg and "sparse_rows" in msg


def _refused(rank, world, what):
    model = _shard(world)
    kw = {"auto": ("auto", {}), "replicas": ("topk", {"ratio": 0.25, "replicate_group": dist.group.WORLD})}[what]
    try:
        commpress.fsdp.register(model, kw[0], sparse_rows=["emb.weight"], **kw[1])
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["auto", "replicas"])
def test_not_yet_supported_combinations_are_refused(what):
    for msg in run(_refused, 2, what):
        assert msg is not None and "sparse_rows is not supported" in msg


def _resume(rank, world, sparse_rows):
    import io

    def build():
        model = _shard(world, split=False)
        state = commpress.fsdp.register(model, "topk", ratio=0.25, sparse_rows=sparse_rows)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.5)

    def steps(model, opt, lo, hi):
        for s in range(lo, hi):
            opt.zero_grad(set_to_none=True)
            model(_ids(rank, s)).pow(2).mean().backward()
            opt.step()

    model, state, opt = build()
    steps(model, opt, 0, 5)
    straight = [p.to_local().detach().clone() for p in model.parameters()]
    model, state, opt = build()
    steps(model, opt, 0, 3)
    buf = io.BytesIO()
    torch.save({"hook": state.state_dict(), "params": [p.to_local().detach().clone() for p in model.parameters()]},
               buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model, state, opt = build()
    with torch.no_grad():
        for p, q in zip(model.parameters(), saved["params"]):
            p.to_local().copy_(q)
    state.load_state_dict(saved["hook"])
    before = state.stats.sparse_rows_report()
    steps(model, opt, 3, 5)
    resumed = [p.to_local().detach().clone() for p in model.parameters()]
    return [torch.equal(a, b) for a, b in zip(straight, resumed)], before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sparse_rows", [["emb.weight"], "auto"])
def test_resume_from_state_dict(sparse_rows):
    # the plan (paths, capacities, what "auto" settled) and the residuals come back: a resumed run
    # is the uninterrupted one bit for bit
    for same, plan in run(_resume, 2, sparse_rows):
        assert all(same)
        assert list(plan) == ["emb.weight"] and plan["emb.weight"]["capacity"] > 0

def _mixed(rank, world, reduce_dtype):
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ["COMMPRESS_BACKEND"] = "torch"
    grads = []
    for rows in (False, True):
        torch.manual_seed(0)
        model = EmbNet()
        mesh = init_device_mesh("cpu", (world,))
        mp = MixedPrecisionPolicy(param_dtype=reduce_dtype, reduce_dtype=reduce_dtype)
        fully_shard(model.emb, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        state = commpress.fsdp.register(model, "identity", sparse_rows=["emb.weight"]) if rows else None
        for s in range(2):
            model.zero_grad(set_to_none=True)
            model(_ids(rank, s)).float().pow(2).mean().backward()
        grads.append([p.grad.full_tensor() for p in model.parameters()])
    plain, rows = grads
    return ([torch.allclose(a, b, rtol=1e-2, atol=1e-5) for a, b in zip(plain, rows)],
            state.stats.as_dict()["sparse_rows"]["emb.weight"]["rows_calls"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reduce_dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_rows(reduce_dtype):
    # bf16: FSDP2 averages (AVG); fp16: it divides before and after a SUM; the rows follow either
    # (summed in fp32, rounded once)
    for close, calls in run(_mixed, 2, reduce_dtype):
        assert all(close) and calls == 2

def _nan_row(rank, world):
    grads = []
    for rows in (False, True):
        model = _shard(world)
        if rows:
            commpress.fsdp.register(model, "identity", sparse_rows=["emb.weight"])
        ids = _ids(rank, 0)
        emb = model.emb(ids)
        if rank == 1:   # a NaN in the gradient of the row of ids[0, 0], on one rank only
            emb.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])),
                                                    torch.full((DIM,), float("nan"))))
        model.fc(emb).sum(1).pow(2).mean().backward()
        grads.append(model.emb.weight.grad.full_tensor())
    plain, got = grads
    bad = int(_ids(1, 0)[0, 0])
    finite = torch.isfinite(plain).all(1)
    return (bool(torch.isnan(got[bad]).all()), torch.equal(finite, torch.isfinite(got).all(1)),
            torch.equal(plain[finite], got[finite]))


@pytest.mark.timeout(120)
def test_nan_row_propagates():
    # a NaN/inf row is a nonzero row: sent, summed, NaN in the owner's shard as in plain FSDP2
    for nan_there, same_mask, same_rest in run(_nan_row, 2):
        assert nan_there and same_mask and same_rest

def _momentum(rank, world, split, kind):
    out = []
    for rows in (False, True):
        model = _shard(world, split=split)
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        if rows:   # the momentum taken over: the rows parameter's on its shard, the rest's in error feedback
            # fp32 storage: the velocities exact (a lean storage keeps them rounded, as the residuals)
            state = commpress.fsdp.register(model, "identity", optimizer=opt, sparse_rows=["emb.weight"],
                                            residual_storage="fp32")
        for s in range(4):
            opt.zero_grad(set_to_none=True)
            model(_ids(rank, s, kind)).pow(2).mean().backward()
            opt.step()
        out.append([p.to_local().detach().clone() for p in model.parameters()])
    plain, taken = out
    return ([torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(plain, taken)],
            state.stats.as_dict()["sparse_rows"]["emb.weight"]["path"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("split,kind", [(True, "sparse"), (False, "sparse"), (False, "all")])
def test_momentum_taken_over(split, kind):
    # optimizer= (SGD's momentum taken over): the rows parameter, on its rows or its dense path,
    # gets plain momentum on its shard; the parameters match plain FSDP2 with SGD's own momentum
    for close, path in run(_momentum, 2, split, kind):
        assert all(close)
        assert path == ("rows" if kind == "sparse" else "dense")

# ------------------------------------------------------------------ bytes (docs/results/sparse_rows.md)
BIG_ROWS, BIG_DIM, IDS = 20000, 32, 512


def _bytes(rank, world, steps):
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ["COMMPRESS_BACKEND"] = "torch"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(BIG_ROWS, BIG_DIM), nn.Linear(BIG_DIM, 16))
    mesh = init_device_mesh("cpu", (world,))
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = commpress.fsdp.register(model, "identity", sparse_rows=[model[0].weight])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shard = -(-BIG_ROWS // world)
    for s in range(steps):
        g = torch.Generator().manual_seed(1000 * s + rank)
        ids = torch.randint(0, BIG_ROWS, (IDS,), generator=g)
        opt.zero_grad(set_to_none=True)
        model(ids).pow(2).mean().backward()
        opt.step()
    # what this rank's last step had to send at least: its touched rows owned by another rank
    owners = torch.unique(ids) // shard
    ideal = int((owners != rank).sum()) * (4 * BIG_DIM + 4)
    d = state.stats.as_dict()
    last = d["last_step"]["units"]["0/sparse_rows"]
    return last["bytes_sent"], last["dense_bytes"], ideal, d["sparse_rows"]["0.weight"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_bytes_against_dense(world):
    # an embedding of 20000 x 32 (640k parameters), 512 ids per rank and step (about 2.5% of the
    # rows): the rows' all_to_all against FSDP2's dense reduce_scatter of the unit, last step
    for sent, dense, ideal, plan in run(_bytes, world, 6):
        print(f"P={world}: rows {sent} B, dense reduce_scatter {dense} B ({dense / sent:.1f}x), "
              f"touched rows owned elsewhere + indices {ideal} B ({sent / ideal:.2f}x), "
              f"capacity {plan['owner_capacity']}, overflow rounds {plan['overflow_rounds']}")
        assert plan["path"] == "rows"
        assert sent < dense / 10
        assert sent < 1.5 * ideal


# ------------------------------------------------------------------ the plan (no ranks)
def test_scatter_plan_by_reduce_scatter_bytes():
    from commpress.hooks.sparse_rows import SparseRows, scatter_cheaper

    # an owner's rows against its shard of the dense reduce_scatter (P = 2: 5000 rows, 2500 a shard)
    assert scatter_cheaper(2, 5000, 16, torch.float32, 1000)
    assert not scatter_cheaper(2, 5000, 16, torch.float32, 2500)
    assert not scatter_cheaper(2, 5000, 16, torch.float32, 1000, margin=0.3)
    with pytest.raises(ValueError, match="collective"):
        SparseRows(nn.Linear(4, 4), ["weight"], collective="all_to_all")
    plan = SparseRows(nn.Embedding(ROWS, DIM), ["weight"], collective="reduce_scatter")
    assert plan.config()["collective"] == "reduce_scatter" and plan.path("weight") == "rows"
    assert "collective" not in SparseRows(nn.Embedding(ROWS, DIM), ["weight"]).config()   # DDP's as it was
