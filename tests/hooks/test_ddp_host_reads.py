"""A steady-state DDP step reads no tensor on the host (DESIGN.md, "The hot path's budget").

On a GPU every ``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, ``float(t)`` or
``.cpu()`` is a device synchronization that stalls the backward pass.  CI has only
CPUs, so this test records every such call made from commpress's own code while
one steady-state step runs (forward, backward, optimizer step) and asserts there
is none.  (The numba backend's zero-copy ``.numpy()`` views of CPU tensors and
the status check of a CPU message, which reads host memory, are not device
synchronizations; on CUDA the status is copied behind an event instead.)
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import run
from nets import MLP3 as Net

import commpress

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu")
PACKAGE = os.path.dirname(commpress.__file__)




class HostReads:
    """Record the READS methods called from a frame inside the commpress package."""

    def __init__(self):
        self.calls: list[str] = []
        self._saved = {}

    def __enter__(self):
        for name in READS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def spy(t, *a, __name=name, __original=original, **k):
                stack = traceback.extract_stack(limit=12)[:-1]
                inside = [f for f in stack if f.filename.startswith(PACKAGE)]
                if inside:
                    f = inside[-1]
                    self.calls.append(f"{__name} at {os.path.relpath(f.filename, PACKAGE)}:{f.lineno}")
                return __original(t, *a, **k)

            setattr(torch.Tensor, name, spy)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)


def _step(model, opt, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 8, (16,), generator=g)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def host_read_worker(rank, world, cases, overlap):
    out = {}
    for name, params in cases:
        torch.manual_seed(0)
        model = DDP(Net(), bucket_cap_mb=0.01)
        state = commpress.ddp.register(model, name, overlap=overlap, min_numel=256, **params)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(3):  # warm-up, DDP's bucket rebuild, first compressed step
            _step(model, opt, rank, step)
        with HostReads() as reads:
            _step(model, opt, rank, 3)
        algorithms = set(state.stats.last_step["units"][u]["algorithm"] for u in state.stats.last_step["units"])
        state.close()
        out[name] = (reads.calls, sorted(algorithms))
    return out


# the sparsifiers without their density warm-up: this is the steady state (after it)
CASES = [("fp16", {}), ("bf16", {}), ("topk", {"ratio": 0.05, "density_warmup": 0}),
         ("dgc", {"ratio": 0.05, "density_warmup": 0}),
         ("blockquant", {"bits": 8}), ("qsgd", {}), ("terngrad", {}), ("signsgd", {}),
         ("powersgd", {"rank": 2}),
         # a codec per unit (dense under error feedback on loopback), timed and normed on the device; step 3
         # is the step before a check point (checks at 0, 4, 8: check_every=4), which runs the units' own
         # path, not DDP's
         ("auto", {"check_every": 4})]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "inline"])
def test_steady_state_step_reads_nothing_on_the_host(overlap):
    res = run(host_read_worker, 2, CASES, overlap, timeout=190)
    for rank_out in res:
        for name, (calls, algorithms) in rank_out.items():
            assert set(algorithms) - {"dense", "waiting"}, (name, algorithms)  # really compressed
            assert calls == [], (name, calls)


def test_the_spy_sees_a_read():
    """The recorder itself works: a read from commpress code is caught."""
    from commpress.compressors import _util

    with HostReads() as reads:
        _util.seed_from_generator(torch.Generator().manual_seed(1))
    assert reads.calls and reads.calls[0].startswith("item")


def _sync_free_worker(rank, world, cases):
    """One steady-state step on CUDA under ``torch.cuda.set_sync_debug_mode("error")``."""
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    out = {}
    for name, params in cases:
        torch.manual_seed(0)
        model = DDP(Net().cuda(), device_ids=[rank], bucket_cap_mb=0.01)
        state = commpress.ddp.register(model, name, min_numel=256, **params)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator(device="cuda").manual_seed(rank)
        x = torch.randn(16, 32, device="cuda", generator=g)
        y = torch.randint(0, 8, (16,), device="cuda", generator=g)

        def step():
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            out[name] = "ok"
        except RuntimeError as exc:
            out[name] = str(exc)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        state.close()
        dist.barrier()
    return out


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_gpu_steady_state_step_never_synchronizes():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    world = min(2, torch.cuda.device_count())
    res = run(_sync_free_worker, world, CASES, timeout=280, backend="nccl")
    for rank_out in res:
        assert all(v == "ok" for v in rank_out.values()), rank_out
