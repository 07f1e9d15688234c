"""A pool of reusable buffers: scratch of the order of the largest request, not of their sum."""

from __future__ import annotations

import threading

import torch


class BufferPool:
    """Buffers lent out by :meth:`take` and returned by :meth:`give`, reused across calls and steps.

    A request gets a view of a free buffer of its dtype and device that is large enough, or a new
    one grown to the largest size asked so far (the smaller free ones of that kind are dropped).
    The pool keeps as many buffers as were lent at once (one, when every user returns its buffer
    before the next takes one), each of the largest request's size.  Safe across threads.
    """

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []
        self._all: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat buffer of ``numel`` elements (a view of a pooled one; contents undefined)."""
        with self._lock:
            same = [b for b in self._free if b.dtype == dtype and b.device == device]
            for b in same:
                if b.numel() >= numel:
                    self._free = [f for f in self._free if f is not b]
                    return b[:numel]
            grown = max([numel] + [b.numel() for b in same])
            self._free = [f for f in self._free if not any(f is b for b in same)]
            self._all = [a for a in self._all if not any(a is b for b in same)]
            buf = torch.empty(grown, dtype=dtype, device=device)
            self._all.append(buf)
            return buf[:numel]

    def give(self, view: torch.Tensor) -> None:
        """Return what :meth:`take` lent (once; a second return is ignored)."""
        with self._lock:
            base = next((b for b in self._all if b.data_ptr() == view.data_ptr()), None)
            if base is not None and not any(f is base for f in self._free):
                self._free.append(base)

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer the pool keeps alive, lent or free."""
        with self._lock:
            return list(self._all)

    def clear(self) -> None:
        """Drop every buffer (those lent stay valid for their holders)."""
        with self._lock:
            self._free.clear()
            self._all.clear()
