"""Alpha-beta(-gamma) cost model that picks a collective algorithm.

Model
-----
The predicted time of an algorithm on the slowest rank is

    T = alpha * messages + beta * bytes + gamma * entries + delta * elements

* ``alpha`` seconds per message (latency), ``beta`` seconds per byte on the
  wire, both *measured once per process group* by :func:`calibrate`: a few
  ``all_reduce`` and ``all_gather`` calls of 256 B .. 1 MiB, each rank's
  best-of-3 time, the max over ranks (one small ``all_reduce``), then a
  least-squares fit of ``t = alpha*m + beta*b`` with ``m`` and ``b`` from the
  accounting model (ring all_reduce: ``m = 2(P-1)``, ``b = 2n(P-1)/P``;
  all_gather: ``m = P-1``, ``b = n(P-1)``);
* ``gamma`` seconds per sparse entry handled locally (sort / scatter-add / pack)
  and ``delta`` seconds per dense element (zero-fill, copy), timed locally in
  the same calibration (max over ranks).

Because the fitted numbers are reduced across ranks before use and the
choice is computed from the all-gathered header only, every rank picks the
same algorithm.  The header also carries each rank's model state
(:func:`model_state`): when any rank has no calibration for the group, all
ranks calibrate together, and :func:`set_cost_model` numbers that differ
across ranks raise on every rank.  Calibrations are cached by the group
object's identity and size.  :func:`set_cost_model` fixes the numbers instead (tests,
benchmarks, users who know their network).

Sparse costs (``k_r`` counts, ``K = sum k_r``, ``n`` numel, ``w`` bytes per entry,
``v`` bytes per value, ``C[s][o]`` the entries rank ``s`` sends to owner ``o``):

* dense: ``2(P-1)`` messages, ``2n v (P-1)/P`` bytes, ``max k`` entries, ``n`` elements;
* allgather: ``P-1`` messages, ``(P-1) w max k`` bytes, ``K`` entries, ``n`` elements;
* recursive doubling: per round 2 messages and ``w s_t`` bytes with the merged set
  ``s_t = min(u, 2^t max k)``; two more steps when P is not a power of two;
* split / hashed: all-to-all (``P-1`` messages, max over ranks of the entries
  sent or received times ``w``), a size all-gather, and an all-gather of the
  largest encoded partition ``min(L v, L/8 + u_o v, u_o w)``, with
  ``u_o = u * sum_s C[s][o] / K`` clamped to its bounds; local work: partition +
  pack ``2 max k`` entries, the owner's reduce, encode and every rank's decode ``2u``.

The union size ``u`` is estimated from a k-minimum-values sketch (the 16
smallest hashes of each rank's indices, carried in the header): with ``v16``
the 16th smallest distinct hash of the union, ``u ~ 15 * 2^32 / v16``; exact
when the union has fewer than 16 entries; always clamped to
``max k <= u <= min(n, K)``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass

import torch

from . import _comm
from .wire import (H_COUNT, H_MODEL, HASH_RANGE, SKETCH, CollectiveInputError, header_hashed, header_sketch,
                   header_split)

log = logging.getLogger("commpress")


@dataclass(frozen=True)
class CostModel:
    """The alpha-beta cost model: seconds per message, per byte, per sparse entry and per dense element.

    What ``algorithm="auto"`` and the hooks' choices read (:func:`get_cost_model`); measured by
    :func:`calibrate` or fixed with :func:`set_cost_model`.

    Attributes:
        alpha: seconds per message.
        beta: seconds per byte.
        gamma: seconds per sparse entry (sort + scatter-add).
        delta: seconds per dense element (fill + add).
    """

    alpha: float
    beta: float
    gamma: float = 1e-8
    delta: float = 5e-10

    def time(self, messages: float = 0, nbytes: float = 0, entries: float = 0, elements: float = 0) -> float:
        return self.alpha * messages + self.beta * nbytes + self.gamma * entries + self.delta * elements


_CACHE = _comm.BoundedCache(1024)   # group key -> calibrated model
_OVERRIDE: CostModel | None = None


def set_cost_model(alpha: float | None, beta: float | None = None, gamma: float = 1e-8,
                   delta: float = 5e-10) -> None:
    """Use fixed numbers for every group instead of calibrating (``set_cost_model(None)`` goes back).

    The model is what ``algorithm="auto"`` and the hooks' choices read; every rank must set the
    same numbers (the header exchange carries their fingerprint).  Nothing is sent.

    Args:
        alpha: seconds per message, or ``None`` to go back to calibration.
        beta: seconds per byte.
        gamma: seconds per sparse entry (sort + scatter-add).
        delta: seconds per dense element (fill + add).

    Raises:
        ValueError: a number that is negative, infinite or missing (``beta``).

    Example::

        >>> commpress.collectives.set_cost_model(20e-6, 1 / 1.25e9)   # 20 µs, 10 Gbit/s
    """
    global _OVERRIDE
    if alpha is None:
        _OVERRIDE = None
        return
    for name, v in (("alpha", alpha), ("beta", beta), ("gamma", gamma), ("delta", delta)):
        if v is None or not (v >= 0) or math.isinf(v):
            raise ValueError(f"set_cost_model: {name} must be a finite number >= 0, got {v!r}")
    _OVERRIDE = CostModel(float(alpha), float(beta), float(gamma), float(delta))


def model_state(group=None) -> int:
    """What this rank would use for ``"auto"``: 0 = must calibrate, 1 = cached calibration,
    ``>= 2`` = a fingerprint of the :func:`set_cost_model` numbers (carried in the header)."""
    if _OVERRIDE is not None:
        import zlib
        return 2 + (zlib.crc32(repr(_OVERRIDE).encode()) & 0x3FFFFFFF)
    return int(_comm.group_key(group) in _CACHE)


def agreed_cost_model(states: list[int], group=None) -> CostModel:
    """The model every rank uses, from all ranks' :func:`model_state` (identical decision on all ranks).

    Fixed numbers must be the same on every rank (else ``ValueError`` on all ranks); when any
    rank has no calibration for ``group``, all ranks calibrate together.
    """
    if any(s >= 2 for s in states):
        if len(set(states)) > 1:
            raise CollectiveInputError("algorithm='auto': set_cost_model() numbers differ across ranks "
                                       "(or are set on some ranks only)")
        return _OVERRIDE
    key = _comm.group_key(group)
    model = _CACHE.get(key)
    if min(states) == 0:
        model = calibrate(group)
        _CACHE.put(key, model)
    elif model is None:  # every rank said it had one a moment ago: only another thread can evict it
        raise RuntimeError("algorithm='auto': the cost model of this group was evicted while in use")
    return model


def get_cost_model(group=None) -> CostModel:
    """The cost model for ``group``: the :func:`set_cost_model` override, the cached calibration,
    or a new calibration.

    A new calibration (:func:`calibrate`) is a collective: every rank of ``group`` must call this
    together (the collectives only do so from ``"auto"``, after the header exchange).

    Args:
        group: the process group (``None``: the default group).

    Returns:
        The :class:`~commpress.collectives.CostModel`, identical on every rank.
    """
    if _OVERRIDE is not None:
        return _OVERRIDE
    key = _comm.group_key(group)
    model = _CACHE.get(key)
    if model is None:
        model = calibrate(group)
        _CACHE.put(key, model)
    return model


#: Timed repetitions per size in :func:`calibrate` (the best one counts).  With one core per rank a
#: collective's time depends on when gloo's threads get the core: six back-to-back calibrations
#: of one loopback pair (2 ranks pinned one core each) read 35–809 µs per message and 416–5627 MB/s
#: with 3 repetitions, 76–137 µs and 865–1571 MB/s with 8 (three pairs each); at an emulated
#: 1 Gbit/s the bandwidth read 105–124 MB/s either way, with fewer α outliers at 8 (1 of 18 fits
#: against 5).  It costs about 150 ms on loopback and 300–450 ms at 1 Gbit/s, once per group.
#: ``COMMPRESS_CALIBRATION_REPS`` replaces it (:func:`calibration_reps`; the test suite runs 3).
CALIBRATION_REPS = 8


def calibration_reps(group=None) -> int:
    """The timed repetitions :func:`calibrate` makes per size: ``COMMPRESS_CALIBRATION_REPS`` (an int
    >= 1) when set, else :data:`CALIBRATION_REPS`; agreed over ``group`` (the largest wins: every rank
    must make the same calls), and a value no rank can use (not an int >= 1) raises ``ValueError`` on
    every rank.  A collective when the group has several ranks."""
    raw = os.environ.get("COMMPRESS_CALIBRATION_REPS", "").strip()
    try:
        reps = int(raw) if raw else CALIBRATION_REPS
    except ValueError:
        reps = 0
    agreed = [reps, reps]
    if _comm.world(group) > 1:
        import torch.distributed as dist
        t = torch.tensor([reps, -reps], dtype=torch.int64, device=_comm.comm_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        agreed = [int(t[0]), -int(t[1])]
    if agreed[1] < 1:
        raise ValueError(f"COMMPRESS_CALIBRATION_REPS must be an int >= 1 on every rank (this rank: {raw!r})")
    return agreed[0]


def _best_of(fn, reps: int = CALIBRATION_REPS) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _fit(rows: list[list[float]], times: list[float]) -> tuple[float, float]:
    """Least squares ``t = alpha*m + beta*b`` by the 2x2 normal equations, in Python floats.

    Deliberately not LAPACK: its result may differ in the last bit between processes, and
    every rank must end with bitwise the same numbers (they decide the algorithm).
    """
    a = sum(m * m for m, _ in rows)
    b = sum(m * n for m, n in rows)
    c = sum(n * n for _, n in rows)
    d = sum(m * t for (m, _), t in zip(rows, times))
    e = sum(n * t for (_, n), t in zip(rows, times))
    det = a * c - b * b
    if det == 0:
        return (d / a if a else 0.0), 0.0
    return (d * c - b * e) / det, (a * e - b * d) / det


def calibrate(group=None, sizes: tuple[int, ...] = (256, 16384, 262144, 1048576)) -> CostModel:
    """Measure the cost model's alpha, beta, gamma and delta on ``group``.

    A collective: a few timed ``all_reduce`` and ``all_gather`` of each size, the best of
    ``COMMPRESS_CALIBRATION_REPS`` repetitions each, a local sort + scatter-add and fill + add,
    then one ``all_reduce`` (max) of the timings, so every rank fits the same numbers.  About
    150 ms on loopback.  :func:`get_cost_model` caches it per group.

    Args:
        group: the process group (``None``: the default group).
        sizes: the message sizes timed, in bytes.

    Returns:
        The :class:`~commpress.collectives.CostModel`, identical on every rank.
    """
    world = _comm.world(group)
    dev = _comm.comm_device(group)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    import torch.distributed as dist

    times = []
    rows = []
    reps = calibration_reps(group)
    if world > 1:
        for nbytes in sizes:
            t = torch.zeros(nbytes // 4, dtype=torch.float32, device=dev)
            out = torch.empty(world * t.numel(), dtype=torch.float32, device=dev)

            def ar():
                dist.all_reduce(t, group=group)
                sync()

            def ag():
                _comm.gather_into(out, t, group=group)
                sync()

            times.append(_best_of(ar, reps))
            rows.append([2.0 * (world - 1), 2.0 * nbytes * (world - 1) / world])
            times.append(_best_of(ag, reps))
            rows.append([float(world - 1), float(nbytes * (world - 1))])
    # local compute: sparse entries (sort + scatter-add) and dense elements (fill + add)
    m, n = 1 << 14, 1 << 18
    g = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.randint(0, n, (m,), generator=g).to(dev)
    val = torch.ones(m, device=dev)
    acc = torch.zeros(n, device=dev)

    def sparse_op():
        s = torch.sort(idx)[0]
        acc.index_add_(0, s, val)
        sync()

    def dense_op():
        z = torch.zeros(n, device=dev)
        z.add_(acc)
        sync()

    times.append(_best_of(sparse_op, reps) / m)
    times.append(_best_of(dense_op, reps) / n)
    tv = torch.tensor(times, dtype=torch.float64, device=dev)
    if world > 1:
        dist.all_reduce(tv, op=dist.ReduceOp.MAX, group=group)
    tv = tv.cpu()
    gamma = max(float(tv[-2]), 1e-9)
    delta = max(float(tv[-1]), 1e-11)
    if world > 1:
        alpha, beta = _fit(rows, tv[:-2].tolist())
        alpha, beta = max(alpha, 1e-6), max(beta, 1e-11)
    else:
        alpha, beta = 1e-6, 1e-11
    model = CostModel(alpha, beta, gamma, delta)
    log.debug("commpress cost model for group of %d ranks: %s", world, model)
    return model


# ---------------------------------------------------------------- sparse
def estimate_union(table: torch.Tensor, numel: int) -> float:
    """Estimated size of the union of the ranks' supports (see module doc)."""
    world = table.shape[0]
    counts = table[:, H_COUNT].tolist()
    lo, hi = max(counts), min(numel, sum(counts))
    if hi <= lo:
        return float(lo)
    h = table[:, header_sketch(world)].reshape(-1)
    h = torch.unique(h[h < HASH_RANGE])
    if h.numel() < SKETCH:
        u = float(h.numel())
    else:
        u = (SKETCH - 1) * HASH_RANGE / (float(h[SKETCH - 1]) + 1.0)
    return float(min(max(u, lo), hi))


def sparse_costs(table: torch.Tensor, numel: int, world: int, value_bytes: int, index_bytes: int,
                 model: CostModel) -> dict[str, float]:
    """Predicted seconds of every sparse algorithm for the gathered header ``table``."""
    P = world
    counts = table[:, H_COUNT].tolist()
    K = sum(counts)
    kmax = max(counts)
    n = numel
    v, w = value_bytes, value_bytes + index_bytes
    u = estimate_union(table, numel)
    c = {}
    c["dense"] = model.time(2 * (P - 1), 2 * n * v * (P - 1) / P, kmax, n)
    c["allgather"] = model.time(P - 1, (P - 1) * w * kmax, K + kmax, n)
    p2 = 1 << (P.bit_length() - 1)
    msgs, nbytes, entries = 0.0, 0.0, float(kmax)
    s = float(kmax)
    if p2 != P:
        msgs, nbytes, s = msgs + 2, nbytes + w * kmax, min(u, 2.0 * kmax)
    t = 1
    while t < p2:
        msgs += 4
        nbytes += 2 * w * s
        entries += 2 * s
        s = min(u, 2.0 * s)
        t <<= 1
    if p2 != P:
        msgs, nbytes = msgs + 2, nbytes + w * u
    c["recursive_doubling"] = model.time(msgs, nbytes, entries + u, n)
    for name, cols, dom in (("split", header_split(P), None), ("hashed", header_hashed(P), n / P)):
        cm = table[:, cols].double()
        sent = (cm.sum(1) - cm.diagonal()).max().item()
        recv_from_others = (cm.sum(0) - cm.diagonal()).max().item()
        owner_load = cm.sum(0)
        enc = 0.0
        for o in range(P):
            L = dom if dom is not None else ((o + 1) * n) // P - (o * n) // P
            lo_o, hi_o = cm[:, o].max().item(), min(L, owner_load[o].item())
            u_o = min(max(u * owner_load[o].item() / K, lo_o), hi_o) if K else 0.0
            enc = max(enc, min(L * v, L / 8 + u_o * v, u_o * w))
        c[name] = model.time(3 * (P - 1), w * max(sent, recv_from_others) + 24 * (P - 1) + enc * (P - 1),
                             2 * kmax + owner_load.max().item() + 2 * u, n)
    return c


def choose_sparse(table: torch.Tensor, numel: int, world: int, value_bytes: int, index_bytes: int,
                  group=None) -> str:
    """The cheapest sparse algorithm (identical on every rank: depends only on gathered data)."""
    model = agreed_cost_model(table[:, H_MODEL].tolist(), group)
    costs = sparse_costs(table, numel, world, value_bytes, index_bytes, model)
    order = ("dense", "allgather", "split", "hashed", "recursive_doubling")  # tie-break
    return min(order, key=lambda a: (costs[a], order.index(a)))


# ---------------------------------------------------------------- quantized
def gather_costs(payload_bytes: int, numel: int, world: int, model: CostModel) -> dict[str, float]:
    """Predicted seconds of the two quantized allreduce variants.

    ``payload_bytes`` is one rank's compressed size of the whole tensor.
    ``two_phase``: all-to-all + all-gather of ``B/P`` pieces, decode ``2n`` + encode ``n/P``;
    ``gather_all``: one all-gather of ``B`` per rank, decode ``P n``.
    """
    P, B, n = world, payload_bytes, numel
    return {
        "two_phase": model.time(2 * (P - 1), 2 * B * (P - 1) / P, 2 * n + n / P, n),
        "gather_all": model.time(P - 1, B * (P - 1), P * n, n),
    }


def choose_gather(payload_bytes: int, numel: int, world: int, model: CostModel) -> str:
    """``"two_phase"`` or ``"gather_all"``, whichever ``model`` predicts faster (ties: by name)."""
    costs = gather_costs(payload_bytes, numel, world, model)
    return min(("two_phase", "gather_all"), key=lambda a: (costs[a], a))


def pipelines_at(model: CostModel, chunk_bytes: list[int], min_wire_s: float) -> bool:
    """Whether ``"gather_all"`` sends each of its P chunks in a message of its own: when ``model``
    puts the largest chunk's all_gather at ``min_wire_s`` or more of bytes on the wire
    (:func:`commpress.collectives.quantized.pipelines` gives the threshold).  A function of agreed
    facts (the calibrated model, the static payload sizes): every rank decides alike."""
    world = len(chunk_bytes)
    return world > 1 and model.beta * (world - 1) * max(chunk_bytes) >= min_wire_s


# ---------------------------------------------------------------- fixed-size (steady state)
FIXED_SPARSE = ("allgather", "dense")


def fixed_sparse_bytes(numel: int, capacity: int, world: int, value_bytes: int,
                       index_bytes: int) -> dict[str, float]:
    """Bytes one rank sends in each fixed-size sparse algorithm:

    * allgather: ``P-1`` messages of ``capacity`` entries plus the status word;
    * dense: a ring all_reduce of ``n`` fp32 values (plus padding and status slots).
    """
    P, n, c = world, numel, capacity
    return {"allgather": (P - 1) * ((value_bytes + index_bytes) * c + 8),
            "dense": 2 * (n + 3) * 4 * (P - 1) / P}


def choose_fixed_sparse(numel: int, capacity: int, world: int, value_bytes: int, index_bytes: int) -> str:
    """``"allgather"`` unless its message is no smaller than the dense all_reduce's.

    By bytes alone, not the calibrated model: whenever the gathered slots are fewer bytes,
    they are also fewer rounds (``P-1`` against ``2(P-1)``) and no more arithmetic (``P·c < n``
    entries scatter-added against ``n`` elements zeroed and reduced), so the all-gather wins
    at any α and β.  A timing-fitted model got this wrong where the fitted β came out near zero
    (loopback, or a shaped link whose burst absorbs the calibration's messages) and flipped
    between runs; a pure function of sizes also makes every rank and a resumed run choose alike.
    """
    b = fixed_sparse_bytes(numel, capacity, world, value_bytes, index_bytes)
    return "allgather" if b["allgather"] < b["dense"] else "dense"
