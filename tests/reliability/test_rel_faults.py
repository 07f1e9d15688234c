"""A rank that dies or raises mid-step: the others raise a clear error, never hang.

Three gloo ranks; rank 1 (the victim) is killed (``os._exit`` or SIGKILL of
itself), raises, or hangs at a chosen point *inside* a compressed collective —
between the phases of the two-phase quantized allreduce, inside the sparse
allreduce, inside the FSDP2 compressed reduce-scatter and inside the DDP comm
hook.  The survivors must raise a ``RuntimeError`` (gloo's ``DistBackendError``
is one) within the process group's timeout (a short-timeout ``new_group``); the
harness's own timeout turns a hang into a test failure.  An exception inside a
compressor is reported through the collectives' validation header, so every
rank raises the same ``CollectiveInputError`` at once and the group stays usable.
Every survivor reports how long it took to raise (``pytest -s`` prints it).
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import commpress
from commpress.collectives import CollectiveInputError
from distributed import RankError, run
from faults import EXIT_CODE, InjectedFault, inject, inject_comm, torch_kernels

pytestmark = pytest.mark.reliability

WORLD = 3
VICTIM = 1
#: timeout of the process group the fault happens in (a ``new_group``)
PG_TIMEOUT = 12.0
#: timeout of the default group, used only for set-up (slow starts on a loaded machine)
SETUP_PG_TIMEOUT = 90.0
# The harness kills ranks still running after this: a survivor that hangs fails the test.
RUN_TIMEOUT = 100.0
#: seconds a survivor may take beyond the process-group timeout (loaded CI machine)
SLACK = 15.0


def _short_group():
    """A new group with PG_TIMEOUT for the faulty step; kernels from the torch backend.

    The faults do not depend on the kernel backend; the pure-torch one needs no
    JIT warm-up, so no rank is late into a collective for that reason.
    """
    torch_kernels()
    dist.barrier()
    return dist.new_group(timeout=datetime.timedelta(seconds=PG_TIMEOUT))


def _outcome(fn):
    """Run ``fn()``; return what a survivor reports: raised?, exception type/MRO, message, seconds."""
    t0 = time.monotonic()
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        return {"raised": True, "type": type(exc).__name__,
                "mro": [c.__name__ for c in type(exc).__mro__], "message": str(exc)[:400],
                "seconds": time.monotonic() - t0}
    return {"raised": False, "seconds": time.monotonic() - t0}


# ---------------------------------------------------------------------- collectives
COLLECTIVE_FAULTS = {
    # id: (compressor, params, algorithm, module attribute to sabotage, nth call)
    "two_phase:before_all_to_all": ("blockquant", {"bits": 8}, "two_phase", "all_to_all_bytes", 1),
    "two_phase:before_phase2_all_gather": ("blockquant", {"bits": 4}, "two_phase", "all_gather", 2),
    "sparse_split:before_all_to_all": ("topk", {"ratio": 0.05}, "split", "all_to_all_bytes", 1),
    "sparse_recursive_doubling:mid_exchange": ("topk", {"ratio": 0.05}, "recursive_doubling", "exchange", 2),
}


def _die_in_collective(rank, world, case, how):
    name, params, algorithm, attr, nth = COLLECTIVE_FAULTS[case]
    pg = _short_group()
    codec = commpress.ErrorFeedback(commpress.get(name, **params))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(3000, generator=g)
    # one healthy call first: connections are up, the fault hits a running job
    commpress.collectives.allreduce(x, codec, group=pg, algorithm=algorithm, key="warm")
    if rank == VICTIM:
        inject_comm(attr, how, nth=nth)
    return _outcome(lambda: commpress.collectives.allreduce(x, codec, group=pg, algorithm=algorithm, key="b"))


def _check_died(res, how):
    """The victim died (``exit``/``sigkill``) or raised the injected fault (``raise``); every
    survivor raised a RuntimeError within the process-group timeout.  Returns their seconds."""
    victim = res[VICTIM]
    if how == "raise":
        assert isinstance(victim, dict) and victim["raised"] and "injected fault" in victim["message"], victim
    else:
        assert isinstance(victim, RankError) and victim.type == "ProcessDied", victim
        assert str(EXIT_CODE if how == "exit" else -9) in victim.message, victim
    seconds = []
    for r, out in enumerate(res):
        if r == VICTIM:
            continue
        assert isinstance(out, dict) and out["raised"], (r, out)
        assert "RuntimeError" in out["mro"], (r, out)      # DistBackendError is a RuntimeError
        assert out["seconds"] < PG_TIMEOUT + SLACK, (r, out)
        seconds.append(out["seconds"])
    print(f"fault figures: victim {victim.message if how != 'raise' else 'raised'}; survivors raised after "
          f"{', '.join(f'{x:.2f}' for x in seconds)} s (pg timeout {PG_TIMEOUT} s)")
    return seconds


@pytest.mark.timeout(RUN_TIMEOUT + 30)
@pytest.mark.parametrize("case,how", [
    ("two_phase:before_all_to_all", "sigkill"),
    ("two_phase:before_phase2_all_gather", "exit"),
    ("sparse_split:before_all_to_all", "exit"),
    ("sparse_recursive_doubling:mid_exchange", "sigkill"),
])
def test_rank_dies_inside_compressed_allreduce(case, how):
    res = run(_die_in_collective, WORLD, case, how, timeout=RUN_TIMEOUT, pg_timeout=SETUP_PG_TIMEOUT,
              return_exceptions=True)
    _check_died(res, how)


# (identity / fp16 / bf16 without error feedback never call compress: the cast is written
# straight into the message, so a "sum" compressor with a real compress stands in for them)
RAISE_CASES = [("blockquant", {"bits": 8}, "two_phase"), ("topk", {"ratio": 0.05}, "split"),
               ("randomk", {"ratio": 0.05}, "auto")]


def _hang_until_peers_raised(tmp, world):
    """A stand-in for a collective: block (alive, silent) until every survivor has touched
    ``raised-<rank>`` in ``tmp``, then exit with EXIT_CODE (EXIT_CODE + 1 after a long wait)."""
    others = [os.path.join(tmp, f"raised-{r}") for r in range(world) if r != VICTIM]

    def hang(*args, **kwargs):
        t0 = time.monotonic()
        while time.monotonic() - t0 < PG_TIMEOUT + SLACK + 10:
            if all(os.path.exists(p) for p in others):
                os._exit(EXIT_CODE)
            time.sleep(0.2)
        os._exit(EXIT_CODE + 1)
    return hang


def _stall_in_collective(rank, world, tmp):
    """The victim stays alive but stops taking part (a hung rank) until every survivor
    has raised (each touches a file), then exits: EXIT_CODE if they all raised while it
    was alive, EXIT_CODE + 1 if it gave up waiting."""
    pg = _short_group()
    codec = commpress.ErrorFeedback(commpress.get("blockquant", bits=8))
    x = torch.randn(3000, generator=torch.Generator().manual_seed(rank))
    commpress.collectives.allreduce(x, codec, group=pg, algorithm="two_phase", key="warm")
    if rank == VICTIM:
        inject_comm("all_to_all_bytes", _hang_until_peers_raised(tmp, world))
    out = _outcome(lambda: commpress.collectives.allreduce(x, codec, group=pg, algorithm="two_phase", key="b"))
    open(os.path.join(tmp, f"raised-{rank}"), "w").close()
    return out


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_hung_rank_makes_peers_raise_at_the_process_group_timeout(tmp_path):
    # No connection closes here: only the group's timeout can end the survivors' wait.
    res = run(_stall_in_collective, WORLD, str(tmp_path), timeout=RUN_TIMEOUT, pg_timeout=SETUP_PG_TIMEOUT,
              return_exceptions=True)
    seconds = _check_died(res, "exit")           # exit code 71: they raised while the victim hung
    for out in (o for r, o in enumerate(res) if r != VICTIM):
        assert "timed out" in out["message"].lower() or "timeout" in out["message"].lower(), out
    assert min(seconds) > 0


def _raise_in_compress(rank, world):
    pg = _short_group()
    outs = []
    for i, (name, params, algorithm) in enumerate(RAISE_CASES):
        codec = commpress.get(name, **params)
        x = torch.randn(2000, generator=torch.Generator().manual_seed(rank))
        commpress.collectives.allreduce(x, codec, group=pg, algorithm=algorithm, key="warm")
        if rank == VICTIM:
            inject(codec, "compress", "raise")
        out = _outcome(lambda: commpress.collectives.allreduce(x, codec, group=pg, algorithm=algorithm, key=i))
        # the group is still usable afterwards: nobody is stuck in a half-done collective
        y = commpress.collectives.allreduce(torch.ones(10), commpress.get("identity"), group=pg)
        out["after"] = y.tolist()
        outs.append(out)
    return outs


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_exception_in_compress_raises_on_every_rank():
    # A compressor that raises on one rank is reported through the validation
    # header: every rank raises CollectiveInputError together, at once, and the
    # group stays usable (blockquant two-phase, topk split, fp16 allreduce).
    res = run(_raise_in_compress, WORLD, timeout=RUN_TIMEOUT, pg_timeout=SETUP_PG_TIMEOUT)
    for r, outs in enumerate(res):
        assert len(outs) == len(RAISE_CASES)
        for case, out in zip(RAISE_CASES, outs):
            assert out["raised"] and "CollectiveInputError" in out["mro"], (r, case, out)
            assert f"rank(s) [{VICTIM}]" in out["message"], (r, case, out)
            assert out["after"] == [float(WORLD)] * 10, (r, case, out)
            if r == VICTIM:
                assert "InjectedFault" in out["message"], out
    assert issubclass(CollectiveInputError, ValueError) and issubclass(InjectedFault, RuntimeError)


# ------------------------------------------------------------------------------ DDP
class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _ddp_fault(rank, world, name, params, attr, action, tmp=None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    pg = _short_group()
    torch.manual_seed(0)
    model = DDP(_Net(), bucket_cap_mb=0.001, process_group=pg)
    commpress.ddp.register(model, name, warmup_steps=1, min_numel=256, **params)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):  # dense warm-up step + one compressed step
        model.zero_grad()
        model(torch.randn(4, 32, generator=g)).sum().backward()
    if rank == VICTIM:   # inside the hook: after the bucket's dense all_reduce, at the header exchange
        if action == "hang":
            inject_comm(attr, _hang_until_peers_raised(tmp, world))
        else:
            inject_comm(attr, action)
    model.zero_grad()
    out = _outcome(lambda: model(torch.randn(4, 32, generator=g)).sum().backward())
    if tmp is not None:
        open(os.path.join(tmp, f"raised-{rank}"), "w").close()
    return out


@pytest.mark.timeout(RUN_TIMEOUT + 30)
@pytest.mark.parametrize("name,params,how", [
    ("blockquant", {"bits": 8}, "sigkill"),
])
def test_rank_dies_inside_ddp_hook(name, params, how):
    res = run(_ddp_fault, WORLD, name, params, "all_gather", how, timeout=RUN_TIMEOUT,
              pg_timeout=SETUP_PG_TIMEOUT, return_exceptions=True)
    _check_died(res, how)


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_hung_rank_inside_ddp_hook_makes_peers_raise_at_the_group_timeout(tmp_path):
    # The hook's collectives run on a group of their own (overlap worker): it must
    # inherit the user's process-group timeout, not torch's 30-minute default.
    res = run(_ddp_fault, WORLD, "topk", {"ratio": 0.05, "density_warmup": 0}, "all_gather", "hang", str(tmp_path),
              timeout=RUN_TIMEOUT, pg_timeout=SETUP_PG_TIMEOUT, return_exceptions=True)
    _check_died(res, "exit")          # exit code 71: the peers raised while the victim hung


@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_exception_inside_ddp_hook_surfaces_and_peers_do_not_hang():
    # The victim's backward() raises (the hook's exception, wrapped by autograd);
    # its peers are left inside the bucket's collective and must raise too.
    res = run(_ddp_fault, WORLD, "topk", {"ratio": 0.05, "density_warmup": 0}, "all_gather", "raise",
              timeout=RUN_TIMEOUT, pg_timeout=SETUP_PG_TIMEOUT, return_exceptions=True)
    victim = res[VICTIM]
    assert isinstance(victim, dict) and victim["raised"], victim
    assert "injected fault" in victim["message"], victim
    for r, out in enumerate(res):
        if r != VICTIM:
            assert isinstance(out, dict) and out["raised"], (r, out)
            assert "RuntimeError" in out["mro"], (r, out)
            assert out["seconds"] < PG_TIMEOUT + SLACK, (r, out)
    print("fault figures: raise in hook; survivors raised after",
          [round(o["seconds"], 2) for r, o in enumerate(res) if r != VICTIM], "s")


# ----------------------------------------------------------------------------- FSDP2
def _fsdp_fault(rank, world, name, params, how):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    pg = _short_group()
    torch.manual_seed(0)
    model = _Net()
    mesh = DeviceMesh.from_group(pg, "cpu")
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    commpress.fsdp.register(model, name, **params)
    g = torch.Generator().manual_seed(rank)
    model(torch.randn(4, 32, generator=g)).sum().backward()   # one healthy step
    if rank == VICTIM:
        inject(dist, "all_to_all_single", how)   # the compressed reduce-scatter's one collective
    return _outcome(lambda: model(torch.randn(4, 32, generator=g)).sum().backward())


@pytest.mark.timeout(RUN_TIMEOUT + 30)
@pytest.mark.parametrize("name,params,how", [
    ("blockquant", {"bits": 8}, "exit"),
    ("topk", {"ratio": 0.05}, "sigkill"),
    ("blockquant", {"bits": 4}, "raise"),
])
def test_rank_dies_or_raises_inside_fsdp2_compressed_reduce_scatter(name, params, how):
    res = run(_fsdp_fault, WORLD, name, params, how, timeout=RUN_TIMEOUT, pg_timeout=SETUP_PG_TIMEOUT,
              return_exceptions=True)
    _check_died(res, how)
