"""Replicas never drift silently, and configurations that differ across ranks are refused.

* after every compressed DDP step all ranks hold bitwise-identical averaged
  gradients (a hash of every gradient, compared across ranks), for every
  compressor and every sparse allreduce algorithm, stochastic rounding included;
* verify mode (``verify_every=N`` or ``COMMPRESS_VERIFY=N``) catches a result
  perturbed on one rank and raises ``ReplicaMismatchError`` on every rank,
  naming the bucket and its parameters; without it the drift goes unnoticed
  (which shows the check is what catches it);
* a different compressor, parameters, options, world view or model on one rank
  raises at registration on every rank (DDP, FSDP2, and the bare collectives).
"""

from __future__ import annotations

import os

import pytest
import torch

import commpress
import commpress.collectives
from distributed import run
from faults import inject, torch_kernels
from relmodels import Net, grad_hashes, make_ddp, step

pytestmark = pytest.mark.reliability


# ------------------------------------------------------------------ bitwise replicas
CONSISTENCY = [
    ("topk", {"ratio": 0.05, "algorithm": "allgather"}),
    ("topk", {"ratio": 0.05, "algorithm": "recursive_doubling"}),
    ("topk", {"ratio": 0.05, "algorithm": "split"}),
    ("topk", {"ratio": 0.05, "algorithm": "hashed"}),
    ("dgc", {"ratio": 0.05, "density_warmup": 0}),  # past the warm-up (its 25% stage sends bf16 whole)
    ("threshold", {"threshold": 0.01}),
    ("randomk", {"ratio": 0.1}),
    ("blockquant", {"bits": 4}),
    ("blockquant", {"bits": 8, "stochastic": True}),
    ("qsgd", {"levels": 7}),
    ("terngrad", {}),
    ("signsgd", {}),
    ("powersgd", {"rank": 2}),
    ("fp16", {}),
    ("bf16", {}),
]  # every registered compressor but identity (which is DDP's own dense all_reduce)
STEPS = 4


def _replicas(rank, world):
    torch_kernels()
    out = []
    for name, params in CONSISTENCY:
        model = make_ddp()
        state = commpress.ddp.register(model, name, warmup_steps=1, min_numel=256, **params)
        hashes = []
        for i in range(STEPS):
            step(model, rank, i)
            hashes.append(grad_hashes(model))
        out.append({"hashes": hashes, "algorithms": dict(state.stats.algorithms)})
    return out


@pytest.mark.timeout(150)
def test_every_compressed_step_leaves_bitwise_identical_replicas():
    res = run(_replicas, 3, timeout=120, pg_timeout=60)
    for c, (name, params) in enumerate(CONSISTENCY):
        per_rank = [r[c] for r in res]
        for i in range(STEPS):
            assert per_rank[0]["hashes"][i] == per_rank[1]["hashes"][i] == per_rank[2]["hashes"][i], \
                (name, params, "step", i)
        # the compressed steps really were compressed (not the dense warm-up path)
        assert any(a != "dense" for a in per_rank[0]["algorithms"].values()), (name, per_rank[0]["algorithms"])


# ---------------------------------------------------------------------- verify mode
def _perturb_fc2(out):
    if out.numel() == 4096:                     # fc2.weight's compressed unit
        out = out.clone()
        out.view(-1)[7] += 1e-3
    return out


def _verify(rank, world):
    from commpress.hooks import ddp_step

    torch_kernels()
    if rank == 1:   # rank 1's compressed result of fc2 is off by 1e-3 in one element, every step
        inject(ddp_step, "allreduce", _perturb_fc2, nth=1, every=True)  # each unit's collective
    out = {}
    for label, every, env in (("arg", 1, None), ("env", None, "2"), ("off", 0, None)):
        if env is None:
            os.environ.pop("COMMPRESS_VERIFY", None)
        else:
            os.environ["COMMPRESS_VERIFY"] = env
        model = make_ddp()
        state = commpress.ddp.register(model, "topk", ratio=0.05, warmup_steps=1, min_numel=256,
                                       verify_every=every)
        res = {"verify_every": state.verify_every, "raised": None, "hashes": None}
        for i in range(4):
            try:
                step(model, rank, i)
            except Exception as exc:  # noqa: BLE001
                res["raised"] = (i, type(exc).__name__, str(exc))
                break
        res["hashes"] = grad_hashes(model)
        out[label] = res
    os.environ.pop("COMMPRESS_VERIFY", None)
    return out


@pytest.mark.timeout(150)
def test_verify_mode_names_the_bucket_of_an_injected_mismatch():
    r0, r1 = run(_verify, 2, timeout=120, pg_timeout=60)
    for r in (r0, r1):
        assert r["arg"]["verify_every"] == 1 and r["env"]["verify_every"] == 2
        # verify_every=1: the first compressed step (step 1; step 0 is dense warm-up)
        # verify_every=2 (env): step 1 is not checked, step 2 is
        for label, at in (("arg", 1), ("env", 2)):
            raised = r[label]["raised"]
            assert raised is not None, (label, r[label])
            i, typ, msg = raised
            assert (i, typ) == (at, "ReplicaMismatchError"), raised
            assert "DDP bucket" in msg and "fc2.weight" in msg and "differ across ranks" in msg, msg
            assert "ranks [1]" in msg, msg
        assert r["off"]["raised"] is None
    # without verification the perturbation drifts silently, in fc2.weight only
    assert r0["off"]["hashes"]["fc2.weight"] != r1["off"]["hashes"]["fc2.weight"]
    assert {k: v for k, v in r0["off"]["hashes"].items() if k != "fc2.weight"} == \
           {k: v for k, v in r1["off"]["hashes"].items() if k != "fc2.weight"}


# ------------------------------------------------------------------------ config drift
def _differ(rank, world, case):
    """What registration raised on this rank for a configuration that differs on one rank."""
    from commpress.hooks import ddp as cddp

    odd = rank == world - 1
    try:
        if case == "ddp:compressor":
            commpress.ddp.register(make_ddp(), "blockquant" if odd else "topk",
                                   **({} if odd else {"ratio": 0.05}))
        elif case == "ddp:params":
            commpress.ddp.register(make_ddp(), "topk", ratio=0.1 if odd else 0.05)
        elif case == "ddp:error_feedback":
            commpress.ddp.register(make_ddp(), "topk", ratio=0.05, error_feedback=not odd)
        elif case == "ddp:skip_policy":
            commpress.ddp.register(make_ddp(), "topk", ratio=0.05, min_numel=256,
                                   skip=(lambda n: n.startswith("fc2")) if odd else None)
        elif case == "ddp:world_view":
            # this rank believes in one more rank than there are (e.g. a stale WORLD_SIZE)
            if odd:
                original = cddp.DDPState.config
                cddp.DDPState.config = lambda self: {**original(self), "world_size": self.world_size + 1}
            commpress.ddp.register(make_ddp(), "topk", ratio=0.05)
        elif case == "collective:params":
            codec = commpress.get("blockquant", bits=4 if odd else 8)
            commpress.collectives.allreduce(torch.ones(4096), codec)
        elif case.startswith("fsdp:"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            torch.manual_seed(0)
            model = Net(hidden=65 if (odd and case == "fsdp:model") else 64)
            mesh = init_device_mesh("cpu", (world,))
            for m in (model.fc1, model.fc2, model.fc3, model):
                fully_shard(m, mesh=mesh)
            name, params = "topk", {"ratio": 0.05}
            if odd and case == "fsdp:compressor":
                name, params = "blockquant", {"bits": 8}
            if odd and case == "fsdp:params":
                params = {"ratio": 0.01}
            commpress.fsdp.register(model, name, **params)
        else:
            raise AssertionError(case)
        return None
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc)


DRIFT = {
    "ddp:compressor": ("ValueError", "compressor"),
    "ddp:params": ("ValueError", "compressor_params.ratio"),
    "ddp:error_feedback": ("ValueError", "error_feedback"),
    "ddp:skip_policy": ("ValueError", "dense_params"),
    "ddp:world_view": ("ValueError", "world_size"),
    "collective:params": ("CollectiveInputError", "compressor/configuration differs"),
    "fsdp:compressor": ("ValueError", "compressor"),
    "fsdp:params": ("ValueError", "compressor_params.ratio"),
    "fsdp:model": ("ValueError", "units"),
}


def _all_drift(rank, world):
    torch_kernels()
    return {case: _differ(rank, world, case) for case in DRIFT}


@pytest.mark.timeout(150)
def test_configuration_drift_raises_on_every_rank_at_registration():
    res = run(_all_drift, 3, timeout=120, pg_timeout=60)
    for case, (exc, words) in DRIFT.items():
        for rank, r in enumerate(res):
            got = r[case]
            assert got is not None, (case, rank, "did not raise")
            assert got[0] == exc and words in got[1], (case, rank, got)
            assert "rank 2" in got[1] or case.startswith("collective"), (case, rank, got)
