"""The lean residual store's numba kernels (and bf16's under error feedback) come from numba's disk
cache in a fresh process.

Defined inside a function (a closure) they were compiled again by every process, about 0.8 s on
its first compressed step with the default ``residual_storage="int8"``, and each compile added a
cache entry that no later process read."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("numba")

_SCRIPT = """
import torch
from commpress.storage import LeanTensor
from commpress.ops import _numba_kernels as K
x = torch.randn(1000)
store = LeanTensor("int8", x.numel(), x.device)
store.encode(x, 1)
store.add_to(x.clone())
LeanTensor("bf16", x.numel(), x.device).encode(x, 1)
store = LeanTensor("int4", x.numel(), x.device)
store.encode(x, 1)
store.add_to(x.clone())
store.decode()
LeanTensor("int8", x.numel(), x.device).decode()
from commpress import ops
ops.cast_feedback(x, None, 1.0, torch.empty(1000), torch.bfloat16)
kernels = (K.lean_int8_encode, K.lean_int8_add, K.lean_bf16_encode, K.lean_int4_encode, K.lean_int4_add,
           K.lean_noise_words, K.lean_int8_decode, K.lean_int4_decode, K.half_feedback)
print(sum(sum(k.stats.cache_hits.values()) for k in kernels), sum(sum(k.stats.cache_misses.values()) for k in kernels))
"""


def _hits_misses() -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300, check=True)
    hits, misses = out.stdout.split()[-2:]
    return int(hits), int(misses)


@pytest.mark.timeout(600)
def test_the_lean_kernels_come_from_the_disk_cache():
    _hits_misses()                       # compiles and caches them if no process did yet
    hits, misses = _hits_misses()
    assert (hits, misses) == (9, 0)
