"""Data for the training sweep, all on the machine already (no downloads).

* :func:`digits` — scikit-learn's 8x8 handwritten digits (1797 images), a fixed
  80/20 split, pixels scaled to [0, 1].
* :func:`stdlib_text` — bytes of the Python standard library's own ``.py``
  files (sorted paths, so every rank and every run reads the same text),
  split 90/10 into train/validation.  Vocabulary: the 256 byte values.
* :class:`Clicks` — a synthetic click log for the ``rec`` task (recommendation-style, large
  embedding tables): users and items drawn from Zipf laws over large id spaces, clicks drawn
  from a hidden low-rank model, all from a fixed seed (every rank and every run sees the same
  world; a run's seed picks its batches).
"""

from __future__ import annotations

import math
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


class Clicks:
    """A synthetic click log: ``(user, item)`` pairs and a click label, from a hidden model.

    Users (``n_users`` ids) and items (``n_items`` ids) are drawn from Zipf laws of exponent
    ``zipf`` over ids in a fixed random order (the hot ids are spread over the table), so a batch
    of a few hundred pairs touches a few hundred of the users' rows and fewer of the items': an
    embedding gradient of mostly zero rows.  A click is a Bernoulli draw of
    ``sigmoid(scale * <u, v> / sqrt(rank) + bias_item)`` with hidden Gaussian factors of ``rank``
    dimensions per user and item: learnable structure (an item's popularity, a user's taste)
    that a model picks up for the ids it sees often.  ``bayes_loss`` is the loss of the hidden
    model itself on the validation set (the floor).

    The world (factors, orders) comes from ``world_seed`` alone; batches from the generator
    the caller passes, so they are a pure function of its seed.
    """

    def __init__(self, n_users: int = 100_000, n_items: int = 20_000, rank: int = 8, zipf: float = 1.0,
                 scale: float = 1.5, world_seed: int = 1234, n_val: int = 8192) -> None:
        g = torch.Generator().manual_seed(world_seed)
        self.n_users, self.n_items, self.rank, self.scale = n_users, n_items, rank, scale
        self.user_f = torch.randn(n_users, rank, generator=g)
        self.item_f = torch.randn(n_items, rank, generator=g)
        self.item_b = torch.randn(n_items, generator=g)
        self.user_order = torch.randperm(n_users, generator=g)
        self.item_order = torch.randperm(n_items, generator=g)
        self.user_cdf = self._zipf_cdf(n_users, zipf)
        self.item_cdf = self._zipf_cdf(n_items, zipf)
        x, y, logit = self.sample(n_val, torch.Generator().manual_seed(world_seed + 1), with_logit=True)
        self.val_x, self.val_y = x, y
        self.bayes_loss = float(torch.nn.functional.binary_cross_entropy_with_logits(logit, y))

    @staticmethod
    def _zipf_cdf(n: int, s: float) -> torch.Tensor:
        p = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** s
        cdf = torch.cumsum(p / p.sum(), 0)
        cdf[-1] = 1.0
        return cdf

    def _draw(self, cdf: torch.Tensor, order: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
        u = torch.rand(n, generator=gen, dtype=torch.float64)
        return order[torch.searchsorted(cdf, u).clamp_(max=len(cdf) - 1)]

    def sample(self, n: int, gen: torch.Generator, with_logit: bool = False):
        """``(x, y)``: ``x`` int64 ``(n, 2)`` of (user, item) ids, ``y`` float32 clicks (0/1); with
        ``with_logit`` also the hidden model's logits."""
        users = self._draw(self.user_cdf, self.user_order, n, gen)
        items = self._draw(self.item_cdf, self.item_order, n, gen)
        logit = ((self.user_f[users] * self.item_f[items]).sum(1) * (self.scale / math.sqrt(self.rank))
                 + self.item_b[items])
        y = (torch.rand(n, generator=gen) < torch.sigmoid(logit)).float()
        x = torch.stack([users, items], 1)
        return (x, y, logit) if with_logit else (x, y)
