"""Registering the CUDA backend: an NVRTC that cannot compile leaves CUDA tensors on the reference.

Runs without a GPU: CuPy and CUDA availability are faked.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

import commpress.ops as ops
from commpress.ops import cuda_backend
from commpress.ops import reference as R


def _fake_cupy(compile_error: Exception | None = None, version_error: Exception | None = None):
    calls = []

    def get_version():
        if version_error is not None:
            raise version_error
        return (12, 9)

    def create_program(src, name, headers, include_names):
        calls.append("create")
        return object()

    def compile_program(prog, options):
        calls.append("compile")
        if compile_error is not None:
            raise compile_error

    nvrtc = types.SimpleNamespace(getVersion=get_version, createProgram=create_program,
                                  compileProgram=compile_program,
                                  destroyProgram=lambda prog: calls.append("destroy"))
    return types.SimpleNamespace(cuda=types.SimpleNamespace(nvrtc=nvrtc)), calls


@pytest.fixture
def clean_registry(monkeypatch):
    impls = {k: dict(v) for k, v in ops._IMPLS.items() if k != "cuda"}
    monkeypatch.setattr(ops, "_IMPLS", impls)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return impls


@pytest.mark.parametrize("failure", [
    {"version_error": OSError("libnvrtc.so.12: cannot open shared object file")},
    {"compile_error": RuntimeError("NVRTC_ERROR_INVALID_OPTION: CUDA 13 NVRTC under a CUDA 12 CuPy")},
])
def test_unusable_nvrtc_falls_back_to_the_reference(clean_registry, monkeypatch, caplog, failure):
    fake, calls = _fake_cupy(**failure)
    monkeypatch.setattr(cuda_backend, "cp", fake)
    with caplog.at_level(logging.WARNING, logger="commpress"):
        assert cuda_backend.register() is False
    assert "cuda" not in ops._IMPLS
    assert "NVRTC" in caplog.text and "reference" in caplog.text
    assert ops.resolve("topk_compact", torch.device("cuda", 0)) is R.topk_compact
    assert not cuda_backend.available()
    if "compile_error" in failure:
        assert calls[:3] == ["create", "compile", "destroy"]  # the program is always released


def test_working_nvrtc_registers_every_op(clean_registry, monkeypatch):
    fake, calls = _fake_cupy()
    monkeypatch.setattr(cuda_backend, "cp", fake)
    assert cuda_backend.register() is True
    assert ops.resolve("topk_compact", torch.device("cuda", 0)) is cuda_backend.topk_compact
    assert ops._IMPLS["cuda"] == cuda_backend.OPS
    assert calls == ["create", "compile", "destroy"]


def test_without_cupy_or_gpu_nothing_registers(clean_registry, monkeypatch):
    monkeypatch.setattr(cuda_backend, "cp", None)
    assert cuda_backend.register() is False
    fake, calls = _fake_cupy()
    monkeypatch.setattr(cuda_backend, "cp", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_backend.register() is False
    assert calls == [] and "cuda" not in ops._IMPLS


class _FakeModule:
    """Stands in for ``cupy.cuda.function.Module``: records the image it loads."""

    loaded: list = []

    def load(self, image):
        self.loaded.append(image)

    def get_function(self, name):
        return ("function", name)


def _fake_compiler(known_archs=("sm_90", "compute_90", "compute_80")):
    """A CuPy whose NVRTC knows ``known_archs``: records each compile's options."""
    compiles = []

    def compile_program(prog, options):
        compiles.append(list(options))
        arch = options[-1].split("=")[1]
        if arch not in known_archs:
            raise RuntimeError("NVRTC_ERROR_INVALID_OPTION")

    nvrtc = types.SimpleNamespace(createProgram=lambda *a: object(), compileProgram=compile_program,
                                  destroyProgram=lambda prog: None, getProgramLog=lambda prog: "bad arch",
                                  getCUBIN=lambda prog: b"cubin", getPTX=lambda prog: b"ptx")
    # no RawModule: CuPy's own compile appends -ftz=true, which flushes subnormals
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(nvrtc=nvrtc, function=types.SimpleNamespace(
        Module=_FakeModule)))
    return fake, compiles


@pytest.fixture
def fresh_launcher(monkeypatch):
    monkeypatch.setattr(cuda_backend.CupyLauncher, "_modules", {})
    monkeypatch.setattr(cuda_backend.CupyLauncher, "_kernels", {})
    monkeypatch.setattr(_FakeModule, "loaded", [])
    return cuda_backend.CupyLauncher()


def test_kernels_compile_keeping_subnormals_for_the_device(monkeypatch, fresh_launcher):
    fake, compiles = _fake_compiler()
    monkeypatch.setattr(cuda_backend, "cp", fake)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    assert fresh_launcher._kernel(0, "sel_count") == ("function", "sel_count")
    assert fresh_launcher._kernel(0, "radix_hist") == ("function", "radix_hist")
    assert len(compiles) == 1  # one compile per device, however many kernels
    opts = compiles[0]
    assert "--ftz=false" in opts and "--fmad=false" in opts and not any("ftz=true" in o for o in opts)
    assert opts[-1] == "--gpu-architecture=sm_90" and _FakeModule.loaded == [b"cubin"]


def test_an_architecture_nvrtc_does_not_know_gets_ptx(monkeypatch, fresh_launcher):
    fake, compiles = _fake_compiler()
    monkeypatch.setattr(cuda_backend, "cp", fake)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (12, 0))
    fresh_launcher._kernel(0, "sel_count")
    assert [o[-1] for o in compiles] == ["--gpu-architecture=sm_120", "--gpu-architecture=compute_90"]
    assert _FakeModule.loaded == [b"ptx"]


def test_a_compile_failure_names_each_architecture_tried(monkeypatch, fresh_launcher):
    fake, compiles = _fake_compiler(known_archs=())
    monkeypatch.setattr(cuda_backend, "cp", fake)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 6))
    with pytest.raises(cuda_backend.KernelsUnavailable, match="sm_86.*bad arch.*compute_80"):
        fresh_launcher._kernel(0, "sel_count")
    assert _FakeModule.loaded == [] and cuda_backend.CupyLauncher._modules == {}
