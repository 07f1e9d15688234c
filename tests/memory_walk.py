"""Bytes of the distinct tensor storages an object keeps alive (to hold memory figures against)."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from commpress.storage import LeanTensor


def storages_bytes(obj: Any, exclude: Iterable[torch.Tensor | None] = ()) -> int:
    """Bytes of every distinct tensor storage reachable from ``obj`` through dicts, lists, tuples,
    sets, :class:`LeanTensor` and the attributes of commpress objects; the storages of ``exclude``
    (e.g. the model's parameters and gradients) are not counted."""
    seen = {t.untyped_storage().data_ptr() for t in exclude if t is not None}
    return _walk(obj, seen, set(), 0)


def _walk(obj: Any, seen: set[int], visited: set[int], depth: int) -> int:
    if depth > 12 or id(obj) in visited:
        return 0
    visited.add(id(obj))
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        if st.data_ptr() in seen or st.nbytes() == 0:
            return 0
        seen.add(st.data_ptr())
        return st.nbytes()
    if isinstance(obj, dict):
        return sum(_walk(v, seen, visited, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(_walk(v, seen, visited, depth + 1) for v in obj)
    if isinstance(obj, LeanTensor):
        return sum(_walk(t, seen, visited, depth + 1) for t in obj.tensors())
    if type(obj).__module__.startswith("commpress"):
        fields = vars(obj) if hasattr(obj, "__dict__") else {
            s: getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)}
        return sum(_walk(v, seen, visited, depth + 1) for v in fields.values())
    return 0
