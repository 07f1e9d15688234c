"""Hugging Face ``transformers.Trainer``: commpress's DDP hook in one line.

>>> trainer = Trainer(model=model, args=args, train_dataset=data)
>>> state = commpress.integrations.hf.enable(trainer, "blockquant", bits=4)
>>> trainer.train()                                  # or train(resume_from_checkpoint=...)
>>> state.stats.compression_ratio

What it does
------------
``Trainer`` has no comm-hook option, and its DDP wrapper exists only inside
``train()`` (as ``trainer.model_wrapped``; callbacks are handed the unwrapped
model).  :func:`enable` builds the :class:`~commpress.ddp.DDPState` at once
(arguments are checked here, nothing is exchanged) and adds a ``TrainerCallback``
that:

* at ``on_train_begin`` binds the state to ``trainer.model_wrapped`` (collective:
  the configuration fingerprint) and registers :func:`commpress.ddp.hook` on it;
* at ``on_save`` writes each rank's hook state (residuals, step counter, PowerSGD
  factors) into the checkpoint folder the Trainer just saved, as
  ``commpress_rank{r}.pt`` (``r`` the global rank);
* when ``trainer.train(resume_from_checkpoint=...)`` resumes (a folder, or ``True``
  for the last one in ``args.output_dir``), loads each rank's file after binding,
  so the resumed run continues bitwise as if never stopped.  A checkpoint saved
  without commpress resumes with zero residuals (one warning); files for some
  ranks only raise on every rank.

Gradient accumulation works as DDP's does: the Trainer skips synchronization
(``no_sync``) on the micro-steps before the last, and the hook runs on the
synchronized one.  ``ddp_find_unused_parameters=True`` works: DDP hands the hook
zeros for unused parameters, as to its default all-reduce.

One process (no ``torchrun``): :func:`enable` logs one line and does nothing else,
so the same script runs unchanged; the returned state stays unbound
(``state.bound`` is ``False``).  DeepSpeed and FSDP Trainers are refused
(``ValueError``): for FSDP2 use :func:`commpress.integrations.accelerate.register`
or :func:`commpress.fsdp.register` in your own loop.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from ..compressors import Compressor
from ..hooks.ddp import DDPState, hook
from . import _checkpoint

log = logging.getLogger("commpress")

__all__ = ["enable"]

_ATTR = "_commpress_hf_callback"


def enable(trainer: Any, compressor: Compressor | str, **params: Any) -> DDPState:
    """Compress the gradient averaging of ``trainer`` (a ``transformers.Trainer``) with commpress.

    Builds the :class:`~commpress.ddp.DDPState` at once (arguments are checked here,
    nothing is exchanged) and adds a ``TrainerCallback`` that binds it to the
    Trainer's DDP model when training starts and saves / loads it with the
    Trainer's checkpoints.  Call it on every rank with the same arguments, before
    ``trainer.train()``.  One process (not distributed): logs one line and returns
    the state unbound.

    Args:
        trainer: the ``transformers.Trainer`` (a DDP one: not DeepSpeed or FSDP).
        compressor: a :class:`~commpress.Compressor` or a registry name, as in
            :func:`commpress.ddp.register`.
        **params: those of :func:`commpress.ddp.register`: compressor parameters
            such as ``bits=4`` and hook options such as ``error_feedback``,
            ``warmup_steps``, ``overlap``.

    Returns:
        The :class:`~commpress.ddp.DDPState`: it binds when training starts;
        ``state.stats`` holds the bytes sent, ``state.close()`` stops its worker
        thread when training is over.

    Raises:
        ImportError: when ``transformers`` is not installed.
        TypeError: for an object that is not a Trainer (or, when training starts, a
            distributed Trainer whose model is not wrapped in DDP).
        RuntimeError: when commpress is already enabled on it.
        ValueError: for DeepSpeed / FSDP Trainers and for bad hook arguments.

    Example:
        >>> trainer = Trainer(model=model, args=args, train_dataset=data)
        >>> state = commpress.integrations.hf.enable(trainer, "blockquant", bits=4)
        >>> trainer.train()
        >>> state.close()
    """
    try:
        from transformers import Trainer, TrainerCallback
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError('commpress.integrations.hf needs transformers: pip install "commpress[hf]"') from exc

    if not isinstance(trainer, Trainer):
        raise TypeError(f"trainer must be a transformers.Trainer, got {type(trainer).__name__}")
    if getattr(trainer, _ATTR, None) is not None:
        raise RuntimeError("commpress is already enabled on this Trainer (one hook per model)")
    for flag, what in (("is_deepspeed_enabled", "DeepSpeed"), ("is_fsdp_enabled", "FSDP"),
                       ("is_fsdp_xla_enabled", "XLA FSDP")):
        if getattr(trainer, flag, False):
            raise ValueError(
                f"commpress.integrations.hf.enable supports DDP Trainers; this Trainer uses {what}. "
                "For FSDP2 use commpress.integrations.accelerate.register(accelerator, model, ...) or "
                "commpress.fsdp.register(model, ...) in your own training loop")
    state = DDPState(compressor, **params)  # checks the arguments now; binds when training starts
    world = int(trainer.args.world_size)
    if world <= 1:
        log.warning("commpress.integrations.hf: the Trainer runs one process (not distributed): "
                    "gradients are not communicated, so commpress does nothing")
        return state

    class _CommpressCallback(TrainerCallback):
        """Binds the state to ``trainer.model_wrapped``; saves / loads it with the Trainer's checkpoints."""

        def __init__(self) -> None:
            self.resume_dir: str | None = None
            self.model: DistributedDataParallel | None = None

        def on_train_begin(self, args: Any, train_state: Any, control: Any, **kwargs: Any) -> None:
            model = trainer.model_wrapped
            if self.model is None:
                if not isinstance(model, DistributedDataParallel):
                    raise TypeError(
                        f"commpress.integrations.hf: the Trainer runs {world} processes but wrapped its "
                        f"model in {type(model).__name__}, not DistributedDataParallel")
                state.bind(model)                      # collective: configuration fingerprint
                model.register_comm_hook(state, hook)
                self.model = model
                log.info("commpress.integrations.hf: %s registered on the Trainer's DDP model", state.compressor)
            elif model is not self.model:
                raise RuntimeError("commpress.integrations.hf: the Trainer wrapped its model again; a "
                                   "DDP hook state belongs to one model (call enable on a new Trainer)")
            if self.resume_dir is not None:
                _checkpoint.load(state, self.resume_dir)
                self.resume_dir = None

        def on_save(self, args: Any, train_state: Any, control: Any, **kwargs: Any) -> None:
            if self.model is None:
                return
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

            _checkpoint.save(state, os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{train_state.global_step}"))

    callback = _CommpressCallback()
    trainer.add_callback(callback)
    setattr(trainer, _ATTR, callback)
    _capture_resume(trainer, callback)
    return state


def _capture_resume(trainer: Any, callback: Any) -> None:
    """Wrap ``trainer.train`` (this instance only) to learn the folder it resumes from.

    Callbacks are not told which checkpoint ``train(resume_from_checkpoint=...)``
    loads; the wrapper resolves it as the Trainer does (``True``: the last
    checkpoint in ``args.output_dir``) and hands it to the callback.
    """
    from transformers.trainer_utils import get_last_checkpoint

    train = trainer.train
    signature = inspect.signature(train)

    @functools.wraps(train)
    def train_and_resume_hook_state(*args: Any, **kwargs: Any) -> Any:
        ckpt = signature.bind_partial(*args, **kwargs).arguments.get("resume_from_checkpoint")
        if ckpt is True:
            ckpt = get_last_checkpoint(trainer.args.output_dir)   # None: the Trainer raises itself
        callback.resume_dir = os.fspath(ckpt) if ckpt not in (None, False) else None
        return train(*args, **kwargs)

    trainer.train = train_and_resume_hook_state
