"""Sparse allreduce: every rank brings ``(indices, values)``, every rank gets the same dense sum.

``sparse_allreduce(indices, values, numel)`` returns ``out`` of length ``numel``
with ``out[i] = sum over ranks of that rank's value at i``, **bitwise identical
on all ranks**.  Each algorithm guarantees this either by having every rank add
the contributions in the same fixed order (rank order), or by letting one owner
reduce a part and sending the owner's result to everyone.

What goes on the wire (``P`` ranks, ``k_r`` entries on rank ``r``, ``u`` the size
of the union of supports, an *entry* is one index (int32, or int64 when
``numel >= 2**31``) plus one value in the values' dtype):

``"allgather"``
    all-gather of every rank's entries padded to ``max k_r``; every rank
    scatter-adds the P contributions in rank order.
``"recursive_doubling"`` (SparCML SSAR)
    ``log2 P`` rounds; in round ``t`` rank ``r`` swaps its current (merged) set
    with ``r XOR 2**t`` (a size message, then the entries) and merges, the
    lower-rank block's set first, so partners compute identical sets.  With P
    not a power of two the ``P - 2**m`` extra ranks first fold their entries
    into rank ``r - 2**m`` and get the final set back from it at the end.
``"split"`` (SparCML split all-gather)
    the index space is cut into P contiguous ranges; an all-to-all sends every
    entry to its range's owner, which sums them (rank order) and all-gathers
    its reduced range, encoded as COO, as a bitmap over the range plus values,
    or densely, whichever is smallest (a size message first).
``"hashed"`` (Zen)
    as ``"split"``, but the owner of index ``i`` is ``commpress.ops.hash_owner(i, P)``,
    so clustered supports still spread evenly; a partition's bitmap is over the
    indices that hash to it (in ascending order).
``"dense"``
    scatter into a dense tensor, ``all_reduce``.

Through :func:`commpress.collectives.allreduce` (the hooks' path) a sparsifier's
fixed-size payload takes :func:`fixed_sparse_allreduce`: ``"allgather"`` is one
all-gather of ``capacity`` slots per rank with the status word in front, and
``"dense"`` one all_reduce; no header, no size message.  ``"auto"`` takes the
all-gather whenever its message is smaller (:func:`~.costmodel.choose_fixed_sparse`:
by bytes alone, so every rank and a resumed run choose alike).  With error
feedback, ``"dense"`` sends the whole compensated tensor rather than its
densified selection: the same bytes, an exact sum, and the residual empties;
``"auto"`` sends the whole compensated tensor instead of the selection whenever
that is the smaller message (:func:`whole_choice`): block-quantized to 4 bits in
one all-gather (about 0.52 bytes an element: a density warm-up's 25% and 8.5%
stages, ratios above about 6%), or in bf16 in a ring all_reduce where that is
smaller still (P >= 8); the residual keeps the rounding.  The whole-tensor sends
carry a ``dense=`` part at P <= 2 by going as one all-gather (one round for the
two).  The
other algorithms need the counts, so they run :func:`sparse_allreduce` below
with its header.

Every call of :func:`sparse_allreduce` first all-gathers one small header per rank
(:mod:`commpress.collectives.validate`, layout in :mod:`.wire`) carrying the counts and, for
``"split"``/``"hashed"``/``"auto"``, each rank's per-owner counts (and a union
sketch for ``"auto"``): that is the only host synchronisation besides the
size messages of the variable-size steps.  Sums are taken in fp32 for fp16 /
bf16 values (in the values' dtype otherwise) and returned in the values' dtype.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from .. import ops
from ..compressors.blockquant import BlockQuant
from ..feedback import ErrorFeedback, ResidualTransaction, nonfinite_flag
from . import _comm, costmodel, steady, steady_sparse, wire
from .accounting import CommStats, codec_timer
from .wire import (ERRORS, H_COUNT, HASH_RANGE, SKETCH, CollectiveInputError, has_feedback, header_hashed,
                   header_sketch, header_split, try_compress_fixed, unwrap)
from .validate import check_sparse_local, exchange_header, make_header

log = logging.getLogger("commpress")

SPARSE_ALGORITHMS = ("allgather", "recursive_doubling", "split", "hashed", "dense")


FMT_DENSE, FMT_BITMAP, FMT_COO = 0, 1, 2
FORMATS = ("dense", "bitmap", "coo")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums are taken in: fp32 for half types, else the dtype itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def wire_index_dtype(numel: int) -> torch.dtype:
    return ops.reference.index_dtype(numel)


def range_bounds(numel: int, world: int) -> list[int]:
    """Boundaries of the P contiguous ranges of ``"split"``: range r is ``[b[r], b[r+1])``."""
    return [(r * numel) // world for r in range(world + 1)]


def range_owner(indices: torch.Tensor, numel: int, world: int) -> torch.Tensor:
    inner = torch.tensor(range_bounds(numel, world)[1:world], dtype=indices.dtype, device=indices.device)
    return torch.bucketize(indices, inner, right=True)


_DOMAINS = _comm.BoundedCache(4)   # (numel, world, device) -> (order, offsets)


def hash_domain(numel: int, world: int, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """Indices of ``[0, numel)`` grouped by hash owner (ascending within a group) and group offsets.

    Computed once per ``(numel, world, device)`` (O(numel)) and cached (last 4).
    """
    key = (numel, world, str(device))
    found = _DOMAINS.get(key)
    if found is None:
        counts, order = ops.hash_partition(torch.arange(numel, device=device, dtype=torch.int64), world)
        offs = [0]
        for c in counts.tolist():
            offs.append(offs[-1] + int(c))
        found = (order.to(torch.int64), offs)
        _DOMAINS.put(key, found)
    return found


def _range_counts(idx: torch.Tensor, numel: int, world: int, owners: dict) -> torch.Tensor:
    """Entries per ``"split"`` range; notes in ``owners`` whether ``idx`` is ascending (then
    the entries are already grouped by owner) or else each entry's owner."""
    # the ascending check is a host sync: only on CPU, where it is cheap (on CUDA: bincount)
    ascending = idx.device.type == "cpu" and (idx.numel() < 2 or bool((idx[1:] > idx[:-1]).all()))
    if ascending:
        owners["split_sorted"] = True
        b = torch.tensor(range_bounds(numel, world), dtype=idx.dtype, device=idx.device)
        return torch.diff(torch.searchsorted(idx, b))
    owners["split"] = range_owner(idx, numel, world)
    return torch.bincount(owners["split"], minlength=world)


def union_sketch(indices: torch.Tensor, hashes: torch.Tensor | None = None) -> torch.Tensor:
    """The ``SKETCH`` smallest 32-bit hashes of ``indices`` (k-minimum-values sketch), padded with
    HASH_RANGE.  ``hashes`` may pass ``commpress.ops.hash_owner(indices, HASH_RANGE)`` already computed."""
    h = (ops.hash_owner(indices, HASH_RANGE) if hashes is None else hashes).to(torch.int64)
    m = min(SKETCH, h.numel())
    small = torch.topk(h, m, largest=False).values if m else h[:0]
    small = torch.sort(small).values
    pad = torch.full((SKETCH - m,), HASH_RANGE, dtype=torch.int64, device=h.device)
    return torch.cat([small, pad])


# ---------------------------------------------------------------- entry point
def sparse_allreduce(indices: torch.Tensor, values: torch.Tensor, numel: int, *, group=None,
                     algorithm: str = "auto", stats: CommStats | None = None, validate: bool = True,
                     config: int = 0, _error: tuple[int, str] = (0, "")) -> torch.Tensor:
    """Sum sparse tensors across the ranks of ``group``; every rank gets the same dense sum.

    ``indices`` (int32/int64, unique, in ``[0, numel)``) and ``values`` (float,
    same length) may have a different length on every rank, 0 included.
    ``algorithm`` is one of :data:`SPARSE_ALGORITHMS` or ``"auto"`` (the cost
    model of :mod:`commpress.collectives.costmodel`).  ``validate=False`` skips
    the O(k) range/uniqueness checks (the cross-rank header exchange still
    happens).  ``config`` is an int fingerprint compared across ranks.
    Returns a 1-D tensor of ``numel`` elements in ``values.dtype``.

    Raises :class:`~commpress.collectives.validate.CollectiveInputError` (a
    ``ValueError``) on every rank when any rank's input is bad or the ranks
    disagree on ``numel``, dtype or ``algorithm``.
    """
    world = _comm.world(group)
    code, msg = _error if _error[0] else check_sparse_local(indices, values, numel, check_contents=validate)
    if code == 0 and algorithm not in SPARSE_ALGORITHMS + ("auto",):
        code, msg = wire.E_MISUSE, f"algorithm must be one of {SPARSE_ALGORITHMS + ('auto',)}, got {algorithm!r}"
    if world == 1:
        if code:
            raise CollectiveInputError(f"sparse_allreduce: {ERRORS[code]}: {msg}")
        out = torch.zeros(numel, dtype=acc_dtype(values.dtype), device=values.device)
        ops.scatter_add_(out, indices, values)
        if stats is not None:
            stats.add(calls=1, algorithm="local")
        return out.to(values.dtype)

    ok = code == 0
    device = _comm.comm_device(group, values if isinstance(values, torch.Tensor) else None)
    vdtype = values.dtype if isinstance(values, torch.Tensor) else None
    k = int(indices.numel()) if ok else 0
    header = make_header(world, device, error=code, numel=numel if isinstance(numel, int) else -1,
                         dtype=vdtype, algorithm=algorithm, kind="sparse", config=config, count=k,
                         group=group)
    idx = vals = None
    owners: dict[str, torch.Tensor] = {}  # per-entry owner rank, computed once for the header
    if ok:
        idx = indices.to(wire_index_dtype(numel)).contiguous()
        vals = values.contiguous()
        if algorithm in ("split", "auto"):
            header[header_split(world)] = _range_counts(idx, numel, world, owners)
        if algorithm in ("hashed", "auto"):
            h = ops.hash_owner(idx, HASH_RANGE)  # the full 32-bit hash, computed once
            owners["hashed"] = h % world
            header[header_hashed(world)] = torch.bincount(owners["hashed"], minlength=world)
            if algorithm == "auto":
                header[header_sketch(world)] = union_sketch(idx, h)
    table = exchange_header(header, group=group, stats=stats, local_message=msg, what="sparse_allreduce")

    counts = table[:, H_COUNT].tolist()
    if algorithm == "auto":
        algorithm = costmodel.choose_sparse(table, numel, world, vals.element_size(),
                                            idx.element_size(), group=group)
    if algorithm in ("split", "hashed"):
        out = _partitioned(idx, vals, numel, table, counts, group, stats, hashed=algorithm == "hashed",
                           owner=owners.get(algorithm), grouped=owners.get("split_sorted", False))
    else:
        out = _ALGOS[algorithm](idx, vals, numel, table, counts, group, stats)
    if stats is not None:
        stats.add(calls=1, algorithm=algorithm)
    return out


# ---------------------------------------------------------------- algorithms
def _allgather(idx, vals, numel, table, counts, group, stats):
    world = len(counts)
    kmax = max(counts)
    acc = torch.zeros(numel, dtype=acc_dtype(vals.dtype), device=vals.device)
    if kmax == 0:
        return acc.to(vals.dtype)
    w = idx.element_size() + vals.element_size()
    rows = torch.zeros(kmax, w, dtype=torch.uint8, device=vals.device)
    rows[: idx.numel()] = _comm.rows_to_bytes(idx, vals)
    gathered = _comm.all_gather(rows.reshape(-1), group=group, stats=stats)
    for r in range(world):  # fixed rank order on every rank
        if counts[r]:
            i, v = _comm.bytes_to_rows(gathered[r, : counts[r] * w], idx.dtype, vals.dtype)
            ops.scatter_add_(acc, i, v.to(acc.dtype))
    return acc.to(vals.dtype)


def _dense(idx, vals, numel, table, counts, group, stats):
    out = torch.zeros(numel, dtype=vals.dtype, device=vals.device)
    ops.scatter_add_(out, idx, vals)
    return _comm.all_reduce_(out, group=group, stats=stats)


def merge_sorted(idx_a, val_a, idx_b, val_b):
    """Union of two sparse sets with unique indices; a shared index gets ``a + b``.

    Deterministic on every device (no atomics): the result depends only on the
    ordered pair ``(a, b)``.  Returns ascending indices.
    """
    cat_i = torch.cat([idx_a, idx_b])
    cat_v = torch.cat([val_a, val_b])
    s_i, order = torch.sort(cat_i, stable=True)
    s_v = cat_v[order]
    if s_i.numel() < 2:
        return s_i, s_v
    dup = s_i[1:] == s_i[:-1]  # entry j+1 repeats entry j (a's comes first: stable sort)
    summed = s_v.clone()
    summed[:-1][dup] = s_v[:-1][dup] + s_v[1:][dup]
    keep = torch.ones_like(s_i, dtype=torch.bool)
    keep[1:][dup] = False
    return s_i[keep], summed[keep]


def reduce_by_index(indices: torch.Tensor, values: torch.Tensor):
    """Sum ``values`` of equal ``indices`` (ascending unique indices, sums in :func:`acc_dtype`).

    Entries of one index are added in their input order (a stable sort keeps it).
    """
    s_i, order = torch.sort(indices, stable=True)
    s_v = values[order].to(acc_dtype(values.dtype))
    if s_i.numel() == 0:
        return s_i, s_v
    first = torch.ones_like(s_i, dtype=torch.bool)
    first[1:] = s_i[1:] != s_i[:-1]
    seg = torch.cumsum(first, 0) - 1
    sums = torch.zeros(int(seg[-1]) + 1, dtype=s_v.dtype, device=s_v.device)
    sums.index_add_(0, seg, s_v)
    return s_i[first], sums


def _reduce_dense(pos: torch.Tensor, values: torch.Tensor, span: int):
    """As :func:`reduce_by_index` for positions in ``[0, span)``, through a dense scratch."""
    scratch = torch.zeros(span, dtype=acc_dtype(values.dtype), device=values.device)
    scratch.index_add_(0, pos, values.to(scratch.dtype))
    touched = torch.zeros(span, dtype=torch.bool, device=values.device)
    touched[pos] = True
    uniq = touched.nonzero().reshape(-1)
    return uniq, scratch[uniq]


def _swap(idx, vals, peer, group, stats, send=True, recv=True):
    """Send my set to ``peer`` and/or receive its set (a size message, then the entries)."""
    dev = vals.device
    n_out = torch.tensor([idx.numel()], dtype=torch.int64, device=dev)
    n_in = torch.zeros(1, dtype=torch.int64, device=dev)
    _comm.exchange(n_out, n_in, peer, group, stats, do_send=send, do_recv=recv)
    w = idx.element_size() + vals.element_size()
    out_buf = _comm.rows_to_bytes(idx, vals).reshape(-1) if send else torch.empty(0, dtype=torch.uint8, device=dev)
    m = int(n_in.item()) if recv else 0
    in_buf = torch.empty(m * w, dtype=torch.uint8, device=dev)
    if (send and out_buf.numel()) or (recv and m):
        _comm.exchange(out_buf, in_buf, peer, group, stats,
                       do_send=send and out_buf.numel() > 0, do_recv=recv and m > 0)
    if not recv:
        return None
    return _comm.bytes_to_rows(in_buf, idx.dtype, vals.dtype)


def _recursive_doubling(idx, vals, numel, table, counts, group, stats):
    world = len(counts)
    me = _comm.rank(group)
    vdtype = vals.dtype
    adt = acc_dtype(vdtype)
    cur_i, cur_v = torch.sort(idx)[0], vals[torch.sort(idx)[1]].to(adt)
    p2 = 1 << (world.bit_length() - 1)
    extra = world - p2
    # fold: ranks >= p2 hand their entries to rank - p2
    if me >= p2:
        _swap(cur_i, cur_v.to(vdtype), me - p2, group, stats, send=True, recv=False)
    else:
        if me < extra:
            oi, ov = _swap(cur_i, cur_v.to(vdtype), me + p2, group, stats, send=False, recv=True)
            cur_i, cur_v = merge_sorted(cur_i, cur_v, oi, ov.to(adt))  # lower rank first
        dist_ = 1
        while dist_ < p2:
            peer = me ^ dist_
            oi, ov = _swap(cur_i, cur_v.to(vdtype), peer, group, stats)
            ov = ov.to(adt)
            if me < peer:
                cur_i, cur_v = merge_sorted(cur_i, cur_v, oi, ov)
            else:
                cur_i, cur_v = merge_sorted(oi, ov, cur_i, cur_v)
            cur_v = cur_v.to(vdtype).to(adt)  # what goes on the wire next round
            dist_ <<= 1
    # unfold: the extra ranks get the final set back
    if me >= p2:
        cur_i, cur_v = _swap(cur_i[:0], cur_v[:0].to(vdtype), me - p2, group, stats, send=False, recv=True)
    elif me < extra:
        _swap(cur_i, cur_v.to(vdtype), me + p2, group, stats, send=True, recv=False)
    out = torch.zeros(numel, dtype=vdtype, device=vals.device)
    ops.scatter_add_(out, cur_i, cur_v.to(vdtype))
    return out


def _partitioned(idx, vals, numel, table, counts, group, stats, hashed: bool, owner=None, grouped=False):
    """SparCML split (range owners) or Zen hashed (hash owners): each entry to its owner, the
    owner reduces and encodes its partition, every rank gathers every partition."""
    world = len(counts)
    cmat = table[:, header_hashed(world) if hashed else header_split(world)].tolist()  # cmat[src][owner]
    r_idx, r_val = _route_to_owners(idx, vals, numel, cmat, group, stats, hashed, owner, grouped)
    uniq, sums = _owner_reduce(r_idx, r_val, numel, world, _comm.rank(group), hashed)
    payload, fmt, domain = _encode_partition(uniq, sums.to(vals.dtype), idx.dtype, numel, world,
                                             _comm.rank(group), hashed)
    return _gather_partitions(payload, fmt, uniq.numel(), domain, idx.dtype, vals.dtype, numel, world,
                              group, stats, hashed)


def _route_to_owners(idx, vals, numel, cmat, group, stats, hashed, owner, grouped):
    """1. All-to-all: each entry to its owner; returns the entries this rank owns."""
    world, me = len(cmat), _comm.rank(group)
    w = idx.element_size() + vals.element_size()
    if hashed:
        order = ops.hash_partition(idx, world)[1]
    elif grouped or (idx.numel() < 2 or bool((idx[1:] > idx[:-1]).all())):
        order = None  # ascending indices are already grouped by range
    else:
        owner = range_owner(idx, numel, world) if owner is None else owner
        order = torch.sort(owner, stable=True)[1]
    send = (_comm.rows_to_bytes(idx, vals) if order is None
            else _comm.rows_to_bytes(idx[order], vals[order])).reshape(-1)
    recv = _comm.all_to_all_bytes(send, [c * w for c in cmat[me]], [cmat[r][me] * w for r in range(world)],
                                  group=group, stats=stats)
    return _comm.bytes_to_rows(recv, idx.dtype, vals.dtype)


def _owner_reduce(r_idx, r_val, numel, world, me, hashed):
    """2. The owner sums its entries (contributions in rank order): ``(indices, sums)``."""
    bounds = range_bounds(numel, world)
    lo, span = (0, numel) if hashed else (bounds[me], bounds[me + 1] - bounds[me])
    if r_idx.numel() * 32 >= span:  # dense scratch over my range: cheaper than sorting
        uniq, sums = _reduce_dense(r_idx.to(torch.int64) - lo, r_val, span)
        return uniq + lo, sums
    return reduce_by_index(r_idx.to(torch.int64), r_val)


def _encode_partition(uniq, sums, index_dtype, numel, world, me, hashed):
    """3. This rank's partition as dense / bitmap / COO bytes, whichever is smallest:
    ``(payload bytes, format, hash domain or None)``."""
    dev, vb = sums.device, sums.element_size()
    u = uniq.numel()
    bounds = range_bounds(numel, world)
    dom_len = (bounds[me + 1] - bounds[me]) if not hashed else None
    coo_bytes = u * (torch.empty((), dtype=index_dtype).element_size() + vb)
    domain = None
    if hashed and coo_bytes * 8 * world * 10 >= 9 * numel:  # a bitmap might win: need the domain
        domain = hash_domain(numel, world, dev)
    if hashed and domain is not None:
        dom_len = domain[1][me + 1] - domain[1][me]
    if dom_len is None:
        fmt = FMT_COO
    else:
        sizes = {FMT_DENSE: dom_len * vb, FMT_BITMAP: (dom_len + 7) // 8 + u * vb, FMT_COO: coo_bytes}
        fmt = min(sizes, key=lambda f: (sizes[f], f))
    if fmt == FMT_COO:
        return _comm.rows_to_bytes(uniq.to(index_dtype), sums).reshape(-1), fmt, domain
    if hashed:
        members = domain[0][domain[1][me]:domain[1][me + 1]]
        pos = torch.searchsorted(members, uniq)
    else:
        pos = uniq - bounds[me]
    if fmt == FMT_DENSE:
        d = torch.zeros(dom_len, dtype=sums.dtype, device=dev)
        d[pos] = sums
        return _comm.to_bytes(d), fmt, domain
    return _comm.to_bytes(ops.bitmap_encode(pos, dom_len), sums), fmt, domain


def _gather_partitions(payload, fmt, u, domain, index_dtype, vdtype, numel, world, group, stats, hashed):
    """4. All-gather: sizes and formats first, then the padded partitions, decoded into the sum."""
    dev = payload.device
    vb = torch.empty((), dtype=vdtype).element_size()
    bounds = range_bounds(numel, world)
    info = _comm.all_gather(torch.tensor([payload.numel(), fmt, u], dtype=torch.int64, device=dev),
                            group=group, stats=stats).tolist()
    maxb = max(i[0] for i in info)
    out = torch.zeros(numel, dtype=vdtype, device=dev)
    if maxb == 0:
        return out
    buf = torch.zeros(maxb, dtype=torch.uint8, device=dev)
    buf[: payload.numel()] = payload
    gathered = _comm.all_gather(buf, group=group, stats=stats)
    if hashed and any(i[1] != FMT_COO for i in info) and domain is None:
        domain = hash_domain(numel, world, dev)
    for r in range(world):
        nbytes, f, ur = info[r]
        if nbytes == 0:
            continue
        piece = gathered[r, :nbytes]
        if f == FMT_COO:
            gi, gv = _comm.bytes_to_rows(piece, index_dtype, vdtype)
            out[gi.to(torch.int64)] = gv
            continue
        members = domain[0][domain[1][r]:domain[1][r + 1]] if hashed else None
        lo, L = (bounds[r], bounds[r + 1] - bounds[r]) if not hashed else (0, members.numel())
        if f == FMT_DENSE:
            d = piece.clone().view(vdtype)
            if hashed:
                out[members] = d
            else:
                out[lo:lo + L] = d
        else:
            nb = (L + 7) // 8
            pos = ops.bitmap_decode(piece[:nb].contiguous(), L).to(torch.int64)
            v = piece[nb:nb + ur * vb].clone().view(vdtype)
            if hashed:
                out[members[pos]] = v
            else:
                out[lo + pos] = v
    return out


def _split(idx, vals, numel, table, counts, group, stats):
    return _partitioned(idx, vals, numel, table, counts, group, stats, hashed=False)


def _hashed(idx, vals, numel, table, counts, group, stats):
    return _partitioned(idx, vals, numel, table, counts, group, stats, hashed=True)


_ALGOS = {"allgather": _allgather, "recursive_doubling": _recursive_doubling, "split": _split,
          "hashed": _hashed, "dense": _dense}


# ---------------------------------------------------------------- fixed-size (steady state)
FIXED_ALGORITHMS = costmodel.FIXED_SPARSE


def fixed_sparse_allreduce(tensor: torch.Tensor, compressor, *, group=None, key=0, step: int = 0,
                           algorithm: str = "auto", stats: CommStats | None = None, generator=None,
                           transaction: ResidualTransaction, error: tuple[int, str] = (0, ""),
                           model: costmodel.CostModel | None = None, out: torch.Tensor | None = None,
                           dense: wire.Rider | None = None, passengers: wire.Passengers | None = None,
                           scale: float = 1.0) -> torch.Tensor:
    """Sum over ranks of a sparsifier's payload of ``tensor``, shaped like ``tensor``.

    Every rank sends ``capacity(numel)`` slots (:meth:`SparseCompressor.compress_fixed`):
    ``"allgather"`` gathers them behind each rank's status word and adds the P
    contributions in rank order (fp32 for half values), ``"dense"`` all-reduces
    the densified slots with two status slots.  A NaN/inf on any rank makes the
    result all-NaN and keeps every residual of ``transaction`` as it was.  ``dense``
    (:class:`~.wire.Rider`): rides raw in the ``"allgather"`` message when that costs no
    more bytes than its own all_reduce (P <= 2), summed in rank order; its NaN/inf joins
    this rank's status flag.  With error feedback the whole-tensor paths (``"dense"``, and
    ``"auto"``'s when the selection would be the larger message: :func:`whole_choice`) carry it
    alike at P <= 2 (:func:`_whole_quantized`, :func:`_whole_dense`).  Left uncarried
    otherwise (the caller all-reduces it).  ``passengers`` (:class:`~.wire.Passengers`): held
    messages that ride in the message on the steady lane (:mod:`.steady_sparse`); left uncarried
    elsewhere.  ``scale``: sum ``tensor * scale`` instead, the factor folded into error feedback's
    compensation pass (a multiplication of its own without error feedback).
    """
    inner = unwrap(compressor)
    world = _comm.world(group)
    n = tensor.numel()
    if algorithm not in ("auto",) + FIXED_ALGORITHMS and world > 1 and not error[0]:
        return _variable(tensor if scale == 1.0 else tensor * scale, compressor, group, key, step, algorithm,
                         stats, generator, transaction)
    flat = tensor.reshape(-1)
    plan = steady_sparse.plan_for(flat, compressor, group=group, algorithm=algorithm, step=step, error=error,
                                  out=out, dense=dense, world=world, whole_choice=whole_choice)
    if plan is not None:   # the steady-state lane (topk + error feedback on the CPU): the same bytes
        steady_sparse.run(plan, flat, compressor, group=group, key=key, stats=stats, transaction=transaction,
                          dense=dense, passengers=passengers, scale=scale)
        return out
    if world > 1 and has_feedback(compressor):
        if algorithm == "dense":
            return _whole_dense(tensor, compressor, group, key, stats, transaction, error, out, torch.float32,
                                dense, scale=scale)
        send = whole_choice(tensor, inner, step, world) if algorithm == "auto" else "selection"
        if send == "blockquant":
            wplan = steady.whole_plan_for(flat, compressor, codec=WHOLE_CODEC, group=group, error=error, out=out,
                                          dense=dense, world=world)
            if wplan is not None:   # the steady-state lane of the whole send (CPU, numba): the same bytes
                steady.run(wplan, flat, compressor, group=group, key=key, step=step, stats=stats,
                           transaction=transaction, dense=dense, passengers=passengers, scale=scale)
                return out
            return _whole_quantized(tensor, compressor, group, key, step, stats, transaction, error, out, dense,
                                    scale=scale)
        if send == "bf16":
            return _whole_dense(tensor, compressor, group, key, stats, transaction, error, out,
                                whole_wire_dtype(tensor.dtype), dense, scale=scale)
    payload, code, msg = try_compress_fixed(compressor, tensor, step=step, key=key, generator=generator,
                                            transaction=transaction, error=error, stats=stats, scale=scale,
                                            scratch=_is_scratch(tensor, out))
    vdtype = tensor.dtype if tensor.dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.float32
    if payload is None:
        cap = inner.capacity(n, step)
        idx = torch.full((cap,), n, dtype=wire_index_dtype(n + 1), device=tensor.device)
        vals = torch.zeros(cap, dtype=vdtype, device=tensor.device)
    else:
        idx, vals = payload.tensors
    if world == 1:
        if code:
            raise wire.CollectiveInputError(f"allreduce: {msg}")
        if stats is not None:
            stats.add(calls=1, algorithm="local")
        return inner.decompress(payload).reshape(tensor.shape)
    if algorithm == "auto":
        algorithm = costmodel.choose_fixed_sparse(n, idx.numel(), world, vals.element_size(),
                                                  idx.element_size())
    bad_local = payload.nonfinite if payload is not None else None
    # decode straight into ``out`` when no slot can hold padding (index n) and the sum's
    # dtype is out's: no scratch, no copy back (the payload was already taken from the input)
    direct = (out is not None and payload is not None and inner.fills_capacity
              and out.dtype == acc_dtype(vals.dtype) and out.is_contiguous())
    if algorithm == "allgather":
        acc = None if direct else _comm.scratch("sparse_acc", n + 1, acc_dtype(vals.dtype),
                                                tensor.device).zero_()  # slot n: padding
        parts = (idx, vals)
        facts = ("sparse", n, str(vals.dtype), idx.numel())
        if dense is not None and wire.Rider.free(world):  # the dense part rides: no round of its own
            dense.carried = True
            parts += (dense.tensor.reshape(-1),)
            facts += (dense.tensor.numel(), str(dense.tensor.dtype))
            if has_feedback(compressor):
                bad_local = dense.flag(bad_local)
        layout = wire.Layout.of(parts)
        sig = wire.signature(*facts)
        message = torch.empty(layout.width, dtype=torch.uint8, device=tensor.device)
        layout.write(message, parts, wire.status_word(tensor.device, error=code, sig=sig,
                                                      nonfinite=bad_local))
        gathered = _comm.all_gather(message, group=group, stats=stats)
        statuses = wire.read_status(gathered)
        wire.check_byte_statuses(statuses, sig, "allreduce", msg)
        with codec_timer(stats, "decompress"):
            if acc is None:
                acc = out.view(-1).zero_()
            rows = [layout.read(gathered[r]) for r in range(world)]
            for i, v, *_ in rows:  # rank order on every rank: bitwise identical sums
                ops.scatter_add_(acc, i, v.to(acc.dtype))
            if len(parts) == 3:
                wire.add_rows(dense.tensor.view(-1), [row[2] for row in rows])
        bad = wire.any_nonfinite(statuses)
    else:  # dense
        buf = _comm.scratch("sparse_dense", n + 1 + wire.SUM_SLOTS, torch.float32, tensor.device).zero_()
        ops.scatter_add_(buf[:n + 1], idx, vals.float())
        wire.sum_slots(buf, error=code, nonfinite=bad_local, rank=_comm.rank(group), world=world)
        _comm.all_reduce_(buf, group=group, stats=stats)
        wire.check_sum_slots(buf, "allreduce", msg, world)
        acc = buf[:n + 1]
        bad = buf[-1] != 0
    with codec_timer(stats, "decompress"):
        if out is None:  # acc is a reused scratch buffer: never hand it out
            out = acc[:n].to(vals.dtype, copy=True).to(tensor.dtype).reshape(tensor.shape)
        elif acc.data_ptr() == out.data_ptr():
            pass  # decoded in place
        else:
            out.view(-1).copy_(acc[:n] if acc.dtype == vals.dtype else acc[:n].to(vals.dtype))
    if has_feedback(compressor):
        transaction.mark_bad(bad)
        wire.poison_(out, bad)
    if stats is not None:
        stats.add(calls=1, algorithm=algorithm)
    return out


def _is_scratch(tensor: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether ``out`` is ``tensor`` itself (the hooks' ``out=t``): nothing reads the input after its
    compress, so error feedback may work in it (``compress(scratch=True)``)."""
    return out is not None and out.data_ptr() == tensor.data_ptr() and out.is_contiguous()


def whole_wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype ``"auto"`` sends a whole compensated tensor in: bf16 for fp32/fp64 input (error
    feedback keeps the rounding error), the input's own for fp16/bf16."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


#: What a sparsifier with error feedback sends instead of its selection, under ``"auto"``, when
#: the selection's message would be the larger: the whole compensated tensor block-quantized to
#: 4 bits, round to nearest (about 0.52 bytes an element; the residual keeps the rounding).
WHOLE_CODEC = BlockQuant(bits=4)


def whole_choice(tensor, inner, step: int | None, world: int) -> str:
    """What a sparsifier with error feedback sends under ``"auto"``: the smallest of, in bytes
    one rank sends,

    - ``"selection"``: the all-gather of its ``capacity`` slots, ``(slots + 8) * (P-1)``;
    - ``"blockquant"``: the all-gather of the whole compensated tensor in :data:`WHOLE_CODEC`;
    - ``"bf16"``: the ring all_reduce of it in :func:`whole_wire_dtype`, ``2 * whole * (P-1)/P``.

    Ties go to the whole tensor (every coordinate, for no more bytes), then to blockquant.  A density
    warm-up's early stages (25%, 8.5% for a 1% target) and large ratios send the whole tensor.  A
    pure function of (numel, capacity at ``step``, P, dtypes), never of timings, so every rank
    and a resumed run choose alike.  ``step=None``: the steady state, after any warm-up (what
    ``"auto"`` predicts with)."""
    n = tensor.numel()
    selection = (_selection_bytes(inner, n, step, tensor.dtype) + 8) * (world - 1)
    quantized = (wire.payload_bytes(WHOLE_CODEC, n, tensor.dtype) + 8) * (world - 1)
    ring = 2 * (n + 1 + wire.SUM_SLOTS) * whole_wire_dtype(tensor.dtype).itemsize * (world - 1) / world
    if selection < min(quantized, ring):
        return "selection"
    return "blockquant" if quantized <= ring else "bf16"


def whole_per_chunk(inner, m: int, step: int | None, dtype: torch.dtype) -> bool:
    """For a reduce-scatter's chunks of ``m`` elements (one message per owner): whether a
    sparsifier with error feedback sends each chunk whole in :data:`WHOLE_CODEC` rather than its
    selection, because the selection's payload (indices and values) would be no smaller.  A pure
    function of (``m``, capacity at ``step``, dtypes), as :func:`whole_choice`."""
    return m > 0 and _selection_bytes(inner, m, step, dtype) >= wire.payload_bytes(WHOLE_CODEC, m, dtype)


def _selection_bytes(inner, n: int, step: int | None, dtype: torch.dtype) -> int:
    """A sparsifier's fixed-size payload of ``n`` elements at ``step``: ``capacity`` indices and
    values (fp16 / bf16 values as they are, any other dtype in fp32)."""
    vsize = (dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32).itemsize
    return inner.capacity(n, step) * (vsize + wire_index_dtype(n + 1).itemsize)


def _whole_quantized(tensor, ef: ErrorFeedback, group, key, step, stats, transaction, error, out,
                     dense: wire.Rider | None = None, scale: float = 1.0) -> torch.Tensor:
    """One ``all_gather`` of ``[status word | the whole compensated tensor in WHOLE_CODEC | the
    dense part raw (P <= 2)]`` (:meth:`ErrorFeedback.compress_whole`: the residual keeps the
    quantization error, momentum masking counts every coordinate as sent); every rank decodes
    the P messages and sums them in rank order in fp32 (bitwise the same on every rank), the
    dense part too.  A NaN/inf anywhere: the result all-NaN and every residual kept."""
    n, world = tensor.numel(), _comm.world(group)
    codec = WHOLE_CODEC
    code, msg = error
    payload = None
    if not code:
        try:
            with codec_timer(stats, "compress"):
                payload = ef.compress_whole(tensor, codec, step=step, key=key, transaction=transaction, scale=scale,
                                            scratch=_is_scratch(tensor, out))
        except Exception as exc:  # noqa: BLE001 - reported through the status word on every rank
            code, msg = wire.E_MISUSE, f"compress failed: {type(exc).__name__}: {exc}"
    bad_local = payload.nonfinite if payload is not None else None
    if code:  # zeros of the right sizes: the others must not be left waiting
        payload = codec.compress_fixed(torch.zeros(n, dtype=torch.float32, device=tensor.device))
    parts = payload.tensors
    facts = ("whole", n, codec.name, codec.bits, codec.block)
    if dense is not None and wire.Rider.free(world):  # the dense part rides: no round of its own
        dense.carried = True
        parts += (dense.tensor.reshape(-1),)
        facts += (dense.tensor.numel(), str(dense.tensor.dtype))
        bad_local = dense.flag(bad_local)
    layout = wire.Layout.of(parts)
    sig = wire.signature(*facts)
    message = _comm.scratch("sparse_whole_message", layout.width, torch.uint8, tensor.device)  # same size every step
    layout.write(message, parts, wire.status_word(tensor.device, error=code, sig=sig, nonfinite=bad_local))
    gathered = _comm.all_gather(message, group=group, stats=stats)
    statuses = wire.read_status(gathered)
    wire.check_byte_statuses(statuses, sig, "allreduce", msg)
    with codec_timer(stats, "decompress"):
        rows = [layout.read(gathered[r]) for r in range(world)]
        direct = out is not None and out.dtype == torch.float32 and out.is_contiguous()
        acc = out.view(-1) if direct else _comm.scratch("sparse_whole_sum", n, torch.float32, tensor.device)
        # decoded in fp32 whatever the input's dtype: the sum of the decoded values, rounded once
        pieces = [dataclasses.replace(payload, tensors=tuple(row[:2]), dtype=torch.float32) for row in rows]
        codec.decompress_sum(pieces, acc)
        if len(parts) == 3:
            wire.add_rows(dense.tensor.view(-1), [row[2] for row in rows])
        if out is None:  # acc is a reused scratch buffer: never hand it out
            out = acc.to(tensor.dtype, copy=True).reshape(tensor.shape)
        elif not direct:
            out.view(-1).copy_(acc)
    return _judged(out, statuses, transaction, stats, "whole_blockquant")


def _judged(out, statuses, transaction, stats, algorithm: str) -> torch.Tensor:
    """A whole-tensor send's verdict: a NaN/inf on any rank poisons ``out`` and keeps every
    residual of ``transaction``; the call counted under ``algorithm``."""
    bad = wire.any_nonfinite(statuses)
    transaction.mark_bad(bad)
    wire.poison_(out, bad)
    if stats is not None:
        stats.add(calls=1, algorithm=algorithm)
    return out


def _whole_dense(tensor, ef: ErrorFeedback, group, key, stats, transaction, error, out,
                 wire_dtype: torch.dtype, dense: wire.Rider | None = None, scale: float = 1.0) -> torch.Tensor:
    """One all_reduce of the whole compensated tensor (``x + beta * e``) instead of a selection.

    ``"dense"`` with error feedback sends it in fp32: the bytes of the densified selection, an
    exact sum, the residual emptied, no selection.  ``"auto"`` takes it, in bf16
    (:func:`whole_wire_dtype`; the residual keeps the rounding error), when this ring all_reduce
    is the smallest message (:func:`whole_choice`: at P >= 8, where gathering P whole 4-bit
    messages would send more).  Sums in ``wire_dtype``, as
    PyTorch's fp16/bf16 hooks do.  With a ``dense`` part at P <= 2: one all_gather that carries
    it too (:func:`_whole_gathered`)."""
    if dense is not None and wire.Rider.free(_comm.world(group)):
        return _whole_gathered(tensor, ef, group, key, stats, transaction, error, out, wire_dtype, dense, scale)
    n, world = tensor.numel(), _comm.world(group)
    code, msg = error
    buf = _comm.scratch("sparse_whole", n + 1 + wire.SUM_SLOTS, wire_dtype, tensor.device)
    bad_local = None
    if not code:
        try:
            with codec_timer(stats, "compress"):
                bad_local = ef.send_whole(tensor, key, buf[:n], transaction, scale=scale,
                                          scratch=_is_scratch(tensor, out))
        except Exception as exc:  # noqa: BLE001 - reported through the status word on every rank
            code, msg = wire.E_MISUSE, f"compress failed: {type(exc).__name__}: {exc}"
    if code:
        buf[:n].zero_()
    buf[n:].zero_()  # the padding slot of the selection's layout, then the status slots
    wire.sum_slots(buf, error=code, nonfinite=bad_local, rank=_comm.rank(group), world=world)
    _comm.all_reduce_(buf, group=group, stats=stats)
    wire.check_sum_slots(buf, "allreduce", msg, world)
    bad = buf[-1] != 0
    with codec_timer(stats, "decompress"):
        if out is None:  # buf is a reused scratch buffer: never hand it out
            out = buf[:n].to(tensor.dtype, copy=True).reshape(tensor.shape)
        else:
            out.view(-1).copy_(buf[:n])
    transaction.mark_bad(bad)
    wire.poison_(out, bad)
    if stats is not None:
        stats.add(calls=1, algorithm="dense")
    return out


def _whole_gathered(tensor, ef: ErrorFeedback, group, key, stats, transaction, error, out,
                    wire_dtype: torch.dtype, dense: wire.Rider, scale: float = 1.0) -> torch.Tensor:
    """:func:`_whole_dense` carrying the bucket's dense part, at P <= 2: one ``all_gather`` of
    ``[status word | whole compensated tensor in wire_dtype | dense part raw]`` instead of the
    whole tensor's ring all_reduce plus the dense part's own (at P=2 an all_gather sends what a
    ring all_reduce sends: the same bytes, up to 8-byte alignment, in one round).  Both are
    summed in rank order (:func:`wire.add_rows`): the whole tensor rounded once to
    ``wire_dtype`` (what the all_reduce of the two wire values gives), the dense part exactly
    as when it rides in the ``"allgather"`` message (fp32 for fp16 / bf16, rounded once).  The
    dense part's NaN/inf joins this rank's status: the result all-NaN and every residual kept."""
    n, world = tensor.numel(), _comm.world(group)
    code, msg = error
    d = dense.tensor.reshape(-1)
    layout = wire.Layout.of((torch.empty(n, dtype=wire_dtype, device="meta"), d))
    sig = wire.signature("whole", n, str(wire_dtype), d.numel(), str(d.dtype))
    message = torch.empty(layout.width, dtype=torch.uint8, device=tensor.device)
    whole, slot = layout.read(message)
    bad_local = None
    if not code:
        try:
            with codec_timer(stats, "compress"):
                bad_local = ef.send_whole(tensor, key, whole, transaction, scale=scale,   # straight into the message
                                          scratch=_is_scratch(tensor, out))
        except Exception as exc:  # noqa: BLE001 - reported through the status word on every rank
            code, msg = wire.E_MISUSE, f"compress failed: {type(exc).__name__}: {exc}"
    if code:
        whole.zero_()
    slot.copy_(d)
    dense.carried = True
    wire.status_word(tensor.device, error=code, sig=sig, nonfinite=dense.flag(bad_local),
                     out=message[:wire.STATUS_BYTES].view(torch.int32))
    gathered = _comm.all_gather(message, group=group, stats=stats)
    statuses = wire.read_status(gathered)
    wire.check_byte_statuses(statuses, sig, "allreduce", msg)
    with codec_timer(stats, "decompress"):
        rows = [layout.read(gathered[r]) for r in range(world)]
        direct = out is not None and out.dtype == wire_dtype and out.is_contiguous()
        acc = out.view(-1) if direct else _comm.scratch("sparse_whole_sum", n, wire_dtype, tensor.device)
        wire.add_rows(acc, [row[0] for row in rows])
        wire.add_rows(d, [row[1] for row in rows])
        if out is None:  # acc is a reused scratch buffer: never hand it out
            out = acc.to(tensor.dtype, copy=True).reshape(tensor.shape)
        elif not direct:
            out.view(-1).copy_(acc)
    return _judged(out, statuses, transaction, stats, "dense")


def _variable(tensor, compressor, group, key, step, algorithm, stats, generator, transaction):
    """The count-exchanging algorithms (split, hashed, recursive doubling) on the compact payload."""
    idx = vals = None
    error = (0, "")
    try:
        if isinstance(compressor, ErrorFeedback):
            payload = compressor.compress(tensor, step=step, key=key, generator=generator,
                                          transaction=transaction)
        else:
            payload = compressor.compress(tensor, step=step, key=key, generator=generator)
        idx, vals = payload.tensors
        vals = vals.to(tensor.dtype)
    except Exception as exc:  # noqa: BLE001 - raised on every rank through the header
        error = (wire.E_MISUSE, f"compress failed: {type(exc).__name__}: {exc}")
    out = sparse_allreduce(idx, vals, tensor.numel(), group=group, algorithm=algorithm, stats=stats,
                           validate=False, _error=error)
    if has_feedback(compressor):
        transaction.mark_bad(nonfinite_flag(out))  # a selected NaN/inf shows in the sum
    return out.reshape(tensor.shape)
