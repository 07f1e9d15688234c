"""Switching a bucket's compressor keeps what error feedback still owes."""

from __future__ import annotations

import pytest
import torch

from commpress.auto.switch import Carry, fold_residual, take_residual
from commpress.compressors import get
from commpress.feedback import ErrorFeedback


def _send(ef, x, key="b"):
    p = ef.compress(x, key=key)
    return ef.decompress(p).reshape(-1).float()


@pytest.fixture(autouse=True)
def _torch_ops(monkeypatch):
    monkeypatch.setenv("COMMPRESS_BACKEND", "torch")


@pytest.mark.parametrize("new", ["blockquant", "dense"])
def test_switch_conserves_sent_plus_residual(new):
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(1000, generator=g) for _ in range(4)]
    old = ErrorFeedback(get("topk", ratio=0.05))
    sent = _send(old, xs[0]) + _send(old, xs[1])
    assert old.residual("b").abs().sum() > 0
    carry = take_residual(old, "b", 1000)
    assert old.residual("b") is None                      # moved out, not copied
    target = ErrorFeedback(get("blockquant", bits=4)) if new == "blockquant" else None
    extra = fold_residual(carry, target, "b")
    for x in xs[2:]:
        if target is None:
            x = x + extra if extra is not None else x
            extra = None
            sent = sent + x                                 # dense sends it all
        else:
            sent = sent + _send(target, x)
    left = target.residual("b").reshape(-1) if target is not None else torch.zeros(1000)
    torch.testing.assert_close(sent + left, sum(xs), rtol=0, atol=1e-5)


def test_two_level_shard_residual_placed_at_its_offset():
    ef = ErrorFeedback(get("topk", ratio=0.1))
    x = torch.arange(1.0, 11.0)
    ef.compress(x, key=("shard", "b", 1))
    r = ef.residual(("shard", "b", 1)).clone()
    carry = take_residual(ef, ("shard", "b", 1), 25, offset=12)
    assert torch.equal(carry.residual[12:22], r) and carry.residual[:12].abs().sum() == 0
    assert carry.residual[22:].abs().sum() == 0
    assert fold_residual(carry, None) is carry.residual     # to the next gradient
    other = ErrorFeedback(get("topk", ratio=0.1))
    other.compress(x, key="k")
    with pytest.raises(ValueError, match="fit"):
        take_residual(other, "k", 12, offset=5)


def test_velocity_needs_momentum_on_the_new_side():
    old = ErrorFeedback(get("topk", ratio=0.1), momentum=0.9)
    old.compress(torch.randn(100, generator=torch.Generator().manual_seed(1)), key="b")
    v = old.velocity("b").clone()
    carry = take_residual(old, "b", 100)
    with pytest.raises(ValueError, match="momentum"):
        fold_residual(carry, None)
    with pytest.raises(ValueError, match="momentum"):
        fold_residual(carry, ErrorFeedback(get("blockquant", bits=8)), "b")
    new = ErrorFeedback(get("blockquant", bits=8), momentum=0.9)
    assert fold_residual(carry, new, "b") is None
    assert torch.equal(new.velocity("b"), v) and new.residual("b") is not None
    assert take_residual(None, "b", 100) == Carry()
