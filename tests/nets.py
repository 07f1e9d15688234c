"""Small models shared by the multi-process hook tests (importable by the rank workers)."""

from __future__ import annotations

import torch
from torch import nn


class MLP3(nn.Module):
    """Three linear layers (32 -> 96 -> 64 -> 8): weights of 3072, 6144 and 512 elements."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 96)
        self.fc2 = nn.Linear(96, 64)
        self.fc3 = nn.Linear(64, 8)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))
