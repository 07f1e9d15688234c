"""DDP communication hook: compressed gradient averaging in one line.

>>> state = commpress.ddp.register(model, "topk", ratio=0.01)   # model is a DDP
>>> # or the PyTorch way:
>>> state = commpress.ddp.DDPState(model, "topk", ratio=0.01)
>>> model.register_comm_hook(state, commpress.ddp.hook)

What a step does.  Every collective is issued from a hook call itself, never
from a future callback, so any number of buckets may be in flight on gloo or
NCCL (PyTorch's ``powerSGD_hook`` deadlocks on gloo with several buckets for
that reason).

1. each bucket is scaled by ``1/world_size`` in place (as DDP's reducer does);
2. **dense part**: parameters that are 1-D (biases, norms), smaller than
   ``min_numel``, selected by ``skip(name)``, or that the compressor would send
   uncompressed anyway, are packed into one buffer with one extra element, the
   count of ranks whose bucket holds a NaN/inf, and sent in one ``all_reduce``;
3. **compressed part**: the compressible parameters are grouped into *units*
   (the compressible parameters of a bucket as DDP laid it out at the first
   compressed step; one unit per matrix for low-rank PowerSGD).  A unit runs
   through :func:`commpress.collectives.allreduce` (compress, the collective of
   its aggregation kind, decompress) as soon as all its parameters' buckets
   have arrived; a bucket's future completes when all its units are done
   (normally within its own hook call).  Units are part of the state, so the
   result does not depend on DDP's bucket layout: not on its rebuild after the
   first iteration, nor on a resumed run's other ``bucket_cap_mb``;
4. if any rank saw a NaN/inf in the step, the rest of the step is sent dense:
   the result carries the NaN/inf (so AMP's ``GradScaler`` skips the step) and
   every error-feedback residual is rolled back to its value before the step;
5. every bucket ends as the average over ranks, bitwise identical on all ranks.

During the first ``warmup_steps`` steps (at least one) each bucket is one dense
``all_reduce``, exactly DDP's default behaviour.

Notes
-----
* ``overlap=True`` (default): the hook hands each bucket to one worker thread
  per state and returns at once, so compression and communication overlap the
  rest of the backward pass as DDP's own all_reduce does.  The worker runs the
  steps above bucket by bucket in DDP's order, on a process group of its own
  (created at registration), so its collectives never interleave with those
  DDP or the user issue on the model's group; it still never waits inside a
  future callback.  A failure in the worker fails that bucket's future, which
  DDP raises from ``backward()``.  Steps with nothing to compress (warm-up, or
  identity without error feedback) skip the worker: one asynchronous
  ``all_reduce`` per bucket straight from the hook, as DDP itself does.  ``overlap=False`` (and any process group
  smaller than the world, where a dedicated group cannot be created without
  every rank) runs everything inside the hook call.  On GPU each bucket costs
  one host sync (the non-finite count).
* ``static_graph=True`` makes DDP rebuild its buckets after the second
  iteration; with ``warmup_steps=1`` the units then follow DDP's first layout
  (correct, only another grouping).  Use ``warmup_steps >= 2`` there.
* ``algorithm="auto"`` lets the collectives' calibrated cost model choose; the
  choice (and so the rounding) can differ between processes.  Fix it for runs
  that must be reproducible bitwise across restarts.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..compressors import Compressor
from .common import HookState, Timer, all_reduce_bytes, inner_compressor, tensor_bytes

log = logging.getLogger("commpress")

#: Parameters with fewer elements than this are sent dense by default.
DEFAULT_MIN_NUMEL = 1024
#: Dense steps at the start (at least 1; DDP rebuilds buckets after the first iteration).
DEFAULT_WARMUP_STEPS = 1

ENV_VERIFY = "COMMPRESS_VERIFY"

_ATTR = "_commpress_ddp_state"


class ReplicaMismatchError(RuntimeError):
    """The synchronized gradients differ across ranks (found by ``verify_every``)."""


@dataclass
class _Unit:
    """One compressed call: a key and the parameters it concatenates (in order)."""

    key: Any
    names: list[str]
    sizes: list[int]
    shape: torch.Size | None = None          # per-matrix (low-rank) units: the parameter shape
    scratch: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return sum(self.sizes)


@dataclass
class _Plan:
    """One DDP bucket as laid out now: its dense slices and its compressible parameters."""

    index: int
    param_ids: tuple[int, ...]
    names: list[str]
    dense_slices: list[tuple[int, int]]              # (offset, numel) in the bucket buffer
    compressed: list[tuple[str, int, int]]           # (name, offset, numel)
    dense_scratch: torch.Tensor | None = None


@dataclass
class _Pending:
    """A bucket whose future waits for units that span later buckets."""

    plan: _Plan
    buf: torch.Tensor
    fut: torch.futures.Future
    units: set[int]


def _unit_key(names: list[str]) -> str:
    return "ddp:%08x:%d" % (zlib.crc32("\0".join(names).encode()), len(names))


class DDPState(HookState):
    """State of the commpress DDP hook (pass it with :func:`hook` to ``register_comm_hook``).

    Parameters
    ----------
    model:
        the ``DistributedDataParallel`` model (``TypeError`` otherwise).
    compressor:
        a :class:`~commpress.Compressor` or a registry name; ``**compressor_params``
        are passed to ``commpress.get`` with a name.
    error_feedback:
        ``"auto"`` (on for biased compressors), ``True`` or ``False``.
    warmup_steps:
        dense steps at the start (clamped to at least 1).
    min_numel:
        parameters with fewer elements go dense.
    skip:
        ``skip(name) -> bool`` on the names of ``model.module.named_parameters()``;
        ``True`` sends that parameter dense.
    algorithm:
        passed to :func:`commpress.collectives.allreduce` (``"auto"``: cost model,
        calibrated once at registration).  Pass a fixed algorithm for results
        that are reproducible across processes.
    process_group:
        defaults to the model's process group.
    verify_every:
        every N steps hash each synchronized bucket on all ranks and raise
        :class:`ReplicaMismatchError` naming the bucket on a mismatch (one
        ``all_gather`` of an int64 per bucket); ``None`` reads the environment
        variable ``COMMPRESS_VERIFY`` (0 = off).  Verify mode runs synchronously
        (no overlap) so that a mismatch raises :class:`ReplicaMismatchError`.
    seed:
        seeds the per-rank generator for stochastic rounding.
    dense_1d:
        send 1-D parameters (biases, norm weights) dense (default ``True``).
    overlap:
        run compression and communication on a worker thread (with a process
        group of its own) so they overlap the backward pass (default ``True``).
        A failure there reaches ``backward()`` as a ``RuntimeError`` naming the
        original exception, which is kept in ``state.last_error``.

    Registration exchanges a configuration fingerprint (compressor, parameters,
    options, world size, parameter names/shapes/policy): ``ValueError`` on every
    rank when they differ.
    """

    kind = "ddp"

    def __init__(self, model: DistributedDataParallel, compressor: Compressor | str, *,
                 error_feedback: bool | str = "auto", warmup_steps: int = DEFAULT_WARMUP_STEPS,
                 min_numel: int = DEFAULT_MIN_NUMEL, skip: Callable[[str], bool] | None = None,
                 algorithm: str = "auto", process_group: dist.ProcessGroup | None = None,
                 verify_every: int | None = None, seed: int = 0, dense_1d: bool = True,
                 overlap: bool = True, **compressor_params: Any) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(
                "model must be a torch.nn.parallel.DistributedDataParallel, got "
                f"{type(model).__name__} (wrap it in DDP first; use commpress.fsdp for FSDP2)"
            )
        if getattr(model, _ATTR, None) is not None:
            raise RuntimeError("a commpress DDP hook is already registered on this model "
                               "(DDP allows one comm hook per model)")
        for name, value in (("warmup_steps", warmup_steps), ("min_numel", min_numel), ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if skip is not None and not callable(skip):
            raise TypeError(f"skip must be a callable name -> bool or None, got {type(skip).__name__}")
        if not isinstance(algorithm, str):
            raise TypeError(f"algorithm must be a string, got {type(algorithm).__name__}")
        if verify_every is None:
            env = os.environ.get(ENV_VERIFY, "0").strip() or "0"
            try:
                verify_every = int(env)
            except ValueError:
                raise ValueError(f"environment variable {ENV_VERIFY} must be an integer, got {env!r}") from None
        if isinstance(verify_every, bool) or not isinstance(verify_every, int) or verify_every < 0:
            raise ValueError(f"verify_every must be an integer >= 0, got {verify_every!r}")
        if process_group is None:
            process_group = getattr(model, "process_group", None)
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {type(overlap).__name__}")
        super().__init__(compressor, error_feedback=error_feedback, process_group=process_group,
                         **compressor_params)
        self.warmup_steps = max(1, warmup_steps)
        self.min_numel = min_numel
        self.algorithm = algorithm
        self.verify_every = verify_every
        self.seed = seed
        self.dense_1d = bool(dense_1d)
        self._worker: _Worker | None = None
        self._names: dict[int, str] = {}
        self._shapes: dict[str, torch.Size] = {}
        self.dense_param_names: list[str] = []
        self.compressed_param_names: list[str] = []
        inner = inner_compressor(self.codec)
        self._inner = inner
        self._lowrank = inner.aggregation == "lowrank"
        for name, p in model.module.named_parameters():
            if not p.requires_grad:
                continue
            self._names[id(p)] = name
            self._shapes[name] = p.shape
            if self._goes_dense(name, p, skip, inner):
                self.dense_param_names.append(name)
            else:
                self.compressed_param_names.append(name)
        self._dense_set = set(self.dense_param_names)
        self._plans: dict[int, _Plan] = {}
        self._units: list[_Unit] = []               # fixed once created (or loaded)
        self._unit_of: dict[str, int] = {}
        self._ready: dict[str, tuple[torch.Tensor, int, int]] = {}   # this step: name -> (buf, off, n)
        self._pending: list[_Pending] = []
        self._done_units: set[int] = set()
        self._generators: dict[torch.device, torch.Generator] = {}
        self._snapshots: dict[tuple[int, Any], torch.Tensor] = {}    # residuals at the start of the step
        self._step_keys: list[tuple[Compressor, Any, bool]] = []
        self._step_nonfinite = False
        self._step_sent = 0
        self._mem_dirty = True
        self.check_config()
        # After the fingerprint check (a collective on the model's group): the hook's own
        # group.  Verify mode runs in the hook call, so a mismatch raises ReplicaMismatchError.
        self.process_group, self._worker = _overlap_group(self.process_group, overlap and not verify_every)
        self.overlap = self._worker is not None
        self.last_error: BaseException | None = None
        if algorithm == "auto" and inner.aggregation in ("sparse", "gather") and self.world_size > 1:
            # Calibrate the collectives' cost model now (a collective), not inside the first
            # backward: keeps the per-step stats to what the steps send.
            from ..collectives import get_cost_model

            get_cost_model(self.process_group)
        setattr(model, _ATTR, self)

    def close(self) -> None:
        """Stop the overlap worker thread (the hook must not run afterwards)."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    # -- policy ----------------------------------------------------------
    def _goes_dense(self, name: str, p: torch.Tensor, skip: Callable[[str], bool] | None,
                    inner: Compressor) -> bool:
        if (self.dense_1d and p.dim() <= 1) or p.numel() < self.min_numel:
            return True
        if inner.name == "identity" and not self.uses_error_feedback:
            return True  # nothing to compress: one dense all_reduce, exactly DDP's
        if skip is not None and skip(name):
            return True
        is_compressed = getattr(inner, "is_compressed", None)
        if is_compressed is not None and not is_compressed(torch.empty(p.shape, device="meta")):
            return True
        return False

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg.update(
            warmup_steps=self.warmup_steps, min_numel=self.min_numel, algorithm=self.algorithm,
            verify_every=self.verify_every, seed=self.seed, dense_1d=self.dense_1d,
            params={n: list(s) for n, s in self._shapes.items()},
            dense_params=sorted(self.dense_param_names),
        )
        return cfg

    # -- bucket plans and units -------------------------------------------
    def _plan(self, bucket: dist.GradBucket) -> _Plan:
        index = bucket.index()
        params = bucket.parameters()
        ids = tuple(id(p) for p in params)
        plan = self._plans.get(index)
        if plan is not None and plan.param_ids == ids:
            return plan
        if plan is not None:
            log.info("commpress ddp: bucket %d changed layout (DDP bucket rebuild)", index)
        names, dense, compressed = [], [], []
        offset = 0
        for p in params:
            name = self._names.get(id(p))
            if name is None:
                raise RuntimeError(f"bucket {index} holds a parameter of shape {tuple(p.shape)} "
                                   "that the model did not have at registration")
            names.append(name)
            if name in self._dense_set:
                dense.append((offset, p.numel()))
            else:
                compressed.append((name, offset, p.numel()))
            offset += p.numel()
        plan = _Plan(index=index, param_ids=ids, names=names, dense_slices=dense, compressed=compressed)
        self._plans[index] = plan
        return plan

    def _assign_units(self, plan: _Plan) -> None:
        """Parameters of ``plan`` without a unit get one (the bucket's set; per matrix for low-rank)."""
        fresh = [(nm, n) for nm, _, n in plan.compressed if nm not in self._unit_of]
        if not fresh:
            return
        groups = [[x] for x in fresh] if self._lowrank else [fresh]
        for group in groups:
            names = [nm for nm, _ in group]
            key = names[0] if self._lowrank else _unit_key(names)
            unit = _Unit(key=key, names=names, sizes=[n for _, n in group],
                         shape=self._shapes[names[0]] if self._lowrank else None)
            for nm in names:
                self._unit_of[nm] = len(self._units)
            self._units.append(unit)
        self._mem_dirty = True

    def _residual_slots(self, unit: _Unit) -> list[tuple[Compressor, Any]]:
        """(error feedback, key) of every residual a unit's allreduce updates."""
        slots: list[tuple[Compressor, Any]] = []
        if self.uses_error_feedback:
            if self._inner.aggregation == "gather" and self.world_size > 1:
                slots += [(self.codec, (unit.key, r)) for r in range(self.world_size)]
            else:
                slots.append((self.codec, (unit.key, 0) if self._inner.aggregation == "gather" else unit.key))
        owner = self._owner_feedback()
        if owner is not None:
            slots.append((owner, (unit.key, self.rank)))
        return slots

    def _owner_feedback(self) -> Compressor | None:
        if self._inner.aggregation != "gather" or self._inner.unbiased or self.world_size == 1:
            return None
        from ..collectives import owner_feedback

        return owner_feedback(self.codec)

    def residuals_by_param(self) -> dict[str, torch.Tensor]:
        """The worker-side error-feedback residual of each compressed parameter (flat copies).

        Empty without error feedback or before the first compressed step.  (The
        owner-side residuals of two-phase quantized allreduce cover chunks, not
        parameters; they are in :meth:`state_dict`.)
        """
        if not self.uses_error_feedback:
            return {}
        out: dict[str, torch.Tensor] = {}
        for unit in self._units:
            parts = [ef.residual(key) for ef, key in self._residual_slots(unit) if ef is self.codec]
            if not parts or any(p is None for p in parts):
                continue
            flat = torch.cat([p.reshape(-1) for p in parts])
            pos = 0
            for nm, n in zip(unit.names, unit.sizes):
                out[nm] = flat[pos:pos + n].clone()
                pos += n
        return out

    def _generator(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed * 1_000_003 + self.rank)
            self._generators[device] = g
        return g

    # -- checkpoints -----------------------------------------------------------
    def _extra_state_dict(self) -> dict[str, Any]:
        owner = self._owner_feedback()
        return {
            "units": [{"key": u.key, "names": list(u.names), "sizes": list(u.sizes)} for u in self._units],
            "owner_feedback": owner.state_dict() if owner is not None else {},
            "generators": {str(d): g.get_state() for d, g in self._generators.items()},
        }

    def _load_extra_state_dict(self, extra: dict[str, Any], state: dict[str, Any]) -> None:
        units = []
        for u in extra.get("units", []):
            names, sizes = [str(n) for n in u["names"]], [int(n) for n in u["sizes"]]
            for nm, n in zip(names, sizes):
                if nm not in self._shapes or self._shapes[nm].numel() != n or nm in self._dense_set:
                    raise ValueError(f"checkpoint unit for parameter {nm!r} ({n} elements) does not "
                                     "match this model's compressed parameters")
            units.append(_Unit(key=u["key"], names=names, sizes=sizes,
                               shape=self._shapes[names[0]] if self._lowrank else None))
        self._units = units
        self._unit_of = {nm: i for i, u in enumerate(units) for nm in u.names}
        owner = self._owner_feedback()
        if owner is not None and extra.get("owner_feedback"):
            owner.load_state_dict(extra["owner_feedback"])
        self._generators = {}
        for dev, gstate in extra.get("generators", {}).items():
            self._generator(torch.device(dev)).set_state(gstate)
        self._mem_dirty = True

    # -- memory ----------------------------------------------------------
    def _memory_bytes(self) -> int:
        def nb(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        scratch = sum(nb(p.dense_scratch) for p in self._plans.values())
        scratch += sum(nb(u.scratch) for u in self._units)
        scratch += sum(nb(t) for t in self._snapshots.values())
        owner = self._owner_feedback()
        extra = tensor_bytes(owner.state_dict()) if owner is not None else 0
        return scratch + extra + tensor_bytes(self.codec.state_dict())


# ---------------------------------------------------------------------------- helpers
def _scale_(buf: torch.Tensor, world: int) -> None:
    # What DDP's reducer does without a hook: multiply by 1/world (a bucket-dtype scalar).
    if world > 1:
        buf.mul_(1.0 / world)


def _gather(buf: torch.Tensor, slices: list[tuple[int, int]], out: torch.Tensor) -> None:
    pos = 0
    for off, n in slices:
        out[pos:pos + n].copy_(buf[off:off + n])
        pos += n


def _scatter(buf: torch.Tensor, slices: list[tuple[int, int]], src: torch.Tensor) -> None:
    pos = 0
    for off, n in slices:
        buf[off:off + n].copy_(src[pos:pos + n])
        pos += n


def _unit_pieces(state: DDPState, unit: _Unit) -> list[tuple[torch.Tensor, int, int]]:
    return [state._ready[nm] for nm in unit.names]


def _unit_view(pieces: list[tuple[torch.Tensor, int, int]]) -> torch.Tensor | None:
    """The unit's input as a view of one bucket buffer when its pieces are adjacent there."""
    buf, start, pos = pieces[0][0], pieces[0][1], pieces[0][1]
    for b, off, n in pieces:
        if b is not buf or off != pos:
            return None
        pos += n
    return buf[start:pos]


def _unit_input(unit: _Unit, pieces: list[tuple[torch.Tensor, int, int]]) -> tuple[torch.Tensor, bool]:
    """(input tensor, is_view).  Copies into the unit's scratch (allocated once) when needed."""
    view = _unit_view(pieces)
    if view is not None:
        t, is_view = view, True
    else:
        ref = pieces[0][0]
        if unit.scratch is None or unit.scratch.dtype != ref.dtype or unit.scratch.device != ref.device:
            unit.scratch = torch.empty(unit.numel, dtype=ref.dtype, device=ref.device)
        pos = 0
        for b, off, n in pieces:
            unit.scratch[pos:pos + n].copy_(b[off:off + n])
            pos += n
        t, is_view = unit.scratch, False
    return (t.view(unit.shape) if unit.shape is not None else t), is_view


def _unit_store(pieces: list[tuple[torch.Tensor, int, int]], result: torch.Tensor) -> None:
    flat = result.reshape(-1)
    pos = 0
    for b, off, n in pieces:
        b[off:off + n].copy_(flat[pos:pos + n])
        pos += n


def _compressed_allreduce(state: DDPState, tensor: torch.Tensor, key: Any) -> tuple[torch.Tensor, int, str]:
    """Sum of ``tensor`` over ranks through the codec: (sum, bytes sent, algorithm)."""
    from ..collectives import CommStats, allreduce

    cs = CommStats()
    out = allreduce(tensor, state.codec, group=state.process_group, key=key, step=state.step,
                    algorithm=state.algorithm, stats=cs, generator=state._generator(tensor.device))
    return out, cs.bytes_sent, cs.last_algorithm or state._inner.aggregation


def _hash_tensor(t: torch.Tensor) -> int:
    data = t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def _verify(state: DDPState, plan: _Plan, buf: torch.Tensor) -> int:
    h = torch.tensor([_hash_tensor(buf)], dtype=torch.int64, device=buf.device)
    out = [torch.empty_like(h) for _ in range(state.world_size)]
    dist.all_gather(out, h, group=state.process_group)
    hashes = [int(x.item()) for x in out]
    if any(x != hashes[0] for x in hashes):
        bad = [r for r, x in enumerate(hashes) if x != hashes[0]]
        shown = ", ".join(plan.names[:6]) + (" ..." if len(plan.names) > 6 else "")
        raise ReplicaMismatchError(
            f"commpress verify: synchronized gradients of DDP bucket {plan.index} "
            f"(parameters {shown}) differ across ranks at step {state.step}: ranks {bad} "
            "disagree with rank 0"
        )
    return h.numel() * h.element_size() * (state.world_size - 1)


def _snapshot(state: DDPState, unit: _Unit) -> None:
    """Keep the unit's residuals as they were before this step (buffers allocated once)."""
    for ef, key in state._residual_slots(unit):
        r = ef.residual(key)
        if r is None:
            state._step_keys.append((ef, key, False))
            continue
        sk = (id(ef), key)
        snap = state._snapshots.get(sk)
        if snap is None or snap.shape != r.shape or snap.device != r.device:
            snap = state._snapshots[sk] = torch.empty_like(r)
            state._mem_dirty = True
        snap.copy_(r)
        state._step_keys.append((ef, key, True))


def _rollback(state: DDPState) -> None:
    for ef, key, existed in state._step_keys:
        r = ef.residual(key)
        if r is None:
            continue
        if existed:
            r.copy_(state._snapshots[(id(ef), key)])
        else:
            r.zero_()
    if state._step_keys:
        log.info("commpress ddp: non-finite gradients at step %d; residuals of this step rolled back",
                 state.step)
    state._step_keys.clear()


# ---------------------------------------------------------------------------- hook
def hook(state: DDPState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP comm hook: average ``bucket`` over ranks, compressed (see the module docs).

    Wire per bucket: one ``all_reduce`` of the dense part plus a one-element
    non-finite count, then the compressed payloads of
    :func:`commpress.collectives.allreduce` for the units that became complete;
    during warm-up one dense ``all_reduce`` of the whole bucket.  Returns a
    future holding the bucket buffer overwritten with the average, completed in
    this call or in the hook call of a later bucket of the same step.
    """
    if not isinstance(state, DDPState):
        raise TypeError(f"commpress.ddp.hook needs a commpress.ddp.DDPState, got {type(state).__name__}")
    if state._worker is not None and (state.step < state.warmup_steps or not state.compressed_param_names):
        return _dense_async(state, bucket)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    view = _BucketView(bucket)
    if state._worker is not None:
        state._worker.submit(state, view, fut)
    else:
        _run_bucket(state, view, fut, raise_errors=True)
    return fut


def _dense_async(state: DDPState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A step with no compressed bucket (warm-up, or nothing to compress): DDP's own
    path, one asynchronous ``all_reduce`` per bucket issued from the hook call, with
    no worker hand-off.  The callback only returns the buffer (no collective)."""
    with Timer() as total:
        buf = bucket.buffer()
        plan = state._plan(bucket)
        dense_bytes = all_reduce_bytes(buf.numel() * buf.element_size(), state.world_size)
        _scale_(buf, state.world_size)
        work = dist.all_reduce(buf, group=state.process_group, async_op=True)
    state.stats.record(plan.index, bytes_sent=dense_bytes, dense_bytes=dense_bytes, algorithm="dense",
                       compress_seconds=0.0, hook_seconds=total.seconds)
    if bucket.is_last():
        _end_step(state)
    return work.get_future().then(lambda _: buf)


def _run_bucket(state: DDPState, bucket: "_BucketView", fut: torch.futures.Future,
                raise_errors: bool = False) -> None:
    try:
        _hook(state, bucket, fut)
    except BaseException as exc:
        pending = [p.fut for p in state._pending if p.fut is not fut]
        _reset_step(state)  # a failed step leaves nothing half-done for the next one
        if raise_errors:
            raise
        state.last_error = exc
        # DDP re-raises a future's exception from backward() as a RuntimeError; keep
        # the original type and message readable in it (the object is state.last_error).
        err = RuntimeError(f"commpress ddp hook failed on bucket {bucket.index()}: "
                           f"{type(exc).__name__}: {exc}")
        for f in [fut, *pending]:
            if not f.done():
                f.set_exception(err)


class _BucketView:
    """What the hook needs from a ``GradBucket``, captured in the hook call."""

    __slots__ = ("_index", "_buffer", "_parameters", "_last")

    def __init__(self, bucket: dist.GradBucket) -> None:
        self._index = bucket.index()
        self._buffer = bucket.buffer()
        self._parameters = bucket.parameters()
        self._last = bucket.is_last()

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return self._parameters

    def is_last(self) -> bool:
        return self._last


class _Worker:
    """One daemon thread that runs the buckets of a state in DDP's order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="commpress-ddp", daemon=True)
        self._thread.start()

    def submit(self, state: DDPState, bucket: _BucketView, fut: torch.futures.Future) -> None:
        self._queue.put((state, bucket, fut))

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            item = self._queue.get()
            if item is None:
                return
            _run_bucket(*item)

    def close(self) -> None:
        self._queue.put(None)


def _overlap_group(process_group: dist.ProcessGroup | None, overlap: bool
                   ) -> tuple[dist.ProcessGroup | None, _Worker | None]:
    """The group the hook's collectives use and its worker (``None``: synchronous)."""
    if not overlap or not dist.is_initialized():
        return process_group, None
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return process_group, None
    if dist.get_world_size(group) != dist.get_world_size():
        log.info("commpress ddp: overlap needs a process group spanning the world (a dedicated "
                 "group is created on every rank); running synchronously")
        return process_group, None
    ranks = dist.get_process_group_ranks(group)
    own = dist.new_group(ranks=ranks, backend=dist.get_backend(group), timeout=_group_timeout(group))
    return own, _Worker()


def _group_timeout(group: dist.ProcessGroup) -> Any:
    """The timeout ``group`` was created with (``None``, torch's default, when it cannot be read).

    The hook's own group must fail as fast as the user's: a hung peer otherwise
    blocks the worker for torch's default (30 minutes) instead of the user's timeout.
    """
    try:
        device = torch.device("cuda") if dist.get_backend(group) == "nccl" else torch.device("cpu")
        return group._get_backend(device).options._timeout
    except Exception:  # noqa: BLE001 - private API; fall back to torch's default
        log.debug("commpress ddp: cannot read the process group's timeout; using torch's default")
        return None


def _reset_step(state: DDPState) -> None:
    state._pending.clear()
    state._ready.clear()
    state._done_units.clear()
    state._step_keys.clear()
    state._step_nonfinite = False


def _hook(state: DDPState, bucket: _BucketView, fut: torch.futures.Future) -> None:
    with Timer() as total:
        buf = bucket.buffer()
        world = state.world_size
        plan = state._plan(bucket)
        dense_bytes = all_reduce_bytes(buf.numel() * buf.element_size(), world)
        _scale_(buf, world)
        compress_s = 0.0
        if state.step < state.warmup_steps or not plan.compressed or world == 1:
            if world > 1:
                dist.all_reduce(buf, group=state.process_group)
            sent, algorithm = dense_bytes, "dense"
            finished = [_Pending(plan, buf, fut, set())]
        else:
            sent, algorithm, compress_s, finished = _sync_compressed(state, plan, buf, fut)
        for done in finished:
            if state.verify_every and world > 1 and state.step % state.verify_every == 0:
                sent += _verify(state, done.plan, done.buf)
    state.stats.record(plan.index, bytes_sent=sent, dense_bytes=dense_bytes, algorithm=algorithm,
                       compress_seconds=compress_s, hook_seconds=total.seconds)
    if bucket.is_last():
        _end_step(state)  # before the last future completes: backward() returns on a finished step
    for done in finished:
        done.fut.set_result(done.buf)


# DDP inspects the annotations (which `from __future__ import annotations` turns into strings).
hook.__annotations__.update(state=DDPState, bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]})


def _end_step(state: DDPState) -> None:
    if state._pending:
        # cannot happen with DDP (every parameter is in some bucket of every step)
        names = [p.plan.index for p in state._pending]
        state._pending.clear()
        raise RuntimeError(f"commpress ddp: buckets {names} still wait for parameters at the end of the step")
    state.step += 1
    _reset_step(state)
    if state._mem_dirty:
        state.stats.memory_overhead_bytes = state._memory_bytes()
        state._mem_dirty = False
    state.stats.end_step()


def _sync_compressed(state: DDPState, plan: _Plan, buf: torch.Tensor,
                     fut: torch.futures.Future) -> tuple[int, str, float, list[_Pending]]:
    world, group = state.world_size, state.process_group
    # 1. dense part + the count of ranks with a NaN/inf in this bucket
    n_dense = sum(n for _, n in plan.dense_slices)
    if plan.dense_scratch is None or plan.dense_scratch.dtype != buf.dtype or plan.dense_scratch.device != buf.device:
        plan.dense_scratch = torch.empty(n_dense + 1, dtype=buf.dtype, device=buf.device)
        state._mem_dirty = True
    scratch = plan.dense_scratch
    _gather(buf, plan.dense_slices, scratch)
    scratch[n_dense] = (~torch.isfinite(buf)).any().to(buf.dtype)
    dist.all_reduce(scratch, group=group)
    sent = all_reduce_bytes(scratch.numel() * scratch.element_size(), world)
    _scatter(buf, plan.dense_slices, scratch)
    if bool(scratch[n_dense] != 0) and not state._step_nonfinite:
        state._step_nonfinite = True
        _rollback(state)
    # 2. the units that this bucket completes
    state._assign_units(plan)
    for nm, off, n in plan.compressed:
        state._ready[nm] = (buf, off, n)
    mine = {state._unit_of[nm] for nm, _, _ in plan.compressed} - state._done_units
    state._pending.append(_Pending(plan, buf, fut, mine))
    runnable = sorted(i for i in {state._unit_of[nm] for nm, _, _ in plan.compressed}
                      if i not in state._done_units
                      and all(nm in state._ready for nm in state._units[i].names))
    algorithms = []
    with Timer() as t_c:
        for i in runnable:
            unit = state._units[i]
            pieces = _unit_pieces(state, unit)
            t, is_view = _unit_input(unit, pieces)
            if state._step_nonfinite:
                # Some rank has a NaN/inf in this step: send dense so the result carries
                # it (GradScaler skips the step); residuals stay as before the step.
                dist.all_reduce(t, group=group)
                nbytes, algorithm, out = all_reduce_bytes(t.numel() * t.element_size(), world), \
                    "dense(non-finite)", t
            else:
                _snapshot(state, unit)
                out, nbytes, algorithm = _compressed_allreduce(state, t, unit.key)
            if not (is_view and out is t):
                _unit_store(pieces, out)
            sent += nbytes
            algorithms.append(algorithm)
            state._done_units.add(i)
    finished = []
    for pend in list(state._pending):
        pend.units -= state._done_units
        if not pend.units:
            state._pending.remove(pend)
            finished.append(pend)
    algorithm = "+".join(sorted(set(algorithms))) or "waiting"
    return sent, algorithm, (0.0 if state._step_nonfinite else t_c.seconds), finished


def register(model: DistributedDataParallel, compressor: Compressor | str, *,
             error_feedback: bool | str = "auto", warmup_steps: int = DEFAULT_WARMUP_STEPS,
             min_numel: int = DEFAULT_MIN_NUMEL, skip: Callable[[str], bool] | None = None,
             algorithm: str = "auto", process_group: dist.ProcessGroup | None = None,
             verify_every: int | None = None, seed: int = 0, dense_1d: bool = True,
             overlap: bool = True, **compressor_params: Any) -> DDPState:
    """Compress ``model``'s gradient averaging: build a :class:`DDPState` and
    ``model.register_comm_hook(state, hook)``.  Returns the state (``state.stats``,
    ``state.state_dict()``).  Collective: call it on every rank with the same
    arguments (checked by a fingerprint exchange; ``ValueError`` on every rank
    otherwise).  ``TypeError`` when ``model`` is not DDP; ``RuntimeError`` when a
    commpress hook is already registered on it.
    """
    state = DDPState(model, compressor, error_feedback=error_feedback, warmup_steps=warmup_steps,
                     min_numel=min_numel, skip=skip, algorithm=algorithm, process_group=process_group,
                     verify_every=verify_every, seed=seed, dense_1d=dense_1d, overlap=overlap,
                     **compressor_params)
    model.register_comm_hook(state, hook)
    return state


__all__ = ["DDPState", "ReplicaMismatchError", "hook", "register", "DEFAULT_MIN_NUMEL",
           "DEFAULT_WARMUP_STEPS"]
