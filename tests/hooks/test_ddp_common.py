"""Shared hook pieces: stats, fingerprints, state plumbing (hooks/common.py)."""

from __future__ import annotations

import io

import pytest
import torch

from distributed import run

from commpress.hooks import common


def test_stats_per_step_and_cumulative():
    s = common.Stats()
    s.record("b0", bytes_sent=10, dense_bytes=40, algorithm="allgather")
    s.record("b1", bytes_sent=30, dense_bytes=40, algorithm="dense")
    s.end_step()
    assert s.last_step["bytes_sent"] == 40 and s.last_step["dense_bytes"] == 80
    assert s.last_step["compression_ratio"] == 2.0
    s.record("b0", bytes_sent=20, dense_bytes=40, algorithm="dense")
    s.end_step()
    d = s.as_dict()
    assert d["steps"] == 2 and d["bytes_sent"] == 60 and d["dense_bytes"] == 120
    assert d["compression_ratio"] == 2.0
    assert d["algorithms"] == {"b0": "dense", "b1": "dense"}


def test_stats_say_which_backend_ran_each_op():
    from commpress import ops

    ops.scatter_add_(torch.zeros(8), torch.tensor([1, 3], dtype=torch.int32), torch.ones(2))
    ops.scatter_add_(torch.zeros(8), torch.tensor([1], dtype=torch.int32), torch.ones(1), backend="torch")
    assert common.Stats().as_dict()["backends"]["scatter_add_"] == "torch"    # the last call's
    ops.scatter_add_(torch.zeros(8), torch.tensor([1], dtype=torch.int32), torch.ones(1))
    assert common.Stats().as_dict()["backends"]["scatter_add_"] == "numba"    # the CPU default


def test_resolve_compressor_errors():
    with pytest.raises(TypeError, match="compressor"):
        common.resolve_compressor(3.0)
    with pytest.raises(ValueError, match="unknown compressor"):
        common.resolve_compressor("no-such-thing")
    fp16 = common.resolve_compressor("fp16")
    with pytest.raises(ValueError, match="only be given with a compressor name"):
        common.resolve_compressor(fp16, {"ratio": 0.1})
    with pytest.raises(ValueError, match="error_feedback"):
        common.wants_error_feedback(fp16, "yes")
    assert common.wants_error_feedback(fp16, "auto") is False
    assert common.wants_error_feedback(fp16, True) is True


def test_fingerprint_canonical():
    a = {"x": 1, "y": {"b": torch.float16, "a": (1, 2)}}
    b = {"y": {"a": [1, 2], "b": torch.float16}, "x": 1}
    assert common.config_fingerprint(a) == common.config_fingerprint(b)
    assert common.config_fingerprint(a) != common.config_fingerprint({**a, "x": 2})


def test_state_round_trip_weights_only_and_refusals():
    s = common.HookState("fp16")
    s.step = 7
    buf = io.BytesIO()
    torch.save(s.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    t = common.HookState("fp16")
    t.load_state_dict(loaded)
    assert t.step == 7
    other = common.HookState("bf16")
    with pytest.raises(ValueError, match="compressor"):
        other.load_state_dict(loaded)
    bad_world = dict(loaded, world_size=4)
    with pytest.raises(ValueError, match="world size 4"):
        t.load_state_dict(bad_world)
    with pytest.raises(ValueError, match="not a commpress hook state"):
        t.load_state_dict({"step": 1})


def _check_config(rank, world, differ_on):
    cfg = {"compressor": "topk", "params": {"ratio": 0.01}, "world_size": world}
    if rank == differ_on:
        cfg["params"]["ratio"] = 0.02
    try:
        fp = common.check_same_config(cfg)
        return ("ok", fp)
    except ValueError as exc:
        return ("ValueError", str(exc))


@pytest.mark.timeout(60)
def test_check_same_config_all_ranks():
    ok = run(_check_config, 3, -1, timeout=40)
    assert [o[0] for o in ok] == ["ok"] * 3 and len({o[1] for o in ok}) == 1
    bad = run(_check_config, 3, 2, timeout=40)
    assert [b[0] for b in bad] == ["ValueError"] * 3
    for _, msg in bad:
        assert "rank 2 vs rank 0" in msg and "params.ratio: 0.01 != 0.02" in msg
