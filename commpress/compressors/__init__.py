"""Compressors, one algorithm per module, each registered by name with :func:`register`."""

from __future__ import annotations

import importlib
import pkgutil

from .base import AGGREGATIONS, Compressor, Payload, available, get, register

# Import every module in this package so its @register decorators run.
for _info in pkgutil.iter_modules(__path__):
    if _info.name != "base":
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["AGGREGATIONS", "Compressor", "Payload", "available", "get", "register"]
