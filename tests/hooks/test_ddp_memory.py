"""What the DDP hook keeps alive between steps: lean residual storage, and stats that tell the truth."""

from __future__ import annotations

import io

import pytest
import torch

from distributed import run

import commpress
import commpress.auto
from commpress.storage import bytes_per_element

from test_ddp import batch, loss_of, make_ddp   # noqa: E402  (tests/hooks is on the path)
from memory_walk import storages_bytes


def _train(rank, model, opt, steps, first=0):
    for step in range(first, first + steps):
        opt.zero_grad()
        loss_of(model, *batch(rank, step, seed=3)).backward()
        opt.step()


def _run(rank, world, compressor, params, storage, steps, rollback="step", view=False):
    model = make_ddp(seed=3, bucket_cap_mb=25, gradient_as_bucket_view=view)   # one bucket: the fused CPU lanes
    state = commpress.ddp.register(model, compressor, warmup_steps=1, residual_storage=storage,
                                   rollback=rollback, **params)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(rank, model, opt, steps)
    mem = state.stats.as_dict()["memory"]
    from commpress.collectives import _comm   # the collectives' reusable buffers: process-wide
    counted = storages_bytes([state, [c.values() for c in _comm._CACHES]],
                             exclude=[p for p in model.parameters()] + [p.grad for p in model.parameters()])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, buf)
    # resume from the checkpoint into a new model and hook, then one more step each
    b = make_ddp(seed=9, bucket_cap_mb=25, gradient_as_bucket_view=view)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    b.load_state_dict(ckpt["model"])
    s_b = commpress.ddp.register(b, compressor, warmup_steps=1, residual_storage=storage,
                                 rollback=rollback, **params)
    o_b = torch.optim.SGD(b.parameters(), lr=0.1)
    o_b.load_state_dict(ckpt["opt"])
    s_b.load_state_dict(ckpt["hook"])
    _train(rank, model, opt, 2, steps)
    _train(rank, b, o_b, 2, steps)
    resumed = all(torch.equal(x, y) for x, y in zip(model.parameters(), b.parameters()))
    weights = [p.detach().numpy().copy() for p in model.parameters()]
    compressed = sum(p.numel() for p in model.parameters() if p.dim() > 1)
    state.close()
    s_b.close()
    return mem, counted, resumed, weights, compressed


@pytest.mark.timeout(200)
@pytest.mark.parametrize("compressor,params", [("topk", {"ratio": 0.05}), ("blockquant", {"bits": 4})])
def test_lean_storage_trains_identical_replicas_and_counts_what_it_keeps(compressor, params):
    figures, weights = {}, {}
    cases = (("fp32", "step", False), ("int8", "step", False), ("int8", "unit", False), ("int4", "step", False),
             ("int8", "step", True))
    for storage, rollback, view in cases:
        res = run(_run, 2, compressor, params, storage, 4, rollback, view, timeout=180)
        (mem, counted, resumed, w0, compressed), (_, _, _, w1, _) = res
        assert all((a == b).all() for a, b in zip(w0, w1)), "replicas differ"
        assert resumed, "the resume from a checkpoint is not bitwise"
        assert mem["bytes"] == sum(mem["by_kind"].values()) == counted
        if storage == "fp32":   # one fp32 residual per compressed element (the small layers go dense)
            elements = mem["by_kind"]["residuals"] // 4
            assert 0 < elements <= compressed
        per = bytes_per_element(storage)
        assert per * elements <= mem["by_kind"]["residuals"] <= per * elements + 3 * 132   # int8: 3 padded blocks
        # the fused CPU lanes (open_fused(scratch=True)) and the general path (compress(scratch=True):
        # the unit's input is the call's output) compensate in the unit's own input and write the next
        # residual over it: no fp32 work buffer of a key's size
        assert mem["by_kind"]["working"] == 0, mem
        # no pending residual between steps: rollback="unit" commits each unit at its verdict, and a
        # lean "step" keeps the old codes in DDP's gradients until the step's (commpress.loan); fp32,
        # and lean storage where the gradients are the buckets (gradient_as_bucket_view), one per key
        lent = storage != "fp32" and not view
        assert mem["by_kind"]["pending"] == (0 if rollback == "unit" or lent else mem["by_kind"]["residuals"])
        # what grows with the model (the work buffers are of the largest unit's size, here the model's)
        figures[storage, rollback, view] = mem["by_kind"]["residuals"] + mem["by_kind"]["pending"]
        weights[storage, rollback, view] = w0
    # lent or pending, the same residuals: the same training, bitwise
    assert all((a == b).all() for a, b in zip(weights["int8", "step", False], weights["int8", "step", True]))
    assert figures["int8", "step", True] < 0.3 * figures["fp32", "step", False]
    assert figures["int8", "step", False] == figures["int8", "unit", False] < 0.6 * figures["int8", "step", True]
    assert figures["int4", "step", False] < 0.6 * figures["int8", "step", False]


def test_residual_storage_is_checked():
    with pytest.raises(ValueError, match="residual_storage must be one of"):
        commpress.ddp.DDPState("topk", ratio=0.01, residual_storage="fp4")
    with pytest.raises(ValueError, match="rollback must be one of 'step', 'unit'"):
        commpress.ddp.DDPState("topk", ratio=0.01, rollback="bucket")


def _unit_residuals(state):
    """{unit's parameter names: its residual and velocity (fp32 copies, or None)}."""
    def copy(t):
        return None if t is None else t.clone().reshape(-1)
    return {tuple(u.names): (copy(state.codec.residual(u.key)), copy(state.codec.velocity(u.key)))
            for u in state.units}


def _same(a, b):
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))


def _nonfinite_in(rank, world, rollback, poisoned, overlap=False, view=False, momentum=False):
    from test_ddp import SMALL_CAP_MB, fast_ops
    fast_ops()
    # a bucket per parameter: a unit each
    model = make_ddp(seed=4, bucket_cap_mb=SMALL_CAP_MB, gradient_as_bucket_view=view)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if momentum else 0.0)
    state = commpress.ddp.register(model, "topk", ratio=0.05, warmup_steps=1, rollback=rollback, overlap=overlap,
                                   optimizer=opt if momentum else None)
    inject = {"on": False}

    def poison(g):
        if inject["on"] and rank == 1:
            g = g.clone()
            g.view(-1)[0] = float("inf")
        return g

    getattr(model.module, poisoned).weight.register_hook(poison)
    _train(rank, model, opt, 3)
    pending_between_steps = state.stats.as_dict()["memory"]["by_kind"]["pending"]
    before = _unit_residuals(state)
    inject["on"] = True
    opt.zero_grad()
    loss_of(model, *batch(rank, 3, seed=3)).backward()   # skipped, as GradScaler would
    after = _unit_residuals(state)
    order = [tuple(u.names) for u in state.units]           # the order the units ran in
    # DDP's averages reached every gradient (none left with lent codes): equal on both ranks
    grads = [p.grad.clone() for p in model.parameters()]
    state.close()
    return pending_between_steps, order, {k: _same(before[k], after[k]) for k in before}, grads


@pytest.mark.timeout(200)
@pytest.mark.parametrize("poisoned", ["fc2", "fc1"])   # compressed (fc3 goes dense); fc2 runs first
def test_rollback_unit_keeps_no_pending_and_keeps_the_units_from_the_bad_one_on(poisoned):
    cases = [("step", False, False, False), ("step", True, False, False), ("step", True, True, False),
             ("step", True, False, True), ("unit", False, False, False)]
    for rollback, overlap, view, momentum in cases:   # momentum: optimizer= (a velocity per unit too)
        res = run(_nonfinite_in, 2, rollback, poisoned, overlap, view, momentum, timeout=100)
        for pending, order, kept, grads in res:
            first_bad = [names[0].startswith(f"module.{poisoned}.") or names[0].startswith(f"{poisoned}.")
                         for names in order].index(True)
            if rollback == "step":   # every residual as it was: the old codes lent to DDP's gradients
                assert all(kept.values()), (overlap, view)   # (with the overlap worker too)
                assert pending == (0 if not view else pending) and (pending > 0) == view
            else:                    # no pending copy; the bad unit and every later one keep theirs
                assert pending == 0
                assert [kept[names] for names in order] == [i >= first_bad for i in range(len(order))]
        assert all(torch.equal(a, b, ) if torch.isfinite(a).all() else torch.isnan(b).any()
                   for a, b in zip(res[0][3], res[1][3]))


def _momentum_memory(rank, world, rollback):
    model = make_ddp(seed=3, bucket_cap_mb=25)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = commpress.ddp.register(model, "topk", ratio=0.05, warmup_steps=1, optimizer=opt,
                                   residual_storage="int8", rollback=rollback)
    _train(rank, model, opt, 3)
    mem = state.stats.as_dict()["memory"]["by_kind"]
    weights = [p.detach().numpy().copy() for p in model.parameters()]
    state.close()
    return mem, weights


@pytest.mark.timeout(120)
def test_rollback_unit_keeps_no_pending_velocity_either():
    for rollback in ("step", "unit"):
        (mem, w0), (_, w1) = run(_momentum_memory, 2, rollback, timeout=100)
        assert all((a == b).all() for a, b in zip(w0, w1))
        assert mem["velocities"] > 0      # the momentum taken over from SGD
        # kept as the residuals are (int8: the same bytes), computed in the unit's input: no work buffer
        assert mem["velocities"] == mem["residuals"] and mem["working"] == 0, mem
        # no pending copy either way: "unit" commits each unit at its verdict, "step" lends the old
        # codes to DDP's gradients (commpress.loan)
        assert mem["pending"] == mem["velocities_pending"] == 0


@pytest.mark.timeout(200)
def test_auto_on_dense_keeps_no_work_or_decode_buffer():
    """``"auto"``'s dense choice runs under error feedback (a residual carried from a switch has a
    home): the 1/P is folded into its compensation pass, done in the unit's own input (the call's
    output), and identity's residual after a send is zero without a decode.  Before, it kept an fp32
    work buffer, a decoded live residual and a decode buffer: 12 bytes per parameter of the unit."""
    opts = {"auto": commpress.auto.Options(candidates=[("dense",)])}
    (mem, counted, resumed, w0, _), (_, _, _, w1, _) = run(_run, 2, "auto", opts, "int8", 4, timeout=180)
    assert all((a == b).all() for a, b in zip(w0, w1)) and resumed
    assert mem["bytes"] == sum(mem["by_kind"].values()) == counted
    assert mem["by_kind"]["working"] == 0 and mem["by_kind"]["decode"] == 0, mem
