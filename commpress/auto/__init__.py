"""``"auto"``: a compressor per bucket, chosen from measured network, overlap and codec cost.

The pure decision (:func:`decide`, :class:`Decider`), the measurements it reads
(:mod:`commpress.auto.measure`), switching a bucket's compressor without losing its
error-feedback residual (:mod:`commpress.auto.switch`), and the DDP hook's side of it
(:mod:`commpress.auto.runtime`: ``commpress.ddp.register(model, "auto")``), and the FSDP2 hook's
(:mod:`commpress.auto.fsdp`: ``commpress.fsdp.register(model, "auto")``).  See each module's doc.
"""

from .candidates import DEFAULT_CANDIDATES, DENSE, Candidate, Choice, describe, gentlest
from .decide import (BucketMeasure, Decider, Decision, Measurements, Network, Prices, decide, exposed_seconds,
                     stats_record)
from .measure import OverlapRecorder, agree, agree_measurements, codec_cost, norm_change, overlap
from .runtime import AutoSpec
from .switch import fold_residual, take_residual

#: ``register(model, "auto", auto=commpress.auto.Options(...))``: the ``"auto"`` options, typed
#: and validated where they are built (:class:`~commpress.auto.runtime.AutoSpec`).
Options = AutoSpec

__all__ = [
    "AutoSpec", "BucketMeasure", "Candidate", "Choice", "DEFAULT_CANDIDATES", "DENSE", "Decider", "Decision",
    "Measurements", "Network", "Options", "OverlapRecorder", "Prices", "agree", "agree_measurements", "codec_cost",
    "decide", "describe", "exposed_seconds", "fold_residual", "gentlest", "norm_change", "overlap",
    "stats_record", "take_residual",
]
