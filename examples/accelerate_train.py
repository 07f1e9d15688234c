"""Hugging Face ``accelerate`` with commpress: one line after ``prepare``; save_state carries the residuals.

    pip install "commpress[hf]"
    torchrun --standalone --nproc_per_node=2 examples/accelerate_train.py --steps 40
    accelerate launch --num_processes 2 --cpu examples/accelerate_train.py --steps 6 --check-resume

The model is a tiny GPT-2 built from a config; each rank's batch at step ``s`` is a
pure function of ``(rank, s)`` (arithmetic progressions modulo the vocabulary), so
nothing is downloaded and a resumed run sees the same data.  The commpress line::

    state = commpress.integrations.accelerate.register(accelerator, model, "blockquant", bits=8)

``model`` is what ``accelerator.prepare`` returned (a DDP model here).  Do not pass
commpress through ``DistributedDataParallelKwargs(comm_hook=...)``: accelerate
takes only its own enum there and silently ignores anything else.
``register`` also adds per-rank save / load pre-hooks, so ``accelerator.save_state``
writes ``commpress_rank{r}.pt`` next to the model and optimizer, and ``load_state``
restores it.

``--check-resume`` saves the state at the middle step, trains to the end, then
loads the middle state back into the same objects, trains the second half again
and checks that it ends bitwise where it ended the first time.

On machines without GPUs create ``Accelerator(cpu=True)`` (done here when CUDA is
absent): without it accelerate runs one process even under torchrun, and
``register`` then raises an error saying so.  ``COMMPRESS_INIT_METHOD`` (e.g.
``file:///tmp/store`` with ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` /
``LOCAL_WORLD_SIZE`` set) initializes the process group here instead of ``env://``.
"""

from __future__ import annotations

import argparse
import os
import zlib

import torch
import torch.distributed as dist

import commpress.integrations.accelerate

try:
    from accelerate import Accelerator
    from transformers import GPT2Config, GPT2LMHeadModel
except ImportError as exc:  # pragma: no cover - the example needs the extra
    raise SystemExit(f'this example needs accelerate and transformers: pip install "commpress[hf]" ({exc})')

VOCAB, LENGTH = 64, 16


def batch(rank: int, step: int, micro: int, n: int = 4) -> torch.Tensor:
    """Rank ``rank``'s micro-batch ``micro`` at ``step``: token ids, a pure function of all three."""
    g = torch.Generator().manual_seed(100_000 * step + 100 * micro + rank)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 5, (n, 1), generator=g)
    return (start + stride * torch.arange(LENGTH)) % VOCAB


def checksum(model: torch.nn.Module) -> int:
    flat = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    return zlib.crc32(flat.numpy().tobytes())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--grad-accum", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--compressor", default="blockquant")
    p.add_argument("--bits", type=int, default=8, help="blockquant bit width")
    p.add_argument("--ckpt", default="accelerate_ckpt", help="folder for save_state at the middle step")
    p.add_argument("--check-resume", action="store_true",
                   help="load the middle state back, train the second half again and compare")
    args = p.parse_args()

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and "COMMPRESS_INIT_METHOD" in os.environ and not dist.is_initialized():
        dist.init_process_group("gloo", init_method=os.environ["COMMPRESS_INIT_METHOD"],
                                rank=int(os.environ["RANK"]), world_size=world)

    accelerator = Accelerator(cpu=not torch.cuda.is_available(), gradient_accumulation_steps=args.grad_accum)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = accelerator.prepare(model, opt)
    params = {"bits": args.bits} if args.compressor == "blockquant" else {}
    state = commpress.integrations.accelerate.register(accelerator, model, args.compressor, **params)  # the line

    rank = accelerator.process_index
    middle = args.steps // 2
    losses: list[float] = []

    def train(first: int, last: int) -> None:
        model.train()
        for step in range(first, last):
            for micro in range(args.grad_accum):
                with accelerator.accumulate(model):
                    ids = batch(rank, step, micro).to(accelerator.device)
                    loss = model(input_ids=ids, labels=ids).loss
                    accelerator.backward(loss)
                    opt.step()
                    opt.zero_grad()
            losses.append(float(loss.detach()))
            if step + 1 == middle and args.ckpt:
                accelerator.save_state(args.ckpt)

    train(0, args.steps)
    whole = checksum(model)
    replicas = [None] * accelerator.num_processes
    dist.all_gather_object(replicas, whole)
    line = (f"step {args.steps} loss {losses[-1]:.4f} ratio {state.stats.compression_ratio:.2f}x "
            f"params-crc32 {whole:08x} replicas-identical {len(set(replicas)) == 1}")
    if args.check_resume:
        accelerator.load_state(args.ckpt)     # model, optimizer, RNG and (pre-hook) the hook state
        train(middle, args.steps)
        line += f" resumed-bitwise {checksum(model) == whole}"
    if rank == 0:
        print(line, flush=True)
    state.close()
    accelerator.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
