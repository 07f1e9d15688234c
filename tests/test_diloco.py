"""commpress.diloco.DiLoCo: against a hand-written reference, replicas, resume, NaN, bad input.

One 2-rank run makes every multi-process check (a process start costs more than the checks).

Exactness is bitwise (``torch.equal``), not within a tolerance: with 2 ranks and compressor=None
every number is computed by the same fp32 operations as in the reference (a sum of two values
is the same in any order, the division by 2 is exact, and the outer step uses torch.optim.SGD's
own formulas: ``buf*m + g``, ``g + m*buf``, ``θ - lr*update``).
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import run

import commpress
from commpress.diloco import DiLoCo

H = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


# fragments of _model() for F = 2 (w1 | b1, w2, b2), written out by hand for the reference
REF_FRAGMENTS = {1: [[0, 1, 2, 3]], 2: [[0], [1, 2, 3]]}


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _inner_step(model, rank, step):
    x, y = _batch(rank, step)
    nn.functional.mse_loss(model(x), y).backward()


def reference(rank, world, steps, fragments, tau, lr=0.7, momentum=0.9, finish=False):
    """DiLoCo / Streaming DiLoCo written out with torch primitives: AdamW inside, one SGD
    (Nesterov) per fragment outside, fp32 pseudo-gradients summed by dist.all_reduce.
    ``finish``: then the end of the run (what ``close()`` does): the exchanges still pending
    applied, and every parameter set to its global value."""
    model = _model()
    params = list(model.parameters())
    inner = torch.optim.AdamW(params, lr=1e-2)
    frags = REF_FRAGMENTS[fragments]
    glob = [p.detach().clone().requires_grad_(True) for p in params]
    outer = [torch.optim.SGD([glob[i] for i in f], lr=lr, momentum=momentum, nesterov=True) for f in frags]
    offsets = [((f + 1) * H // fragments) % H for f in range(fragments)]
    pending = []
    for t in range(1, steps + 1):
        _inner_step(model, rank, t)
        inner.step()
        inner.zero_grad()
        due = [p for p in pending if p[0] == t]
        pending = [p for p in pending if p[0] != t]
        sends = [(t + tau, f) for f in range(fragments) if t % H == offsets[f]]
        for at, f in sends:
            deltas = [glob[i].detach() - params[i].detach() for i in frags[f]]
            for d in deltas:
                dist.all_reduce(d)
                d.div_(world)
            (due if tau == 0 else pending).append((at, f, deltas))
        for _, f, deltas in due:
            for i, d in zip(frags[f], deltas):
                glob[i].grad = d
            outer[f].step()
            with torch.no_grad():
                for i in frags[f]:
                    params[i].copy_(glob[i])
    if finish:
        for _, f, deltas in pending:
            for i, d in zip(frags[f], deltas):
                glob[i].grad = d
            outer[f].step()
        with torch.no_grad():
            for p, g in zip(params, glob):
                p.copy_(g)
    return [p.detach().clone() for p in params]


def _train(rank, steps, model=None, opt=None, dl=None, start=0, **kw):
    model = model if model is not None else _model()
    opt = opt if opt is not None else torch.optim.AdamW(model.parameters(), lr=1e-2)
    dl = dl if dl is not None else DiLoCo(model, opt, sync_every=H, **kw)
    for t in range(start + 1, steps + 1):
        _inner_step(model, rank, t)
        dl.step()
        dl.zero_grad()
    return model, opt, dl


def _same_everywhere(tensors) -> bool:
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    out = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(out, flat)
    return all(torch.equal(out[0], o) for o in out)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def diloco_worker(rank, world):
    res = {}
    # 1. exactness against the reference: plain DiLoCo, and streaming with overlap (worker thread)
    for fragments, tau in ((1, 0), (2, 1)):
        want = reference(rank, world, 8, fragments, tau)
        model, _, dl = _train(rank, 8, fragments=fragments, overlap=tau)
        res[f"exact F{fragments} tau{tau}"] = all(torch.equal(a, b) for a, b in zip(_params(model), want))
        res[f"dense bytes F{fragments}"] = dl.stats.bytes_sent
        dl.close()

    # 2. replicas after every sync, compressed (SparseLoCo: no outer momentum, decayed error feedback)
    sparse = dict(outer_momentum=0.0, outer_lr=1.0,
                  compressor=commpress.ErrorFeedback(commpress.get("sparseloco", ratio=0.1, chunk=32), beta=0.9))
    model, _, dl = _train(rank, 2 * H, overlap=False, **sparse)
    res["replicas sparseloco"] = _same_everywhere(model.parameters())
    res["not trivially"] = not torch.equal(_params(model)[0], _params(_model())[0])
    res["sparse bytes"] = dl.stats.bytes_sent
    dl.close()

    # 3. bitwise resume with a fragment in flight (sent at step 7, applied at 8)
    def streaming():
        return dict(fragments=2, overlap=1, outer_momentum=0.5, compressor="sparseloco", ratio=0.2, chunk=16)
    straight, _, dl = _train(rank, 11, **streaming())
    straight = _params(straight)   # the local replica at step 11 (close() then sets the global one)
    dl.close()
    model, opt, dl = _train(rank, 7, **streaming())
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "dl": dl.state_dict()}, buf)
    res["in flight at save"] = len(dl.state_dict()["in_flight"])
    dl.close()
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the checkpoint must overwrite everything
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dl = DiLoCo(model, opt, sync_every=H, **streaming())
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["opt"])
    dl.load_state_dict(ck["dl"])
    _train(rank, 11, model, opt, dl, start=7)
    res["resume bitwise"] = all(torch.equal(a, b) for a, b in zip(_params(model), straight))
    dl.close()

    # 4. NaN in rank 1's pseudo-gradient at the sync of step 2H: skipped everywhere, nothing lost
    for name, kw in (("dense", {}), ("sparseloco", dict(compressor="sparseloco", ratio=0.2, chunk=16))):
        model, opt, dl = _train(rank, H, overlap=False, **kw)
        glob = [g.clone() for g in dl.global_parameters()]
        mom = [f.momentum.clone() for f in dl._fragments]
        resid = {} if dl.compressor is None else {k: r.clone() for k, r in dl.compressor._residuals.items()}
        _train(rank, 2 * H - 1, model, opt, dl, start=H)
        _inner_step(model, rank, 2 * H)
        if rank == 1:
            with torch.no_grad():
                next(model.parameters())[0, 0] = float("nan")
        dl.step()
        dl.zero_grad()
        kept = all(torch.equal(a, b) for a, b in zip(glob, dl.global_parameters()))
        kept &= all(torch.equal(a, f.momentum) for a, f in zip(mom, dl._fragments))
        if dl.compressor is not None:
            kept &= resid.keys() == dl.compressor._residuals.keys() and all(
                torch.equal(r, dl.compressor._residuals[k]) for k, r in resid.items()) and len(resid) > 0
        back = torch.equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                           torch.cat(dl.global_parameters()))
        skipped = dl.stats.skipped_syncs
        _train(rank, 3 * H, model, opt, dl, start=2 * H)  # the next sync goes through
        moved = not all(torch.equal(a, b) for a, b in zip(glob, dl.global_parameters()))
        finite = all(torch.isfinite(p).all() for p in model.parameters())
        res[f"nan {name}"] = (kept, back, skipped, moved, finite, _same_everywhere(model.parameters()))
        dl.close()

    # 4b. the end of a run (overlap on, worker thread): close() or a with block applies the exchange
    # still in flight (stop at 7: fragment 0 sent at 7) or, with none (stop at 8), the drifted
    # fragment's global value: one model, bitwise identical on every rank, the reference's
    for steps, how in ((7, "close"), (8, "with")):
        want = reference(rank, world, steps, 2, 1, finish=True)
        if how == "close":
            model, _, dl = _train(rank, steps, fragments=2, overlap=1)
            in_flight = len(dl._in_flight)
            differ = not _same_everywhere(model.parameters())
            dl.close()
            dl.close()  # idempotent
        else:
            model = _model()
            with DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H, fragments=2,
                        overlap=1) as dl:
                _train(rank, steps, model, dl.inner_optimizer, dl)
                in_flight = len(dl._in_flight)
                differ = not _same_everywhere(model.parameters())
        try:
            dl.step()
            after = None
        except RuntimeError as exc:
            after = str(exc)
        res[f"end {how}"] = (in_flight, differ, _same_everywhere(model.parameters()),
                             all(torch.equal(a, b) for a, b in zip(_params(model), want)),
                             torch.equal(torch.cat([p.reshape(-1) for p in _params(model)]),
                                         torch.cat(dl.global_parameters())),
                             after is not None and "closed" in after, dl._executor.group is None)

    # 5. bad input on one rank, or configurations that differ, raise on every rank
    for what, kw in (("local", {"sync_every": 0 if rank == 1 else H}),
                     ("differ", {"sync_every": H, "outer_lr": 0.7 if rank == 0 else 0.5}),
                     ("compressor", {"sync_every": H, "compressor": "topk" if rank == 0 else "sparseloco"})):
        model = _model()
        try:
            DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)
            res[f"raises {what}"] = None
        except ValueError as exc:
            res[f"raises {what}"] = str(exc)

    # 6. a failure on one rank (its compressor raises on its data) raises on every rank, from the
    # worker too (the collective sends a zero payload of the right size in its place)
    class Failing(type(commpress.get("fp16"))):
        fused_feedback = False   # ErrorFeedback calls the compress() below (not a fused path around it)

        def compress(self, tensor, **kw):
            if dist.get_rank() == 1 and bool(tensor.abs().sum() > 0):
                raise RuntimeError("rank 1's codec broke")
            return super().compress(tensor, **kw)

    for tau in (0, 1):
        try:
            model, _, dl = _train(rank, H + tau, overlap=tau, compressor=Failing())
            res[f"failure tau{tau}"] = None
        except Exception as exc:  # noqa: BLE001 - what every rank saw
            res[f"failure tau{tau}"] = f"{type(exc).__name__}: {exc}"
    return res


@pytest.mark.timeout(120)
def test_diloco_two_ranks():
    for out in run(diloco_worker, 2, timeout=110):
        assert out["exact F1 tau0"], "dense DiLoCo differs from the reference"
        assert out["exact F2 tau1"], "streaming DiLoCo (overlap on the worker) differs from the reference"
        numel = sum(p.numel() for p in _model().parameters())
        assert out["dense bytes F1"] >= 2 * 4 * numel * (8 // H) // 2  # fp32 ring all_reduce per sync
        assert out["replicas sparseloco"] and out["not trivially"]
        assert 0 < out["sparse bytes"] < out["dense bytes F1"] / 2
        assert out["in flight at save"] == 1
        assert out["resume bitwise"]
        # in flight at the end, replicas apart before close(), identical after, the reference's end,
        # the global parameters, closed for good, the worker's group released
        assert out["end close"] == (1, True, True, True, True, True, True), out["end close"]
        assert out["end with"] == (0, True, True, True, True, True, True), out["end with"]
        for name in ("dense", "sparseloco"):
            assert out[f"nan {name}"] == (True, True, 1, True, True, True), name
        assert "rank 1" in out["raises local"] and "sync_every" in out["raises local"]
        assert "outer_lr" in out["raises differ"]
        assert "compressor" in out["raises compressor"]
        for tau in (0, 1):
            msg = out[f"failure tau{tau}"]  # rank 1 says why; rank 0 that rank 1 failed
            assert msg and "CollectiveInputError" in msg and ("codec broke" in msg or "rank(s) [1]" in msg), msg


def test_bad_arguments_name_the_argument():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [
        (dict(sync_every=0), "sync_every"), (dict(sync_every=2.5), "sync_every"),
        (dict(sync_every=4, outer_lr=0), "outer_lr"), (dict(sync_every=4, outer_lr=float("nan")), "outer_lr"),
        (dict(sync_every=4, outer_momentum=1.0), "outer_momentum"), (dict(sync_every=4, nesterov=1), "nesterov"),
        (dict(sync_every=4, fragments=0), "fragments"), (dict(sync_every=4, fragments=5), "fragments"),
        (dict(sync_every=4, overlap=4), "overlap"), (dict(sync_every=4, overlap=-1), "overlap"),
        (dict(sync_every=4, compressor="nope"), "nope"), (dict(sync_every=4, compressor=3), "compressor"),
        (dict(sync_every=4, ratio=0.1), "without a compressor"),
        (dict(sync_every=4, compressor="topk", ratio=2.0), "ratio"),
    ]
    for kw, word in cases:
        with pytest.raises(ValueError, match=word):
            DiLoCo(model, opt, **kw)
    with pytest.raises(ValueError, match="model"):
        DiLoCo(torch.zeros(3), opt, sync_every=2)
    with pytest.raises(ValueError, match="inner_optimizer"):
        DiLoCo(model, "adam", sync_every=2)


def test_one_process_fragments_stats_and_state_checks():
    model, opt, dl = _train(0, 2 * H, fragments=2, compressor="fp16")
    st = dl.stats
    assert st.inner_steps == 2 * H and st.exchanges == 3 and st.bytes_sent == 0  # one rank sends nothing
    sizes = [g.numel() for g in dl.global_parameters()]
    assert sizes == [128, 16 + 64 + 4]  # REF_FRAGMENTS[2]
    state = dl.state_dict()
    assert len(state["in_flight"]) == 1  # fragment 1 sent at step 6, applied at 7
    other = DiLoCo(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), sync_every=H + 1, fragments=2,
                   compressor="fp16")
    with pytest.raises(ValueError, match="configuration"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="keys"):
        dl.load_state_dict({"global": []})


def dropped_worker(rank, world):
    import gc
    import threading
    import weakref

    model, opt, dl = _train(rank, 2 * H, fragments=2, overlap=1)
    workers = [t for t in threading.enumerate() if t.name == "commpress-diloco"]
    ref = weakref.ref(dl)
    del model, opt, dl
    gc.collect()
    for t in workers:
        t.join(timeout=10)
    return len(workers), ref() is None, [t.is_alive() for t in workers]


@pytest.mark.timeout(60)
def test_a_diloco_dropped_without_close_is_freed_and_stops_its_worker():
    for workers, freed, alive in run(dropped_worker, 2, timeout=50):
        assert workers == 1 and freed and alive == [False]


def test_stats_count_what_diloco_keeps():
    # one process (world size 1): the global copy, outer momentum and pseudo-gradient buffer per
    # fragment, and the compressor's error feedback, counted from the tensors themselves
    from memory_walk import storages_bytes

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with DiLoCo(model, opt, sync_every=H, compressor="topk", ratio=0.25, overlap=False) as dl:
        for step in range(2 * H):
            opt.zero_grad()
            x, y = _batch(0, step)
            nn.functional.mse_loss(model(x), y).backward()
            dl.step()
        stats = dl.stats
        n = sum(p.numel() for p in model.parameters())
        assert stats.memory["global"] == stats.memory["outer_momentum"] == stats.memory["delta"] == 4 * n
        assert stats.memory_overhead_bytes == sum(stats.memory.values())
        exclude = [*model.parameters(), *(p.grad for p in model.parameters())]
        assert stats.memory_overhead_bytes - stats.memory["collectives"] == storages_bytes(dl, exclude=exclude)
