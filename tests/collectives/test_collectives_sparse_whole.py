"""A sparsifier with error feedback whose selection would be the larger message (a density warm-up's
early stages, large ratios) sends the whole compensated tensor block-quantized to 4 bits instead
(``sparse.whole_choice``, ``sparse._whole_quantized``): one all_gather, every rank's message decoded
and summed in rank order, the residual keeping the quantization error, nothing lost.

The expectations are computed here from the public compressors: ``blockquant(bits=4)`` of each
rank's compensated tensor, decoded and added in rank order in fp32.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run

import commpress
from commpress.collectives import CommStats, allreduce
from commpress.collectives.sparse import WHOLE_CODEC, whole_choice

N = 5000  # not a multiple of the block: a short last block


def data(rank: int, step: int, n: int = N) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * step + rank))


def _topk(ratio: float, **kw):
    return commpress.get("topk", ratio=ratio, density_warmup=0, **kw)


@pytest.mark.parametrize("ratio, world, expected", [
    (0.25, 2, "blockquant"), (0.085, 2, "blockquant"), (0.029, 2, "selection"), (0.01, 2, "selection"),
    (0.25, 4, "blockquant"), (0.25, 8, "bf16"), (0.01, 8, "selection"),
    (1.0, 2, "blockquant"),
])
def test_the_smallest_message_is_chosen(ratio, world, expected):
    x = torch.zeros(1 << 20)
    assert whole_choice(x, _topk(ratio), 0, world) == expected


def test_reduce_scatter_chunks_go_whole_where_the_selection_is_no_smaller():
    from commpress.collectives.sparse import whole_per_chunk
    assert [whole_per_chunk(_topk(r), 100_000, 0, torch.float32) for r in (0.25, 0.085, 0.06, 0.01)] == \
        [True, True, False, False]
    assert not whole_per_chunk(_topk(0.25), 0, 0, torch.float32)


def test_the_choice_follows_the_density_warm_up():
    """topk 1% from 25% over 300 steps: 25% and 8.5% send the whole tensor in 4 bits, 2.9% and 1% select."""
    c = commpress.get("topk", ratio=0.01, density_warmup=300, density_start=0.25)
    x = torch.zeros(1 << 20)
    assert [whole_choice(x, c, s, 2) for s in (0, 99, 100, 199, 200, 299, 300)] == \
        ["blockquant"] * 4 + ["selection"] * 3


def _expected(compensated: list[torch.Tensor]) -> torch.Tensor:
    acc = torch.zeros(compensated[0].numel())
    for c in compensated:  # rank order
        acc += WHOLE_CODEC.decompress(WHOLE_CODEC.compress_fixed(c)).float()
    return acc


def whole_worker(rank, world):
    out = {}
    ef = commpress.ErrorFeedback(_topk(0.25))
    residuals = [torch.zeros(N) for _ in range(world)]  # every rank's, replayed here
    for step in range(3):
        stats = CommStats()
        got = allreduce(data(rank, step), ef, key="w", step=step, stats=stats)
        comp = [data(r, step) + residuals[r] for r in range(world)]
        expect = _expected(comp)
        residuals = [c - WHOLE_CODEC.decompress(WHOLE_CODEC.compress_fixed(c)).float() for c in comp]
        out[step] = dict(equal=torch.equal(got, expect), residual=torch.equal(ef.residual("w"), residuals[rank]),
                         algorithm=stats.last_algorithm, rounds=stats.rounds, sent=stats.bytes_sent,
                         result=got)
    # with momentum correction and factor masking every coordinate counts as sent: velocity zeroed
    for masking in (True, False):
        m = commpress.ErrorFeedback(_topk(0.25), momentum=0.9, masking=masking)
        allreduce(data(rank, 0), m, key="m")
        out[f"velocity_zero:{masking}"] = bool((m._velocity["m"] == 0).all())
    # the same call out of place and in place (out= the input, as the DDP hook calls it)
    a, b = commpress.ErrorFeedback(_topk(0.25)), commpress.ErrorFeedback(_topk(0.25))
    x = data(rank, 5)
    ref = allreduce(x.clone(), a, key="io")
    buf = x.clone()
    got = allreduce(buf, b, key="io", out=buf)
    out["in_place"] = torch.equal(ref, got) and got.data_ptr() == buf.data_ptr()
    # a bf16 input: decoded and summed in fp32, returned in bf16
    h = commpress.ErrorFeedback(_topk(0.25))
    got = allreduce(data(rank, 0).bfloat16(), h, key="h")
    out["bf16"] = (got.dtype, torch.equal(got, _expected([data(r, 0).bfloat16().float() for r in range(world)])
                                          .bfloat16()))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_whole_tensor_in_four_bits_summed_in_rank_order_nothing_lost(world):
    res = run(whole_worker, world, timeout=110)
    message = 8 + (N + 1) // 2 + 8 * 0 + 4 * -(-N // 256)  # status, codes (8-aligned below), scales
    for rank in range(world):
        got = res[rank]
        for step in range(3):
            r = got[step]
            assert r["equal"] and r["residual"], (rank, step)
            assert r["algorithm"] == "whole_blockquant", r
            if step:  # after the first call's check of the arguments: one round, the message's bytes
                assert r["rounds"] == 1, r
                assert message <= r["sent"] / (world - 1) <= message + 16, (r["sent"], message)
            assert torch.equal(r["result"], res[0][step]["result"])  # bitwise on every rank
        assert got["velocity_zero:True"] is True and got["velocity_zero:False"] is False, got
        assert got["in_place"]
        assert got["bf16"] == (torch.bfloat16, True), got["bf16"]


def reduce_scatter_worker(rank, world):
    """FSDP2's path: each chunk's selection would be no smaller than the chunk in 4 bits, so
    every chunk goes whole to its owner, which decodes the P pieces and adds them in rank order."""
    from commpress.collectives import reduce_scatter

    n = 2000 * world
    per = n // world
    ef = commpress.ErrorFeedback(_topk(0.25))
    residuals = [torch.zeros(n) for _ in range(world)]
    out = []
    for step in range(2):
        got = reduce_scatter(data(rank, step, n), ef, key="rs", step=step)
        comp = [data(r, step, n) + residuals[r] for r in range(world)]
        chunks = [[c[q * per:(q + 1) * per] for q in range(world)] for c in comp]
        expect = _expected([chunks[r][rank] for r in range(world)])
        residuals = [torch.cat([ch - WHOLE_CODEC.decompress(WHOLE_CODEC.compress_fixed(ch)).float() for ch in cs])
                     for cs in chunks]
        kept = torch.cat([ef.residual(("rs", q)) for q in range(world)])
        out.append((torch.equal(got, expect), torch.equal(kept, residuals[rank])))
    # 6%: the selection is the smaller payload, sent as before
    small = commpress.ErrorFeedback(_topk(0.06))
    got = reduce_scatter(data(rank, 0, n), small, key="sel")
    out.append((int((got != 0).sum()) <= world * round(0.06 * per), True))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_sends_chunks_whole_when_the_selection_is_no_smaller(world):
    res = run(reduce_scatter_worker, world, timeout=110)
    for rank in range(world):
        assert all(a and b for a, b in res[rank]), (rank, res[rank])
