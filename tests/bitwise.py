"""``same``: bitwise equality of nested results (tensors by their bytes, so NaN payloads and signed
zeros count), what the steady-lane tests compare the lane and the general path with."""

from __future__ import annotations

import torch


def same(a, b) -> bool:
    """``a`` and ``b`` hold the same bytes: tensors (dtype, shape, bytes), dicts, lists, else ``==``."""
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def tensors_in(obj) -> list[torch.Tensor]:
    """Copies of every tensor in a nested dict / list / tuple, in a fixed order (dict keys sorted
    by ``repr``): a hook's ``state_dict()`` as a list to compare bitwise."""
    out: list[torch.Tensor] = []

    def walk(o):
        if isinstance(o, torch.Tensor):
            out.append(o.detach().clone())
        elif isinstance(o, dict):
            for k in sorted(o, key=repr):
                walk(o[k])
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return out
