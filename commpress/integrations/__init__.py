"""Integrations with training frameworks (optional extra ``pip install "commpress[hf]"``).

* :mod:`commpress.integrations.hf` — ``enable(trainer, compressor, **params)`` for a
  Hugging Face ``transformers.Trainer``;
* :mod:`commpress.integrations.accelerate` — ``register(accelerator, model, compressor, **params)``
  for a model prepared by Hugging Face ``accelerate``.

Neither is imported here: ``import commpress`` never imports transformers or
accelerate, and each integration imports its framework only when called.
"""

from __future__ import annotations

__all__ = ["hf", "accelerate"]
