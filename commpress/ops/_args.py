"""Argument checks shared by the fast backends.

A backend handles only arguments these accept and leaves everything else to the
torch reference, which then decides the result or raises the error.
"""

from __future__ import annotations

import math

import numpy as np
import torch

#: Magnitude key of +inf (fp32 bits of |x|); keys above it are NaN.
INF_KEY = 0x7F800000


def valid_bits(bits) -> bool:
    """A bit width the packing kernels handle: an integer in 1..8."""
    return isinstance(bits, (int, np.integer)) and 1 <= int(bits) <= 8


def valid_block(block) -> bool:
    """A block or chunk length: an integer >= 1."""
    return isinstance(block, (int, np.integer)) and int(block) >= 1


def codes_u8(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` flattened as contiguous uint8, masked to ``bits`` bits when wider."""
    c = codes.reshape(-1)
    if c.dtype != torch.uint8:
        c = (c.to(torch.int64) & ((1 << bits) - 1)).to(torch.uint8)
    return c.contiguous()


def threshold_key_range(threshold: float) -> tuple[int, int]:
    """Magnitude keys ``[lo, hi]`` selected by ``|x| >= threshold`` compared in fp32
    (the reference's rule): NaN entries never pass, a NaN threshold passes nothing."""
    thr = torch.tensor(float(threshold), dtype=torch.float32).item()
    if math.isnan(thr):
        return 1, 0
    if thr <= 0:
        return 0, INF_KEY
    return int(np.array([thr], np.float32).view(np.int32)[0]), INF_KEY
