"""A unit whose parameters lie between its bucket's dense ones (an MLP's weights between its
biases) is packed in place (ddp_step.packing) instead of copied into a scratch: the same input,
the same results, bitwise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commpress
from commpress.hooks import ddp_step
from commpress.hooks.ddp_step import Unit, packing, unit_input

from distributed import run


def _unit(pieces) -> Unit:
    return Unit(key="u", names=[str(i) for i in range(len(pieces))], sizes=[n for _, _, n in pieces],
                shapes=[(n,) for _, _, n in pieces])


def test_packing_moves_the_small_runs_next_to_the_largest():
    buf = torch.arange(100.0)
    pieces = [(buf, 2, 6), (buf, 10, 70), (buf, 80, 4), (buf, 84, 3), (buf, 95, 5)]
    start, moves = packing(pieces)
    # the run [10, 87) stays; 6 move right to end at 10, the last 5 left to start at 87
    assert start == 4 and moves == [(2, 4, 6), (95, 87, 5)]
    want = torch.cat([buf[o:o + n].clone() for _, o, n in pieces])
    t, store = unit_input(_unit(pieces), pieces, packable=True)
    assert torch.equal(t, want) and t.data_ptr() == buf[4:].data_ptr()   # a view, no scratch
    store(-want)   # the result goes back where each piece was
    for (_, o, n), got in zip(pieces, torch.split(-want, [n for _, _, n in pieces])):
        assert torch.equal(buf[o:o + n], got)


@pytest.mark.parametrize("pieces", [
    [(0, 0, 10), (1, 20, 10)],                     # two buffers
    [(0, 50, 10), (0, 0, 10)],                     # not in increasing order
])
def test_packing_declines(pieces):
    bufs = [torch.zeros(100), torch.zeros(100)]
    pieces = [(bufs[b], o, n) for b, o, n in pieces]
    assert packing(pieces) is None
    t, store = unit_input(_unit(pieces), pieces, packable=True)   # the scratch copy then
    assert t.data_ptr() not in (bufs[0].data_ptr(), bufs[1].data_ptr()) and store is not None


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Linear(96, 8))


def _train(rank: int, world: int, name: str, kw: dict, pack: bool) -> dict:
    """Five steps with packing allowed or refused; the parameters, whether the replicas agree and
    how many calls packed.  One model per launch (the two variants run in separate processes)."""
    torch.set_num_threads(1)
    calls = []

    def spy(pieces, real=ddp_step.packing):
        calls.append(real(pieces))
        return calls[-1] if pack else None

    model = DDP(_net())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ddp_step, "packing", spy)
        with commpress.ddp.register(model, name, min_numel=256, **kw):
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            for step in range(5):
                g = torch.Generator().manual_seed(100 * step + rank)
                x, y = torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(rows, flat)
    return {"flat": flat, "replicas": all(torch.equal(rows[0], r) for r in rows),
            "packed_calls": sum(c is not None for c in calls)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,kw", [("blockquant", {"bits": 4}), ("topk", {"ratio": 0.05}),
                                     ("powersgd", {"rank": 2})])
def test_packed_units_train_bitwise_as_copied_ones(name, kw):
    packed = run(_train, 2, name, kw, True, timeout=50)
    copied = run(_train, 2, name, kw, False, timeout=50)
    for a, b in zip(packed, copied):
        assert a["replicas"] and b["replicas"] and a["packed_calls"] >= 3 and b["packed_calls"] >= 3, (a, b)
        assert torch.equal(a["flat"].view(torch.int32), b["flat"].view(torch.int32))


def test_packing_moves_overlapping_runs_in_place():
    """Runs that overlap their destination (a weight shifted past a small bias) move in place (a
    memmove on the CPU), however much of the unit moves; and back, bitwise."""
    buf = torch.arange(100, dtype=torch.float32)
    before = buf.clone()
    pieces = [(buf, 0, 30), (buf, 33, 40), (buf, 75, 25)]   # gaps of 3 and 2 (a bias each)
    start, moves = packing(pieces)
    assert start == 3 and moves == [(0, 3, 30), (75, 73, 25)]   # 55 of 95 elements move
    want = torch.cat([before[o:o + n] for _, o, n in pieces])
    t, store = unit_input(_unit(pieces), pieces, packable=True)
    assert torch.equal(t, want) and t.data_ptr() == buf[3:].data_ptr()   # a view, no scratch
    store(t * 2)
    for _, o, n in pieces:
        assert torch.equal(buf[o:o + n], 2 * before[o:o + n])
