"""Decoding straight into ``out`` (issue 17) gives bitwise the sum the copying path gives.

``allreduce(t, c, out=t)`` now scatters (topk) or decodes with accumulation
(blockquant) into ``t`` itself; ``allreduce(t, c)`` decodes into a fresh buffer.
Both must agree bit for bit, with and without error feedback, and report the
rounds and codec passes in :class:`CommStats`.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run

import commpress
from commpress.collectives import CommStats, allreduce


def _direct_worker(rank, world):
    g = torch.Generator().manual_seed(10 + rank)
    out = {}
    cases = [("topk", {"ratio": 0.05}, "auto"), ("blockquant", {"bits": 4}, "gather_all"),
             ("blockquant", {"bits": 4}, "two_phase")]
    for name, params, algorithm in cases:
        for ef in (False, True):
            x = torch.randn(3000, generator=g)
            a = commpress.get(name, **params)
            b = commpress.get(name, **params)
            if ef:
                a, b = commpress.ErrorFeedback(a), commpress.ErrorFeedback(b)
            for step in range(2):  # the second step uses the residuals
                t = x.clone()
                stats = CommStats()
                got = allreduce(t, a, out=t, step=step, algorithm=algorithm, stats=stats, validate=False)
                want = allreduce(x.clone(), b, step=step, algorithm=algorithm, validate=False)
                same = got.data_ptr() == t.data_ptr() and torch.equal(got.view(torch.int32),
                                                                      want.view(torch.int32))
                out[(name, algorithm, ef, step)] = (same, stats.rounds, sorted(stats.codec_seconds))
    return out


def test_decode_into_out_is_bitwise_the_copying_path():
    for rank_out in run(_direct_worker, 2, timeout=120):
        for case, (same, rounds, passes) in rank_out.items():
            assert same, case
            assert rounds == (2 if case[1] == "two_phase" else 1), (case, rounds)
            assert passes == ["compress", "decompress"], (case, passes)


def test_cast_message_pieces_are_the_flat_message_cut_per_shard():
    # the reduce_scatter message: each shard cast (and scaled) exactly as the flat message
    # would hold it, followed by its own status slots
    from commpress.collectives import cast_message

    x = torch.randn(12, dtype=torch.float32) * 100
    flat = cast_message(x, torch.float16, 0.25, slots=2)
    pieces = cast_message(x, torch.float16, 0.25, slots=2, pieces=3)
    assert flat.shape == (14,) and pieces.shape == (18,)
    assert torch.equal(pieces.view(3, 6)[:, :4].reshape(-1), flat[:12])
    assert torch.equal(flat[:12], (x * 0.25).to(torch.float16))
    with pytest.raises(ValueError, match="pieces"):
        cast_message(x, torch.float16, pieces=5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_scaled_cast_in_slices_has_the_bits_of_one_call(dtype, monkeypatch):
    # a large host cast runs in slices (no whole-input fp32 temporary); the bits must be the
    # single call's, including the last short slice, NaN/inf, overflow and the reduce_scatter rows
    from commpress.collectives import cast_message, wire

    monkeypatch.setattr(wire, "CAST_SLICE", 7)
    x = torch.randn(2 * 3 * 25, dtype=torch.float32) * 1e4
    x[3], x[40], x[99] = float("nan"), float("inf"), 1e6
    want = torch.mul(x, 0.5).to(dtype)
    flat = cast_message(x, dtype, 0.5, slots=2)
    assert torch.equal(flat[:x.numel()].view(torch.int16), want.view(torch.int16))
    pieces = cast_message(x, dtype, 0.5, slots=2, pieces=3).view(3, 52)[:, :50].reshape(-1)
    assert torch.equal(pieces.view(torch.int16), want.view(torch.int16))
    # scaled in place first (a DDP bucket): the same bits, for a scale that rounds too
    for scale in (0.5, 1 / 3):
        want = torch.mul(x, scale).to(dtype)
        y = x.clone()
        got = cast_message(y, dtype, scale, slots=2, scale_in_place=True)
        assert torch.equal(got[:x.numel()].view(torch.int16), want.view(torch.int16)), scale
        torch.testing.assert_close(y, torch.mul(x, scale), rtol=0, atol=0, equal_nan=True)  # it was scaled
