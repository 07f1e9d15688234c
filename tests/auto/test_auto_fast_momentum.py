"""``"auto"`` with ``optimizer=`` (momentum correction) on an all-dense plan: the steps between
check windows run DDP's own ``all_reduce`` with each unit's velocity applied in the ``1/P``
pass (:func:`commpress.hooks.ddp._dense_momentum_async`), and compute exactly what the units'
path computes (2 ranks: parameters, velocities and the optimizer bitwise equal to a run forced
through the units' path); a step whose sum holds a NaN keeps every velocity as it was."""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run
from nets import MLP3 as Net, train_step

import commpress
from commpress.auto import Network
from commpress.collectives.costmodel import CostModel

FAST = CostModel(1e-7, 1e-13)    # nothing to gain: dense everywhere


def _velocities(state) -> dict:
    auto = state.codec
    out = {f"unit:{k}": c.velocity(k).clone() for k, c in auto.codecs.items() if c.velocity(k) is not None}
    out.update({f"dense:{k}": v.clone() for k, v in auto.home.dense_velocities().items()})
    return out


def _run(rank: int, world: int, forced_units_path: bool, steps: int = 10, nan_step: int | None = None,
         backend: str = "torch", nan_in: str | None = None):
    os.environ["COMMPRESS_BACKEND"] = backend
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.01)   # several buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = commpress.ddp.register(model, "auto", optimizer=opt, min_numel=256,
                                   auto=commpress.auto.Options(check_every=6, remeasure=False))
    state.codec.network = Network(world, FAST)
    if forced_units_path:
        state.codec.fast = lambda step: None
    one_pass, real_unit = [], state.codec.velocity_unit
    state.codec.velocity_unit = lambda *a: one_pass.append(real_unit(*a)) or one_pass[-1]
    paths, kept = [], None
    for step in range(steps):
        if step == nan_step:
            before = _velocities(state)
            with torch.no_grad():   # this rank's gradient is NaN everywhere: so is every bucket's sum
                scale = float("nan") if rank == 1 else 1.0
                handle = [p.register_hook(lambda g, s=scale: g * s) for n, p in model.module.named_parameters()
                          if nan_in is None or n == nan_in]
            train_step(model, opt, rank, step)
            for h in handle:
                h.remove()
            after = _velocities(state)
            kept = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        else:
            train_step(model, opt, rank, step)
        paths.append(sorted({u["algorithm"] for u in state.stats.last_step["units"].values()}))
    out = {"paths": paths, "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
           "velocities": _velocities(state), "choices": sorted(e["choice"] for e in state.stats.as_dict()["auto"].values()),
           "opt_momentum": [g["momentum"] for g in opt.param_groups], "kept": kept, "one_pass": one_pass,
           "memory": state.stats.as_dict()["memory"]["by_kind"]}
    state.close()
    return out


def fast_worker(rank, world, backend):
    return (_run(rank, world, False, backend=backend), _run(rank, world, True, backend=backend),
            _run(rank, world, False, steps=4, nan_step=2, backend=backend),
            _run(rank, world, False, steps=4, nan_step=2, backend=backend, nan_in="fc2.bias"),
            # ranks that read their part differently (rank 0 in the one-pass velocities, rank 1 by a sum)
            _run(rank, world, False, steps=4, nan_step=2, backend="numba" if rank == 0 else "torch",
                 nan_in="fc2.bias"))


# numba: each unit's velocity in one pass on DDP's path (ErrorFeedback.velocity_unit), the units'
# path through the fused CPU lanes
@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_all_dense_with_momentum_correction_runs_ddps_path_bitwise(backend):
    if backend == "numba":
        pytest.importorskip("numba")
    (fast_a, units_a, nan_a, bias_a, mixed_a), (fast_b, units_b, _, bias_b, mixed_b) = run(
        fast_worker, 2, backend, timeout=180)
    # numba: every unit's velocity in one pass on DDP's path; torch: part by part
    assert fast_a["one_pass"] and {r is not None for r in fast_a["one_pass"]} == {backend == "numba"}, fast_a["one_pass"]
    assert fast_a["choices"] == ["dense"] * len(fast_a["choices"]) and fast_a["choices"]
    assert fast_a["opt_momentum"] == [0.0]   # taken over: the hook applies it
    # check points end steps 0 (the warm-up step, DDP's path), 4 (the early one) and 6: they and the
    # steps before them run the units' path; the others went DDP's way with the velocities applied in
    # the 1/P pass
    took = [p == ["dense"] for p in fast_a["paths"]]
    assert took == [True, True, True, False, False, False, False, True, True, True], fast_a["paths"]
    assert not any(p == ["dense"] for p in units_a["paths"][1:]), units_a["paths"]
    for fast, units in ((fast_a, units_a), (fast_b, units_b)):
        assert torch.equal(fast["params"], units["params"])
        assert fast["velocities"].keys() == units["velocities"].keys() and fast["velocities"]
        for k, v in fast["velocities"].items():
            assert torch.equal(v.reshape(-1), units["velocities"][k].reshape(-1)), k
    assert torch.equal(fast_a["params"], fast_b["params"])
    # step 2 is a fast step: a NaN in one rank's gradient keeps every velocity, on every rank (rank 0
    # learns it from the sum), also where it is only in a parameter sent dense (a bias)
    assert [p == ["dense"] for p in nan_a["paths"]][2] and nan_a["kept"] is True
    assert bias_a["kept"] is True and bias_b["kept"] is True
    assert mixed_a["kept"] is True and mixed_b["kept"] is True   # the verdict is agreed
    if backend == "numba":   # the one-pass velocities store over the live ones, the old codes lent to
        # DDP's gradients until the step's verdict (commpress.loan): no pending velocity between steps
        assert fast_a["memory"]["velocities"] > 0 and fast_a["memory"]["velocities_pending"] == 0, fast_a["memory"]
        assert units_a["memory"]["velocities_pending"] == 0   # nor on the units' path



class _Emb(torch.nn.Module):
    """A 200 x 16 embedding whose every row each step touches (its rows go dense) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(200, 16)
        self.fc = torch.nn.Linear(16, 64)

    def forward(self, ids):
        return self.fc(self.emb(ids)).sum(1)


def _rows_run(rank: int, world: int, forced_units_path: bool):
    os.environ["COMMPRESS_BACKEND"] = "torch"
    torch.manual_seed(0)
    model = DDP(_Emb(), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = commpress.ddp.register(model, "auto", optimizer=opt, min_numel=256, sparse_rows=[model.module.emb.weight],
                                   auto=commpress.auto.Options(check_every=6, remeasure=False))
    state.codec.network = Network(world, FAST)
    if forced_units_path:
        state.codec.fast = lambda step: None
    paths = []
    for step in range(10):
        g = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.cat([torch.arange(200), torch.randint(0, 200, (40,), generator=g)]).reshape(-1, 8)
        opt.zero_grad()
        model(ids).pow(2).mean().backward()
        opt.step()
        paths.append(sorted({u["algorithm"] for u in state.stats.last_step["units"].values()}))
    out = {"paths": paths, "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
           "velocities": _velocities(state)}
    state.close()
    return out


def rows_worker(rank, world):
    return _rows_run(rank, world, False), _rows_run(rank, world, True)


def test_sparse_rows_on_their_dense_path_are_averaged_and_get_their_momentum_on_ddps_path():
    """``sparse_rows`` parameters whose rows all go dense this step ride in DDP's all_reduce on the
    fast steps: scaled by ``1/P`` and given their plain momentum, as the units' path does."""
    (fast, units), _ = run(rows_worker, 2, timeout=180)
    assert any(p == ["dense"] for p in fast["paths"]), fast["paths"]
    assert torch.equal(fast["params"], units["params"])
    assert fast["velocities"].keys() == units["velocities"].keys()
    assert any(k.startswith("dense:emb") for k in fast["velocities"]), sorted(fast["velocities"])
    for k, v in fast["velocities"].items():
        assert torch.equal(v.reshape(-1), units["velocities"][k].reshape(-1)), k
