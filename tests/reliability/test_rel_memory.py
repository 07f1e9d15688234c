"""Memory: 1000 compressed DDP steps of a small model do not grow the process.

World size 2, ``topk`` + error feedback, one DDP bucket.  After a warm-up, the resident set size
(``/proc/self/statm``) may grow by at most :data:`RSS_BOUND` over the remaining
steps, the error-feedback residual buffers keep their storage (allocated once,
updated in place) and ``stats.memory_overhead_bytes`` reports at least the
residual bytes and stays constant.
"""

from __future__ import annotations

import pytest
import torch

import commpress
from commpress.storage import LeanTensor
from distributed import run
from faults import rss_bytes, torch_kernels
from relmodels import make_ddp, step

pytestmark = pytest.mark.reliability

STEPS, WARMUP = 1000, 100
#: allowed RSS growth after warm-up; one leaked gradient-sized tensor per step would be ~16 MB
RSS_BOUND = 8 * 2**20


def _residual_ptrs(state):
    """Per residual: where its storage starts and its bytes (a lean one: its codes and scales)."""
    res = getattr(state.codec, "_residuals", {})
    return {repr(k): (v.codes.data_ptr(), v.nbytes) if isinstance(v, LeanTensor)
            else (v.untyped_storage().data_ptr(), v.numel() * v.element_size()) for k, v in res.items()}


def _memory(rank, world, name, params):
    torch_kernels()
    model = make_ddp(bucket_cap_mb=25)   # one bucket: one compressed call per step
    state = commpress.ddp.register(model, name, warmup_steps=1, min_numel=256, **params)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    marks = {}
    for i in range(STEPS):
        step(model, rank, i % 50)
        opt.step()
        if i + 1 == WARMUP:
            marks["rss0"] = rss_bytes()
            marks["ptrs0"] = _residual_ptrs(state)
            marks["mem0"] = state.stats.memory_overhead_bytes
            marks["n_alg0"] = len(state.stats.algorithms)
    residual_bytes = sum(n for _, n in _residual_ptrs(state).values())
    return {"growth": rss_bytes() - marks["rss0"], "rss": rss_bytes(),
            "same_buffers": marks["ptrs0"] == _residual_ptrs(state) and len(marks["ptrs0"]) > 0,
            "mem0": marks["mem0"], "mem": state.stats.memory_overhead_bytes,
            "residual_bytes": residual_bytes,
            "algorithms_stable": marks["n_alg0"] == len(state.stats.algorithms),
            "steps": state.stats.steps}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,params", [
    ("topk", {"ratio": 0.05}),
])
def test_thousand_steps_do_not_grow_memory(name, params):
    for rank, out in enumerate(run(_memory, 2, name, params, timeout=200, pg_timeout=60)):
        assert out["steps"] == STEPS, out
        assert out["growth"] < RSS_BOUND, (rank, out)
        assert out["same_buffers"], (rank, out)
        assert out["mem"] == out["mem0"] and out["mem"] >= out["residual_bytes"] > 0, (rank, out)
        assert out["algorithms_stable"], (rank, out)
        print(f"memory figures: rank {rank}: RSS {out['rss'] / 2**20:.1f} MiB, growth over steps "
              f"{WARMUP}-{STEPS}: {out['growth'] / 2**10:.0f} KiB (bound {RSS_BOUND / 2**20:.0f} MiB), "
              f"stats.memory_overhead_bytes={out['mem']} (residuals {out['residual_bytes']} B)")
