"""benchmarks/projections.py: it runs, and its rows are advise's with the stated inputs (no timing)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import commpress  # noqa: E402
from benchmarks import projections as pj  # noqa: E402
from commpress.advise import PROFILES, advise  # noqa: E402


@pytest.fixture
def small_grid(monkeypatch):
    """One model, two world sizes, two links: the whole pipeline in about a second."""
    monkeypatch.setattr(pj, "MODELS", (("7B", 7e9, 4096),))
    monkeypatch.setattr(pj, "WORLDS", (64, 1024))
    monkeypatch.setattr(pj, "LINKS", {k: pj.LINKS[k] for k in ("100gbit-ib", "400gbit-ib")})


def test_main_writes_the_generated_block_and_keeps_the_rest(small_grid, tmp_path, capsys):
    doc = tmp_path / "p.md"
    doc.write_text(f"# title\n\nprose before\n\n{pj.BEGIN}\nold\n{pj.END}\n\nprose after\n")
    assert pj.main(["--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# title\n\nprose before\n\n" + pj.BEGIN)
    assert text.endswith(pj.END + "\n\nprose after\n")
    assert "old" not in text and "### Headline" in text and "#### 400gbit-ib" in text
    assert pj.main([]) == 0                      # deterministic: stdout is the same block
    assert capsys.readouterr().out.rstrip("\n") in text
    bad = tmp_path / "none.md"
    bad.write_text("no markers\n")
    with pytest.raises(SystemExit):
        pj.main(["--doc", str(bad)])


def test_ddp_row_is_advise_with_the_stated_inputs():
    # 7B on 256 GPUs at 100 Gbit/s: 16,384 tokens per GPU, 6 x 7e9 x 16384 FLOPs at 40% of 989 TFLOP/s
    compute = 1e3 * 6 * 7e9 * 16384 / (0.40 * 989e12)
    assert pj.tokens_per_gpu(256) == 16384
    assert pj.compute_ms(7e9, 256) == pytest.approx(compute)
    res = pj.project("100gbit-ib", "7B", 256, 2 / 3)
    ref = advise(7_000_000_000, compute, 256, profile="100gbit-ib", gpus_per_node=8,
                 intra_bandwidth=PROFILES["nvlink-node"]["bandwidth"],
                 intra_latency_us=PROFILES["nvlink-node"]["latency_us"], overlap=2 / 3,
                 compressors=["bf16"], codec_ns_per_element=1.0)
    assert res["rows"][0] == ref["rows"][0]
    assert res["rows"][0]["compressor"] == "ddp"
    assert [r["compressor"] for r in res["rows"][1:]] == list(pj.COMPRESSORS)


def test_codec_inputs_are_the_gpu_md_figures_scaled_to_the_h100():
    ns = pj.codec_ns_per_element()
    scale = 4814 / 3350
    assert ns["topk(ratio=0.01)"] == pytest.approx((0.810 + 0.134) * 1e6 / 2**26 * scale)
    assert ns["blockquant(bits=8)"] == pytest.approx((0.280 + 0.347 + 3 * 0.134) * 1e6 / 2**26 * scale)
    assert set(ns) == set(pj.COMPRESSORS) and all(v > 0 for v in ns.values())


def test_bytes_ratios_are_the_compressors_own(small_grid):
    rows = [r for r in pj.rows() if r["link"] == "100gbit-ib" and r["overlap"] == 0]
    x = torch.randn(1 << 16)
    for world in pj.WORLDS:
        by = {r["compressor"]: r for r in rows if r["world"] == world}
        ddp = by["ddp"]
        intra = ddp["bytes"] - ddp["inter_node_bytes"]
        for name, r in by.items():   # no compressor shrinks the intra-node fp32 reduce-scatter/all-gather
            assert r["bytes"] - r["inter_node_bytes"] == pytest.approx(intra, rel=1e-9), name
        for spec, (name, params) in {"bf16": ("bf16", {}), "blockquant(bits=8)": ("blockquant", {"bits": 8}),
                                     "blockquant(bits=4)": ("blockquant", {"bits": 4})}.items():
            p = commpress.get(name, **params).compress(x)
            ratio = p.nbytes / p.dense_nbytes
            assert by[spec]["inter_node_bytes"] / ddp["inter_node_bytes"] == pytest.approx(ratio, rel=1e-3), spec
        for rank in (4, 1):          # PowerSGD: r(n + n) per n x n matrix, n = the hidden size (4096)
            got = by[f"powersgd(rank={rank})"]["inter_node_bytes"] / ddp["inter_node_bytes"]
            assert got == pytest.approx(2 * rank / 4096, rel=0.02)
        # top-k: M nodes all-gather k values + indices (8 bytes each) against the ring's 2(M-1)/M x 4 bytes
        # per element: r x M of DDP's bytes, or the dense ring when that is smaller
        nodes = world // pj.GPUS_PER_NODE
        for r in (0.1, 0.01):
            got = by[f"topk(ratio={r:g})"]["inter_node_bytes"] / ddp["inter_node_bytes"]
            assert got == pytest.approx(min(r * nodes, 1.0), rel=1e-3), (r, world)


def test_summary_counts_match_the_rows(small_grid):
    all_rows = pj.rows()
    s = pj.summary(all_rows)
    assert s["setups"] == len(pj.LINKS) * len(pj.MODELS) * len(pj.WORLDS) * len(pj.OVERLAPS)
    for (link, f), v in s["per"].items():
        mine = [r for r in all_rows if r["link"] == link and r["overlap"] == f and r["compressor"] != "ddp"]
        best = {}
        for r in mine:
            k = (r["model"], r["world"])
            best[k] = max(best.get(k, 0.0), r["speedup"])
        assert v["pays_10"] == sum(b > 1.1 for b in best.values())
        assert v["max"] == pytest.approx(max(best.values()))
    # more bandwidth never makes compression pay more
    for f in pj.OVERLAPS:
        assert s["per"][("400gbit-ib", round(f, 4))]["max"] <= s["per"][("100gbit-ib", round(f, 4))]["max"]
