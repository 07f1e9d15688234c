"""``python -m benchmarks auto2x2`` in its smallest form on loopback, and its pure helpers.

The entry runs end to end (``main``: settings, rows, verdict, ``results.json`` and
``summary.md``) with the rank processes forked by ``tests/distributed.py`` instead of
:func:`benchmarks.netem.launch` (tested in ``test_netem.py``): same rank function, without
four fresh interpreters importing torch.  No namespaces, no root.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import auto2x2, netem  # noqa: E402
from distributed import run  # noqa: E402


def _rank(rank, world, kwargs):
    import commpress

    commpress.collectives.set_cost_model(1e-4, 1e-9)   # no calibrations at binding: seconds at 4 ranks on 2 cores
    try:
        return auto2x2.rank_main(rank, world, report=lambda msg: None, **kwargs)
    finally:
        commpress.collectives.set_cost_model(None)


def _launch(target, world, *, cluster, kwargs, timeout, **_):
    assert target == "benchmarks.auto2x2:rank_main" and isinstance(cluster, netem.Loopback)
    return run(_rank, world, kwargs, timeout=timeout - 5, pg_timeout=60)


@pytest.mark.timeout(120)
def test_smallest_run_on_loopback(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(netem, "launch", _launch)
    rc = auto2x2.main(["--nets", "loopback", "--task", "tiny", "--steps", "4", "--check-every", "2",
                       "--kinds", "blockquant(bits=4)", "--out", str(tmp_path), "--timeout", "100"])
    assert rc == 0
    (run_dir,) = tmp_path.iterdir()
    doc = json.loads((run_dir / "results.json").read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    auto = rows["auto"]
    # auto's plan: one valid choice per unit, the path included; its history has the check points
    assert auto["plan"] and set(auto["plan"]) == set(auto["auto"])
    choices = [auto2x2.parse_choice(c) for c in auto["plan"].values()]
    assert auto["history"] and auto["history"][-1]["plan"] == auto["plan"]
    assert auto["network_model"] == {"flat": [1e-4, 1e-9], "intra": [1e-4, 1e-9], "inter": [1e-4, 1e-9]}
    # each kind auto chose, and the --kinds one, fixed on both paths (dense flat is DDP itself)
    for c in [ch.candidate for ch in choices] + [auto2x2.parse_choice("blockquant(bits=4)").candidate]:
        label = auto2x2._kind_label(c.kind, c.param)
        assert ("ddp" if c.kind == "dense" else label) in rows and f"{label}+two_level" in rows
    # the fixed configs ran the path they are named for (dense two-level too: not DDP's way)
    for r in rows.values():
        if r["path"] == "two_level":
            assert r["algorithms"] and all(a.startswith("two_level+") for a in r["algorithms"]), r
        elif r["path"] == "flat" and r["kind"] != "dense":
            assert r["algorithms"] and not any(a.startswith("two_level+") for a in r["algorithms"]), r
    assert rows["ddp"]["kind"] == "dense" and "algorithms" not in rows["ddp"]   # DDP itself, no hook
    assert all(r["step_ms"] > 0 and r["bytes_across_nodes_per_step"] is None for r in rows.values())  # loopback
    # one verdict per unit, each against its kind's two fixed runs
    (verdict,) = doc["meta"]["verdict"].values()
    assert [v["unit"] for v in verdict] == list(auto["plan"])
    assert all(isinstance(v["right"], bool) for v in verdict)
    summary = (run_dir / "summary.md").read_text()
    assert "oversubscribed" in summary or "4 ranks on" in summary
    assert "auto's plan after each check point" in summary and summary in capsys.readouterr().out


def _row(name, kind, param, path, ms, **extra):
    return {"name": name, "kind": kind, "param": param, "path": path, "step_ms": ms,
            "bytes_across_nodes_per_step": 1e6, **extra}


def test_verdict_judges_each_unit_against_its_kinds_two_fixed_paths():
    auto = _row("auto", "auto", None, "chosen", 100.0,
                plan={"0": "blockquant(bits=8)+two_level", "1": "blockquant(bits=4)", "2": "dense",
                      "3": "topk(ratio=0.01)"},
                history=[{"step": 3, "plan": {"0": "dense"}}])
    rows = [auto, _row("blockquant(bits=8)", "blockquant", 8, "flat", 200.0),
            _row("blockquant(bits=8)+two_level", "blockquant", 8, "two_level", 120.0),
            _row("blockquant(bits=4)", "blockquant", 4, "flat", 150.0),
            _row("blockquant(bits=4)+two_level", "blockquant", 4, "two_level", 100.0),
            _row("ddp", "dense", None, "flat", 300.0), _row("dense+two_level", "dense", None, "two_level", 290.0)]
    v = {x["unit"]: x for x in auto2x2.verdict(rows)}
    assert v["0"]["right"] and v["0"]["faster"] == "two_level"
    assert not v["1"]["right"] and v["1"]["gap"] == pytest.approx(0.5)       # flat, but two-level was faster
    assert v["2"]["right"] and v["2"]["faster"] == "two_level"                 # within the tie: either path
    assert v["3"]["right"] is None                                            # no fixed runs of topk
    text = auto2x2.render({"100mbit": {"network": "tc", "rows": rows, "verdict": auto2x2.verdict(rows)}},
                          {"steps": 30, "check_every": 10, "oversubscribed_note": "4 ranks on 2 cores",
                           "seconds": 1.0, "command": "x"})
    assert "auto chose **blockquant(bits=4)**" in text and "**wrong**" in text
    assert "(a tie: 3% apart)" in text and "| ddp | dense, flat | 300 | 1.00x | 1.00 |" in text


def test_parse_choice_reads_what_describe_writes():
    from commpress.auto.candidates import DEFAULT_CANDIDATES, Choice, describe

    for c in DEFAULT_CANDIDATES:
        for path in ("flat", "two_level"):
            assert auto2x2.parse_choice(describe(Choice(c, path))) == Choice(c, path)
    with pytest.raises(SystemExit, match="--kinds"):
        auto2x2._parse_kinds("blockquant(bits=3)")
