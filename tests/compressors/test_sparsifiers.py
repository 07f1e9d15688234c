"""topk, threshold, dgc and randomk: which entries they keep."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import commpress


def magnitude_rank(x: torch.Tensor) -> torch.Tensor:
    """Indices of x sorted by (|x| desc with NaN > inf > finite, index asc), via a plain sort."""
    key = torch.where(torch.isnan(x), torch.tensor(float("inf")), x.float().abs())
    nan_first = torch.isnan(x).to(torch.int64)
    order = sorted(range(x.numel()), key=lambda i: (-int(nan_first[i]), -float(key[i]), i))
    return torch.tensor(order, dtype=torch.int64)


@settings(max_examples=30)
@given(n=st.integers(1, 300), ratio=st.floats(0.001, 1.0), seed=st.integers(0, 1000),
       ties=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_topk_keeps_exactly_the_k_largest(n, ratio, seed, ties, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    if ties:
        x = torch.round(x * 2) / 2  # many equal magnitudes
    x = x.to(dtype)
    p = commpress.get("topk", ratio=ratio, density_warmup=0).compress(x)
    idx, values = p.tensors
    k = max(1, round(ratio * n))
    assert idx.numel() == k
    expected = torch.sort(magnitude_rank(x)[:k]).values
    assert torch.equal(idx.long(), expected)
    assert torch.equal(values, x[expected])


def test_topk_keeps_non_finite_first():
    x = torch.randn(100)
    x[[3, 50, 90]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    idx, _ = commpress.get("topk", ratio=0.03, density_warmup=0).compress(x).tensors
    assert idx.tolist() == [3, 50, 90]


@settings(max_examples=30)
@given(n=st.integers(0, 500), t=st.floats(0, 3), seed=st.integers(0, 1000),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_threshold_keeps_exactly_entries_at_or_above(n, t, seed, dtype):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    idx, values = commpress.get("threshold", threshold=t).compress(x).tensors
    expected = (x.float().abs() >= t).nonzero().reshape(-1)
    assert torch.equal(idx.long(), expected)
    assert torch.equal(values, x[expected])


def test_threshold_keeps_nan():
    x = torch.zeros(10)
    x[4] = float("nan")
    x[7] = 5.0
    idx, _ = commpress.get("threshold", threshold=1.0).compress(x).tensors
    assert idx.tolist() == [4, 7]


def _distributions(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, generator=g)
    yield "normal", normal
    yield "uniform", torch.rand(n, generator=g) - 0.5
    yield "cauchy", torch.empty(n).cauchy_(generator=g)  # heavy tails
    yield "lognormal", torch.empty(n).log_normal_(0, 3, generator=g) * torch.sign(normal)
    sparse = normal * (torch.rand(n, generator=g) < 0.02)
    yield "mostly-zero", sparse
    yield "sorted", torch.sort(normal.abs()).values  # adversarial for a strided sample
    yield "periodic", torch.arange(n).remainder(97).float()
    yield "constant", torch.full((n,), 0.25)


@pytest.mark.parametrize("n,ratio", [(10_000, 0.01), (10_000, 0.1), (200_003, 0.001),
                                     (200_003, 0.01)])
def test_dgc_keeps_within_20_percent_of_k_and_a_top_set(n, ratio):
    c = commpress.get("dgc", ratio=ratio, density_warmup=0)
    k = max(1, round(ratio * n))
    for name, x in _distributions(n, seed=n):
        idx, values = c.compress(x, step=1, key=name).tensors
        assert math.ceil(0.8 * k) <= idx.numel() <= math.floor(1.25 * k), name
        assert (idx[1:] > idx[:-1]).all() and idx.min() >= 0 and idx.max() < n
        assert torch.equal(values, x[idx.long()])
        # DGC keeps a top set: nothing dropped is larger than anything kept
        dropped = torch.ones(n, dtype=torch.bool)
        dropped[idx.long()] = False
        assert x[dropped].abs().max() <= values.abs().min(), name


@settings(max_examples=20)
@given(n=st.integers(1, 3000), ratio=st.floats(0.001, 1.0), seed=st.integers(0, 100))
def test_dgc_small_tensors_stay_in_range(n, ratio, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    idx, _ = commpress.get("dgc", ratio=ratio, density_warmup=0).compress(x).tensors
    k = max(1, round(ratio * n))
    assert math.ceil(0.8 * k) <= idx.numel() <= math.floor(1.25 * k)


def test_dgc_keeps_nan_and_inf():
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(0))
    x[123] = float("nan")
    x[4567] = float("inf")
    idx, _ = commpress.get("dgc", ratio=0.01, density_warmup=0).compress(x).tensors
    assert {123, 4567} <= set(idx.tolist())


@settings(max_examples=20)
@given(n=st.integers(1, 5000), ratio=st.floats(0.001, 1.0), seed=st.integers(0, 2**20),
       step=st.integers(0, 10**6), key=st.one_of(st.integers(), st.text(max_size=5)))
def test_randomk_indices_are_a_function_of_seed_step_key(n, ratio, seed, step, key):
    a = commpress.get("randomk", ratio=ratio, seed=seed, density_warmup=0)
    b = commpress.get("randomk", ratio=ratio, seed=seed, density_warmup=0)  # another "rank"
    ia = a.indices(n, step=step, key=key)
    ib = b.indices(n, step=step, key=key)
    k = max(1, round(ratio * n))
    assert torch.equal(ia, ib)
    assert ia.numel() == k and ia.dtype == torch.int32
    assert (ia[1:] > ia[:-1]).all() and ia.min() >= 0 and ia.max() < n
    if 0 < k < n and math.comb(n, k) > 10**6:
        assert not torch.equal(ia, a.indices(n, step=step + 1, key=key))
        assert not torch.equal(ia, a.indices(n, step=step, key=(key, 1)))


def test_randomk_summed_payloads_decompress_to_the_sum():
    c = commpress.get("randomk", ratio=0.1, seed=9, density_warmup=0)
    xs = [torch.randn(40, 25, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    payloads = [c.compress(x, step=4, key="b") for x in xs]
    summed = type(payloads[0])(tuple(sum(p.tensors[0] for p in payloads).reshape(1, -1)),
                               payloads[0].shape, payloads[0].dtype, payloads[0].numel,
                               payloads[0].meta)
    total = sum(c.decompress(p) for p in payloads)
    torch.testing.assert_close(c.decompress(summed), total)


def test_randomk_inclusion_is_uniform():
    # each index is kept with probability k/n: counts over 400 steps ~ Binomial(400, k/n)
    n, ratio, steps = 100, 0.2, 150
    c = commpress.get("randomk", ratio=ratio, density_warmup=0)
    counts = torch.zeros(n)
    for s in range(steps):
        counts[c.indices(n, step=s, key=0).long()] += 1
    p = 20 / n
    sigma = math.sqrt(steps * p * (1 - p))
    assert (counts - steps * p).abs().max() <= 5 * sigma
    assert counts.sum() == steps * 20
