"""Issue 55.8's outside training loop (``python -m benchmarks.outside``): one short round on
loopback trains the config named and prints its row."""

from __future__ import annotations

import pytest

from benchmarks import outside


def test_unknown_configs_are_refused():
    with pytest.raises(SystemExit, match="unknown configs"):
        outside.main(["--configs", "ddp,nope"])


def test_a_short_round_prints_a_row_per_config(capsys):
    assert outside.main(["--configs", "auto-opt", "--rounds", "1", "--steps", "12"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split(" | ") for line in out if line.startswith("| 1 |")]
    assert [r[1] for r in rows] == ["auto-opt"] and float(rows[0][2]) > 0
    assert rows[0][-1].strip(" |")   # what "auto" chose


def test_help_prints(capsys):
    """``--help`` lists the configs (one is named with a ``%``, which argparse expands)."""
    with pytest.raises(SystemExit) as exit_:
        outside.main(["--help"])
    assert exit_.value.code == 0 and "topk-1%-mc" in capsys.readouterr().out


def test_a_round_shorter_than_one_evaluation_prints_its_row(capsys):
    """Fewer steps than ``eval_every``: no accuracy measured, the row still prints (it raised IndexError)."""
    assert outside.main(["--configs", "ddp", "--rounds", "1", "--steps", "4", "--walls"]) == 0
    out = capsys.readouterr().out
    row = [line for line in out.splitlines() if line.startswith("| 1 | ddp |")]
    assert row and "None" in row[0] and "first steps of ddp" in out


def test_the_comm_hook_floor_configs_run(capsys):
    """PyTorch's own ``allreduce_hook`` and commpress identity (the floor a comm hook that averages
    in Python sets under "auto"'s all-dense steps) train and print their rows."""
    assert outside.main(["--configs", "torch-allreduce-hook,identity", "--rounds", "1", "--steps", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[1] for line in out if line.startswith("| 1 |")] == ["torch-allreduce-hook", "identity"]
