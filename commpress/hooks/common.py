"""Pieces shared by the DDP and FSDP2 integrations.

* :func:`resolve_compressor` / :func:`wrap_error_feedback`: turn the user's
  ``compressor`` argument (a :class:`~commpress.Compressor` or a registry name plus
  parameters) into the codec a hook runs, with error feedback switched on for
  biased compressors when ``error_feedback="auto"``.
* :class:`Stats`: bytes handed to ``torch.distributed`` per step and in total,
  against the bytes the dense collective would have moved, the algorithm chosen
  per bucket / unit, time spent, memory overhead.
* :func:`check_same_config`: the registration-time fingerprint exchange.  Every
  rank hashes a canonical JSON of its configuration; one ``all_gather`` of an
  ``int64`` per rank compares them; on a mismatch the configurations themselves
  are gathered and every rank raises the same :class:`ValueError` naming the
  fields that differ (no rank is left waiting in a later collective).
* :class:`HookState`: the state object both hooks hand to PyTorch: codec, step
  counter, stats and ``state_dict()`` / ``load_state_dict()`` plumbing (loads
  with ``torch.load(weights_only=True)``; a checkpoint of another world size or
  another model/compressor configuration is refused with a ``ValueError``).

Byte accounting follows :mod:`commpress.collectives.accounting`: an
``all_reduce`` of ``n`` bytes is charged ``2·n·(P−1)/P`` bytes sent (ring).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from .. import ops
from ..storage import HOOK_DEFAULT
from ..collectives.accounting import all_reduce_cost
from ..compressors import Compressor, get

log = logging.getLogger("commpress")

STATE_FORMAT = "commpress.hook_state/1"



# ---------------------------------------------------------------- compressor
def resolve_compressor(compressor: Compressor | str, params: dict[str, Any] | None = None) -> Compressor:
    """Return ``compressor`` itself, or ``commpress.get(compressor, **params)`` for a name.

    Raises ``TypeError`` for anything else and ``ValueError`` for params given
    together with a Compressor instance (or unknown names / bad params).
    """
    params = dict(params or {})
    if isinstance(compressor, Compressor):
        if params:
            raise ValueError(
                f"compressor parameters {sorted(params)} can only be given with a compressor "
                f"name, not with the instance {compressor!r}"
            )
        return compressor
    if isinstance(compressor, str):
        return get(compressor, **training_defaults(compressor, params))
    raise TypeError(
        "compressor must be a commpress.Compressor or a registry name "
        f"(one of {', '.join(_available())}), got {type(compressor).__name__}"
    )


#: What a step with a NaN/inf keeps (the hooks' ``rollback=``): ``"step"``, every residual as it
#: was (each key keeps a pending residual between steps: twice the storage); ``"unit"``, the
#: residuals of the unit that saw it and of every unit after it (each unit commits once its
#: collective judged it: pending residuals only for the units in flight); the units committed
#: before keep their update, what they sent dropped with the step as GradScaler drops the gradient.
ROLLBACKS = ("step", "unit")


def training_defaults(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` for the compressor registered as ``name`` with the hooks' training policies
    added where the user gave none: a sparsifier's density warm-up
    (``density_warmup=DEFAULT_DENSITY_WARMUP`` steps; a bare compressor has none).

    Args:
        name: a registry name (``commpress.available()``).
        params: the user's compressor parameters (not modified).
    """
    from ..compressors._util import DEFAULT_DENSITY_WARMUP
    from ..compressors.base import _REGISTRY

    cls = _REGISTRY.get(name)
    if cls is None or "density_warmup" in params:
        return params
    init = getattr(cls.__init__, "__wrapped__", cls.__init__)
    if "density_warmup" not in inspect.signature(init).parameters:
        return params
    return {**params, "density_warmup": DEFAULT_DENSITY_WARMUP}


def _available() -> list[str]:
    from ..compressors import available

    return available()


def wants_error_feedback(compressor: Compressor, error_feedback: bool | str) -> bool:
    """Decide whether error feedback is used: ``"auto"`` means ``not compressor.unbiased``."""
    if error_feedback == "auto":
        return not compressor.unbiased
    if isinstance(error_feedback, bool):
        return error_feedback
    raise ValueError(f"error_feedback must be True, False or 'auto', got {error_feedback!r}")


def wrap_error_feedback(compressor: Compressor, error_feedback: bool | str = "auto",
                        momentum: float = 0.0, masking: bool = True,
                        storage: str = "fp32", hold_pending: bool = True) -> tuple[Compressor, bool]:
    """Return ``(codec, uses_ef)``: ``compressor`` wrapped in ``commpress.ErrorFeedback`` when
    wanted (always with ``momentum > 0``: DGC's momentum correction lives there, with momentum
    factor masking when ``masking``), its residuals kept in ``storage`` (:mod:`commpress.storage`),
    its pending ones between steps only with ``hold_pending``."""
    if momentum:
        if error_feedback is False:
            raise ValueError("momentum correction needs error feedback (error_feedback=False was given)")
        error_feedback = True
    use = wants_error_feedback(compressor, error_feedback)
    if not use:
        return compressor, False
    try:
        from ..feedback import ErrorFeedback
    except ImportError as exc:  # pragma: no cover - only while the package is incomplete
        raise RuntimeError("error feedback needs commpress.feedback.ErrorFeedback") from exc
    if isinstance(compressor, ErrorFeedback):
        if momentum and momentum != compressor.momentum:
            raise ValueError(f"momentum={momentum} given with an ErrorFeedback of momentum {compressor.momentum}")
        return compressor, True
    return ErrorFeedback(compressor, momentum=momentum, masking=masking, storage=storage,
                         hold_pending=hold_pending), True


def all_reduce_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in a ring ``all_reduce`` of ``nbytes`` (:mod:`commpress.collectives.accounting`)."""
    return all_reduce_cost(int(nbytes), world)[0]


@dataclass
class Stats:
    """Traffic and cost of a hook, per step and cumulative.

    ``bytes_sent``: bytes this rank handed to ``torch.distributed`` (payloads,
    metadata and dense parts, by the convention of
    :mod:`commpress.collectives.accounting`).  ``dense_bytes``: what the plain
    dense collective on the same buckets would have sent.  ``algorithms`` maps
    a bucket / unit to the algorithm used for it last (``"dense"`` for warm-up
    and skipped parts).  ``compress_seconds``: time inside the compressed path
    (compress + collectives + decompress); ``hook_seconds``: time in the hook
    in total.  ``memory_overhead_bytes``: residuals, scratch buffers and
    compressor state the hook keeps alive.

    **Step-time account** (``last_step["account"]``, and ``as_dict()["account"]``: the
    mean per accounted step), in seconds, measured on the thread that runs the
    buckets (the hook call, or the overlap worker) between the ends of two steps:

    * ``step``: wall time from the previous step's end to this one's;
    * ``compute_wait``: ``step`` minus the time in the hook: forward, backward and
      optimizer (inline), or the worker waiting for its next bucket (overlap);
    * ``codec``: host time per codec pass (``{"compress": s, "decompress": s}``), and
      ``codec_total``;
    * ``wire``: ``bytes_sent * beta`` and ``latency``: ``rounds * alpha``, by the
      cost model calibrated at binding (:mod:`commpress.collectives.costmodel`);
      ``rounds``: the ``torch.distributed`` calls of the step (dense part included);
    * ``comm``: measured host time inside those calls; ``comm_wait``: what ``comm``
      has beyond ``wire + latency`` (waiting for a slower peer), at least 0;
    * ``framework``: the rest of the hook's time (scaling, packing, queue, futures,
      copies, bookkeeping), at least 0;
    * ``unexplained``: ``step`` minus every part above (negative when the model
      predicts more wire time than the collectives took);
    * ``cpu``: host CPU seconds the whole process used during the step, every thread
      together (the training loop, the hook's worker, the communication library's threads;
      ``time.process_time``), and ``hook_cpu``: the part of it on the thread running the
      buckets (``time.thread_time``).  Not parts of ``step``: they say what the wall-clock
      parts cannot.  ``cpu`` close to ``step`` times the cores the rank may use means the
      rank is CPU-bound: its wire time is hidden, fewer bytes cannot shorten the step and
      less host work can (on one core the hook's worker and the backward share it, so
      ``compute_wait`` and ``codec`` also hold time the other thread ran).

    All times are ``time.perf_counter`` around host-side work: no timer adds a
    host synchronisation.  On CUDA a kernel's time shows where the host waits for it
    (a collective, the next bucket), not in ``codec``.
    """

    steps: int = 0
    bytes_sent: int = 0
    dense_bytes: int = 0
    compress_seconds: float = 0.0
    hook_seconds: float = 0.0
    #: what the hook keeps, by kind (:func:`codec_memory`): read when asked (:meth:`track_memory`)
    memory_source: Callable[[], dict[str, int]] | None = None
    memory_params: int = 0                 # the model's parameters, for the figures per parameter
    memory_sharded_state: int | None = None  # FSDP2: this rank's sharded params + grads, bytes
    algorithms: dict[str, str] = field(default_factory=dict)
    last_step: dict[str, Any] = field(default_factory=dict)
    _cur_sent: int = 0
    _cur_dense: int = 0
    _cur_compress: float = 0.0
    _cur_hook: float = 0.0
    _cur_units: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: the calibrated :class:`~commpress.collectives.costmodel.CostModel` the account uses (set at binding)
    cost_model: Any = None
    account_steps: int = 0
    _account_sum: dict[str, float] = field(default_factory=dict)
    _cur_rounds: int = 0
    _cur_comm: float = 0.0
    _cur_codec: dict[str, float] = field(default_factory=dict)
    _cur_hook_cpu: float = 0.0
    _last_end: float | None = None
    _last_cpu: float = 0.0
    #: with ``register(model, "auto")``: returns ``as_dict()["auto"]`` (each unit's choice, predicted
    #: and measured ms; see :meth:`commpress.auto.runtime.AutoCodec.report`)
    auto_report: Any = None
    #: with ``"auto"``: returns ``as_dict()["auto_network"]`` (the link the last decision priced:
    #: :meth:`commpress.auto.runtime.AutoCodec.network_report`)
    auto_network: Any = None
    #: with ``sparse_rows``: returns ``as_dict()["sparse_rows"]``, per parameter its density seen,
    #: path, capacities, overflow rounds and algorithm (:meth:`~.sparse_rows.SparseRows.as_dict`)
    sparse_rows_report: Any = None

    def record(self, unit: Any, *, bytes_sent: int, dense_bytes: int, algorithm: str,
               compress_seconds: float = 0.0, hook_seconds: float = 0.0, rounds: int = 0,
               comm_seconds: float = 0.0, codec_seconds: dict[str, float] | None = None,
               hook_cpu_seconds: float = 0.0) -> None:
        """Add what one bucket / unit sent in the current step (``rounds``, ``comm_seconds``,
        ``codec_seconds`` and ``hook_cpu_seconds`` feed the step-time account)."""
        u = str(unit)
        self._cur_sent += int(bytes_sent)
        self._cur_dense += int(dense_bytes)
        self._cur_compress += compress_seconds
        self._cur_hook += hook_seconds
        self._cur_rounds += int(rounds)
        self._cur_comm += float(comm_seconds)
        self._cur_hook_cpu += float(hook_cpu_seconds)
        for name, sec in (codec_seconds or {}).items():
            self._cur_codec[name] = self._cur_codec.get(name, 0.0) + float(sec)
        entry = self._cur_units.setdefault(u, {"bytes_sent": 0, "dense_bytes": 0, "algorithm": algorithm})
        entry["bytes_sent"] += int(bytes_sent)
        entry["dense_bytes"] += int(dense_bytes)
        if algorithm != entry["algorithm"]:
            entry["algorithm"] = f"{entry['algorithm']}+{algorithm}"
        self.algorithms[u] = entry["algorithm"]

    def end_step(self) -> None:
        """Close the current step: fold it into the totals and ``last_step``."""
        now, cpu = time.perf_counter(), time.process_time()
        self.steps += 1
        self.bytes_sent += self._cur_sent
        self.dense_bytes += self._cur_dense
        self.compress_seconds += self._cur_compress
        self.hook_seconds += self._cur_hook
        self.last_step = {
            "bytes_sent": self._cur_sent,
            "dense_bytes": self._cur_dense,
            "compression_ratio": _ratio(self._cur_dense, self._cur_sent),
            "compress_seconds": self._cur_compress,
            "hook_seconds": self._cur_hook,
            "rounds": self._cur_rounds,
            "units": self._cur_units,
        }
        if self._last_end is not None:
            account = self._account(now - self._last_end, cpu - self._last_cpu)
            self.last_step["account"] = account
            self.account_steps += 1
            for k, v in account.items():
                if isinstance(v, float):
                    self._account_sum[k] = self._account_sum.get(k, 0.0) + v
                elif k == "codec":
                    for name, sec in v.items():
                        self._account_sum["codec." + name] = self._account_sum.get("codec." + name, 0.0) + sec
        self._last_end, self._last_cpu = now, cpu
        self._cur_sent = self._cur_dense = self._cur_rounds = 0
        self._cur_compress = self._cur_hook = self._cur_comm = self._cur_hook_cpu = 0.0
        self._cur_units = {}
        self._cur_codec = {}

    def _account(self, step: float, cpu: float = 0.0) -> dict[str, Any]:
        """The current step's time account (see the class doc)."""
        model = self.cost_model
        alpha = float(model.alpha) if model is not None else 0.0
        beta = float(model.beta) if model is not None else 0.0
        hook = self._cur_hook
        codec = dict(self._cur_codec)
        codec_total = sum(codec.values())
        wire = self._cur_sent * beta
        latency = self._cur_rounds * alpha
        comm = self._cur_comm
        comm_wait = max(0.0, comm - wire - latency)
        framework = max(0.0, hook - codec_total - comm)
        compute_wait = max(0.0, step - hook)
        parts = compute_wait + codec_total + wire + latency + comm_wait + framework
        return {"step": step, "compute_wait": compute_wait, "codec": codec, "codec_total": codec_total,
                "wire": wire, "latency": latency, "rounds": float(self._cur_rounds), "comm": comm,
                "comm_wait": comm_wait, "framework": framework, "unexplained": step - parts,
                "cpu": cpu, "hook_cpu": self._cur_hook_cpu, "calibrated": model is not None}

    def reset_account(self) -> None:
        """Start the account's mean afresh (e.g. after warm-up); the next step starts a new interval."""
        self.account_steps = 0
        self._account_sum = {}
        self._last_end = None

    def account(self) -> dict[str, Any]:
        """Mean step-time account per accounted step, seconds (``{}`` before two steps)."""
        if not self.account_steps:
            return {}
        mean = {k: v / self.account_steps for k, v in self._account_sum.items() if not k.startswith("codec.")}
        mean["codec"] = {k[6:]: v / self.account_steps for k, v in self._account_sum.items()
                         if k.startswith("codec.")}
        mean["steps"] = self.account_steps
        return mean

    def track_memory(self, source: Callable[[], dict[str, int]], params: int,
                     sharded_state: int | None = None) -> None:
        """Count what the hook keeps alive with ``source`` (bytes by kind, from tensor metadata: no
        tensor is read), called when a figure is asked for, not every step; ``params``: the model's
        parameters; ``sharded_state``: under FSDP2 the rank's parameter + gradient shards, bytes."""
        self.memory_source = source
        self.memory_params = int(params)
        self.memory_sharded_state = sharded_state

    @property
    def memory_parts(self) -> dict[str, int]:
        """:attr:`memory_overhead_bytes` by kind (``{}`` before the hook bound)."""
        return {k: int(v) for k, v in self.memory_source().items()} if self.memory_source else {}

    @property
    def memory_overhead_bytes(self) -> int:
        """Every byte the hook's state keeps alive between steps (residuals, pending buffers,
        velocities, scratch, the collectives' caches, compressor state)."""
        return sum(self.memory_parts.values())

    def memory(self) -> dict[str, Any]:
        """``{"bytes": total, "by_kind": {kind: bytes}, "bytes_per_param": total / params,
        "by_kind_per_param": {...}}``, plus ``"of_sharded_state"`` (the total over the rank's
        sharded parameters + gradients) under FSDP2."""
        parts = self.memory_parts
        total = sum(parts.values())
        per = max(1, self.memory_params)
        out: dict[str, Any] = {
            "bytes": total, "by_kind": parts, "params": self.memory_params, "bytes_per_param": total / per,
            "by_kind_per_param": {k: v / per for k, v in parts.items()}}
        if self.memory_sharded_state:
            out["of_sharded_state"] = total / self.memory_sharded_state
        return out

    @property
    def compression_ratio(self) -> float:
        """Cumulative dense bytes / bytes sent (``inf`` when nothing was sent, 1.0 before any step)."""
        return _ratio(self.dense_bytes, self.bytes_sent)

    def as_dict(self) -> dict[str, Any]:
        """A plain dict (JSON-friendly) of the cumulative and last-step figures."""
        memory = self.memory()
        return {
            "steps": self.steps,
            "bytes_sent": self.bytes_sent,
            "dense_bytes": self.dense_bytes,
            "compression_ratio": self.compression_ratio,
            "compress_seconds": self.compress_seconds,
            "hook_seconds": self.hook_seconds,
            "memory_overhead_bytes": memory["bytes"],
            "memory": memory,
            "algorithms": dict(self.algorithms),
            "last_step": dict(self.last_step),
            "account": self.account(),
            # process-wide: which backend (torch / numba / cuda) ran each op's last call
            "backends": ops.backends_used(),
        } | ({"auto": self.auto_report()} if self.auto_report is not None else {}) | (
            {"auto_network": self.auto_network()} if self.auto_network is not None else {}) | (
            {"sparse_rows": self.sparse_rows_report()} if self.sparse_rows_report is not None else {})


def _ratio(dense: int, sent: int) -> float:
    if sent == 0:
        return 1.0 if dense == 0 else float("inf")
    return dense / sent


class Timer:
    """``with Timer() as t: ...; t.seconds``; with ``cpu=True`` also ``t.cpu_seconds``, the
    calling thread's CPU time (``time.thread_time``) over the same span."""

    def __init__(self, cpu: bool = False) -> None:
        self._cpu = cpu
        self.seconds = self.cpu_seconds = 0.0

    def __enter__(self) -> "Timer":
        self._c0 = time.thread_time() if self._cpu else 0.0
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self._t0
        if self._cpu:
            self.cpu_seconds = time.thread_time() - self._c0


# --------------------------------------------------------------- fingerprint
def _jsonable(obj: Any) -> Any:
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if isinstance(obj, torch.Size):
        return list(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    return repr(obj)


def canonical_json(config: dict[str, Any]) -> str:
    """Deterministic JSON of ``config`` (sorted keys, no whitespace, dtypes/sizes as text)."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"), default=_jsonable)


def config_fingerprint(config: dict[str, Any]) -> int:
    """A signed 64-bit hash (sha256 prefix) of :func:`canonical_json` of ``config``."""
    digest = hashlib.sha256(canonical_json(config).encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k in obj:
            out.update(_flatten(obj[k], f"{prefix}.{k}" if prefix else str(k)))
        if not obj:
            out[prefix] = {}
        return out
    return {prefix: obj}


def describe_differences(a: dict[str, Any], b: dict[str, Any], limit: int = 8) -> list[str]:
    """Human-readable ``path: a_value != b_value`` lines for the fields that differ."""
    fa = _flatten(json.loads(canonical_json(a)))
    fb = _flatten(json.loads(canonical_json(b)))
    lines = []
    for key in sorted(set(fa) | set(fb)):
        va, vb = fa.get(key, "<missing>"), fb.get(key, "<missing>")
        if va != vb:
            lines.append(f"{key}: {va!r} != {vb!r}")
    if len(lines) > limit:
        lines = lines[:limit] + [f"... and {len(lines) - limit} more"]
    return lines


def check_same_config(config: dict[str, Any], group: dist.ProcessGroup | None = None) -> int:
    """Verify every rank of ``group`` registered the same configuration.

    Wire: one ``all_gather`` of an ``int64`` fingerprint per rank; only on a
    mismatch, an ``all_gather_object`` of the configurations (so every rank can
    name the differences).  Returns the fingerprint.  Raises ``ValueError`` on
    every rank, listing the fields in which some rank differs from rank 0.
    Without an initialized process group (or with one rank) nothing is sent.
    """
    fp = config_fingerprint(config)
    if not dist.is_available() or not dist.is_initialized():
        return fp
    world = dist.get_world_size(group)
    if world <= 1:
        return fp
    device = _collective_device(group)
    mine = torch.tensor([fp], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    fps = [int(t.item()) for t in gathered]
    if all(f == fps[0] for f in fps):
        return fp
    configs: list[Any] = [None] * world
    dist.all_gather_object(configs, config, group=group)
    parts = []
    for r in range(1, world):
        if fps[r] != fps[0]:
            diffs = describe_differences(configs[0], configs[r])
            parts.append(f"rank {r} vs rank 0: " + "; ".join(diffs or ["(fingerprints differ)"]))
    raise ValueError(
        "commpress configuration differs across ranks (every rank must register the same "
        "compressor, parameters, options, world size and model): " + " | ".join(parts)
    )


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ----------------------------------------------------------------- loss scaling
def check_scaler(scaler: Any) -> Any:
    """``scaler`` when it is ``None`` or a ``torch.amp.GradScaler`` (a subclass included, e.g.
    ``torch.cuda.amp.GradScaler``); ``TypeError`` naming the argument otherwise."""
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
    return scaler


def loss_scales(scaler: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(S, 1/S)``: ``scaler``'s current loss scale and its reciprocal, fp32 0-d tensors on
    ``device``, computed on the device from the scaler's own scale tensor (no host read).

    ``None`` (nothing to undo) without a scaler, with a disabled one, and before its first
    ``scaler.scale(...)`` (which creates the scale tensor).  With a power-of-two scale (GradScaler's
    own, from a power-of-two ``init_scale``) multiplying by either is exact (barring under- or
    overflow of the values multiplied)."""
    if scaler is None or not scaler.is_enabled():
        return None
    s = getattr(scaler, "_scale", None)
    if s is None:
        return None
    s = s.detach().reshape(())
    if s.device != device:   # the scaler lives where the loss was: normally the gradients' device
        s = s.to(device)
    s = s.float().clone()     # this step's value, whatever update() does to the scaler's tensor later
    return s, torch.reciprocal(s)


# ----------------------------------------------------------------- hook state
class HookState:
    """Base of the DDP and FSDP2 hook states.

    Holds the resolved ``compressor`` (the user's), the ``codec`` actually run
    (``compressor`` wrapped in ``ErrorFeedback`` when ``uses_error_feedback``),
    the process group, the step counter and :class:`Stats`.  Subclasses extend
    :meth:`config` (the fingerprinted configuration) and
    :meth:`_extra_state_dict` / :meth:`_load_extra_state_dict`.
    """

    kind: str = "hook"

    def __init__(self, compressor: Compressor | str, *, error_feedback: bool | str = "auto",
                 process_group: dist.ProcessGroup | None = None, momentum: float = 0.0,
                 momentum_masking: bool = False, residual_storage: str = HOOK_DEFAULT,
                 rollback: str = "step", **compressor_params: Any) -> None:
        from ..storage import check_storage

        self.residual_storage = check_storage(residual_storage, "residual_storage")
        if rollback not in ROLLBACKS:
            raise ValueError(f"rollback must be one of {', '.join(repr(r) for r in ROLLBACKS)}, got {rollback!r}")
        self.rollback = rollback
        self.compressor = resolve_compressor(compressor, compressor_params)
        if not isinstance(momentum_masking, bool):
            raise TypeError(f"momentum_masking must be a bool, got {type(momentum_masking).__name__}")
        self.momentum_masking = momentum_masking
        self.codec, self.uses_error_feedback = wrap_error_feedback(self.compressor, error_feedback, momentum,
                                                                   momentum_masking, self.residual_storage,
                                                                   hold_pending=rollback == "step")
        self.error_feedback_arg = error_feedback   # momentum taken over later rewraps with it
        self.momentum = float(getattr(self.codec, "momentum", 0.0))
        self.process_group = process_group
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size(process_group)
            self.rank = dist.get_rank(process_group)
        else:
            self.world_size, self.rank = 1, 0
        self.step = 0
        self.stats = Stats()
        self.fingerprint: int | None = None
        self.scaler: Any = None   # see attach_scaler

    # -- AMP loss scaling ------------------------------------------------
    def attach_scaler(self, scaler: Any) -> None:
        """Keep error-feedback residuals (and momentum-correction velocities) in the gradients'
        own units under AMP's loss scaling.

        With ``torch.amp.GradScaler`` the hook sees gradients multiplied by the loss scale
        ``S``, which changes (halved after an overflow, grown every ``growth_interval`` steps):
        state kept in scaled units would be off by the ratio of two steps' scales.  With a
        scaler attached the hook multiplies its input by ``1/S`` before compressing (residuals
        and velocities are then unscaled, the meaning they have in :meth:`state_dict`) and the
        averaged result by ``S`` before handing it back, so ``scaler.unscale_`` /
        ``scaler.step`` see what they expect.  ``S`` is read from the scaler's scale tensor on
        the device (no host read).  Nothing else is sent; the scaler is not part of the
        configuration fingerprint: attach it on every rank alike.

        Args:
            scaler: the ``torch.amp.GradScaler`` that scales the loss, or ``None`` to detach it.
                A disabled scaler (``enabled=False``) does nothing.

        Raises:
            TypeError: ``scaler`` is neither ``None`` nor a ``torch.amp.GradScaler``.
        """
        self.scaler = check_scaler(scaler)
        self._scaler_changed()

    def _scaler_changed(self) -> None:
        """Hook for subclasses that freeze their configuration (DDP)."""

    def _report_auto(self) -> None:
        """Point the stats' ``"auto"`` reports at the current codec: bound methods, not closures
        over this state (the overlap worker holds the stats, and must not keep the state alive)."""
        self.stats.auto_report, self.stats.auto_network = self.codec.report, self.codec.network_report

    # -- configuration ---------------------------------------------------
    def config(self) -> dict[str, Any]:
        """What must agree across ranks and between a checkpoint and its loader."""
        return {
            "kind": self.kind,
            "compressor": self.compressor.name or type(self.compressor).__name__,
            "compressor_params": self.compressor.config(),
            "error_feedback": self.uses_error_feedback,
            "momentum": self.momentum,
            "world_size": self.world_size,
        } | ({"momentum_masking": False} if self.momentum and not self.momentum_masking else {})
        # (absent with masking: checkpoints from before the option, which always masked, still load)

    def holds_state(self) -> bool:
        """Whether the codec holds any tensor yet (residuals, velocities, factors): compressed
        steps have run."""
        return any(True for _ in _tensors_in(self.codec.state_dict()))

    def check_config(self) -> int:
        """Run :func:`check_same_config` on :meth:`config` (collective) and remember the fingerprint."""
        self.fingerprint = check_same_config(self.config(), self.process_group)
        return self.fingerprint

    # -- checkpoints -------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step counter, codec state (residuals, PowerSGD factors) and layout facts.

        Only tensors, numbers, strings, lists and dicts: loads with
        ``torch.load(path, weights_only=True)``.  Residuals are per rank: save
        one file per rank.
        """
        return {
            "format": STATE_FORMAT,
            "kind": self.kind,
            "step": int(self.step),
            "world_size": int(self.world_size),
            "rank": int(self.rank),
            "config": canonical_json(self.config()),
            "codec": self.codec.state_dict(),
            "extra": self._extra_state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises ``ValueError`` when the checkpoint is not a commpress hook state,
        comes from another world size or another rank, or another configuration (compressor,
        parameters, options, model parameter shapes) — naming what differs.
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"state is not a commpress hook state (expected format {STATE_FORMAT!r})")
        if state.get("kind") != self.kind:
            raise ValueError(f"state is a {state.get('kind')!r} hook state, this is a {self.kind!r} hook")
        if int(state["world_size"]) != self.world_size:
            raise ValueError(
                f"checkpoint was saved with world size {state['world_size']}, this run has "
                f"{self.world_size}: error-feedback residuals are per rank and cannot be "
                "re-split; start the new world size without loading the hook state"
            )
        if int(state.get("rank", self.rank)) != self.rank:
            raise ValueError(
                f"checkpoint was saved by rank {state['rank']}, this is rank {self.rank}: "
                "error-feedback residuals and noise generators are per rank; load each rank's own file"
            )
        saved = json.loads(state["config"])
        mine = json.loads(canonical_json(self.config()))
        if saved != mine:
            diffs = describe_differences(saved, mine)
            raise ValueError("checkpoint configuration differs from this hook's: " + "; ".join(diffs))
        self._load_extra_state_dict(state.get("extra", {}), state)
        self.codec.load_state_dict(state["codec"])
        self.step = int(state["step"])

    def _extra_state_dict(self) -> dict[str, Any]:
        return {}

    def _load_extra_state_dict(self, extra: dict[str, Any], state: dict[str, Any]) -> None:
        pass


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)


def codec_memory(codec: Compressor) -> dict[str, int]:
    """Bytes ``codec`` keeps alive between steps, by kind: its own ``memory()`` where it has one
    (:class:`~commpress.ErrorFeedback`, ``"auto"``'s codec), else its state (``"compressor"``)."""
    memory = getattr(codec, "memory", None)
    if callable(memory):
        return dict(memory())
    return {"compressor": tensor_bytes(codec.state_dict())}


def tensor_bytes(tensors: Any) -> int:
    """Total bytes of the tensors found in a (nested) container."""
    seen: set[int] = set()
    total = 0
    for t in _tensors_in(tensors):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
