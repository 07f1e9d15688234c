"""``"auto"``'s check points in a critical regime (issue 55.8): the first window is one on every rank,
and a later window is one for a unit whose norm changed by the critical fraction, so the aggressive
candidates it excludes are not timed there (their codec cost, paid in the first steps, is most of
``"auto"``'s gap to the best fixed config where a run reaches its target in seconds); a check point
out of it times them."""

from __future__ import annotations

import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run
from nets import MLP3 as Net, train_step

import commpress
from commpress.auto import Network
from commpress.auto.decide import Prices, critical_candidates
from commpress.auto.runtime import DEFAULT_CANDIDATES
from commpress.collectives.costmodel import CostModel


def first_check_worker(rank, world, check_every=4):
    os.environ["COMMPRESS_BACKEND"] = "torch"
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = commpress.ddp.register(model, "auto", min_numel=256,
                                   auto=commpress.auto.Options(check_every=check_every, remeasure=False))
    auto = state.codec
    auto.network = Network(world, CostModel(1e-3, 1e-6))   # 1 MB/s: compressing pays
    timed, original = [], auto._codec_cost
    changes = []
    import commpress.auto.runtime as runtime
    real_change = runtime.norm_change

    def spy(c, unit, device):
        timed.append((auto.checks, unit.key, c))
        return original(c, unit, device)

    def change(prev, now):   # each unit's own change at the later check points; the first unit's
        out = real_change(prev, now)   # made critical on rank 0 only (the agreement's max makes it so everywhere)
        if rank == 0:
            out[0] = max(out[0], 1.0)
        changes.append(dict(zip([u.key for u in auto._units], out)))
        return out
    auto._codec_cost = spy
    runtime.norm_change = change
    try:
        for step in range(5):   # check points end steps 0 (the warm-up step) and 4
            train_step(model, opt, rank, step)
    finally:
        runtime.norm_change = real_change
    state.close()
    second = {}
    for n, key, c in timed:
        if n == 1:
            second.setdefault(str(key), set()).add(str(c))
    critical = auto.spec.decider_args["critical"]
    return (sorted({str(c) for n, _, c in timed if n == 0}),
            {k: (sorted(v), changes[0][key] >= critical) for key in changes[0] for k, v in second.items()
             if k == str(key)},
            sorted(map(str, auto.candidates)))


def test_a_critical_regime_times_only_what_it_allows():
    """The first check point (a critical regime on every rank) and, later, a unit whose own norm
    changed by the critical fraction or more time only the candidates that regime allows (and the
    choice in force); a unit below it times every candidate."""
    run_result = run(first_check_worker, 2, timeout=120)
    allowed = sorted(map(str, critical_candidates(DEFAULT_CANDIDATES, Prices())))
    assert [sum(c for _, c in r[1].values()) for r in run_result] == [1, 0]   # rank 0's first unit only
    for first, second, cands in run_result:
        assert first == allowed and len(allowed) < len(cands)
        assert second, "the second check point timed nothing"
        for timed, is_critical in second.values():
            if is_critical:
                assert set(allowed) <= set(timed) and len(set(timed) - set(allowed)) <= 1
            else:
                assert set(timed) == set(cands)


def test_a_window_without_a_norm_keeps_the_last_regime():
    """The early check point (4 steps after the first, whose window samples no norm at
    check_every=50) reads no regime: every unit stays in the first window's critical one, so it
    times nothing the first did not (the aggressive candidates wait for a window with norms)."""
    run_result = run(first_check_worker, 2, 50, timeout=120)
    allowed = sorted(map(str, critical_candidates(DEFAULT_CANDIDATES, Prices())))
    for first, second, cands in run_result:
        assert first == allowed and second
        for timed, _ in second.values():
            assert len(set(timed) - set(allowed)) <= 1, timed   # the allowed ones and the choice in force
