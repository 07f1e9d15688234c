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
