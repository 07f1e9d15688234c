"""Integrations with training frameworks (optional extra ``pip install "commpress[hf]"``).

* :mod:`commpress.integrations.hf` — ``enable(trainer, compressor, **params)`` for a
  Hugging Face ``transformers.Trainer``;
* :mod:`commpress.integrations.accelerate` — ``register(accelerator, model, compressor, **params)``
  for a model prepared by Hugging Face ``accelerate``;
* :mod:`commpress.integrations.lightning` — ``BindCallback(state)`` binds a
  :class:`~commpress.ddp.DDPState` to the DDP model of a PyTorch Lightning ``Trainer``.

None is imported here: ``import commpress`` never imports transformers, accelerate or
Lightning; ``hf`` and ``accelerate`` import their framework only when called, ``lightning``
when it is imported (its callback subclasses Lightning's ``Callback``).
"""

from __future__ import annotations

__all__ = ["hf", "accelerate", "lightning"]
