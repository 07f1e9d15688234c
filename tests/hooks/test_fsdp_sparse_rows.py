"""``commpress.fsdp.register(..., sparse_rows=...)`` on gloo ranks (issue 52 item 5): a unit whose
reduce-scatter input holds a row-sparse parameter (an ``nn.Embedding`` weight) sends only its
nonzero rows to the ranks that own them (:func:`commpress.collectives.rows.rows_reduce_scatter`)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import run

import commpress  # noqa: F401
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
    cs = CommStats()
    res = rows_reduce_scatter(x, capacity=capacity, stats=cs, key="t")
    again = rows_reduce_scatter(x, capacity=capacity, key="t")
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
    if capacity == 40 and world == 2:
        b = row_scatter_bytes(world, world * L, d, torch.float32, capacity)
        assert out[0][5] >= b["scatter"]              # + the header round of the first call


# ------------------------------------------------------------------ FSDP2
class EmbNet(nn.Module):
    """An embedding (301 x 8) and a Linear head; ``fully_shard`` each, then the root."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM)
        self.fc = nn.Linear(DIM, 16)

    def forward(self, ids):
        return self.fc(self.emb(ids)).sum(1)


def _shard(world: int, seed: int = 0) -> nn.Module:
    import os

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ["COMMPRESS_BACKEND"] = "torch"
    torch.manual_seed(seed)
    model = EmbNet()
    mesh = init_device_mesh("cpu", (world,))
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


def _fsdp_matches(rank, world, compressor, sparse_rows, kind, steps):
    ref = _shard(world)
    plain = _train(ref, rank, steps, kind)
    model = _shard(world)
    args = {} if compressor is None else {}
    state = commpress.fsdp.register(model, compressor or "identity", sparse_rows=(
        [model.emb.weight] if sparse_rows == "declared" else sparse_rows), **args)
    rows = _train(model, rank, steps, kind)
    d = state.stats.as_dict()
    return ([torch.equal(a, b) for a, b in zip(plain, rows)],
            [torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(plain, rows)],
            d["sparse_rows"], {k: v for k, v in d.items() if k in ("bytes_sent", "dense_bytes")},
            rows)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_identity_with_rows_equals_plain_fsdp2(world):
    out = run(_fsdp_matches, world, None, "declared", "sparse", 4)
    for bitwise, close, report, totals, _ in out:
        assert all(close)
        if world == 2:
            assert all(bitwise)
        assert report["emb.weight"]["path"] == "rows" and report["emb.weight"]["rows_calls"] == 4
        assert report["emb.weight"]["density"] < 0.1
        assert totals["bytes_sent"] < totals["dense_bytes"]
