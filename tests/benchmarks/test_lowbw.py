"""The demo's low-bandwidth part: configs build, the verdict reads the figures it is given."""

from __future__ import annotations

from benchmarks import lowbw


def _row(name, ttt, bytes_per_step, final, steps=120, step_ms=10.0):
    curve = [{"step": 0, "time": 0.0, "val_loss": 5.0}, {"step": steps, "time": ttt, "val_loss": final}]
    return {"config": name, "describe": lowbw._describe(name), "steps": steps, "train_time_s": ttt,
            "step_ms": step_ms, "bytes_per_step": bytes_per_step, "ddp_bytes_per_step": 1000.0, "final": final,
            "curve": curve, "ttt_s": ttt, "ttt_step": steps, "target": 2.8}


def test_every_config_is_described_and_the_goals_are_judged():
    rows = [_row("ddp", 40.0, 1000.0, 2.7, 60), _row("blockquant-4bit", 9.0, 140.0, 2.7, 60),
            _row("torch-postlocalsgd", 6.0, 70.0, 2.7, 60), _row("diloco", 4.0, 66.0, 2.60),
            _row("sparseloco", 3.0, 1.5, 2.62), _row("streaming-mx-fp4", 3.5, 8.0, 2.9)]
    assert all(lowbw._describe(n) for n in lowbw.CONFIGS)
    text = "\n".join(lowbw.render(rows, {"network": "tc 10mbit", "seconds": 1.0, "sync_every": 15, "ddp_steps": 60}))
    assert "best DiLoCo config **sparseloco** (3.0 s" in text
    assert "vs ddp (40.0 s): 13.3x, goal 10x: met" in text
    assert "vs blockquant-4bit (9.0 s): 3.0x, goal 3x: met" in text
    assert "vs torch-postlocalsgd (6.0 s): 2.0x, goal 1.5x: met" in text
    assert "667x fewer than DDP, goal 500x: met" in text
    assert "sparseloco: final loss +0.8%" in text and "44x fewer bytes (goal: within 2% at 20x fewer): met" in text
    slow = [dict(r, ttt_s=20.0) if r["config"] in ("diloco", "sparseloco", "streaming-mx-fp4") else r for r in rows]
    assert "goal 10x: missed" in "\n".join(lowbw.goal_lines(slow))
