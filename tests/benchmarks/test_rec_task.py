"""The sweep's ``rec`` task (issue 52's demo: large embedding tables, row-sparse gradients): it
builds, its data is deterministic, a batch touches few rows, and a few steps lower its loss."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import configs as C  # noqa: E402
from benchmarks import sweep  # noqa: E402
from benchmarks.data import Clicks  # noqa: E402
from benchmarks.train import make_task  # noqa: E402


@pytest.fixture
def world1(tmp_path):
    """A gloo group of one rank (the task's evaluation all-reduces its sums)."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_clicks_are_deterministic_and_zipf_skewed():
    a, b = Clicks(1000, 200, n_val=64), Clicks(1000, 200, n_val=64)
    assert torch.equal(a.val_x, b.val_x) and torch.equal(a.val_y, b.val_y)
    x1, y1 = a.sample(512, torch.Generator().manual_seed(3))
    x2, y2 = b.sample(512, torch.Generator().manual_seed(3))
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.dtype == torch.int64 and x1.shape == (512, 2) and set(y1.tolist()) <= {0.0, 1.0}
    assert 0 <= int(x1[:, 0].min()) and int(x1[:, 0].max()) < 1000 and int(x1[:, 1].max()) < 200
    assert len(torch.unique(x1[:, 0])) < 400          # hot ids repeat
    assert 0.0 < a.bayes_loss < 0.69


@pytest.mark.timeout(120)
def test_rec_task_builds_has_row_sparse_gradients_and_trains(world1):
    torch.manual_seed(0)
    task = make_task("rec", "quick", 0)
    info = task.info
    assert info["embedding_params"] >= 2_000_000 and info["params"] - info["embedding_params"] < 50_000
    ddp = torch.nn.parallel.DistributedDataParallel(task.model)
    opt = task.make_opt(ddp.parameters())
    gen = torch.Generator().manual_seed(0)
    before = task.evaluate(task.model, 0, 1)
    for step in range(30):
        x, y = task.batch(gen)
        task.loss(ddp, x, y).backward()
        if step == 0:
            emb = task.model.embedding_params()
            # every table's gradient is row-sparse (few rows touched), the MLP's is not
            assert all(C.row_sparse(p.grad, 0.05) for p in emb)
            assert not any(C.row_sparse(p.grad) for p in task.model.mlp.parameters() if p.dim() == 2)
        opt.step()
        opt.zero_grad(set_to_none=True)
    after = task.evaluate(task.model, 0, 1)
    assert after < before, (before, after)


def test_sparse_configs_skip_without_the_wiring_and_pass_sparse_rows():
    cfg = C.BY_NAME["sparse-rows"]
    assert cfg.params == {"sparse_rows": "auto"} and cfg.compressor == "identity"
    assert [c.name for c in C.resolve("sparse", False)][-2:] == ["sparse-rows", "sparse-rows+blockquant-4bit"]
    reason = C.unavailable_reason(cfg)
    assert (reason is None) == C.has_sparse_rows()
    if reason is not None:
        assert "sparse_rows" in reason


def test_sparse_goals_compare_losses_steps_and_bytes():
    def row(config, kind, ttt, losses, bytes_sent=0, seed=0):
        return {"config": config, "kind": kind, "seed": seed, "curve": [], "ttt_s": ttt, "ttt_step": 50,
                "step_s": 0.1, "ratio": 1.0, "compute_s": 0.01, "compression_s": 0.0, "comm_s": 0.09,
                "steps": 100, "metric": "val_loss", "final": 0.6, "target": 0.62, "train_losses": losses,
                "bytes_sent": bytes_sent, "dense_bytes": 15_000_000,
                "task_info": {"rows_touched_per_rank": {"users": 200.0, "items": 100.0}, "row_bytes": 128,
                              "params": 3_861_000, "embedding_params": 3_840_000}}

    rest = C.ring_all_reduce_bytes(4 * 21_000, 2)
    rows = [row("ddp", "ddp", 10.0, [0.7, 0.6, 0.5]), row("torch-fp16", "torch_fp16", 6.0, [0.7, 0.6, 0.5]),
            row("blockquant-4bit", "commpress", 2.5, [0.7, 0.61, 0.5]),
            row("sparse-rows", "commpress", 2.0, [0.7, 0.6, 0.5 + 1e-7], bytes_sent=rest + 300 * 132)]
    text = "\n".join(sweep.check_sparse_goals(sweep.Leg("rec", 2, "1gbit", ()), rows))
    assert "max |difference| 1.00e-07" in text and "first at step 3" in text
    assert "vs ddp (10.0 s): 2.0 s, 5.00x, goal >= 3x: met" in text
    assert "vs best lossy commpress (blockquant-4bit) (2.5 s): 2.0 s, 1.25x, goal ahead: met" in text
    assert "1.000x the touched rows' own" in text and "goal <= 1.25x: met" in text
    assert "estimate" not in text                          # no host CPU figures: no estimate
    rows[-1]["cpu_s"] = 0.030
    text = "\n".join(sweep.check_sparse_goals(sweep.Leg("rec", 2, "1gbit", ()), rows))
    # DDP's 15 MB take 120 ms at 1 Gbit/s; the row path's rank 30 ms of host CPU a step: 4x
    assert "take 120 ms a step at 1gbit" in text and "at equal steps about 4.0x DDP's speed" in text
    rows[-1]["train_losses"] = [0.7, 0.6, 0.5]
    assert "bitwise identical" in "\n".join(sweep.check_sparse_goals(sweep.Leg("rec", 2, "1gbit", ()), rows))
    assert sweep.check_sparse_goals(sweep.Leg("rec", 2, "1gbit", ()), rows[:3]) == []


def test_the_demo_has_the_rec_leg():
    legs = sweep.plan(sweep.build_parser().parse_args(["--demo"]))
    rec = [leg for leg in legs if leg.task == "rec"]
    assert [(leg.world_size, leg.net) for leg in rec] == [(2, "1gbit")]
    assert {"ddp", "torch-fp16", "sparse-rows"} <= set(rec[0].configs)
    assert all(n in C.BY_NAME for n in rec[0].configs)
    assert sweep._parse_steps(None, True)["rec"] == 100
    # --tasks rec outside the demo, with the sparse group
    legs = sweep.plan(sweep.build_parser().parse_args(["--tasks", "rec", "--configs", "sparse", "--net", "1gbit"]))
    assert [leg.task for leg in legs] == ["rec"] and "sparse-rows+blockquant-4bit" in legs[0].configs
