"""commpress.advise: the prediction of whether compression pays (pure arithmetic, no processes
except one subprocess for ``python -m commpress.advise``)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from commpress import advise as adv

NS = 2.0   # a fixed codec cost: no timing in the tests but one small measurement


def run(**kw):
    base = dict(params=25_000_000, compute_ms=100.0, world=8, bandwidth="1gbit", codec_ns_per_element=NS)
    base.update(kw)
    return adv.advise(**base)


def rows(result):
    return {r["compressor"]: r for r in result["rows"]}


def test_json_shape_and_row_names():
    res = run(compressors=["blockquant(bits=4)", "topk(ratio=0.01)", "powersgd(rank=4)", "fp16", "bf16"])
    json.loads(json.dumps(res))
    names = [r["compressor"] for r in res["rows"]]
    assert names == ["ddp", "blockquant(bits=4)", "topk(ratio=0.01)", "powersgd(rank=4)", "fp16", "bf16"]
    for r in res["rows"]:
        assert {"compressor", "step_ms", "bytes", "comm_ms", "codec_ms", "speedup", "pays"} <= set(r)
        assert r["step_ms"] > 0 and r["bytes"] > 0
    assert res["codec"].startswith("given")
    # fp16 sends half of DDP's bytes; blockquant 4-bit about an eighth (plus its scales)
    r = rows(res)
    assert r["fp16"]["bytes"] == pytest.approx(r["ddp"]["bytes"] / 2, rel=1e-3)
    assert r["ddp"]["bytes"] / 9 < r["blockquant(bits=4)"]["bytes"] < r["ddp"]["bytes"] / 6


@pytest.mark.parametrize("world,bw,lat_us,overlap", [(8, "1gbit", None, 0.0), (3, "10gbit", 20.0, 0.0),
                                                     (16, "100mbit", 5.0, 0.4), (2, "2.5gbit", 0.0, 1.0)])
def test_ddp_row_is_compute_plus_ring_alpha_beta(world, bw, lat_us, overlap):
    N, C = 25_000_000, 100.0
    res = run(params=N, compute_ms=C, world=world, bandwidth=bw, latency_us=lat_us, overlap=overlap)
    bits = {"1gbit": 1e9, "10gbit": 1e10, "100mbit": 1e8, "2.5gbit": 2.5e9}[bw]
    alpha = (adv.DEFAULT_LATENCY_US if lat_us is None else lat_us) * 1e-6
    P = world
    comm = alpha * 2 * (P - 1) + (2 * 4 * N * (P - 1) / P) * 8 / bits   # ring all_reduce of 4N bytes
    ddp = rows(res)["ddp"]
    one_byte_ms = 1e3 * 8 / bits   # accounting counts whole bytes (floor of 2n(P-1)/P)
    assert ddp["step_ms"] == pytest.approx(C + 1e3 * max(0.0, comm - overlap * C / 1e3), rel=0, abs=one_byte_ms)
    assert ddp["bytes"] == pytest.approx(2 * 4 * N * (P - 1) / P, abs=1)
    assert res["bound"] == pytest.approx(ddp["step_ms"] / C, rel=1e-9)


def test_slower_link_makes_compression_pay_more():
    fast = rows(run(bandwidth="10gbit", compressors=["blockquant(bits=4)"]))["blockquant(bits=4)"]
    slow = rows(run(bandwidth="1gbit", compressors=["blockquant(bits=4)"]))["blockquant(bits=4)"]
    assert slow["speedup"] > fast["speedup"]
    assert slow["pays"]


@pytest.mark.parametrize("kw", [dict(), dict(bandwidth="100mbit"), dict(bandwidth="400gbit", world=2),
                                dict(overlap=0.7), dict(codec_ns_per_element=0.0),
                                dict(gpus_per_node=4, intra_bandwidth="400gbit", world=16),
                                dict(gpus_per_node=8, intra_bandwidth="2400gbit"), dict(world=1)])
def test_no_row_beats_the_bound(kw):
    res = run(**kw)
    ddp = rows(res)["ddp"]
    c = res["comm_fraction"]
    assert 0.0 <= c < 1.0
    assert res["bound"] == pytest.approx(1.0 / (1.0 - c))
    for r in res["rows"]:
        assert r["speedup"] == pytest.approx(ddp["step_ms"] / r["step_ms"])
        assert r["speedup"] <= res["bound"] * (1 + 1e-12)
        assert r["pays"] == (r["speedup"] > 1.0)


def test_two_level_formula_for_ddp():
    N, P, G = 10_000_000, 16, 4
    res = run(params=N, world=P, gpus_per_node=G, intra_bandwidth="400gbit", intra_latency_us=2.0,
              bandwidth="10gbit", latency_us=20.0, compressors=["fp16"])
    s, M = -(-N // G), P // G
    intra = 2 * (2e-6 * (G - 1) + 4 * s * (G - 1) * 8 / 400e9)   # reduce-scatter + all-gather
    inter = 20e-6 * 2 * (M - 1) + 2 * 4 * s * (M - 1) / M * 8 / 10e9
    ddp = rows(res)["ddp"]
    assert ddp["comm_ms"] == pytest.approx(1e3 * (intra + inter), rel=1e-6)
    assert ddp["inter_node_bytes"] == pytest.approx(2 * 4 * s * (M - 1) / M, abs=1)
    assert rows(res)["fp16"]["inter_node_bytes"] == pytest.approx(ddp["inter_node_bytes"] / 2, rel=1e-3)
    assert res["inputs"]["path"] == "two_level"


def test_profile_and_override():
    a = adv.advise(25e6, 100, 8, profile="10gbit-ethernet", codec_ns_per_element=NS, compressors=["bf16"])
    b = run(bandwidth="10gbit", latency_us=adv.PROFILES["10gbit-ethernet"]["latency_us"], compressors=["bf16"])
    assert rows(a)["ddp"]["step_ms"] == pytest.approx(rows(b)["ddp"]["step_ms"])
    c = adv.advise(25e6, 100, 8, "1gbit", profile="10gbit-ethernet", codec_ns_per_element=NS, compressors=["bf16"])
    assert rows(c)["ddp"]["step_ms"] > rows(a)["ddp"]["step_ms"]   # --bandwidth overrides the profile's


def test_powersgd_uses_the_listed_shapes():
    small = rows(run(compressors=["powersgd(rank=4)"], matrix_side=256))["powersgd(rank=4)"]
    big = rows(run(compressors=["powersgd(rank=4)"], matrix_side=4096))["powersgd(rank=4)"]
    assert big["bytes"] < small["bytes"]   # rank r sends 2r/side of a square matrix
    listed = rows(run(compressors=["powersgd(rank=4)"], tensors="5000x5000"))["powersgd(rank=4)"]
    assert listed["bytes"] < rows(run(compressors=["powersgd(rank=4)"]))["powersgd(rank=4)"]["bytes"]


def test_measured_codec_is_said_so():
    res = adv.advise(1e6, 10, 4, "1gbit", compressors=["fp16"], device="cpu", probe_elements=1 << 14, reps=1)
    assert res["codec"].startswith("measured on cpu")
    assert rows(res)["fp16"]["codec_ms"] > 0


@pytest.mark.parametrize("kw,arg", [
    (dict(bandwidth="25gbps"), "--bandwidth"), (dict(bandwidth="1 gbit"), "--bandwidth"),
    (dict(bandwidth="0gbit"), "--bandwidth"), (dict(bandwidth=1e9), "--bandwidth"),
    (dict(bandwidth=None), "--profile"), (dict(profile="wifi"), "--profile"),
    (dict(world=0), "--world"), (dict(world=2.5), "--world"), (dict(params=0), "--params"),
    (dict(compute_ms=0), "--compute-ms"), (dict(compute_ms=float("nan")), "--compute-ms"),
    (dict(overlap=1.5), "--overlap"), (dict(overlap=-0.1), "--overlap"), (dict(latency_us=-1), "--latency-us"),
    (dict(gpus_per_node=3), "--gpus-per-node"), (dict(gpus_per_node=4), "--intra-bandwidth"),
    (dict(gpus_per_node=4, intra_bandwidth="fast"), "--intra-bandwidth"),
    (dict(compressors=["nope"]), "--compressors"), (dict(compressors=["topk(ratio=2)"]), "--compressors"),
    (dict(compressors=["blockquant(bits=4"]), "--compressors"), (dict(compressors=[]), "--compressors"),
    (dict(tensors="4096by4096"), "--tensors"), (dict(tensors="10000x10000"), "--tensors"),
    (dict(codec_ns_per_element=-1), "--codec-ns-per-element"), (dict(matrix_side=0), "--matrix-side"),
])
def test_bad_arguments_name_the_argument(kw, arg):
    with pytest.raises(ValueError, match=arg):
        run(**kw)


def test_cli_bad_argument_exits_naming_it(capsys):
    with pytest.raises(SystemExit) as e:
        adv.main(["--params", "25e6", "--compute-ms", "100", "--world", "8", "--bandwidth", "25gbps"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--bandwidth" in err and "gbit" in err


def test_cli_table(capsys):
    assert adv.main(["--params", "25e6", "--compute-ms", "100", "--world", "8", "--bandwidth", "1gbit",
                     "--codec-ns-per-element", "2", "--compressors", "blockquant(bits=4)", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "1 / (1 - c)" in out and "blockquant(bits=4)" in out and "verdict" in out


def test_module_runs_as_main_and_prints_json():
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "commpress.advise", "--params", "25e6", "--compute-ms", "100",
                           "--world", "8", "--bandwidth", "1gbit", "--codec-ns-per-element", "2",
                           "--compressors", "blockquant(bits=4)", "topk(ratio=0.01)", "--json"],
                          cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [r["compressor"] for r in out["rows"]] == ["ddp", "blockquant(bits=4)", "topk(ratio=0.01)"]
    assert all(math.isfinite(r["step_ms"]) and r["bytes"] > 0 for r in out["rows"])


# ---------------------------------------------------------------- the terms of "auto"'s model (issue 53)
SPECS = ["fp16", "blockquant(bits=8)", "topk(ratio=0.01)", "powersgd(rank=4)"]


@pytest.mark.parametrize("world,kw,rounds,dense", [
    # the dense part (1-D tensors) rides in the gather kinds' messages and, at P=2, the sparse
    # kinds'; fp16 casts it with the rest; elsewhere an all-reduce of its own: one round more
    (2, {}, {"fp16": 1, "blockquant(bits=8)": 1, "topk(ratio=0.01)": 1, "powersgd(rank=4)": 2},
     {"powersgd(rank=4)"}),
    (8, {}, {"fp16": 1, "blockquant(bits=8)": 2, "topk(ratio=0.01)": 1, "powersgd(rank=4)": 2},
     {"topk(ratio=0.01)", "powersgd(rank=4)"}),
    # two levels: the inter-node call among 4 nodes, and two intra-node rounds more
    (8, dict(gpus_per_node=2, intra_bandwidth="20gbit"),
     {"fp16": 3, "blockquant(bits=8)": 4, "topk(ratio=0.01)": 3, "powersgd(rank=4)": 4},
     {"blockquant(bits=8)", "topk(ratio=0.01)", "powersgd(rank=4)"}),
    # two nodes: the quantized inter-node call is one all_gather
    (4, dict(gpus_per_node=2, intra_bandwidth="20gbit"),
     {"fp16": 3, "blockquant(bits=8)": 3, "topk(ratio=0.01)": 3, "powersgd(rank=4)": 4},
     {"blockquant(bits=8)", "topk(ratio=0.01)", "powersgd(rank=4)"}),
])
def test_round_cost_is_charged_per_round_of_the_kind(world, kw, rounds, dense):
    for dense_params, extra in ((0, set()), (None, dense), (10_000, dense)):
        base = rows(run(world=world, compressors=SPECS, dense_params=dense_params, **kw))
        paid = rows(run(world=world, compressors=SPECS, round_ms=1.5, dense_params=dense_params, **kw))
        assert paid["ddp"]["step_ms"] == base["ddp"]["step_ms"] and paid["ddp"]["round_ms"] == 0.0
        for name, n in rounds.items():
            n += name in extra
            assert paid[name]["round_ms"] == pytest.approx(1.5 * n)
            assert paid[name]["step_ms"] == pytest.approx(base[name]["step_ms"] + 1.5 * n)
            assert base[name]["round_ms"] == 0.0


def test_the_dense_part_costs_its_messages_where_it_goes_alone():
    """A dense all-reduce of its own: 2(P-1) messages more (the inter-node link's on two levels),
    its bytes; where it rides: its bytes only; none (0): neither."""
    lat = 1000.0   # 1 ms per message, bandwidth immaterial at these sizes
    for world, kw, alone, rides in ((8, {}, "topk(ratio=0.01)", "blockquant(bits=8)"),
                                    (4, dict(gpus_per_node=2, intra_bandwidth="400gbit"), "blockquant(bits=8)", "fp16")):
        none = rows(run(world=world, latency_us=lat, compressors=[alone, rides], dense_params=0, **kw))
        some = rows(run(world=world, latency_us=lat, compressors=[alone, rides], dense_params=None, **kw))
        assert some[alone]["comm_ms"] == pytest.approx(none[alone]["comm_ms"] + 2 * (world - 1) * lat / 1e3, rel=1e-3)
        assert some[rides]["comm_ms"] == pytest.approx(none[rides]["comm_ms"])
        big = rows(run(world=world, latency_us=lat, compressors=[alone], dense_params=1_000_000, **kw))
        assert big[alone]["bytes"] > some[alone]["bytes"]
    # a cast sends its 1-D tensors with the rest: nothing taken out of its elements, nothing added
    cast = [rows(run(world=8, compressors=["fp16"], dense_params=d))["fp16"] for d in (0, 1_000_000)]
    assert cast[1]["bytes"] == cast[0]["bytes"] and cast[1]["step_ms"] == cast[0]["step_ms"]
    assert adv.dense_rounds(adv.parse_compressor("fp16")[1], 8, True) == 0
    assert adv.dense_rounds(adv.parse_compressor("powersgd(rank=2)")[1], 2) == 1
    assert adv.dense_rounds(adv.parse_compressor("topk(ratio=0.01)")[1], 1) == 0


def test_round_cost_is_autos_call_seconds():
    """advise's round term is what "auto" adds to a candidate's codec seconds (one model)."""
    from commpress.auto.candidates import Candidate, Choice, prototype
    from commpress.auto.decide import BucketMeasure, Network, codec_seconds, kind_rounds
    from commpress.auto.runtime import _rounds
    from commpress.collectives.costmodel import CostModel

    for world in (2, 3, 8):
        for cand in (Candidate("bf16"), Candidate("blockquant", 4), Candidate("topk", 0.01), Candidate("powersgd", 4)):
            assert _rounds(cand, world) == kind_rounds(prototype(cand).aggregation, world)
    cand = Candidate("blockquant", 8)
    r = 2e-3
    b = BucketMeasure("b", 1 << 20, codec_s={cand: 0.0}, call_s={cand: r * kind_rounds("gather", 8)}, round_s=r)
    net = Network(8, CostModel(0, 0), local_size=2, intra=CostModel(0, 0), inter=CostModel(0, 0))
    advised = rows(run(world=8, gpus_per_node=2, intra_bandwidth="20gbit", codec_ns_per_element=0.0,
                       compressors=["blockquant(bits=8)"], round_ms=1e3 * r, dense_params=0))["blockquant(bits=8)"]
    # auto: the flat round count, the two-level path two more; advise: the inter call among 4 nodes (two-phase too)
    assert 1e3 * codec_seconds(Choice(cand, "two_level"), b, net) == pytest.approx(advised["round_ms"])
    with pytest.raises(ValueError, match="kind"):
        kind_rounds("dense", 4)


def test_ranks_per_core_scales_the_codec_only():
    one = rows(run(world=4, compressors=SPECS, round_ms=1.0))
    two = rows(run(world=4, compressors=SPECS, round_ms=1.0, ranks_per_core=2))
    assert two["ddp"] == one["ddp"]
    for name in SPECS:
        assert two[name]["codec_ms"] == pytest.approx(2 * one[name]["codec_ms"])
        assert two[name]["round_ms"] == one[name]["round_ms"] and two[name]["comm_ms"] == one[name]["comm_ms"]
        assert two[name]["step_ms"] == pytest.approx(one[name]["step_ms"] + one[name]["codec_ms"])
    assert run(world=4, ranks_per_core=1.5)["inputs"]["ranks_per_core"] == 1.5


def test_flat_ddp_row_is_one_ring_over_the_inter_node_link():
    N, P, G = 10_000_000, 8, 2
    kw = dict(params=N, world=P, gpus_per_node=G, intra_bandwidth="400gbit", bandwidth="10gbit", latency_us=20.0,
              compressors=["fp16"])
    plain = run(**kw)
    res = run(flat_ddp=True, **kw)
    assert [r["compressor"] for r in res["rows"]] == ["ddp", adv.FLAT_DDP, "fp16"]
    assert [r["compressor"] for r in plain["rows"]] == ["ddp", "fp16"]
    flat = rows(res)[adv.FLAT_DDP]
    comm = 20e-6 * 2 * (P - 1) + 2 * 4 * N * (P - 1) / P * 8 / 10e9
    assert flat["comm_ms"] == pytest.approx(1e3 * comm, rel=1e-6)
    assert flat["step_ms"] == pytest.approx(100.0 + 1e3 * comm, rel=1e-6)
    assert flat["bytes"] == pytest.approx(2 * 4 * N * (P - 1) / P, abs=1)
    assert flat["speedup"] == pytest.approx(rows(res)["ddp"]["step_ms"] / flat["step_ms"])
    # the other rows, the bound and the verdict do not change with it
    assert res["bound"] == plain["bound"] and res["best"] == plain["best"]
    assert rows(res)["fp16"] == rows(plain)["fp16"]
    # one node, or one rank per node: no two levels, no extra row
    assert [r["compressor"] for r in run(flat_ddp=True, compressors=["fp16"])["rows"]] == ["ddp", "fp16"]


def test_flat_ddp_never_wins_the_verdict():
    res = run(world=8, gpus_per_node=2, intra_bandwidth="400gbit", bandwidth="100gbit", flat_ddp=True,
              compressors=["powersgd(rank=4)"], codec_ns_per_element=1e4)
    assert res["best"] in (None, "powersgd(rank=4)") and res["best_to_target"] != adv.FLAT_DDP


class _Spy:
    """Stands in for ErrorFeedback in advise: records the storage and the torch threads it ran with."""
    seen: list = []

    def __init__(self, comp, storage="fp32"):
        self.comp, self.storage = comp, storage

    def compress_fixed(self, x, **kw):
        _Spy.seen.append((self.storage, torch.get_num_threads()))
        return self.comp.compress_fixed(x, **kw)


@pytest.mark.parametrize("storage", ["int8", "fp32"])
def test_codec_is_measured_as_a_rank_runs_it(monkeypatch, storage):
    """Residuals kept as the hooks keep them, one torch thread on a CPU (torchrun's default), restored after."""
    monkeypatch.setattr(adv, "ErrorFeedback", _Spy)
    _Spy.seen = []
    before = torch.get_num_threads()
    res = adv.advise(1e6, 10, 2, "1gbit", compressors=["topk(ratio=0.01)", "fp16"], device="cpu",
                     probe_elements=1 << 12, reps=1, residual_storage=storage)
    assert torch.get_num_threads() == before
    assert _Spy.seen and all(s == (storage, 1) for s in _Spy.seen)   # topk only: fp16 is unbiased
    assert f"residuals {storage}" in res["codec"] and "one thread" in res["codec"]
    assert res["inputs"]["residual_storage"] == storage
    assert adv.advise(1e6, 10, 2, "1gbit", compressors=["fp16"], codec_ns_per_element=NS)["inputs"][
        "residual_storage"] == adv.DEFAULT_RESIDUAL_STORAGE == "int8"


def test_autos_codec_cost_keeps_the_hooks_residual_storage(monkeypatch):
    from commpress.auto import measure
    from commpress.auto.candidates import Candidate

    monkeypatch.setattr(measure, "ErrorFeedback", _Spy)
    measure.clear_codec_cache()
    try:
        for storage in ("int8", "fp32"):
            _Spy.seen = []
            measure.codec_cost(Candidate("topk", 0.01), 4096, reps=1, storage=storage)
            assert _Spy.seen and {s for s, _ in _Spy.seen} == {storage}
    finally:
        measure.clear_codec_cache()


@pytest.mark.parametrize("kw,arg", [
    (dict(round_ms=-1), "--round-ms"), (dict(round_ms=float("inf")), "--round-ms"), (dict(round_ms="1"), "--round-ms"),
    (dict(ranks_per_core=0.5), "--ranks-per-core"), (dict(ranks_per_core=float("nan")), "--ranks-per-core"),
    (dict(residual_storage="int3"), "--residual-storage"), (dict(residual_storage=None), "--residual-storage"),
    (dict(flat_ddp="yes"), "--flat-ddp"), (dict(dense_params=-1), "--dense-params"),
    (dict(dense_params=25_000_000), "--dense-params"), (dict(dense_params=2.5), "--dense-params"),
])
def test_bad_new_arguments_name_the_argument(kw, arg):
    with pytest.raises(ValueError, match=arg):
        run(**kw)


def test_cli_new_flags(capsys):
    argv = ["--params", "25e6", "--compute-ms", "100", "--world", "8", "--bandwidth", "1gbit",
            "--codec-ns-per-element", "2", "--compressors", "blockquant(bits=4)", "--gpus-per-node", "4",
            "--intra-bandwidth", "400gbit", "--round-ms", "1.5", "--ranks-per-core", "2", "--residual-storage",
            "fp32", "--flat-ddp", "--dense-params", "0", "--json"]
    assert adv.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["compressor"] for r in out["rows"]] == ["ddp", adv.FLAT_DDP, "blockquant(bits=4)"]
    assert out["inputs"]["round_ms"] == 1.5 and out["inputs"]["ranks_per_core"] == 2
    assert out["inputs"]["residual_storage"] == "fp32"
    assert out["rows"][2]["round_ms"] == pytest.approx(1.5 * 3)   # one all_gather between 2 nodes + 2 intra
    assert out["inputs"]["dense_params"] == 0
    assert adv.main(argv[:-3] + ["--dense-params", "4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"][2]["round_ms"] == pytest.approx(1.5 * 4)   # the dense part alone, across all 8 ranks
    for flag, bad in (("--round-ms", "-2"), ("--ranks-per-core", "0"), ("--residual-storage", "int3"),
                      ("--dense-params", "-5")):
        with pytest.raises(SystemExit) as e:
            adv.main(argv[:-1] + [flag, bad])
        assert e.value.code == 2 and flag in capsys.readouterr().err


def test_a_model_smaller_than_the_probe_is_timed_at_its_own_size():
    res = adv.advise(5000, 10, 2, "1gbit", compressors=["fp16"], device="cpu", probe_elements=1 << 14, reps=1)
    assert "(5000 elements" in res["codec"]
    res = adv.advise(1e6, 10, 2, "1gbit", compressors=["fp16"], device="cpu", probe_elements=1 << 14, reps=1)
    assert f"({1 << 14} elements" in res["codec"]
