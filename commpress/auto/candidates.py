"""The compressors ``"auto"`` chooses among, and how a choice is named.

A :class:`Candidate` is a compressor kind and its one parameter: ``dense``,
``bf16``, ``blockquant(bits=8|4)``, ``topk(ratio=...)``, ``powersgd(rank=...)``.
A :class:`Choice` is a candidate and the path it runs on (``"flat"``, or
``"two_level"`` through a :class:`~commpress.collectives.Hierarchy`).

``aggressiveness`` orders the candidates of one family (a higher number sends
less); Accordion's critical regimes keep only the least aggressive of each
family (:func:`gentlest`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..compressors import base as _registry
from ..compressors._util import DEFAULT_DENSITY_WARMUP
from ..compressors.base import Compressor

KINDS = ("dense", "bf16", "blockquant", "topk", "powersgd")
PATHS = ("flat", "two_level")


@dataclass(frozen=True, order=True)
class Candidate:
    """One compressor configuration: ``kind`` in :data:`KINDS` and its parameter.

    ``param`` is ``bits`` for blockquant (8 or 4), ``ratio`` for topk (in (0, 1)),
    ``rank`` for powersgd (>= 1), and ``None`` for dense and bf16.
    """

    kind: str
    param: float | int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Candidate: kind must be one of {KINDS}, got {self.kind!r}")
        p = self.param
        if self.kind in ("dense", "bf16"):
            if p is not None:
                raise ValueError(f"Candidate: {self.kind} takes no param, got {p!r}")
        elif self.kind == "blockquant":
            if p not in (2, 4, 8) or isinstance(p, bool):
                raise ValueError(f"Candidate: blockquant bits must be 2, 4 or 8, got {p!r}")
        elif self.kind == "topk":
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p < 1.0:
                raise ValueError(f"Candidate: topk ratio must be a number in (0, 1), got {p!r}")
        elif isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"Candidate: powersgd rank must be an int >= 1, got {p!r}")

    @property
    def feedback(self) -> bool:
        """Whether the kind is biased and runs under error feedback (all but dense and bf16)."""
        return self.kind in ("blockquant", "topk", "powersgd")

    @property
    def aggressiveness(self) -> float:
        """Larger sends less, within a family: bits 8 < 4; ratio 0.1 < 0.01; rank 4 < 1."""
        if self.kind == "blockquant":
            return 32.0 / self.param
        if self.kind == "topk":
            return 1.0 / self.param
        if self.kind == "powersgd":
            return 1.0 / self.param
        return 1.0 if self.kind == "bf16" else 0.0

    def build(self) -> Compressor:
        """A new compressor of this kind (``identity`` for dense), without error feedback; topk with
        the hooks' density warm-up (:data:`~commpress.compressors._util.DEFAULT_DENSITY_WARMUP`)."""
        if self.kind == "dense":
            return _registry.get("identity")
        if self.kind == "bf16":
            return _registry.get("bf16")
        if self.kind == "blockquant":
            return _registry.get("blockquant", bits=int(self.param))
        if self.kind == "topk":   # the hooks' training policy: the density warm-up
            return _registry.get("topk", ratio=float(self.param), density_warmup=DEFAULT_DENSITY_WARMUP)
        return _registry.get("powersgd", rank=int(self.param))


@dataclass(frozen=True, order=True)
class Choice:
    """A candidate on a path: what one bucket runs."""

    candidate: Candidate
    path: str = "flat"

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"Choice: path must be one of {PATHS}, got {self.path!r}")


DENSE = Choice(Candidate("dense"))

#: The default set: dense, bf16, blockquant 8/4 bits, topk 10%/1%, powersgd rank 1/4.
DEFAULT_CANDIDATES: tuple[Candidate, ...] = (
    Candidate("dense"), Candidate("bf16"), Candidate("blockquant", 8), Candidate("blockquant", 4),
    Candidate("topk", 0.1), Candidate("topk", 0.01), Candidate("powersgd", 4), Candidate("powersgd", 1),
)

_PARAM_NAME = {"blockquant": "bits", "topk": "ratio", "powersgd": "rank"}


def describe(choice: Choice | Candidate) -> str:
    """``"dense"``, ``"bf16"``, ``"blockquant(bits=4)"``, ``"topk(ratio=0.01)"``,
    ``"powersgd(rank=1)"``; ``"+two_level"`` appended for the two-level path."""
    c = choice.candidate if isinstance(choice, Choice) else choice
    text = c.kind if c.param is None else f"{c.kind}({_PARAM_NAME[c.kind]}={c.param:g})"
    if isinstance(choice, Choice) and choice.path == "two_level":
        text += "+two_level"
    return text


def gentlest(candidates: tuple[Candidate, ...] | list[Candidate]) -> tuple[Candidate, ...]:
    """The candidates left in a critical regime: dense, bf16, and the least aggressive
    member of each compressing family (order kept)."""
    least: dict[str, float] = {}
    for c in candidates:
        least[c.kind] = min(least.get(c.kind, float("inf")), c.aggressiveness)
    return tuple(c for c in candidates if c.aggressiveness == least[c.kind])


_BUILT: dict[Candidate, Compressor] = {}


def prototype(candidate: Candidate) -> Compressor:
    """One shared compressor per candidate for predictions (payload-size probes, codec timing).

    Kept alive for the process so probe caches keyed by the object stay valid; never used
    to send (its warm starts are scratch).
    """
    if candidate not in _BUILT:
        _BUILT[candidate] = candidate.build()
    return _BUILT[candidate]
