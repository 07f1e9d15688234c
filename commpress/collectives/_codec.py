"""What the collectives need to know about a compressor chain (an optional
:class:`~commpress.ErrorFeedback` around a real compressor)."""

from __future__ import annotations

from typing import Any

import torch

from ..compressors._util import mix_seed, stable_hash
from ..compressors.base import Compressor, Payload
from ..feedback import ErrorFeedback, ResidualTransaction
from .accounting import codec_timer
from .wire import E_DTYPE, E_MISUSE, signature


def unwrap(compressor: Any) -> Any:
    """The real compressor behind error-feedback wrappers (or the compressor itself)."""
    inner = compressor
    while is_feedback(inner):
        inner = inner.compressor
    return inner


def is_feedback(c: Any) -> bool:
    return isinstance(c, ErrorFeedback)


def fingerprint(compressor: Any) -> int:
    """A hash of the compressor chain's names and configurations (compared across ranks)."""
    parts = []
    c = compressor
    while True:
        cfg = c.config() if hasattr(c, "config") else {}
        parts.append((type(c).__name__, getattr(c, "name", ""), sorted((k, repr(v)) for k, v in cfg.items())))
        if not is_feedback(c):
            break
        c = c.compressor
    return signature(*parts)


def compress_fixed(compressor: Compressor, tensor: torch.Tensor, *, step: int, key: Any,
                   generator: torch.Generator | None, transaction: ResidualTransaction | None) -> Payload:
    """The fixed-size payload of ``tensor``; an error-feedback residual update is staged in
    ``transaction`` (committed by the caller once every rank's status is known).  An int
    ``generator`` (a seed) is mixed with ``key``, so the chunks of one call draw
    independent noise."""
    if isinstance(generator, int) and not isinstance(generator, bool):
        generator = mix_seed(generator, stable_hash(key))
    if isinstance(compressor, ErrorFeedback):
        return compressor.compress_fixed(tensor, step=step, key=key, generator=generator,
                                         transaction=transaction)
    return compressor.compress_fixed(tensor, step=step, key=key, generator=generator)


def has_feedback(compressor: Any) -> bool:
    return isinstance(compressor, ErrorFeedback)


def local_check(tensor: torch.Tensor, compressor: Any, algorithm: str, allowed: tuple[str, ...]
                ) -> tuple[int, str]:
    """This rank's static checks: ``(error code, message)``, code 0 when fine."""
    if algorithm not in allowed:
        return E_MISUSE, f"algorithm must be one of {allowed}, got {algorithm!r}"
    inner = unwrap(compressor)
    if tensor.dtype not in inner.supported_dtypes:
        return E_DTYPE, f"dtype {tensor.dtype} not supported by {inner.name}"
    return 0, ""


def size_step(inner: Compressor, step: int) -> int:
    """The step to compress a zero payload at when only its size matters: ``step`` for a
    compressor whose size follows the step (a density warm-up, ``ratio_at``), else 0 (a
    compressor that failed at ``step`` may fail there again)."""
    return step if inner.ratio_at(step) is not None else 0


def try_compress_fixed(compressor: Compressor, tensor: torch.Tensor, *, step: int, key: Any,
                       generator, transaction: ResidualTransaction | None, error: tuple[int, str],
                       stats=None) -> tuple[Payload | None, int, str]:
    """:func:`compress_fixed` unless ``error`` is already set; a compress that raises
    becomes an error code (raised on every rank through the status, never here).
    ``stats`` (a :class:`~.accounting.CommStats`): its ``"compress"`` pass is charged."""
    code, msg = error
    if code:
        return None, code, msg
    try:
        with codec_timer(stats, "compress"):
            return compress_fixed(compressor, tensor, step=step, key=key, generator=generator,
                                  transaction=transaction), 0, ""
    except Exception as exc:  # noqa: BLE001 - reported through the status word
        return None, E_MISUSE, f"compress failed: {type(exc).__name__}: {exc}"
