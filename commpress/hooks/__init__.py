"""Integrations with PyTorch data-parallel training: :mod:`.ddp` (DDP comm hook) and FSDP2.

``common`` holds what both share (state base class, stats, config fingerprint).
"""

from __future__ import annotations

from . import common, ddp


def __getattr__(name: str):
    if name == "fsdp":   # imported on first use (FSDP2's own imports take ~2 s; see commpress/__init__)
        import importlib

        return importlib.import_module(f"{__name__}.fsdp")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["common", "ddp", "fsdp"]
