"""Hugging Face ``accelerate``: commpress on a prepared model in one line.

>>> accelerator = Accelerator()                      # Accelerator(cpu=True) on CPU-only machines
>>> model, opt, loader = accelerator.prepare(model, opt, loader)
>>> state = commpress.integrations.accelerate.register(accelerator, model, "blockquant", bits=4)
>>> accelerator.save_state("ckpt")  /  accelerator.load_state("ckpt")   # carry the residuals

Why not ``DistributedDataParallelKwargs(comm_hook=...)``: accelerate accepts only its
own ``DDPCommunicationHookType`` enum there; a custom hook (or any string) is
accepted and silently ignored.  :func:`register` instead registers
:func:`commpress.ddp.hook` on the DDP model ``accelerator.prepare`` returned
(:func:`commpress.ddp.register`), or, for an FSDP2 model (accelerate's
``FullyShardedDataParallelPlugin(fsdp_version=2)``), installs the compressed
reduce-scatter on its FSDP units (:func:`commpress.fsdp.register`).

Checkpoints: ``accelerator.register_for_checkpointing(state)`` would save rank 0's
state only, and residuals are per rank.  :func:`register` adds a save-state
pre-hook that writes each rank's hook state as ``commpress_rank{r}.pt`` into the
folder ``save_state`` writes, and a load-state pre-hook that reads it back in
``load_state`` (all ranks agree first that the files are there; see
:mod:`commpress.integrations._checkpoint`), so a resumed run is bitwise the
uninterrupted one.

Gradient accumulation with ``accelerator.accumulate(model)`` works: accelerate
skips synchronization (``no_sync``) on the micro-steps before the last.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..compressors import Compressor
from ..hooks import ddp as _ddp
from ..hooks import fsdp as _fsdp
from ..hooks.common import HookState
from . import _checkpoint

log = logging.getLogger("commpress")

__all__ = ["register"]


def register(accelerator: Any, model: torch.nn.Module, compressor: Compressor | str,
             **params: Any) -> HookState:
    """Compress the gradient communication of ``model``, prepared by ``accelerator``.

    Collective: call it on every rank with the same arguments.  Also registers the
    save / load state pre-hooks that put each rank's hook state into
    ``accelerator.save_state`` folders and restore it in ``load_state``.

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model``.
        model: the object ``accelerator.prepare`` returned: a
            ``DistributedDataParallel`` (multi-process CPU or GPU) gets the DDP hook
            (:func:`commpress.ddp.register`); an FSDP2 model gets the compressed
            reduce-scatter (:func:`commpress.fsdp.register`).
        compressor: a :class:`~commpress.Compressor` or a registry name, passed on to
            :func:`commpress.ddp.register` / :func:`commpress.fsdp.register`.
        **params: passed on with ``compressor``: compressor parameters (e.g.
            ``bits=4``) and the options of the register function used.

    Returns:
        The hook state: a :class:`~commpress.ddp.DDPState` for a DDP model, an
        ``FSDPState`` for an FSDP2 model.

    Raises:
        ImportError: when ``accelerate`` is not installed.
        RuntimeError: when the model is not distributed (one process: launch
            several, and pass ``Accelerator(cpu=True)`` on machines without GPUs).
        TypeError: for an object that is not an ``Accelerator`` or a model that
            ``accelerator.prepare`` did not wrap.
        ValueError: for FSDP1 (use ``fsdp_version=2``) and for a DDP comm hook
            accelerate already registered.

    Example:
        >>> model, opt, loader = accelerator.prepare(model, opt, loader)
        >>> state = commpress.integrations.accelerate.register(accelerator, model, "blockquant", bits=4)
        >>> accelerator.save_state("ckpt")   # carries each rank's residuals
    """
    try:
        from accelerate import Accelerator
        from accelerate.utils import DistributedType
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError('commpress.integrations.accelerate needs accelerate: pip install "commpress[hf]"') from exc

    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"accelerator must be an accelerate.Accelerator, got {type(accelerator).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be the torch.nn.Module accelerator.prepare returned, got {type(model).__name__}")
    kind = accelerator.distributed_type
    if accelerator.num_processes <= 1 or kind == DistributedType.NO:
        raise RuntimeError(
            f"commpress.integrations.accelerate.register: the model is not distributed (accelerate runs "
            f"{accelerator.num_processes} process, distributed type {kind}), so there are no gradients to "
            "communicate. Launch several processes (accelerate launch --num_processes 2 script.py, or "
            "torchrun --nproc_per_node 2 script.py); on a machine without GPUs also create "
            "Accelerator(cpu=True): without it accelerate runs one process even under torchrun")
    if kind == DistributedType.FSDP:
        version = getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1)
        if version != 2:
            raise ValueError(
                f"commpress supports FSDP2 only; this Accelerator uses FSDP{version} "
                "(FullyShardedDataParallelPlugin(fsdp_version=2))")
    if any(isinstance(m, _fsdp.FSDPModule) for m in model.modules()):
        state: HookState = _fsdp.register(model, compressor, **params)
    elif isinstance(model, DistributedDataParallel):
        _refuse_accelerate_comm_hook(accelerator)
        state = _ddp.register(model, compressor, **params)
    else:
        raise TypeError(
            f"model must be what accelerator.prepare returned (DistributedDataParallel or an FSDP2 model) "
            f"for distributed type {kind}; got {type(model).__name__}. Pass the prepared model, not the "
            "original one")

    def save_hook(models: list[torch.nn.Module], weights: list[Any], output_dir: str) -> None:
        _checkpoint.save(state, output_dir)

    def load_hook(models: list[torch.nn.Module], input_dir: str) -> None:
        _checkpoint.load(state, input_dir)

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    log.info("commpress.integrations.accelerate: %s on %s, hook state saved with save_state",
             state.compressor, type(model).__name__)
    return state


def _refuse_accelerate_comm_hook(accelerator: Any) -> None:
    """DDP takes one comm hook: refuse when accelerate registered its own (``comm_hook=`` in its kwargs)."""
    from accelerate.utils import DDPCommunicationHookType as Hook

    hook_type = getattr(getattr(accelerator, "ddp_handler", None), "comm_hook", Hook.NO)
    if hook_type in (Hook.FP16, Hook.BF16, Hook.POWER_SGD, Hook.BATCHED_POWER_SGD):
        raise ValueError(
            f"accelerate already registered its DDP comm hook {hook_type!s} (DistributedDataParallelKwargs("
            "comm_hook=...)); DDP allows one hook per model: drop comm_hook from the kwargs handler")
    if hook_type not in (None, Hook.NO):
        log.warning("commpress.integrations.accelerate: DistributedDataParallelKwargs(comm_hook=%r) was "
                    "ignored by accelerate (it takes only its DDPCommunicationHookType enum)", hook_type)
