"""Thin, accounted wrappers around the torch.distributed primitives we use.

Every wrapper charges :class:`~commpress.collectives.accounting.CommStats` by the
convention documented in :mod:`commpress.collectives.accounting`, and does
nothing (and charges nothing) in a one-rank group.

Every wrapper first calls the fault hook (:func:`set_fault_hook`, public as
``commpress.collectives.set_fault_hook``) with its name, so tests can make a rank
raise, hang or die at a chosen point of a protocol without replacing these
functions.  The torch.distributed functions are looked up at call time.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from typing import Callable

import torch
import torch.distributed as dist

from .accounting import CommStats, all_gather_cost, all_reduce_cost, reduce_scatter_cost


def world(group=None) -> int:
    """Size of ``group`` (1 when torch.distributed is not initialized)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def rank(group=None) -> int:
    """This process's rank in ``group`` (0 when not initialized)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


_GROUP_SERIALS: "weakref.WeakKeyDictionary[object, int]" = weakref.WeakKeyDictionary()
_SERIALS = itertools.count()
_SERIALS_LOCK = threading.Lock()


def group_key(group=None) -> tuple:
    """A hashable identity of ``group`` for caches: a serial number the group object gets on
    first use (held weakly), never its ``id()``.  A group created after another was destroyed
    can reuse the dead one's address on one rank and not on another; a cache keyed by the
    address then handed one rank the old group's calibration while the other calibrated,
    a collective the first never joined (seen as gloo's "3948 vs 64" size mismatch)."""
    g = group if group is not None else (dist.group.WORLD if dist.is_initialized() else None)
    if g is None:
        return (None, world(group))
    with _SERIALS_LOCK:
        try:
            serial = _GROUP_SERIALS.get(g)
            if serial is None:
                serial = _GROUP_SERIALS[g] = next(_SERIALS)
        except TypeError:  # an object without weak references: its address, as before
            serial = ("id", id(g))
    return (serial, world(group))


def comm_device(group=None, like: torch.Tensor | None = None) -> torch.device:
    """The device for the collectives' small bookkeeping tensors (headers, status words).

    Args:
        group: the process group (``None``: the default group).
        like: a tensor whose device wins when given.

    Returns:
        ``like``'s device, else the current CUDA device for an NCCL group, else the CPU.
    """
    if like is not None and isinstance(like, torch.Tensor):
        return like.device
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_into(out: torch.Tensor, t: torch.Tensor, group=None, async_op: bool = False):
    """torch's all-gather into one flat tensor (``all_gather_single`` since torch 2.13,
    ``all_gather_into_tensor`` before), looked up at call time; with ``async_op`` its work."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, t, group=group, async_op=async_op)


_FAULT_HOOK: Callable[[str], None] | None = None


def set_fault_hook(hook: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """For tests: call ``hook(name)`` before every torch.distributed call of the collectives.

    ``name`` is the wrapper's: ``"all_gather"``, ``"all_gather_into"``, ``"all_reduce_"``,
    ``"all_to_all_bytes"``, ``"all_to_all_"``, ``"exchange"``; in this process only.

    Args:
        hook: a callable of the name; it may raise, block or end the process.  ``None``
            removes it.

    Returns:
        The previous hook (or ``None``).
    """
    global _FAULT_HOOK
    previous, _FAULT_HOOK = _FAULT_HOOK, hook
    return previous


def _enter(name: str) -> None:
    if _FAULT_HOOK is not None:
        _FAULT_HOOK(name)


_CACHES: list["BoundedCache"] = []   # every cache of the collectives, for cached_bytes()


class BoundedCache:
    """A dict of at most ``limit`` entries (the least recently used evicted), safe across
    threads.  Every module-level cache of the collectives is one, keyed by what it depends
    on (the group's :func:`group_key` where it depends on the group)."""

    def __init__(self, limit: int) -> None:
        self._d: dict = {}
        self._limit = limit
        self._lock = threading.Lock()
        _CACHES.append(self)

    def get(self, key, default=None):
        with self._lock:
            value = self._d.pop(key, None)
            if value is None:
                return default
            self._d[key] = value   # most recently used last
            return value

    def put(self, key, value) -> None:
        with self._lock:
            self._d.pop(key, None)
            self._d[key] = value
            while len(self._d) > self._limit:
                self._d.pop(next(iter(self._d)))

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._d

    def clear(self) -> None:
        with self._lock:
            self._d.clear()

    def values(self) -> list:
        with self._lock:
            return list(self._d.values())


_SCRATCH = BoundedCache(16)


def scratch(tag: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable buffer of ``n`` elements (contents undefined): a view of one buffer per
    ``(tag, dtype, device)`` and thread, grown to the largest ``n`` asked, the last few kept
    (fresh large allocations cost page faults on every call; one per size would keep the
    model's size alive when every bucket has its own).  Never return it to a caller: it is
    overwritten by the next call of the same tag."""
    key = (tag, dtype, str(device), threading.get_ident())
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.empty(n, dtype=dtype, device=device)
        _SCRATCH.put(key, buf)
    return buf[:n]


def clear_caches() -> None:
    """Drop every tensor the collectives' caches keep (the next calls allocate them again).

    Process-wide; nothing is sent.  The hooks' ``stats`` count these bytes
    (:func:`cached_bytes`).
    """
    for cache in _CACHES:
        cache.clear()


def cached_bytes() -> int:
    """Bytes of the tensors the collectives' caches keep alive (process-wide, every thread's).

    The reusable buffers of the collectives' scratch, the sparse collectives' hash domains, ...;
    each storage counted once.  :func:`clear_caches` drops them.

    Returns:
        The number of bytes.
    """
    seen: set[int] = set()
    total = 0
    stack = [v for cache in _CACHES for v in cache.values()]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            st = v.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        elif isinstance(v, (tuple, list)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return total


def _charge(stats: CommStats | None, cost: tuple[int, int, int], t0: float | None = None) -> None:
    """Charge one round of ``cost`` (and the host seconds since ``t0``) to ``stats``."""
    if stats is not None:
        stats.add(*cost, rounds=1, seconds=0.0 if t0 is None else time.perf_counter() - t0)


def all_gather(t: torch.Tensor, group=None, stats: CommStats | None = None) -> torch.Tensor:
    """All-gather a same-shape tensor from every rank: returns ``[P, *t.shape]``."""
    _enter("all_gather")
    p = world(group)
    t = t.contiguous()
    if p == 1:
        return t.unsqueeze(0).clone()
    out = torch.empty(p * t.numel(), dtype=t.dtype, device=t.device)
    t0 = time.perf_counter()
    gather_into(out, t.reshape(-1), group=group)
    _charge(stats, all_gather_cost(t.numel() * t.element_size(), p), t0)
    return out.reshape((p,) + tuple(t.shape))


class Gathering:
    """An all-gather in flight (:func:`all_gather_start`): :meth:`wait` returns ``[P, *shape]``
    and charges ``stats`` with the round and the host seconds spent issuing and waiting."""

    def __init__(self, work, out: torch.Tensor, shape: tuple, cost: tuple[int, int, int],
                 stats: CommStats | None, issued: float) -> None:
        self._work, self._out, self._shape = work, out, shape
        self._cost, self._stats, self._issued = cost, stats, issued

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        self._work.wait()
        if self._stats is not None:
            self._stats.add(*self._cost, rounds=1, seconds=self._issued + time.perf_counter() - t0)
        return self._out.reshape(self._shape)


def all_gather_start(t: torch.Tensor, group=None, stats: CommStats | None = None) -> Gathering:
    """Start an all-gather of a same-shape tensor from every rank (``P >= 2``); the caller
    keeps ``t`` unchanged until :meth:`Gathering.wait`.  What a pipeline overlaps its next
    piece's compression (and its last piece's decoding) with."""
    _enter("all_gather")
    p = world(group)
    t = t.contiguous()
    out = torch.empty(p * t.numel(), dtype=t.dtype, device=t.device)
    t0 = time.perf_counter()
    work = gather_into(out, t.reshape(-1), group=group, async_op=True)
    return Gathering(work, out, (p,) + tuple(t.shape), all_gather_cost(t.numel() * t.element_size(), p),
                     stats, time.perf_counter() - t0)


def all_gather_into(out: torch.Tensor, t: torch.Tensor, group=None, stats: CommStats | None = None) -> torch.Tensor:
    """All-gather ``t`` (contiguous, same size on every rank) into the flat ``out`` of ``P * t.numel()``."""
    _enter("all_gather_into")
    if world(group) == 1:
        return out.copy_(t.reshape(-1))
    t0 = time.perf_counter()
    gather_into(out, t.reshape(-1), group=group)
    _charge(stats, all_gather_cost(t.numel() * t.element_size(), world(group)), t0)
    return out


def all_reduce_(t: torch.Tensor, group=None, stats: CommStats | None = None, op=None) -> torch.Tensor:
    """In-place sum (or ``op``) all-reduce of a contiguous tensor; returns it."""
    _enter("all_reduce_")
    p = world(group)
    if p == 1:
        return t
    t0 = time.perf_counter()
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
    _charge(stats, all_reduce_cost(t.numel() * t.element_size(), p), t0)
    return t


def reduce_scatter_(out: torch.Tensor, send: torch.Tensor, group=None, stats: CommStats | None = None
                    ) -> torch.Tensor:
    """Sum reduce-scatter: ``send`` (contiguous) is P equal pieces, piece ``r`` for rank ``r``;
    ``out`` (one piece) gets the sum over the ranks of this rank's piece.  Returns ``out``."""
    _enter("reduce_scatter_")
    p = world(group)
    if p == 1:
        return out.copy_(send.reshape(out.shape))
    t0 = time.perf_counter()
    dist.reduce_scatter_single(out, send, op=dist.ReduceOp.SUM, group=group)
    _charge(stats, reduce_scatter_cost(out.numel() * out.element_size(), p), t0)
    return out


def all_to_all_bytes(buf: torch.Tensor, send_sizes: list[int], recv_sizes: list[int],
                     group=None, stats: CommStats | None = None) -> torch.Tensor:
    """All-to-all of a uint8 buffer cut into ``send_sizes`` pieces (one per rank, in rank order).

    Returns the received buffer: ``recv_sizes[r]`` bytes from each rank ``r``, in rank order.
    """
    _enter("all_to_all_bytes")
    p = world(group)
    me = rank(group)
    out = torch.empty(int(sum(recv_sizes)), dtype=torch.uint8, device=buf.device)
    if p == 1:
        out.copy_(buf)
        return out
    t0 = time.perf_counter()
    dist.all_to_all_single(out, buf.contiguous(), output_split_sizes=list(recv_sizes),
                           input_split_sizes=list(send_sizes), group=group)
    if stats is not None:
        sent = sum(s for r, s in enumerate(send_sizes) if r != me)
        recv = sum(s for r, s in enumerate(recv_sizes) if r != me)
        stats.add(sent, recv, p - 1, rounds=1, seconds=time.perf_counter() - t0)
    return out


def all_to_all_(out: torch.Tensor, send: torch.Tensor, group=None, stats: CommStats | None = None) -> torch.Tensor:
    """All-to-all of equal pieces: row ``r`` of ``send`` (``[P, m]``) goes to rank ``r``; row ``s``
    of ``out`` comes from rank ``s``."""
    _enter("all_to_all_")
    p = world(group)
    if p == 1:
        return out.copy_(send)
    t0 = time.perf_counter()
    dist.all_to_all_single(out, send, group=group)
    if stats is not None:
        b = (send.numel() // p) * send.element_size() * (p - 1)
        stats.add(b, b, p - 1, rounds=1, seconds=time.perf_counter() - t0)
    return out


def exchange(send: torch.Tensor, recv: torch.Tensor, peer: int, group=None,
             stats: CommStats | None = None, do_send: bool = True, do_recv: bool = True) -> None:
    """Point-to-point: send ``send`` to ``peer`` and/or receive ``recv`` from it (group ranks)."""
    _enter("exchange")
    gpeer = peer if group is None else dist.get_global_rank(group, peer)
    ops = []
    if do_send:
        ops.append(dist.P2POp(dist.isend, send.contiguous(), gpeer, group))
    if do_recv:
        ops.append(dist.P2POp(dist.irecv, recv, gpeer, group))
    t0 = time.perf_counter()
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if stats is not None:
        s = send.numel() * send.element_size() if do_send else 0
        r = recv.numel() * recv.element_size() if do_recv else 0
        stats.add(s, r, int(do_send), rounds=1, seconds=time.perf_counter() - t0)


def to_bytes(*tensors: torch.Tensor) -> torch.Tensor:
    """Concatenate the raw bytes of ``tensors`` (flattened) into one uint8 tensor."""
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
    if not parts:
        dev = tensors[0].device if tensors else torch.device("cpu")
        return torch.empty(0, dtype=torch.uint8, device=dev)
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def from_bytes(buf: torch.Tensor, specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Inverse of :func:`to_bytes`: cut ``buf`` into tensors of the given (dtype, shape)."""
    out = []
    off = 0
    for dtype, shape in specs:
        n = 1
        for s in shape:
            n *= int(s)
        nb = n * torch.empty((), dtype=dtype).element_size()
        out.append(buf[off:off + nb].clone().view(dtype).reshape(shape))
        off += nb
    return out


def rows_to_bytes(indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """COO entries as rows ``[index bytes | value bytes]``: a ``(k, ib+vb)`` uint8 tensor."""
    k = indices.numel()
    if k == 0:  # empty tensors may have stride 0 (e.g. from numpy), which .view(uint8) rejects
        return torch.empty((0, indices.element_size() + values.element_size()), dtype=torch.uint8,
                           device=values.device)
    ib = indices.reshape(-1).contiguous().view(torch.uint8).reshape(k, indices.element_size())
    vb = values.reshape(-1).contiguous().view(torch.uint8).reshape(k, values.element_size())
    return torch.cat([ib, vb], dim=1)


def bytes_to_rows(buf: torch.Tensor, index_dtype: torch.dtype, value_dtype: torch.dtype):
    """Inverse of :func:`rows_to_bytes` (``buf`` flat or ``(k, w)``): ``(indices, values)``."""
    isz = torch.empty((), dtype=index_dtype).element_size()
    vsz = torch.empty((), dtype=value_dtype).element_size()
    rows = buf.reshape(-1, isz + vsz)
    idx = rows[:, :isz].contiguous().view(index_dtype).reshape(-1)
    val = rows[:, isz:].contiguous().view(value_dtype).reshape(-1)
    return idx, val
