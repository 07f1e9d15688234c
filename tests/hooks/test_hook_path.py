"""The path of a bucket as users run it: the default backend (numba on CPU, no
``COMMPRESS_BACKEND`` override) and the overlap worker, DDP and FSDP2, in one
two-rank worker (one JIT warm-up for every check).

* ``register(model, "powersgd", rank=2, momentum=0.9)`` trains (it used to fail
  with ``KeyError: 'ddp:<hash>:2'`` at the first compressed step) and keeps
  replicas identical;
* a failure inside the hook surfaces from ``backward()`` on every rank as an
  error naming the bucket, the compressor and the cause;
* :func:`commpress.collectives.all_gather` decodes every rank's row, and a rank
  whose compress fails makes every rank raise ``CollectiveInputError``;
* FSDP2 with a compressed reduce-scatter (topk + error feedback) and the
  quantized all-gather trains with identical replicas;
* topk + error feedback with the ``1/P`` folded into the compensation pass trains
  bitwise like the ``mul_`` it replaces.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run

import commpress
from commpress.compressors.blockquant import BlockQuant
from commpress.compressors.topk import TopK


class FailingTopK(TopK):
    """topk whose compress raises on rank 1 from step ``at`` on (a fault injected through
    the public Compressor API, not by patching the collectives)."""

    name = "failing_topk"

    def __init__(self, at: int) -> None:
        super().__init__(ratio=0.05)
        self.at = at

    def compress_fixed(self, tensor, *, step=0, key=0, generator=None):
        if dist.get_rank() == 1 and step >= self.at:
            raise ArithmeticError("injected codec fault")
        return super().compress_fixed(tensor, step=step, key=key, generator=generator)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Linear(96, 8))


def _train(model, rank: int, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same_everywhere(t: torch.Tensor) -> bool:
    rows = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, t)
    return all(torch.equal(rows[0], r) for r in rows)


def _powersgd_momentum(rank: int) -> dict:
    model = DDP(_net())
    with commpress.ddp.register(model, "powersgd", rank=2, momentum=0.9) as state:
        _train(model, rank, 3)
        return {"overlap": state.overlap, "steps": state.step, "replicas": _same_everywhere(_flat(model)),
                "velocity": any(state.codec.velocity(u.key) is not None for u in state.units)}


def _hook_failure(rank: int) -> dict:
    model = DDP(_net())
    with commpress.ddp.register(model, FailingTopK(at=2), error_feedback=False, min_numel=256) as state:
        try:
            _train(model, rank, 4)
        except Exception as exc:  # noqa: BLE001 - what backward() raised
            return {"step": state.step, "message": str(exc), "cause": repr(state.last_error)}
    return {"step": state.step, "message": None}


def _all_gather(rank: int) -> dict:
    comp = commpress.get("blockquant", bits=8)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    rows = commpress.collectives.all_gather(x, comp, key="probe")
    mine = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) * (r + 1) for r in range(2)]
    expect = [comp.decompress(comp.compress_fixed(m)) for m in mine]
    ok = rows.shape == (2, 1000) and all(torch.equal(rows[r], expect[r]) for r in range(2))
    failing = FailingBlockQuant(rank)
    commpress.collectives.all_gather(x, failing, key="probe-fail")
    try:
        commpress.collectives.all_gather(x, failing, key="probe-fail", validate=False)
        raised = None
    except commpress.collectives.CollectiveInputError as exc:
        raised = str(exc)
    return {"rows": ok, "raised": raised}


class FailingBlockQuant(BlockQuant):
    """blockquant whose compress raises on rank 1 from its second call on."""

    def __init__(self, rank: int) -> None:
        super().__init__(bits=8)
        self.fail = rank == 1
        self.calls = 0

    def compress_fixed(self, tensor, *, step=0, key=0, generator=None):
        self.calls += 1
        if self.fail and self.calls > 1:
            raise ArithmeticError("injected codec fault")
        return super().compress_fixed(tensor, step=step, key=key, generator=generator)


def _fsdp(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _net()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = commpress.fsdp.register(model, "topk", ratio=0.1, all_gather="blockquant")
    _train(model, rank, 3)
    full = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    algos = set(state.stats.algorithms.values())
    return {"replicas": _same_everywhere(full.detach()), "finite": bool(torch.isfinite(full).all()),
            "algorithms": algos, "steps": state.step}


def _folded_scale(rank: int, world: int, name: str, **kw) -> dict:
    """The same training with the 1/P folded into error feedback and with the old mul_
    (a sparsifier folds it for the unit's key, a gather kind for its P chunk keys)."""
    from commpress.hooks import ddp_step

    flats, residuals = [], []
    for fold in (True, False):
        model = DDP(_net())
        with pytest.MonkeyPatch.context() as mp:
            if not fold:
                mp.setattr(ddp_step, "_scale_in_feedback", lambda cfg, *a: None)
            with commpress.ddp.register(model, name, min_numel=256, **kw) as state:
                _train(model, rank, 4)
                assert (ddp_step._scale_in_feedback(state.frozen) is not None) == fold
                flats.append(_flat(model))
                keys = [u.key for u in state.units] if name == "topk" else [
                    (u.key, r) for u in state.units for r in range(world)]
                residuals.append([state.codec.residual(k).clone() for k in keys])
    same = torch.equal(flats[0].view(torch.int32), flats[1].view(torch.int32)) and all(
        torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(*residuals))
    return {"bitwise": same, "units": len(residuals[0]),
            "nonzero": all(bool(r.abs().sum() > 0) for r in residuals[0])}


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {"powersgd": _powersgd_momentum(rank), "failure": _hook_failure(rank),
            "all_gather": _all_gather(rank), "fsdp": _fsdp(rank, world), "folded": _folded_scale(rank, world, "topk", ratio=0.05),
            "folded_gather": _folded_scale(rank, world, "blockquant", bits=4, error_feedback=True)}


@pytest.mark.timeout(240)
def test_the_default_backend_with_the_overlap_worker():
    for rank, out in enumerate(run(_worker, 2, timeout=220)):
        p = out["powersgd"]
        assert p["overlap"] and p["steps"] == 3 and p["replicas"] and p["velocity"], p
        f = out["failure"]
        assert f["step"] == 2 and f["message"] is not None, f   # warm-up, one good step, then the fault
        msg = f["message"]
        assert "bucket 0" in msg and "failing_topk" in msg and "rank(s) [1]" in msg, msg
        assert "Unable to cast" not in msg, msg
        assert ("injected codec fault" in msg) == (rank == 1), msg   # the cause, where it happened
        assert "CollectiveInputError" in f["cause"], f
        a = out["all_gather"]
        assert a["rows"], a
        assert a["raised"] is not None and "rank(s) [1]" in a["raised"], a
        s = out["fsdp"]
        assert s["replicas"] and s["finite"] and s["steps"] == 3, s
        assert "blockquant:all_gather" in s["algorithms"] and "topk:sparse_reduce_scatter" in s["algorithms"], s
        for folded in (out["folded"], out["folded_gather"]):
            assert folded["bitwise"] and folded["units"] >= 1 and folded["nonzero"], folded


def test_hook_error_names_bucket_compressor_and_cause_for_any_cause():
    from commpress.collectives import CollectiveInputError
    from commpress.ddp import HookError, ReplicaMismatchError
    from commpress.hooks.ddp import hook_error

    for cause in (RuntimeError("gloo: connection closed"), KeyError("k"), ArithmeticError("a"),
                  ReplicaMismatchError("r"), CollectiveInputError("c"), TypeError("t")):
        err = hook_error(cause, 3, "ef(topk)", None)
        assert isinstance(err, HookError), cause
        assert isinstance(err, type(cause)) == isinstance(cause, (ValueError, TypeError, RuntimeError)), cause
        msg = str(err)
        assert "bucket 3" in msg and "ef(topk)" in msg and type(cause).__name__ in msg, msg
