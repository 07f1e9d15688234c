"""PowerSGD: low-rank recovery, the stepwise protocol, warm starts and their state."""

from __future__ import annotations

import io

import pytest
import torch

import commpress


def _low_rank(rows, cols, rank, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, rank, generator=g) @ torch.randn(rank, cols, generator=g)


def test_recovers_a_low_rank_matrix():
    c = commpress.get("powersgd", rank=3)
    x = _low_rank(60, 40, 3)
    y = c.decompress(c.compress(x, key="w"))
    assert (y - x).norm() / x.norm() < 1e-4


def test_warm_start_improves_a_full_rank_approximation():
    c = commpress.get("powersgd", rank=2)
    x = torch.randn(80, 50, generator=torch.Generator().manual_seed(1))
    errs = [(c.decompress(c.compress(x, key=0)) - x).norm().item() for _ in range(8)]
    best = torch.linalg.svdvals(x)[2:].norm().item()  # Eckart-Young optimum for rank 2
    assert errs[-1] <= errs[0] + 1e-4 and errs[-1] <= best * 1.05


def test_higher_dims_view_as_dim0_by_rest_and_small_ones_are_sent_as_is():
    c = commpress.get("powersgd", rank=1)
    x = torch.randn(16, 3, 5, 5)
    assert c.is_compressed(x)
    p = c.compress(x, key="conv")
    assert p.meta["rows"] == 16 and p.meta["cols"] == 75
    assert [t.shape for t in p.tensors] == [torch.Size([16, 1]), torch.Size([75, 1])]
    for small in (torch.randn(100), torch.randn(2, 2), torch.randn(()), torch.randn(0, 4)):
        assert not c.is_compressed(small)
        p = c.compress(small)
        assert p.meta["uncompressed"] and torch.equal(c.decompress(p), small)


def test_stepwise_protocol_matches_the_power_iteration_over_ranks():
    # three simulated ranks, the all_reduce being a plain sum
    shape = (30, 4, 5)
    ms = [torch.randn(shape, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    ranks = [commpress.get("powersgd", rank=2) for _ in ms]
    for step in range(3):
        p_sum = sum(c.begin(m, "b") for c, m in zip(ranks, ms))
        p_copies = [p_sum.clone() for _ in ranks]
        q_sum = sum(c.middle(m, p, "b") for c, m, p in zip(ranks, ms, p_copies))
        outs = [c.end(p, q_sum.clone(), "b", shape, torch.float32) for c, p in zip(ranks, p_copies)]
        for o in outs[1:]:
            assert torch.equal(o, outs[0])  # every rank ends with the same tensor
        p_hat = p_copies[0]
        torch.testing.assert_close(p_hat.t() @ p_hat, torch.eye(2), atol=1e-5, rtol=0)
        total = sum(m.reshape(30, -1) for m in ms)
        torch.testing.assert_close(outs[0], (p_hat @ p_hat.t() @ total).reshape(shape),
                                   atol=1e-4, rtol=1e-4)
        for c in ranks:  # the warm start is the summed Q
            assert torch.equal(c.state_dict()["warm_start"]["tensors"][0], q_sum)


def test_compress_equals_one_rank_protocol():
    x = torch.randn(20, 30, generator=torch.Generator().manual_seed(3))
    a, b = commpress.get("powersgd", rank=2), commpress.get("powersgd", rank=2)
    y = a.decompress(a.compress(x, key=7))
    p = b.begin(x, 7)
    q = b.middle(x, p, 7)
    torch.testing.assert_close(b.end(p, q, 7, x.shape, x.dtype), y, atol=0, rtol=0)


def test_warm_start_is_the_same_on_every_rank_and_per_key():
    x = torch.randn(20, 30)
    p1 = commpress.get("powersgd", rank=2).begin(x, ("bucket", 3))
    p2 = commpress.get("powersgd", rank=2).begin(x, ("bucket", 3))
    p3 = commpress.get("powersgd", rank=2).begin(x, ("bucket", 4))
    assert torch.equal(p1, p2) and not torch.equal(p1, p3)


def test_non_finite_q_does_not_poison_the_warm_start():
    c = commpress.get("powersgd", rank=2)
    x = torch.randn(20, 30)
    c.compress(x, key=1)
    before = c.state_dict()["warm_start"]["tensors"][0].clone()
    bad = x.clone()
    bad[3, 4] = float("nan")
    assert torch.isnan(c.decompress(c.compress(bad, key=1))).any()
    assert torch.equal(c.state_dict()["warm_start"]["tensors"][0], before)


def test_state_dict_round_trip_weights_only():
    c = commpress.get("powersgd", rank=2)
    keys = [0, "layer.weight", ("bucket", 2), (1, ("a", 2.5))]
    for i, k in enumerate(keys):
        c.compress(torch.randn(10 + i, 12), key=k)
    buf = io.BytesIO()
    torch.save(c.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    d = commpress.get("powersgd", rank=2)
    d.load_state_dict(state)
    x = torch.randn(12, 12)
    for k, q in zip(c.state_dict()["warm_start"]["keys"], c.state_dict()["warm_start"]["tensors"]):
        e = d.state_dict()["warm_start"]
        assert torch.equal(e["tensors"][e["keys"].index(k)], q)
    assert d.state_dict()["warm_start"]["keys"] == keys
    assert torch.equal(c.begin(x, keys[1]), d.begin(x, keys[1]))
    with pytest.raises(ValueError, match="rank"):
        commpress.get("powersgd", rank=3).load_state_dict(state)


def test_half_precision_sends_fp32_factors_and_returns_input_dtype():
    c = commpress.get("powersgd", rank=1)
    x = _low_rank(64, 64, 1).to(torch.bfloat16)
    p = c.compress(x)
    assert all(t.dtype == torch.float32 for t in p.tensors)
    y = c.decompress(p)
    assert y.dtype == torch.bfloat16
    assert (y.float() - x.float()).norm() / x.float().norm() < 1e-2


def test_rank_deficient_matrix_keeps_orthonormal_factors():
    # rank 1 < r = 3: the later columns of P are round-off; they must not spoil P_hat
    c = commpress.get("powersgd", rank=3)
    x = _low_rank(200, 150, 1, seed=4)
    p = c.begin(x, "w")
    c.middle(x, p, "w")
    gram = p.t() @ p
    off_diag = gram - torch.diag(torch.diagonal(gram))
    assert off_diag.abs().max() < 1e-4
    y = c.decompress(c.compress(x, key="w2"))
    assert (y - x).norm() / x.norm() < 1e-4
