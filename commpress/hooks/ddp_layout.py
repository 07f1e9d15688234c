"""The DDP hook's view of the model: which parameters go dense, how buckets and
units lie.  Plain records and pure functions; no communication.

:class:`ModelLayout` holds them for one model: what the hook binds (names,
shapes, the dense set) and what it learns from DDP's buckets (plans, units).

A *plan* is one DDP bucket as laid out now: its dense slices and its
compressible parameters.  A *unit* is one compressed collective call: the
compressible parameters of a bucket as DDP laid it out at the first compressed
step, concatenated.  Units are part of the hook's state (and its checkpoints),
so the result does not depend on DDP's bucket layout: not on its rebuild after
the first iteration, nor on a resumed run's other ``bucket_cap_mb``.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..compressors import Compressor

log = logging.getLogger("commpress")


@dataclass
class Unit:
    """One compressed call: a key and the parameters it concatenates (in order)."""

    key: Any
    names: list[str]
    sizes: list[int]
    shapes: list[tuple[int, ...]]
    scratch: torch.Tensor | None = None   # the concatenated input when it is not one view

    @property
    def numel(self) -> int:
        return sum(self.sizes)


@dataclass
class Plan:
    """One DDP bucket as laid out now."""

    index: int
    param_ids: tuple[int, ...]
    names: list[str]
    dense_slices: list[tuple[int, int]]              # (offset, numel) in the bucket buffer
    compressed: list[tuple[str, int, int]]           # (name, offset, numel)
    dense_names: list[str] = field(default_factory=list)   # the parameters of dense_slices
    dense_scratch: torch.Tensor | None = None


def unit_key(names: list[str]) -> str:
    """A key naming a unit by its parameters (stable across processes and restarts)."""
    return "ddp:%08x:%d" % (zlib.crc32("\0".join(names).encode()), len(names))


def goes_dense(name: str, p: torch.Tensor, inner: Compressor, *, dense_1d: bool, min_numel: int,
               uses_error_feedback: bool, skip: Callable[[str], bool] | None) -> bool:
    """The policy: 1-D parameters (with ``dense_1d``), small ones, skipped ones, and the
    ones the compressor would send as they are anyway travel in the dense part.

    Elementwise casts (fp16, bf16: compressors that declare ``casts``) are the exception
    to ``dense_1d`` / ``min_numel``: they send every parameter of a bucket in one
    message, as PyTorch's fp16/bf16 hooks do; a separate dense collective would cost
    more than it keeps (measured: 1.59x against 1.30x DDP on a 2.2M MLP at P=2).
    """
    if inner.name == "identity" and not uses_error_feedback:
        return True  # nothing to compress: one dense all_reduce, exactly DDP's
    if skip is not None and skip(name):
        return True
    if inner.casts:
        return False
    if (dense_1d and p.dim() <= 1) or p.numel() < min_numel:
        return True
    return not inner.is_compressed(torch.empty(p.shape, device="meta"))


def make_plan(index: int, params: list[torch.Tensor], names_by_id: dict[int, str],
              dense_names: set[str]) -> Plan:
    """The plan of a bucket holding ``params`` (in DDP's order)."""
    names, dense, compressed = [], [], []
    offset = 0
    for p in params:
        name = names_by_id.get(id(p))
        if name is None:
            raise RuntimeError(f"bucket {index} holds a parameter of shape {tuple(p.shape)} "
                               "that the model did not have at registration")
        names.append(name)
        if name in dense_names:
            dense.append((offset, p.numel()))
        else:
            compressed.append((name, offset, p.numel()))
        offset += p.numel()
    return Plan(index=index, param_ids=tuple(id(p) for p in params), names=names, dense_slices=dense,
                compressed=compressed, dense_names=[nm for nm in names if nm in dense_names])


def new_unit(plan: Plan, assigned: dict[str, int], shapes: dict[str, torch.Size]) -> Unit | None:
    """A unit for the compressible parameters of ``plan`` that have none yet (``None`` if all have)."""
    fresh = [(nm, n) for nm, _, n in plan.compressed if nm not in assigned]
    if not fresh:
        return None
    names = [nm for nm, _ in fresh]
    return Unit(key=unit_key(names), names=names, sizes=[n for _, n in fresh],
                shapes=[tuple(shapes[nm]) for nm in names])


def gather_slices(buf: torch.Tensor, slices: list[tuple[int, int]], out: torch.Tensor) -> None:
    pos = 0
    for off, n in slices:
        out[pos:pos + n].copy_(buf[off:off + n])
        pos += n


def scatter_slices(buf: torch.Tensor, slices: list[tuple[int, int]], src: torch.Tensor) -> None:
    pos = 0
    for off, n in slices:
        buf[off:off + n].copy_(src[pos:pos + n])
        pos += n


def unit_input(unit: Unit, pieces: list[tuple[torch.Tensor, int, int]]) -> tuple[torch.Tensor, bool]:
    """``(input, is_view)``: a view of one bucket buffer when the unit's pieces are adjacent
    there, else the pieces copied into the unit's scratch (allocated once)."""
    buf, start, pos = pieces[0][0], pieces[0][1], pieces[0][1]
    for b, off, n in pieces:
        if b is not buf or off != pos:
            break
        pos += n
    else:
        return buf[start:pos], True
    ref = pieces[0][0]
    if unit.scratch is None or unit.scratch.dtype != ref.dtype or unit.scratch.device != ref.device:
        unit.scratch = torch.empty(unit.numel, dtype=ref.dtype, device=ref.device)
    gathered = unit.scratch
    pos = 0
    for b, off, n in pieces:
        gathered[pos:pos + n].copy_(b[off:off + n])
        pos += n
    return gathered, False


def unit_store(pieces: list[tuple[torch.Tensor, int, int]], result: torch.Tensor) -> None:
    flat = result.reshape(-1)
    pos = 0
    for b, off, n in pieces:
        b[off:off + n].copy_(flat[pos:pos + n])
        pos += n


class ModelLayout:
    """The parameters of one bound model, its bucket plans and its units.

    Built at binding (names, shapes, the dense set: fixed from then on); plans and
    units are added by the executor as buckets arrive (units once, plans again when
    DDP rebuilds its buckets).  Units are checkpointed (:meth:`units_state`).
    """

    def __init__(self, names: dict[int, str], shapes: dict[str, torch.Size], dense: set[str]) -> None:
        self.names = names
        self.shapes = shapes
        self.dense = dense
        self.plans: dict[int, Plan] = {}
        self.units: list[Unit] = []
        self.unit_of: dict[str, int] = {}

    def plan(self, index: int, params: list[torch.Tensor]) -> Plan:
        """The plan of bucket ``index`` (rebuilt when DDP changed the bucket's parameters)."""
        plan = self.plans.get(index)
        if plan is None or plan.param_ids != tuple(id(p) for p in params):
            if plan is not None:
                log.info("commpress ddp: bucket %d changed layout (DDP bucket rebuild)", index)
            plan = self.plans[index] = make_plan(index, params, self.names, self.dense)
        return plan

    def assign_units(self, plan: Plan) -> None:
        """Give the compressible parameters of ``plan`` that have no unit yet one new unit."""
        unit = new_unit(plan, self.unit_of, self.shapes)
        if unit is not None:
            for nm in unit.names:
                self.unit_of[nm] = len(self.units)
            self.units.append(unit)

    def scratch_bytes(self) -> int:
        """Bytes of the plans' and units' scratch buffers."""
        return sum(_nbytes(p.dense_scratch) for p in self.plans.values()) + sum(_nbytes(u.scratch)
                                                                              for u in self.units)

    def units_state(self) -> list[dict[str, Any]]:
        return [{"key": u.key, "names": list(u.names), "sizes": list(u.sizes)} for u in self.units]

    def load_units(self, saved: list[dict[str, Any]]) -> None:
        """Restore :meth:`units_state`; ``ValueError`` when a unit does not fit this model."""
        units = []
        for u in saved:
            names, sizes = [str(n) for n in u["names"]], [int(n) for n in u["sizes"]]
            for nm, n in zip(names, sizes):
                if nm not in self.shapes or self.shapes[nm].numel() != n or nm in self.dense:
                    raise ValueError(f"checkpoint unit for parameter {nm!r} ({n} elements) does not "
                                     "match this model's compressed parameters")
            units.append(Unit(key=u["key"], names=names, sizes=sizes,
                              shapes=[tuple(self.shapes[nm]) for nm in names]))
        self.units = units
        self.unit_of = {nm: i for i, u in enumerate(units) for nm in u.names}


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
