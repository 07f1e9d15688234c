"""``register(model, "auto", residual_storage="int8", rollback="unit")``: every unit's error feedback
keeps its residual lean, a switch carries it, replicas stay identical, a resume is bitwise."""

from __future__ import annotations

import io
import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run
from nets import MLP3 as Net, train_step, with_params

import commpress
from commpress.auto import Network
from commpress.auto.runtime import AutoSpec
from commpress.collectives.costmodel import CostModel
from commpress.storage import LeanTensor

SLOW = CostModel(1e-3, 1e-6)     # 1 MB/s: compressing pays
FAST = CostModel(1e-7, 1e-13)    # nothing to gain: dense


def _register(model, opt):
    return commpress.ddp.register(model, "auto", optimizer=opt, min_numel=256, residual_storage="int8",
                                  rollback="unit", auto=AutoSpec(check_every=2, every=2, margin=0.0,
                                                                 remeasure=False, candidates=[("blockquant", 4)]))


def _worker(rank, world):
    os.environ["COMMPRESS_BACKEND"] = "torch"
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = _register(model, opt)
    state.codec.network = Network(world, SLOW)
    for step in range(5):   # check points end steps 0, 2 and 4 (the early one: a window of measured steps)
        train_step(model, opt, rank, step)
    codecs = state.codec.codecs
    lean = {k: [type(v).__name__ for v in c._residuals.values()] for k, c in codecs.items()}
    choices = sorted(e["choice"] for e in state.stats.as_dict()["auto"].values())
    mem = state.stats.as_dict()["memory"]["by_kind"]
    buf = io.BytesIO()
    torch.save({"hook": state.state_dict(), "params": [p.detach().clone() for p in model.parameters()],
                "opt": opt.state_dict()}, buf)
    state.codec.network = Network(world, FAST)   # back to dense at the next check point: residuals carried
    for step in range(5, 9):
        train_step(model, opt, rank, step)
    after = sorted(e["choice"] for e in state.stats.as_dict()["auto"].values())
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    state.close()
    # resume from the end of step 4: bitwise through step 8
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    model2 = DDP(with_params(Net(), ckpt["params"]), bucket_cap_mb=0.01)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05, momentum=0.9)
    opt2.load_state_dict(ckpt["opt"])
    state2 = _register(model2, opt2)
    state2.codec.network = Network(world, FAST)
    state2.load_state_dict(ckpt["hook"])
    for step in range(5, 9):
        train_step(model2, opt2, rank, step)
    resumed = torch.cat([p.detach().reshape(-1) for p in model2.parameters()])
    state2.close()
    return {"lean": lean, "choices": choices, "after": after, "mem": mem, "params": params, "resumed": resumed}


@pytest.mark.timeout(120)
def test_auto_keeps_lean_residuals_and_resumes_bitwise():
    a, b = run(_worker, 2, timeout=110)
    assert torch.equal(a["params"], b["params"])                       # replicas identical
    assert set(a["choices"]) == {"blockquant(bits=4)"}, a["choices"]   # the slow network: compressed
    stored = [kind for kinds in a["lean"].values() for kind in kinds]
    assert stored and set(stored) == {LeanTensor.__name__}, a["lean"]   # every unit's residual int8
    assert a["mem"]["pending"] == 0 and a["mem"]["residuals"] > 0       # rollback="unit": no pending copy
    assert a["after"] != a["choices"]                                   # switched back to dense
    assert torch.equal(a["resumed"], a["params"]) and torch.equal(b["resumed"], b["params"])
