"""Explicit binding of a model-free DDPState: ``state.bind(model)`` and Lightning's BindCallback.

A state nobody bound still finds its model at the first bucket, with a DeprecationWarning (the
live-object scan goes away); a state bound explicitly never scans.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from distributed import run
from test_ddp import batch, fast_ops, loss_of, make_ddp

import commpress
from commpress.hooks import ddp as ddp_module
from commpress.hooks.ddp import DDPState, hook
from commpress.integrations.lightning import BindCallback


def _train(model, rank, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, *batch(rank, step, seed=11)).backward()
        opt.step()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _no_scan(*_):
    raise AssertionError("an explicitly bound state scanned the live objects")


class _Strategy:
    def __init__(self, model):
        self.model = model


class _Trainer:
    """What BindCallback reads of a Lightning Trainer: ``trainer.strategy.model``."""

    def __init__(self, model):
        self.strategy = _Strategy(model)


def _explicit(rank, world):
    fast_ops()
    ddp_module._model_of = _no_scan    # this rank's module: binding must not scan
    eager = make_ddp(seed=4)
    s_eager = commpress.ddp.register(eager, "topk", ratio=0.05)

    bound = make_ddp(seed=4)
    s_bound = DDPState("topk", ratio=0.05)
    before = s_bound.bound
    s_bound.bind(bound)                                  # every rank, before the first step
    bound.register_comm_hook(s_bound, hook)

    # Lightning: setup sees the LightningModule (not wrapped yet), on_fit_start the DDP model
    net = make_ddp(seed=4)
    s_cb = DDPState("topk", ratio=0.05)
    cb = BindCallback(s_cb, register_hook=True)
    trainer = _Trainer(net.module)
    cb.setup(trainer, net.module, "fit")
    after_setup = s_cb.bound
    trainer.strategy.model = net
    cb.on_fit_start(trainer, net.module)
    cb.on_fit_start(trainer, net.module)                 # a second fit start does nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for model in (eager, bound, net):
            _train(model, rank)
    out = (before, s_bound.bound, after_setup, s_cb.bound, s_bound.step, s_cb.step,
           torch.equal(_flat(eager), _flat(bound)), torch.equal(_flat(eager), _flat(net)),
           _flat(bound).numpy().copy())
    for s in (s_eager, s_bound, s_cb):
        s.close()
    return out


@pytest.mark.timeout(120)
def test_bind_and_lightning_callback_bind_explicitly_and_match_register():
    res = run(_explicit, 2, timeout=100)
    for before, bound, after_setup, cb_bound, step, cb_step, same, same_cb, _ in res:
        assert not before and bound
        assert not after_setup and cb_bound
        assert step == cb_step == 3
        assert same and same_cb           # bitwise the run of commpress.ddp.register
    assert (res[0][-1] == res[1][-1]).all()


def _unbound(rank, world):
    fast_ops()
    model = make_ddp(seed=2)
    state = DDPState("topk", ratio=0.05)
    model.register_comm_hook(state, hook)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, rank, steps=2)
    state.close()
    return [(w.category.__name__, str(w.message)) for w in caught], state.bound, state.step


@pytest.mark.timeout(120)
def test_a_state_never_bound_still_binds_at_its_first_bucket_with_a_deprecation_warning():
    for caught, bound, step in run(_unbound, 2, timeout=100):
        assert bound and step == 2
        deprecations = [m for c, m in caught if c == "DeprecationWarning" and "commpress ddp" in m]
        assert len(deprecations) == 1, caught      # once, at the binding
        assert "state.bind(ddp_model)" in deprecations[0] and "BindCallback" in deprecations[0]


def test_the_fallback_names_the_explicit_binding_when_no_model_holds_the_bucket():
    with pytest.raises(RuntimeError, match=r"not bound to a model.*state\.bind\(ddp_model\)"):
        ddp_module._model_of([torch.zeros(3, requires_grad=True)])


def test_bind_callback_checks_its_arguments_and_the_strategy_model():
    state = DDPState("topk", ratio=0.01)
    with pytest.raises(TypeError, match="DDPState"):
        BindCallback("topk")
    with pytest.raises(TypeError, match="register_hook"):
        BindCallback(state, register_hook=1)
    cb = BindCallback(state)
    cb.setup(_Trainer(nn.Linear(2, 2)), None, "fit")     # not wrapped yet: nothing happens
    assert not state.bound
    with pytest.raises(TypeError, match="not a DistributedDataParallel"):
        cb.on_fit_start(_Trainer(nn.Linear(2, 2)), None)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        state.bind(nn.Linear(2, 2))
    state.close()
