"""Which parameters go as sparse rows, and with what capacity (planning only: no DDP wiring).

A parameter whose gradient has mostly zero rows (an ``nn.Embedding`` weight a batch touches a
few rows of) is summed losslessly by :func:`commpress.collectives.rows_allreduce`.
:class:`SparseRows` keeps, per such parameter, what the hook needs each step:

* the **path**, ``"rows"`` or ``"dense"``: rows while the rows' message is the smaller
  (:func:`rows_cheaper`, by bytes), dense again when the rows stop being sparse, and back to
  rows (with a margin) when a re-check every ``recheck_every`` steps finds them sparse;
* the **capacities** of the next call (:meth:`SparseRows.capacities`), from the rows seen in the
  last ``window`` calls, with ``headroom`` and rounded up a ladder of ``2**(1/8)`` steps (few
  distinct sizes: each new size costs one header exchange);
* what was seen, for ``stats``: :meth:`SparseRows.as_dict`.

Every decision is a function of numbers that are the same on every rank (the counts a
:class:`~commpress.collectives.RowsResult` carries, gathered from every rank; the max over the
ranks of the dense-path measurements) and is taken at the same step on every rank, so all ranks
agree on the path and the capacities without a round of their own.

Host reads: none on the hot path.  Counts a rows call gathered are host ints already (its one
read, see :mod:`commpress.collectives.rows`); its union count is a device scalar read one step
later (:meth:`SparseRows.begin_step`), when it is long done.  A dense-path parameter is measured on
the device at the first ``warmup`` steps and every ``recheck_every`` steps
(:meth:`SparseRows.observe`); :meth:`SparseRows.end_step` starts one ``all_reduce`` (max) of those
counts without waiting, and the next :meth:`SparseRows.begin_step` reads it.

Typical use by a hook, each step::

    plan.begin_step()
    for name, p in plan.items():
        if plan.path(name) == "rows":
            result = rows_allreduce(p.grad, key=name, group=group, out=p.grad, **plan.capacities(name))
            plan.record(name, result)
        else:
            plan.observe(name, p.grad)          # measured on measuring steps only
            ...                                 # the dense path as configured
    plan.end_step()
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..collectives.rows import RowsResult, nonzero_rows, row_bytes, row_scatter_bytes

__all__ = ["SparseRows", "RowPlan", "capacity_ladder", "check_no_sparse_embeddings", "rows_cheaper",
           "scatter_cheaper"]

COLLECTIVES = ("allreduce", "reduce_scatter")

PATHS = ("rows", "dense")
#: an owner's share of the union, over the even share: hash partitions of a few hundred rows
#: differ by a few standard deviations (sqrt of the share)
UNION_SKEW = 1.25


def check_no_sparse_embeddings(model: nn.Module) -> None:
    """Refuse ``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)``: their sparse
    gradients cannot go through a DDP comm hook.  Raises ``ValueError`` naming the module and
    saying what to do instead."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            raise ValueError(
                f"{name or 'the model'} is {type(module).__name__}(sparse=True): its sparse gradient cannot "
                f"go through a DDP comm hook. Build it with sparse=False and pass its weight in "
                f"sparse_rows=[model.{name}.weight] (or sparse_rows='auto'): commpress then sends only "
                f"the rows a batch touched, summed exactly, with any optimizer")


def capacity_ladder(rows: float) -> int:
    """The smallest size of the ladder ``ceil(2**(j/8))`` (j >= 0) that holds ``rows`` (0 for none)."""
    if rows <= 0:
        return 0
    j = max(0, math.ceil(8 * math.log2(rows)) - 1)
    while math.ceil(2 ** (j / 8)) < rows:
        j += 1
    return math.ceil(2 ** (j / 8))


def rows_cheaper(world: int, rows: int, dim: int, dtype: torch.dtype, capacity: int, owner_capacity: int,
                 union_capacity: int, margin: float = 1.0) -> bool:
    """Whether the rows' messages (the smaller of ``"allgather"`` and ``"hashed"`` at these
    capacities) are fewer bytes than ``margin`` times a dense ring all_reduce's.

    By bytes alone, as :func:`~commpress.collectives.costmodel.choose_fixed_sparse`: fewer bytes are
    also no more rounds per byte, and a pure function of sizes lets every rank and a resumed run
    decide alike (the rows call itself picks between its two algorithms by the calibrated model).

    Args:
        world: ranks ``P``.
        rows, dim, dtype: the parameter.
        capacity, owner_capacity, union_capacity: the capacities the rows call would use.
        margin: the fraction of the dense bytes the rows must stay under.
    """
    b = row_bytes(world, rows, dim, dtype, capacity, owner_capacity, union_capacity)
    rows_bytes, dense_bytes = min(b["allgather"], b["hashed"]), b["dense"]
    return rows_bytes < margin * dense_bytes


def scatter_cheaper(world: int, rows: int, dim: int, dtype: torch.dtype, owner_capacity: int,
                    margin: float = 1.0) -> bool:
    """Whether :func:`~commpress.collectives.rows.rows_reduce_scatter`'s message at this capacity is
    fewer bytes than ``margin`` times a dense ``reduce_scatter``'s (FSDP2's case).

    Args:
        world: ranks ``P``.
        rows, dim, dtype: the parameter (rows before FSDP2's padding).
        owner_capacity: rows per (rank, owner) of the first round.
        margin: the fraction of the dense bytes the rows must stay under.
    """
    padded = -(-rows // max(world, 1)) * world
    b = row_scatter_bytes(world, padded, dim, dtype, owner_capacity)
    return b["scatter"] < margin * b["dense"]


@dataclass
class RowPlan:
    """One parameter's plan and what was seen of it (see :meth:`SparseRows.as_dict`)."""

    name: str
    rows: int
    dim: int
    dtype: torch.dtype
    declared: bool
    path: str = "dense"
    capacity: int = 0
    owner_capacity: int = 0
    union_capacity: int = 0
    density: float | None = None          # largest fraction of rows nonzero on a rank, last seen
    union_density: float | None = None    # fraction of rows nonzero on some rank, last seen
    overflow_rounds: int = 0
    rows_calls: int = 0
    algorithm: str = ""
    world: int = 1                        # ranks of the last rows call
    seen: deque = field(default_factory=lambda: deque(maxlen=8))        # (max count, max per owner)
    owner_unions: deque = field(default_factory=lambda: deque(maxlen=8))  # rows an owner sums, estimated
    pending_union: "LazyRead | None" = None

    def as_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "dim": self.dim, "declared": self.declared, "path": self.path,
                "density": self.density, "union_density": self.union_density, "capacity": self.capacity,
                "owner_capacity": self.owner_capacity, "union_capacity": self.union_capacity,
                "overflow_rounds": self.overflow_rounds, "rows_calls": self.rows_calls, "algorithm": self.algorithm}


class SparseRows:
    """Per parameter of ``sparse_rows``: the path (rows or dense), the next capacities, what was seen.

    Args:
        model: the model whose parameters are named.
        sparse_rows: a list of the model's 2-D parameters (or their names), ``"auto"`` (every
            2-D parameter that requires grad, measured), or ``None`` / ``[]`` (none).
        group: the process group the rows are summed over (default: the world).
        warmup: steps at the start whose dense-path parameters are measured.
        recheck_every: a dense-path parameter is measured again every this many steps.
        window: calls whose counts set the next capacities.
        headroom: capacities hold this fraction more than the most rows seen.
        return_margin: a dense parameter goes back to rows when its rows cost under this
            fraction of the dense bytes (hysteresis; leaving rows is at parity, 1.0).
        collective: ``"allreduce"`` (DDP: :func:`rows_allreduce` against a dense all_reduce) or
            ``"reduce_scatter"`` (FSDP2: :func:`rows_reduce_scatter` against a dense reduce_scatter,
            by :func:`scatter_cheaper`).

    Raises:
        ValueError: a tensor that is not a parameter of ``model``, a 1-D parameter, a parameter that
            does not require grad, an unknown name or ``nn.Embedding(sparse=True)`` in ``model``
            (named; the same on every rank: the model is).
        TypeError: ``sparse_rows`` that is neither a list nor ``"auto"``.
    """

    def __init__(self, model: nn.Module, sparse_rows: Any, *, group=None, warmup: int = 2, recheck_every: int = 100,
                 window: int = 8, headroom: float = 0.05, return_margin: float = 0.8,
                 collective: str = "allreduce") -> None:
        for name, v in (("warmup", warmup), ("recheck_every", recheck_every), ("window", window)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "warmup" else 1):
                raise ValueError(f"SparseRows: {name} must be an int >= {0 if name == 'warmup' else 1}, got {v!r}")
        if not (0 <= headroom < 10) or not (0 < return_margin <= 1):
            raise ValueError(f"SparseRows: headroom must lie in [0, 10) and return_margin in (0, 1], "
                             f"got {headroom!r}, {return_margin!r}")
        if collective not in COLLECTIVES:
            raise ValueError(f"SparseRows: collective must be one of {COLLECTIVES}, got {collective!r}")
        self.collective = collective
        check_no_sparse_embeddings(model)
        self.group = group
        self.warmup, self.recheck_every, self.window = warmup, recheck_every, window
        self.headroom, self.return_margin = headroom, return_margin
        self.step = 0
        self._params: dict[str, nn.Parameter] = {}
        self.plans: dict[str, RowPlan] = {}
        for name, p, declared in _select(model, sparse_rows):
            self._params[name] = p
            self.plans[name] = RowPlan(name, p.shape[0], p.shape[1], p.dtype, declared,
                                       path="rows" if declared else "dense", seen=deque(maxlen=window),
                                       owner_unions=deque(maxlen=window))
        self._by_id = {id(p): name for name, p in self._params.items()}
        self._observed: dict[str, torch.Tensor] = {}
        self._pending: tuple | None = None   # (names, counts tensor, work or None)

    # ------------------------------------------------------------ lookups
    def __contains__(self, param_or_name) -> bool:
        return self._name(param_or_name, strict=False) is not None

    def __len__(self) -> int:
        return len(self.plans)

    def items(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(name, parameter)`` of every tracked parameter, in the model's order."""
        return iter(self._params.items())

    def _name(self, param_or_name, strict: bool = True) -> str | None:
        name = param_or_name if isinstance(param_or_name, str) else self._by_id.get(id(param_or_name))
        if name not in self.plans:
            if strict:
                raise KeyError(f"SparseRows: {param_or_name if isinstance(param_or_name, str) else 'tensor'} "
                               f"is not tracked")
            return None
        return name

    def path(self, param_or_name) -> str:
        """``"rows"`` or ``"dense"`` for this step."""
        return self.plans[self._name(param_or_name)].path

    def capacities(self, param_or_name) -> dict[str, int]:
        """Keyword arguments of the next :func:`~commpress.collectives.rows_allreduce` call."""
        plan = self.plans[self._name(param_or_name)]
        return {"capacity": plan.capacity, "owner_capacity": plan.owner_capacity,
                "union_capacity": plan.union_capacity}

    def measuring(self, step: int | None = None) -> bool:
        """Whether dense-path parameters are measured at ``step`` (default: this step)."""
        s = self.step if step is None else step
        return s < self.warmup or (s > 0 and s % self.recheck_every == 0)

    # ------------------------------------------------------------ the step
    def begin_step(self) -> None:
        """Apply what the last step measured (read now: those copies are long done)."""
        for plan in self.plans.values():
            if plan.pending_union is not None:
                union = int(plan.pending_union.value()[0])
                plan.union_density = union / max(plan.rows, 1)
                plan.pending_union = None
                if plan.algorithm == "allgather":   # hash owners share the union about evenly
                    plan.owner_unions.append(math.ceil(union / plan.world * UNION_SKEW))
                    self._set_capacities(plan, plan.world)
        if self._pending is not None:
            names, counts = self._pending
            self._pending = None
            for name, count in zip(names, counts.value()):
                self._measured(self.plans[name], int(count))

    def record(self, param_or_name, result: RowsResult) -> None:
        """What a rows call saw (the same on every rank): next capacities, the path, the counts."""
        plan = self.plans[self._name(param_or_name)]
        world = max(len(result.counts), 1)
        per_owner = max((max(row) for row in result.owner_counts if row), default=0)
        plan.rows_calls += 1
        plan.world = world
        plan.overflow_rounds += result.overflow_rounds
        plan.algorithm = result.algorithm
        plan.density = max(result.counts, default=0) / max(plan.rows, 1)
        plan.seen.append((max(result.counts, default=0), per_owner))
        if result.algorithm == "scatter":   # each owner sums its own rows: no union to plan for
            pass
        elif result.owner_unions:   # hashed: each owner's rows (host ints; after an overflow, a lower bound)
            plan.owner_unions.append(max(result.owner_unions))
            plan.union_density = sum(result.owner_unions) / max(plan.rows, 1)
        else:   # allgather: the union is a device count, read at the next step (begin_step)
            plan.pending_union = LazyRead(result.union)
        self._set_capacities(plan, world)
        if not self._cheaper(plan, world) and world > 1:
            plan.path = "dense"

    def observe(self, param_or_name, grad: torch.Tensor) -> None:
        """On a measuring step, count a dense-path parameter's nonzero rows (on the device)."""
        name = self._name(param_or_name)
        if self.plans[name].path == "dense" and self.measuring() and grad is not None:
            self._observed[name] = nonzero_rows(grad.reshape(grad.shape[0], -1)).sum()

    def observe_count(self, param_or_name, count: torch.Tensor) -> None:
        """As :meth:`observe`, with the nonzero rows already counted (a 0-d device tensor: FSDP2's
        reduce-scatter input holds the gradient as ``P`` strided chunks)."""
        name = self._name(param_or_name)
        if self.plans[name].path == "dense" and self.measuring():
            self._observed[name] = count

    def end_step(self) -> None:
        """Start the max over the ranks of this step's measurements (not waited for); next step."""
        if self._observed:
            names = sorted(self._observed)
            counts = torch.stack([self._observed[n] for n in names]).to(torch.int64)
            work = None
            if _world(self.group) > 1:
                work = dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            self._pending = (names, LazyRead(counts, work))
            self._observed = {}
        self.step += 1

    def _measured(self, plan: RowPlan, count: int) -> None:
        """A dense-path parameter's largest count over the ranks: back to rows where they are cheaper."""
        world = _world(self.group)
        plan.density = count / max(plan.rows, 1)
        plan.seen.clear()
        plan.owner_unions.clear()
        plan.seen.append((count, count))
        # the union is unknown here: plan as if no row were shared (the largest union, k * P)
        plan.owner_unions.append(math.ceil(min(plan.rows, count * world) / world * UNION_SKEW))
        self._set_capacities(plan, world)
        if world > 1 and self._cheaper(plan, world, self.return_margin):
            plan.path = "rows"

    def _cheaper(self, plan: RowPlan, world: int, margin: float = 1.0) -> bool:
        """Whether the rows' message at the plan's capacities beats the dense collective's bytes."""
        if self.collective == "reduce_scatter":
            return scatter_cheaper(world, plan.rows, plan.dim, plan.dtype, plan.owner_capacity, margin)
        return rows_cheaper(world, plan.rows, plan.dim, plan.dtype, plan.capacity, plan.owner_capacity,
                            plan.union_capacity, margin)

    def _set_capacities(self, plan: RowPlan, world: int) -> None:
        if not plan.seen:
            return
        room = 1.0 + self.headroom
        count, per_owner = (max(s[i] for s in plan.seen) for i in range(2))
        # an owner sums at least the most one rank sends it; with no union seen yet, at most what
        # all ranks send it
        union = max(max(plan.owner_unions), per_owner) if plan.owner_unions else min(plan.rows, per_owner * world)
        plan.capacity = min(capacity_ladder(count * room), plan.rows)
        plan.owner_capacity = min(capacity_ladder(per_owner * room), plan.rows)
        # (reduce_scatter: every owner sums only its own rows, no union to hold)
        scatter = self.collective == "reduce_scatter"
        plan.union_capacity = 0 if scatter else min(capacity_ladder(union * room), plan.rows)

    def drop(self, names: Iterable[str]) -> None:
        """Stop tracking ``names`` (a hook that compresses them instead: ``sparse_rows="auto"``
        under DDP keeps a parameter found dense at its first compressed step in its units)."""
        for name in list(names):
            if name in self.plans:
                p = self._params.pop(name)
                del self.plans[name]
                self._by_id.pop(id(p), None)
                self._observed.pop(name, None)

    def any_rows(self, names: Iterable[str] | None = None) -> bool:
        """Whether some tracked parameter (of ``names``, default all) takes the rows path now."""
        return any(self.plans[n].path == "rows" for n in (self.plans if names is None else names) if n in self.plans)

    def memory_bytes(self) -> int:
        """Bytes kept between steps: the measurements and counts still to be read (a few int64)."""
        kept = [p.pending_union._host for p in self.plans.values() if p.pending_union is not None]
        if self._pending is not None:
            kept.append(self._pending[1]._host)
        kept.extend(self._observed.values())
        return sum(t.numel() * t.element_size() for t in kept)

    # ------------------------------------------------------------ reporting, checkpoints
    def as_dict(self) -> dict[str, dict[str, Any]]:
        """Per parameter name: rows, dim, declared, path, density (largest fraction of rows nonzero
        on a rank, last seen), union_density, capacities, overflow_rounds, rows_calls, algorithm."""
        return {name: plan.as_dict() for name, plan in self.plans.items()}

    def config(self) -> dict[str, Any]:
        """The static configuration, for the hooks' cross-rank fingerprint."""
        cfg = {"sparse_rows": sorted((n, p.declared) for n, p in self.plans.items()), "warmup": self.warmup,
               "recheck_every": self.recheck_every, "window": self.window, "headroom": self.headroom,
               "return_margin": self.return_margin}
        if self.collective != "allreduce":   # DDP's fingerprint as it was
            cfg["collective"] = self.collective
        return cfg

    def state_dict(self) -> dict[str, Any]:
        """Paths, capacities and counts seen (plain ints and strings: ``weights_only`` loadable)."""
        return {"step": self.step, "plans": {n: {"path": p.path, "capacity": p.capacity,
                                                 "owner_capacity": p.owner_capacity,
                                                 "union_capacity": p.union_capacity,
                                                 "overflow_rounds": p.overflow_rounds,
                                                 "seen": [list(s) for s in p.seen],
                                                 "owner_unions": list(p.owner_unions)}
                                             for n, p in self.plans.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a state naming other parameters raises ``ValueError``."""
        plans = state.get("plans", {})
        if sorted(plans) != sorted(self.plans):
            raise ValueError(f"SparseRows.load_state_dict: the state tracks {sorted(plans)}, this plan "
                             f"{sorted(self.plans)}")
        self.step = int(state.get("step", 0))
        for name, saved in plans.items():
            plan = self.plans[name]
            if saved["path"] not in PATHS:
                raise ValueError(f"SparseRows.load_state_dict: path of {name!r} must be one of {PATHS}")
            plan.path = saved["path"]
            plan.capacity, plan.owner_capacity = int(saved["capacity"]), int(saved["owner_capacity"])
            plan.union_capacity, plan.overflow_rounds = int(saved["union_capacity"]), int(saved["overflow_rounds"])
            plan.seen.clear()
            plan.seen.extend(tuple(int(v) for v in s) for s in saved["seen"])
            plan.owner_unions.clear()
            plan.owner_unions.extend(int(v) for v in saved.get("owner_unions", []))


class LazyRead:
    """A device tensor read later without stalling: on CUDA copied to pinned host memory behind an
    event now, read (the event waited for, long done by then) when :meth:`value` is called; on the
    CPU read then.  ``work``: a collective that produces the tensor (waited for first: with NCCL that
    only orders the copy after it on the stream)."""

    def __init__(self, t: torch.Tensor, work=None) -> None:
        self._work, self._event = work, None
        if t.is_cuda:
            if work is not None:
                work.wait()
                self._work = None
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = t

    def value(self) -> list:
        """The values as a flat list of Python numbers."""
        if self._work is not None:
            self._work.wait()
        if self._event is not None:
            self._event.synchronize()
        return self._host.reshape(-1).tolist()


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _select(model: nn.Module, sparse_rows: Any) -> Iterable[tuple[str, nn.Parameter, bool]]:
    """``(name, parameter, declared)`` of the parameters ``sparse_rows`` names, validated."""
    named = list(model.named_parameters())
    if sparse_rows is None:
        return []
    if isinstance(sparse_rows, str):
        if sparse_rows != "auto":
            raise ValueError(f"sparse_rows must be a list of parameters, 'auto' or None, got {sparse_rows!r}")
        return [(n, p, False) for n, p in named if p.dim() == 2 and p.requires_grad and p.is_floating_point()]
    if isinstance(sparse_rows, torch.Tensor) or not isinstance(sparse_rows, (list, tuple, set)):
        raise TypeError(f"sparse_rows must be a list of parameters, 'auto' or None, got {type(sparse_rows).__name__}")
    by_id = {id(p): n for n, p in named}
    by_name = dict(named)
    chosen: dict[str, nn.Parameter] = {}
    for i, item in enumerate(sparse_rows):
        if isinstance(item, str):
            if item not in by_name:
                raise ValueError(f"sparse_rows[{i}]: {item!r} is not a parameter name of the model")
            name = item
        elif isinstance(item, torch.Tensor) and id(item) in by_id:
            name = by_id[id(item)]
        else:
            what = (f"a tensor of shape {tuple(item.shape)}" if isinstance(item, torch.Tensor)
                    else type(item).__name__)
            raise ValueError(f"sparse_rows[{i}] ({what}) is not a parameter of the model")
        p = by_name[name]
        if p.dim() != 2:
            raise ValueError(f"sparse_rows: {name!r} has shape {tuple(p.shape)}; only 2-D parameters "
                             f"(rows x D) can go as rows")
        if not p.requires_grad or not p.is_floating_point():
            raise ValueError(f"sparse_rows: {name!r} has no gradient to send (requires_grad=False or "
                             f"dtype {p.dtype})")
        chosen[name] = p
    return [(n, p, True) for n, p in named if n in chosen]
