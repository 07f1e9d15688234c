"""Low-communication training: DiLoCo, Streaming DiLoCo and SparseLoCo.

>>> dl = commpress.diloco.DiLoCo(model, torch.optim.AdamW(model.parameters()), sync_every=100)
>>> for x, y in data:
...     loss_fn(model(x), y).backward()
...     dl.step()          # in place of the inner optimizer's step()
...     dl.zero_grad()
>>> dl.close()             # applies what is in flight: every rank's model holds the global parameters

See :class:`DiLoCo`; SparseLoCo is ``outer_momentum=0`` with
``compressor=commpress.ErrorFeedback(commpress.get("sparseloco"), beta=0.95)``.
"""

from __future__ import annotations

from .core import ALGORITHM, DiLoCo, DiLoCoStats

__all__ = ["ALGORITHM", "DiLoCo", "DiLoCoStats"]
