"""The DDP hook on the pipelined ``gather_all`` (one all_gather per chunk, where the calibrated link puts a
chunk long enough on the wire): training is bitwise the one-message run, the bucket's dense part still
rides (no all_reduce of its own), and the step makes one round per chunk; with the buckets joined
(``join_buckets``) the held units ride in the last unit's first chunk: P rounds a step."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run
from nets import MLP3 as Net, train_step

import commpress
from commpress.collectives import joint, quantized, set_cost_model


def pipeline_hook_worker(rank, world):
    set_cost_model(1e-4, 1e-5)   # a slow link: every unit's chunk is long on the wire
    out = {}
    for mode, threshold, join in (("one", math.inf, False), ("piped", 0.0, False), ("joined", math.inf, True),
                                  ("joined-piped", 0.0, True)):
        quantized.PIPELINE_MIN_WIRE_S = threshold
        joint.HOLD_MAX_WIRE_S = math.inf   # held however long on the wire (its limit: test_ddp_joint.py)
        torch.manual_seed(0)
        model = DDP(Net(), bucket_cap_mb=0.01)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        state = commpress.ddp.register(model, "blockquant", bits=4, min_numel=256, join_buckets=join)
        rounds = []
        for step in range(5):
            train_step(model, opt, rank, step)
            rounds.append(state.stats.last_step["rounds"])
        out[mode] = dict(params=torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                         rounds=rounds, algorithms=sorted(set(state.stats.algorithms.values())))
        state.close()
    set_cost_model(None)
    return out


@pytest.mark.timeout(120)
def test_hook_on_the_pipelined_gather_all_trains_bitwise_as_one_message():
    res = run(pipeline_hook_worker, 2, timeout=110)
    for r in res:
        one, piped = r["one"], r["piped"]
        assert torch.equal(one["params"], piped["params"])            # bitwise the same training
        assert torch.equal(piped["params"], res[0]["piped"]["params"])  # and the same replicas
        assert one["algorithms"] == piped["algorithms"] == ["gather_all"], (one, piped)
        # steps 1..4 compressed (step 0 is the warm-up): a round per unit (its dense part riding), and
        # pipelined a round per chunk, 2 at P=2
        assert one["rounds"][1:] and all(n > 0 for n in one["rounds"][1:]), one["rounds"]
        assert piped["rounds"][1:] == [2 * n for n in one["rounds"][1:]], (one["rounds"], piped["rounds"])
        # joined: every unit's message in the last unit's flight (pipelined: its first chunk's), bitwise alike
        assert one["rounds"][1] > 1, one["rounds"]
        assert r["joined"]["rounds"][1:] == [1] * 4 and r["joined-piped"]["rounds"][1:] == [2] * 4, r
        for mode in ("joined", "joined-piped"):
            assert torch.equal(r[mode]["params"], one["params"]), mode
            assert r[mode]["algorithms"] == ["gather_all"], r[mode]
