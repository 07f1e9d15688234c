"""commpress.fsdp on FSDP2 (gloo, CPU, ``init_device_mesh("cpu", (P,))``).

Workers are module-level functions run by ``distributed.run`` on P gloo ranks.
Models are tiny MLPs with each Linear as its own FSDP unit plus the root.
"""

from __future__ import annotations

import io
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import commpress
from distributed import run
from nets import fsdp_shard as shard

# ----------------------------------------------------------------------------- helpers
SIZES = (64, 33, 10)   # 33: shards need padding for P = 2 and 3


def make_model(seed: int = 0, sizes=SIZES) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def batch(rank: int, step: int, n: int = 8, d: int = SIZES[0], classes: int = SIZES[-1]):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, d, generator=g) * 3, torch.randint(0, classes, (n,), generator=g)


def full_grads(model) -> list[torch.Tensor]:
    return [p.grad.full_tensor().clone() for p in model.parameters()]


def local_params(model) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]


def train_steps(model, steps: int, rank: int, lr: float = 0.1, start: int = 0):
    """SGD (stateless) on random batches; returns the full gradients of every step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads = []
    for s in range(start, start + steps):
        x, y = batch(rank, s)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads.append(full_grads(model))
        opt.step()
    return grads


# ------------------------------------------------------------------ identity == default
def _identity_matches_default(rank, world_size):
    ref = shard(make_model(), world_size)
    cmp = shard(make_model(), world_size)
    state = commpress.fsdp.register(cmp, "identity")
    g_ref = train_steps(ref, 3, rank)
    g_cmp = train_steps(cmp, 3, rank)
    same_grads = all(torch.equal(a, b) for ga, gb in zip(g_ref, g_cmp) for a, b in zip(ga, gb))
    same_params = all(torch.equal(a, b) for a, b in zip(local_params(ref), local_params(cmp)))
    return same_grads, same_params, state.stats.steps, sorted(state._units)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2])
def test_identity_bitwise_equals_default_fsdp2(world_size):
    # Bitwise: the "sum" path hands the same buffer and op (AVG) to the same
    # reduce_scatter call FSDP2 makes, so nothing may differ.  (World size 3 and
    # fp16/bf16 reduce dtypes: test_lossless_paths_match_default_with_mixed_precision.)
    for same_grads, same_params, steps, units in run(_identity_matches_default, world_size):
        assert same_grads and same_params
        assert steps == 3
        assert units == ["0", "2"]   # both Linear units; the parameterless root is skipped


# ------------------------------------- mixed precision and the lossless owner path
def shard_mp(model, world_size, reduce_dtype):
    os.environ["COMMPRESS_BACKEND"] = "torch"
    mp = MixedPrecisionPolicy(param_dtype=reduce_dtype, reduce_dtype=reduce_dtype)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def _lossless_paths(rank, world_size):
    out = {}
    for reduce_dtype in (None, torch.float16, torch.bfloat16):
        grads = {}
        for name, params in ((None, {}), ("identity", {}), ("topk", {"ratio": 1.0})):
            model = shard_mp(make_model(), world_size, reduce_dtype)
            if name is not None:
                commpress.fsdp.register(model, name, error_feedback=False, **params)
            x, y = batch(rank, 0)
            torch.nn.functional.cross_entropy(model(x).float(), y).backward()
            grads[name] = full_grads(model)
        ref = grads[None]
        out[str(reduce_dtype)] = {
            "identity_equal": all(torch.equal(a, b) for a, b in zip(ref, grads["identity"])),
            "topk_rel": max(((a.float() - b.float()).abs().max() / a.float().abs().max()).item()
                            for a, b in zip(ref, grads["topk"])),
        }
    return out


@pytest.mark.timeout(90)
def test_lossless_paths_match_default_with_mixed_precision():
    # reduce dtype fp32 (FSDP passes ReduceOp.AVG), fp16 (FSDP pre/post-divides and
    # passes SUM) and bf16 (AVG).  identity goes through the "sum" path: bitwise equal.
    # topk with ratio 1 sends every entry through the sparse owner path, which sums in
    # fp32 in rank order: equal up to rounding of the reduce dtype (2 ulps of its eps,
    # relative to the largest entry; 1e-6 for fp32).
    tol = {"None": 1e-6, "torch.float16": 2 * 2.0 ** -10, "torch.bfloat16": 2 * 2.0 ** -7}
    for per_rank in run(_lossless_paths, 3):
        for dtype, res in per_rank.items():
            assert res["identity_equal"], dtype
            assert res["topk_rel"] <= tol[dtype], (dtype, res)


# ---------------------------------------------------------------- digits training
def _digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


def _train_digits(rank, world_size, configs, steps, batch_size, lr=0.2, momentum=0.9):
    (xtr, ytr), (xte, yte) = _digits()
    out = {}
    for label, name, params in configs:
        model = shard(make_model(seed=1, sizes=(64, 64, 10)), world_size)
        state = None
        if name is not None:
            state = commpress.fsdp.register(model, name, **params)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        g = torch.Generator().manual_seed(7)
        for _ in range(steps):
            idx = torch.randint(0, len(ytr), (batch_size * world_size,), generator=g)
            idx = idx[rank * batch_size:(rank + 1) * batch_size]
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
            opt.step()
        with torch.no_grad():
            acc = (model(xte).argmax(1) == yte).float().mean().item()
        ratio = state.stats.compression_ratio if state is not None else 1.0
        out[label] = (acc, ratio)
    return out


@pytest.mark.timeout(150)
def test_compressed_reduce_scatter_trains_digits_like_default():
    # 2 ranks x 32 samples, 150 steps of plain SGD (lr 0.5), 397 held-out digits (one
    # sample = 0.25 points).  Runs are deterministic (fixed seeds, CPU), so the bounds are
    # margins, not probabilities: blockquant 8-bit within 0.5 point of dense FSDP2,
    # topk 1% + error feedback (auto) within 1.5 points.  (Measured when written:
    # dense 95.97%, blockquant8 95.97%, topk1%+EF 95.47%.)  With momentum 0.9 and lr 0.2
    # topk 5% + EF fell to 64% in the same steps (EF's delayed bursts compound with
    # heavy momentum); that regime is not claimed.
    configs = [("dense", None, {}),
               ("blockquant8", "blockquant", {"bits": 8}),
               ("topk1%+ef", "topk", {"ratio": 0.01, "density_warmup": 0})]   # the steady state's bytes
    results = run(_train_digits, 2, configs, 150, 32, 0.5, 0.0, timeout=140)
    assert results[0] == results[1]          # every rank evaluates the same replicated model
    res = results[0]
    dense = res["dense"][0]
    assert dense > 0.9
    assert res["blockquant8"][0] >= dense - 0.005
    assert res["topk1%+ef"][0] >= dense - 0.015
    assert res["blockquant8"][1] > 3.5       # 8-bit codes + an fp32 scale per 256 fp32 entries
    assert res["topk1%+ef"][1] > 25.0        # 8 bytes per kept entry of 1% (+ headers)


# ------------------------------------------------------------------ stats
def _stats_bytes(rank, world_size, configs):
    out = []
    for name, params in configs:
        model = shard(make_model(), world_size)
        state = commpress.fsdp.register(model, name, **params)
        train_steps(model, 2, rank)
        out.append(state.stats.as_dict())
    return out


def _padded(n: int, p: int) -> int:
    return math.ceil(n / p) * p


def _align8(n: int) -> int:
    return -(-n // 8) * 8


def _expected_rs_bytes(world_size, per_chunk_message):
    """Steady-state reduce-scatter bytes per step of the two units, by the module docstring's wire:
    ``per_chunk_message(m)`` bytes to each of the P-1 other owners."""
    total = dense = 0
    for fan_in, fan_out in zip(SIZES[:-1], SIZES[1:]):
        rows = _padded(fan_out, world_size) // world_size       # dim-0 shard rows
        m = rows * fan_in + rows                                # weight + bias shard
        total += per_chunk_message(m) * (world_size - 1)
        dense += 4 * m * (world_size - 1)
    return total, dense


def _validation_bytes(world_size):
    """The first call of each of the two units: one all_gather of the validation header
    (HEADER_FIXED + 4P + SKETCH int64 per rank)."""
    from commpress.collectives.wire import HEADER_FIXED, SKETCH

    return 2 * (HEADER_FIXED + 4 * world_size + SKETCH) * 8 * (world_size - 1)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [3])
def test_stats_bytes_match_payloads(world_size):
    # owner path (one all_to_all): the 8-byte status word, then each wire tensor 8-aligned;
    # "sum" path (one reduce_scatter): the payload, then two status slots of its dtype.
    cases = (("blockquant", {"bits": 8},   # uint8 codes + one fp32 scale per 256 entries
              lambda m: 8 + _align8(m) + _align8(4 * math.ceil(m / 256)), True),
             ("topk", {"ratio": 0.05, "density_warmup": 0},     # k int32 indices + k fp32 values
              lambda m: 8 + 2 * _align8(4 * max(1, round(0.05 * m))), True),
             # 25%: the selection would be larger than the chunk in 4 bits, which goes instead
             ("topk", {"ratio": 0.25, "density_warmup": 0},
              lambda m: 8 + _align8(math.ceil(m / 2)) + _align8(4 * math.ceil(m / 256)), True),
             ("fp16", {}, lambda m: 2 * (m + 2), True))
    per_rank = run(_stats_bytes, world_size, [(name, params) for name, params, _, _ in cases])
    for i, (name, params, per_chunk, validated) in enumerate(cases):
        sent, dense = _expected_rs_bytes(world_size, per_chunk)
        first = _validation_bytes(world_size) if validated else 0
        for st in (r[i] for r in per_rank):
            assert st["steps"] == 2
            assert st["last_step"]["bytes_sent"] == sent, name
            assert st["bytes_sent"] == 2 * sent + first, name
            assert st["dense_bytes"] == 2 * dense
            assert st["compression_ratio"] == pytest.approx(2 * dense / (2 * sent + first))
            # the step account sees the reduce-scatters: one round per unit, time inside them, codec passes
            acc = st["account"]
            assert acc["rounds"] == 2 and acc["comm"] > 0, (name, acc)
            assert 0.0 < acc["hook_cpu"] <= acc["cpu"] + 1e-3, (name, acc)   # host CPU: the hook's within the process's
            assert (acc["codec"].get("compress", 0.0) > 0) == (name != "fp16"), (name, acc["codec"])


# ------------------------------------------------------------------ checkpoint / resume
def _resume(rank, world_size, options=None):
    options = options or {}
    # uninterrupted: 4 steps
    a = shard(make_model(), world_size)
    commpress.fsdp.register(a, "topk", ratio=0.1, **options)
    train_steps(a, 4, rank)
    # interrupted: 2 steps, save (weights_only round trip), new model + state, 2 more steps
    b = shard(make_model(), world_size)
    sb = commpress.fsdp.register(b, "topk", ratio=0.1, **options)
    train_steps(b, 2, rank)
    buf = io.BytesIO()
    torch.save({"hook": sb.state_dict(), "params": local_params(b)}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    c = shard(make_model(seed=5), world_size)
    with torch.no_grad():
        for p, saved in zip(c.parameters(), ckpt["params"]):
            p.to_local().copy_(saved)
    sc = commpress.fsdp.register(c, "topk", ratio=0.1, **options)
    sc.load_state_dict(ckpt["hook"])
    residual_keys = sorted(map(str, sc.codec._residuals))
    train_steps(c, 2, rank, start=2)
    same = all(torch.equal(x, y) for x, y in zip(local_params(a), local_params(c)))
    return same, sc.step, residual_keys, sc.stats.as_dict()["memory"]["by_kind"]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("options", [{}, {"residual_storage": "int8", "rollback": "unit"},
                                     {"residual_storage": "int4"}])
def test_state_dict_round_trip_resumes_bitwise(options):
    for same, step, keys, memory in run(_resume, 2, options):
        assert same
        assert step == 4
        assert len(keys) == 4       # two units x two chunks
        # rollback="unit": no pending copy between steps
        assert (memory["pending"] == 0) == (options.get("rollback") == "unit") and memory["residuals"] > 0


# ------------------------------------------------------------------ non-finite
def _nonfinite(rank, world_size):
    ref = shard(make_model(), world_size)
    cmp = shard(make_model(), world_size)
    state = commpress.fsdp.register(cmp, "topk", ratio=0.1)
    train_steps(cmp, 1, rank)                                   # residuals exist
    before = {k: state.codec.residual(k).clone() for k in state.codec._residuals}   # fp32 (decoded)
    for model in (ref, cmp):
        x, y = batch(rank, 5)
        if rank == 1:
            x[0, 0] = float("inf")
        torch.nn.functional.cross_entropy(model(x), y).backward()
    ref_bad = {n: ~torch.isfinite(p.grad.full_tensor()) for n, p in ref.named_parameters()}
    cmp_bad = {n: ~torch.isfinite(p.grad.full_tensor()) for n, p in cmp.named_parameters()}
    # every entry default FSDP2 makes non-finite is non-finite here too (a unit whose input
    # held a NaN/inf on any rank is all-NaN: weight and bias); units FSDP2 left finite stay finite
    covered = all(bool((ref_bad[n] & ~cmp_bad[n]).sum() == 0) for n in ref_bad)
    units = {n.split(".")[0] for n in ref_bad}
    finite_alike = all(any(bool(b.any()) for n, b in ref_bad.items() if n.startswith(u + "."))
                       == any(bool(b.any()) for n, b in cmp_bad.items() if n.startswith(u + "."))
                       for u in units)
    any_bad = any(bool(b.any()) for b in cmp_bad.values())
    # the step's residual updates are one transaction: every residual of every rank
    # (both units, both chunks) is exactly as before
    untouched = sorted(before) == sorted(state.codec._residuals) and all(
        torch.equal(before[k], state.codec.residual(k)) for k in before)
    return covered, finite_alike, any_bad, untouched, len(before)


@pytest.mark.timeout(90)
def test_nonfinite_gradients_propagate_and_spare_residuals():
    for covered, finite_alike, any_bad, untouched, n_residuals in run(_nonfinite, 2):
        assert any_bad and covered and finite_alike
        assert untouched and n_residuals == 4


# ------------------------------------------------------------------ quantized all-gather
def _quantized_all_gather(rank, world_size):
    ref = shard(make_model(), world_size)
    cmp = shard(make_model(), world_size)
    state = commpress.fsdp.register(cmp, "identity", all_gather="blockquant")
    x, y = batch(rank, 0)
    with torch.no_grad():
        out_ref, out_cmp = ref(x), cmp(x)
    # every rank decodes the same codes: losses of the same input agree across ranks
    probe = torch.ones(1, SIZES[0])
    with torch.no_grad():
        val = cmp(probe).sum().reshape(1)
    vals = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(vals, val)
    err = (out_ref - out_cmp).abs().max().item()
    train_steps(cmp, 3, rank)
    st = state.stats.as_dict()
    return err, out_ref.abs().max().item(), len({v.item() for v in vals}), st["algorithms"]


@pytest.mark.timeout(90)
def test_quantized_all_gather_close_and_replicated():
    for err, scale, distinct, algorithms in run(_quantized_all_gather, 3):
        assert err <= 0.05 * scale
        assert err > 0                                          # parameters really were quantized
        assert distinct == 1
        assert algorithms["0/all_gather"] == "blockquant:all_gather"


# ------------------------------------------------------------------ no host reads
_HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu")


def _commpress_frame() -> str | None:
    """The innermost stack frame inside the commpress package (not its tests), or None."""
    import traceback

    pkg = os.path.dirname(os.path.abspath(commpress.__file__)) + os.sep
    for f in reversed(traceback.extract_stack()[:-2]):
        if os.path.abspath(f.filename).startswith(pkg):
            return f"{os.path.relpath(f.filename, os.path.dirname(pkg.rstrip(os.sep)))}:{f.lineno} {f.name}"
    return None


def _steady_state_host_reads(rank, world_size, configs):
    out = {}
    for label, params in configs:
        name = label.split("/")[0]
        model = shard(make_model(), world_size)
        state = commpress.fsdp.register(model, name, **params)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def one_step(i):
            x, y = batch(rank, i)
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()   # no loss.item() here
            opt.step()

        for i in range(2):                       # warm-up: the first call of each unit validates
            one_step(i)
        reads: list[tuple[str, str]] = []
        originals = {attr: getattr(torch.Tensor, attr) for attr in _HOST_READS}

        def spy(attr, fn):
            def wrapper(self, *args, **kwargs):
                where = _commpress_frame()
                if where is not None:
                    reads.append((attr, where))
                return fn(self, *args, **kwargs)
            return wrapper

        try:
            for attr, fn in originals.items():
                setattr(torch.Tensor, attr, spy(attr, fn))
            one_step(2)
        finally:
            for attr, fn in originals.items():
                setattr(torch.Tensor, attr, fn)
        out[label] = {"reads": reads, "steps": state.stats.steps, "ef": state.uses_error_feedback,
                      "residuals": state.stats.as_dict()["memory"]["by_kind"].get("residuals", 0),
                     "algorithms": dict(state.stats.algorithms)}
    return out


@pytest.mark.timeout(90)
def test_steady_state_step_reads_no_tensor_on_the_host():
    # One forward/backward/optimizer step after warm-up, with Tensor.item / tolist / __bool__ /
    # __int__ / __float__ / cpu recording every call made from a commpress frame: none may
    # happen (on a GPU each would be a device synchronization stalling the backward pass).
    # blockquant: FSDP2's default, stochastic rounding without a residual; blockquant/ef: with one
    configs = [("blockquant", {"bits": 8}), ("blockquant/ef", {"bits": 8, "stochastic": False}),
               ("topk", {"ratio": 0.1}),
               ("identity", {"all_gather": "blockquant"}), ("fp16", {}),
               # "auto" between check points (at the ends of steps 1 and 4); with momentum correction
               # every unit runs its codec under error feedback, dense included
               ("auto", {"check_every": 3, "momentum": 0.9})]
    for per_rank in run(_steady_state_host_reads, 2, configs):
        for name, params in configs:
            res = per_rank[name]
            assert res["reads"] == [], (name, res["reads"])
            assert res["steps"] == 3, (name, res)
        assert per_rank["blockquant/ef"]["ef"] and per_rank["topk"]["ef"] and not per_rank["blockquant"]["ef"]
        # the default keeps no residual on any rank; with error feedback, one of the whole unit
        assert per_rank["blockquant"]["residuals"] == 0 < per_rank["blockquant/ef"]["residuals"]
        assert per_rank["blockquant"]["algorithms"]["0"] == "blockquant:gather_reduce_scatter"
        assert per_rank["topk"]["algorithms"]["0"] == "topk:sparse_reduce_scatter"
        assert per_rank["identity"]["algorithms"]["0/all_gather"] == "blockquant:all_gather"
        assert per_rank["fp16"]["algorithms"]["0"] == "fp16:reduce_scatter"
        assert per_rank["auto"]["ef"] and per_rank["auto"]["algorithms"]["0"].endswith("_reduce_scatter")


# ------------------------------------------------------------------ bad input
def _bad_input(rank, world_size, case):
    if case == "not_fsdp":
        model = make_model()
        try:
            commpress.fsdp.register(model, "topk", ratio=0.1)
        except TypeError as exc:
            return "TypeError", str(exc)
        return "none", ""
    model = shard(make_model(), world_size)
    if case == "differs":
        ratio = 0.1 if rank == 0 else 0.2
        try:
            commpress.fsdp.register(model, "topk", ratio=ratio)
        except ValueError as exc:
            return "ValueError", str(exc)
        return "none", ""
    if case == "twice":
        commpress.fsdp.register(model, "identity")
        try:
            commpress.fsdp.register(model[0], "identity")
        except RuntimeError as exc:
            return "RuntimeError", str(exc)
        return "none", ""
    if case == "lowrank":
        try:
            commpress.fsdp.register(model, "powersgd")
        except ValueError as exc:
            return "ValueError", str(exc)
        return "none", ""
    raise AssertionError(case)


BAD_CASES = [("not_fsdp", "TypeError", "FSDP2"),
             ("differs", "ValueError", "ratio"),
             ("twice", "RuntimeError", "already registered"),
             ("lowrank", "ValueError", "lowrank")]


def _all_bad_inputs(rank, world_size):
    return [_bad_input(rank, world_size, case) for case, _, _ in BAD_CASES]


@pytest.mark.timeout(60)
def test_bad_input_raises_on_every_rank():
    for per_rank in run(_all_bad_inputs, 3, timeout=45, pg_timeout=20):
        for (kind, msg), (case, exc, words) in zip(per_rank, BAD_CASES):
            assert kind == exc and words in msg, (case, kind, msg)


# ------------------------------------------------------------------ the Comm by hand
def _comm_by_hand(rank, world_size):
    model = shard(make_model(), world_size)
    state = commpress.fsdp.register(model, "blockquant", bits=8, error_feedback=False)
    comm = model[0]._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm
    m = 300
    g = torch.Generator().manual_seed(rank)
    inp = comm.allocate((world_size * m,), dtype=torch.float32, device=torch.device("cpu"))
    inp.copy_(torch.randn(world_size * m, generator=g))
    out = torch.empty(m)
    comm(out, inp, dist.group.WORLD, dist.ReduceOp.AVG)              # outside backward
    ref = torch.empty(m)
    dist.reduce_scatter_tensor(ref, inp.clone(), op=dist.ReduceOp.SUM)
    ref /= world_size
    absmax = torch.tensor([inp.abs().max().item()])
    dist.all_reduce(absmax, op=dist.ReduceOp.MAX)
    err = (out - ref).abs().max().item()
    steps_after_one = state.stats.steps
    comm(out, inp, dist.group.WORLD, dist.ReduceOp.SUM)              # same unit again: new step
    return err, absmax.item(), steps_after_one, state.stats.steps, state.stats.algorithms["0"]


@pytest.mark.timeout(60)
def test_comm_called_by_hand_averages_within_quantization_error():
    # 8-bit absmax blocks: each rank's entry is off by at most half a step (s/127/2,
    # s <= the largest |input|); the average of P such errors is within the same bound.
    for err, absmax, steps1, steps2, algorithm in run(_comm_by_hand, 3):
        assert err <= absmax / 127 / 2 * (1 + 1e-5)
        assert (steps1, steps2) == (0, 1)     # outside backward the step closes lazily
        assert algorithm == "blockquant:gather_reduce_scatter"


# ------------------------------------------- the "sum" path: status slots on the reduce_scatter
def _sum_path_status(rank, world_size):
    out = {}
    # fp16: a NaN/inf on rank 1 travels in the payload (no error), the next step is healthy again
    model = shard(make_model(), world_size)
    state = commpress.fsdp.register(model, "fp16")
    train_steps(model, 1, rank)
    x, y = batch(rank, 1)
    if rank == 1:
        x[0, 0] = float("inf")
    torch.nn.functional.cross_entropy(model(x), y).backward()
    out["fp16_nonfinite"] = any(bool((~torch.isfinite(g)).any()) for g in full_grads(model))
    model.zero_grad(set_to_none=True)
    grads = train_steps(model, 1, rank, start=2)[0]
    out["fp16_finite_after"] = all(bool(torch.isfinite(g).all()) for g in grads)
    out["fp16_algorithm"] = state.stats.algorithms["0"]
    # random-k ("sum", shared indices): rank 1's compress fails after a healthy (validated) step
    model = shard(make_model(), world_size)
    state = commpress.fsdp.register(model, "randomk", ratio=0.5, error_feedback=False)
    train_steps(model, 1, rank)
    out["randomk_algorithm"] = state.stats.algorithms["0"]
    if rank == 1:
        def failing(*args, **kwargs):
            raise RuntimeError("injected codec fault")
        state.compressor.compress_fixed = failing
    x, y = batch(rank, 1)
    try:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        out["raised"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["raised"] = (isinstance(exc, commpress.collectives.CollectiveInputError), str(exc))
    return out


@pytest.mark.timeout(60)
def test_sum_path_status_raises_on_every_rank():
    # fp16 / random-k without error feedback: one reduce_scatter whose pieces end with the
    # status slots.  A NaN/inf rides in the payload; a rank whose compress fails makes every
    # rank raise CollectiveInputError (never a hang, never a size mismatch).
    for r, res in enumerate(run(_sum_path_status, 2, timeout=45, pg_timeout=20)):
        assert res["fp16_nonfinite"] and res["fp16_finite_after"], (r, res)
        assert res["fp16_algorithm"] == "fp16:reduce_scatter"
        assert res["randomk_algorithm"] == "randomk:reduce_scatter"
        assert res["raised"] is not None, r
        is_input_error, msg = res["raised"]
        assert is_input_error and "rank(s) [1]" in msg, (r, msg)
        assert ("injected codec fault" in msg) == (r == 1), (r, msg)

