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
