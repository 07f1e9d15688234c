"""commpress in PyTorch Lightning: a DDP comm hook passed to ``DDPStrategy``, bound by a callback.

    pip install lightning
    python examples/lightning_train.py --devices 2 --steps 30

On GPUs the strategy is Lightning's own::

    state = commpress.ddp.DDPState("blockquant", bits=8)
    DDPStrategy(ddp_comm_state=state, ddp_comm_hook=commpress.ddp.hook)
    pl.Trainer(..., callbacks=[commpress.integrations.lightning.BindCallback(state)])

The state is built before the model and the process group exist; the callback binds it to
the DDP model Lightning builds, on every rank before the first step.  Lightning (2.6)
registers comm hooks only when the model is on CUDA; on CPU the callback registers the hook
itself (``register_hook=True``).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import commpress

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as exc:  # pragma: no cover - the example needs Lightning
    raise SystemExit(f"this example needs Lightning: pip install lightning ({exc})")

from commpress.integrations.lightning import BindCallback


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def data(n: int = 4096) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, :8].sum(1) > 0).long() + 2 * (x[:, 8:16].sum(1) > 0).long())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()

    state = commpress.ddp.DDPState("blockquant", bits=8)
    cuda = torch.cuda.is_available()
    if cuda:   # Lightning registers the hook; the callback binds the state
        strategy = DDPStrategy(process_group_backend="nccl", ddp_comm_state=state, ddp_comm_hook=commpress.ddp.hook)
    else:      # Lightning registers no comm hook on CPU: the callback binds and registers it
        strategy = DDPStrategy(process_group_backend="gloo")
    trainer = pl.Trainer(accelerator="gpu" if cuda else "cpu", devices=args.devices, strategy=strategy,
                         callbacks=[BindCallback(state, register_hook=not cuda)],
                         max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(data(), batch_size=64, shuffle=True)
    trainer.fit(Classifier(), loader)
    if trainer.global_rank == 0:
        print(f"step {trainer.global_step} bound {state.bound} ratio {state.stats.compression_ratio:.2f}x "
              f"steps {state.stats.steps}", flush=True)
    state.close()


if __name__ == "__main__":
    main()
