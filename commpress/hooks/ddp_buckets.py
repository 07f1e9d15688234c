"""DDP's bucket layout after its rebuild, known at the end of the first backward.

DDP lays its buckets out anew at the forward after its first backward, in the order the
gradients became ready in that backward (``Reducer::rebuild_buckets``: a first bucket of
``first_bucket_bytes_cap``, then ``bucket_bytes_cap`` each, by dtype and device; rank 0's
order on every rank).  With its default arguments the first iteration has one bucket for
the whole model.  ``"auto"`` decides at the end of the first backward (its warm-up step,
DDP's own path), so it forms its units on the layout DDP is about to make:
:class:`ReadyOrder` records the order in that backward (one post-accumulate hook per
parameter, removed after it) and lays it out with DDP's own assignment function
(:meth:`ReadyOrder.rebuilt_buckets`).  :func:`unpredictable` names what makes that layout another one
(``static_graph``, ``find_unused_parameters``, a list of bucket caps, the Python reducer,
``DDP_SET_LAST_BUCKET_CAP``); ``"auto"`` then decides one step later, as before.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def ddp_params(model: Any) -> list[torch.Tensor]:
    """The parameters DDP reduces, in registration order (shared ones once, ignored ones out)."""
    ignored = set(getattr(model, "parameters_to_ignore", ()) or ())
    seen, out = set(), []
    for name, p in model.module.named_parameters():
        if p.requires_grad and name not in ignored and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def unpredictable(model: Any) -> str | None:
    """Why DDP's layout after its first iteration is not :func:`rebuilt_buckets`' (``None``: it is)."""
    if not hasattr(dist, "_compute_bucket_assignment_by_size"):
        return "this torch has no dist._compute_bucket_assignment_by_size"
    if getattr(model, "static_graph", False):
        return "static_graph=True (DDP rebuilds its buckets after the second iteration)"
    if getattr(model, "find_unused_parameters", False):
        return "find_unused_parameters=True"
    if getattr(model, "_use_python_reducer", False):
        return "DDP's Python reducer"
    config = getattr(model, "_bucket_config", None)
    if config is not None and getattr(config, "per_bucket_bytes_caps", ()):
        return "a list of bucket caps (bucket_cap_mb=[...])"
    if os.environ.get("DDP_SET_LAST_BUCKET_CAP") == "1":
        return "DDP_SET_LAST_BUCKET_CAP=1"
    return None


def bucket_caps(model: Any) -> tuple[int, int]:
    """``(first bucket's cap, the others')`` in bytes, as DDP's rebuild uses them."""
    cap = int(model.bucket_bytes_cap)
    config = getattr(model, "_bucket_config", None)
    if config is not None:
        return int(config.first_bucket_bytes_cap), cap
    default = getattr(model, "bucket_bytes_cap_default", False)
    return (int(dist._DEFAULT_FIRST_BUCKET_BYTES) if default else cap), cap


class ReadyOrder:
    """The order in which ``model``'s gradients become ready in its next backward, and the buckets
    DDP lays out from it.

    Args:
        model: the DDP model; each of its parameters (:func:`ddp_params`) gets a post-accumulate
            hook, which DDP's own hook for that parameter follows, until :meth:`remove`.
    """

    def __init__(self, model: Any) -> None:
        self.params = ddp_params(model)
        self.caps = bucket_caps(model)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.order: list[int] = []
        self._handles = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]

    def _ready(self, p: torch.Tensor) -> None:
        if len(self.order) < len(self.params):
            self.order.append(self._index[id(p)])

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def agreed(self, group: Any) -> list[int] | None:
        """Rank 0's order (DDP's rebuild takes rank 0's too), broadcast over ``group``
        (collective; on the group's device: an NCCL group's current CUDA device, read back once);
        ``None`` where rank 0 did not see every parameter get its gradient."""
        n = len(self.params)
        mine = self.order if len(self.order) == n else [-1] * n
        t = torch.tensor(mine or [0], dtype=torch.int64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            from ..collectives import comm_device

            src = dist.get_global_rank(group, 0) if group is not None else 0
            t = t.to(comm_device(group))
            dist.broadcast(t, src=src, group=group)
        order = t.tolist()[:n]
        return order if n and sorted(order) == list(range(n)) else None

    def rebuilt_buckets(self, order: list[int]) -> list[list[torch.Tensor]]:
        """DDP's buckets after its rebuild, first-ready first: the parameters in ready ``order``,
        cut by DDP's own ``_compute_bucket_assignment_by_size`` at :func:`bucket_caps`."""
        ready = [self.params[i] for i in order]
        buckets, _ = dist._compute_bucket_assignment_by_size(ready, list(self.caps), [False] * len(ready),
                                                             list(range(len(ready))))
        return [[ready[i] for i in b] for b in buckets]
