"""ErrorFeedback(momentum=, clip=): DGC momentum correction, masking, clipping, state, fused signsgd."""

from __future__ import annotations

import io

import pytest
import torch

import commpress


def _grads(steps, shape=(20, 15), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


def test_dense_compressor_sends_the_velocity():
    """identity: payload_t = u_t = m*u_{t-1} + g_t (nothing masked, residual stays 0)."""
    m = 0.9
    ef = commpress.ErrorFeedback(commpress.get("identity"), momentum=m)
    u = torch.zeros(20, 15)
    for t, g in enumerate(_grads(4)):
        u = g if t == 0 else torch.add(g, u, alpha=m)  # the definition, rounded as torch does
        out = ef.decompress(ef.compress(g, key="k"))
        torch.testing.assert_close(out, u, rtol=0, atol=0)
        assert torch.equal(ef.velocity("k"), u)
        assert torch.equal(ef.residual("k"), torch.zeros(20, 15))


def test_topk_matches_a_hand_written_dgc_loop():
    """u = m*u + g; v += u; send top-k of v; zero u and v where sent (Lin et al. 2018)."""
    m, ratio = 0.9, 0.05
    ef = commpress.ErrorFeedback(commpress.get("topk", ratio=ratio), momentum=m)
    topk = commpress.get("topk", ratio=ratio)
    u = torch.zeros(300)
    v = torch.zeros(300)
    for t, g in enumerate(_grads(6, (300,))):
        u = g if t == 0 else torch.add(g, u, alpha=m)  # the definition, rounded as torch does
        v = u if t == 0 else v + u
        want = topk.compress(v, step=t, key="b")
        idx = want.tensors[0].long()
        got = ef.compress(g, step=t, key="b")
        assert all(torch.equal(a, b) for a, b in zip(got.tensors, want.tensors))
        u[idx] = 0
        v[idx] = 0
        assert torch.equal(ef.velocity("b"), u)
        assert torch.equal(ef.residual("b"), v)
        assert (ef.velocity("b")[idx] == 0).all()


def test_without_masking_the_velocity_keeps_the_sent_coordinates():
    """masking=False (the hooks' default): u = m*u + g everywhere; only v is cleared where sent."""
    m = 0.9
    ef = commpress.ErrorFeedback(commpress.get("topk", ratio=0.05, density_warmup=0), momentum=m, masking=False)
    topk = commpress.get("topk", ratio=0.05, density_warmup=0)
    u, v = torch.zeros(300), torch.zeros(300)
    for t, g in enumerate(_grads(5, (300,))):
        u = g if t == 0 else torch.add(g, u, alpha=m)
        v = u.clone() if t == 0 else v + u
        want = topk.compress(v, step=t, key="b")
        got = ef.compress(g, step=t, key="b")
        assert all(torch.equal(a, b) for a, b in zip(got.tensors, want.tensors))
        v[want.tensors[0].long()] = 0
        assert torch.equal(ef.velocity("b"), u) and torch.equal(ef.residual("b"), v)
    assert ef.config()["masking"] is False
    with pytest.raises(TypeError, match="masking"):
        commpress.ErrorFeedback(topk, momentum=m, masking=1)


def test_fixed_size_payload_masks_only_real_slots():
    ef = commpress.ErrorFeedback(commpress.get("threshold", threshold=1.0), momentum=0.5)
    g = torch.zeros(64)
    g[3] = 5.0
    g[10] = 0.5
    p = ef.compress_fixed(g, key=0)
    assert p.tensors[0].numel() >= 1
    u = ef.velocity(0)
    assert u[3] == 0 and u[10] == 0.5 and u.numel() == 64


def test_quantizer_with_momentum_conserves_mass():
    """blockquant: decode(payload) + e_after == u + e_before; u is not masked (all entries are sent)."""
    m = 0.8
    ef = commpress.ErrorFeedback(commpress.get("blockquant", bits=2, block=16), momentum=m)
    u = torch.zeros(200)
    for t, g in enumerate(_grads(4, (200,), seed=3)):
        u = g if t == 0 else torch.add(g, u, alpha=m)  # the definition, rounded as torch does
        before = torch.zeros(200) if ef.residual("q") is None else ef.residual("q").clone()
        out = ef.decompress(ef.compress(g, key="q"))
        torch.testing.assert_close(out + ef.residual("q"), u + before, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ef.velocity("q"), u, rtol=1e-6, atol=1e-6)


def test_clip_scales_the_local_gradient_to_the_norm():
    ef = commpress.ErrorFeedback(commpress.get("identity"), momentum=0.9, clip=2.0)
    g = torch.full((10,), 3.0)  # norm ~9.5 > 2
    out = ef.decompress(ef.compress(g, key=0))
    torch.testing.assert_close(out.norm(), torch.tensor(2.0))
    small = torch.full((10,), 0.01)
    ef2 = commpress.ErrorFeedback(commpress.get("identity"), momentum=0.9, clip=2.0)
    assert torch.equal(ef2.decompress(ef2.compress(small, key=0)), small)


@pytest.mark.parametrize("name,params", [("topk", {"ratio": 0.1}), ("blockquant", {}), ("signsgd", {})])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_step_leaves_velocity_and_residual(name, params, bad):
    ef = commpress.ErrorFeedback(commpress.get(name, **params), momentum=0.9, clip=10.0)
    ef.compress(torch.randn(100), key=1)
    u0, e0 = ef.velocity(1).clone(), ef.residual(1).clone()
    g = torch.randn(100)
    g[7] = bad
    out = ef.decompress(ef.compress(g, key=1))
    assert not torch.isfinite(out).all()
    assert torch.equal(ef.velocity(1), u0) and torch.equal(ef.residual(1), e0)


def test_transaction_rollback_keeps_velocity():
    from commpress.feedback import ResidualTransaction

    ef = commpress.ErrorFeedback(commpress.get("topk", ratio=0.2), momentum=0.9)
    ef.compress(torch.randn(50), key="a")
    u0 = ef.velocity("a").clone()
    tx = ResidualTransaction()
    ef.compress(torch.randn(50), key="a", transaction=tx)
    tx.commit(torch.tensor(True))  # another rank overflowed
    assert torch.equal(ef.velocity("a"), u0)
    tx = ResidualTransaction()
    ef.compress(torch.ones(50), key="a", transaction=tx)
    tx.commit()
    assert not torch.equal(ef.velocity("a"), u0)


def test_momentum_state_dict_round_trip_is_bitwise():
    make = lambda: commpress.ErrorFeedback(commpress.get("topk", ratio=0.1), momentum=0.9)  # noqa: E731
    ef = make()
    for t in range(3):
        for k in ("a", ("b", 1)):
            ef.compress(torch.randn(40, 3), step=t, key=k)
    buf = io.BytesIO()
    torch.save(ef.state_dict(), buf)
    buf.seek(0)
    restored = make()
    restored.load_state_dict(torch.load(buf, weights_only=True))
    for k in ("a", ("b", 1)):
        assert torch.equal(restored.velocity(k), ef.velocity(k))
        x = torch.randn(40, 3)
        a, b = ef.compress(x, step=5, key=k), restored.compress(x, step=5, key=k)
        assert all(torch.equal(s, t) for s, t in zip(a.tensors, b.tensors))
        assert torch.equal(restored.velocity(k), ef.velocity(k))
    with pytest.raises(ValueError, match="velocities"):
        restored.load_state_dict({k: v for k, v in ef.state_dict().items() if k != "velocities"})
    plain = commpress.ErrorFeedback(commpress.get("topk", ratio=0.1))
    assert set(plain.state_dict()) == {"beta", "residuals", "compressor"}


@pytest.mark.parametrize("kw,arg", [({"momentum": 1.0}, "momentum"), ({"momentum": -0.1}, "momentum"),
                                    ({"momentum": True}, "momentum"), ({"clip": 0.0}, "clip"),
                                    ({"clip": float("inf")}, "clip"), ({"clip": "1"}, "clip")])
def test_bad_momentum_and_clip(kw, arg):
    with pytest.raises(ValueError, match=arg):
        commpress.ErrorFeedback(commpress.get("topk", ratio=0.1), **kw)


def test_config_records_momentum_only_when_used():
    assert "momentum" not in commpress.ErrorFeedback(commpress.get("qsgd")).config()
    cfg = commpress.ErrorFeedback(commpress.get("qsgd"), momentum=0.9, clip=1.0).config()
    assert cfg["momentum"] == 0.9 and cfg["clip"] == 1.0


@pytest.mark.parametrize("chunk", [8, 64, 1024, 5])
def test_fused_signsgd_feedback_equals_the_generic_path(chunk):
    """The one-pass sign + scale + residual kernel gives the generic path's payload and residual."""
    ef = commpress.ErrorFeedback(commpress.get("signsgd", chunk=chunk))
    inner = commpress.get("signsgd", chunk=chunk)
    r = torch.zeros(37, 29)
    for t, x in enumerate(_grads(4, (37, 29), seed=5)):
        c = x + r
        want = inner.compress(c)
        got = ef.compress(x, key="s")
        assert all(torch.equal(a, b) for a, b in zip(got.tensors, want.tensors))
        r = c - inner.decompress(want)
        assert torch.equal(ef.residual("s"), r)


def test_velocity_buffers_swap_on_commit_and_values_follow_the_definition():
    """On the CPU a commit swaps the live and pending velocity (no copy): after the first steps the
    live velocity alternates between two buffers, and its values stay u = m*u + g; a step kept
    back (NaN/inf) leaves both the value and the buffer."""
    m = 0.9
    ef = commpress.ErrorFeedback(commpress.get("topk", ratio=0.1, density_warmup=0), momentum=m, masking=False)
    u, ptrs = torch.zeros(300), []
    for t, g in enumerate(_grads(6, (300,))):
        u = g if t == 0 else torch.add(g, u, alpha=m)
        ef.compress(g, step=t, key="s")
        assert torch.equal(ef.velocity("s"), u)
        ptrs.append(ef.velocity("s").data_ptr())
    assert len(set(ptrs[1:])) == 2 and ptrs[2] == ptrs[4] and ptrs[3] == ptrs[5]
    bad = torch.randn(300)
    bad[3] = float("nan")
    ef.compress(bad, step=6, key="s")
    assert torch.equal(ef.velocity("s"), u) and ef.velocity("s").data_ptr() == ptrs[-1]


@pytest.mark.parametrize("name,params", [("topk", {"ratio": 0.05, "density_warmup": 0}), ("blockquant", {"bits": 4})])
def test_the_velocity_joins_the_fused_pass(name, params, monkeypatch):
    """On the CPU (numba backend, a known rounding of torch's add(alpha=)) topk and blockquant compute the
    velocity inside their own pass: error feedback's separate torch passes never run, and the result is
    the definition's, bitwise (with the hook's folded 1/P scale)."""
    nb = pytest.importorskip("commpress.ops.numba_backend")
    if nb.velocity_mode() is None:
        pytest.skip("torch's add(alpha=) rounds like neither fma nor a separate product on this CPU")
    m = 0.9
    ef = commpress.ErrorFeedback(commpress.get(name, **params), momentum=m, masking=False)
    monkeypatch.setattr(commpress.ErrorFeedback, "_accumulate", lambda *a, **k: pytest.fail("a separate velocity pass"))
    u = None
    for t, g in enumerate(_grads(4, (3000,))):
        half = g * 0.5
        u = half if u is None else torch.add(half, u, alpha=m)
        ef.compress(g, step=t, key="k", scale=0.5)
        assert torch.equal(ef.velocity("k"), u), t


def test_dgc_fuses_the_velocity_into_its_fixed_wire_and_its_sample(monkeypatch):
    """dgc's fixed-size wire (what the collectives send) computes the velocity in its selection pass and
    its sampled threshold from the same velocity: payloads, residuals and velocities bitwise those of the
    separate torch passes, over steps (masking on), in the sampled and the exact (small tensor) branches."""
    dgc = commpress.get("dgc", ratio=0.01, density_warmup=0)
    runs = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(type(dgc), "fuses_velocity", lambda self, t, fixed=True: False)
        ef = commpress.ErrorFeedback(commpress.get("dgc", ratio=0.01, density_warmup=0), momentum=0.9)
        if fused:
            ef._accumulate = lambda *a, **k: pytest.fail("a separate velocity pass")
        out = []
        for t, g in enumerate(_grads(5, (20_000,)) + _grads(3, (300,), seed=1)):
            key = "big" if g.numel() > 1000 else "small"
            p = ef.compress_fixed(g, step=t, key=key, scale=0.5)
            out.append([x.clone() for x in p.tensors] + [ef.residual(key).clone(), ef.velocity(key).clone()])
        runs[fused] = out
    for a, b in zip(runs[True], runs[False]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
