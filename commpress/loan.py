"""Memory a caller lends error feedback until a step's verdict: where old residuals wait.

"A step with a NaN/inf anywhere leaves every residual as it was" needs the old value of every
residual the step rewrote until the last collective has judged the step.  Kept as a second store
(the *pending* one) that doubles the residuals' memory.  A DDP hook can do without it: while a
step runs, each parameter's ``.grad`` (with ``gradient_as_bucket_view=False``, DDP's default)
holds the local gradient that DDP already copied into its bucket, and DDP overwrites it with the
bucket's result only after the step's last hook.  Lent to error feedback, that memory holds a
lean residual's old codes: the new residual is then stored over the live one, and a step judged
bad copies the old codes back.  The result is bitwise the pending store's; nothing of the model's
size is kept between steps.

* :class:`Loan` — the lent buffers (flat ``uint8`` views), filled in order;
* :class:`Saved` — what one store saved into a loan, and how it comes back.

Everything runs on the tensors' device; a device verdict is applied with ``torch.where``.
"""

from __future__ import annotations

import torch

__all__ = ["Loan", "Saved"]


def byte_view(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s memory as a flat ``uint8`` view, or ``None`` where it has no such view (not
    contiguous, not strided)."""
    if t.layout != torch.strided or not t.is_contiguous():
        return None
    return t.reshape(-1).view(torch.uint8)


class Saved:
    """The bytes one store held before it was overwritten, and where they wait in a :class:`Loan`.

    Args:
        pairs: ``(live, saved)`` byte views of equal size: the overwritten bytes and their copy.
    """

    __slots__ = ("pairs",)

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pairs = pairs

    def restore(self, bad: torch.Tensor | None, keep_old: bool | None) -> None:
        """Put the saved bytes back where the step was judged bad.

        Args:
            bad: the verdict, a 0-d bool tensor (``None``: good unless ``keep_old``).
            keep_old: the verdict read on the host (``True``: bad, ``False``: good), or ``None``
                for a device flag, applied there with one ``torch.where`` per piece.
        """
        if keep_old is False or (keep_old is None and bad is None):
            return
        for live, saved in self.pairs:
            if keep_old:
                live.copy_(saved)
            else:
                torch.where(bad.to(live.device), saved, live, out=live)


class Loan:
    """Byte buffers lent until a step's verdict; :meth:`save` copies stores into them in order.

    Args:
        buffers: flat ``uint8`` tensors (:func:`byte_view` of the lent memory), on one device.
    """

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self._free = [b for b in buffers if b.numel()]
        self.room = sum(b.numel() for b in self._free)

    def save(self, tensors: tuple[torch.Tensor, ...]) -> Saved | None:
        """Copy ``tensors`` (contiguous, on the loan's device) into the loan; ``None`` (nothing
        copied) when the room left is too small or a tensor has no byte view."""
        views = [byte_view(t) for t in tensors]
        if any(v is None for v in views) or any(v.device != b.device for v in views for b in self._free[:1]):
            return None
        need = sum(v.numel() for v in views)
        if need > self.room:
            return None
        pairs = []
        for src in views:
            pos = 0
            while pos < src.numel():
                buf = self._free[0]
                n = min(buf.numel(), src.numel() - pos)
                live = src[pos:pos + n]
                buf[:n].copy_(live)
                pairs.append((live, buf[:n]))
                if n == buf.numel():
                    self._free.pop(0)
                else:
                    self._free[0] = buf[n:]
                pos += n
        self.room -= need
        return Saved(pairs)
