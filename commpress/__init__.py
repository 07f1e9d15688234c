"""commpress: gradient compression and compressed collectives for PyTorch.

>>> import commpress
>>> c = commpress.get("topk", ratio=0.01)
>>> payload = c.compress(grad)          # payload.tensors go on the wire
>>> approx = c.decompress(payload)
"""

from __future__ import annotations

import logging
import sys

from .compressors import Compressor, Payload, available, get, register
from .feedback import ErrorFeedback
from .hooks import ddp
from . import diloco  # noqa: E402 - after the compressors and collectives it builds on

# `import commpress.ddp` works like attribute access.  `commpress.fsdp` (commpress/fsdp.py) is
# imported on first use: FSDP2's modules (DTensor's op table) take ~2 s to import, which every
# DDP rank process would otherwise pay.
sys.modules[f"{__name__}.ddp"] = ddp


def __getattr__(name: str):
    if name == "fsdp":
        import importlib

        return importlib.import_module(f"{__name__}.fsdp")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


logging.getLogger("commpress").addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = ["Compressor", "ErrorFeedback", "ddp", "diloco", "fsdp", "Payload", "available", "get", "register", "__version__"]
