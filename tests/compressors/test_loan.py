"""commpress.loan: a lean residual stored over the live one, its old codes lent until the verdict."""

from __future__ import annotations

import pytest
import torch

import commpress
from commpress.feedback import ErrorFeedback, ResidualTransaction
from commpress.loan import Loan


def _buffers(*sizes):
    return [torch.full((n,), 0xAB, dtype=torch.uint8) for n in sizes]


def test_save_spans_buffers_and_restores_by_the_verdict():
    a = torch.arange(10, dtype=torch.float32)             # 40 bytes
    b = torch.arange(7, dtype=torch.int8)                 # 7 bytes
    loan = Loan(_buffers(16, 0, 5, 40))
    saved = loan.save((a, b))
    assert saved is not None and loan.room == 61 - 47
    a_old, b_old = a.clone(), b.clone()
    a.fill_(-1.0)
    b.fill_(3)
    saved.restore(torch.tensor(False), False)              # good on the host: nothing
    assert (a == -1).all() and (b == 3).all()
    saved.restore(torch.tensor(False), None)               # good on the device: kept
    assert (a == -1).all() and (b == 3).all()
    saved.restore(torch.tensor(True), None)                # bad on the device: restored
    assert torch.equal(a, a_old) and torch.equal(b, b_old)
    a.fill_(-1.0)
    saved.restore(None, True)                              # bad on the host (a rollback)
    assert torch.equal(a, a_old)


def test_save_without_room_takes_nothing():
    loan = Loan(_buffers(8, 8))
    assert loan.save((torch.zeros(5),)) is None            # 20 bytes > 16
    assert loan.room == 16
    assert loan.save((torch.zeros(4),)) is not None and loan.room == 0
    assert loan.save((torch.zeros(1),)) is None
    assert Loan([]).save((torch.zeros(1),)) is None
    assert loan.save((torch.zeros(4, 4).t(),)) is None     # no byte view of a transposed tensor


def _steps(storage, lend, bad_at, momentum=0.0, compressor=("topk", {"ratio": 0.1}), n=1000, steps=4):
    """``steps`` compress calls on one key, each in a transaction (a loan when ``lend``), the one at
    ``bad_at`` judged bad; returns (residual, velocity) after each step and the memory by kind."""
    name, params = compressor
    ef = ErrorFeedback(commpress.get(name, **params), storage=storage, momentum=momentum, seed=5)
    g = torch.Generator().manual_seed(0)
    out = []
    for step in range(steps):
        x = torch.randn(n, generator=g)
        tx = ResidualTransaction()
        if lend:
            grads = torch.full((n,), float(step))               # the lent memory: 4 bytes per element
            tx.loan = Loan([grads.view(torch.uint8)])
        ef.compress(x.clone(), key="k", step=step, transaction=tx, scratch=True)
        tx.loan = None
        tx.commit(torch.tensor(step == bad_at))
        r, u = ef.residual("k"), ef.velocity("k") if momentum else None
        out.append((r.clone(), None if u is None else u.clone()))
    return out, ef.memory()


@pytest.mark.parametrize("storage", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("compressor", [("topk", {"ratio": 0.1}), ("blockquant", {"bits": 4})])
def test_lent_equals_pending_bitwise_and_a_bad_step_keeps_the_old(storage, momentum, compressor):
    pending, mem_p = _steps(storage, False, 2, momentum, compressor)
    lent, mem_l = _steps(storage, True, 2, momentum, compressor)
    for (rp, up), (rl, ul) in zip(pending, lent):
        assert torch.equal(rp, rl)
        assert (up is None and ul is None) or torch.equal(up, ul)
    assert torch.equal(lent[2][0], lent[1][0])              # the bad step left the residual as it was
    if momentum:
        assert torch.equal(lent[2][1], lent[1][1])          # and the velocity
    assert not torch.equal(lent[3][0], lent[2][0])
    assert mem_p["pending"] > 0 and mem_l["pending"] == 0
    if momentum:
        assert mem_p["velocities_pending"] > 0 and mem_l["velocities_pending"] == 0


def test_rollback_restores_a_residual_stored_over_the_live_one():
    ef = ErrorFeedback(commpress.get("topk", ratio=0.1), storage="int8")
    x = torch.randn(500)
    ef.compress(x.clone(), key="k")                         # a live residual (committed at once)
    before = ef.residual("k").clone()
    tx = ResidualTransaction()
    tx.loan = Loan([torch.empty(2000, dtype=torch.uint8)])
    ef.compress(torch.randn(500), key="k", transaction=tx, scratch=True)
    assert not torch.equal(ef.residual("k"), before)        # stored over the live one
    tx.rollback()
    assert torch.equal(ef.residual("k"), before)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_the_first_step_under_a_loan_allocates_no_pending_store(momentum):
    ef = ErrorFeedback(commpress.get("topk", ratio=0.1), storage="int8", momentum=momentum)
    tx = ResidualTransaction()
    tx.loan = Loan([torch.empty(4 * 500, dtype=torch.uint8)])
    ef.compress(torch.randn(500), key="k", transaction=tx, scratch=True)
    mem = ef.memory()
    assert mem["pending"] == mem["velocities_pending"] == 0 and mem["residuals"] > 0
    tx.loan = None
    tx.commit(torch.tensor(True))                            # a bad first step: zeros, as if none was kept
    assert not ef.residual("k").any()
    assert not momentum or not ef.velocity("k").any()


def test_ddp_lends_only_gradients_of_their_own():
    from commpress.hooks.ddp_loan import grad_loan, unlendable

    bucket = torch.zeros(30)
    g1, g2 = torch.zeros(10), torch.zeros(4, 5)
    assert grad_loan([g1, g2], bucket).room == 4 * 30
    assert grad_loan([g1, None], bucket) is None                   # a parameter without a gradient
    assert grad_loan([g1, bucket[10:20]], bucket) is None          # a view of the bucket
    assert grad_loan([g1, torch.zeros(5, 4).t()], bucket) is None  # not contiguous
    assert grad_loan([], bucket) is None

    class Model:
        gradient_as_bucket_view = False
    assert unlendable(Model()) is None
    Model.find_unused_parameters = True
    assert "find_unused_parameters" in unlendable(Model())


def test_a_units_stores_fill_its_largest_gradient_first():
    from commpress.hooks.ddp_loan import grad_loan

    grads = [torch.zeros(16), torch.zeros(1000), torch.zeros(8)]   # a bias, a weight, a bias
    loan = grad_loan(grads, torch.zeros(1024))
    codes, scales = torch.zeros(1024, dtype=torch.int8), torch.zeros(8)
    saved = loan.save((codes, scales))
    assert len(saved.pairs) == 2   # one piece each, both in the weight's gradient
    base = grads[1].untyped_storage().data_ptr()
    assert all(s.untyped_storage().data_ptr() == base for _, s in saved.pairs)
