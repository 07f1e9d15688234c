"""Which backend ran each op (for :func:`commpress.ops.backends_used`), and fallbacks logged once.

The dispatcher notes the backend it picked; a backend that hands a call to the torch reference
(arguments no kernel covers) notes ``"torch"`` instead, and the first such fallback of each op
(and reason) is logged to ``logging.getLogger("commpress")``: a GPU run never silently takes
the slow path.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger("commpress")

_used: dict[str, str] = {}
_logged: set[tuple[str, str]] = set()
_lock = threading.Lock()


def note(op: str, backend: str) -> None:
    """Record that ``op``'s last call ran on ``backend``."""
    _used[op] = backend


def fallback(op: str, backend: str, reason: str) -> None:
    """``op`` ran the torch reference instead of ``backend``: record it and log once per reason."""
    _used[op] = "torch"
    key = (op, reason)
    if key in _logged:
        return
    with _lock:
        if key in _logged:
            return
        _logged.add(key)
    log.warning("ops.%s: no %s kernel for this call (%s): the torch reference runs instead "
                "(logged once)", op, backend, reason)


def used(reset: bool = False) -> dict[str, str]:
    """``{op: backend}`` of the last call of each op (since the last reset)."""
    out = dict(sorted(_used.items()))
    if reset:
        _used.clear()
    return out
