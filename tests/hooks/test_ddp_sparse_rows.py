"""``commpress.ddp.register(..., sparse_rows=...)`` on gloo ranks: an embedding's naturally sparse
gradient summed losslessly as rows (issue 52), beside whatever the rest of the model uses."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run

import commpress

ROWS, DIM = 5000, 16


class EmbNet(nn.Module):
    """An embedding of 5000 x 16 (80k parameters) and a Linear head."""

    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(ROWS, DIM, sparse=sparse)
        self.fc = nn.Linear(DIM, 64)

    def forward(self, ids):
        return self.fc(self.emb(ids)).sum(1)


def _fast_ops():
    import os
    os.environ["COMMPRESS_BACKEND"] = "torch"


def _ids(rank: int, world: int, step: int, kind: str = "own") -> torch.Tensor:
    """Token ids of ``rank`` at ``step``.  ``own``: rows of the rank's own range (no row shared
    across ranks); ``shared``: a few rows every rank touches plus random ones; ``all``: every
    row; ``grow``: more rows every step (past any capacity seen)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if kind == "all":
        return torch.arange(ROWS).reshape(-1, 10)
    if kind == "own":
        span = ROWS // world
        return rank * span + torch.randint(0, span, (8, 6), generator=g)
    if kind == "grow":
        return torch.randint(0, ROWS, (4 * (step + 1), 8), generator=g)
    return torch.cat([torch.arange(8), torch.randint(0, ROWS, (40,), generator=g)]).reshape(6, 8)


def _make(seed: int = 0, sparse: bool = False) -> DDP:
    torch.manual_seed(seed)
    return DDP(EmbNet(sparse), bucket_cap_mb=0.05)


def _step(model: DDP, ids: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(ids).pow(2).mean().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _vs_ddp(rank, world, kinds, compressor, params, sparse_rows, *, overlap=False):
    """Plain DDP and the hook side by side on the same batches; per step both models' grads
    (``sparse_rows="tensor"``: the embedding's weight itself)."""
    _fast_ops()
    ref, mine = _make(), _make()
    state = commpress.ddp.register(mine, compressor, warmup_steps=1, overlap=overlap,
                                   sparse_rows=[mine.module.emb.weight] if sparse_rows == "tensor" else sparse_rows,
                                   **params)
    out = []
    for step, kind in enumerate(kinds):
        ids = _ids(rank, world, step, kind)
        want, got = _step(ref, ids), _step(mine, ids)
        out.append((want, got, state.stats.as_dict().get("sparse_rows", {}).get("emb.weight", {}).get("path")))
    stats = state.stats.as_dict()
    units = [list(u.names) for u in state.units]
    state.close()
    return out, stats, units


def _same_across_ranks(results):
    for other in results[1:]:
        for (_, a, _), (_, b, _) in zip(results[0][0], other[0]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 3])
def test_rows_equal_plain_ddp_per_step(world):
    kinds = ["own", "own", "shared", "own", "shared"]
    results = run(_vs_ddp, world, kinds, "identity", {}, "tensor", timeout=80)
    _same_across_ranks(results)
    steps, stats, units = results[0]
    for step, (want, got, _) in enumerate(steps):
        for w, g in zip(want, got):
            assert torch.allclose(w, g, rtol=1e-6, atol=1e-7), step
        if kinds[step] == "own":   # no row shared: exactly DDP's average
            assert torch.equal(want[0], got[0]), step
    rows = stats["sparse_rows"]["emb.weight"]
    assert rows["path"] == "rows" and rows["declared"] and rows["rows_calls"] == len(kinds) - 1
    assert rows["algorithm"] in ("allgather", "hashed") and 0 < rows["density"] < 0.05
    assert units == []   # identity: nothing compressed; the embedding in no unit
    assert any(a.startswith("rows_") for a in stats["algorithms"].values())
    # the rows' bytes are a fraction of a dense all_reduce's
    assert stats["last_step"]["bytes_sent"] < 0.5 * stats["last_step"]["dense_bytes"]
    # kept between steps: counts, the dense part's scratch, the collectives' caches (the owner
    # table at 4 bytes a row where the all-gather runs): a fraction of the embedding's own bytes
    assert "sparse_rows" in stats["memory"]["by_kind"]
    if rows["algorithm"] == "allgather":
        assert stats["memory_overhead_bytes"] < ROWS * DIM * 4 // 4, stats["memory"]


@pytest.mark.timeout(90)
def test_rows_equal_plain_ddp_with_overlap_worker():
    kinds = ["own", "shared", "own", "shared"]
    results = run(_vs_ddp, 2, kinds, "identity", {}, ["emb.weight"], overlap=True, timeout=80)
    _same_across_ranks(results)
    for want, got, _ in results[0][0]:
        assert all(torch.allclose(w, g, rtol=1e-6, atol=1e-7) for w, g in zip(want, got))


@pytest.mark.timeout(90)
def test_auto_turns_rows_on_then_dense_when_most_rows_are_touched():
    # step 0 measured (dense warm-up), rows from step 1; every row touched at step 3: the rows call
    # finds them dense and the embedding goes in its bucket's dense part from step 4
    kinds = ["own", "own", "shared", "all", "shared", "own"]
    results = run(_vs_ddp, 2, kinds, "identity", {}, "auto", timeout=80)
    _same_across_ranks(results)
    steps, stats, _ = results[0]
    for want, got, _ in steps:
        assert all(torch.allclose(w, g, rtol=1e-6, atol=1e-7) for w, g in zip(want, got))
    paths = [p for _, _, p in steps]
    assert paths == ["dense", "rows", "rows", "dense", "dense", "dense"], paths
    report = stats["sparse_rows"]
    assert report["emb.weight"]["rows_calls"] == 3 and not report["emb.weight"]["declared"]
    assert report["fc.weight"]["path"] == "dense" and report["fc.weight"]["rows_calls"] == 0
    assert report["emb.weight"]["density"] == 1.0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 3])
def test_overflow_rounds_counted_and_nothing_lost(world):
    kinds = ["grow"] * 6   # more rows every step: past the capacity of the last steps
    results = run(_vs_ddp, world, kinds, "identity", {}, ["emb.weight"], timeout=80)
    _same_across_ranks(results)
    steps, stats, _ = results[0]
    for want, got, _ in steps:
        assert all(torch.allclose(w, g, rtol=1e-6, atol=1e-7) for w, g in zip(want, got))
    assert stats["sparse_rows"]["emb.weight"]["overflow_rounds"] >= 1


@pytest.mark.timeout(90)
def test_topk_with_error_feedback_on_the_rest_rows_lossless():
    kinds = ["own", "own", "shared", "own", "own"]
    results = run(_vs_ddp, 2, kinds, "topk", {"ratio": 0.05, "min_numel": 16}, ["emb.weight"], timeout=80)
    _same_across_ranks(results)
    steps, stats, units = results[0]
    assert units and all("emb.weight" not in u for u in units) and any("fc.weight" in u for u in units)
    for step, (want, got, _) in enumerate(steps):
        assert torch.allclose(want[0], got[0], rtol=1e-6, atol=1e-7), step   # the embedding: lossless
        if kinds[step] == "own":
            assert torch.equal(want[0], got[0]), step
    assert not torch.allclose(steps[-1][0][1], steps[-1][1][1])   # fc.weight went through top-k
    assert any("rows_" in a for a in stats["algorithms"].values())


def _nan_step(rank, world):
    _fast_ops()
    model = _make()
    state = commpress.ddp.register(model, "topk", ratio=0.05, min_numel=16, warmup_steps=1, overlap=False,
                                   sparse_rows=[model.module.emb.weight])
    for step in range(3):
        _step(model, _ids(rank, world, step))
    before = {k: v.clone() for k, v in state.residuals_by_param().items()}
    model.zero_grad()
    model(_ids(rank, world, 3)).pow(2).mean().backward()   # hook runs; then poison the next one
    mid = {k: v.clone() for k, v in state.residuals_by_param().items()}

    def poison(grad):
        grad = grad.clone()
        if rank == 1:
            grad[7, 0] = float("nan")
        return grad
    h = model.module.emb.weight.register_hook(poison)
    model.zero_grad()
    model(_ids(rank, world, 4)).pow(2).mean().backward()
    h.remove()
    after = state.residuals_by_param()
    nan_everywhere = bool(model.module.emb.weight.grad.isnan().any())
    state.close()
    return (all(torch.equal(mid[k], after[k]) for k in after),
            any(not torch.equal(before[k], mid[k]) for k in mid), nan_everywhere)


@pytest.mark.timeout(90)
def test_nan_in_rows_marks_the_step_bad():
    for kept, moved, nan in run(_nan_step, 2, timeout=80):
        assert moved      # a clean step updates the residuals
        assert kept       # the step with a NaN in the rows keeps them as they were
        assert nan        # and the NaN propagates to every rank (GradScaler skips the step)


def _bad(rank, world, which):
    model = _make(sparse=which == "sparse_embedding")
    arg = {"other_tensor": [torch.zeros(3, 4)], "bias": [model.module.fc.bias],
           "name": ["emb.nope"], "sparse_embedding": None}[which]
    try:
        commpress.ddp.register(model, "identity", sparse_rows=arg, overlap=False)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(90)
@pytest.mark.parametrize("which,named", [("other_tensor", "sparse_rows[0] (a tensor of shape (3, 4))"),
                                         ("bias", "'fc.bias'"), ("name", "'emb.nope'"),
                                         ("sparse_embedding", "emb is Embedding(sparse=True)")])
def test_bad_input_raises_value_error_naming_it_on_every_rank(which, named):
    for msg in run(_bad, 2, which, timeout=80):
        assert msg is not None and named in msg, msg


def test_bad_sparse_rows_type_refused_at_construction():
    with pytest.raises(ValueError, match="sparse_rows"):
        commpress.ddp.DDPState("identity", sparse_rows="all")
    with pytest.raises(TypeError, match="sparse_rows"):
        commpress.ddp.DDPState("identity", sparse_rows=torch.zeros(3, 3))


def _resume(rank, world, compressor, params, sparse_rows, total, split):
    _fast_ops()

    def train(model, opt, first, steps):
        for step in range(first, first + steps):
            opt.zero_grad()
            model(_ids(rank, world, step, "shared")).pow(2).mean().backward()
            opt.step()

    def build(seed):
        model = _make(seed)
        state = commpress.ddp.register(model, compressor, warmup_steps=1, overlap=False,
                                       sparse_rows=sparse_rows, **params)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    full, s_full, o_full = build(0)
    train(full, o_full, 0, total)
    a, s_a, o_a = build(0)
    train(a, o_a, 0, split)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": o_a.state_dict(), "hook": s_a.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    b, s_b, o_b = build(7)
    b.load_state_dict(ckpt["model"])
    o_b.load_state_dict(ckpt["opt"])
    s_b.load_state_dict(ckpt["hook"])
    assert s_b.stats.as_dict()["sparse_rows"]["emb.weight"]["capacity"] == \
        s_a.stats.as_dict()["sparse_rows"]["emb.weight"]["capacity"]
    train(b, o_b, split, total - split)
    same = all(torch.equal(x, y) for x, y in zip(full.parameters(), b.parameters()))
    report = s_full.stats.as_dict()["sparse_rows"]
    for s in (s_full, s_a, s_b):
        s.close()
    return same, report


@pytest.mark.timeout(120)
@pytest.mark.parametrize("compressor,params,sparse_rows", [
    ("topk", {"ratio": 0.05, "min_numel": 16}, ["emb.weight"]),
    ("identity", {}, "auto"),
    ("topk", {"ratio": 0.05, "min_numel": 16}, "auto"),
], ids=["topk-declared", "identity-auto", "topk-auto"])
def test_checkpoint_resume_is_bitwise(compressor, params, sparse_rows):
    for same, report in run(_resume, 2, compressor, params, sparse_rows, 6, 3, timeout=110):
        assert same
        assert report["emb.weight"]["path"] == "rows" and report["emb.weight"]["rows_calls"] == 5
        # "auto" with a compressor: fc.weight, found dense at the first compressed step, stays with it
        assert ("fc.weight" in report) == (compressor == "identity")


@pytest.mark.timeout(120)
def test_auto_compressor_keeps_rows_parameters_out_of_its_units():
    from commpress.auto.runtime import AutoSpec

    kinds = ["own", "own", "shared", "own", "own"]
    results = run(_vs_ddp, 2, kinds, "auto", {"auto": AutoSpec(candidates=[("topk", 0.05)], check_every=2),
                                               "min_numel": 16}, ["emb.weight"], timeout=110)
    _same_across_ranks(results)
    steps, stats, units = results[0]
    assert units and all("emb.weight" not in u for u in units)
    for step, (want, got, _) in enumerate(steps):
        assert torch.allclose(want[0], got[0], rtol=1e-6, atol=1e-7), step
        if kinds[step] == "own":
            assert torch.equal(want[0], got[0]), step
    assert stats["sparse_rows"]["emb.weight"]["rows_calls"] == len(kinds) - 1


def _scaled(rank, world, scaled):
    _fast_ops()
    model = _make()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2) if scaled else None
    state = commpress.ddp.register(model, "topk", ratio=0.05, min_numel=16, warmup_steps=1, overlap=False,
                                   sparse_rows=["emb.weight"], scaler=scaler)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        opt.zero_grad()
        loss = model(_ids(rank, world, step, "shared")).pow(2).mean()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    rows = state.stats.as_dict()["sparse_rows"]["emb.weight"]["rows_calls"]
    state.close()
    return [p.detach().clone() for p in model.parameters()], rows


@pytest.mark.timeout(90)
def test_loss_scaler_leaves_the_rows_and_the_rest_as_unscaled():
    # a power-of-two scale that grows every 2 steps: every multiplication by S or 1/S is exact
    plain, scaled = run(_scaled, 2, False, timeout=80), run(_scaled, 2, True, timeout=80)
    for (a, rows_a), (b, rows_b) in zip(plain, scaled):
        assert rows_a == rows_b == 4
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _host_reads(rank, world, overlap):
    from test_ddp_host_reads import HostReads

    _fast_ops()
    model = _make()
    state = commpress.ddp.register(model, "topk", ratio=0.05, min_numel=16, density_warmup=0, warmup_steps=1,
                                   overlap=overlap, sparse_rows=["emb.weight"])
    for step in range(4):   # warm-up, the first rows call (a count round), capacities from the counts
        _step(model, _ids(rank, world, step))
    with HostReads() as reads:
        _step(model, _ids(rank, world, 4))
    algorithms = set(state.stats.last_step["units"][u]["algorithm"] for u in state.stats.last_step["units"])
    state.close()
    return reads.calls, sorted(algorithms)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "inline"])
def test_steady_state_reads_only_what_rows_documents(overlap):
    # the rows call's one read of the gathered counts (collectives/rows.py) and the last step's
    # counts, long gathered (sparse_rows.py's LazyRead: on CUDA a pinned copy behind an event)
    for calls, algorithms in run(_host_reads, 2, overlap, timeout=80):
        assert any("rows_" in a for a in algorithms), algorithms
        others = [c for c in calls if not c.split(" at ")[1].startswith(("collectives/rows.py",
                                                                         "hooks/sparse_rows.py"))]
        assert others == [], others
        assert len(calls) <= 3, calls


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 3])
def test_rows_turned_dense_go_in_the_compressed_bucket_dense_part(world):
    # every row touched at step 2: from step 3 the embedding goes in its bucket's dense part beside
    # top-k's unit (riding in its message at P=2, its own all_reduce at P=3), the units unchanged
    kinds = ["own", "own", "all", "own", "own"]
    results = run(_vs_ddp, world, kinds, "topk", {"ratio": 0.05, "min_numel": 16}, ["emb.weight"], timeout=80)
    _same_across_ranks(results)
    steps, stats, units = results[0]
    assert [p for _, _, p in steps] == ["rows", "rows", "dense", "dense", "dense"]
    assert units and all("emb.weight" not in u for u in units)
    for step, (want, got, _) in enumerate(steps):
        assert torch.allclose(want[0], got[0], rtol=1e-6, atol=1e-7), step
    assert stats["sparse_rows"]["emb.weight"]["rows_calls"] == 2


@pytest.mark.timeout(90)
def test_momentum_correction_gives_rows_plain_momentum():
    # DGC's momentum correction: the hook holds the momentum; a rows parameter (on either path) gets
    # plain momentum on its exact average, from the first compressed step (step 0 is dense warm-up)
    kinds = ["own", "own", "shared", "all", "own"]
    results = run(_vs_ddp, 2, kinds, "topk", {"ratio": 0.05, "min_numel": 16, "momentum": 0.9}, ["emb.weight"],
                  timeout=80)
    _same_across_ranks(results)
    steps, _, _ = results[0]
    velocity = None
    for step, (want, got, _) in enumerate(steps):
        if step == 0:
            assert torch.allclose(want[0], got[0], rtol=1e-6, atol=1e-7)
            continue
        velocity = want[0].clone() if velocity is None else 0.9 * velocity + want[0]
        assert torch.allclose(velocity, got[0], rtol=1e-5, atol=1e-7), step
