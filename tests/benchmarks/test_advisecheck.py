"""benchmarks.advisecheck's arithmetic (no namespaces, no processes): the per-round cost it hands
to advise, and the row it compares plain DDP with."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import advisecheck as ac  # noqa: E402
from commpress import advise as adv  # noqa: E402

COMPS = ["fp16", "blockquant(bits=8)", "powersgd(rank=4)"]


def test_round_cost_is_the_excess_per_round(monkeypatch):
    pred = {"ddp": 1.0, "fp16": 2.0, "blockquant(bits=8)": 3.0, "powersgd(rank=4)": 4.0}
    monkeypatch.setattr(ac, "predict", lambda *a, **k: dict(pred))
    measured = {"tiny:compute": 1.0, "tiny:fp16": 2.5, "tiny:blockquant(bits=8)": 5.0, "tiny:powersgd(rank=4)": 8.0}
    # flat, 2 ranks: 1 + 1 + 2 rounds, and PowerSGD's dense part (the bias) one of its own
    # (fp16 casts the bias with the rest, blockquant's messages carry it); excess 0.5 + 2 + 4
    assert ac.round_cost(measured, 2, "1gbit", 50.0, None, COMPS) == pytest.approx(6.5 / (1 + 1 + 3))
    # flat, 4 ranks: the quantized kind two-phase (2 rounds, the dense part in them)
    assert ac.round_cost(measured, 4, "1gbit", 50.0, None, COMPS) == pytest.approx(6.5 / (1 + 2 + 3))
    # 2 x 2: the inter-node call among 2 nodes, two intra-node rounds more each; the dense part
    # rides in no two-level call (a round of its own for blockquant and PowerSGD)
    assert ac.round_cost(measured, 4, "1gbit", 50.0, (2, 2), COMPS) == pytest.approx(6.5 / (3 + 4 + 5))
    # faster than predicted: no negative cost
    fast = {k: (v if k == "tiny:compute" else 0.0) for k, v in measured.items()}
    assert ac.round_cost(fast, 2, "1gbit", 50.0, None, COMPS) == 0.0


def test_predict_passes_the_new_terms_and_prices_the_flat_ring_on_2x2(monkeypatch):
    # the codec at a fixed 1 ns per element pass: two measurements of it differ by noise, and the
    # check below compares a row with its codec doubled (two ranks per core) against one without
    monkeypatch.setattr(adv, "measure_codec", lambda *a, **k: (1e-9, 1e-9))
    kw = dict(width=64, compute_ms=1.0, world=4, net="1gbit", latency_us=50.0, compressors=["fp16"])
    flat = ac.predict(topology=None, **kw)
    assert adv.FLAT_DDP not in flat
    two = ac.predict(topology=(2, 2), **kw)
    assert set(two) == {"ddp", adv.FLAT_DDP, "fp16"}
    # 4 ranks in one ring at the 1 Gbit/s link: the same as 4 ranks flat (every step crosses a link)
    assert two[adv.FLAT_DDP] == pytest.approx(flat["ddp"])
    paid = ac.predict(topology=None, round_ms=2.0, ranks_per_core=2.0, **kw)
    # one round of 2 ms more (fp16 all-reduces: one round) and the codec's time once more
    assert paid["ddp"] == flat["ddp"] and paid["fp16"] > flat["fp16"] + 2.0
