"""Hugging Face ``Trainer`` with commpress: one line, checkpoints that carry the residuals.

    pip install "commpress[hf]"
    torchrun --standalone --nproc_per_node=2 examples/hf_trainer.py --steps 40
    torchrun --standalone --nproc_per_node=2 examples/hf_trainer.py --steps 6 --save-steps 3 --check-resume

The model is a tiny GPT-2 built from a config and the data are synthetic token
sequences (arithmetic progressions modulo the vocabulary), so nothing is
downloaded.  The commpress line is::

    state = commpress.integrations.hf.enable(trainer, "blockquant", bits=8)

It binds commpress's DDP hook to ``trainer.model_wrapped`` when training starts,
writes each rank's hook state (``commpress_rank{r}.pt``) into every checkpoint
folder the Trainer saves, and loads it on ``train(resume_from_checkpoint=...)``.

``--check-resume`` then trains again in the same processes from the middle
checkpoint (a fresh model and Trainer, ``resume_from_checkpoint``) and checks
that it ends bitwise where the uninterrupted run ended; and once more from a copy
of that checkpoint without the commpress files (residuals start from zero),
which must end elsewhere.  Rank 0 prints one line of results; every rank checks
that the replicas are bitwise identical.

On CPU the Trainer runs gloo (``use_cpu``); ``COMMPRESS_INIT_METHOD`` (e.g.
``file:///tmp/store`` with ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` /
``LOCAL_WORLD_SIZE`` set) initializes the process group here instead of torchrun's
``env://``.  Run as one plain process, ``enable`` logs one line and does nothing.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import zlib

import torch
import torch.distributed as dist

import commpress.integrations.hf

try:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed
except ImportError as exc:  # pragma: no cover - the example needs the extra
    raise SystemExit(f'this example needs transformers: pip install "commpress[hf]" ({exc})')

VOCAB, LENGTH = 64, 16


class Progressions(torch.utils.data.Dataset):
    """``n`` sequences ``start, start+step, ...`` modulo ``VOCAB``: learnable, no download."""

    def __init__(self, n: int = 256, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        step = torch.randint(1, 5, (n, 1), generator=g)
        self.ids = (start + step * torch.arange(LENGTH)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> GPT2LMHeadModel:
    set_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def train(args: argparse.Namespace, output_dir: str, resume: str | None = None):
    """One Trainer run (a fresh model) with commpress enabled; returns the Trainer and the hook state."""
    targs = TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, save_strategy="steps", save_steps=args.save_steps,
        per_device_train_batch_size=4, gradient_accumulation_steps=args.grad_accum, learning_rate=3e-3,
        logging_steps=1, report_to="none", use_cpu=not torch.cuda.is_available(), seed=0,
        ddp_find_unused_parameters=args.find_unused, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=tiny_gpt2(), args=targs, train_dataset=Progressions())
    params = {"bits": args.bits} if args.compressor == "blockquant" else {}
    state = commpress.integrations.hf.enable(trainer, args.compressor, **params)   # the one line
    trainer.train(resume_from_checkpoint=resume)
    return trainer, state


def checksum(model: torch.nn.Module) -> int:
    flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    return zlib.crc32(flat.numpy().tobytes())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--save-steps", type=int, default=20, help="save a checkpoint every N steps")
    p.add_argument("--grad-accum", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--find-unused", action="store_true", help="ddp_find_unused_parameters=True")
    p.add_argument("--compressor", default="blockquant")
    p.add_argument("--bits", type=int, default=8, help="blockquant bit width")
    p.add_argument("--out", default="hf_trainer_out", help="the Trainer's output_dir")
    p.add_argument("--check-resume", action="store_true",
                   help="also resume from the middle checkpoint and compare (see the module doc)")
    args = p.parse_args()

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and "COMMPRESS_INIT_METHOD" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo", init_method=os.environ["COMMPRESS_INIT_METHOD"],
                                rank=int(os.environ["RANK"]), world_size=world)

    trainer, state = train(args, args.out)
    rank = trainer.args.process_index
    whole = checksum(trainer.model)
    replicas = [whole]
    if dist.is_initialized():
        replicas = [None] * dist.get_world_size()
        dist.all_gather_object(replicas, whole)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    line = (f"step {trainer.state.global_step} loss {losses[-1]:.4f} ratio {state.stats.compression_ratio:.2f}x "
            f"params-crc32 {whole:08x} replicas-identical {len(set(replicas)) == 1} bound {state.bound}")
    state.close()

    if args.check_resume:
        middle = os.path.join(args.out, f"checkpoint-{args.save_steps}")
        resumed_trainer, resumed_state = train(args, os.path.join(args.out, "resumed"), resume=middle)
        resumed = checksum(resumed_trainer.model)
        resumed_state.close()
        plain = os.path.join(args.out, "plain-checkpoint")
        if rank == 0:
            shutil.copytree(middle, plain, dirs_exist_ok=True)
            for f in glob.glob(os.path.join(plain, "commpress_rank*.pt")):
                os.remove(f)
        if dist.is_initialized():
            dist.barrier()
        zero_trainer, zero_state = train(args, os.path.join(args.out, "zero"), resume=plain)
        zero = checksum(zero_trainer.model)
        zero_state.close()
        line += f" resumed-bitwise {resumed == whole} zero-residuals-differ {zero != whole}"
    if rank == 0:
        print(line, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
