"""register(..., optimizer=opt) / state.attach_optimizer(opt): the hook takes over the optimizer's SGD momentum
(DGC's momentum correction), puts it back on close(), checkpoints the velocity; and the sparsifiers' density warm-up
seen through the hook."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run
from loglines import capture
from nets import small_net as _net, train_step as _step

import commpress
from commpress.hooks.optimizer import MARK, sgd_momentum

KW = dict(ratio=0.05, min_numel=256, density_warmup=4, overlap=False)


def _sgd(model, momentum=0.9):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def takeover_worker(rank, world):
    lines = capture()
    out = {}
    # A: register(optimizer=) -- a stale momentum buffer is dropped
    a = DDP(_net())
    opt_a = _sgd(a)
    opt_a.state[next(a.parameters())]["momentum_buffer"] = torch.ones(1)
    st_a = commpress.ddp.register(a, "topk", optimizer=opt_a, **KW)
    out["a_taken"] = (st_a.momentum, opt_a.param_groups[0]["momentum"], opt_a.param_groups[0][MARK],
                      any("momentum_buffer" in s for s in opt_a.state.values()))
    # B: the manual recipe, momentum= and an optimizer without momentum
    b = DDP(_net())
    opt_b = _sgd(b, momentum=0.0)
    st_b = commpress.ddp.register(b, "topk", momentum=0.9, **KW)
    # C: attach_optimizer after register (the optimizer made after the hook)
    c = DDP(_net())
    st_c = commpress.ddp.register(c, "topk", **KW)
    opt_c = _sgd(c)
    out["c_attached"] = st_c.attach_optimizer(opt_c)
    # D: a lazy state (Lightning's ddp_comm_state), the optimizer attached before its first bucket
    d = DDP(_net())
    st_d = commpress.ddp.DDPState("topk", **KW)
    d.register_comm_hook(st_d, commpress.ddp.hook)
    opt_d = _sgd(d)
    st_d.attach_optimizer(opt_d)
    sent = []
    for step in range(6):
        for model, opt in ((a, opt_a), (b, opt_b), (c, opt_c), (d, opt_d)):
            _step(model, opt, rank, step)
        sent.append(st_a.stats.last_step["units"])
    out["d_momentum"] = (st_d.momentum, opt_d.param_groups[0]["momentum"])
    pb = _params(b)
    out["equal"] = [all(torch.equal(x, y) for x, y in zip(_params(m), pb)) for m in (a, c, d)]
    out["moved"] = not all(torch.equal(x, y) for x, y in zip(pb, _params(_net())))
    # payload per step: the density warm-up (4 steps from 25% to 5%) shrinks it, then it stays
    out["unit_bytes"] = [sum(u["bytes_sent"] for k, u in s.items()) for s in sent]
    for st in (st_a, st_c, st_d):
        st.close()
    out["restored"] = [(o.param_groups[0]["momentum"], MARK in o.param_groups[0]) for o in (opt_a, opt_c, opt_d)]
    # Adam: one line, nothing changed
    e = DDP(_net())
    adam = torch.optim.Adam(e.parameters(), lr=1e-3)
    before = {k: v for k, v in adam.param_groups[0].items() if k != "params"}
    n_lines = len(lines.lines)
    st_e = commpress.ddp.register(e, "topk", optimizer=adam, **KW)
    out["adam"] = (st_e.momentum, before == {k: v for k, v in adam.param_groups[0].items() if k != "params"},
                   [m for m in lines.lines[n_lines:] if "no SGD momentum" in m])
    # a sparsifier with an adaptive optimizer: one warning; blockquant with it, or topk with SGD: none
    out["adaptive_warned"] = [m for m in lines.lines[n_lines:] if "adaptive optimizer" in m]
    f = DDP(_net())
    n_lines = len(lines.lines)
    st_f = commpress.ddp.register(f, "blockquant", bits=4, optimizer=torch.optim.AdamW(f.parameters()),
                                  min_numel=256, overlap=False)
    out["blockquant_adam_warned"] = [m for m in lines.lines[n_lines:] if "adaptive optimizer" in m]
    out["sgd_warned"] = [m for m in lines.lines if "adaptive optimizer" in m and "SGD" in m]
    for st in (st_b, st_e, st_f):
        st.close()
    return out


@pytest.mark.timeout(120)
def test_takeover_matches_the_manual_recipe_and_restores_the_optimizer():
    for out in run(takeover_worker, 2, timeout=110):
        assert out["a_taken"] == (0.9, 0.0, 0.9, False)
        assert out["c_attached"] == 0.9 and out["d_momentum"] == (0.9, 0.0)
        assert out["moved"] and out["equal"] == [True, True, True]
        assert out["restored"] == [(0.9, False)] * 3
        momentum, unchanged, adam_lines = out["adam"]
        assert momentum == 0.0 and unchanged and len(adam_lines) == 1
        warned = out["adaptive_warned"]
        assert len(warned) == 1 and "topk" in warned[0] and "Adam" in warned[0], warned
        assert out["blockquant_adam_warned"] == [] and out["sgd_warned"] == []
        b = out["unit_bytes"]  # step 0: the hook's dense step; stages 25% (1), 11% (2, 3), 5% (4, 5)
        assert b[1] >= b[2] == b[3] > b[4] == b[5], b


def resume_worker(rank, world):
    kw = dict(KW, density_warmup=6)
    ref = DDP(_net())
    opt_ref = _sgd(ref)
    st_ref = commpress.ddp.register(ref, "topk", optimizer=opt_ref, **kw)
    for step in range(8):
        _step(ref, opt_ref, rank, step)
    first = DDP(_net())
    opt1 = _sgd(first)
    st1 = commpress.ddp.register(first, "topk", optimizer=opt1, **kw)
    for step in range(4):
        _step(first, opt1, rank, step)
    buf = io.BytesIO()
    torch.save({"hook": st1.state_dict(), "model": first.module.state_dict(), "opt": opt1.state_dict()}, buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    out = {"velocities": "velocities" in saved["hook"]["codec"] and "dense_velocity" in saved["hook"]["extra"]}
    results = []
    for opt_first in (False, True):  # the optimizer's state loaded after, then before, registering
        m = DDP(_net())
        m.module.load_state_dict(saved["model"])
        opt = _sgd(m)
        if opt_first:
            opt.load_state_dict(saved["opt"])
        st = commpress.ddp.register(m, "topk", optimizer=opt, **kw)
        if not opt_first:
            opt.load_state_dict(saved["opt"])
        st.load_state_dict(saved["hook"])
        for step in range(4, 8):
            _step(m, opt, rank, step)
        results.append(all(torch.equal(x, y) for x, y in zip(_params(m), _params(ref))))
        st.close()
        results.append(opt.param_groups[0]["momentum"] == 0.9)
    out["resumed"] = results
    for st in (st_ref, st1):
        st.close()
    return out


@pytest.mark.timeout(120)
def test_takeover_resumes_bitwise():
    for out in run(resume_worker, 2, timeout=110):
        assert out["velocities"]
        assert out["resumed"] == [True] * 4


def fsdp_worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def sharded():
        model = _net()
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
        return model

    from loglines import capture

    a, b = sharded(), sharded()
    opt_a, opt_b = _sgd(a), _sgd(b, momentum=0.0)
    lines = capture()
    st_a = commpress.fsdp.register(a, "topk", ratio=0.05, density_warmup=2, optimizer=opt_a)
    told = [ln for ln in lines.lines if "velocity of every unit's whole gradient" in ln]
    st_b = commpress.fsdp.register(b, "topk", ratio=0.05, density_warmup=2, momentum=0.9)
    out = {"taken": (st_a.momentum, opt_a.param_groups[0]["momentum"]), "told": told,
           "storage": (st_a.residual_storage, st_a.codec.storage, st_b.residual_storage)}
    for step in range(4):
        _step(a, opt_a, rank, step)
        _step(b, opt_b, rank, step)
    out["equal"] = all(torch.equal(x.full_tensor(), y.full_tensor())
                       for x, y in zip(a.parameters(), b.parameters()))
    st_a.close()
    st_b.close()
    out["restored"] = opt_a.param_groups[0]["momentum"]
    return out


@pytest.mark.timeout(120)
def test_takeover_through_fsdp2():
    for out in run(fsdp_worker, 2, timeout=110):
        assert out["taken"] == (0.9, 0.0)
        assert len(out["told"]) == 1 and "2.06 bytes per parameter of the model (int8, live + pending)" in out["told"][0]   # its memory, said
        assert out["equal"]
        assert out["restored"] == 0.9
        # a sparsifier's int4 default is for error feedback without momentum: optimizer= (and
        # momentum=) keep residuals and velocities in int8
        assert out["storage"] == ("int8", "int8", "int8")


def test_fsdp2_keeps_a_sparsifiers_residuals_in_int4_by_default_without_momentum():
    from commpress.hooks.fsdp import FSDPState

    assert FSDPState("topk", ratio=0.01).codec.storage == "int4"
    assert FSDPState("dgc", ratio=0.01).residual_storage == "int4"
    assert FSDPState(commpress.get("topk", ratio=0.01)).residual_storage == "int4"
    assert FSDPState("topk", ratio=0.01, momentum=0.9).residual_storage == "int8"
    assert FSDPState("topk", ratio=0.01, residual_storage="int8").residual_storage == "int8"   # as given
    assert FSDPState("blockquant", bits=4, stochastic=False).residual_storage == "int8"      # a quantizer
    assert FSDPState("auto").residual_storage == "int8"


# ------------------------------------------------------------------ what can be taken over (no processes)
def _covered(model):
    return {id(p) for p in model.parameters()}


def test_what_cannot_be_taken_over_raises_naming_the_group():
    model = _net()
    cov = _covered(model)
    with pytest.raises(ValueError, match="nesterov"):
        sgd_momentum(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True), cov)
    with pytest.raises(ValueError, match="dampening"):
        sgd_momentum(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.1), cov)
    two = torch.optim.SGD([{"params": model[0].parameters(), "momentum": 0.9},
                           {"params": model[2].parameters(), "momentum": 0.5}], lr=0.1)
    with pytest.raises(ValueError, match="different momenta"):
        sgd_momentum(two, cov)
    extra = nn.Linear(2, 2)
    mixed = torch.optim.SGD(list(model.parameters()) + list(extra.parameters()), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="param group 0 holds both"):
        sgd_momentum(mixed, cov)
    with pytest.raises(TypeError, match="optimizer must be"):
        sgd_momentum(object(), cov)
    # groups of other parameters are left out; SGD without momentum or Adam: nothing to take over
    apart = torch.optim.SGD([{"params": model.parameters()}, {"params": extra.parameters(), "momentum": 0.5}],
                            lr=0.1, momentum=0.9)
    assert sgd_momentum(apart, cov) == 0.9
    assert sgd_momentum(torch.optim.SGD(model.parameters(), lr=0.1), cov) == 0.0
    assert sgd_momentum(torch.optim.AdamW(model.parameters()), cov) == 0.0


def test_weight_decay_is_taken_over_with_a_log_line(caplog):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    with caplog.at_level(logging.INFO, logger="commpress"):
        assert sgd_momentum(opt, _covered(model)) == 0.9
    assert any("weight_decay" in r.getMessage() for r in caplog.records)
