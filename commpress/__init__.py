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
from .hooks import ddp, fsdp
from . import diloco  # noqa: E402 - after the compressors and collectives it builds on

# `import commpress.ddp` / `from commpress.fsdp import register` work like attribute access.
sys.modules[f"{__name__}.ddp"] = ddp
sys.modules[f"{__name__}.fsdp"] = fsdp

logging.getLogger("commpress").addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = ["Compressor", "ErrorFeedback", "ddp", "diloco", "fsdp", "Payload", "available", "get", "register", "__version__"]
