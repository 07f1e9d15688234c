"""Hot primitives with one dispatch point per op.

Each op has a pure-torch reference (:mod:`commpress.ops.reference`, the
definition of correct) and may have faster backends: ``"numba"`` for CPU
tensors and ``"cuda"`` (CuPy kernels from ``kernels/*.cu``) for CUDA tensors.
``backend=None`` picks the fastest installed backend for the tensors' device;
``backend="torch" | "numba" | "cuda"`` forces one (tests, benchmarks), and the
environment variable ``COMMPRESS_BACKEND`` forces one globally.

Compressors and collectives call these functions, never a backend directly.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable

import torch

from . import _usage, lean, reference

BACKENDS = ("torch", "numba", "cuda")

# backend name -> {op name -> implementation}; filled by backend modules.
_IMPLS: dict[str, dict[str, Callable]] = {"torch": {}}
for _name in reference.__all__:
    _IMPLS["torch"][_name] = getattr(reference, _name)
_IMPLS["torch"].update(lean.REFERENCE)   # the lean residual stores' encoders (commpress.storage)


def register_backend(backend: str, impls: dict[str, Callable]) -> None:
    """Add (or replace) a backend's implementations of some ops."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _IMPLS.setdefault(backend, {}).update(impls)


def _load_optional_backends() -> None:
    for module in ("numba_backend", "cuda_backend"):
        try:
            __import__(f"{__name__}.{module}")
        except ImportError as exc:  # numba / cupy not installed: backend not registered
            logging.getLogger("commpress").debug("ops backend %s not loaded: %s", module, exc)
        except Exception as exc:  # a broken install must not break `import commpress`
            logging.getLogger("commpress").warning("ops backend %s failed to load: %r", module, exc)


def available_backends() -> list[str]:
    """Backends with at least one op registered."""
    return [b for b in BACKENDS if _IMPLS.get(b)]


#: The backend ``backend=None`` prefers per device type (the GPU check's dry run maps "cpu" to "cuda",
#: the host build of the kernels).
DEVICE_BACKENDS = {"cuda": "cuda", "cpu": "numba"}
#: Why the cuda backend is not registered (set by cuda_backend), for the fallback log.
cuda_unavailable_reason = "commpress.ops.cuda_backend not loaded"


def _resolve(op: str, device: torch.device, backend: str | None = None) -> tuple[str, Callable]:
    """``(backend name, implementation)`` of ``op`` for tensors on ``device``."""
    backend = backend or os.environ.get("COMMPRESS_BACKEND") or None
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
        impls = _IMPLS.get(backend, {})
        if op in impls:
            return backend, impls[op]
        if backend != "torch":
            raise NotImplementedError(f"op {op!r} has no {backend!r} backend (installed?)")
    preferred = DEVICE_BACKENDS.get(device.type, "torch")
    impl = _IMPLS.get(preferred, {}).get(op)
    if impl is not None:
        return preferred, impl
    if preferred == "cuda":  # a CUDA tensor on the reference: say so once per op
        why = ("the cuda backend has no kernel for this op" if _IMPLS.get("cuda")
               else f"the cuda backend is not registered: {cuda_unavailable_reason}")
        _usage.fallback(op, "cuda", why)
    return "torch", _IMPLS["torch"][op]


def resolve(op: str, device: torch.device, backend: str | None = None) -> Callable:
    """The implementation of ``op`` for tensors on ``device``."""
    return _resolve(op, device, backend)[1]


def backends_used(reset: bool = False) -> dict[str, str]:
    """``{op: backend}``: the backend (``"torch"``, ``"numba"`` or ``"cuda"``) that ran the last
    call of each op called through :mod:`commpress.ops` since the last ``reset=True``.

    ``"torch"`` also marks a call of the cuda backend handed to the reference (arguments no
    kernel covers, or no kernel for the op); each such fallback is logged once to
    ``logging.getLogger("commpress")``.  A training loop can read this after a step to check
    that its compressor's ops ran on the GPU kernels.
    """
    return _usage.used(reset)


def _dispatching(op: str) -> Callable:
    ref = _IMPLS["torch"][op]

    @functools.wraps(ref)
    def call(*args, backend: str | None = None, **kwargs):
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        if device is None:  # tensors in a list (block_dequantize_sum)
            device = next((t.device for a in args if isinstance(a, (list, tuple))
                           for t in a if isinstance(t, torch.Tensor)), None)
        if device is None:  # ops without tensor arguments (counter_bits, ...) take a device
            device = kwargs.get("device", next((a for a in args if isinstance(a, torch.device)), "cpu"))
            device = torch.device(device)
        name, impl = _resolve(op, device, backend)
        _usage.note(op, name)
        return impl(*args, **kwargs)

    return call


_load_optional_backends()
if lean.NUMBA:
    register_backend("numba", lean.NUMBA)

# Re-export every op as a dispatching function: commpress.ops.topk_compact(...).
for _name in [*reference.__all__, *lean.REFERENCE]:
    globals()[_name] = _dispatching(_name)

__all__ = list(reference.__all__) + list(lean.REFERENCE) + ["BACKENDS", "available_backends", "backends_used", "register_backend",
                                     "resolve"]
