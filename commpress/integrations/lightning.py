"""PyTorch Lightning: a callback that binds a :class:`~commpress.ddp.DDPState` to the DDP model.

Lightning takes a DDP comm hook and its state through ``DDPStrategy(ddp_comm_state=...,
ddp_comm_hook=...)``; the state is built before the model and the process group exist, so it
must be bound to the DDP model Lightning builds (:meth:`~commpress.ddp.DDPState.bind`).
:class:`BindCallback` does that on every rank.  Importing this module imports Lightning
(``lightning.pytorch``, else ``pytorch_lightning``) when it is installed; ``import commpress``
never does.
"""

from __future__ import annotations

import logging
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from ..hooks.ddp import DDPState, hook

log = logging.getLogger("commpress")

try:   # the callback must be Lightning's Callback where Lightning runs it
    from lightning.pytorch import Callback as _Base
except ImportError:   # pragma: no cover - depends on what is installed
    try:
        from pytorch_lightning import Callback as _Base
    except ImportError:
        _Base = object


class BindCallback(_Base):
    """Bind a model-free :class:`~commpress.ddp.DDPState` to the DDP model of a Lightning ``Trainer``.

    Lightning wraps the ``LightningModule`` in ``DistributedDataParallel`` inside
    ``trainer.fit``, after the callbacks' ``setup`` and before ``on_fit_start``.  The callback
    binds in ``setup`` when the strategy's model is already the DDP model, and otherwise in
    ``on_fit_start``, the first callback hook after the wrapping; both run on every rank before
    the first backward pass, so the binding (a collective) is explicit and never happens
    inside a step.  Nothing else is sent.

    Lightning (2.6) registers a comm hook only on CUDA; ``register_hook=True`` makes the
    callback register :func:`commpress.ddp.hook` itself (then do not pass the state to
    ``DDPStrategy``).  A state binds to one DDP model: a second ``trainer.fit`` (which wraps the
    module again) needs a new state and callback.

    Args:
        state: the :class:`~commpress.ddp.DDPState`, built without a model
            (``DDPState("blockquant", bits=8)``).
        register_hook: also call ``model.register_comm_hook(state, commpress.ddp.hook)`` after
            binding (for CPU runs, where Lightning's ``DDPStrategy`` registers none).

    Raises:
        TypeError: ``state`` is not a ``DDPState``, or the strategy's model is not a
            ``DistributedDataParallel`` when training starts (another strategy than DDP).

    Example::

        >>> state = commpress.ddp.DDPState("blockquant", bits=8)
        >>> strategy = DDPStrategy(ddp_comm_state=state, ddp_comm_hook=commpress.ddp.hook)
        >>> trainer = pl.Trainer(strategy=strategy, devices=2,
        ...                      callbacks=[commpress.integrations.lightning.BindCallback(state)])
        >>> trainer.fit(module)
        >>> state.stats.compression_ratio
    """

    def __init__(self, state: DDPState, *, register_hook: bool = False) -> None:
        if not isinstance(state, DDPState):
            raise TypeError(f"state must be a commpress.ddp.DDPState, got {type(state).__name__}")
        if not isinstance(register_hook, bool):
            raise TypeError(f"register_hook must be a bool, got {type(register_hook).__name__}")
        super().__init__()
        self.state = state
        self.register_hook = register_hook

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Bind now when the strategy has already wrapped the model in DDP (else at ``on_fit_start``)."""
        if stage == "fit" and isinstance(_model(trainer), DistributedDataParallel):
            self._bind(trainer)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Bind to ``trainer.strategy.model`` (DDP by now), on every rank, before the first step."""
        self._bind(trainer)

    def _bind(self, trainer: Any) -> None:
        if self.state.bound:
            return
        model = _model(trainer)
        if not isinstance(model, DistributedDataParallel):
            raise TypeError("commpress.integrations.lightning.BindCallback: the strategy's model is a "
                            f"{type(model).__name__}, not a DistributedDataParallel (use DDPStrategy; "
                            "FSDP2 models take commpress.fsdp.register)")
        self.state.bind(model)
        if self.register_hook:
            model.register_comm_hook(self.state, hook)
        log.info("commpress lightning: %s bound to the DDP model", self.state.compressor)


def _model(trainer: Any) -> Any:
    """The strategy's (possibly wrapped) model: the ``DistributedDataParallel`` once DDP set it up."""
    return getattr(getattr(trainer, "strategy", None), "model", None)


__all__ = ["BindCallback"]
