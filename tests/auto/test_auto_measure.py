"""Measurement helpers of ``"auto"``: codec cost, overlap, norm change, agreement across ranks."""

from __future__ import annotations

import pytest

from distributed import run

from commpress.auto import (BucketMeasure, Candidate, Network, OverlapRecorder, agree_measurements,
                            codec_cost, decide, norm_change, overlap)
from commpress.auto.measure import clear_codec_cache
from commpress.collectives import CostModel


def test_overlap_takes_hook_time_out():
    # backward 0..10 s; hooks fire at 2 (busy 1), 6 (busy 1), 9.5 (busy 0.5); backward ends at 10
    # backward compute alone: 7.5 s; arrivals net of earlier hooks' time: 2, 5, 7.5
    assert overlap(0.0, [2.0, 6.0, 9.5], [1.0, 1.0, 0.5], 10.0) == pytest.approx([5.5, 2.5, 0.0])
    assert overlap(1.0, [], [], 3.0) == []
    with pytest.raises(ValueError, match="busy"):
        overlap(0.0, [1.0], [], 2.0)


def test_overlap_recorder_averages_steps():
    rec = OverlapRecorder()
    for shift in (0.0, 100.0):
        rec.begin(shift)
        rec.arrive("a", shift + 2.0)
        rec.leave("a", shift + 3.0)
        rec.arrive("b", shift + 7.0)
        rec.leave("b", shift + 7.0)
        # backward compute 8 - 1 s (hook a's time out); b arrives at 7 - 1 = 6 of it
        assert rec.finish(shift + 8.0) == pytest.approx([5.0, 1.0])
    assert rec.order() == ["a", "b"]
    assert rec.mean_hidden() == pytest.approx({"a": 5.0, "b": 1.0})
    with pytest.raises(RuntimeError, match="begin"):
        rec.finish(1.0)


def test_norm_change():
    assert norm_change([1.0, 2.0, 0.0, 0.0], [1.5, 2.0, 0.0, 3.0]) == pytest.approx([0.5, 0.0, 0.0, 1.0])
    assert norm_change([float("nan")], [1.0]) == [1.0]
    assert norm_change([None, 1.0], [1.0, None]) == [0.0, 0.0]    # a window without a norm: no change


def test_codec_cost_cached_per_size(monkeypatch):
    monkeypatch.setenv("COMMPRESS_BACKEND", "torch")
    clear_codec_cache()
    for c in (Candidate("bf16"), Candidate("blockquant", 4), Candidate("topk", 0.01)):
        t = codec_cost(c, 4096)
        assert t > 0 and codec_cost(c, 4096) == t      # second call: the cached number
    assert codec_cost(Candidate("dense"), 4096) == 0.0
    assert codec_cost(Candidate("powersgd", 1), 4096 + 8, shapes=((64, 64), (8,))) > 0
    assert codec_cost(Candidate("powersgd", 1), 8, shapes=((8,),)) == 0.0   # nothing compressed
    with pytest.raises(ValueError, match="numel"):
        codec_cost(Candidate("bf16"), -1)


def test_codec_cost_runs_the_candidate_under_error_feedback(monkeypatch):
    """auto runs every choice through ErrorFeedback: its cost is measured that way (with a
    residual in place), unless asked for the plain compressor."""
    from commpress.feedback import ErrorFeedback

    monkeypatch.setenv("COMMPRESS_BACKEND", "torch")
    clear_codec_cache()
    calls = []
    real = ErrorFeedback.compress_fixed

    def spy(self, tensor, **kw):
        calls.append(self._live(kw["key"], tensor) is not None)
        return real(self, tensor, **kw)

    monkeypatch.setattr(ErrorFeedback, "compress_fixed", spy)
    codec_cost(Candidate("blockquant", 4), 4096, reps=2)
    assert calls == [False, True, True]      # the warm-up leaves the residual the timed runs add
    calls.clear()
    codec_cost(Candidate("blockquant", 4), 4096, reps=2, feedback=False)
    assert calls == []


def _agree_and_decide(rank, world):
    import os
    os.environ["COMMPRESS_BACKEND"] = "torch"
    c8, c4 = Candidate("blockquant", 8), Candidate("blockquant", 4)
    # rank-dependent local numbers; rank 1 did not measure 4-bit for bucket 1
    local = (BucketMeasure("b0", 1 << 16, (), 0.01 * (rank + 1), {c8: 1e-3 * (rank + 1), c4: 2e-3}, 0.1 * rank),
             BucketMeasure("b1", 1 << 16, (), 0.0, {c8: 1e-3} if rank else {c8: 1e-3, c4: 5e-4}, 0.0))
    net = Network(world, CostModel(alpha=1e-4, beta=8e-8))
    m = agree_measurements(net, local, 0.02 * (rank + 1), (c8, c4))
    d = decide(m, candidates=(Candidate("dense"), c8, c4))
    bad = None
    other = (local[0], BucketMeasure("b1", (1 << 16) + rank, (), 0.0, {c8: 1e-3}))
    try:
        agree_measurements(net, other, 0.02, (c8, c4))
    except ValueError as exc:
        bad = str(exc)
    return m, d, bad


def test_agreement_makes_every_rank_decide_alike():
    (m0, d0, bad0), (m1, d1, bad1) = run(_agree_and_decide, 2)
    assert m0 == m1 and d0 == d1                 # bitwise the same inputs and plan on both ranks
    b0, b1 = m0.buckets
    assert b0.hidden_s == 0.01                    # min over ranks
    assert b0.codec_s[Candidate("blockquant", 8)] == 2e-3   # max over ranks
    assert b0.norm_change == 0.1 and m0.compute_s == 0.04
    assert Candidate("blockquant", 4) not in b1.codec_s      # unmeasured on rank 1: left out
    assert bad0 and bad0 == bad1 and "elements" in bad0      # a size mismatch raises on every rank


def test_a_sparsifier_is_measured_as_it_runs_after_its_warm_up(monkeypatch):
    """topk 1%: its selection at the final density (not the warm-up's 25%); topk 10%, whose
    selection would be no smaller than the tensor in 4 bits: the whole tensor in 4 bits, as the
    collectives send it under error feedback."""
    import commpress
    from commpress.auto.measure import STEADY_STEP
    from commpress.collectives.sparse import WHOLE_CODEC

    calls = []
    fixed, whole = commpress.ErrorFeedback.compress_fixed, commpress.ErrorFeedback.compress_whole

    def spy_fixed(self, x, **kw):
        calls.append(("selection", kw.get("step"), self.compressor.capacity(x.numel(), kw.get("step"))))
        return fixed(self, x, **kw)

    def spy_whole(self, x, codec, **kw):
        calls.append(("whole", kw.get("step"), codec is WHOLE_CODEC))
        return whole(self, x, codec, **kw)

    monkeypatch.setattr(commpress.ErrorFeedback, "compress_fixed", spy_fixed)
    monkeypatch.setattr(commpress.ErrorFeedback, "compress_whole", spy_whole)
    clear_codec_cache()
    codec_cost(Candidate("topk", 0.01), 10_000, reps=1)
    assert calls and set(calls) == {("selection", STEADY_STEP, 100)}
    calls.clear()
    codec_cost(Candidate("topk", 0.1), 10_000, reps=1)
    assert calls and set(calls) == {("whole", STEADY_STEP, True)}
    clear_codec_cache()


def test_codec_cost_on_a_sample_scales_elementwise_codecs_and_shares_the_measurement(monkeypatch):
    """``sample``: an elementwise codec on a larger unit is timed on ``sample`` elements, scaled by
    the ratio (one measurement for every unit beyond it); powersgd is timed on its own matrices."""
    monkeypatch.setenv("COMMPRESS_BACKEND", "torch")
    clear_codec_cache()
    c = Candidate("blockquant", 4)
    small = codec_cost(c, 4096)
    assert codec_cost(c, 3 * 4096, sample=4096) == pytest.approx(3 * small)
    assert codec_cost(c, 5 * 4096, sample=4096) == pytest.approx(5 * small)   # the same measurement
    assert codec_cost(c, 2048, sample=4096) == codec_cost(c, 2048)             # below the sample: itself
    shapes = ((128, 128),)
    assert codec_cost(Candidate("powersgd", 1), 128 * 128, shapes=shapes, sample=4096) == \
        codec_cost(Candidate("powersgd", 1), 128 * 128, shapes=shapes)


def test_codec_cost_shares_a_probe_per_size_and_never_writes_it(monkeypatch):
    """``probes=``: the candidates timed on one size read one random input, drawn once; no codec
    writes it (each would otherwise time the next one on another's leftovers)."""
    import torch

    from commpress.auto import measure

    monkeypatch.setattr(measure, "_CODEC", {})
    drawn = []
    real = torch.randn
    monkeypatch.setattr(measure.torch, "randn", lambda *a, **k: drawn.append(a) or real(*a, **k))
    probes = {}
    for c in (Candidate("bf16"), Candidate("blockquant", 4), Candidate("blockquant", 8), Candidate("topk", 0.1)):
        assert codec_cost(c, 4096, probes=probes) > 0
    assert len(drawn) == 1 and list(probes) == [(4096, "cpu", torch.float32)]
    want = real(4096, generator=torch.Generator().manual_seed(4096))
    assert torch.equal(probes[(4096, "cpu", torch.float32)], want)
