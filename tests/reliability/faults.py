"""Fault injection for the reliability suite.

Everything here runs inside one rank (a worker of ``distributed.run``) and
changes only that process: a function of a module is replaced by a wrapper that,
at its ``nth`` call, kills the process (``os._exit`` or ``SIGKILL`` of itself),
raises :class:`InjectedFault`, or perturbs the function's result.

>>> inject(commpress.collectives._comm, "all_to_all_bytes", "sigkill", nth=1)   # a module's function
>>> inject_comm("all_to_all_bytes", "sigkill", nth=1)     # the collectives: through their fault hook
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable

#: exit code of a rank killed with ``os._exit`` by :func:`inject`
EXIT_CODE = 71


class InjectedFault(RuntimeError):
    """Raised by a function :func:`inject` armed with ``"raise"``."""


def die(how: str) -> None:
    """End this process now: ``"exit"`` → ``os._exit(EXIT_CODE)``, ``"sigkill"`` → SIGKILL itself."""
    if how == "exit":
        os._exit(EXIT_CODE)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # never reached: SIGKILL cannot be caught
    raise ValueError(f"how must be 'exit' or 'sigkill', got {how!r}")


def inject(obj: Any, attr: str, action: str | Callable[[Any], Any], *, nth: int = 1,
           every: bool = False) -> dict[str, int]:
    """Replace ``obj.attr`` so that its ``nth`` call (1-based) misbehaves (with ``every``:
    the ``nth`` and all later calls).

    ``action``: ``"exit"`` / ``"sigkill"`` (die *before* the call: the peers are
    left waiting inside the collective), ``"raise"`` (raise
    :class:`InjectedFault` before the call), or a callable applied to the
    call's result (a perturbation).  Other calls go through unchanged.
    Returns a dict whose ``"calls"`` counts the calls seen so far.
    """
    original = getattr(obj, attr)
    seen = {"calls": 0}

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        seen["calls"] += 1
        if seen["calls"] < nth or (seen["calls"] > nth and not every):
            return original(*args, **kwargs)
        if action in ("exit", "sigkill"):
            die(action)
        if action == "raise":
            raise InjectedFault(f"injected fault in {attr} (call {nth})")
        return action(original(*args, **kwargs))

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(obj, attr, wrapper)
    return seen


def inject_comm(name: str, action: str | Callable[[], Any], *, nth: int = 1) -> dict[str, int]:
    """Make the ``nth`` call (1-based) of the collectives' primitive ``name`` misbehave, through
    the public :func:`commpress.collectives.set_fault_hook` (the collectives' code is not
    replaced).  ``action``: ``"exit"`` / ``"sigkill"`` / ``"raise"`` as :func:`inject`, or a
    callable run in place of the call's start (e.g. one that blocks: a hung rank).
    Returns a dict whose ``"calls"`` counts the calls of ``name`` seen so far."""
    from commpress.collectives import set_fault_hook

    seen = {"calls": 0}

    def hook(called: str) -> None:
        if called != name:
            return
        seen["calls"] += 1
        if seen["calls"] != nth:
            return
        if action in ("exit", "sigkill"):
            die(action)
        if action == "raise":
            raise InjectedFault(f"injected fault in {name} (call {nth})")
        action()

    set_fault_hook(hook)
    return seen


def torch_kernels() -> None:
    """Use commpress's pure-torch kernels in this process (``COMMPRESS_BACKEND=torch``).

    The multi-process tests are about protocols, not kernels (the numba kernels
    are proven bitwise equal to the torch reference in ``tests/ops``); the torch
    backend needs no JIT compilation, which on a loaded machine can keep one rank
    out of a collective for minutes.
    """
    os.environ["COMMPRESS_BACKEND"] = "torch"


def rss_bytes() -> int:
    """Resident set size of this process in bytes (``/proc/self/statm``, field 2)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")
