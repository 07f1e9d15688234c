"""DDP communication hook: compressed gradient averaging in one line.

>>> state = commpress.ddp.register(model, "topk", ratio=0.01)   # model is a DDP
>>> # or the PyTorch way, a state built before its model and bound to it on every rank:
>>> state = commpress.ddp.DDPState("topk", ratio=0.01)
>>> state.bind(model)
>>> model.register_comm_hook(state, commpress.ddp.hook)

The pieces, each in its own module:

* :mod:`.ddp_step` — which parameters go dense, bucket plans and units
  (:class:`~.ddp_step.ModelLayout`); the :class:`~.ddp_step.HookConfig` that binding freezes (every
  decision a step needs: scale-by-world and the cast among them) and one training
  step: the dense part, the units, the residual transaction (what a bucket sends:
  each completed unit's payload messages, the dense part riding in the first one
  where the kind carries it (sparse kinds at P=2, gather kinds), else in one concurrent
  ``all_reduce``; nothing else);
* the executor below — owns the per-step state (step counter, the step in
  progress, the last error); runs a bucket in the hook call (``overlap=False``) or
  on one worker thread with a process group of its own (``overlap=True``);
  buckets go in through ``submit``, results come out through their futures;
* :func:`hook` — one warm-up decision, then the executor.

During the first ``warmup_steps`` steps (at least one) each bucket is one dense
asynchronous ``all_reduce`` from the hook call, exactly DDP's behaviour.  Under ``"auto"`` the
last one's backward ends with the first check point (:func:`_before_first_check`: the units of
the layout DDP uses from the next step, predicted by :mod:`.ddp_buckets` after the first one).

Executors and devices.  Collectives are issued from the hook call or the worker,
never from a future's callback (PyTorch's ``powerSGD_hook`` deadlocks on gloo
with several buckets for that reason).  The worker runs buckets in DDP's order
on a group of its own, so its collectives never interleave with those DDP or the
user issue.  On CUDA the worker runs on the stream that was current in the hook
call, so its kernels are ordered after the backward kernels that produced the
bucket; nothing in the steady state reads a tensor on the host.  A failure
fails the bucket's future (DDP raises it from ``backward()`` as a :class:`HookError`
naming the bucket, the compressor and the cause; the original in
``state.last_error``) and rolls the step's residual updates back.

Binding
-------
A state built with its model binds at construction; one built without
(``DDPState("topk", ratio=0.01)``, as Lightning's ``DDPStrategy(ddp_comm_state=...)``
needs) is bound by :meth:`DDPState.bind` on every rank before the first step (in
Lightning by :class:`commpress.integrations.lightning.BindCallback`).  Binding is
collective (fingerprint exchange, the overlap group, the cost model's calibration).
Deprecated: a state nobody bound binds in its first hook call (the first bucket of the
first synchronized step, which DDP calls on every rank in the same order) to the
``DistributedDataParallel`` found among the live objects holding the bucket's
parameters, with a ``DeprecationWarning``; that fallback goes away.

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

import copy
import gc
import hashlib
import logging
import os
import socket
import sys
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..collectives.core import ALLREDUCE_ALGORITHMS
from ..compressors import Compressor
from ..compressors._util import decode_keyed, encode_keyed, mix_seed, stable_hash
from .. import collectives
from ..storage import HOOK_DEFAULT, bytes_per_element
from .._worker import JobThread, seconds
from ..collectives import cast_message, unwrap
from ..feedback import ResidualTransaction, nonfinite_flag
from .common import HookState, Stats, Timer, all_reduce_bytes, codec_memory
from . import ddp_buckets, ddp_loan
from .ddp_buckets import ReadyOrder
from .ddp_step import HookConfig, ModelLayout, Plan, Step, StepContext, goes_dense, make_plan
from .sparse_rows import SparseRows, check_no_sparse_embeddings
from .optimizer import TakeoverMixin

if TYPE_CHECKING:   # imported when used: "auto" is optional
    from ..auto.runtime import AutoSpec

log = logging.getLogger("commpress")

#: Parameters with fewer elements than this are sent dense by default.
DEFAULT_MIN_NUMEL = 1024
#: Dense steps at the start (at least 1; DDP rebuilds buckets after the first iteration).
DEFAULT_WARMUP_STEPS = 1

ENV_VERIFY = "COMMPRESS_VERIFY"

_ATTR = "_commpress_ddp_state"

#: What the first bucket of a state that was never bound warns (and, once the fallback goes, raises).
UNBOUND_DEPRECATION = (
    "commpress ddp: this DDPState was not bound to its model before the first step, so it looks for "
    "the DistributedDataParallel holding the bucket's parameters among all live objects "
    "(gc.get_objects()); that fallback is deprecated and will become an error. Bind explicitly, on "
    "every rank before the first step: state.bind(ddp_model), or DDPState(ddp_model, ...), or "
    "commpress.ddp.register(ddp_model, ...); in PyTorch Lightning add the callback "
    "commpress.integrations.lightning.BindCallback(state)")


class ReplicaMismatchError(RuntimeError):
    """The synchronized gradients differ across ranks (found by ``verify_every``)."""


class HookError(RuntimeError):
    """A compressed bucket failed: names the bucket, the compressor and the cause
    (the original exception is ``__cause__`` and ``state.last_error``).  Raised on
    every rank: a failure inside a collective is judged on every rank alike."""


def _private(name: str) -> property:
    """A read-only alias of the private ``_<name>``, deprecated: internals are not part of the API."""
    def get(self: Any) -> Any:
        deprecated(f"commpress.ddp: DDPState.{name} is internal and private now (DDPState._{name}); "
                   "users need stats, state_dict/load_state_dict, close, bind, attach_optimizer, "
                   "attach_scaler and config()")
        return getattr(self, "_" + name)
    return property(get, doc=f"Deprecated: internal (``_{name}``).")


class DDPState(TakeoverMixin, HookState):
    """State of the commpress DDP comm hook: pass it with :func:`hook` to ``register_comm_hook``.

    What users need of it: :attr:`stats` (bytes sent against dense, ratio, step-time account,
    memory), :meth:`state_dict` / :meth:`load_state_dict` (one file per rank), :meth:`close`,
    :meth:`bind`, :meth:`attach_optimizer`, :meth:`attach_scaler`, and :meth:`config`, the
    configuration every rank agreed on at binding.  Everything else is the hook's.

    What goes on the wire: during the first ``warmup_steps`` steps each bucket is one dense
    ``all_reduce``, as DDP does; afterwards each unit of compressed parameters sends its
    compressor's payload through the collective its aggregation kind needs
    (:func:`commpress.collectives.allreduce`), the dense parameters riding in the same message
    where that costs no more bytes.  Binding exchanges a configuration fingerprint (compressor,
    parameters, options, world size, parameter names/shapes/policy), the only cross-rank check
    of the configuration; steps send their payloads only.

    Attributes:
        stats: a :class:`~commpress.hooks.common.Stats`: per step and cumulative bytes, ratio,
            algorithm per unit, step-time account, ``memory_overhead_bytes``
            (``stats.as_dict()``).
        step: steps synchronized so far (dense warm-up steps included); checkpointed.
        bound: whether :meth:`bind` has run.
        last_error: the original exception of the last failed bucket, or ``None``.

    Args:
        model: the ``DistributedDataParallel`` model, or omitted: ``DDPState("topk", ratio=0.01)``
            is bound later by :meth:`bind` on every rank before the first step (in Lightning by
            :class:`commpress.integrations.lightning.BindCallback`); nothing is exchanged before
            then, so it can be built before ``init_process_group``.
        compressor: a :class:`~commpress.Compressor` or a registry name (``commpress.available()``);
            ``**compressor_params`` are passed to ``commpress.get`` with a name.  ``"auto"``: a
            compressor per unit, chosen and re-chosen from measurements
            (:mod:`commpress.auto.runtime`, its options in ``auto``); every choice runs under
            error feedback.  With ``hierarchy`` each unit also chooses its path, flat or
            two-level (not with momentum correction: then every unit stays flat, logged).
        error_feedback: ``"auto"`` (on for biased compressors), ``True`` or ``False``.
        warmup_steps: dense steps at the start (clamped to at least 1).
        min_numel: parameters with fewer elements go dense.
        skip: ``skip(name) -> bool`` on the names of ``model.module.named_parameters()``;
            ``True`` sends that parameter dense.
        algorithm: passed to :func:`commpress.collectives.allreduce`: ``"auto"`` (cost model,
            calibrated once at binding) or one of the compressor kind's algorithms.
        process_group: defaults to the model's process group.
        verify_every: every N steps hash each synchronized bucket on all ranks and raise
            :class:`ReplicaMismatchError` naming the bucket on a mismatch (one ``all_gather`` of
            an int64 per bucket, read on the host; runs without overlap); ``None`` reads the
            environment variable ``COMMPRESS_VERIFY`` (0 = off).
        seed: seeds stochastic rounding: each rank's noise for a unit is a pure function of
            ``(seed, rank, step, unit)``, so resumed runs draw the same noise.
        dense_1d: send 1-D parameters (biases, norm weights) dense.
        overlap: run compression and communication on a worker thread (with a process group of
            its own) so they overlap the backward pass.
        hierarchy: ``None`` (flat), an int ``L`` (ranks per node: every unit reduces densely
            inside its node and compresses only between nodes, see
            :mod:`commpress.collectives.hierarchy`), or ``"auto"`` (torchrun's
            ``LOCAL_WORLD_SIZE`` when ``1 < L < world``, flat or two-level per unit by the
            intra/inter cost model; flat otherwise).  Creates the node groups (collective).
            Residuals of two-level units are kept per node shard (in :meth:`state_dict`).
        optimizer: a ``torch.optim.SGD`` whose momentum the hook takes over (DGC's recipe): its
            momentum ``m`` turns on ``momentum=m`` here and is set to 0 in the optimizer until
            :meth:`close`; Adam and SGD without momentum are left as they are (one log line).
            An optimizer made after the hook: :meth:`attach_optimizer`.
        join_buckets: hold each bucket's compressed message until a later bucket's collective
            carries it (:mod:`commpress.collectives.joint`): one round per step instead of one
            per bucket, the values bitwise the same.  ``None``: on where the backward pass keeps
            a rank's cores busy (a CPU rank whose cores its threads fill, agreed across ranks),
            off on GPUs; ``True`` / ``False``: always / never; a float: on, holding messages while
            the held ones spend at most that many seconds on the wire (``math.inf``: one round a
            step).  Units on the general path or a hierarchy send at once.
        scaler: AMP's ``torch.amp.GradScaler``: the hook divides each compressed step's buckets
            by the loss scale before compressing and multiplies the averages back, so residuals
            and velocities stay in unscaled units (:meth:`attach_scaler`, also for a scaler made
            later).
        residual_storage: how error feedback keeps its residuals (and momentum correction's
            velocities) between steps: ``"int8"`` (default: blockwise with its own scales,
            rounded stochastically; :mod:`commpress.storage`), ``"int4"`` (the same in 4 bits),
            ``"bf16"`` or ``"fp32"`` (exact).
        rollback: what a step with a NaN/inf keeps as it was: ``"step"`` every residual (the old
            codes of a lean residual wait in the parameters' ``.grad`` until the step's verdict,
            :mod:`commpress.loan`; a pending copy of each between steps with fp32 storage or where
            the gradients are not free, e.g. ``gradient_as_bucket_view=True``), ``"unit"`` the
            residuals of the first unit that saw it and of every unit after it (pending copies only
            for units in flight).
        momentum: DGC momentum correction in the error feedback
            (``commpress.ErrorFeedback(..., momentum=)``), in ``[0, 1)``; the parameters that go
            dense get plain momentum on their averaged gradient.  Pair it with
            ``torch.optim.SGD(..., momentum=0)``: the momentum now lives here.
        momentum_masking: DGC's momentum factor masking (with ``momentum`` or ``optimizer``):
            zero the velocity where a coordinate was sent (see :mod:`commpress.hooks.optimizer`).
        auto: the options of compressor ``"auto"`` (candidates, check points, hysteresis,
            prices, ...), a :class:`commpress.auto.runtime.AutoSpec`; only with
            ``compressor="auto"``.  Giving them as keywords (``check_every=...``) is deprecated.
        sparse_rows: parameters whose gradients are naturally row-sparse (an ``nn.Embedding``
            weight), sent losslessly as their nonzero rows and summed exactly
            (:func:`commpress.collectives.rows_allreduce`; the path and capacities from
            :class:`~commpress.hooks.sparse_rows.SparseRows`): a list of 2-D parameters of the
            model (or their names), ``"auto"`` (every 2-D parameter measured in the first steps
            and re-checked every 100 steps; those found dense at the first compressed step stay
            with the compressor) or ``None``.  Such a parameter is in no compressed unit (never
            compressed lossily, by ``"auto"`` neither); where its rows stop being sparse it goes
            in its bucket's dense part.  ``stats.as_dict()["sparse_rows"]`` shows each one's
            density, path, capacities, overflow rounds and algorithm.
        **compressor_params: the compressor's own parameters (with a registry name), as
            ``commpress.get`` takes them, e.g. ``ratio=0.01``.

    Raises:
        TypeError: ``model`` is not a DDP model, or a bad ``skip``, ``overlap``, ``scaler``,
            ``join_buckets``, ``auto`` or ``sparse_rows`` (neither a list nor ``"auto"``).
        ValueError: an algorithm the compressor's kind does not have; a negative
            ``warmup_steps``/``min_numel``/``seed``; a bad ``hierarchy``, ``residual_storage``,
            ``rollback`` or ``join_buckets``; ``auto`` without ``compressor="auto"``; at binding,
            configurations that differ between ranks (on every rank, naming what differs), a
            ``sparse_rows`` entry that is not a 2-D parameter of the model (named), or an
            ``nn.Embedding(sparse=True)`` in the model (its sparse gradient cannot go through a
            comm hook: build it dense and name its weight in ``sparse_rows``).

    Example::

        >>> state = commpress.ddp.DDPState("topk", ratio=0.01)
        >>> state.bind(ddp_model)                              # every rank
        >>> ddp_model.register_comm_hook(state, commpress.ddp.hook)
        >>> state.stats.compression_ratio
    """

    kind = "ddp"

    def __init__(self, model: DistributedDataParallel | Compressor | str | None = None,
                 compressor: Compressor | str | None = None, *,
                 error_feedback: bool | str = "auto", warmup_steps: int = DEFAULT_WARMUP_STEPS,
                 min_numel: int = DEFAULT_MIN_NUMEL, skip: Callable[[str], bool] | None = None,
                 algorithm: str = "auto", process_group: dist.ProcessGroup | None = None,
                 verify_every: int | None = None, seed: int = 0, dense_1d: bool = True,
                 overlap: bool = True, hierarchy: int | str | None = None,
                 optimizer: torch.optim.Optimizer | None = None, join_buckets: bool | float | None = None,
                 scaler: torch.amp.GradScaler | None = None, residual_storage: str = HOOK_DEFAULT,
                 rollback: str = "step", momentum: float = 0.0, momentum_masking: bool = False,
                 auto: AutoSpec | None = None,
                 sparse_rows: Sequence[torch.nn.Parameter | str] | str | None = None,
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
        if join_buckets is not None and not isinstance(join_buckets, (bool, float)):
            # an int is refused: join_buckets=1 reads as True but would be a one-second wire limit
            raise TypeError("join_buckets must be None, a bool or a wire limit in seconds as a float (e.g. "
                            f"0.005, math.inf), got {type(join_buckets).__name__} {join_buckets!r}")
        if isinstance(join_buckets, float) and not join_buckets > 0:   # (a bool is not a float)
            raise ValueError(f"join_buckets: a wire limit must be > 0 seconds (math.inf: none), got {join_buckets!r}")
        verify_every = _verify_every(verify_every)
        if isinstance(sparse_rows, str) and sparse_rows != "auto":
            raise ValueError(f"sparse_rows must be a list of parameters (or their names), 'auto' or None, "
                             f"got {sparse_rows!r}")
        if not (sparse_rows is None or isinstance(sparse_rows, str)
                or (isinstance(sparse_rows, (list, tuple, set)) and not isinstance(sparse_rows, torch.Tensor))):
            raise TypeError(f"sparse_rows must be a list of parameters (or their names), 'auto' or None, "
                            f"got {type(sparse_rows).__name__}")
        options, auto = auto, isinstance(compressor, str) and compressor == "auto"
        if options is not None and not auto:
            raise ValueError(f"auto= holds the options of compressor 'auto' and is given only with it, "
                             f"got compressor {getattr(compressor, 'name', compressor)!r}")
        if auto:  # a compressor per unit, chosen from measurements (commpress.auto)
            compressor = _auto_spec(compressor_params, options, algorithm=algorithm, error_feedback=error_feedback)
        if not (hierarchy is None or hierarchy == "auto"
                or (isinstance(hierarchy, int) and not isinstance(hierarchy, bool) and hierarchy >= 1)):
            raise ValueError(f"hierarchy must be None, 'auto' or a positive int (ranks per node), got {hierarchy!r}")
        super().__init__(compressor, error_feedback=error_feedback, process_group=process_group,
                         residual_storage=residual_storage, rollback=rollback, momentum=momentum,
                         momentum_masking=momentum_masking, **compressor_params)
        self.auto = auto
        if auto:
            self._new_auto_codec()
        self.inner = self.compressor if auto else unwrap(self.codec)
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
        self._lowrank = self.inner.aggregation == "lowrank"
        self._skip = skip
        self._want_overlap = overlap and not verify_every
        self.join_buckets = join_buckets
        self._worker_own_core = True     # agreed at binding (world > 1)
        self._lend_grads = False         # decided at binding (:mod:`.ddp_loan`)
        self._hierarchy_arg = hierarchy
        self.hierarchy = None
        self._sparse_rows_arg = list(sparse_rows) if isinstance(sparse_rows, (list, tuple, set)) else sparse_rows
        self._sparse_rows: SparseRows | None = None     # built at binding
        self._sparse_rows_config: dict[str, Any] | None = None
        self.dense_param_names: list[str] = []
        self.compressed_param_names: list[str] = []
        self._layout = ModelLayout({}, {}, set())
        self.frozen: HookConfig | None = None          # decided at binding, then never changed
        self._executor: _Executor | None = None         # created at binding; owns the per-step state
        self.overlap = False
        self.bound = False
        self._pending_load: dict[str, Any] | None = None
        self._forward_hook = None
        self._forward_pre_hook = None
        #: ``"auto"`` deciding at the end of the first backward: the order its gradients became
        #: ready in (DDP's rebuilt layout, :mod:`.ddp_buckets`), until that decision
        self._ready_order: ReadyOrder | None = None
        self._binding_in_step = False   # bound in the first hook call (deprecated): too late to record it
        self._stop_worker: weakref.finalize | None = None
        if optimizer is not None:
            self.attach_optimizer(optimizer)  # taken over at binding
        self.attach_scaler(scaler)
        if model is not None:
            self.bind(model)

    def bind(self, model: DistributedDataParallel) -> None:
        """Attach this state to ``model``, the DDP model whose gradients it compresses.

        Names the model's parameters, decides which go dense, exchanges the configuration
        fingerprint (one ``all_gather`` of a hash, on every rank), creates the overlap
        worker's process group and calibrates the cost model.  A state built with its model
        (``DDPState(model, ...)``, :func:`register`) is bound at construction; one built
        without (``DDPState("topk", ratio=0.01)``, as ``register_comm_hook`` and Lightning's
        ``DDPStrategy(ddp_comm_state=...)`` take it) must be bound with this call before the
        first step (in Lightning: :class:`commpress.integrations.lightning.BindCallback`).
        A state dict loaded before binding is checked and restored here.

        Collective on the model's process group: call it on every rank at the same point,
        outside the backward pass.

        Args:
            model: the ``torch.nn.parallel.DistributedDataParallel`` model; its hook is this
                state's (``model.register_comm_hook(state, commpress.ddp.hook)``, before or
                after binding).

        Raises:
            TypeError: ``model`` is not a ``DistributedDataParallel``.
            RuntimeError: this state is already bound, or another commpress state is bound
                to ``model`` (DDP takes one comm hook per model).
            ValueError: the configuration differs between ranks (on every rank, naming what
                differs), or a state dict loaded before binding does not match.

        Example::

            >>> state = commpress.ddp.DDPState("topk", ratio=0.01)   # before the model exists
            >>> model = DistributedDataParallel(net)
            >>> state.bind(model)                                      # every rank
            >>> model.register_comm_hook(state, commpress.ddp.hook)
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
        # an nn.Embedding(sparse=True) cannot go through a comm hook; a bad sparse_rows is named
        # (the same model on every rank: every rank raises, before any collective)
        check_no_sparse_embeddings(model.module)
        tracker = SparseRows(model.module, self._sparse_rows_arg) if self._sparse_rows_arg else None
        self._sparse_rows = tracker if tracker is not None and len(tracker) else None
        # fingerprinted as declared (what "auto" settles later is in the state dict, not the config)
        self._sparse_rows_config = self._sparse_rows.config() if self._sparse_rows is not None else None
        names, shapes = {}, {}          # from scratch: a failed binding may be retried
        self.dense_param_names, self.compressed_param_names = [], []
        for name, p in model.module.named_parameters():
            if not p.requires_grad:
                continue
            names[id(p)] = name
            shapes[name] = p.shape
            dense = goes_dense(name, p, self.inner, dense_1d=self.dense_1d, min_numel=self.min_numel,
                               uses_error_feedback=self.uses_error_feedback, skip=self._skip)
            (self.dense_param_names if dense else self.compressed_param_names).append(name)
        self._layout = ModelLayout(names, shapes, set(self.dense_param_names))
        if self._sparse_rows is not None:
            # declared ones and those the compressor sends dense anyway are out of the units now;
            # "auto"'s others are settled at the first compressed step (_settle_rows)
            tracked = {n for n, _ in self._sparse_rows.items()}
            declared = {n for n in tracked if self._sparse_rows.plans[n].declared}
            self._layout.rows = declared | (tracked & set(self.dense_param_names))
            self._layout.rows_settled = self._layout.rows == tracked
        self._take_pending_optimizer()  # its momentum is part of the configuration
        self.check_config()
        # After the fingerprint check (a collective on the model's group): the hook's own group.
        self.process_group, overlapped = _executor_group(self.process_group, self._want_overlap)
        self.hierarchy = _hierarchy(self._hierarchy_arg, self.process_group, self.world_size)
        if self._sparse_rows is not None:   # its counts' all_reduce runs where the steps run
            self._sparse_rows.group = self.process_group
            self.stats.sparse_rows_report = self._sparse_rows.as_dict
        if self.world_size > 1 and (self.auto or self.join_buckets is None):
            # whether an overlap worker could run beside the backward pass (agreed: every rank decides alike)
            local = _ranks_on_this_host(self.process_group)
            from ..auto.measure import agree

            own = agree([1.0 if _worker_has_own_core(model, local) else 0.0], ["min"], self.process_group)[0]
            self._worker_own_core = own == 1.0
        self._lend_grads = self._grads_lendable(model)
        self.frozen = self._freeze()
        executor_cls = _Overlapped if overlapped else _Inline
        self._executor = executor_cls(self.frozen, self._layout, self.stats, step=self._step_count)
        self.overlap = overlapped
        if overlapped:
            # a state dropped without close() (with its model) stops its worker: the thread holds the
            # executor, never this state; its group stays until the process ends (a group's shutdown
            # may be collective on some backends, and a finalizer runs at no agreed point)
            self._stop_worker = weakref.finalize(self, self._executor.stop)
            self._stop_worker.atexit = False
        if self.world_size > 1:
            from ..collectives import get_cost_model

            # calibrate now (a collective), not inside a step: "auto" and the step account use it
            self.stats.cost_model = get_cost_model(self.process_group)
        if self.hierarchy is not None and self.hierarchy.mode == "auto":
            self.hierarchy.models()  # likewise for the intra-node and inter-node models
        if self.auto:
            self._bind_auto(model)
        setattr(model, _ATTR, self)
        self.bound = True
        if self._pending_load is not None:
            pending, self._pending_load = self._pending_load, None
            self.load_state_dict(pending)

    def _grads_lendable(self, model: DistributedDataParallel) -> bool:
        """Whether the steps lend each unit's gradients to its residuals' old codes
        (:mod:`.ddp_loan`: lean residuals, no pending store); said once where they keep a pending
        store instead."""
        if not self.uses_error_feedback or self.residual_storage == "fp32":
            return False
        why = ddp_loan.unlendable(model)
        if why is not None:
            log.info("commpress ddp: %s residuals keep a pending copy for a NaN/inf step (%s): %.2f bytes "
                     "per compressed parameter instead of %.2f", self.residual_storage, why,
                     2 * bytes_per_element(self.residual_storage), bytes_per_element(self.residual_storage))
        return why is None

    def _new_auto_codec(self) -> None:
        from ..auto.runtime import AutoCodec

        old = getattr(self, "_auto_codec", None)
        self.codec = self._auto_codec = AutoCodec(self.compressor, self.momentum, self.momentum_masking,
                                                  self.residual_storage, self.rollback == "step")
        self.uses_error_feedback = True   # every choice runs under error feedback
        if old is not None:  # rebuilt after binding (a momentum taken over): keep what binding set
            for name in ("network", "hierarchy", "first_check", "queued", "world", "rank"):
                setattr(self.codec, name, getattr(old, name))
        if self.stats.auto_report is not None:
            self._report_auto()   # the reports follow the new codec

    def _bind_auto(self, model: DistributedDataParallel) -> None:
        """``"auto"``: the network model (calibrated just before), the check points, the
        forward hook that stamps the backward's start."""
        from ..auto.decide import Network
        from ..collectives.costmodel import CostModel

        auto = self._auto_codec
        flat = self.stats.cost_model if self.stats.cost_model is not None else CostModel(0.0, 0.0)
        auto.network = Network(max(1, self.world_size), flat)
        h = self.hierarchy
        if h is not None:  # hierarchy=L: each unit flat or two-level, by the intra/inter models
            intra, inter = h.models()   # collective (every rank binds alike)
            auto.network = Network(self.world_size, flat, local_size=h.local_size, intra=intra, inter=inter)
            if h.mode != "two_level":   # hierarchy="auto": the auto codec chooses the path, not the hierarchy
                h = copy.copy(h)
                h.mode, h._plans = "two_level", {}
            auto.hierarchy = h
            if self.momentum:
                log.info("commpress auto: momentum correction keeps every unit on the flat path "
                         "(a velocity cannot be split between the flat and the two-level path)")
        # the first check point ends the last warm-up step's backward (DDP's own path), on the units
        # of the layout DDP has then (from the second step) or is about to make (the first: predicted
        # from the order its gradients became ready in, :mod:`.ddp_buckets`); its compute is timed from
        # the forward's start (a forward pre-hook).  Where that layout is not known then, it ends the
        # first compressed step, whose units run dense.
        why = ("sparse_rows settles its parameters at the first compressed step" if self._sparse_rows is not None
               else "bound in the first step's hook call" if self._binding_in_step
               else ddp_buckets.unpredictable(model) if self.warmup_steps == 1
               else "static_graph=True" if getattr(model, "static_graph", False) else None)
        if why is None:
            auto.first_check = self.warmup_steps - 1
            if auto.first_check == 0 and self._step_count == 0:
                self._ready_order = ReadyOrder(model)
        else:
            auto.first_check = self.warmup_steps
            log.info("commpress auto: the first check point ends the first compressed step (%s)", why)
        # the overlap worker's codec runs beside the backward only where it has a core of its own;
        # on a CPU rank whose cores the backward's threads fill, it takes them from the backward
        # and "auto" prices it on the critical path (agreed at binding)
        auto.queued = self.overlap and self._worker_own_core
        auto.world, auto.rank = self.world_size, self.rank
        self._report_auto()
        # host-clock stamps: under torch.compile they run eagerly (not traced: Dynamo cannot trace
        # time.perf_counter and would warn on every compile)
        @torch.compiler.disable
        def forward_end(*_: Any) -> None:
            self.codec.begin()

        @torch.compiler.disable
        def forward_start(*_: Any) -> None:
            self.codec.forward_start()

        self._forward_hook = model.register_forward_hook(forward_end)
        self._forward_pre_hook = model.register_forward_pre_hook(forward_start)

    def _freeze(self) -> HookConfig:
        """Every decision a step needs, taken once (scale-by-world and the cast among them)."""
        cast = self.inner.casts and not self.uses_error_feedback
        return HookConfig(
            codec=self.codec, compressor_name=self.codec.name or type(self.codec).__name__,
            group=self.process_group, world_size=self.world_size, rank=self.rank, algorithm=self.algorithm,
            hierarchy=self.hierarchy, seed=self.seed, scale=1.0 / self.world_size,
            fold_scale=cast and self.hierarchy is None, cast_to=self.inner.cast_to if cast else None,
            feedback=self.uses_error_feedback, momentum=bool(self.momentum), lowrank=self._lowrank,
            verify_every=self.verify_every, auto=self.codec if self.auto else None,
            joins=(self.world_size > 1 and self.hierarchy is None
                   and (not self._worker_own_core if self.join_buckets is None else bool(self.join_buckets))),
            hold_max_wire_s=self.join_buckets if isinstance(self.join_buckets, float) else None,
            scaler=self.scaler, unit_commits=self.rollback == "unit", sparse_rows=self._sparse_rows,
            lend_grads=self._lend_grads)

    def _scaler_changed(self) -> None:
        """A scaler attached (or detached) after binding: freeze the configuration again (the next
        step reads it; a step in progress keeps its own)."""
        if self.frozen is not None:
            self.frozen = self._freeze()
            self._executor.config = self.frozen

    # -- what the executor owns, seen from here -------------------------------
    @property
    def step(self) -> int:
        """Steps synchronized so far (dense warm-up steps included); checkpointed."""
        return self._executor.step if self._executor is not None else self._step_count

    @step.setter
    def step(self, value: int) -> None:
        self._step_count = int(value)
        if self._step_count > 0:   # a resumed run: its first check point was long ago
            self._drop_ready_order()
        if getattr(self, "_executor", None) is not None:
            self._executor.step = int(value)

    @property
    def last_error(self) -> BaseException | None:
        """The original exception of the last failed bucket (the overlap worker's), or ``None``."""
        return self._executor.last_error if self._executor is not None else None

    # internals that were public before issue 51: read-only, deprecated
    executor = _private("executor")
    layout = _private("layout")
    lowrank = _private("lowrank")
    hierarchy_arg = _private("hierarchy_arg")

    @property
    def units(self):
        return self._layout.units

    @property
    def unit_of(self) -> dict[str, int]:
        return self._layout.unit_of

    @property
    def _plans(self) -> dict[int, Plan]:
        return self._layout.plans

    @property
    def dense_momentum(self):
        """The plain momentum of the dense parameters (``.velocity`` by name), ``None`` without momentum."""
        return _DenseVelocities(self.codec) if self.momentum else None

    # -- the optimizer's momentum (commpress.hooks.optimizer) -------------------
    def _covered_parameter_ids(self) -> set[int] | None:
        """The parameters whose momentum the hook takes over (``None`` before binding)."""
        return set(self._layout.names) if (self.bound or self._layout.names) else None

    def _codec_changed(self) -> None:
        """The codec's configuration changed after construction (a momentum taken over, ``"auto"``'s
        candidates narrowed): rebuild the auto codec, freeze the configuration again (with momentum
        the codec has error feedback, so the cast path is off)."""
        if self.auto:
            self._new_auto_codec()   # the per-unit codecs get the momentum, the decider the candidates
        if self.frozen is not None:
            self.frozen = self._freeze()
            self._executor.config = self.frozen

    def _bind_to_bucket(self, bucket: dist.GradBucket) -> None:
        """The first hook call of a state nobody bound (:meth:`bind`): deprecated.

        The model is then found by scanning the live objects for the DDP model holding
        ``bucket``'s parameters (:func:`_model_of`), with a ``DeprecationWarning``: that
        fallback goes away, and an unbound state will raise here.
        """
        deprecated(UNBOUND_DEPRECATION)
        self._binding_in_step = True
        self.bind(_model_of(bucket.parameters()))

    # -- lifetime ----------------------------------------------------------
    def close(self) -> None:
        """Stop the overlap worker and release its process group (the hook must not run afterwards);
        give a taken-over optimizer its momentum back."""
        if self._executor is not None:
            self._executor.close()
        if self._stop_worker is not None:
            self._stop_worker.detach()
        if self._forward_hook is not None:
            self._forward_hook.remove()
            self._forward_hook = None
        if self._forward_pre_hook is not None:
            self._forward_pre_hook.remove()
            self._forward_pre_hook = None
        self._drop_ready_order()
        self.release_optimizer()

    def _drop_ready_order(self) -> None:
        ready, self._ready_order = getattr(self, "_ready_order", None), None
        if ready is not None:
            ready.remove()

    def __enter__(self) -> "DDPState":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- layout --------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """The configuration every rank agreed on at binding (fingerprinted; saved in :meth:`state_dict`).

        Returns:
            A JSON-able dict: the compressor and its parameters, error feedback, momentum,
            world size, the hook's options (``warmup_steps``, ``min_numel``, ``algorithm``,
            ``verify_every``, ``seed``, ``dense_1d``, ``hierarchy``, ``join_buckets``), the
            parameters' shapes and which go dense (after binding), and with ``sparse_rows`` the
            tracked parameters as bound (declared or ``"auto"``) and the plan's options.
        """
        cfg = super().config()
        cfg.update(
            warmup_steps=self.warmup_steps, min_numel=self.min_numel, algorithm=self.algorithm,
            verify_every=self.verify_every, seed=self.seed, dense_1d=self.dense_1d,
            params={n: list(s) for n, s in self._layout.shapes.items()},
            dense_params=sorted(self.dense_param_names),
        )
        if self._hierarchy_arg is not None:  # absent when flat: older checkpoints still load
            cfg["hierarchy"] = self._hierarchy_arg
        if self.join_buckets is not None:   # absent by default, likewise (ranks must agree: fingerprinted)
            cfg["join_buckets"] = self.join_buckets
        if self._sparse_rows_config is not None:   # likewise
            cfg["sparse_rows"] = self._sparse_rows_config
        return cfg

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
            codec = self.codec.codecs.get(unit.key) if self.auto else self.codec
            if codec is None:
                continue
            kind = codec.aggregation
            if kind == "gather" and self.world_size > 1:
                parts = [codec.residual((unit.key, r)) for r in range(self.world_size)]
            else:
                parts = [codec.residual((unit.key, 0) if kind == "gather" else unit.key)]
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
        """This rank's hook state: step counter, error-feedback residuals (and velocities),
        PowerSGD factors, the units' layout and the configuration.

        Only tensors, numbers, strings, lists and dicts: it loads with
        ``torch.load(path, weights_only=True)``.  Residuals are per rank: save one file per rank.
        Before binding, a state dict loaded then is returned as it was.

        Returns:
            The state dict.

        Raises:
            RuntimeError: the state is not bound yet and nothing was loaded.
        """
        if not self.bound:
            if self._pending_load is not None:
                return self._pending_load
            raise RuntimeError("this DDPState is not bound to a model yet (it binds at its first "
                               "bucket): there is no state to save before the first step")
        return super().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; before binding it is kept, and checked and applied at binding.

        Args:
            state: what :meth:`state_dict` returned on this rank (one file per rank).

        Raises:
            ValueError: not a commpress DDP hook state, or one saved by another world size,
                another rank or another configuration (naming what differs).
        """
        if not self.bound:
            self._pending_load = state
            return
        super().load_state_dict(state)

    def _extra_state_dict(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"units": self._layout.units_state()}
        if self._sparse_rows is not None:
            extra["sparse_rows"] = self._sparse_rows.state_dict()
            extra["rows_params"] = sorted(self._layout.rows) if self._layout.rows_settled else None
        if self.momentum:
            extra["dense_velocity"] = encode_keyed(self.codec.dense_velocities())
        return extra

    def _load_extra_state_dict(self, extra: dict[str, Any], state: dict[str, Any]) -> None:
        if self._sparse_rows is not None:
            settled = extra.get("rows_params")
            if settled is not None:   # "auto" settled before the save: the same parameters go as rows
                self._layout.units, self._layout.unit_of = [], {}
                self._layout.set_rows(set(settled))
                self._sparse_rows.drop([n for n, _ in list(self._sparse_rows.items()) if n not in settled])
            self._sparse_rows.load_state_dict(extra.get("sparse_rows", {}))
        self._layout.load_units(extra.get("units", []))
        if self.momentum:
            saved = decode_keyed(extra.get("dense_velocity", {"keys": [], "tensors": []}), "dense velocity")
            self.codec.load_dense_velocities(saved)

    # -- memory ----------------------------------------------------------
    def memory_bytes(self) -> int:
        """Bytes the hook keeps alive: residuals (live and pending), velocities, scratch,
        compressor state (by kind: ``stats.as_dict()["memory"]``)."""
        return sum(_memory_parts(self.codec, self._layout, self._sparse_rows).values())


def _auto_spec(params: dict[str, Any], options: AutoSpec | None, *, algorithm: str,
               error_feedback: Any, exclude: tuple[str, ...] = (), where: str = "the DDP hook",
               hook: str = "commpress.ddp", spelled: str = "commpress.auto.runtime.AutoSpec") -> AutoSpec:
    """The :class:`~commpress.auto.runtime.AutoSpec` of ``register(model, "auto", auto=options)``
    (DDP's and, with ``exclude`` / ``where`` / ``hook``, FSDP2's): ``options`` itself (validated when
    it was built; candidates of a kind in ``exclude`` refused), or, deprecated, one built from the
    options given as keywords (taken out of ``params``).  ``ValueError`` for what "auto" cannot do."""
    from ..auto.runtime import AUTO_OPTIONS, AutoSpec, auto_spec, excluding

    if algorithm != "auto":
        raise ValueError(f"algorithm must be 'auto' with compressor 'auto' (each unit's kind picks its "
                         f"own), got {algorithm!r}")
    if error_feedback is False:
        raise ValueError("error_feedback=False cannot be given with compressor 'auto': every choice runs "
                         "under error feedback so that a switch loses no residual")
    given = [k for k in AUTO_OPTIONS if k in params]
    if options is None:
        if given:
            shown = ", ".join(f"{k}=..." for k in given)
            deprecated(f"{hook}: the options of compressor 'auto' as keywords ({', '.join(given)}) "
                       f"are deprecated: pass auto={spelled}({shown})")
        return auto_spec(params, exclude=exclude, where=where)
    if not isinstance(options, AutoSpec):
        raise TypeError(f"auto must be a commpress.auto.runtime.AutoSpec (commpress.auto.Options: the options "
                        f"of compressor 'auto') or None, got {type(options).__name__}")
    if given:
        raise ValueError(f"the options of compressor 'auto' are given twice: {given} as keywords and auto=; "
                         "give them in auto= only")
    auto_spec(dict(params), where=where)   # ValueError for anything else given as a keyword
    return excluding(options, exclude, where)


#: Frames in these folders are skipped when a deprecation is attributed to its caller.
_LIBRARY_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
                 os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)


def deprecated(message: str) -> None:
    """``warnings.warn(message, DeprecationWarning)`` attributed to the first frame outside commpress
    and torch: the user's line (``register(...)``, ``DDPState(...)``, ``loss.backward()``), so
    Python's default filters show it where that line is in ``__main__``."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, DeprecationWarning, stacklevel=level + 1)


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

    Deprecated (the fallback of a state nobody bound, :meth:`DDPState._bind_to_bucket`): one
    scan of the garbage collector's objects, once per state; every rank finds its own model
    the same way, so the binding that follows stays collective.
    """
    ids = {id(p) for p in params}
    found = []
    for obj in gc.get_objects():
        if issubclass(type(obj), DistributedDataParallel) and getattr(obj, _ATTR, None) is None:
            if any(id(p) in ids for p in obj.module.parameters()):
                found.append(obj)
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise RuntimeError(f"commpress ddp: this DDPState is not bound to a model, and {what} "
                           "DistributedDataParallel models hold this bucket's parameters: call "
                           "state.bind(ddp_model) on every rank before the first step (or build the "
                           "state with its model: DDPState(ddp_model, ...), commpress.ddp.register; in "
                           "Lightning: commpress.integrations.lightning.BindCallback(state))")
    return found[0]


# ---------------------------------------------------------------------------- executors
class _Executor:
    """Owns the per-step state: the step counter, the step in progress, the last error.

    Buckets go in through :meth:`submit` (run at once, or queued for the worker) and
    come out through their futures.  What it reads is frozen at binding
    (:class:`~.ddp_step.HookConfig`) or the model's layout; it never reads the hook's state.
    """

    def __init__(self, config: HookConfig, layout: ModelLayout, stats: Stats, step: int = 0) -> None:
        self.config, self.layout, self.stats = config, layout, stats
        # counted when asked (metadata only, no tensor is read), from this executor's codec and layout
        stats.track_memory(lambda: _memory_parts(self.config.codec, self.layout, self.config.sparse_rows),
                           _params(layout))
        self.step = step
        self.current: Step | None = None
        self.last_error: BaseException | None = None
        #: ``sparse_rows``: whether this step's first bucket began it (:func:`_begin_rows`), and
        #: whether some rows parameter takes the rows path in it (the step then runs here)
        self.rows_begun = False
        self.rows_active = False
        #: a bucket of the current step failed: its later buckets fail too, without a collective (a
        #: collective issued here after the failed one would take the slot the peers still wait in)
        self.failed: BaseException | None = None
        #: ``"auto"``'s all-dense steps under momentum correction (:func:`_dense_momentum_async`): the
        #: step's velocity updates and its buckets' futures, until its last bucket
        self.fast_transaction: ResidualTransaction | None = None
        self.fast_futures: list[torch.futures.Future] = []
        #: and, with lent gradients, the futures handed to DDP for its earlier buckets (set at the commit)
        self.fast_gates: list[tuple[torch.futures.Future, torch.Tensor]] = []
        #: ``"auto"``'s deciding warm-up step: each compressible parameter's gradient norm so far
        #: (:func:`_before_first_check`)
        self.warmup_norms: dict[str, torch.Tensor] = {}
        #: buckets finished before the step's last one, whose futures wait for the step's verdict:
        #: DDP copies a landed bucket into its lent gradients (:mod:`.ddp_loan`) at once
        self.finished: list[Any] = []

    def submit(self, bucket: dist.GradBucket, fut: torch.futures.Future) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def run(self, index: int, buf: torch.Tensor, params: list[torch.Tensor], last: bool,
            fut: torch.futures.Future, *, inline: bool) -> None:
        """One bucket of a compressed step; the one error path of both executors."""
        if self.failed is not None:   # an earlier bucket of this step failed: no collective until its end
            err = self.failed
            if last:
                self.failed = None
            if not fut.done():
                fut.set_exception(err)
            return
        try:
            if self.current is None:
                self.current = Step(StepContext(self.config, self.layout, self.stats, self.step))
            finished = self.current.run_bucket(index, buf, params, fut, last)
            cfg = self.config
            if cfg.verify_every and cfg.world_size > 1 and self.step % cfg.verify_every == 0:
                for done in finished:
                    _verify(cfg, self.stats, self.step, done.plan, done.buf)
            if self.config.lend_grads and not inline and not last:
                self.finished.extend(finished)   # DDP would copy them into lent memory before the verdict
                return
            if last:
                self._end_step()
            finished, self.finished = self.finished + finished, []
            for done in finished:
                done.fut.set_result(done.buf)
        except BaseException as exc:
            waiting = self.current.abort() if self.current is not None else []
            waiting += [done.fut for done in self.finished]
            self.finished = []
            self.current = None
            self.rows_begun = False
            self.last_error = exc
            err = hook_error(exc, index, self.config.compressor_name, self.layout.plans.get(index))
            if not last and not inline:   # DDP goes on submitting this step's buckets (inline: backward stops)
                self.failed = err
            for f in {id(f): f for f in [fut, *waiting]}.values():
                if not f.done():
                    f.set_exception(err)
            if inline:
                raise err from exc

    def _end_step(self) -> None:
        self.current.commit()
        self.current = None
        self.end_rows()
        collectives.flush_deferred()   # this step's CUDA statuses that have landed (no wait)
        if self.config.auto is not None:  # "auto": a check point every check_every steps (collective)
            self.config.auto.end_step(self.step, self.layout, self.config.group)
        self.step += 1
        self.stats.end_step()

    def end_rows(self) -> None:
        """``sparse_rows``: start the max over the ranks of this step's measurements (not waited for)."""
        if self.config.sparse_rows is not None and self.rows_begun:
            self.config.sparse_rows.end_step()
        self.rows_begun = False


class _Inline(_Executor):
    """Runs each bucket inside the hook call; errors raise from the hook."""

    queued = False

    def submit(self, bucket: dist.GradBucket, fut: torch.futures.Future) -> None:
        self.run(bucket.index(), bucket.buffer(), bucket.parameters(), bucket.is_last(), fut, inline=True)


class _Overlapped(_Executor):
    """One daemon thread runs the buckets in DDP's order on the hook's own group;
    errors fail the bucket's future (DDP raises them from ``backward()``).  The thread
    (a :class:`~commpress._worker.JobThread`) is joined before the interpreter finalizes
    when :meth:`close` was never called."""

    queued = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._group = self.config.group    # the hook's own group, released by close()
        self._worker = JobThread("commpress-ddp", self._job, seconds(_group_timeout(self._group)))
        self._thread = self._worker.thread  # read by benchmarks/cpu.py (the worker's CPU clock)

    def submit(self, bucket: dist.GradBucket, fut: torch.futures.Future) -> None:
        buf = bucket.buffer()
        stream = torch.cuda.current_stream(buf.device) if buf.is_cuda else None
        self._worker.put((bucket.index(), buf, bucket.parameters(), bucket.is_last(), fut, stream))

    def _job(self, item: tuple) -> None:
        *args, stream = item
        if stream is not None:
            with torch.cuda.stream(stream):
                self.run(*args, inline=False)
        else:
            self.run(*args, inline=False)

    def stop(self) -> None:
        """Let the worker finish what is queued and exit; no wait, the group kept (a state
        collected without :meth:`close`)."""
        self._worker.stop()

    def close(self) -> None:
        if not self._worker.close():   # still in a collective after the group's timeout
            log.warning("commpress ddp: the overlap worker did not stop; its group is kept")
            return
        if self._group is not None:
            try:
                dist.destroy_process_group(self._group)
            except Exception:  # noqa: BLE001 - already gone with the default group
                log.debug("commpress ddp: the overlap group was already destroyed")
            self._group = None


def _ranks_on_this_host(group: dist.ProcessGroup | None) -> int:
    """How many ranks of ``group`` run on this host: ``LOCAL_WORLD_SIZE`` where ``torchrun`` set
    it, else counted from the ranks' host names (one all_gather; collective)."""
    try:
        return max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    except (KeyError, ValueError):
        pass
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return 1
    from ..collectives import comm_device

    me = stable_hash(socket.gethostname())
    mine = torch.tensor([me], dtype=torch.int64, device=comm_device(group))
    hosts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(hosts, mine, group=group)
    return sum(int(h.item()) == me for h in hosts)


def _worker_has_own_core(model: torch.nn.Module, local_ranks: int = 1) -> bool:
    """Whether the overlap worker can run beside the backward pass: a CUDA model (the backward
    runs on the device), or a CPU rank with more cores than the backward's threads, counting the
    ``local_ranks`` ranks on this host that share its cores (a rank pinned to one core shares none)."""
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu":
        return True
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    sharing = max(1, local_ranks) if cores > 1 else 1
    return cores > torch.get_num_threads() * sharing


def _value(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()


_TYPED: dict[type, type] = {}


def hook_error(exc: BaseException, index: int, compressor: str, plan: Plan | None) -> BaseException:
    """The error a failed bucket surfaces with: its message names the bucket (and its first
    parameters), the compressor and the cause.  It is a :class:`HookError`; for a
    ``ValueError`` / ``TypeError`` / ``RuntimeError`` cause it is also an instance of the
    cause's own type (same class name), so ``except CollectiveInputError`` still works."""
    where = f"bucket {index}"
    if plan is not None:
        where += " (parameters " + ", ".join(plan.names[:4]) + (" ..." if len(plan.names) > 4 else "") + ")"
    msg = f"commpress ddp hook failed on {where} with compressor {compressor}: {type(exc).__name__}: {exc}"
    cls = type(exc)
    if isinstance(exc, HookError):
        return exc
    if issubclass(HookError, cls) or not issubclass(cls, (ValueError, TypeError, RuntimeError)):
        return HookError(msg)   # RuntimeError itself, and the rest: a HookError is one already
    typed = _TYPED.get(cls)
    if typed is None:
        try:
            typed = type(cls.__name__, (cls, HookError), {"__module__": cls.__module__,
                                                          "__init__": BaseException.__init__,
                                                          "__str__": BaseException.__str__})
        except TypeError:  # no consistent MRO (or a class that cannot be subclassed)
            typed = HookError
        _TYPED[cls] = typed
    return typed(msg)


def _memory_parts(codec: Compressor, layout: ModelLayout, rows: SparseRows | None = None) -> dict[str, int]:
    """Bytes the hook keeps alive between steps, by kind: the codec's (:func:`codec_memory`),
    ``scratch``, the plans' and units' buffers, ``collectives``, the collectives' reusable
    buffers and caches (process-wide, :func:`commpress.collectives.cached_bytes`: the rows'
    hash-owner tables among them), and with ``sparse_rows`` its counts still to be read."""
    return codec_memory(codec) | {"scratch": layout.scratch_bytes(), "collectives": collectives.cached_bytes()} | (
        {"sparse_rows": rows.memory_bytes()} if rows is not None else {})


def _params(layout: ModelLayout) -> int:
    """The model's parameters (every one the hook sees, dense ones included)."""
    return sum(s.numel() for s in layout.shapes.values())


class _DenseVelocities:
    """``state.dense_momentum.velocity``: the dense parameters' plain momentum, kept in the codec."""

    def __init__(self, codec: Any) -> None:
        self.velocity = codec.dense_velocities()


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


def _executor_group(process_group: dist.ProcessGroup | None, overlap: bool):
    """``(group, overlapped)``: the group the hook's collectives use, and whether a worker runs them."""
    if not overlap or not dist.is_initialized():
        return process_group, False
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return process_group, False
    if dist.get_world_size(group) != dist.get_world_size():
        log.info("commpress ddp: overlap needs a process group spanning the world (a dedicated "
                 "group is created on every rank); running synchronously")
        return process_group, False
    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend=dist.get_backend(group), timeout=_group_timeout(group)), True


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


def _verify(cfg: HookConfig, stats: Stats, step: int, plan: Plan, buf: torch.Tensor) -> None:
    """Hash the synchronized bucket on every rank; raise on a mismatch (reads on the host)."""
    data = buf.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
    digest = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)
    h = torch.tensor([digest], dtype=torch.int64, device=buf.device)
    out = [torch.empty_like(h) for _ in range(cfg.world_size)]
    dist.all_gather(out, h, group=cfg.group)
    hashes = [int(x.item()) for x in out]
    bad = [r for r, x in enumerate(hashes) if x != hashes[0]]
    if bad:
        shown = ", ".join(plan.names[:6]) + (" ..." if len(plan.names) > 6 else "")
        raise ReplicaMismatchError(
            f"commpress verify: synchronized gradients of DDP bucket {plan.index} "
            f"(parameters {shown}) differ across ranks at step {step}: ranks {bad} "
            "disagree with rank 0"
        )
    stats.record(plan.index, bytes_sent=8 * (cfg.world_size - 1), dense_bytes=0, algorithm="verify")


# ---------------------------------------------------------------------------- hook
def hook(state: DDPState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP comm hook: average ``bucket`` over ranks, compressed (see the module docs).

    Warm-up steps (and models with nothing to compress): one asynchronous dense
    ``all_reduce`` per bucket, as DDP does.  Afterwards the bucket goes to the
    executor; the returned future holds the bucket buffer overwritten with the
    average, completed when the bucket's units are done (normally with the bucket
    itself, at the latest with the last bucket of the step).

    Example::

        >>> state = commpress.ddp.DDPState("topk", ratio=0.01)
        >>> ddp_model.register_comm_hook(state, commpress.ddp.hook)
    """
    if not isinstance(state, DDPState):
        raise TypeError(f"commpress.ddp.hook needs a commpress.ddp.DDPState, got {type(state).__name__}")
    if not state.bound:  # the first bucket of the first step, on every rank: bind (collective)
        state._bind_to_bucket(bucket)
    executor, cfg = state._executor, state.frozen
    # "auto" times the backward (host clock, no sync) from its first check point's step
    if cfg.auto is not None and executor.step >= min(1, cfg.auto.first_check):
        index, last = bucket.index(), bucket.is_last()
        t0 = cfg.auto.arrive(index, last)
        try:
            return _hook(state, executor, cfg, bucket)
        finally:
            if not last:
                cfg.auto.leave(index, t0)
    return _hook(state, executor, cfg, bucket)


def _hook(state: DDPState, executor: _Executor, cfg: HookConfig,
          bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    rows = cfg.sparse_rows is not None and _begin_rows(state, executor, cfg)   # a rows parameter goes as rows
    if not rows and (executor.step < state.warmup_steps or not state.compressed_param_names):
        deciding = (cfg.auto is not None and executor.step == cfg.auto.first_check
                    and bool(state.compressed_param_names))
        if deciding:
            _before_first_check(state, executor, cfg, bucket)
        fut = _dense_async(executor, bucket)
        if deciding and bucket.is_last() and executor.step - 1 == cfg.auto.first_check:
            # the first check point (collective), beside the last all_reduce
            cfg.auto.end_step(executor.step - 1, executor.layout, cfg.group, timed_next=False)
        return fut
    fast = (cfg.auto.fast(executor.step) if cfg.auto is not None and not cfg.verify_every and not rows
            and cfg.scaler is None else None)
    if fast is not None:   # "auto" chose dense (or bf16) everywhere: DDP's own path (PyTorch's bf16 hook's)
        if cfg.momentum:   # the units' velocities in the same pass as the 1/P (fast() says "dense")
            return _dense_momentum_async(executor, bucket)
        return _dense_async(executor, bucket, cast=torch.bfloat16 if fast == "bf16" else None)
    if cfg.fold_scale and not cfg.verify_every and not rows:
        return _dense_async(executor, bucket, cast=cfg.cast_to)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    executor.submit(bucket, fut)
    # A Python future's exception is only a value to DDP's C++ side ("Unable to cast ... to
    # Tensor"); raised from a callback it becomes the child future's error, which DDP raises.
    return fut.then(_value) if executor.queued else fut


def _before_first_check(state: DDPState, executor: _Executor, cfg: HookConfig, bucket: dist.GradBucket) -> None:
    """``"auto"``'s warm-up step that ends with its first check point, at each bucket (before its
    all_reduce scales it): each parameter's gradient norm is noted (not with a loss scaler: those
    gradients are scaled); the units are formed from this bucket (a step after DDP's rebuild) or, at
    the last bucket of the first step, from the layout DDP makes at the next forward
    (:meth:`~.ddp_buckets.ReadyOrder.rebuilt_buckets`, rank 0's ready order: every rank forms the same units);
    then each unit's norm, bucket and device go to the auto codec."""
    auto, layout = cfg.auto, executor.layout
    buf = bucket.buffer()
    plan = layout.plan(bucket.index(), bucket.parameters())
    norms = executor.warmup_norms
    if cfg.scaler is None:
        for name, off, n in plan.compressed:
            norms[name] = torch.linalg.vector_norm(buf[off:off + n])
    predicted = state._ready_order is not None
    if not predicted:
        layout.assign_units(plan)
    if not bucket.is_last():
        return
    executor.warmup_norms = {}
    if predicted:
        ready, state._ready_order = state._ready_order, None
        ready.remove()
        order = ready.agreed(cfg.group)
        if order is None:   # rank 0 did not see every gradient: decide one step later, as without a prediction
            auto.postpone_first_check(state.warmup_steps)
            log.info("commpress auto: the first check point ends the first compressed step (not every "
                     "parameter's gradient was ready in the first backward)")
            return
    plans = layout.plans.values()
    if predicted:
        plans = [make_plan(i, params, layout.names, layout.dense, layout.rows)
                 for i, params in enumerate(ready.rebuilt_buckets(order))]
        for p in plans:
            layout.assign_units(p)
        layout.predicted = True
    bucket_of = {name: p.index for p in plans for name, _, _ in p.compressed}
    for unit in layout.units:
        parts = [norms[nm] for nm in unit.names if nm in norms]
        auto.warmup_unit(unit, parts if len(parts) == len(unit.names) else None,
                         bucket_of.get(unit.names[-1], bucket.index()), buf.device, cfg.scale)


def _begin_rows(state: DDPState, executor: _Executor, cfg: HookConfig) -> bool:
    """``sparse_rows``, at each bucket: whether this step sends some parameter as rows.  The step's
    first bucket applies what the last one measured (:meth:`SparseRows.begin_step`: counts long
    gathered), settles ``"auto"``'s parameters at the first compressed step (:func:`_settle_rows`),
    and decides for the whole step (every rank alike: paths are functions of gathered counts)."""
    if not executor.rows_begun:
        tracker = cfg.sparse_rows
        tracker.begin_step()
        executor.rows_begun = True
        compressed = executor.step >= state.warmup_steps
        if compressed and not executor.layout.rows_settled:
            _settle_rows(tracker, executor.layout)
        executor.rows_active = compressed and cfg.world_size > 1 and tracker.any_rows(executor.layout.rows)
    return executor.rows_active


def _settle_rows(tracker: SparseRows, layout: ModelLayout) -> None:
    """``sparse_rows="auto"`` at the first compressed step: the parameters measured sparse (on the
    rows path now) join the rows parameters for good; the others the compressor would compress
    stay with it (in its units) and are no longer tracked.  Units stay stable from then on."""
    keep = layout.rows | {n for n, _ in tracker.items() if tracker.path(n) == "rows"}
    tracker.drop([n for n, _ in list(tracker.items()) if n not in keep])
    layout.set_rows(keep)
    log.info("commpress ddp: sparse_rows='auto' settled: %s as rows", sorted(keep) or "none")


# DDP inspects the annotations (which `from __future__ import annotations` turns into strings).
hook.__annotations__.update(state=DDPState, bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]})


def _dense_momentum_async(executor: _Executor, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own path for ``"auto"``'s all-dense steps under momentum correction (``optimizer=``):
    what the units' path computes, in DDP's one asynchronous ``all_reduce`` per bucket.

    Each unit's part of the bucket becomes its pending velocity ``m·u + g/P`` in place
    (:meth:`~commpress.ErrorFeedback.velocity_into`, the same fp32 operations as the
    units' path; a dense unit's residual is zero), the dense parameters are scaled by ``1/P``;
    the bucket is summed; the dense parameters get their plain momentum on the sum (as
    :meth:`.ddp_step.Step._finish_dense` gives it).  The step's velocity updates commit when its
    last bucket's sum has landed, kept where any rank's part held a NaN/inf: each rank marks its
    own in its message's first element (:func:`_mark_nonfinite`; read in the one-pass velocities,
    else by a sum over its part), and every rank reads that element of the sum.  With lent
    gradients (:mod:`.ddp_loan`) a one-pass velocity is stored over the live one, its old codes
    kept in the unit's gradients; DDP then gets the earlier buckets' futures at the commit."""
    cfg, layout = executor.config, executor.layout
    with Timer(cpu=True) as total:
        buf = bucket.buffer()
        plan = layout.plan(bucket.index(), bucket.parameters())
        _observe_rows(executor, bucket)
        if executor.fast_transaction is None:
            executor.fast_transaction, executor.fast_futures = ResidualTransaction(), []
        tx, futures = executor.fast_transaction, executor.fast_futures
        one_pass, local_bad = True, False
        grads = dict(zip(plan.names, (p.grad for p in bucket.parameters()))) if cfg.lend_grads else None
        for unit, parts, whole in _unit_parts(layout, plan):
            # a whole unit's old velocity waits in its gradients until the verdict
            loan = ddp_loan.grad_loan([grads[nm] for nm in unit.names], buf) if whole and grads is not None else None
            with tx.lending(loan):
                bad = (cfg.auto.velocity_unit(unit, buf, [(off, n) for _, off, n in parts], cfg.scale, tx)
                       if whole else None)
            if bad is not None:   # the unit in one pass (int8 on the CPU), which read its NaN/inf
                local_bad = local_bad or bad
                continue
            one_pass = False
            for name, off, n in parts:
                cfg.auto.velocity_part(unit, name, buf[off:off + n], cfg.scale, tx)
        # the dense parameters, and sparse_rows parameters on their dense path this step
        dense = list(zip(plan.dense_names, plan.dense_slices)) + [(nm, (o, k)) for nm, o, k in plan.rows]
        for _, (off, n) in dense:
            buf[off:off + n].mul_(cfg.scale)
        # every rank marks a NaN/inf of its own part in its message's first element (the one-pass
        # velocities read theirs; the dense slices, or the whole bucket where a unit went part by
        # part, are summed for it): every rank's verdict is then that element of the sum
        checked = [buf[off:off + n] for _, (off, n) in dense] if one_pass else [buf]
        probe = _mark_nonfinite(buf, local_bad, checked)
        work = dist.all_reduce(buf, group=cfg.group, async_op=True)

        def landed(_: Any) -> torch.Tensor:
            tx.mark_bad(nonfinite_flag(probe))
            for name, (off, n) in dense:
                cfg.codec.dense_momentum(buf[off:off + n], name, tx)
            return buf

        fut = work.get_future().then(landed)
        futures.append(fut)
        if cfg.lend_grads and not bucket.is_last():
            # DDP copies a landed bucket into its gradients at once: with the old velocities lent
            # there, each bucket lands for DDP when the step's verdict is applied (below)
            gate: torch.futures.Future = torch.futures.Future()
            executor.fast_gates.append((gate, buf))
            fut = gate
        if bucket.is_last():   # every bucket landed: the step's velocities commit (or keep their values)
            gates, executor.fast_gates = executor.fast_gates, []
            executor.fast_transaction, executor.fast_futures = None, []

            def commit(done: torch.futures.Future) -> torch.Tensor:
                try:
                    done.wait()   # raises where a bucket's all_reduce failed
                except BaseException as exc:
                    tx.rollback()   # the lent velocities back before DDP may copy into their memory
                    for gate, _ in gates:
                        gate.set_exception(exc)
                    raise
                tx.commit()
                for gate, landed_buf in gates:
                    gate.set_result(landed_buf)
                return buf

            fut = torch.futures.collect_all(futures).then(commit)
    dense_bytes = all_reduce_bytes(buf.numel() * buf.element_size(), cfg.world_size)
    _account_dense(executor, bucket, plan, total, dense_bytes, dense_bytes, "dense", 1)
    return fut


def _mark_nonfinite(buf: torch.Tensor, units_bad: bool, checked: list[torch.Tensor]) -> torch.Tensor:
    """Where this rank's part of ``buf`` holds a NaN/inf (``units_bad``, read by the units' one-pass
    velocities, or in a ``checked`` slice: a flag on the device, no host read), its first element
    becomes NaN, so that every rank's sum holds one there: the returned one-element view of ``buf``
    is then the step's verdict after the ``all_reduce``, on every rank alike, whichever way each
    rank read its own part.  A finite step whose sum overflows is not seen, as on DDP's own path."""
    first = buf[:1]
    if units_bad:
        first.fill_(float("nan"))
    elif checked:
        first.masked_fill_(torch.stack([nonfinite_flag(d) for d in checked]).any(), float("nan"))
    return first


def _account_dense(executor: _Executor, bucket: dist.GradBucket, plan: Plan, total: Timer, sent: int,
                   dense_bytes: int, algorithm: str, rounds: int) -> None:
    """Record a bucket sent DDP's way; the step's last bucket ends the step."""
    executor.stats.record(plan.index, bytes_sent=sent, dense_bytes=dense_bytes, algorithm=algorithm,
                          compress_seconds=0.0, hook_seconds=total.seconds, rounds=rounds,
                          hook_cpu_seconds=total.cpu_seconds)
    if bucket.is_last():
        executor.end_rows()
        executor.step += 1
        executor.stats.end_step()


def _observe_rows(executor: _Executor, bucket: dist.GradBucket) -> None:
    """``sparse_rows`` on DDP's own path: count the rows parameters' nonzero rows (on the device)."""
    tracker = executor.config.sparse_rows
    if tracker is not None and executor.rows_begun and tracker.measuring():
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            if p in tracker:
                tracker.observe(p, g.view(p.shape[0], -1))


def _unit_parts(layout: ModelLayout, plan: Plan) -> list[tuple[Any, list[tuple[str, int, int]], bool]]:
    """The units of ``plan``'s compressed parameters, each with its parts in this bucket
    ``(name, offset, numel)`` in the unit's order and whether they are all of it (cached in the plan)."""
    if plan.unit_parts is None:
        here = {name: (name, off, n) for name, off, n in plan.compressed}
        units = []
        for name, _, _ in plan.compressed:
            unit = layout.units[layout.unit_of[name]]
            if all(u is not unit for u, _, _ in units):
                parts = [here[nm] for nm in unit.names if nm in here]
                units.append((unit, parts, len(parts) == len(unit.names)))
        plan.unit_parts = units
    return plan.unit_parts


def _dense_async(executor: _Executor, bucket: dist.GradBucket,
                 cast: torch.dtype | None = None) -> torch.futures.Future[torch.Tensor]:
    """DDP's own path: one asynchronous ``all_reduce`` per bucket issued from the hook call.

    With ``cast`` (fp16 / bf16 without error feedback; the steady state of those
    compressors) the bucket is scaled and cast in one pass into the message
    (:func:`commpress.collectives.cast_message`), as PyTorch's fp16 hook does;
    NaN/inf travel in the values and nothing can fail to compress, so the message
    carries no status.  The callback only copies the sum back (no collective)."""
    cfg = executor.config
    with Timer(cpu=True) as total:
        buf = bucket.buffer()
        plan = executor.layout.plan(bucket.index(), bucket.parameters())
        _observe_rows(executor, bucket)
        dense_bytes = all_reduce_bytes(buf.numel() * buf.element_size(), cfg.world_size)
        sent, algorithm = dense_bytes, "dense"
        if cfg.world_size > 1 and cast is not None:
            message = cast_message(buf, cast, cfg.scale, scale_in_place=True)   # buf is overwritten by the sum
            work = dist.all_reduce(message, group=cfg.group, async_op=True)
            fut = work.get_future().then(lambda _: buf.copy_(message))
            sent = all_reduce_bytes(message.numel() * message.element_size(), cfg.world_size)
            algorithm = "allreduce"
        elif cfg.world_size > 1:
            buf.mul_(cfg.scale)
            work = dist.all_reduce(buf, group=cfg.group, async_op=True)
            fut = work.get_future().then(lambda _: buf)
        else:
            fut = torch.futures.Future()
            fut.set_result(buf)
    _account_dense(executor, bucket, plan, total, sent, dense_bytes, algorithm, int(cfg.world_size > 1))
    return fut


def register(model: DistributedDataParallel, compressor: Compressor | str, *,
             error_feedback: bool | str = "auto", warmup_steps: int = DEFAULT_WARMUP_STEPS,
             min_numel: int = DEFAULT_MIN_NUMEL, skip: Callable[[str], bool] | None = None,
             algorithm: str = "auto", process_group: dist.ProcessGroup | None = None,
             verify_every: int | None = None, seed: int = 0, dense_1d: bool = True,
             overlap: bool = True, hierarchy: int | str | None = None,
             optimizer: torch.optim.Optimizer | None = None, join_buckets: bool | float | None = None,
             scaler: torch.amp.GradScaler | None = None, residual_storage: str = HOOK_DEFAULT,
             rollback: str = "step", momentum: float = 0.0, momentum_masking: bool = False,
             auto: AutoSpec | None = None,
             sparse_rows: Sequence[torch.nn.Parameter | str] | str | None = None,
             **compressor_params: Any) -> DDPState:
    """Compress ``model``'s gradient averaging with a commpress DDP comm hook.

    Builds a :class:`DDPState` and calls ``model.register_comm_hook(state, hook)``.
    Collective: call it on every rank with the same arguments (checked by a
    fingerprint exchange; ``ValueError`` on every rank otherwise).  Each parameter
    has the meaning it has in :class:`DDPState`, summarized here.

    Args:
        model: the ``DistributedDataParallel`` model (``TypeError`` otherwise).
        compressor: a :class:`~commpress.Compressor` or a registry name;
            ``**compressor_params`` are passed to ``commpress.get`` with a name.
            ``"auto"``: each unit gets its own compressor, chosen at check points from
            the measured overlap and codec cost and the calibrated network (see
            :mod:`commpress.auto.runtime`; its options in ``auto``); every choice runs
            under error feedback, and ``state.stats.as_dict()["auto"]`` shows the choices.
        error_feedback: ``"auto"`` (on for biased compressors), ``True`` or ``False``.
        warmup_steps: dense steps at the start (clamped to at least 1).
        min_numel: parameters with fewer elements go dense.
        skip: ``skip(name) -> bool`` on the names of ``model.module.named_parameters()``;
            ``True`` sends that parameter dense.
        algorithm: passed to :func:`commpress.collectives.allreduce`: ``"auto"`` (cost
            model, calibrated once at registration) or one of the compressor kind's
            algorithms (``ValueError`` otherwise).
        process_group: defaults to the model's process group.
        verify_every: every N steps hash each synchronized bucket on all ranks and raise
            :class:`ReplicaMismatchError` naming the bucket on a mismatch; ``None`` reads
            the environment variable ``COMMPRESS_VERIFY`` (0 = off).  Runs
            synchronously (no overlap).
        seed: seeds stochastic rounding: each rank's noise for a unit is a pure function
            of ``(seed, rank, step, unit)``, so resumed runs draw the same noise.
        dense_1d: send 1-D parameters (biases, norm weights) dense (default ``True``).
        overlap: run compression and communication on a worker thread (with a process
            group of its own) so they overlap the backward pass (default ``True``).
        hierarchy: ``None`` (flat), an int ``L`` (ranks per node: dense inside a node,
            compressed only between nodes, see :mod:`commpress.collectives.hierarchy`),
            or ``"auto"`` (torchrun's ``LOCAL_WORLD_SIZE`` when ``1 < L < world``, flat
            or two-level per unit by the intra/inter cost model).  Creates the node
            groups (collective).
        optimizer: a ``torch.optim.SGD`` with momentum whose momentum the hook takes
            over, DGC's recipe for reaching DDP's step count with a sparsifier (momentum
            correction here, the optimizer's momentum 0 until ``state.close()``; see
            :mod:`commpress.hooks.optimizer`).  Adam and SGD without momentum are left
            as they are.
        join_buckets: hold each bucket's compressed message until a later bucket's collective
            carries it: one round per step instead of one per bucket, bitwise the same values.
            ``None`` (default): on where the backward keeps a CPU rank's cores busy, off on
            GPUs; ``True`` / ``False``: always / never; a float: a wire-time limit in seconds
            for the held messages (``math.inf``: none).  See :class:`DDPState`.
        scaler: AMP's ``torch.amp.GradScaler`` when the loss is scaled (fp16): residuals and
            momentum-correction velocities are then kept in the gradients' own units, unaffected
            by the scale's changes; the buckets handed back stay scaled for ``scaler.step``
            (:meth:`DDPState.attach_scaler`; ``TypeError`` for anything but a GradScaler or
            ``None``).
        residual_storage: how error feedback keeps its residuals (and, with ``momentum`` or
            ``optimizer=``, its velocities) between steps: ``"int8"``
            (default: blockwise with its own scales, about 1.03 bytes per compressed parameter,
            rounded stochastically; :mod:`commpress.storage`), ``"int4"`` (0.56), ``"bf16"`` (2)
            or ``"fp32"`` (4, exact, plus 4 for a pending copy).  int8 reached the demo's targets in
            the steps fp32 needs (docs/results/memory.md).  ``ValueError`` for another value.
        rollback: what a step with a NaN/inf anywhere (on any rank) keeps as it was: ``"step"``
            (default) every residual: a lean residual's old codes wait in the parameters' ``.grad``
            (free between DDP's copy into its bucket and the step's end; :mod:`commpress.loan`),
            or, where they are not free (``gradient_as_bucket_view=True``,
            ``find_unused_parameters=True``, ``static_graph=True``) and with fp32 storage, in a
            pending copy of each residual kept between steps;
            ``"unit"`` the residuals of the first unit that saw it and of every unit after it,
            while the units judged before keep their update (what they sent is dropped with the
            step, as GradScaler drops its gradient): each unit commits when its collective
            ends, so pending residuals exist only for the units in flight (about half the
            residual memory).  ``ValueError`` for another value.
        momentum: DGC momentum correction in the error feedback, in ``[0, 1)`` (0: off); the
            dense parameters get plain momentum on their average.  Pair it with
            ``torch.optim.SGD(..., momentum=0)`` (or pass ``optimizer=``, which sets it).
        momentum_masking: DGC's momentum factor masking: zero the velocity where a coordinate
            was sent (with ``momentum`` or ``optimizer``; off by default).
        auto: the options of compressor ``"auto"``, a :class:`commpress.auto.runtime.AutoSpec`
            (``candidates``, ``check_every``, ``every``, ``margin``, ``drift``, ``critical``,
            ``prices``, ``remeasure``, ``revert``), validated when it is built; only with
            ``compressor="auto"``.  The same options as keywords of ``register`` still work
            and warn (``DeprecationWarning``).
        sparse_rows: parameters whose gradients are naturally row-sparse (an ``nn.Embedding``
            weight a batch touches a few rows of): a list of the model's 2-D parameters (or their
            names), or ``"auto"`` (every 2-D parameter, measured in the first steps and
            re-checked every 100; those found dense at the first compressed step stay with the
            compressor).  Each is sent as its nonzero rows and summed exactly
            (:func:`commpress.collectives.rows_allreduce`: all-gather or ZEN's hashed
            all-to-all, one overflow round when the rows outgrow the capacity, nothing dropped),
            bitwise the same on every rank and equal to DDP's average up to fp32 summation
            order; when its rows stop being sparse it goes dense in its bucket, and back to rows
            when a re-check finds them sparse.  Never in a compressed unit (``"auto"``'s neither).
            ``ValueError`` naming the tensor for one that is not a 2-D parameter of the model;
            see :class:`DDPState`.
        **compressor_params: the compressor's own parameters (with a registry name), as
            ``commpress.get`` takes them, e.g. ``ratio=0.01``; the sparsifiers' density
            warm-up (``density_warmup=`` steps from ``density_start=``) is one.

    Returns:
        The :class:`DDPState` (``state.stats``, ``state.state_dict()``, ``state.close()``).

    Raises:
        TypeError: when ``model`` is not DDP, or for a bad ``scaler``, ``skip``,
            ``overlap``, ``join_buckets`` or ``auto``.
        RuntimeError: when a commpress hook is already registered on ``model``.
        ValueError: for an algorithm the compressor's kind does not have, a bad
            ``residual_storage``, ``rollback``, ``hierarchy`` or ``momentum``, a negative
            ``warmup_steps``/``min_numel``/``seed``, ``auto`` without
            ``compressor="auto"``, a bad ``sparse_rows`` entry (named), an
            ``nn.Embedding(sparse=True)`` in the model, or configurations that differ between
            ranks (on every rank).

    Example:
        >>> model = DistributedDataParallel(net)
        >>> state = commpress.ddp.register(model, "topk", ratio=0.01)
        >>> ...  # train as usual
        >>> print(state.stats.as_dict())
        >>> # or a compressor per bucket, chosen from measurements, with its options:
        >>> from commpress.auto.runtime import AutoSpec
        >>> state = commpress.ddp.register(model, "auto", auto=AutoSpec(check_every=50))
    """
    state = DDPState(model, compressor, error_feedback=error_feedback, warmup_steps=warmup_steps,
                     min_numel=min_numel, skip=skip, algorithm=algorithm, process_group=process_group,
                     verify_every=verify_every, seed=seed, dense_1d=dense_1d, overlap=overlap,
                     hierarchy=hierarchy, optimizer=optimizer, join_buckets=join_buckets, scaler=scaler,
                     residual_storage=residual_storage, rollback=rollback, momentum=momentum,
                     momentum_masking=momentum_masking, auto=auto, sparse_rows=sparse_rows,
                     **compressor_params)
    model.register_comm_hook(state, hook)
    return state


__all__ = ["DDPState", "HookError", "ReplicaMismatchError", "hook", "register", "DEFAULT_MIN_NUMEL",
           "DEFAULT_WARMUP_STEPS"]
