"""``powersgd``: rank-r approximation by one warm-started power iteration (Vogels et al., 2019)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ._util import check_int, decode_keyed, encode_keyed, stable_hash
from .base import Compressor, Payload, register

log = logging.getLogger("commpress")


def orthogonalize_(p: torch.Tensor) -> torch.Tensor:
    """Modified Gram-Schmidt on the columns of the fp32 matrix ``p``, in place, run twice.

    The second pass ("twice is enough") restores orthogonality when ``p`` is
    (nearly) rank-deficient, e.g. a gradient of rank < r: one pass leaves the
    normalized round-off columns far from orthogonal and ``P_hat P_hat.T M``
    then misses ``M`` by tens of percent.
    A zero column stays zero; NaN/inf propagate.  Returns ``p``.
    """
    for _ in range(2):
        for i in range(p.shape[1]):
            col = p[:, i]
            norm = torch.linalg.vector_norm(col)
            col.div_(torch.where(norm > 0, norm, torch.ones_like(norm)))
            if i + 1 < p.shape[1]:
                rest = p[:, i + 1:]
                rest.sub_(torch.outer(col, col @ rest))
    return p


@register("powersgd")
class PowerSGD(Compressor):
    """PowerSGD: the tensor as a ``rows x cols`` matrix ``M`` (``rows = shape[0]``,
    ``cols = numel/rows``) is sent as ``P_hat`` (rows x r) and ``Q`` (cols x r),
    fp32, ``4*r*(rows+cols)`` bytes, with ``M ~ P_hat @ Q.T``:

    ``P = M @ Q_warm``; ``P_hat = orthogonalize(P)``; ``Q = M.T @ P_hat``.

    ``Q_warm`` is kept per ``key`` (the last ``Q``; initialised from a generator
    seeded with ``zlib.crc32(repr(key))``, the same on every rank) and is part of
    :meth:`state_dict`.  Tensors with fewer than 2 dims, or whose factors would
    not be smaller than the tensor (``4*r*(rows+cols) >= numel*itemsize``, i.e.
    ``r*(rows+cols) >= numel`` for fp32), are sent uncompressed in their own
    dtype (``payload.meta["uncompressed"] = True``).  Biased: use error feedback.

    Distributed protocol (``"lowrank"`` aggregation), per tensor with
    :meth:`is_compressed`: ``p = begin(M, key)``; all_reduce ``p``;
    ``q = middle(M, p, key)``; all_reduce ``q``; ``out = end(p, q, key, shape, dtype)``.
    A non-finite ``q`` is never stored as a warm start.
    """

    aggregation = "lowrank"
    unbiased = False
    deterministic = True

    def __init__(self, rank: int = 4) -> None:
        self.rank = check_int("rank", rank, 1)
        self._warm: dict[Any, torch.Tensor] = {}

    # -- geometry ------------------------------------------------------
    def matrix_shape(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """``(rows, cols)`` when ``tensor`` is sent compressed, else ``None``."""
        if tensor.dim() < 2 or tensor.numel() == 0:
            return None
        rows = tensor.shape[0]
        cols = tensor.numel() // rows
        if 4 * self.rank * (rows + cols) >= tensor.numel() * tensor.element_size():
            return None
        return rows, cols

    def is_compressed(self, tensor: torch.Tensor) -> bool:
        """False when ``tensor`` is sent as it is (1-D or too small for rank ``r``)."""
        return self.matrix_shape(tensor) is not None

    def _matrix(self, tensor: torch.Tensor) -> torch.Tensor:
        shape = self.matrix_shape(tensor)
        if shape is None:
            raise ValueError(f"powersgd: tensor of shape {tuple(tensor.shape)} is not compressed "
                             "(check is_compressed first)")
        return tensor.reshape(shape).float()

    def _warm_start(self, key: Any, cols: int, device: torch.device) -> torch.Tensor:
        q = self._warm.get(key)
        if q is None or q.shape != (cols, self.rank):
            if q is not None:
                log.debug("powersgd: key %r changed shape to %d cols; new warm start", key, cols)
            g = torch.Generator().manual_seed(stable_hash(key))
            q = torch.randn(cols, self.rank, generator=g, dtype=torch.float32)
            self._warm[key] = q
        if q.device != device:
            q = self._warm[key] = q.to(device)
        return q

    # -- stepwise protocol ---------------------------------------------
    def begin(self, tensor: torch.Tensor, key: Any) -> torch.Tensor:
        """``P_local = M @ Q_warm`` (fp32, rows x r)."""
        self.check_input(tensor)
        m = self._matrix(tensor)
        return m @ self._warm_start(key, m.shape[1], m.device)

    def middle(self, tensor: torch.Tensor, p_sum: torch.Tensor, key: Any) -> torch.Tensor:
        """Orthogonalizes ``p_sum`` in place (it becomes ``P_hat``); returns
        ``Q_local = M.T @ P_hat`` (fp32, cols x r)."""
        orthogonalize_(p_sum)
        return self._matrix(tensor).t() @ p_sum

    def end(self, p_hat: torch.Tensor, q_sum: torch.Tensor, key: Any,
            shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Stores ``q_sum`` as the warm start for ``key`` (unless non-finite) and
        returns ``(P_hat @ q_sum.T)`` reshaped to ``shape`` in ``dtype``."""
        self._store(key, q_sum)
        return (p_hat @ q_sum.t()).reshape(shape).to(dtype)

    def _store(self, key: Any, q: torch.Tensor) -> None:
        """Keep ``q`` as the warm start, or the old one where ``q`` is non-finite (on the device)."""
        old = self._warm.get(key)
        if old is not None and old.shape == q.shape and old.device == q.device:
            finite = torch.isfinite(q.sum())
            torch.where(finite, q, old, out=old)
        else:
            self._warm[key] = q.detach().float().clone()

    # -- Compressor API ------------------------------------------------
    def compress(self, tensor, *, step=0, key=0, generator=None) -> Payload:
        self.check_input(tensor)
        shape = self.matrix_shape(tensor)
        if shape is None:
            return self.make_payload(tensor, (tensor.reshape(-1).contiguous(),), uncompressed=True)
        p = self.begin(tensor, key)
        q = self.middle(tensor, p, key)
        self._store(key, q)
        return self.make_payload(tensor, (p, q), uncompressed=False, rows=shape[0],
                                 cols=shape[1], rank=self.rank)

    def decompress(self, payload: Payload, out: torch.Tensor | None = None) -> torch.Tensor:
        dst = self.decode_target(payload, out)
        if payload.meta.get("uncompressed"):
            return self.finish_decode(payload, payload.tensors[0], out)
        p, q = payload.tensors
        if dst is not None and p.dtype == torch.float32 and q.dtype == torch.float32:
            torch.mm(p, q.t(), out=dst.view(p.shape[0], q.shape[0]))
            return self.finish_decode(payload, dst, out)
        return self.finish_decode(payload, (p @ q.t()).reshape(-1), out)

    # -- state ---------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"rank": r, "warm_start": {"keys": [...], "tensors": [Q, ...]}}``."""
        return {"rank": self.rank, "warm_start": encode_keyed(self._warm)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or set(state) != {"rank", "warm_start"}:
            raise ValueError("powersgd state must be a dict with keys 'rank' and 'warm_start'")
        if state["rank"] != self.rank:
            raise ValueError(f"powersgd state has rank {state['rank']}, this compressor {self.rank}")
        warm = decode_keyed(state["warm_start"], "powersgd warm_start")
        for key, q in warm.items():
            if q.dim() != 2 or q.shape[1] != self.rank:
                raise ValueError(f"powersgd warm start for key {key!r} has shape {tuple(q.shape)}")
        self._warm = {k: q.float().clone() for k, q in warm.items()}
