"""``"auto"``'s first check point (issue 55.8): the first window is a critical regime on every rank,
so the aggressive candidates it excludes are not timed there (their codec cost, paid in the first
steps, is most of ``"auto"``'s gap to the best fixed config where a run reaches its target in
seconds); the next check point times them."""

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


def first_check_worker(rank, world):
    os.environ["COMMPRESS_BACKEND"] = "torch"
    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = commpress.ddp.register(model, "auto", min_numel=256,
                                   auto=commpress.auto.Options(check_every=50, remeasure=False))
    auto = state.codec
    auto.network = Network(world, CostModel(1e-3, 1e-6))   # 1 MB/s: compressing pays
    timed, original = [], auto._codec_cost

    def spy(c, unit, device):
        timed.append((auto.checks, c))
        return original(c, unit, device)
    auto._codec_cost = spy
    for step in range(6):   # check points end steps 1 and 5
        train_step(model, opt, rank, step)
    state.close()
    return [sorted({str(c) for n, c in timed if n == i}) for i in (0, 1)], sorted(map(str, auto.candidates))


def test_the_first_check_point_times_only_what_a_critical_regime_allows():
    (first, second), cands = run(first_check_worker, 2, timeout=120)[0]
    allowed = sorted(map(str, critical_candidates(DEFAULT_CANDIDATES, Prices())))
    assert first == allowed and len(allowed) < len(cands)
    assert set(second) == set(cands)
