"""``collectives.all_gather`` with the fixed-capacity sparsifiers (topk, dgc, threshold) beside a
quantizer: one all_gather of ``[status | capacity slots of (indices, values)]`` per rank, and row
``r`` is bitwise rank ``r``'s own ``decompress(compress_fixed(x_r))``, with and without error
feedback (whose residual keeps what the row did not carry), on 1 to 3 ranks.

The expectations are computed here, on every rank, from fresh compressors of the same
configuration fed each rank's data (the sparsifiers are deterministic; the error-feedback
references replay each rank's steps).
"""

from __future__ import annotations

import pytest
import torch

from distributed import run

import commpress
from commpress.collectives import CommStats, all_gather

N = 3001   # not a multiple of 8: the values' slot is padded to 8 bytes
STEPS = 3


def _data(rank: int, step: int) -> torch.Tensor:
    x = torch.randn(N, generator=torch.Generator().manual_seed(100 * step + rank))
    x[::7] *= 10.0   # a heavy tail, so dgc's and threshold's counts vary with the data
    return x


CONFIGS = {
    "topk": lambda: commpress.get("topk", ratio=0.1),
    "dgc": lambda: commpress.get("dgc", ratio=0.1),
    "threshold": lambda: commpress.get("threshold", threshold=2.0, max_ratio=0.1),
    "blockquant": lambda: commpress.get("blockquant", bits=4),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _gather_rows(rank: int, world: int) -> dict:
    ok, widths = {}, {}
    for name, make in CONFIGS.items():
        for ef in (False, True):
            mine = commpress.ErrorFeedback(make()) if ef else make()
            refs = [commpress.ErrorFeedback(make()) if ef else make() for _ in range(world)]
            good = True
            for step in range(STEPS):
                stats = CommStats()
                rows = all_gather(_data(rank, step), mine, key=(name, ef), step=step, stats=stats)
                for r in range(world):
                    want = refs[r].decompress(refs[r].compress_fixed(_data(r, step), step=step, key=(name, ef)))
                    good &= rows.shape == (world, N) and torch.equal(_bits(rows[r]), _bits(want))
                if ef:   # committed: the residual is what this rank's own row left out
                    good &= torch.equal(_bits(mine.residual((name, ef))), _bits(refs[rank].residual((name, ef))))
                if world > 1 and step > 0:   # step 0 also agreed on the static facts (one header exchange)
                    good &= stats.rounds == 1
                    widths[name] = stats.bytes_sent // (world - 1)
            ok[(name, ef)] = good
    return {"ok": ok, "widths": widths}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_all_gather_rows_are_each_ranks_own_decode(world):
    results = run(_gather_rows, world, timeout=110)
    for res in results:
        assert all(res["ok"].values()), res["ok"]
    if world > 1:   # capacity slots: 8 status bytes, int32 indices and fp32 values, each 8-aligned
        k = commpress.get("topk", ratio=0.1).capacity(N)
        width = 8 + 2 * (-(-4 * k // 8) * 8)
        assert all(res["widths"]["topk"] == width for res in results)


def test_all_gather_refuses_what_has_no_fixed_size():
    with pytest.raises(TypeError, match="fixed-size"):
        all_gather(torch.zeros(16), commpress.get("powersgd"))
