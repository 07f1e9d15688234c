"""Data for the training sweep, all on the machine already (no downloads).

* :func:`digits` — scikit-learn's 8x8 handwritten digits (1797 images), a fixed
  80/20 split, pixels scaled to [0, 1].
* :func:`stdlib_text` — bytes of the Python standard library's own ``.py``
  files (sorted paths, so every rank and every run reads the same text),
  split 90/10 into train/validation.  Vocabulary: the 256 byte values.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import torch


def digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: float32 images flattened to 64, int64 labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = len(x) // 5
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def stdlib_text(max_bytes: int = 4_000_000) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, val)`` uint8 tensors of stdlib source bytes (at most ``max_bytes`` in all)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            b = path.read_bytes()
        except OSError:
            continue
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    if total < 100_000:
        raise RuntimeError(f"found only {total} bytes of stdlib source under {root}")
    buf = np.frombuffer(b"\n".join(chunks)[:max_bytes], dtype=np.uint8).copy()
    data = torch.from_numpy(buf)
    split = int(len(data) * 0.9)
    return data[:split], data[split:]


def lm_batch(data: torch.Tensor, batch: int, context: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: inputs ``(batch, context)`` and next-byte targets, int64."""
    starts = torch.randint(0, len(data) - context - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(context + 1)[None, :]
    seq = data[idx].long()
    return seq[:, :-1], seq[:, 1:]
