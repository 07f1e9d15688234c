"""What ``"auto"`` measures: codec cost, overlap, gradient-norm change, and their agreement.

* :func:`codec_cost`: seconds of one candidate's compress + decompress at a bucket's size
  on this device, with the ops backend in use (best of a few repetitions; cached by
  device, backend, size, shapes and candidate).  Local: agree it before use.
* :class:`OverlapRecorder` + :func:`overlap`: from the backward start, each bucket's hook
  arrival, the seconds each hook spent (its codec), and the backward end, the backward
  time still to run after each bucket arrives (its hidden window), hooks' time taken out.
* :func:`norm_change`: Accordion's statistic from the gradient norms of two windows.
* :func:`agree`: one ``all_reduce`` (``MAX``; entries to minimise are negated) that makes
  a measurement vector identical on every rank; :func:`agree_measurements` packs a
  :class:`~commpress.auto.decide.Measurements` into it.  Which reduction:

  - times that cost (codec seconds, compute seconds): **max** over ranks: the step waits for
    the slowest rank;
  - hidden windows: **min**: a bucket is hidden only as much as on the rank that hides it least;
  - gradient-norm change: **max**: one rank in a critical regime makes the bucket gentle;
  - sizes: both max and min, so a layout that differs across ranks raises on every rank.

  MAX and MIN are exact in floating point, so every rank ends with bitwise the same
  numbers.  Call it at decision points only: nothing here runs in steady state.
"""

from __future__ import annotations

import math
import os
import time
from typing import Sequence

import torch
import torch.distributed as dist

from ..collectives.costmodel import CostModel
from ..collectives.sparse import WHOLE_CODEC, whole_per_chunk
from ..feedback import ErrorFeedback
from .candidates import Candidate, prototype
from .decide import BucketMeasure, Measurements, Network

# ---------------------------------------------------------------- codec cost
_CODEC: dict[tuple, float] = {}

#: The step :func:`codec_cost` codes at: past any density warm-up (the sparsifiers' default is 200
#: steps), what a choice runs for the rest of the training.
STEADY_STEP = 1 << 30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: :func:`codec_cost` with ``sample``: elementwise codecs are timed on at most this many elements
#: (2 MB of fp32, as much again of residual: beyond a core's L2, as a large unit is) and scaled linearly
CODEC_SAMPLE = 1 << 19


def codec_cost(candidate: Candidate, numel: int, device: torch.device | str = "cpu",
               shapes: Sequence[tuple[int, ...]] | None = None, dtype: torch.dtype = torch.float32,
               reps: int = 3, feedback: bool = True, sample: int | None = None, storage: str = "fp32",
               probes: dict | None = None) -> float:
    """Best-of-``reps`` seconds of ``compress_fixed`` + ``decompress`` of ``candidate`` on a
    ``numel`` tensor on ``device`` (powersgd: each matrix of ``shapes`` in turn, as the
    bucket's collective codes them; pieces it sends as they are cost nothing here).
    ``feedback``: through :class:`~commpress.ErrorFeedback` with a residual in place, as
    ``"auto"`` runs every choice (its compensation and residual passes are part of the cost:
    for blockquant the fused pass costs about twice the plain quantization), the residual kept
    as ``storage`` (:data:`commpress.storage.STORAGES`; the runtime passes the hook's
    ``residual_storage``: a lean store adds its encode and decode passes).  A sparsifier is
    measured at its steady state, after any density warm-up (:data:`STEADY_STEP`), and, under
    feedback, as the collectives send it: the whole tensor in 4 bits where its selection would
    be no smaller (:func:`~commpress.collectives.sparse.whole_per_chunk`).

    One untimed warm-up run first (JIT, allocation).  Cached per (device, ops backend,
    numel, shapes, dtype, candidate): a bucket of a size seen before costs nothing.
    ``sample``: a candidate other than powersgd (whose cost follows its matrices' shapes) on more
    elements than that is timed on ``sample`` elements and scaled by ``numel / sample`` (its
    passes are elementwise: the cost of the check point that times every candidate on every unit
    stays bounded, and units larger than ``sample`` share one measurement; a smaller tensor stays
    in faster caches: 75-90% of the full-size time for the CPU codecs of a 2.2M unit).
    Dense costs 0.  Local to this rank: reduce it with :func:`agree` before deciding.
    ``probes``: a dict the caller keeps for one round of timings (a check point's): the random
    input of a size is drawn once into it and shared by the candidates timed on that size (each
    codec reads it, none writes it); the caller drops it, and the memory with it.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"codec_cost: numel must be an int >= 0, got {numel!r}")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"codec_cost: reps must be an int >= 1, got {reps!r}")
    if candidate.kind == "dense" or numel == 0:
        return 0.0
    if sample is not None and candidate.kind != "powersgd" and numel > sample:
        return codec_cost(candidate, int(sample), device, dtype=dtype, reps=reps, feedback=feedback,
                          storage=storage, probes=probes) * numel / sample
    dev = torch.device(device)
    shp = tuple(tuple(int(x) for x in s) for s in shapes) if shapes else None
    key = (str(dev), os.environ.get("COMMPRESS_BACKEND", ""), numel, shp, str(dtype), candidate, bool(feedback),
           storage if feedback else None)
    if key in _CODEC:
        return _CODEC[key]
    comp = prototype(candidate)
    coder = ErrorFeedback(comp, storage=storage) if feedback else comp
    flat = None if probes is None else probes.get((numel, str(dev), dtype))
    if flat is None:
        gen = torch.Generator(device="cpu").manual_seed(numel)
        flat = torch.randn(numel, generator=gen, dtype=torch.float32).to(device=dev, dtype=dtype)
        if probes is not None:
            probes[(numel, str(dev), dtype)] = flat
    if candidate.kind == "powersgd":
        pieces, pos = [], 0
        for s in (shp or ((numel,),)):
            n = math.prod(s)
            m = flat[pos:pos + n].view(s)
            pos += n
            if comp.is_compressed(m):
                pieces.append(m)
    else:
        pieces = [flat]

    whole = feedback and comp.aggregation == "sparse" and whole_per_chunk(comp, numel, None, dtype)

    def run() -> None:
        for i, x in enumerate(pieces):
            if whole:
                WHOLE_CODEC.decompress(coder.compress_whole(x, WHOLE_CODEC, step=STEADY_STEP, key=("auto-codec-probe", i)))
            else:
                comp.decompress(coder.compress_fixed(x, step=STEADY_STEP, key=("auto-codec-probe", i)))
        _sync(dev)

    run()   # warm-up: JIT, allocations and, with feedback, the residuals the timed runs add
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    _CODEC[key] = best if pieces else 0.0
    return _CODEC[key]


def clear_codec_cache() -> None:
    """Forget every :func:`codec_cost` measurement (tests, a changed backend)."""
    _CODEC.clear()


# ---------------------------------------------------------------- overlap
def overlap(start: float, arrivals: Sequence[float], busy: Sequence[float], end: float) -> list[float]:
    """Hidden window of each bucket, in arrival order: backward seconds still to run after
    its hook fired, with the hooks' own time (``busy``: seconds spent inside each hook,
    its codec) taken out so that the window belongs to the backward pass, not to the
    compressors in use when it was measured.

    ``start``: backward start; ``arrivals``: when each bucket's hook fired (sorted is not
    required: they are taken in the given order, which must be the arrival order);
    ``end``: backward end (after the last hook returned).  A pure function; clamped at 0.
    """
    if len(arrivals) != len(busy):
        raise ValueError(f"overlap: {len(arrivals)} arrivals but {len(busy)} busy times")
    spent_before, net = 0.0, []
    for a, k in zip(arrivals, busy):
        net.append(a - start - spent_before)
        spent_before += k
    backward = end - start - spent_before
    return [max(0.0, backward - a) for a in net]


class OverlapRecorder:
    """Timestamps of one step's backward pass (``time.perf_counter`` seconds, host clock).

    Usage per step: :meth:`begin` when backward starts (e.g. a forward-end hook or the
    first gradient hook), :meth:`arrive` when a bucket's hook fires and :meth:`leave` when it
    returns, :meth:`finish` when backward ends (e.g. the final callback); then
    :meth:`hidden` is the bucket's hidden windows in arrival order.  Windows are averaged
    over the recorded steps (:meth:`mean_hidden`).  Host timestamps only: on CUDA the
    arrival times are the host's view of the autograd engine; no device sync is added.
    """

    def __init__(self) -> None:
        self._start: float | None = None
        self._arrive: dict[str, float] = {}
        self._busy: dict[str, float] = {}
        self._order: list[str] = []
        self._end: float | None = None
        self._sums: dict[str, float] = {}
        self._count = 0

    def begin(self, t: float | None = None) -> None:
        self._start = time.perf_counter() if t is None else t
        self._arrive.clear()
        self._busy.clear()
        self._order.clear()
        self._end = None

    def arrive(self, bucket: str, t: float | None = None) -> None:
        if bucket not in self._arrive:
            self._order.append(bucket)
        self._arrive[bucket] = time.perf_counter() if t is None else t

    def leave(self, bucket: str, t: float | None = None) -> None:
        t = time.perf_counter() if t is None else t
        self._busy[bucket] = self._busy.get(bucket, 0.0) + max(0.0, t - self._arrive.get(bucket, t))

    def finish(self, t: float | None = None) -> list[float]:
        """Ends the step; returns and accumulates its hidden windows (arrival order)."""
        self._end = time.perf_counter() if t is None else t
        if self._start is None:
            raise RuntimeError("OverlapRecorder.finish: begin() was not called this step")
        h = self.hidden()
        for name, w in zip(self._order, h):
            self._sums[name] = self._sums.get(name, 0.0) + w
        self._count += 1
        self._start = None
        return h

    def order(self) -> list[str]:
        """The buckets in the arrival order of the last step."""
        return list(self._order)

    def hidden(self) -> list[float]:
        return overlap(self._start, [self._arrive[b] for b in self._order],
                       [self._busy.get(b, 0.0) for b in self._order], self._end)

    def mean_hidden(self) -> dict[str, float]:
        """``{bucket: mean hidden window}`` over the steps recorded since :meth:`reset`."""
        return {b: s / self._count for b, s in self._sums.items()} if self._count else {}

    def reset(self) -> None:
        self._sums.clear()
        self._count = 0


def norm_change(previous: Sequence[float | None], current: Sequence[float | None]) -> list[float]:
    """Accordion's statistic per bucket: ``|‖g_prev‖ - ‖g_now‖| / ‖g_prev‖``, the gradient norms
    of the previous and the current window (per step: windows differ in length).  1.0 where
    the previous norm is 0 and the current is not (treated as critical); 0.0 where both are
    0, and where either window has no norm (``None``: the bucket did not run through a codec)."""
    if len(previous) != len(current):
        raise ValueError(f"norm_change: {len(previous)} previous norms but {len(current)} current")
    out = []
    for a, b in zip(previous, current):
        if a is None or b is None:
            out.append(0.0)
            continue
        a, b = float(a), float(b)
        if not (math.isfinite(a) and math.isfinite(b)):
            out.append(1.0)
        elif a > 0:
            out.append(abs(a - b) / a)
        else:
            out.append(1.0 if b > 0 else 0.0)
    return out


# ---------------------------------------------------------------- agreement
def agree(values: Sequence[float], ops: Sequence[str], group=None) -> list[float]:
    """``values`` reduced over ``group`` entry by entry: ``ops[i]`` is ``"max"`` or ``"min"``.

    One ``all_reduce(MAX)`` of a float64 vector (``"min"`` entries negated); exact, so every
    rank returns bitwise the same list.  A collective: every rank calls it together with a
    vector of the same length.  Without an initialized process group, returns ``values``.
    """
    if len(values) != len(ops):
        raise ValueError(f"agree: {len(values)} values but {len(ops)} ops")
    bad = [o for o in ops if o not in ("max", "min")]
    if bad:
        raise ValueError(f"agree: ops must be 'max' or 'min', got {bad[0]!r}")
    sign = [1.0 if o == "max" else -1.0 for o in ops]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return [float(v) for v in values]
    from ..collectives import comm_device
    v = torch.tensor([s * float(x) for s, x in zip(sign, values)], dtype=torch.float64,
                     device=comm_device(group))
    dist.all_reduce(v, op=dist.ReduceOp.MAX, group=group)
    return [s * x for s, x in zip(sign, v.cpu().tolist())]


def agree_measurements(network: Network, buckets: Sequence[BucketMeasure], compute_s: float,
                       candidates: Sequence[Candidate], group=None, *, codec_inline: bool = True,
                       extra: Sequence[tuple[float, str]] = ()) -> Measurements:
    """This rank's measurements made identical on every rank (one :func:`agree`).

    Per bucket: numel (max and min: must match), hidden window (min), codec seconds of
    each of ``candidates`` (max; a candidate missing from a bucket's ``codec_s`` on any rank
    stays out of that bucket), norm change (max); then
    compute seconds (max).  ``network`` must already be agreed (the cost model's
    calibration is).

    The vector's length is ``2 + len(buckets) * (4 + 2 * len(candidates)) + 1``: the number of
    buckets and of candidates must be the same on every rank before the call (the hook's
    bind-time configuration check guarantees it; a different length cannot be detected inside
    one collective).  With equal lengths, bucket sizes that differ raise ``ValueError`` on
    every rank together.

    ``extra``: more ``(value, "max" | "min")`` entries agreed in the same collective (same
    number on every rank); their agreed values are ``Measurements.extra``.
    """
    vals: list[float] = [float(len(buckets)), -float(len(buckets))]
    ops: list[str] = ["max", "max"]
    for b in buckets:
        vals += [float(b.numel), float(b.numel), b.hidden_s, b.norm_change]
        ops += ["max", "min", "min", "max"]
        for c in candidates:
            vals.append(float(b.codec_s.get(c, 0.0)))
            ops.append("max")
    vals.append(float(compute_s))
    ops.append("max")
    # a candidate unmeasured on any rank stays out: its "missing" flag, max over ranks
    flags = [0.0 if c in b.codec_s else 1.0 for b in buckets for c in candidates]
    flags += [float(v) for v, _ in extra]
    out = agree(vals + flags, ops + ["max"] * (len(flags) - len(extra)) + [o for _, o in extra], group)
    n_hi, n_lo = out[0], -out[1]
    if n_hi != len(buckets) or n_lo != len(buckets):
        raise ValueError(f"agree_measurements: ranks have different numbers of buckets "
                         f"({int(n_lo)} .. {int(n_hi)})")
    missing = out[len(vals):len(out) - len(extra)]
    agreed_extra = tuple(out[len(out) - len(extra):]) if extra else ()
    pos, agreed = 2, []
    for bi, b in enumerate(buckets):
        hi, lo, hidden, change = out[pos:pos + 4]
        pos += 4
        if hi != lo:
            raise ValueError(f"agree_measurements: bucket {bi} ({b.name!r}) has {int(lo)} elements on "
                             f"some rank and {int(hi)} on another")
        codec = {}
        for ci, c in enumerate(candidates):
            t = out[pos]
            pos += 1
            if missing[bi * len(candidates) + ci] == 0.0:
                codec[c] = t
        agreed.append(BucketMeasure(b.name, b.numel, b.shapes, max(0.0, hidden), codec, max(0.0, change), b.dtype))
    return Measurements(network, tuple(agreed), out[pos], codec_inline, agreed_extra)


def network_from_models(world: int, flat: CostModel, local_size: int = 1, intra: CostModel | None = None,
                        inter: CostModel | None = None) -> Network:
    """A :class:`Network` (the cost models are agreed already when they come from
    :func:`commpress.collectives.costmodel.get_cost_model` or :meth:`Hierarchy.models`)."""
    return Network(world, flat, local_size, intra, inter)
