"""Backend selection in commpress.ops: forced backends, COMMPRESS_BACKEND, fallbacks."""

from __future__ import annotations

import importlib

import pytest
import torch

import commpress.ops as ops
from commpress.ops import reference as R

from opcheck import assert_bitwise  # noqa: E402

CPU = torch.device("cpu")


def test_every_reference_op_dispatches():
    for name in R.__all__:
        assert callable(getattr(ops, name))
        assert ops.resolve(name, CPU, "torch") is getattr(R, name)


def test_numba_is_default_on_cpu():
    nb = pytest.importorskip("commpress.ops.numba_backend")
    assert "numba" in ops.available_backends()
    for name in nb.OPS:
        assert ops.resolve(name, CPU) is nb.OPS[name]
    # ops the numba backend does not implement fall back to the reference
    assert ops.resolve("qmax_for", CPU) is R.qmax_for


def test_forced_backend_argument():
    pytest.importorskip("commpress.ops.numba_backend")
    x = torch.randn(1000)
    for backend in ("torch", "numba"):
        got = ops.topk_compact(x, 17, backend=backend)
        assert_bitwise(got, R.topk_compact(x, 17), backend)
    assert ops.resolve("block_quantize", CPU, "numba") is not R.block_quantize


def test_env_var_forces_backend(monkeypatch):
    pytest.importorskip("commpress.ops.numba_backend")
    monkeypatch.setenv("COMMPRESS_BACKEND", "torch")
    assert ops.resolve("topk_compact", CPU) is R.topk_compact
    monkeypatch.setenv("COMMPRESS_BACKEND", "numba")
    assert ops.resolve("topk_compact", CPU) is not R.topk_compact
    # an explicit argument wins over the environment
    assert ops.resolve("topk_compact", CPU, "torch") is R.topk_compact


def test_unknown_backend_is_a_value_error(monkeypatch):
    with pytest.raises(ValueError, match="backend"):
        ops.topk_compact(torch.ones(3), 1, backend="fortran")
    monkeypatch.setenv("COMMPRESS_BACKEND", "fortran")
    with pytest.raises(ValueError, match="backend"):
        ops.resolve("topk_compact", CPU)
    with pytest.raises(ValueError, match="backend"):
        ops.register_backend("fortran", {})


def test_missing_op_of_a_backend(monkeypatch):
    monkeypatch.setitem(ops._IMPLS, "numba", {"pack_bits": R.pack_bits})
    # chosen automatically: the reference stands in
    assert ops.resolve("topk_compact", CPU) is R.topk_compact
    # forced: a clear error
    with pytest.raises(NotImplementedError, match="numba"):
        ops.resolve("topk_compact", CPU, "numba")


def test_device_argument_steers_tensorless_ops(monkeypatch):
    seen = []

    def fake(seed, start, n, device="cpu"):
        seen.append(torch.device(device))
        return R.counter_uniform(seed, start, n)

    monkeypatch.setitem(ops._IMPLS, "cuda", {"counter_uniform": fake})
    ops.counter_uniform(1, 0, 3, device="cuda")
    ops.counter_uniform(1, 0, 3, torch.device("cuda"))
    assert seen == [torch.device("cuda")] * 2
    ops.counter_uniform(1, 0, 3)  # cpu: not the cuda backend
    assert len(seen) == 2


def test_cuda_backend_imports_without_cupy():
    cb = importlib.import_module("commpress.ops.cuda_backend")
    assert "commpress_ops.cu" in cb.SOURCES
    assert "__global__" in cb.read_source("commpress_ops.cu")
    if not cb.available():
        assert "cuda" not in ops.available_backends()
