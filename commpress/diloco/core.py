""":class:`DiLoCo`: the outer loop of DiLoCo, Streaming DiLoCo and SparseLoCo."""

from __future__ import annotations

import math
import numbers
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import collectives
from ..compressors import Compressor, get
from ..feedback import ErrorFeedback
from ._exec import Exchange, Inline, Worker, make_executor

# one fixed algorithm per aggregation kind: the same on every rank and in every process
# (no calibration), and for "gather" the all-gather (no re-compression by an owner)
ALGORITHM = {"sum": "allreduce", "sparse": "allgather", "gather": "gather_all", "lowrank": "powersgd"}

_STATE_KEYS = {"version", "inner_steps", "exchanges", "skipped", "global", "momentum", "feedback", "in_flight",
               "config", "bytes_sent", "bytes_received"}


@dataclass(frozen=True)
class DiLoCoStats:
    """Traffic of this rank since construction (or the loaded checkpoint's, continued).

    Bytes are counted by :class:`commpress.collectives.CommStats`'s convention (what
    this rank handed to ``torch.distributed``, headers included).  A *sync* is one
    outer step of the whole model (every fragment once); an *exchange* is one
    fragment's.  ``ddp_bytes_per_step`` is what DDP's fp32 ring all_reduce of the
    same parameters sends per step, and ``reduction`` its ratio to
    ``bytes_per_inner_step``.  ``memory_overhead_bytes``: what DiLoCo keeps beside the model
    and its inner optimizer, by kind in ``memory``: the fp32 global copy, the outer momentum
    and the pseudo-gradient buffer of every fragment (12 bytes per parameter), the
    compressor's state (error-feedback residuals), the exchanges in flight and the
    collectives' caches.
    """

    inner_steps: int
    exchanges: int
    syncs: float
    skipped_syncs: int
    bytes_sent: int
    bytes_received: int
    bytes_per_sync: float
    bytes_per_inner_step: float
    ddp_bytes_per_step: float
    reduction: float
    memory_overhead_bytes: int = 0
    memory: dict = field(default_factory=dict)


class _Fragment:
    """Parameters synced together, with their fp32 global copy and outer momentum."""

    def __init__(self, index: int, params: list[nn.Parameter], offset: int) -> None:
        self.index = index
        self.params = params
        self.offset = offset  # inner steps mod sync_every at which it is sent
        self.numel = sum(p.numel() for p in params)
        device = params[0].device
        self.global_ = torch.empty(self.numel, dtype=torch.float32, device=device)
        self.momentum = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.delta = torch.empty(self.numel, dtype=torch.float32, device=device)
        self.read_local(self.global_)

    def read_local(self, out: torch.Tensor) -> torch.Tensor:
        pos = 0
        for p in self.params:
            out[pos:pos + p.numel()].copy_(p.detach().reshape(-1))
            pos += p.numel()
        return out

    def write_local(self, src: torch.Tensor) -> None:
        pos = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(src[pos:pos + p.numel()].view(p.shape))
                pos += p.numel()


class DiLoCo:
    """Train a replicated model with rare, compressed synchronizations (DiLoCo family).

    Args:
        model: the replicated module (a plain ``nn.Module``, not wrapped in DDP); its
            trainable parameters (``requires_grad``) are synced, all on one device.
            Rank 0's values are broadcast at construction.
        inner_optimizer: a ``torch.optim.Optimizer`` over the model's parameters.
        sync_every: H, inner steps between two syncs of a fragment (>= 1).
        outer_lr: the outer SGD's learning rate, a finite number > 0 (DiLoCo: 0.7).
        outer_momentum: the outer SGD's momentum, in [0, 1) (DiLoCo: 0.9).
            ``outer_momentum=0`` is plain averaging scaled by ``outer_lr`` (SparseLoCo).
        nesterov: Nesterov momentum in the outer SGD (DiLoCo: ``True``).
        compressor: ``None`` (dense fp32), a registered name (built with
            ``compressor_params``), a :class:`~commpress.Compressor` (wrapped in
            ``ErrorFeedback``), or an :class:`~commpress.ErrorFeedback` used as given
            (its ``beta`` is SparseLoCo's error-feedback decay).
        fragments: F, Streaming DiLoCo's fragments: the parameters, in order, cut into F
            groups of about equal size; fragment ``f`` is sent when the inner step
            count is ``(f+1)*H//F`` modulo H (staggered; F=1: every H steps).  At most
            the number of trainable parameters and ``sync_every``.
        overlap: τ, the inner steps between sending a fragment and applying its
            outer step (``True`` = 1, or 0 when H = 1; ``False`` = 0; ``0 <= τ < H``).  With τ > 0 and
            more than one rank the exchange runs on a worker thread with a process
            group of its own (on a side stream on CUDA) during the next τ inner
            steps; when applied, the fragment's local parameters are replaced by the
            new global ones (the τ local steps on that fragment are dropped, so
            replicas stay bitwise identical).
        process_group: the data-parallel group (default: the world).
        **compressor_params: the compressor's parameters, with a registered name.

    Raises:
        ValueError: for a bad configuration on any rank, or configurations that differ
            between ranks (on every rank).

    Example:
        >>> dl = DiLoCo(model, torch.optim.AdamW(model.parameters()), sync_every=100,
        ...             compressor="topk", ratio=0.01)
        >>> for batch in loader:
        ...     model(batch).backward()
        ...     dl.step()
        ...     dl.zero_grad()
        >>> dl.close()

    Every rank holds the whole ``model`` (a plain ``nn.Module``, not wrapped in DDP)
    and runs ``inner_optimizer`` on its own data.  The loop is::

        loss.backward()
        dl.step()        # in place of inner_optimizer.step()
        dl.zero_grad()
        ...
        dl.close()       # or the end of ``with DiLoCo(...) as dl:``

    Every ``sync_every`` (H) inner steps each fragment of the parameters is
    synchronized: the pseudo-gradient ``Δ = θ_global − θ_local`` (fp32) goes through
    ``compressor`` with error feedback (:class:`commpress.ErrorFeedback`), is summed
    over the ranks by :func:`commpress.collectives.allreduce` and averaged; the outer
    optimizer (SGD, ``outer_lr``, ``outer_momentum``, Nesterov when ``nesterov``)
    steps ``θ_global`` with it, and the local parameters are set to ``θ_global``.

    Wire per sync: ``compressor=None`` sends the fp32 pseudo-gradient in one
    ``all_reduce`` (DDP's traffic once per H steps); otherwise what the compressor
    sends for a tensor of the fragment's size (``dl.stats`` counts it).

    Guarantees: replicas are bitwise identical after every sync; :meth:`state_dict`
    holds the global parameters, outer momentum, residuals, in-flight fragments and
    step count (save it with the model's and the inner optimizer's for a bitwise
    resume); a bad configuration on any rank, or configurations that differ,
    raise ``ValueError`` on every rank; a failed exchange raises on every rank; a
    NaN/inf in any rank's pseudo-gradient skips that fragment's outer step
    everywhere (global parameters, momentum and residuals unchanged; every rank's
    local parameters go back to the global ones).  The inner optimizer's own state
    is not touched: keep non-finite gradients out of it (e.g. AMP's GradScaler).

    A run ends with one model: :meth:`close` (or leaving a ``with`` block without an
    exception) applies the exchanges still in flight and writes the global parameters
    into every rank's model (:meth:`finish`), so the replicas are bitwise identical;
    ``step()`` raises afterwards.  Save a checkpoint for resuming before it.
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, *, sync_every: int,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 compressor: str | Compressor | None = None, fragments: int = 1, overlap: bool | int = True,
                 process_group: dist.ProcessGroup | None = None, **compressor_params: Any) -> None:
        errors: list[str] = []
        params: list[nn.Parameter] = []
        if not isinstance(model, nn.Module):
            errors.append(f"model must be a torch.nn.Module, got {type(model).__name__}")
        else:
            params = [p for p in model.parameters() if p.requires_grad]
            if not params:
                errors.append("model has no trainable parameters")
            elif len({p.device for p in params}) > 1:
                errors.append("model's parameters must all be on one device, got "
                              f"{sorted({str(p.device) for p in params})}")
            if isinstance(model, nn.parallel.DistributedDataParallel):
                errors.append("model must be the plain module, not a DistributedDataParallel")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            errors.append(f"inner_optimizer must be a torch.optim.Optimizer, got {type(inner_optimizer).__name__}")
        if not _is_int(sync_every) or sync_every < 1:
            errors.append(f"sync_every must be an integer >= 1, got {sync_every!r}")
        if not _is_real(outer_lr) or not (0 < outer_lr < math.inf):
            errors.append(f"outer_lr must be a finite number > 0, got {outer_lr!r}")
        if not _is_real(outer_momentum) or not (0 <= outer_momentum < 1):
            errors.append(f"outer_momentum must be a number in [0, 1), got {outer_momentum!r}")
        if not isinstance(nesterov, bool):
            errors.append(f"nesterov must be True or False, got {nesterov!r}")
        if not _is_int(fragments) or fragments < 1:
            errors.append(f"fragments must be an integer >= 1, got {fragments!r}")
        elif params and _is_int(sync_every) and fragments > min(len(params), sync_every):
            errors.append(f"fragments must be at most the number of trainable parameters ({len(params)}) "
                          f"and sync_every ({sync_every}), got {fragments}")
        tau = int(overlap) if isinstance(overlap, (bool, numbers.Integral)) else -1
        if overlap is True and sync_every == 1:
            tau = 0  # nothing to overlap with: the next step is the next sync
        if tau < 0 or (_is_int(sync_every) and sync_every >= 1 and tau >= sync_every):
            errors.append(f"overlap must be True, False or an integer in [0, sync_every), got {overlap!r}")
        comp: ErrorFeedback | None = None
        try:
            comp = _build_compressor(compressor, compressor_params)
        except (TypeError, ValueError) as exc:
            errors.append(str(exc))

        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        self.config = {
            "sync_every": sync_every, "outer_lr": outer_lr, "outer_momentum": outer_momentum,
            "nesterov": nesterov, "fragments": fragments, "overlap": tau,
            "compressor": None if comp is None else collectives.fingerprint(comp),
            "numels": [p.numel() for p in params],
        }
        _agree(errors, self.config, process_group, self.world_size)  # raises on every rank

        self.model = model
        self.inner_optimizer = inner_optimizer
        self.sync_every = int(sync_every)
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.nesterov = bool(nesterov) and self.outer_momentum > 0
        self.tau = tau
        self.compressor = comp
        self._dense = collectives.unwrap(get("identity")) if comp is None else None
        self.algorithm = ALGORITHM[comp.aggregation] if comp is not None else "allreduce"
        if self.world_size > 1:
            src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
            with torch.no_grad():
                for p in params:
                    dist.broadcast(p.data, src=src, group=process_group)
        self._fragments = [_Fragment(f, group, ((f + 1) * self.sync_every // fragments) % self.sync_every)
                           for f, group in enumerate(_split(params, fragments))]
        self._numel = sum(f.numel for f in self._fragments)
        self.inner_steps = 0
        self._exchanges = 0
        self._skipped: list[torch.Tensor] = []  # 0-d bool per applied exchange, read only by .stats
        self._bytes = [0, 0]
        self._in_flight: list[Exchange] = []
        self._closed = False
        self._executor: Inline | Worker = make_executor(process_group, self.tau > 0 and self.world_size > 1)
        self._stop_worker = None
        if isinstance(self._executor, Worker):
            # dropped without close(): stop the worker (which never holds this object); its group
            # stays until the process ends (a group's shutdown may be collective on some backends)
            self._stop_worker = weakref.finalize(self, self._executor.stop)
            self._stop_worker.atexit = False

    # ------------------------------------------------------------------ loop
    def step(self) -> None:
        """``inner_optimizer.step()``, then the outer work due at this inner step:
        apply the exchanges that arrive now, send the fragments that are due."""
        self._check_open()
        self.inner_optimizer.step()
        self.inner_steps += 1
        t = self.inner_steps
        while self._in_flight and self._in_flight[0].apply_at <= t:
            self._apply(self._in_flight.pop(0))
        for frag in self._fragments:
            if t % self.sync_every == frag.offset:
                item = self._send(frag)
                if self.tau == 0:
                    self._apply(item)
                else:
                    self._in_flight.append(item)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``inner_optimizer.zero_grad(set_to_none)``."""
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def _send(self, frag: _Fragment) -> Exchange:
        delta = frag.read_local(frag.delta)
        torch.sub(frag.global_, delta, out=delta)
        item = Exchange(frag.index, self.inner_steps, self.inner_steps + self.tau)
        number = self._exchanges + len(self._in_flight)
        group = self._executor.group if self._executor.group is not None else self.process_group
        seed = (self.rank * 0x9E3779B1 + number * 0x85EBCA77 + frag.index) & 0x7FFFFFFFFFFFFFFF

        def run() -> tuple[torch.Tensor, int, int]:
            stats = collectives.CommStats()
            comp = self.compressor if self.compressor is not None else self._dense
            out = collectives.allreduce(delta, comp, group=group, key=("diloco", frag.index), step=number,
                                        algorithm=self.algorithm, stats=stats, generator=seed)
            return out, stats.bytes_sent, stats.bytes_received

        if isinstance(self._executor, Worker):
            self._executor.submit(item, run, delta.device)
        else:
            self._executor.submit(item, run)
        return item

    def _apply(self, item: Exchange) -> None:
        """The outer step of one fragment (skipped on the device when the sum is non-finite)."""
        frag = self._fragments[item.fragment]
        avg = item.wait().div_(self.world_size)
        bad = ~torch.isfinite(avg.sum())
        m = self.outer_momentum
        if m > 0:
            buf = torch.mul(frag.momentum, m).add_(avg)  # torch.optim.SGD's momentum buffer
            update = torch.add(avg, buf, alpha=m) if self.nesterov else buf
            torch.where(bad, frag.momentum, buf, out=frag.momentum)
        else:
            update = avg
        torch.where(bad, frag.global_, torch.add(frag.global_, update, alpha=-self.outer_lr), out=frag.global_)
        frag.write_local(frag.global_)
        self._exchanges += 1
        self._skipped.append(bad)
        if len(self._skipped) > 64:
            self._skipped = [torch.stack([f.to(torch.int64) for f in self._skipped]).sum()]
        self._bytes[0] += item.bytes_sent
        self._bytes[1] += item.bytes_received

    def _drain(self) -> None:
        """Wait for every in-flight exchange (their results stay to be applied on time)."""
        for item in self._in_flight:
            item.wait()

    # ------------------------------------------------------------------ reporting
    @property
    def stats(self) -> DiLoCoStats:
        """Traffic so far (reads the skipped-sync flags on the host)."""
        skipped = int(sum(int(s) for s in self._skipped))
        sent, received = self._bytes
        syncs = self._exchanges / len(self._fragments)
        ddp = 2 * 4 * self._numel * (self.world_size - 1) / self.world_size
        per_step = sent / self.inner_steps if self.inner_steps else 0.0
        memory = self._memory()
        return DiLoCoStats(
            inner_steps=self.inner_steps, exchanges=self._exchanges, syncs=syncs, skipped_syncs=skipped,
            bytes_sent=sent, bytes_received=received, bytes_per_sync=sent / syncs if syncs else 0.0,
            bytes_per_inner_step=per_step, ddp_bytes_per_step=ddp,
            reduction=ddp / per_step if per_step else math.inf,
            memory_overhead_bytes=sum(memory.values()), memory=memory)

    def _memory(self) -> dict[str, int]:
        """Bytes kept beside the model, by kind (metadata only: no tensor is read)."""
        from ..hooks.common import codec_memory, tensor_bytes

        frag = self._fragments
        out = {"global": tensor_bytes([f.global_ for f in frag]),
               "outer_momentum": tensor_bytes([f.momentum for f in frag]),
               "delta": tensor_bytes([f.delta for f in frag]),
               "in_flight": tensor_bytes([vars(e) for e in self._in_flight]),
               "flags": tensor_bytes(self._skipped),   # the skipped-sync verdicts, read by stats
               "collectives": collectives.cached_bytes()}
        if self.compressor is not None:
            for kind, n in codec_memory(self.compressor).items():
                out[f"compressor.{kind}"] = n
        return out

    def global_parameters(self) -> list[torch.Tensor]:
        """The fp32 global parameters θ_global, one flat tensor per fragment (live buffers)."""
        return [f.global_ for f in self._fragments]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Global parameters, outer momentum, error-feedback residuals, in-flight fragments
        (waited for: their summed pseudo-gradients), step and traffic counters.  Loads with
        ``torch.load(weights_only=True)``.  Save the model's and the inner optimizer's state
        with it."""
        self._drain()
        skipped = int(sum(int(s) for s in self._skipped))
        return {
            "version": 1, "inner_steps": self.inner_steps, "exchanges": self._exchanges, "skipped": skipped,
            "global": [f.global_.clone() for f in self._fragments],
            "momentum": [f.momentum.clone() for f in self._fragments],
            "feedback": self.compressor.state_dict() if self.compressor is not None else {},
            "in_flight": [{"fragment": i.fragment, "sent_at": i.sent_at, "apply_at": i.apply_at,
                           "result": i.wait().clone(), "bytes": [i.bytes_sent, i.bytes_received]}
                          for i in self._in_flight],
            "config": {k: v for k, v in self.config.items() if k != "numels"},
            "bytes_sent": self._bytes[0], "bytes_received": self._bytes[1],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (on every rank; collective: the ranks check that they
        loaded the same step). The local parameters come from the model's own state."""
        if not isinstance(state, dict) or set(state) != _STATE_KEYS:
            raise ValueError(f"diloco state must have keys {sorted(_STATE_KEYS)}")
        mine = {k: v for k, v in self.config.items() if k != "numels"}
        if state["config"] != mine:
            raise ValueError(f"diloco state was saved with configuration {state['config']}, this one is {mine}")
        shapes = [f.numel for f in self._fragments]
        for name in ("global", "momentum"):
            got = [t.numel() for t in state[name]]
            if got != shapes:
                raise ValueError(f"diloco state {name!r} has fragments of {got} entries, the model has {shapes}")
        self._drain()
        for f, g, m in zip(self._fragments, state["global"], state["momentum"]):
            f.global_.copy_(g)
            f.momentum.copy_(m)
        if self.compressor is not None:
            self.compressor.load_state_dict(state["feedback"])
        self.inner_steps = int(state["inner_steps"])
        self._exchanges = int(state["exchanges"])
        device = self._fragments[0].global_.device
        self._skipped = [torch.tensor(int(state["skipped"]), device=device)]
        self._bytes = [int(state["bytes_sent"]), int(state["bytes_received"])]
        self._in_flight = []
        for d in state["in_flight"]:
            item = Exchange(int(d["fragment"]), int(d["sent_at"]), int(d["apply_at"]))
            item.bytes_sent, item.bytes_received = (int(b) for b in d["bytes"])
            item.finish(d["result"].to(device=device, dtype=torch.float32).clone())
            self._in_flight.append(item)
        _agree([], {"inner_steps": self.inner_steps, "exchanges": self._exchanges}, self.process_group,
               self.world_size, what="loaded state")

    # ------------------------------------------------------------------ lifetime
    def finish(self) -> None:
        """End the run with one model: apply every exchange still in flight (waited for; with
        overlap the last one usually is), then set every fragment's local parameters to the
        global ones.  Afterwards every rank's model holds θ_global, bitwise identical.

        Call it on every rank at the same inner step (:meth:`close` and the end of a ``with``
        block do).  It issues no collective of its own (the worker's exchanges are already
        under way on every rank).  The local steps since each fragment's last sync are dropped,
        as a sync drops them; to keep them, stop right after a sync is applied.  Raises what a
        failed exchange raised."""
        self._check_open()
        while self._in_flight:
            self._apply(self._in_flight.pop(0))
        for frag in self._fragments:
            frag.write_local(frag.global_)

    def close(self) -> None:
        """:meth:`finish` the run, then stop the worker thread and release its process group.
        The worker is released even when finishing raises.  Idempotent."""
        if self._closed:
            return
        try:
            self.finish()
        finally:
            self._release()

    def _release(self) -> None:
        self._closed = True
        self._executor.close()
        if self._stop_worker is not None:
            self._stop_worker.detach()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("commpress diloco: this DiLoCo was closed (its run is finished)")

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        """:meth:`close`; when the block raised, only release the worker (the ranks may
        be at different steps: nothing is waited for or applied)."""
        if exc_type is None:
            self.close()
        else:
            self._release()

    def __repr__(self) -> str:
        comp = None if self.compressor is None else self.compressor.name
        return (f"DiLoCo(sync_every={self.sync_every}, outer_lr={self.outer_lr}, "
                f"outer_momentum={self.outer_momentum}, nesterov={self.nesterov}, compressor={comp}, "
                f"fragments={len(self._fragments)}, overlap={self.tau})")


# ---------------------------------------------------------------------- helpers
def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(float(x))


def _build_compressor(compressor: Any, params: dict[str, Any]) -> ErrorFeedback | None:
    if compressor is None:
        if params:
            raise ValueError(f"compressor parameters {sorted(params)} given without a compressor")
        return None
    if isinstance(compressor, str):
        return ErrorFeedback(get(compressor, **params))
    if params:
        raise ValueError("compressor parameters can only be given with a compressor name")
    if isinstance(compressor, ErrorFeedback):
        return compressor
    if isinstance(compressor, Compressor):
        return ErrorFeedback(compressor)
    raise TypeError(f"compressor must be None, a registered name or a commpress Compressor, got "
                    f"{type(compressor).__name__}")


def _split(params: list[nn.Parameter], fragments: int) -> list[list[nn.Parameter]]:
    """``params`` in order, cut into ``fragments`` non-empty groups of about equal numel
    (a group closes once its parameters reach its share; each keeps at least one)."""
    total = sum(p.numel() for p in params)
    groups: list[list[nn.Parameter]] = []
    i, seen = 0, 0
    for j in range(fragments):
        group = [params[i]]
        seen += params[i].numel()
        i += 1
        last = len(params) - (fragments - 1 - j)  # leave one parameter for each later group
        target = (j + 1) * total / fragments
        while i < last and (j == fragments - 1 or seen + params[i].numel() / 2 <= target):
            group.append(params[i])
            seen += params[i].numel()
            i += 1
        groups.append(group)
    return groups


def _agree(errors: list[str], config: dict[str, Any], group, world: int, what: str = "configuration") -> None:
    """Exchange every rank's local errors and ``config``; raise the same ``ValueError`` on
    every rank when any rank has an error or the configurations differ."""
    if world == 1 or not dist.is_initialized():
        if errors:
            raise ValueError("commpress diloco: " + "; ".join(errors))
        return
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (errors, config), group=group)
    bad = [(r, e) for r, (e, _) in enumerate(everyone) if e]
    if bad:
        raise ValueError("commpress diloco: " + "; ".join(f"rank {r}: {'; '.join(e)}" for r, e in bad))
    differ = sorted(k for k in config if any(c.get(k) != config[k] for _, c in everyone))
    if differ:
        shown = ", ".join(f"{k}: {[c.get(k) for _, c in everyone]}" for k in differ)
        raise ValueError(f"commpress diloco: the {what} differs across ranks ({shown})")
