"""The training sweep end to end on loopback with a tiny configuration, and its pure helpers."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import configs as C  # noqa: E402
from benchmarks import sweep  # noqa: E402
from benchmarks.__main__ import main as bench_main  # noqa: E402


def test_cli_lists_suites_and_reports_missing_ones(capsys):
    assert bench_main(["--help"]) == 0
    out = capsys.readouterr().out
    for suite in ("compressors", "collectives", "kernels", "sweep"):
        assert suite in out
    assert bench_main(["nosuch"]) == 2


def test_resolve_configs():
    assert [c.name for c in C.resolve("ddp,torch", False)][:2] == ["ddp", "torch-fp16"]
    assert len({c.name for c in C.resolve("all,ddp", False)}) == len(C.ALL)
    with pytest.raises(ValueError, match="unknown config"):
        C.resolve("ddp,nope", False)
    assert C.BY_NAME["torch-powersgd-r2"].bucket_cap_mb == C.ONE_BUCKET_MB
    assert C.BY_NAME["ddp"].bucket_cap_mb is None


def test_torch_powersgd_payload_mirrors_the_hook():
    import torch

    params = [torch.zeros(100, 50), torch.zeros(50), torch.zeros(3, 3), torch.zeros(8, 2, 5)]
    unc, ps, qs = C.torch_powersgd_payload(params, rank=2)
    # 100x50: (150)*2*2 < 5000 -> compressed; 50: 1-D; 3x3: (6*2*2=24) >= 9 -> dense; 8x10: 18*2*2=72 < 80
    assert (ps, qs) == (100 * 2 + 8 * 2, 50 * 2 + 10 * 2)
    assert unc == 50 + 9
    b = C.hook_bytes(C.BY_NAME["torch-fp16"], params, 4)
    n = sum(p.numel() for p in params)
    assert b["payload_bytes"] == 2 * n and b["bytes_sent"] == 2 * 2 * n * 3 // 4


def _curve(vals):
    return [{"step": i, "time": float(i), "accuracy": v} for i, v in enumerate(vals)]


def test_time_to_target_reads_the_mean_of_the_last_three_evaluations():
    rows = [{"config": "ddp", "metric": "accuracy", "final": 0.9, "curve": _curve([0.1, 0.5, 0.88, 0.9, 0.9, 0.9])},
            # a lucky evaluation (0.95 at step 1) does not count: its window mean is below the target
            {"config": "lucky", "metric": "accuracy", "final": 0.9,
             "curve": _curve([0.1, 0.95, 0.5, 0.6, 0.9, 0.9, 0.9])},
            {"config": "fast", "metric": "accuracy", "final": 0.95, "curve": _curve([0.1, 0.9, 0.9, 0.9, 0.9])},
            {"config": "slow", "metric": "accuracy", "final": 0.8, "curve": _curve([0.1, 0.5, 0.7, 0.8])}]
    meta = sweep.time_to_target(rows)
    assert meta["dense_final"] == pytest.approx(0.9)          # mean of the last three
    assert meta["target"] == pytest.approx(0.895)
    assert rows[0]["ttt_s"] == 5.0                             # (0.9+0.9+0.9)/3 at step 5
    assert rows[1]["ttt_s"] == 6.0
    assert rows[2]["ttt_s"] == 3.0 and rows[2]["speedup"] == pytest.approx(5 / 3)
    assert rows[3]["ttt_s"] is None


def test_a_config_with_ddps_curve_reaches_the_target_when_ddp_stops_off_the_grid():
    # evaluations every 3 steps; DDP also evaluates its last step (100), off the grid
    grid = [0.1, 0.5, 0.8, 0.93, 0.96, 0.97, 0.92]                     # steps 0, 3, ..., 18
    ddp = [{"step": 3 * i, "time": 3.0 * i, "accuracy": v} for i, v in enumerate(grid)]
    ddp.append({"step": 19, "time": 19.0, "accuracy": 0.99})             # a lucky off-grid final
    same = [dict(p) for p in ddp[:-1]] + [{"step": 21, "time": 21.0, "accuracy": 0.9}]
    rows = [{"config": "ddp", "metric": "accuracy", "final": 0.99, "curve": ddp},
            {"config": "same", "metric": "accuracy", "final": 0.9, "curve": same}]
    sweep.time_to_target(rows)
    assert rows[0]["final_smoothed"] == pytest.approx((0.96 + 0.97 + 0.92) / 3)
    assert rows[1]["ttt_step"] is not None and rows[1]["ttt_step"] <= rows[0]["ttt_step"]


def test_verdict_speedups_and_goals_say_by_how_much_and_the_bound():
    def row(config, kind, ttt, seed=0, step_s=0.040, comm_s=0.030, final=0.9, cpu_s=None):
        return {"config": config, "kind": kind, "seed": seed, "curve": [], "ttt_s": ttt, "ttt_step": 10,
                "step_s": step_s, "ratio": 1.0, "compute_s": step_s - comm_s, "compression_s": 0.0, "comm_s": comm_s,
                "steps": 100, "metric": "accuracy", "final": final, "target": 0.95, "cpu_s": cpu_s}

    rows = [row("ddp", "ddp", 6.0), row("ddp", "ddp", 4.0, seed=1), row("torch-fp16", "torch_fp16", 4.0),
            row("torch-fp16", "torch_fp16", 4.0, seed=1), row("torch-powersgd-r1", "torch_powersgd", 3.0),
            row("topk-1%", "commpress", None), row("blockquant-4bit", "commpress", 2.0),
            row("blockquant-4bit", "commpress", 3.0, seed=1)]
    summary = sweep.summarize_configs(rows)
    assert summary["ddp"]["ttt_s"] == 5.0 and summary["ddp"]["ttt_range"] == (4.0, 6.0)
    verdict = {r["config"]: r for r in sweep.verdict_rows(summary)}
    assert verdict["blockquant-4bit"]["vs DDP"] == "2.00x"
    assert verdict["blockquant-4bit"]["vs torch fp16"] == "1.60x"
    assert verdict["topk-1%"]["time to target s"] == "not reached"
    # a config of one seed is set against the baselines on that seed, not their mean over both
    one = {r["config"]: r for r in sweep.verdict_rows(sweep.summarize_configs(rows + [row("bf16", "commpress", 2.0)]))}
    assert one["bf16"]["vs DDP"] == "3.00x" and one["bf16"]["vs torch fp16"] == "2.00x", one["bf16"]
    lines = sweep.check_goals(sweep.Leg("digits", 2, "1gbit", ()), summary)
    text = "\n".join(lines)
    assert "blockquant-4bit" in lines[0]
    assert "2.00x, goal >= 3x: MISSED (short by 33%)" in text
    assert "vs torch-powersgd-r1 (3.0 s): 1.20x, goal ahead: met" in text
    assert "1.20x, goal ahead: met, inside" not in text and "a tie" not in text
    assert "1/(1 - 0.75) = 4.0x" in text                     # DDP's communication share bounds the speedup
    assert "host CPU" not in text                            # no CPU figures: nothing said of them
    # with the ranks' host CPU: the bound line says how much of the best step it is, and when it is CPU-bound
    rows_cpu = [row("ddp", "ddp", 6.0, cpu_s=0.015), row("blockquant-4bit", "commpress", 2.0, cpu_s=0.036)]
    cpu_text = "\n".join(sweep.check_goals(sweep.Leg("digits", 2, "1gbit", ()), sweep.summarize_configs(rows_cpu)))
    assert "36 ms of it host CPU against DDP's 15 (CPU-bound" in cpu_text
    rows_cpu[1]["cpu_s"] = 0.020
    cpu_text = "\n".join(sweep.check_goals(sweep.Leg("digits", 2, "1gbit", ()), sweep.summarize_configs(rows_cpu)))
    assert "20 ms of it host CPU against DDP's 15" in cpu_text and "CPU-bound" not in cpu_text
    # issue 17's per-step goals: the median step against the config's compute-only step
    assert "step of blockquant-4bit vs its compute-only step: 40 / 10 ms = 4.00x, goal <= 1.8x: MISSED" in text
    assert "step of topk-1% vs its compute-only step: 40 / 10 ms = 4.00x, goal <= 1.3x: MISSED (inside its density warm-up" in text
    assert sweep.check_goals(sweep.Leg("digits", 4, "1gbit", ()), summary) == []
    # given the runs, a comparison with a run under outside load (its compute-only step 1.25x the
    # leg's median or more) says so on that line only
    loaded = [dict(r) for r in rows]
    loaded[2]["compute_s"] = 0.020                            # torch-fp16 seed 0: 20 ms against 10
    lines = sweep.check_goals(sweep.Leg("digits", 2, "1gbit", ()), summary, loaded)
    fp16 = [x for x in lines if "vs torch-fp16" in x]
    assert len(fp16) == 1 and fp16[0].endswith("(under outside load: compute-only step torch-fp16 seed 0's 20 ms "
                                               "against the leg's median 10 ms, the same model in every run)")
    assert sum("outside load" in x for x in lines) == 1
    quiet = sweep.check_goals(sweep.Leg("digits", 2, "1gbit", ()), summary, rows)   # quiet runs: nothing added
    assert quiet == sweep.check_goals(sweep.Leg("digits", 2, "1gbit", ()), summary)
    # a faster config that ran one seed of two is not the one the goals judge (its seed may be the easy one)
    one_seed = sweep.summarize_configs(rows + [row("bf16", "commpress", 1.5)])
    assert "fastest commpress config blockquant-4bit" in sweep.check_goals(sweep.Leg("digits", 2, "1gbit", ()), one_seed)[0]
    # none reached: the goals are missed, saying how close the best came and what bounds it
    rows = [row("ddp", "ddp", 6.0), row("topk-1%", "commpress", None, final=0.90, step_s=0.08),
            row("blockquant-4bit", "commpress", None, final=0.93, step_s=0.08)]
    lines = sweep.check_goals(sweep.Leg("digits", 2, "1gbit", ()), sweep.summarize_configs(rows))
    assert "goals MISSED; closest blockquant-4bit, accuracy 0.9300 against the target 0.9500" in lines[0]
    assert "costs 2.00x DDP's" in lines[-1]
    assert sweep._best(sweep.summarize_configs(rows), "commpress") is None
    # no DDP row (--configs without ddp): no target, the goals are not evaluated (no crash)
    rows = [dict(row("blockquant-4bit", "commpress", None), target=None)]
    assert sweep.check_goals(sweep.Leg("digits", 2, "1gbit", ()), sweep.summarize_configs(rows)) == [
        "- digits, 2 ranks, 1gbit: DDP did not run (its final metric is the target): goals not evaluated"]
    rows = [row("ddp", "ddp", 6.0), row("torch-fp16", "torch_fp16", 3.3), row("bf16", "commpress", 3.0),
            row("torch-powersgd-r1", "torch_powersgd", None)]
    text = "\n".join(sweep.check_goals(sweep.Leg("lm", 2, "100mbit", ()), sweep.summarize_configs(rows)))
    assert "vs torch-fp16 (3.3 s): 1.10x, goal ahead: met, inside the ~20% run-to-run noise" in text
    assert "vs torch-powersgd-r1: met, it did not reach the target" in text


def test_auto_goals_compare_on_the_seeds_both_ran():
    def row(config, kind, ttt, seed=0):
        return {"config": config, "kind": kind, "seed": seed, "curve": [], "ttt_s": ttt}

    rows = [row("ddp", "ddp", 5.0), row("ddp", "ddp", 6.0, 1),
            row("bf16", "commpress", 1.5),                                   # one seed only: not the rival
            row("blockquant-4bit", "commpress", 2.0), row("blockquant-4bit", "commpress", 3.0, 1),
            row("torch-powersgd-r1", "torch_powersgd", 2.4), row("torch-powersgd-r1", "torch_powersgd", 2.6, 1),
            row("auto", "commpress", 2.0), row("auto", "commpress", 3.4, 1)]
    text = "\n".join(sweep.check_auto_goals(sweep.Leg("digits", 2, "1gbit", ()), rows))
    assert "auto 2.7 s (2.0, 3.4) against blockquant-4bit's 2.5 s on the same seeds [0, 1]: 1.08x its time, " \
           "goal within 10%: met" in text
    assert "against torch-powersgd-r1's 2.5 s on the same seeds [0, 1]: 1.08x its time, goal ahead: MISSED" in text
    rows[-1]["ttt_s"] = None
    text = "\n".join(sweep.check_auto_goals(sweep.Leg("digits", 2, "1gbit", ()), rows))
    assert "auto did not reach the target on seed(s) [1]: MISSED" in text
    assert sweep.check_auto_goals(sweep.Leg("digits", 4, "1gbit", ()), rows) == []
    assert sweep.check_auto_goals(sweep.Leg("digits", 2, "1gbit", ()), rows[:-2]) == []   # no auto: nothing
    # a compared run whose compute-only step is 1.25x the leg's median or more is named (the same model
    # everywhere: it ran under load from outside); a run not compared, or below the bar, is not
    rows[-1]["ttt_s"] = 3.4
    for r in rows:
        r["compute_s"] = 0.007
    rows[-1]["compute_s"], rows[0]["compute_s"], rows[4]["compute_s"] = 0.010, 0.012, 0.008
    lines = sweep.check_auto_goals(sweep.Leg("digits", 2, "1gbit", ()), rows)
    assert lines[1].endswith("goal within 10%: met (under outside load: compute-only step auto seed 1's 10 ms "
                             "against the leg's median 7 ms, the same model in every run)"), lines
    assert "ddp seed 0" not in "\n".join(lines) and "blockquant-4bit seed 1" not in lines[1]
    for r in rows:
        r["compute_s"] = 0.007
    assert "outside load" not in "\n".join(sweep.check_auto_goals(sweep.Leg("digits", 2, "1gbit", ()), rows))


def test_demo_plan_names_known_configs_and_says_what_is_oversubscribed():
    args = sweep.build_parser().parse_args(["--demo"])
    legs = sweep.plan(args)
    assert [(leg.task, leg.world_size, leg.net) for leg in legs][:2] == [("digits", 2, "1gbit"), ("lm", 2, "100mbit")]
    for leg in legs:
        for name in sweep._expand(leg.configs, {"commpress": "topk-1%", "torch_powersgd": "torch-powersgd-r1"}):
            assert name in C.BY_NAME
    assert "torch-bf16" in legs[0].configs and C.unavailable_reason(C.BY_NAME["torch-bf16"])
    meta = {"world_size": 4, "cores": 2, "oversubscribed": True, "pin": True, "network": "x"}
    assert "oversubscribed" in sweep._leg_setting("k", meta)


def test_launch_pins_each_rank_to_one_core():
    import os

    from benchmarks.netem import launch

    cpus = sorted(os.sched_getaffinity(0))
    out = launch("benchmarks.netem:echo_target", 2, kwargs={"numel": 4}, timeout=60, pin=True)
    assert [o["cpus"] for o in out] == [[cpus[0]], [cpus[1 % len(cpus)]]]


@pytest.mark.timeout(150)
def test_tiny_sweep_writes_results(tmp_path):
    names = ["ddp", "torch-fp16"] + (["identity"] if C.unavailable_reason(C.BY_NAME["identity"]) is None else [])
    rc = sweep.main(["--quick", "--world-size", "2", "--tasks", "digits", "--steps", "4", "--evals", "2",
                     "--configs", ",".join(names), "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    (run_dir,) = list(tmp_path.iterdir())
    doc = json.loads((run_dir / "results.json").read_text())
    rows = doc["rows"]
    assert [r["config"] for r in rows] == names
    for r in rows:
        assert "error" not in r, r
        assert r["steps"] >= 2 and len(r["curve"]) >= 2
        assert r["curve"][-1]["step"] == r["steps"]
        assert 0.0 <= r["final"] <= 1.0
        assert r["bytes_sent"] > 0 and r["step_s"] > 0
        assert 0.0 < r["cpu_s"] < 10 * r["step_s"]     # the rank process's host CPU per step
    dense = rows[0]
    assert dense["steps"] == 4                     # ddp runs --steps; the others get its training time
    assert all(r["time_budget_s"] == pytest.approx(dense["train_time_s"]) for r in rows[1:])
    assert dense["bytes_sent"] == dense["dense_bytes"]
    assert rows[1]["bytes_sent"] == dense["bytes_sent"] // 2          # fp16: 2 bytes per element
    with open(run_dir / "results.csv") as f:
        assert [r["config"] for r in csv.DictReader(f)] == names
    for png in ("time_to_target.png", "frontier.png", "step_time.png"):
        assert (run_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (run_dir / "summary.md").read_text()
    assert "| config |" in summary and "python -m benchmarks sweep" in summary
    assert "## Verdict" in summary and "commit " in summary
    assert "issue" not in summary.lower()              # the product speaks of itself
    # rerender judges the goals again by the current rules (a stale verdict in results.json is replaced)
    doc["meta"]["goals"] = ["- a stale verdict"]
    (run_dir / "results.json").write_text(json.dumps(doc))
    assert sweep.rerender(run_dir) == summary and "stale" not in (run_dir / "summary.md").read_text()


@pytest.mark.timeout(150)
def test_without_namespaces_the_sweep_says_why_and_runs_on_loopback(tmp_path, monkeypatch, capsys):
    from benchmarks import netem

    monkeypatch.setattr(netem.Cluster, "probe", staticmethod(lambda: "not running as root (test)"))
    rc = sweep.main(["--quick", "--tasks", "digits", "--net", "1gbit", "--steps", "2", "--evals", "1",
                     "--configs", "ddp", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "emulated network unavailable (not running as root (test)); running on loopback" in err
    (run_dir,) = list(tmp_path.iterdir())
    assert "loopback" in json.loads((run_dir / "results.json").read_text())["meta"]["legs"][
        "digits, 2 ranks, 1gbit"]["network"]


def test_auto_rows_show_their_choices():
    rows = [{"config": "ddp"}, {"config": "auto", "seed": 1, "auto": {
        "0": {"choice": "bf16", "predicted_ms": 3.25, "measured_ms": 4.0},
        "1": {"choice": "topk(ratio=0.01)", "predicted_ms": 1.0, "measured_ms": None}}}]
    (line, blank) = sweep.auto_lines(rows)
    assert line == ("- auto seed 1 chose: bucket 0: bf16 (predicted 3.2 ms, measured 4.0 ms); "
                    "bucket 1: topk(ratio=0.01) (predicted 1.0 ms, measured ? ms)") and blank == ""
    rows[1]["auto_network"] = {"calibrated": {"alpha_ms": 0.1, "mb_per_s": 125.0},
                               "priced": {"alpha_ms": 0.1, "mb_per_s": 110.4}, "round_ms": 0.84}
    assert sweep.auto_lines(rows)[0].endswith("; link 125 MB/s calibrated, 110 MB/s measured, "
                                              "0.8 ms per round beyond the model")
    assert sweep.auto_lines(rows[:1]) == []
    # a unit switched more than once: its earlier choices, with the step each started
    rows[1]["auto"]["0"]["switches"] = [[1, "blockquant(bits=4)"], [21, "blockquant(bits=8)"], [41, "bf16"]]
    rows[1]["auto"]["1"]["switches"] = [[1, "topk(ratio=0.01)"]]
    assert sweep.auto_lines(rows)[0].startswith(
        "- auto seed 1 chose: bucket 0: bf16 (predicted 3.2 ms, measured 4.0 ms; before: blockquant(bits=4) from "
        "step 1, blockquant(bits=8) from step 21); bucket 1: topk(ratio=0.01) (predicted 1.0 ms, measured ? ms);")
    assert C.unavailable_reason(C.BY_NAME["auto"]) is None


def test_a_payload_the_run_could_not_state_is_left_blank():
    """``"auto"`` has no payload by contract (its kinds vary by bucket and over the run): its cell is
    blank, not ``0 B`` (as older results stored it), and so is sent/payload; a fixed config's shows."""
    base = {"metric": "accuracy", "bytes_sent": 588000, "ratio": 7.7, "steps": 100, "step_s": 0.02, "cpu_s": 0.015,
            "compute_s": 0.006, "compression_s": 0.001, "comm_s": 0.013, "final": 0.95}
    rows = sweep.table_rows([{**base, "config": "auto", "payload_bytes": None},
                             {**base, "config": "auto", "payload_bytes": 0},
                             {**base, "config": "blockquant-4bit", "payload_bytes": 588000}])
    assert [(r["payload"], r["sent/payload"]) for r in rows] == [("", ""), ("", ""), ("588.00 KB", "1.00")]
