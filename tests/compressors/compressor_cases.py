"""Shared test cases for the compressor tests: every compressor with test parameters,
a tensor builder and each compressor's wire-size bound."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

import commpress
from commpress.testing import make_tensor

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# (registry name, params) for every compressor; several settings of some.
CASES = [
    ("identity", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("topk", {"ratio": 0.3}),
    ("randomk", {"ratio": 0.3, "seed": 3}),
    ("threshold", {"threshold": 0.5}),
    ("dgc", {"ratio": 0.3}),
    ("qsgd", {"levels": 5, "bucket": 16}),
    ("qsgd", {"levels": 2, "bucket": 10**9}),
    ("terngrad", {}),
    ("signsgd", {"chunk": 5}),
    ("blockquant", {}),
    ("blockquant", {"bits": 4, "block": 7, "stochastic": True}),
    ("blockquant", {"bits": 2, "block": 3}),
    ("powersgd", {"rank": 1}),
    ("powersgd", {"rank": 2}),
    ("fp8", {}),
    ("fp8", {"format": "e5m2", "block": 7, "stochastic": True}),
    ("mx", {}),
    ("mx", {"element": "fp6_e2m3", "stochastic": True}),
    ("mx", {"element": "fp4_e2m1"}),
    ("sparseloco", {"ratio": 0.3, "chunk": 16}),
    ("sparseloco", {"ratio": 0.05, "chunk": 300, "bits": 4}),
]
IDS = [f"{n}-{'-'.join(f'{k}{v}' for k, v in p.items())}".rstrip("-") for n, p in CASES]

SPARSIFIERS = [c for c in CASES if c[0] in ("topk", "threshold", "dgc")]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` that also takes float8 tensors (compared by their bytes)."""
    if a.dtype != b.dtype:
        return False
    if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def make(name: str, params: dict) -> commpress.Compressor:
    return commpress.get(name, **params)


build = make_tensor   # the inputs of commpress.testing's checks


shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 9), min_size=1, max_size=3),
    st.tuples(st.integers(8, 40), st.integers(8, 40)),
)
layouts = st.sampled_from(["contiguous", "transposed", "strided"])
dtypes = st.sampled_from(DTYPES)


def nbytes_bound(c: commpress.Compressor, x: torch.Tensor, payload) -> tuple[int, bool]:
    """``(bound, exact)``: the wire size the compressor promises for ``x``."""
    n, it = x.numel(), x.element_size()
    name = c.name
    k = 0 if n == 0 else min(n, max(1, round(getattr(c, "ratio", 0) * n)))
    if name == "identity":
        return n * it, True
    if name in ("fp16", "bf16"):
        return 2 * n, True
    if name == "topk":
        return k * (4 + it), True
    if name == "dgc":
        return math.floor(1.25 * k) * (4 + it), False
    if name == "threshold":
        return n * (4 + it), False
    if name == "randomk":
        return k * it, True
    if name == "qsgd":
        return math.ceil(n * c.bits / 8) + 4 * math.ceil(n / c.bucket), True
    if name == "terngrad":
        return math.ceil(n / 4) + 4, True
    if name == "signsgd":
        return math.ceil(n / 8) + 4 * math.ceil(n / c.chunk), True
    if name == "blockquant":
        return math.ceil(n * c.bits / 8) + 4 * math.ceil(n / c.block), True
    if name == "fp8":
        return n + 4 * math.ceil(n / c.block), True
    if name == "mx":
        return math.ceil(n * c.bits / 8) + math.ceil(n / 32), True
    if name == "sparseloco":
        chunks, clen, kc = c.layout(n)
        return chunks * (kc * (1 if clen <= 256 else 2 if clen <= 2 ** 15 else 4) + math.ceil(kc * c.bits / 8) + 8), True
    if name == "powersgd":
        if payload.meta["uncompressed"]:
            return n * it, True
        rows, cols = payload.meta["rows"], payload.meta["cols"]
        return 4 * c.rank * (rows + cols), True
    raise AssertionError(f"no bound for {name}")
