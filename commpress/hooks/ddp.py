"""DDP communication hook: compressed gradient averaging in one line.

>>> state = commpress.ddp.register(model, "topk", ratio=0.01)   # model is a DDP
>>> # or the PyTorch way (the state binds to the model at its first bucket):
>>> state = commpress.ddp.DDPState("topk", ratio=0.01)
>>> model.register_comm_hook(state, commpress.ddp.hook)

The pieces, each in its own module:

* :mod:`.ddp_layout` — which parameters go dense, bucket plans and units (pure);
* :mod:`.ddp_step` — one training step: the dense part, the units, the
  residual transaction (what a bucket sends: its dense part in one concurrent
  ``all_reduce`` and each completed unit's payload messages, nothing else);
* the executor below — runs a bucket in the hook call (``overlap=False``) or
  on one worker thread with a process group of its own (``overlap=True``);
* :func:`hook` — one warm-up decision, then the executor.

During the first ``warmup_steps`` steps (at least one) each bucket is one dense
asynchronous ``all_reduce`` from the hook call, exactly DDP's behaviour.

Executors and devices.  Collectives are issued from the hook call or the worker,
never from a future's callback (PyTorch's ``powerSGD_hook`` deadlocks on gloo
with several buckets for that reason).  The worker runs buckets in DDP's order
on a group of its own, so its collectives never interleave with those DDP or the
user issue.  On CUDA the worker runs on the stream that was current in the hook
call, so its kernels are ordered after the backward kernels that produced the
bucket; nothing in the steady state reads a tensor on the host.  A failure
fails the bucket's future (DDP raises it from ``backward()``, the original in
``state.last_error``) and rolls the step's residual updates back.

Binding
-------
A state built with its model binds at construction; one built without
(``DDPState("topk", ratio=0.01)``, as Lightning's ``DDPStrategy(ddp_comm_state=...)``
needs) binds in the first hook call: the first bucket of the first synchronized
step, which DDP calls on every rank, in the same order, before any other hook
collective.  Binding is collective (fingerprint exchange, the overlap group,
the cost model's calibration), so it is safe there and nowhere later.  The model
is the ``DistributedDataParallel`` that holds the bucket's parameters (found once
among the live objects; :meth:`DDPState.bind` names it explicitly).

Notes
-----
* ``overlap`` is turned off by ``verify_every`` (so a mismatch raises
  :class:`ReplicaMismatchError` from the hook) and by a process group smaller
  than the world (a dedicated group needs every rank).
* ``static_graph=True`` makes DDP rebuild its buckets after the second
  iteration; with ``warmup_steps=1`` the units then follow DDP's first layout
  (correct, only another grouping).  Use ``warmup_steps >= 2`` there.
* ``algorithm="auto"`` is decided per unit by the cost model calibrated at
  registration (a pure function of numel, capacity, P and the model), so every
  rank picks the same.  Pass a fixed algorithm for results that must be bitwise
  reproducible in another process (a new calibration may choose differently).
* ``close()`` (or ``with state:``) stops the worker and releases its group.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import queue
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..collectives.core import ALLREDUCE_ALGORITHMS
from ..compressors import Compressor
from ..compressors._util import decode_keyed, encode_keyed, mix_seed, stable_hash
from ..collectives import unwrap
from .common import HookState, Timer, all_reduce_bytes, tensor_bytes
from .ddp_layout import Plan, Unit, goes_dense, make_plan, new_unit
from .ddp_step import DenseMomentum, Step
from .optimizer import TakeoverMixin

log = logging.getLogger("commpress")

#: Parameters with fewer elements than this are sent dense by default.
DEFAULT_MIN_NUMEL = 1024
#: Dense steps at the start (at least 1; DDP rebuilds buckets after the first iteration).
DEFAULT_WARMUP_STEPS = 1

ENV_VERIFY = "COMMPRESS_VERIFY"

_ATTR = "_commpress_ddp_state"


class ReplicaMismatchError(RuntimeError):
    """The synchronized gradients differ across ranks (found by ``verify_every``)."""


class DDPState(TakeoverMixin, HookState):
    """State of the commpress DDP hook (pass it with :func:`hook` to ``register_comm_hook``).

    Parameters
    ----------
    model:
        the ``DistributedDataParallel`` model (``TypeError`` otherwise), or omitted:
        ``DDPState("topk", ratio=0.01)`` binds at its first bucket (see the module
        docs); nothing is exchanged before then, so it can be built before
        ``init_process_group``.
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
        passed to :func:`commpress.collectives.allreduce`: ``"auto"`` (cost model,
        calibrated once at registration) or one of the compressor kind's
        algorithms (``ValueError`` otherwise).
    process_group:
        defaults to the model's process group.
    verify_every:
        every N steps hash each synchronized bucket on all ranks and raise
        :class:`ReplicaMismatchError` naming the bucket on a mismatch (one
        ``all_gather`` of an int64 per bucket, read on the host); ``None`` reads
        the environment variable ``COMMPRESS_VERIFY`` (0 = off).  Runs
        synchronously (no overlap).
    seed:
        seeds stochastic rounding: each rank's noise for a unit is a pure function of
        ``(seed, rank, step, unit)``, so resumed runs draw the same noise.
    dense_1d:
        send 1-D parameters (biases, norm weights) dense (default ``True``).
    overlap:
        run compression and communication on a worker thread (with a process
        group of its own) so they overlap the backward pass (default ``True``).
    momentum:
        (a keyword passed with the compressor parameters) DGC momentum correction
        in the error feedback (``ErrorFeedback(..., momentum=)``); the parameters
        that go dense get plain momentum on their averaged gradient.  Pair it with
        ``torch.optim.SGD(..., momentum=0)``: the momentum now lives here.
    momentum_masking:
        (a keyword, with ``momentum`` or ``optimizer``) DGC's momentum factor masking:
        zero the velocity where a coordinate was sent.  Off by default (see
        :mod:`commpress.hooks.optimizer` for why).
    optimizer:
        a ``torch.optim.SGD`` whose momentum the hook takes over (DGC's recipe): its
        momentum ``m`` turns on ``momentum=m`` here and is set to 0 in the optimizer
        until :meth:`close`; Adam and SGD without momentum are left as they are (one
        log line); see :mod:`commpress.hooks.optimizer`.  An optimizer made after
        the hook: :meth:`attach_optimizer`.
    hierarchy:
        ``None`` (flat), an int ``L`` (ranks per node: every unit reduces densely
        inside its node and compresses only between nodes, see
        :mod:`commpress.collectives.hierarchy`), or ``"auto"`` (torchrun's
        ``LOCAL_WORLD_SIZE`` when ``1 < L < world``, flat or two-level per unit by the
        intra/inter cost model; flat otherwise).  Creates the node groups (collective).
        Residuals of two-level units are kept per node shard (in :meth:`state_dict`);
        :meth:`residuals_by_param` has no per-parameter view of them and leaves those units out.

    Binding exchanges a configuration fingerprint (compressor, parameters,
    options, world size, parameter names/shapes/policy): ``ValueError`` on every
    rank when they differ (from ``backward()`` when the state binds at its first
    bucket).  It is the only cross-rank check of the configuration; steps send
    their payloads only.
    """

    kind = "ddp"

    def __init__(self, model: DistributedDataParallel | Compressor | str | None = None,
                 compressor: Compressor | str | None = None, *,
                 error_feedback: bool | str = "auto", warmup_steps: int = DEFAULT_WARMUP_STEPS,
                 min_numel: int = DEFAULT_MIN_NUMEL, skip: Callable[[str], bool] | None = None,
                 algorithm: str = "auto", process_group: dist.ProcessGroup | None = None,
                 verify_every: int | None = None, seed: int = 0, dense_1d: bool = True,
                 overlap: bool = True, hierarchy: int | str | None = None,
                 optimizer: torch.optim.Optimizer | None = None,
                 **compressor_params: Any) -> None:
        if compressor is None and isinstance(model, (str, Compressor)):
            model, compressor = None, model  # DDPState("topk", ratio=0.01): bind later
        if model is not None and not isinstance(model, DistributedDataParallel):
            raise TypeError(
                "model must be a torch.nn.parallel.DistributedDataParallel, got "
                f"{type(model).__name__} (wrap it in DDP first; use commpress.fsdp for FSDP2)"
            )
        if compressor is None:
            raise TypeError("DDPState needs a compressor (a commpress.Compressor or a registry name)")
        for name, value in (("warmup_steps", warmup_steps), ("min_numel", min_numel), ("seed", seed)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if skip is not None and not callable(skip):
            raise TypeError(f"skip must be a callable name -> bool or None, got {type(skip).__name__}")
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {type(overlap).__name__}")
        verify_every = _verify_every(verify_every)
        if not (hierarchy is None or hierarchy == "auto"
                or (isinstance(hierarchy, int) and not isinstance(hierarchy, bool) and hierarchy >= 1)):
            raise ValueError(f"hierarchy must be None, 'auto' or a positive int (ranks per node), got {hierarchy!r}")
        super().__init__(compressor, error_feedback=error_feedback, process_group=process_group,
                         **compressor_params)
        self.inner = unwrap(self.codec)
        allowed = ALLREDUCE_ALGORITHMS[self.inner.aggregation]
        if algorithm not in allowed:
            raise ValueError(f"algorithm must be one of {allowed} for a {self.inner.aggregation!r} "
                             f"compressor ({self.inner.name}), got {algorithm!r}")
        self.warmup_steps = max(1, warmup_steps)
        self.min_numel = min_numel
        self.algorithm = algorithm
        self.verify_every = verify_every
        self.seed = seed
        self.dense_1d = bool(dense_1d)
        self.lowrank = self.inner.aggregation == "lowrank"
        self.dense_momentum = DenseMomentum(self.momentum) if self.momentum else None
        self._skip = skip
        self._want_overlap = overlap and not verify_every
        self.hierarchy_arg = hierarchy
        self.hierarchy = None
        self.fused_scale = False  # decided at binding
        self._names: dict[int, str] = {}
        self._shapes: dict[str, torch.Size] = {}
        self.dense_param_names: list[str] = []
        self.compressed_param_names: list[str] = []
        self._dense_set: set[str] = set()
        self._plans: dict[int, Plan] = {}
        self.units: list[Unit] = []                 # fixed once created (or loaded)
        self.unit_of: dict[str, int] = {}
        self._step: Step | None = None
        self._memory_shape: tuple[int, int] = (-1, -1)
        self.last_error: BaseException | None = None
        self.executor: _Inline | _Overlapped = _Inline()
        self.overlap = False
        self.bound = False
        self._pending_load: dict[str, Any] | None = None
        if optimizer is not None:
            self.attach_optimizer(optimizer)  # taken over at binding
        if model is not None:
            self.bind(model)

    def bind(self, model: DistributedDataParallel) -> None:
        """Attach this state to ``model``: name its parameters, decide the dense policy,
        exchange the fingerprint, create the overlap group, calibrate the cost model.

        Collective on the model's process group: every rank binds at the same point
        (at construction with a model, otherwise in the first hook call).  A state
        dict loaded before binding is checked and restored here.
        """
        if self.bound:
            raise RuntimeError("this DDPState is already bound to a model (one state per model)")
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"model must be a torch.nn.parallel.DistributedDataParallel, got {type(model).__name__}")
        if getattr(model, _ATTR, None) is not None:
            raise RuntimeError("a commpress DDP hook is already registered on this model "
                               "(DDP allows one comm hook per model)")
        if self.process_group is None:
            self.process_group = getattr(model, "process_group", None)
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size(self.process_group)
            self.rank = dist.get_rank(self.process_group)
        self._names, self._shapes = {}, {}          # from scratch: a failed binding may be retried
        self.dense_param_names, self.compressed_param_names = [], []
        for name, p in model.module.named_parameters():
            if not p.requires_grad:
                continue
            self._names[id(p)] = name
            self._shapes[name] = p.shape
            dense = goes_dense(name, p, self.inner, dense_1d=self.dense_1d, min_numel=self.min_numel,
                               uses_error_feedback=self.uses_error_feedback, skip=self._skip)
            (self.dense_param_names if dense else self.compressed_param_names).append(name)
        self._dense_set = set(self.dense_param_names)
        self._take_pending_optimizer()  # its momentum is part of the configuration
        self.check_config()
        # After the fingerprint check (a collective on the model's group): the hook's own group.
        self.process_group, self.executor = _executor(self.process_group, self._want_overlap)
        self.overlap = isinstance(self.executor, _Overlapped)
        self.hierarchy = _hierarchy(self.hierarchy_arg, self.process_group, self.world_size)
        self.fused_scale = (self.hierarchy is None and not self.uses_error_feedback
                            and getattr(self.inner, "cast_to", False) is not False)
        if self.algorithm == "auto" and self.inner.aggregation in ("sparse", "gather") and self.world_size > 1:
            from ..collectives import get_cost_model

            get_cost_model(self.process_group)  # calibrate now (a collective), not inside a step
        if self.hierarchy is not None and self.hierarchy.mode == "auto":
            self.hierarchy.models()  # likewise for the intra-node and inter-node models
        setattr(model, _ATTR, self)
        self.bound = True
        if self._pending_load is not None:
            pending, self._pending_load = self._pending_load, None
            self.load_state_dict(pending)

    def _covered_parameter_ids(self) -> set[int] | None:
        """The parameters whose momentum the hook takes over (``None`` before binding)."""
        return set(self._names) if (self.bound or self._names) else None

    def _bind_to_bucket(self, bucket: dist.GradBucket) -> None:
        """Bind to the DDP model holding ``bucket``'s parameters (the first hook call)."""
        self.bind(_model_of(bucket.parameters()))

    # -- lifetime ----------------------------------------------------------
    def close(self) -> None:
        """Stop the overlap worker and release its process group (the hook must not run afterwards);
        give a taken-over optimizer its momentum back."""
        self.executor.close()
        self.release_optimizer()

    def __enter__(self) -> "DDPState":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- layout --------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg.update(
            warmup_steps=self.warmup_steps, min_numel=self.min_numel, algorithm=self.algorithm,
            verify_every=self.verify_every, seed=self.seed, dense_1d=self.dense_1d,
            params={n: list(s) for n, s in self._shapes.items()},
            dense_params=sorted(self.dense_param_names),
        )
        if self.hierarchy_arg is not None:  # absent when flat: older checkpoints still load
            cfg["hierarchy"] = self.hierarchy_arg
        return cfg
        return cfg

    def layout(self, index: int, params: list[torch.Tensor]) -> Plan:
        """The plan of bucket ``index`` (rebuilt when DDP changed the bucket's parameters)."""
        plan = self._plans.get(index)
        if plan is None or plan.param_ids != tuple(id(p) for p in params):
            if plan is not None:
                log.info("commpress ddp: bucket %d changed layout (DDP bucket rebuild)", index)
            plan = self._plans[index] = make_plan(index, params, self._names, self._dense_set)
        return plan

    def assign_units(self, plan: Plan) -> None:
        unit = new_unit(plan, self.unit_of, self._shapes)
        if unit is not None:
            for nm in unit.names:
                self.unit_of[nm] = len(self.units)
            self.units.append(unit)

    def noise_seed(self, key: Any) -> int:
        """The seed of this rank's stochastic rounding for ``key`` at this step: a pure
        function of ``(seed, rank, step, key)`` (nothing to read, nothing to checkpoint)."""
        return mix_seed(self.seed, self.rank, self.step, stable_hash(key))

    def residuals_by_param(self) -> dict[str, torch.Tensor]:
        """The worker-side error-feedback residual of each compressed parameter (flat copies).

        Empty without error feedback or before the first compressed step.  (The
        owner-side residuals of two-phase quantized allreduce cover chunks, not
        parameters; they are in :meth:`state_dict`.)
        """
        if not self.uses_error_feedback:
            return {}
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            if self.inner.aggregation == "gather" and self.world_size > 1:
                parts = [self.codec.residual((unit.key, r)) for r in range(self.world_size)]
            else:
                parts = [self.codec.residual((unit.key, 0) if self.inner.aggregation == "gather" else unit.key)]
            if any(p is None for p in parts):
                continue
            flat = torch.cat([p.reshape(-1) for p in parts])
            pos = 0
            for nm, n in zip(unit.names, unit.sizes):
                out[nm] = flat[pos:pos + n].clone()
                pos += n
        return out

    # -- checkpoints -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if not self.bound:
            if self._pending_load is not None:
                return self._pending_load
            raise RuntimeError("this DDPState is not bound to a model yet (it binds at its first "
                               "bucket): there is no state to save before the first step")
        return super().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; before binding the state is kept and checked at binding."""
        if not self.bound:
            self._pending_load = state
            return
        super().load_state_dict(state)

    def _extra_state_dict(self) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "units": [{"key": u.key, "names": list(u.names), "sizes": list(u.sizes)} for u in self.units]}
        if self.dense_momentum is not None:
            extra["dense_velocity"] = encode_keyed(self.dense_momentum.velocity)
        return extra

    def _load_extra_state_dict(self, extra: dict[str, Any], state: dict[str, Any]) -> None:
        units = []
        for u in extra.get("units", []):
            names, sizes = [str(n) for n in u["names"]], [int(n) for n in u["sizes"]]
            for nm, n in zip(names, sizes):
                if nm not in self._shapes or self._shapes[nm].numel() != n or nm in self._dense_set:
                    raise ValueError(f"checkpoint unit for parameter {nm!r} ({n} elements) does not "
                                     "match this model's compressed parameters")
            units.append(Unit(key=u["key"], names=names, sizes=sizes,
                              shapes=[tuple(self._shapes[nm]) for nm in names]))
        self.units = units
        self.unit_of = {nm: i for i, u in enumerate(units) for nm in u.names}
        if self.dense_momentum is not None:
            saved = decode_keyed(extra.get("dense_velocity", {"keys": [], "tensors": []}), "dense velocity")
            self.dense_momentum.velocity = {k: v.float().clone() for k, v in saved.items()}

    # -- memory ----------------------------------------------------------
    def memory_bytes(self) -> int:
        """Bytes the hook keeps alive: residuals (live and pending), scratch, compressor state."""
        def nb(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        scratch = sum(nb(p.dense_scratch) for p in self._plans.values())
        scratch += sum(nb(u.scratch) for u in self.units)
        pending = sum(nb(t) for t in getattr(self.codec, "_pending", {}).values())
        return scratch + pending + tensor_bytes(self.codec.state_dict())


def _verify_every(value: int | None) -> int:
    if value is None:
        env = os.environ.get(ENV_VERIFY, "0").strip() or "0"
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"environment variable {ENV_VERIFY} must be an integer, got {env!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"verify_every must be an integer >= 0, got {value!r}")
    return value


def _model_of(params: list[torch.Tensor]) -> DistributedDataParallel:
    """The live DDP model (not bound to another commpress state) holding ``params``.

    One scan of the garbage collector's objects, once per state; every rank finds
    its own model the same way, so the binding that follows stays collective.
    """
    ids = {id(p) for p in params}
    found = []
    for obj in gc.get_objects():
        if issubclass(type(obj), DistributedDataParallel) and getattr(obj, _ATTR, None) is None:
            if any(id(p) in ids for p in obj.module.parameters()):
                found.append(obj)
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise RuntimeError(f"commpress ddp: {what} DistributedDataParallel models hold this bucket's "
                           "parameters; build the state with its model (DDPState(model, ...)) or "
                           "call state.bind(model) on every rank before the first step")
    return found[0]


# ---------------------------------------------------------------------------- executors
class _Inline:
    """Runs each bucket inside the hook call; errors raise from the hook."""

    def submit(self, state: DDPState, bucket: dist.GradBucket, fut: torch.futures.Future) -> None:
        _run(state, bucket.index(), bucket.buffer(), bucket.parameters(), bucket.is_last(), fut, None)

    def close(self) -> None:
        pass


class _Overlapped:
    """One daemon thread runs the buckets in DDP's order on the hook's own group;
    errors fail the bucket's future (DDP raises them from ``backward()``)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="commpress-ddp", daemon=True)
        self._thread.start()

    def submit(self, state: DDPState, bucket: dist.GradBucket, fut: torch.futures.Future) -> None:
        buf = bucket.buffer()
        stream = torch.cuda.current_stream(buf.device) if buf.is_cuda else None
        self._queue.put((state, bucket.index(), buf, bucket.parameters(), bucket.is_last(), fut, stream))

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            item = self._queue.get()
            if item is None:
                return
            *args, stream = item
            if stream is not None:
                with torch.cuda.stream(stream):
                    _run(*args, errors=self)
            else:
                _run(*args, errors=self)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=60)
        if self.group is not None:
            try:
                dist.destroy_process_group(self.group)
            except Exception:  # noqa: BLE001 - already gone with the default group
                log.debug("commpress ddp: the overlap group was already destroyed")
            self.group = None


def _run(state: DDPState, index: int, buf: torch.Tensor, params: list[torch.Tensor], last: bool,
         fut: torch.futures.Future, errors: _Overlapped | None) -> None:
    """One bucket of a compressed step; the one error path of both executors."""
    try:
        if state._step is None:
            state._step = Step(state)
        finished = state._step.run_bucket(index, buf, params, fut)
        if state.verify_every and state.world_size > 1 and state.step % state.verify_every == 0:
            for done in finished:
                _verify(state, done.plan, done.buf)
        if last:
            _end_step(state)
        for done in finished:
            done.fut.set_result(done.buf)
    except BaseException as exc:
        waiting = state._step.abort() if state._step is not None else []
        state._step = None
        if errors is None:
            raise
        state.last_error = exc
        # DDP re-raises a future's exception from backward() as a RuntimeError; keep
        # the original type and message readable in it (the object is state.last_error).
        err = RuntimeError(f"commpress ddp hook failed on bucket {index}: {type(exc).__name__}: {exc}")
        for f in {id(f): f for f in [fut, *waiting]}.values():
            if not f.done():
                f.set_exception(err)


def _end_step(state: DDPState) -> None:
    state._step.commit()
    state._step = None
    state.step += 1
    shape = (len(state.units), len(state._plans))
    if shape != state._memory_shape:  # buffers are allocated once: count them when they change
        state._memory_shape = shape
        state.stats.memory_overhead_bytes = state.memory_bytes()
    state.stats.end_step()


def _hierarchy(arg: int | str | None, group: dist.ProcessGroup | None, world: int):
    """The :class:`~commpress.collectives.Hierarchy` for ``register(hierarchy=arg)`` (collective), or None."""
    from ..collectives import Hierarchy

    if arg is None or world == 1:
        return None
    if arg == "auto":
        try:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
        except ValueError:
            local = 0
        h = Hierarchy(local if 1 < local < world else world, group, mode="auto")  # agreed on every rank
        return h if h.local_size < world else None
    return Hierarchy(arg, group)


def _executor(process_group: dist.ProcessGroup | None, overlap: bool):
    """The group the hook's collectives use and the executor that runs them."""
    if not overlap or not dist.is_initialized():
        return process_group, _Inline()
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return process_group, _Inline()
    if dist.get_world_size(group) != dist.get_world_size():
        log.info("commpress ddp: overlap needs a process group spanning the world (a dedicated "
                 "group is created on every rank); running synchronously")
        return process_group, _Inline()
    ranks = dist.get_process_group_ranks(group)
    own = dist.new_group(ranks=ranks, backend=dist.get_backend(group), timeout=_group_timeout(group))
    return own, _Overlapped(own)


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


def _verify(state: DDPState, plan: Plan, buf: torch.Tensor) -> None:
    """Hash the synchronized bucket on every rank; raise on a mismatch (reads on the host)."""
    data = buf.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
    digest = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)
    h = torch.tensor([digest], dtype=torch.int64, device=buf.device)
    out = [torch.empty_like(h) for _ in range(state.world_size)]
    dist.all_gather(out, h, group=state.process_group)
    hashes = [int(x.item()) for x in out]
    bad = [r for r, x in enumerate(hashes) if x != hashes[0]]
    if bad:
        shown = ", ".join(plan.names[:6]) + (" ..." if len(plan.names) > 6 else "")
        raise ReplicaMismatchError(
            f"commpress verify: synchronized gradients of DDP bucket {plan.index} "
            f"(parameters {shown}) differ across ranks at step {state.step}: ranks {bad} "
            "disagree with rank 0"
        )
    state.stats.record(plan.index, bytes_sent=8 * (state.world_size - 1), dense_bytes=0, algorithm="verify")


# ---------------------------------------------------------------------------- hook
def hook(state: DDPState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP comm hook: average ``bucket`` over ranks, compressed (see the module docs).

    Warm-up steps (and models with nothing to compress): one asynchronous dense
    ``all_reduce`` per bucket, as DDP does.  Afterwards the bucket goes to the
    executor; the returned future holds the bucket buffer overwritten with the
    average, completed when the bucket's units are done (normally with the bucket
    itself, at the latest with the last bucket of the step).
    """
    if not isinstance(state, DDPState):
        raise TypeError(f"commpress.ddp.hook needs a commpress.ddp.DDPState, got {type(state).__name__}")
    if not state.bound:  # the first bucket of the first step, on every rank: bind (collective)
        state._bind_to_bucket(bucket)
    if state.step < state.warmup_steps or not state.compressed_param_names:
        return _dense_async(state, bucket)
    if state.fused_scale and not state.verify_every:
        return _dense_async(state, bucket, cast=state.inner.cast_to)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    state.executor.submit(state, bucket, fut)
    return fut


# DDP inspects the annotations (which `from __future__ import annotations` turns into strings).
hook.__annotations__.update(state=DDPState, bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]})


def _dense_async(state: DDPState, bucket: dist.GradBucket,
                 cast: torch.dtype | None = None) -> torch.futures.Future[torch.Tensor]:
    """DDP's own path: one asynchronous ``all_reduce`` per bucket issued from the hook call.

    With ``cast`` (fp16 / bf16 without error feedback; the steady state of those
    compressors) the bucket is scaled by ``1/world`` and cast in one pass into the
    message, as PyTorch's fp16 hook does; NaN/inf travel in the values and nothing
    can fail to compress, so the message carries no status.  The callback only
    copies the sum back (no collective)."""
    with Timer() as total:
        buf = bucket.buffer()
        plan = state.layout(bucket.index(), bucket.parameters())
        dense_bytes = all_reduce_bytes(buf.numel() * buf.element_size(), state.world_size)
        sent, algorithm = dense_bytes, "dense"
        if state.world_size > 1 and cast is not None:
            message = torch.empty(buf.shape, dtype=cast, device=buf.device)
            torch.mul(buf, 1.0 / state.world_size, out=message)  # computed in buf's dtype, rounded once
            work = dist.all_reduce(message, group=state.process_group, async_op=True)
            fut = work.get_future().then(lambda _: buf.copy_(message))
            sent = all_reduce_bytes(message.numel() * message.element_size(), state.world_size)
            algorithm = "allreduce"
        elif state.world_size > 1:
            buf.mul_(1.0 / state.world_size)
            work = dist.all_reduce(buf, group=state.process_group, async_op=True)
            fut = work.get_future().then(lambda _: buf)
        else:
            fut = torch.futures.Future()
            fut.set_result(buf)
    state.stats.record(plan.index, bytes_sent=sent, dense_bytes=dense_bytes, algorithm=algorithm,
                       compress_seconds=0.0, hook_seconds=total.seconds)
    if bucket.is_last():
        state.step += 1
        state.stats.end_step()
    return fut


def register(model: DistributedDataParallel, compressor: Compressor | str, *,
             error_feedback: bool | str = "auto", warmup_steps: int = DEFAULT_WARMUP_STEPS,
             min_numel: int = DEFAULT_MIN_NUMEL, skip: Callable[[str], bool] | None = None,
             algorithm: str = "auto", process_group: dist.ProcessGroup | None = None,
             verify_every: int | None = None, seed: int = 0, dense_1d: bool = True,
             overlap: bool = True, hierarchy: int | str | None = None,
             optimizer: torch.optim.Optimizer | None = None,
             **compressor_params: Any) -> DDPState:
    """Compress ``model``'s gradient averaging: build a :class:`DDPState` and
    ``model.register_comm_hook(state, hook)``.  Returns the state (``state.stats``,
    ``state.state_dict()``, ``state.close()``).  Collective: call it on every rank
    with the same arguments (checked by a fingerprint exchange; ``ValueError`` on
    every rank otherwise).  ``TypeError`` when ``model`` is not DDP; ``RuntimeError``
    when a commpress hook is already registered on it; ``ValueError`` for an
    algorithm the compressor's kind does not have.

    ``optimizer=opt`` (a ``torch.optim.SGD`` with momentum): the hook takes over its
    momentum, DGC's recipe for reaching DDP's step count with a sparsifier (momentum
    correction here, the optimizer's momentum 0 until ``state.close()``; see
    :mod:`commpress.hooks.optimizer`).  The sparsifiers' density warm-up
    (``density_warmup=`` steps from ``density_start=``) is a compressor parameter.
    """
    state = DDPState(model, compressor, error_feedback=error_feedback, warmup_steps=warmup_steps,
                     min_numel=min_numel, skip=skip, algorithm=algorithm, process_group=process_group,
                     verify_every=verify_every, seed=seed, dense_1d=dense_1d, overlap=overlap,
                     hierarchy=hierarchy, optimizer=optimizer, **compressor_params)
    model.register_comm_hook(state, hook)
    return state


__all__ = ["DDPState", "ReplicaMismatchError", "hook", "register", "DEFAULT_MIN_NUMEL",
           "DEFAULT_WARMUP_STEPS"]
