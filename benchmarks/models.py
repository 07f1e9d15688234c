"""Models for the training sweep: an MLP for digits, a small causal transformer LM and a
recommendation-style model with large embedding tables."""

from __future__ import annotations

import torch
from torch import nn


class DigitsMLP(nn.Module):
    """64 -> hidden -> hidden -> 10 with ReLU.

    Deliberately wide for the input (about 1.1M parameters at ``hidden=1024``):
    on a 2-core machine this keeps compute per step small while the gradient
    is large enough for the network to matter.
    """

    def __init__(self, hidden: int = 1024) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CharLM(nn.Module):
    """A pre-norm causal transformer over bytes (vocabulary 256) with learned positions."""

    def __init__(self, d_model: int = 256, n_layers: int = 4, n_heads: int = 4, context: int = 64) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(256, d_model)
        self.pos = nn.Embedding(context, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))[None]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


class RecModel(nn.Module):
    """A click-through model in the style of DLRM / neural collaborative filtering.

    A user table (``n_users x dim``) and an item table (``n_items x dim``), the pair's two rows
    and their elementwise product into an MLP ``3·dim -> hidden -> hidden/2 -> 1`` (a logit).
    Almost all parameters are embedding rows, and a batch touches few of them: the gradient of
    each table is mostly zero rows (``nn.Embedding(sparse=False)``: a dense tensor DDP averages
    whole).  Tables start at ``N(0, 0.1²)``.
    """

    def __init__(self, n_users: int = 100_000, n_items: int = 20_000, dim: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.user = nn.Embedding(n_users, dim)
        self.item = nn.Embedding(n_items, dim)
        nn.init.normal_(self.user.weight, std=0.1)
        nn.init.normal_(self.item.weight, std=0.1)
        self.mlp = nn.Sequential(nn.Linear(3 * dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden // 2), nn.ReLU(),
                                 nn.Linear(hidden // 2, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, v = self.user(x[:, 0]), self.item(x[:, 1])
        return self.mlp(torch.cat([u, v, u * v], 1)).squeeze(-1)

    def embedding_params(self) -> list[nn.Parameter]:
        return [self.user.weight, self.item.weight]


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
