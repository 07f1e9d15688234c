"""Compress a real model's gradients with every compressor and print what it costs.

A small CNN on scikit-learn's 8x8 digits does one forward/backward pass; each
parameter's gradient is then compressed and decompressed by every registered
compressor (with a sensible setting).  Printed per compressor: compression
ratio (dense bytes / wire bytes), relative error ||g - g~|| / ||g|| over all
gradients, and compress + decompress time.

    python examples/compress_model.py [--batch 256] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import commpress

SETTINGS = {
    "identity": {}, "fp16": {}, "bf16": {},
    "topk": {"ratio": 0.01}, "randomk": {"ratio": 0.01}, "threshold": {"threshold": 1e-3},
    "dgc": {"ratio": 0.01}, "qsgd": {"levels": 7}, "terngrad": {}, "signsgd": {"chunk": 256},
    "blockquant": {"bits": 4, "block": 64}, "powersgd": {"rank": 2},
}


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 16, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def gradients(batch: int, seed: int) -> dict[str, torch.Tensor]:
    from sklearn.datasets import load_digits

    torch.manual_seed(seed)
    digits = load_digits()
    x = torch.tensor(digits.images[:batch], dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target[:batch])
    net = model()
    nn.functional.cross_entropy(net(x), y).backward()
    return {name: p.grad for name, p in net.named_parameters()}


def evaluate(name: str, grads: dict[str, torch.Tensor]) -> dict[str, float]:
    c = commpress.get(name, **SETTINGS.get(name, {}))
    gen = torch.Generator().manual_seed(0)
    dense = wire = 0
    err2 = norm2 = 0.0
    t0 = time.perf_counter()
    for key, g in grads.items():
        payload = c.compress(g, key=key, generator=gen)
        approx = c.decompress(payload)
        dense += payload.dense_nbytes
        wire += payload.nbytes
        err2 += float((approx - g).double().pow(2).sum())
        norm2 += float(g.double().pow(2).sum())
    seconds = time.perf_counter() - t0
    return {"ratio": dense / wire, "rel_error": (err2 / norm2) ** 0.5, "ms": 1e3 * seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    grads = gradients(args.batch, args.seed)
    numel = sum(g.numel() for g in grads.values())
    print(f"{len(grads)} gradient tensors, {numel} values ({4 * numel / 1024:.0f} KiB fp32)\n")
    print(f"| {'compressor':<48} | {'ratio':>8} | {'rel. error':>10} | {'time ms':>8} |")
    print(f"|{'-' * 50}|{'-' * 10}|{'-' * 12}|{'-' * 10}|")
    for name in commpress.available():
        evaluate(name, grads)  # warm-up: JIT-compiled kernels compile on first use
        r = evaluate(name, grads)
        label = repr(commpress.get(name, **SETTINGS.get(name, {})))
        print(f"| {label:<48} | {r['ratio']:8.2f} | {r['rel_error']:10.4f} | {r['ms']:8.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
