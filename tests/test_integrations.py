"""commpress.integrations: what the examples' 2-rank runs (tests/test_examples.py) do not cover.

The core imports neither transformers nor accelerate; one process makes the Trainer
integration a no-op and the accelerate one an error that says what to do; an FSDP2
model handed to the accelerate integration gets the FSDP2 hook, and save_state /
load_state carry its per-rank residuals.  Everything but the import check needs the
``hf`` extra (``pip install "commpress[hf]"``) and is skipped without it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

import pytest
import torch

from distributed import run

HF_MISSING = importlib.util.find_spec("transformers") is None or importlib.util.find_spec("accelerate") is None
needs_hf = pytest.mark.skipif(HF_MISSING, reason='the hf extra is not installed (pip install "commpress[hf]")')


def _modules_after_importing_commpress(rank, world):
    import commpress  # noqa: F401
    import commpress.integrations.accelerate  # noqa: F401
    import commpress.integrations.hf  # noqa: F401

    return sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "accelerate"))


@pytest.mark.timeout(60)
def test_core_and_integrations_import_neither_transformers_nor_accelerate():
    # a worker of tests/distributed.py: a fresh process (preloaded with torch and commpress only)
    assert run(_modules_after_importing_commpress, 1, timeout=50) == [[]]


@pytest.fixture
def fresh_accelerate_state():
    """accelerate keeps its process state in singletons: start and leave them empty."""
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


@needs_hf
@pytest.mark.timeout(120)
def test_trainer_on_one_process_is_a_noop_with_one_log_line(tmp_path, caplog, fresh_accelerate_state):
    from transformers import Trainer, TrainingArguments

    import commpress.integrations.hf as hf

    torch.manual_seed(0)
    net = torch.nn.Linear(8, 8)

    class Regression(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x, y):
            return {"loss": torch.nn.functional.mse_loss(self.net(x), y)}

    g = torch.Generator().manual_seed(1)
    data = [{"x": torch.randn(8, generator=g), "y": torch.randn(8, generator=g)} for _ in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                             report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=Regression(), args=args, train_dataset=data)
    before = [type(cb) for cb in trainer.callback_handler.callbacks]
    with caplog.at_level(logging.INFO, logger="commpress"):
        state = hf.enable(trainer, "topk", ratio=0.1)
    lines = [r for r in caplog.records if r.name == "commpress"]
    assert len(lines) == 1 and "one process" in lines[0].getMessage()
    assert [type(cb) for cb in trainer.callback_handler.callbacks] == before    # nothing added
    w0 = net.weight.detach().clone()
    trainer.train()                                                              # trains, unchanged script
    assert not torch.equal(w0, net.weight) and not state.bound
    with pytest.raises(TypeError, match="transformers.Trainer"):
        hf.enable(net, "topk", ratio=0.1)


@needs_hf
@pytest.mark.timeout(120)
def test_accelerate_register_on_one_process_says_what_to_do(fresh_accelerate_state):
    from accelerate import Accelerator

    import commpress.integrations.accelerate as acc

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(8, 8))
    with pytest.raises(RuntimeError, match=r"not distributed.*[Ll]aunch several processes.*Accelerator\(cpu=True\)"):
        acc.register(accelerator, model, "topk", ratio=0.1)
    with pytest.raises(TypeError, match="accelerate.Accelerator"):
        acc.register(object(), model, "topk", ratio=0.1)


def _fsdp2_through_accelerate(rank, world, ckpt):
    """FSDP2 model + MULTI_CPU Accelerator: register gives the FSDP2 hook; save/load_state carry residuals."""
    from accelerate import Accelerator
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import commpress
    import commpress.integrations.accelerate as acc

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", COMMPRESS_BACKEND="torch")
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = acc.register(accelerator, model, "topk", ratio=0.1)
    assert isinstance(state, commpress.fsdp.FSDPState)

    def step(i):
        g = torch.Generator().manual_seed(100 * i + rank)
        model(torch.randn(16, 32, generator=g)).square().mean().backward()
        model.zero_grad()

    for i in range(2):
        step(i)
    accelerator.save_state(ckpt)
    saved = state.state_dict()
    step(2)
    moved = state.state_dict()
    accelerator.load_state(ckpt)
    back = state.state_dict()

    def residuals(sd):
        return sd["codec"]["residuals"]["tensors"]

    assert os.path.isfile(os.path.join(ckpt, f"commpress_rank{rank}.pt"))
    assert any(not torch.equal(a, b) for a, b in zip(residuals(saved), residuals(moved)))
    assert back["step"] == saved["step"] and len(residuals(back)) == len(residuals(saved))
    assert all(torch.equal(a, b) for a, b in zip(residuals(saved), residuals(back)))
    return True


@needs_hf
@pytest.mark.timeout(180)
def test_accelerate_register_gives_fsdp2_models_the_fsdp_hook_and_checkpoints_it(tmp_path):
    assert run(_fsdp2_through_accelerate, 2, str(tmp_path / "ckpt"), timeout=150) == [True, True]


def test_lightning_callback_imports_with_or_without_lightning_and_import_commpress_leaves_it_out():
    import subprocess

    code = ("import sys, commpress, commpress.integrations; "
            "assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning') for m in sys.modules); "
            "from commpress.integrations.lightning import BindCallback; "
            "base = BindCallback.__mro__[1]; "
            "print(base.__module__.split('.')[0] if base is not object else 'object')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    has_lightning = importlib.util.find_spec("lightning") is not None
    # where Lightning runs the callback it is Lightning's Callback; without it, a plain object
    assert out.stdout.strip() == ("lightning" if has_lightning else "object") or (
        not has_lightning and out.stdout.strip() == "pytorch_lightning")
