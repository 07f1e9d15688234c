"""Error feedback's residual storage (fp32, bf16, int8 and int4 blockwise) and its memory accounting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import commpress
from commpress.storage import INT4_BLOCK, INT8_BLOCK, LeanTensor, bytes_per_element
from memory_walk import storages_bytes

LEAN = ("bf16", "int8", "int4")
#: the blockwise storages' (elements per scale, largest code)
BLOCKWISE = {"int8": (INT8_BLOCK, 127), "int4": (INT4_BLOCK, 7)}


def _x(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("storage", LEAN)
@pytest.mark.parametrize("n", [1, 127, 128, 1000])
def test_a_store_is_within_one_code_of_the_value(storage, n):
    x = _x(n) * 3.0
    lean = LeanTensor(storage, n, x.device)
    lean.encode(x, seed=5)
    y = lean.decode()
    if storage == "bf16":
        bound = x.abs() * 2.0 ** -7            # one bf16 ulp at most
    else:
        block, top = BLOCKWISE[storage]
        blocks = torch.nn.functional.pad(x.abs(), (0, -n % block)).view(-1, block).amax(1) / top
        bound = blocks.repeat_interleave(block)[:n] * (1 + 1e-6)
    assert bool(((y - x).abs() <= bound).all())
    code_bytes = {"bf16": 2 * n, "int8": -(-n // INT8_BLOCK) * (INT8_BLOCK + 4),
                  "int4": -(-n // INT4_BLOCK) * (INT4_BLOCK // 2 + 4)}
    assert lean.nbytes == code_bytes[storage]


@pytest.mark.parametrize("storage", LEAN)
def test_a_store_is_unbiased(storage):
    # stochastic rounding: the mean of many stores is the value, within 5 sigma of the estimator
    n, trials = 256, 400
    x = _x(n, 1)
    x[0] = 100.0                              # the int8 block's scale: the others sit between codes
    total = torch.zeros(n, dtype=torch.float64)
    lean = LeanTensor(storage, n, x.device)
    for t in range(trials):
        lean.encode(x, seed=t)
        total += lean.decode().double()
    mean = total / trials
    step = (x.abs() * 2.0 ** -7) if storage == "bf16" else torch.full((n,), 100.0 / BLOCKWISE[storage][1])
    sigma = step.double() / 2 / trials ** 0.5   # a rounding's spread is at most half a code
    assert bool(((mean - x.double()).abs() <= 5 * sigma + 1e-12).all())


@pytest.mark.parametrize("storage", LEAN)
def test_a_small_steady_gradient_is_not_rounded_away(storage):
    # round-to-nearest would keep a coordinate far below its block's code at zero for ever
    # (each store's noise adds up over the steps: a random walk of sqrt(steps) * code / 2 at most;
    # the tolerance stays below what round-to-nearest would lose, the whole debt)
    ef = commpress.ErrorFeedback(commpress.get("topk", ratio=0.01), storage=storage)
    g = torch.zeros(1000)
    big, tolerance = (2.0, 0.6) if storage == "int4" else (50.0, 0.3)
    g[:10] = big           # sent every step: the block's scale stays large
    g[500] = 0.05          # under half a code of a block holding `big` (int8 0.197, int4 0.143)
    sent = 0.0
    for step in range(400):
        p = ef.compress(g, step=step, key="w")
        sent += float(ef.decompress(p)[500])
        res = ef.residual("w")[500]
    owed = 400 * 0.05
    assert abs(sent + float(res) - owed) < tolerance * owed


@pytest.mark.parametrize("storage", ("fp32", *LEAN))
def test_feedback_invariant_and_nonfinite_steps_keep_the_residual(storage):
    ef = commpress.ErrorFeedback(commpress.get("blockquant", bits=4), storage=storage)
    x = _x(3000, 2)
    for step in range(3):
        before = ef.residual("w")
        before = torch.zeros(3000) if before is None else before.clone()
        p = ef.compress(x, step=step, key="w")
        after = ef.residual("w").reshape(-1)
        got = ef.decompress(p).reshape(-1) + after
        tol = 0 if storage == "fp32" else (2.0 ** -7 * got.abs().max() if storage == "bf16" else
                                           got.abs().max() / 127 * 2)
        assert float((got - (x + before)).abs().max()) <= float(tol) + 1e-5
    kept = ef.residual("w").clone()
    bad = x.clone()
    bad[7] = float("nan")
    p = ef.compress(bad, step=3, key="w")
    assert bool(p.nonfinite)
    assert torch.equal(ef.residual("w"), kept)


@pytest.mark.parametrize("storage", LEAN)
def test_state_dict_resumes_bitwise_and_converts_between_storages(storage, tmp_path):
    ef = commpress.ErrorFeedback(commpress.get("topk", ratio=0.1), storage=storage)
    for step in range(3):
        ef.compress(_x(500, step), step=step, key="w")
    path = tmp_path / "ef.pt"
    torch.save(ef.state_dict(), path)
    state = torch.load(path, weights_only=True)
    same = commpress.ErrorFeedback(commpress.get("topk", ratio=0.1), storage=storage)
    same.load_state_dict(state)
    assert torch.equal(same.residual("w"), ef.residual("w"))
    # the next step too: the rounding's noise counter is restored
    a, b = ef.compress(_x(500, 9), step=3, key="w"), same.compress(_x(500, 9), step=3, key="w")
    assert torch.equal(a.tensors[1], b.tensors[1]) and torch.equal(ef.residual("w"), same.residual("w"))
    # into fp32: the stored value exactly; from fp32 into this storage: within one code
    wide = commpress.ErrorFeedback(commpress.get("topk", ratio=0.1))
    wide.load_state_dict(ef.state_dict())
    assert torch.equal(wide.residual("w").reshape(-1), ef.residual("w"))
    back = commpress.ErrorFeedback(commpress.get("topk", ratio=0.1), storage=storage)
    back.load_state_dict(wide.state_dict())
    r = wide.residual("w").reshape(-1)
    assert float((back.residual("w") - r).abs().max()) <= float(r.abs().max()) / (7 if storage == "int4" else 64)


def test_bad_storage_values_are_named():
    with pytest.raises(ValueError, match="storage must be one of 'fp32', 'bf16', 'int8', 'int4'"):
        commpress.ErrorFeedback(commpress.get("topk", ratio=0.1), storage="int2")
    ef = commpress.ErrorFeedback(commpress.get("topk", ratio=0.1), storage="int8")
    ef.compress(_x(300), key="w")
    state = ef.state_dict()
    state["storage"] = "fp8"
    with pytest.raises(ValueError, match="fp8"):
        commpress.ErrorFeedback(commpress.get("topk", ratio=0.1)).load_state_dict(state)


@pytest.mark.parametrize("storage", ("fp32", *LEAN))
@pytest.mark.parametrize("name,params,momentum", [("topk", {"ratio": 0.01}, 0.9), ("blockquant", {"bits": 4}, 0.0),
                                                  ("powersgd", {"rank": 2}, 0.0)])
def test_memory_counts_every_storage_the_feedback_keeps(storage, name, params, momentum):
    ef = commpress.ErrorFeedback(commpress.get(name, **params), storage=storage, momentum=momentum)
    for step in range(3):
        for key, n in (("a", 4096), ("b", 1000)):
            ef.compress(_x(n, step).view(-1, 8), step=step, key=key)
        if momentum:
            ef.dense_momentum(_x(10, step), "bias")
    parts = ef.memory()
    assert ef.memory_bytes() == sum(parts.values()) == storages_bytes(ef)
    elements = 4096 + 1000
    per = bytes_per_element(storage)
    # live and pending residuals, in the storage's size (int8: its blocks padded)
    assert parts["residuals"] == parts["pending"] >= per * elements
    assert parts["residuals"] <= per * elements + 2 * (INT8_BLOCK + 4)
    # lean storage works in fp32 buffers of the largest key's size (one pooled, one decoded), not per key;
    # a lean velocity two more (its new value until sealed, pooled: 4096 + 1 entries; its live one decoded)
    lean_velocity = 4 * (4096 + 1) + 4 * 4096 if momentum and storage != "fp32" else 0
    assert parts["working"] == (0 if storage == "fp32" else 2 * 4 * 4096 + lean_velocity)
    if momentum:   # velocities live and pending, in the storage's size (fp32: each with a padding slot)
        assert per * elements <= parts["velocities"] == parts["velocities_pending"] <= per * elements + 2 * (INT8_BLOCK + 4)


@pytest.mark.parametrize("storage", LEAN)
@pytest.mark.parametrize("kind", ["topk", "blockquant"])
@pytest.mark.parametrize("momentum,masking", [(0.0, True), (0.9, True), (0.9, False)])
def test_fused_lanes_on_a_scratch_input_match_the_buffered_path(storage, kind, momentum, masking):
    """``open_fused(scratch=True)`` (the CPU lanes: the input is the call's output) compensates in
    the input and writes the next residual over it: the same payloads and stored residuals as with
    the fp32 work buffers (bitwise without momentum), and no work buffer kept (a lean velocity is
    computed in the input too, stored, and masked in its codes)."""
    nb = pytest.importorskip("commpress.ops.numba_backend")
    n, k, bits, block = 5000, 50, 4, 64
    efs = [commpress.ErrorFeedback(commpress.get(kind, **({"ratio": 0.01} if kind == "topk" else {"bits": bits})),
                                   storage=storage, momentum=momentum, masking=masking, seed=7) for _ in range(2)]
    for step in range(3):
        outs = []
        for scratch, ef in zip((False, True), efs):
            x = _x(n, 10 + step) * (step + 1)
            slots = ef.open_fused(x, "w", scratch=scratch, scale=0.5)
            if kind == "topk":
                idx, bits_ = nb.topk_feedback_arrays(slots.x.numpy(), None if slots.live is None
                                                     else slots.live.view(-1).numpy(), ef.beta, slots.scale, k,
                                                     slots.pending.view(-1).numpy(), slots.velocity)
                payload, sent = (idx.copy(), bits_.copy()), {"sent": torch.from_numpy(idx)}
            else:
                codes = np.zeros((n * bits + 7) // 8, np.uint8)
                scales = np.zeros(-(-n // block), np.float32)
                nb.quantize_feedback_into(slots.x.numpy(), None if slots.live is None else slots.live.view(-1).numpy(),
                                          ef.beta, slots.scale, bits, block, slots.pending.view(-1).numpy(), codes,
                                          scales, slots.velocity)
                payload, sent = (codes, scales), {"sent_all": False}
            ef.close_fused("w", torch.tensor(False), **sent)
            outs.append((payload, ef.residual("w")))
        (p0, r0), (p1, r1) = outs
        if momentum:   # the velocity added by torch first rather than inside the kernel: one rounding apart
            assert torch.allclose(r0, r1, rtol=1e-5, atol=1e-6)
        else:
            assert all(np.array_equal(a, b) for a, b in zip(p0, p1)) and torch.equal(r0, r1), step
        if momentum:   # the stored velocities: the same values stored with the same noise
            u0, u1 = efs[0].velocity("w"), efs[1].velocity("w")
            assert torch.allclose(u0, u1, rtol=1e-5, atol=1e-6)
    assert efs[1].memory()["working"] == 0
    if momentum:   # a lean velocity, live and pending
        mem = efs[1].memory()
        assert mem["velocities"] == mem["velocities_pending"] <= bytes_per_element(storage) * n + INT8_BLOCK + 4


@pytest.mark.parametrize("storage", LEAN)
@pytest.mark.parametrize("name,params", [("topk", {"ratio": 0.02}), ("blockquant", {"bits": 4}),
                                         ("qsgd", {"levels": 4})])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_compress_on_a_scratch_input_matches_the_buffered_path(storage, name, params, momentum, backend, monkeypatch):
    """``compress_fixed(scratch=True)`` (a collective whose output overwrites the input, FSDP2's
    reduce-scatter input) compensates in the input: the same payloads and residuals as the buffered
    path (bitwise without momentum), no work buffer kept, and the input overwritten."""
    if backend == "numba":
        pytest.importorskip("commpress.ops.numba_backend")
    monkeypatch.setenv("COMMPRESS_BACKEND", backend)
    efs = [commpress.ErrorFeedback(commpress.get(name, **params), storage=storage, momentum=momentum, seed=3)
           for _ in range(2)]
    for step in range(3):
        outs = []
        for scratch, ef in zip((False, True), efs):
            x = _x(4000, 20 + step) * (step + 1)
            keep = x.clone()
            p = ef.compress_fixed(x, step=step, key="w", scale=0.5, scratch=scratch, generator=step)
            if not scratch:   # the buffered path leaves its input as it was
                assert torch.equal(x, keep)
            outs.append((p, ef.residual("w")))
        (p0, r0), (p1, r1) = outs
        if momentum:
            assert torch.allclose(r0, r1, rtol=1e-5, atol=1e-6)
        else:
            assert all(torch.equal(a, b) for a, b in zip(p0.tensors, p1.tensors)) and torch.equal(r0, r1), step
    assert efs[1].memory()["working"] == 0 and efs[0].memory()["working"] > 0


@pytest.mark.parametrize("storage", LEAN)
@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_send_whole_with_lean_storage_keeps_no_buffer_of_the_key(storage, wire, momentum):
    """A whole send (a sparsifier's dense round) with a lean residual: fp32 ``out`` gets exactly the
    compensation (``x*s + e``, the velocity first) and leaves a zero residual; a narrower ``out`` on a
    scratch input gives the buffered path's message and residual; no work buffer kept."""
    make = lambda: commpress.ErrorFeedback(commpress.get("topk", ratio=0.05), storage=storage,  # noqa: E731
                                           momentum=momentum, seed=1)
    a, b = make(), make()
    for ef in (a, b):   # a residual (and a velocity) to carry
        ef.compress(_x(3000, 1), key="k", scratch=True)
    e = a.residual("k").clone()
    u = a.velocity("k").clone() if momentum else None
    x = _x(3000, 2)
    outs = []
    for ef, scratch in ((a, False), (b, True)):
        out = torch.empty(3000, dtype=wire)
        bad = ef.send_whole(x.clone(), "k", out, scale=0.5, scratch=scratch)
        assert not bool(bad)
        outs.append((out, ef.residual("k")))
    (o0, r0), (o1, r1) = outs
    assert torch.equal(o0, o1) and torch.equal(r0, r1)
    if wire == torch.float32:
        want = (x * 0.5 if u is None else u * 0.9 + x * 0.5) + e
        assert torch.allclose(o0, want, rtol=1e-6, atol=1e-7) and torch.count_nonzero(r0) == 0
    assert b.memory()["working"] == 0


@pytest.mark.parametrize("storage", LEAN)
def test_zero_at_stores_exact_zeros_there_and_nowhere_else(storage):
    n = 3 * INT4_BLOCK + 45   # a short tail block: both halves of the int4 layout
    x = _x(n, 4) + 3.0        # no zeros of its own
    lean = LeanTensor(storage, n, x.device)
    lean.encode(x, seed=2)
    before = lean.decode()
    idx = torch.tensor([0, 31, 32, 63, 64, n - 1, n, n])   # n: a padding slot, ignored
    lean.zero_at(idx)
    after = lean.decode()
    hit = torch.zeros(n, dtype=torch.bool)
    hit[idx[idx < n]] = True
    assert bool((after[hit] == 0).all()) and torch.equal(after[~hit], before[~hit])
    lean.zero_()
    assert bool((lean.decode() == 0).all())


@pytest.mark.parametrize("storage", LEAN)
@pytest.mark.parametrize("masking", [True, False])
def test_a_lean_velocity_resumes_bitwise_and_keeps_on_a_nonfinite_step(storage, masking, tmp_path):
    """Momentum correction's velocity is kept in the residuals' storage (live and pending): a
    checkpoint holds its codes (the next steps bitwise), a NaN step keeps it, masking zeroes it
    where sent."""
    make = lambda: commpress.ErrorFeedback(commpress.get("topk", ratio=0.05), storage=storage, momentum=0.9,
                                           masking=masking, seed=3)
    ef = make()
    for step in range(3):
        p = ef.compress(_x(700, step), step=step, key="w")
    assert isinstance(ef._velocity["w"], LeanTensor)
    if masking:   # what was sent: zero in the stored velocity
        assert bool((ef.velocity("w")[p.tensors[0].long()] == 0).all())
    path = tmp_path / "ef.pt"
    torch.save(ef.state_dict(), path)
    same = make()
    same.load_state_dict(torch.load(path, weights_only=True))
    assert torch.equal(same.velocity("w"), ef.velocity("w"))
    for step in (3, 4):
        a, b = ef.compress(_x(700, step), step=step, key="w"), same.compress(_x(700, step), step=step, key="w")
        assert torch.equal(a.tensors[1], b.tensors[1]) and torch.equal(ef.velocity("w"), same.velocity("w"))
    kept = ef.velocity("w").clone()
    bad = _x(700, 9)
    bad[5] = float("nan")
    assert bool(ef.compress(bad, step=5, key="w").nonfinite)
    assert torch.equal(ef.velocity("w"), kept)
    # into an fp32 feedback: the stored values exactly; a checkpoint of the fp32 format loads too
    wide = commpress.ErrorFeedback(commpress.get("topk", ratio=0.05), momentum=0.9, masking=masking)
    wide.load_state_dict(ef.state_dict())
    assert torch.equal(wide.velocity("w").reshape(-1), kept)
    back = make()
    back.load_state_dict(wide.state_dict())
    assert float((back.velocity("w") - kept).abs().max()) <= float(kept.abs().max()) / 7


@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
@pytest.mark.parametrize("offset,n", [(0, 1000), (37, 500), (128, 1), (1, 1 << 16)])
def test_int8_velocity_pass_is_bitwise_torchs(scale, offset, n):
    """``LeanTensor.velocity_into`` (one numba pass over an int8 store) computes what
    ``accumulate_velocity`` computes on the decoded span, bit for bit."""
    pytest.importorskip("commpress.ops.numba_backend")
    from commpress.ops.numba_backend import velocity_mode
    from commpress.ops.reference import accumulate_velocity

    numel = offset + n + 77
    store = LeanTensor("int8", numel, torch.device("cpu"))
    store.encode(_x(numel, 5) * 2, seed=4)
    x = _x(n, 6)
    want = accumulate_velocity(x.clone(), scale, store.decode()[offset:offset + n].clone(), 0.9, torch.empty(n))
    out = torch.empty(n)
    if velocity_mode() is None:   # torch rounds like neither here: the pass declines
        assert not store.velocity_into(x, scale, 0.9, offset, out)
        return
    assert store.velocity_into(x, scale, 0.9, offset, out)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    inplace = x.clone()
    assert store.velocity_into(inplace, scale, 0.9, offset, inplace) and torch.equal(inplace, out)
    both, beside = x.clone(), torch.full((n,), 7.0)   # also=: a second copy in the same pass
    assert store.velocity_into(both, scale, 0.9, offset, beside, also=both)
    assert torch.equal(both, out) and torch.equal(beside, out)


def test_int8_velocity_pass_refuses_a_span_outside_the_store():
    """The pass indexes without bounds checks: a part past the store's end raises, touching nothing."""
    store = LeanTensor("int8", 300, torch.device("cpu"))
    with pytest.raises(ValueError, match="out of range"):
        store.velocity_into(torch.zeros(100), 0.5, 0.9, 250, torch.empty(100))
    with pytest.raises(ValueError, match="out of range"):
        store.velocity_into(torch.zeros(100), 0.5, 0.9, 0, torch.empty(99))


def _unit_velocity_runs(layout, scale, steps, nan_step=None):
    """``(buffers, stores)`` of the part-by-part velocity (``velocity_into`` per part, then
    ``stage_velocity``) and of the one-pass ``velocity_unit``, over ``steps`` steps of a unit laid
    out as ``layout`` (``(offset, n)`` parts of a buffer, gaps between them) with int8 storage."""
    size = max(o + n for o, n in layout) + 5
    numel = sum(n for _, n in layout)
    runs = []
    for one_pass in (False, True):
        ef = commpress.ErrorFeedback(commpress.get("identity"), momentum=0.9, storage="int8", seed=3)
        bufs = []
        for step in range(steps):
            buf = _x(size, 20 + step)
            if step == nan_step:
                buf[layout[-1][0] + layout[-1][1] // 2] = float("nan")
            tx = commpress.feedback.ResidualTransaction()
            if one_pass:
                flagged = ef.velocity_unit(buf, layout, "u", numel, scale=scale, transaction=tx)
                assert flagged is (step == nan_step), (step, flagged)   # it read the NaN
            else:
                pos = 0
                for off, n in layout:
                    ef.velocity_into(buf[off:off + n], "u", numel, pos, scale=scale)
                    pos += n
                ef.stage_velocity("u", tx)
            tx.mark_bad(commpress.feedback.nonfinite_flag(buf))
            tx.commit()
            bufs.append(buf)
        runs.append((bufs, ef.velocity("u").reshape(-1).clone(), ef.state_dict()))
    return runs


@pytest.mark.parametrize("scale", [1.0, 0.5])
@pytest.mark.parametrize("layout", [[(0, 1000)], [(3, 200), (210, 77), (300, 1001)], [(0, 128), (130, 128)],
                                    [(7, 1)], [(0, 300), (301, 20000)]])
def test_the_one_pass_unit_velocity_is_bitwise_the_part_by_part_one(scale, layout):
    """``ErrorFeedback.velocity_unit`` (DDP's own path under "auto" with momentum correction: the
    live int8 velocity decoded, the parts written, the new velocity stored, block by block, blocks
    straddling parts) leaves the buffer and the stored velocity bitwise as the part-by-part calls
    do, step after step (the first without a live velocity), and a step with a NaN keeps both."""
    pytest.importorskip("commpress.ops.numba_backend")
    from commpress.ops.numba_backend import velocity_mode

    if velocity_mode() is None:
        ef = commpress.ErrorFeedback(commpress.get("identity"), momentum=0.9, storage="int8")
        assert ef.velocity_unit(_x(100, 1), [(0, 100)], "u", 100) is None   # declines: the caller goes part by part
        return
    (bufs_a, vel_a, sd_a), (bufs_b, vel_b, sd_b) = _unit_velocity_runs(layout, scale, 4, nan_step=2)
    for a, b in zip(bufs_a, bufs_b):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert torch.equal(vel_a.view(torch.int32), vel_b.view(torch.int32)) and bool(vel_a.abs().sum() > 0)
    assert sd_a.keys() == sd_b.keys()


def test_the_one_pass_unit_velocity_declines_where_it_does_not_apply():
    """Another storage, or a part-by-part write in progress: ``None``, nothing touched."""
    ef = commpress.ErrorFeedback(commpress.get("identity"), momentum=0.9, storage="bf16")
    x = _x(300, 1)
    before = x.clone()
    assert ef.velocity_unit(x, [(0, 300)], "u", 300) is None and torch.equal(x, before)
    ef8 = commpress.ErrorFeedback(commpress.get("identity"), momentum=0.9, storage="int8")
    ef8.velocity_into(x[:100], "u", 300, 0)
    y = _x(300, 2)
    assert ef8.velocity_unit(y, [(0, 300)], "u", 300) is None and torch.equal(y, _x(300, 2))
    with pytest.raises(ValueError, match="parts of 200"):
        ef8.velocity_unit(y, [(0, 200)], "u", 300)
