"""Taking over the optimizer's SGD momentum: DGC's momentum correction, by default.

Sparsified gradients with error feedback converge at DDP's step count only when
the momentum is applied *before* the selection (momentum correction, Lin et al.
2018): the hook keeps a velocity ``u = m u + g`` per compressed tensor, sends the
top entries of ``u + residual`` and zeroes the sent coordinates of ``u`` and of the
residual (momentum factor masking).  The optimizer must then not apply momentum a
second time.  ``register(..., optimizer=opt)`` (or ``state.attach_optimizer(opt)``
when the optimizer is made after the hook, as in Lightning) does both halves:

* reads the SGD momentum ``m`` of the parameter groups that hold the hook's
  parameters and turns on ``momentum=m`` in the hook (error feedback with momentum
  correction for the compressed parameters, plain momentum for
  the ones DDP sends dense, kept in the same error-feedback memory);
* sets those groups' ``momentum`` to 0 and drops their ``momentum_buffer`` state;
  the group remembers ``m`` under the key ``"commpress_momentum"`` (so an optimizer
  checkpoint saved during training, loaded before or after registration, is
  recognised as taken over);
* :meth:`TakeoverMixin.close` puts ``m`` back (the optimizer starts new momentum
  buffers: the hook's velocity lives per bucket, not per parameter).

Momentum factor masking (DGC zeroes ``u`` where a coordinate was sent) is off in
the hooks by default (``momentum_masking=False``): a coordinate that is sent at
every step then sees exactly SGD's momentum, and a gradient's total effect,
``g/(1-m)``, is kept (only delayed) for the others.  With masking, a coordinate
sent often loses its momentum, so the dense early steps of the density warm-up
behave like SGD without momentum: on the digits task, topk 1% with masking took
2.45-3.1x DDP's steps to the target, without 1.0-1.03x (both with the warm-up;
2 seeds, ``python -m benchmarks sweep --tasks digits --configs convergence``).  ``momentum_masking=True`` restores DGC's rule.

The velocity is in the hook's ``state_dict()`` (the error-feedback codec's
``velocities`` and DDP's ``dense_velocity``), so resume is bitwise.

What can be taken over, per parameter group that holds the hook's parameters:

* ``torch.optim.SGD`` (and subclasses) with ``momentum > 0``, ``dampening == 0``,
  ``nesterov=False``, the same ``m`` in every such group: taken over;
* ``nesterov=True`` or ``dampening != 0``: ``ValueError`` (the correction is
  heavy-ball momentum ``u = m u + g``; Nesterov's look-ahead and a damped
  ``(1 - d) g`` cannot be reproduced by it), as are groups with different
  momenta, and a group that mixes the hook's parameters with others (its
  ``momentum`` cannot be set for only some of them);
* ``weight_decay != 0``: taken over; the decay stays in the optimizer and is no
  longer accumulated into the momentum (its steady-state effect is ``1 - m``
  times what it was: one line is logged; scale ``weight_decay`` by ``1/(1 - m)``
  to keep it);
* any other optimizer (Adam, AdamW, RMSprop, ...) or SGD without momentum: one
  line is logged and nothing changes; with a sparsifier and an optimizer other than
  SGD, a warning says that blockquant or bf16 keep an adaptive optimizer's convergence
  (a coordinate moves only in the steps that select it); ``"auto"`` with such an
  optimizer leaves the sparsifiers out of its default candidates (one log line).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .common import wrap_error_feedback

log = logging.getLogger("commpress")

#: The param-group key that remembers a taken-over momentum (saved with the optimizer's state).
MARK = "commpress_momentum"


def _groups_of(optimizer: torch.optim.Optimizer, covered: set[int]) -> list[tuple[int, dict]]:
    """The ``(index, group)`` of ``optimizer`` holding the hook's parameters (``ValueError``
    for a group that holds some of them and other parameters too)."""
    out = []
    for i, group in enumerate(optimizer.param_groups):
        mine = [id(p) in covered for p in group["params"]]
        if not any(mine):
            continue
        if not all(mine):
            raise ValueError(
                f"optimizer: param group {i} holds both parameters of the hooked model and "
                f"{mine.count(False)} other(s); its momentum cannot be taken over for only some of "
                "them: put the model's parameters in groups of their own")
        out.append((i, group))
    return out


def sgd_momentum(optimizer: Any, covered: set[int]) -> float:
    """The SGD momentum to take over from ``optimizer`` for the parameters whose ``id`` is in
    ``covered``: ``m > 0``, or ``0.0`` when there is none (logged once).  Raises
    ``TypeError`` for a non-optimizer and ``ValueError`` for what cannot be taken over
    (see the module doc)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(optimizer, torch.optim.SGD):
        log.info("commpress: optimizer %s has no SGD momentum to take over; it is left as it is "
                 "(no momentum correction)", type(optimizer).__name__)
        return 0.0
    groups = _groups_of(optimizer, covered)
    momenta = {}
    for i, group in groups:
        m = float(group.get(MARK, group.get("momentum", 0.0)))
        if m and group.get("nesterov", False):
            raise ValueError(
                f"optimizer: param group {i} uses nesterov=True, which the hook's momentum "
                "correction (heavy-ball u = m*u + g) cannot reproduce; use nesterov=False "
                "or register without optimizer=")
        if m and float(group.get("dampening", 0.0)) != 0.0:
            raise ValueError(
                f"optimizer: param group {i} uses dampening={group['dampening']}, which the hook's "
                "momentum correction (u = m*u + g) cannot reproduce; use dampening=0 or register "
                "without optimizer=")
        momenta[i] = m
    values = set(momenta.values())
    if len(values) > 1:
        raise ValueError(f"optimizer: the param groups of the hooked model use different momenta "
                         f"{momenta}; the hook takes over one momentum")
    m = values.pop() if values else 0.0
    if not m:
        log.info("commpress: optimizer %s has no momentum on the model's parameters; it is left as "
                 "it is (no momentum correction)", type(optimizer).__name__)
        return 0.0
    for i, group in groups:
        wd = float(group.get("weight_decay", 0.0))
        if wd:
            log.info("commpress: param group %d keeps weight_decay=%g in the optimizer, no longer "
                     "accumulated into the momentum the hook took over (its steady-state effect is "
                     "%.3g of before; scale weight_decay by 1/(1-m) to keep it)", i, wd, 1.0 - m)
    return m


class Takeover:
    """The momentum taken over from one optimizer: :meth:`apply` zeroes it, :meth:`restore` puts it back.

    Groups are found again at :meth:`restore` (``optimizer.load_state_dict`` replaces
    the group dicts): every group of the hook's parameters that carries the mark.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, covered: set[int], momentum: float) -> None:
        self.optimizer = optimizer
        self.covered = covered
        self.momentum = momentum

    def apply(self) -> None:
        for _, group in _groups_of(self.optimizer, self.covered):
            group[MARK] = self.momentum
            group["momentum"] = 0.0
            for p in group["params"]:
                self.optimizer.state.get(p, {}).pop("momentum_buffer", None)

    def restore(self) -> None:
        for group in self.optimizer.param_groups:
            if MARK in group and any(id(p) in self.covered for p in group["params"]):
                group["momentum"] = group.pop(MARK)


def _warn_sparse_adaptive(compressor: Any, optimizer: Any) -> None:
    """One warning for a sparsifier with an optimizer that normalizes per coordinate (Adam,
    RMSprop, ...): it sees a coordinate's accumulated gradient only in the steps that select it, so
    most coordinates move at a fraction of its learning rate."""
    if getattr(compressor, "aggregation", None) != "sparse" or isinstance(optimizer, torch.optim.SGD):
        return
    _warn_adaptive(getattr(compressor, "name", compressor), optimizer)


def _warn_adaptive(what: str, optimizer: Any) -> None:
    log.warning("commpress: %s with %s: a sparsifier's error feedback sends each coordinate's accumulated "
                "gradient only in the steps that select it, and a per-coordinate adaptive optimizer then "
                "moves most coordinates at a fraction of its learning rate (this project's LM under AdamW: "
                "topk 1%% ended 3.6%% above DDP's loss after 600 steps, blockquant 4-bit 0.2%%); blockquant or "
                "bf16 keep an adaptive optimizer's convergence", what, type(optimizer).__name__)


class TakeoverMixin:
    """``attach_optimizer`` and the restoring ``close`` of the DDP and FSDP2 hook states.

    The host class provides ``_covered_parameter_ids()`` (``None`` while the
    parameters are not known yet: the takeover then waits for
    :meth:`_take_pending_optimizer`, called when they are) and, optionally,
    ``_codec_changed()`` (to rebuild what depends on the codec's configuration: the momentum,
    or ``"auto"``'s candidates, :meth:`_narrow_auto`).
    """

    _takeover: Takeover | None = None
    _pending_optimizer: torch.optim.Optimizer | None = None

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> float:
        """Take over ``optimizer``'s SGD momentum (see :mod:`commpress.hooks.optimizer`).

        For an optimizer made after the hook (Lightning): call it on every rank
        before the first compressed step (``RuntimeError`` afterwards).  When the
        hook is bound already, the changed configuration is checked across ranks
        again (one ``all_gather``).  Returns the momentum taken over (0.0: none,
        nothing changed).  On a state not bound yet (``DDPState("topk", ...)``)
        the takeover happens at binding.
        """
        if self._takeover is not None:
            raise RuntimeError("an optimizer is attached to this hook already")
        covered = self._covered_parameter_ids()
        if covered is None:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
            self._pending_optimizer = optimizer
            return 0.0
        m = sgd_momentum(optimizer, covered)
        if not m:
            if getattr(self, "auto", False):
                self._narrow_auto(optimizer)
            else:
                _warn_sparse_adaptive(getattr(self, "compressor", None), optimizer)
            return 0.0
        if not getattr(self, "compressed_param_names", True):  # DDP with nothing to compress
            log.info("commpress: the hook compresses none of the model's parameters (DDP's dense path, "
                     "no momentum there); the optimizer keeps its momentum")
            return 0.0
        if m != self.momentum:
            if self.momentum:
                raise ValueError(f"momentum={self.momentum} was given and the optimizer has momentum {m}: "
                                 "give one of them (optimizer= takes the optimizer's)")
            if self.holds_state():
                raise RuntimeError("attach_optimizer: the hook has compressed steps already (it holds "
                                   "residuals); attach the optimizer before the first compressed step")
            self.codec, self.uses_error_feedback = wrap_error_feedback(
                self.compressor, getattr(self, "error_feedback_arg", "auto"), m,
                getattr(self, "momentum_masking", False), self._storage_with_momentum(),
                hold_pending=getattr(self, "rollback", "step") == "step")
            self.momentum = m
            self._codec_changed()
            if self.fingerprint is not None:
                self.check_config()   # the momentum is fingerprinted: every rank must agree
        self._takeover = Takeover(optimizer, covered, m)
        self._takeover.apply()
        log.info("commpress: took over the optimizer's momentum %g (momentum correction in the hook; "
                 "the optimizer's momentum is 0 until close())", m)
        note = self._takeover_memory_note()
        if note:
            log.warning(note)
        return m

    def _storage_with_momentum(self) -> str:
        """The residuals' storage once momentum correction is on (FSDP2 changes a default that is
        for error feedback without it)."""
        return getattr(self, "residual_storage", "fp32")

    def _takeover_memory_note(self) -> str | None:
        """What taking over the momentum costs in memory, when a user should hear it (one log line;
        ``None``: nothing to say).  FSDP2 overrides it: the velocity is not sharded."""
        return None

    def _codec_changed(self) -> None:
        """Rebuild what depends on the codec's configuration (a host class overrides it)."""

    def _narrow_auto(self, optimizer: torch.optim.Optimizer) -> None:
        """``"auto"`` with an optimizer that normalizes per coordinate (anything but SGD): the
        sparsifiers leave its default candidates (one log line), as a sparsifier alone would warn
        (:func:`_warn_sparse_adaptive`); candidates the user gave stay, with that warning.  Before
        the first check point only (``RuntimeError`` afterwards): what was decided is not undone."""
        from ..auto.candidates import describe

        spec = self.compressor
        sparse = spec.sparse_candidates()
        if isinstance(optimizer, torch.optim.SGD) or not sparse:
            return
        names = ", ".join(describe(c) for c in sparse)
        if spec.user_candidates:
            _warn_adaptive(f"auto's candidates given ({names})", optimizer)
            return
        if getattr(self.codec, "checks", 0) or self.holds_state():
            raise RuntimeError("attach_optimizer: 'auto' has decided already; attach the optimizer before the "
                               "first compressed step")
        self.compressor = spec.without_sparsifiers()
        if getattr(self, "inner", None) is spec:
            self.inner = self.compressor
        self._codec_changed()   # the auto codec is rebuilt on the narrowed candidates
        if self.fingerprint is not None:
            self.check_config()    # the candidates are fingerprinted: every rank must agree
        log.info("commpress: auto with %s: the sparsifiers (%s) are left out of the candidates (a per-coordinate "
                 "adaptive optimizer moves a coordinate only in the steps that select it)",
                 type(optimizer).__name__, names)

    def _take_pending_optimizer(self) -> None:
        """Run a deferred :meth:`attach_optimizer` now that the parameters are known."""
        if self._pending_optimizer is not None:
            optimizer, self._pending_optimizer = self._pending_optimizer, None
            self.attach_optimizer(optimizer)

    def release_optimizer(self) -> None:
        """Give the optimizer its momentum back (``close()`` does it)."""
        if self._takeover is not None:
            self._takeover.restore()
            self._takeover = None

    def close(self) -> None:
        """Give the optimizer its momentum back."""
        self.release_optimizer()
