"""Integrations with PyTorch data-parallel training: :mod:`.ddp` (DDP comm hook) and FSDP2.

``common`` holds what both share (state base class, stats, config fingerprint).
"""

from __future__ import annotations

from . import common, ddp, fsdp

__all__ = ["common", "ddp", "fsdp"]
