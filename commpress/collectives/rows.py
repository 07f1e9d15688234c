"""Lossless sum of row-sparse 2-D tensors (naturally sparse gradients: ZEN's case).

``rows_allreduce(x)`` with ``x`` of shape ``(rows, D)`` returns on every rank the sum over the
ranks of ``x``, computed from each rank's *nonzero rows* only (a row is sent when any of its
elements is ``!= 0``; NaN rows are sent and propagate).  The result equals the dense all-reduce
up to fp32 summation order (exactly where no row is nonzero on two ranks), is **bitwise
identical on every rank** (every rank applies the same gathered bytes in the same order) and
deterministic.  fp16 / bf16 rows are summed in fp32 and rounded once (``"hashed"``: the owners'
sums travel in the input's dtype, so rounded once more where an overflow round adds to them).

What goes on the wire (``P`` ranks; an *entry* is an int32 row index, int64 from ``2**31`` rows,
plus a row of ``D`` values in ``x``'s dtype; every message starts with :mod:`.wire`'s status word
and a few int64 counts, each part 8-aligned):

``"allgather"``
    one ``all_gather`` of ``capacity`` entries per rank plus its count of nonzero rows and its
    rows per hash owner; every rank adds the P ranks' rows in rank order.  Cheapest at P = 2
    and where the ranks' rows rarely overlap.
``"hashed"`` (ZEN)
    rows are routed by ``commpress.ops.hash_owner(row, P)``: one ``all_to_all`` of
    ``owner_capacity`` entries per (rank, owner), each owner sums what it got in rank order,
    then one ``all_gather`` of the owners' summed rows, ``union_capacity`` entries per owner.
    Where the ranks touch the same rows, the all-gather carries each row once, not P times.
``"auto"``
    the cheaper of the two for these capacities by the calibrated cost model
    (:func:`row_costs`, :func:`~.costmodel.get_cost_model`); a pure function of agreed facts,
    so every rank chooses alike.

**Capacity and overflow.**  The first round carries at most ``capacity`` rows per rank (hashed:
``owner_capacity`` per owner and ``union_capacity`` summed rows per owner), sizes every rank
knows without a host read (the caller's, e.g. from previous steps: :mod:`commpress.hooks.sparse_rows`).
What does not fit goes in **one overflow round** (an ``all_gather`` sized by the largest
leftover), so no row is ever dropped; :attr:`RowsResult.overflow_rounds` says whether it ran.
``capacity=0`` is a count round followed by exact sizes (``"hashed"`` with zero capacities: every
row goes in the overflow all_gather, none through an owner).

**Host reads.**  Finding the nonzero rows and filling the fixed-size slots run on ``x``'s device
(a cumulative count and a scatter, no ``nonzero()``).  One host read remains per call: the
status words and counts of the *last first-round message* (a few int64 per rank, after the
all_gather), because whether an overflow round runs is a decision the host makes (it issues the
collective) and every rank must make it alike.  On CPU tensors that read is free (host memory);
on CUDA it waits for that all_gather only.  The bytes are judged there too: a bad input or a
configuration that differs on any rank raises :class:`~.wire.CollectiveInputError` on every rank.

**In place.**  ``out=tensor`` writes the sum into the input (a DDP bucket's view): only the rows
this rank sent are zeroed before the others' land, so no pass over the whole tensor beyond
finding its nonzero rows.

**Static facts** (shape, dtype, capacities, algorithm) are agreed by one header ``all_gather``
the first time a ``(group, key, facts)`` is seen, as :func:`~.validate.check_once` does.  Later,
facts that differ across ranks (say one rank's capacity) are caught by the status words' signature
on every rank where the messages have the same size; where they do not, gloo aborts the rank that
receives more than it expected ("Received data size doesn't match"), so every rank must pass the
same capacities (:class:`~commpress.hooks.sparse_rows.SparseRows` derives them from gathered counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import _comm, costmodel, wire
from .accounting import CommStats, codec_timer
from ..ops import reference
from .sparse import acc_dtype, wire_index_dtype
from .wire import DTYPES, E_DTYPE, E_MISUSE, E_SHAPE, ERRORS, CollectiveInputError, Layout, align8, dtype_code

__all__ = ["ROW_ALGORITHMS", "RowsResult", "nonzero_rows", "row_bytes", "row_costs", "rows_allreduce",
           "rows_reduce_scatter", "row_scatter_bytes"]

ROW_ALGORITHMS = ("allgather", "hashed")


@dataclass
class RowsResult:
    """What :func:`rows_allreduce` returns (the same on every rank).

    Attributes:
        sum: ``(rows, D)`` tensor, the sum over the ranks, in the input's dtype.
        algorithm: ``"allgather"``, ``"hashed"`` or ``"local"`` (one rank).
        counts: nonzero rows of each rank (host ints, read after the first round).
        owner_counts: ``owner_counts[r][o]``: rank ``r``'s nonzero rows that hash to owner ``o``.
        union: 0-d int64 tensor on the device, read it lazily: rows nonzero on some rank
            (``"hashed"``: the rows the owners summed in the first round, a lower bound after
            an overflow round).
        overflow_rounds: 0, or 1 when some rank's rows did not fit the capacities.
        owner_unions: ``"hashed"``: the rows each owner summed in the first round (host ints);
            empty otherwise.
    """

    sum: torch.Tensor
    algorithm: str
    counts: list[int]
    owner_counts: list[list[int]]
    union: torch.Tensor
    overflow_rounds: int = 0
    owner_unions: list[int] = field(default_factory=list)
    #: :func:`rows_reduce_scatter`: whether some rank's rows held a NaN/inf (host bool, every rank alike)
    nonfinite: bool = False


def nonzero_rows(x: torch.Tensor) -> torch.Tensor:
    """Bool mask ``[rows]`` of the rows of ``x`` with any element ``!= 0`` (NaN counts), on ``x``'s device.

    Two reductions (a row is zero when its max and min are), no temporary of ``x``'s size: on one
    CPU core about 4x faster than ``(x != 0).any(1)`` (50000 x 64 fp32: 6 against 23 ms)."""
    if not x.shape[1] or not x.shape[0]:
        return torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    return (x.amax(dim=1) != 0) | (x.amin(dim=1) != 0)


# ---------------------------------------------------------------- cost model
def _widths(world: int, dim: int, value_bytes: int, index_bytes: int, capacity: int, owner_capacity: int,
            union_capacity: int) -> dict[str, int]:
    """Bytes of one message of each round (status word, counts, indices, rows; 8-aligned)."""
    def slots(c: int, meta: int) -> int:
        return wire.STATUS_BYTES + align8(8 * meta) + align8(index_bytes * c) + align8(value_bytes * dim * c)
    return {"allgather": slots(capacity, 1 + world), "a2a": slots(owner_capacity, 1),
            "owners": slots(union_capacity, 3 + world)}


def row_bytes(world: int, rows: int, dim: int, dtype: torch.dtype, capacity: int, owner_capacity: int,
              union_capacity: int) -> dict[str, float]:
    """Bytes one rank sends in a call without overflow: ``"allgather"``, ``"hashed"`` and a dense
    ring ``"dense"`` all_reduce of the same tensor (:mod:`.accounting`'s convention).

    Args:
        world: ranks ``P``.
        rows, dim, dtype: the tensor.
        capacity: rows per rank of ``"allgather"``'s first round.
        owner_capacity, union_capacity: ``"hashed"``'s slots per (rank, owner) and per owner.
    """
    vb = torch.empty((), dtype=dtype).element_size()
    w = _widths(world, dim, vb, wire_index_dtype(rows + 1).itemsize, capacity, owner_capacity, union_capacity)
    return {"allgather": (world - 1) * w["allgather"], "hashed": (world - 1) * (w["a2a"] + w["owners"]),
            "dense": 2 * rows * dim * vb * (world - 1) / world}


def row_costs(world: int, rows: int, dim: int, capacity: int, owner_capacity: int, union_capacity: int,
              value_bytes: int, index_bytes: int, model: costmodel.CostModel) -> dict[str, float]:
    """Predicted seconds of ``"allgather"``, ``"hashed"`` and a dense ring ``"dense"`` all_reduce.

    Bytes are the messages' sizes at these capacities (:mod:`.accounting`'s convention: what one
    rank sends); entries are the values each rank adds or writes, elements the dense output it
    zero-fills.

    Args:
        world: ranks ``P``.
        rows, dim: the tensor's shape.
        capacity: rows per rank of ``"allgather"``'s first round.
        owner_capacity, union_capacity: ``"hashed"``'s slots per (rank, owner) and per owner.
        value_bytes, index_bytes: bytes of one value and one row index.
        model: the alpha-beta(-gamma-delta) model.
    """
    P = world
    w = _widths(P, dim, value_bytes, index_bytes, capacity, owner_capacity, union_capacity)
    n = rows * dim
    return {
        "allgather": model.time(P - 1, (P - 1) * w["allgather"], P * capacity * dim, n),
        "hashed": model.time(2 * (P - 1), (P - 1) * (w["a2a"] + w["owners"]),
                             P * (owner_capacity + union_capacity) * dim, n + n / P),
        "dense": model.time(2 * (P - 1), 2 * n * value_bytes * (P - 1) / P, 0, n),
    }


def _choose(world, rows, dim, caps, value_bytes, index_bytes, model) -> str:
    costs = row_costs(world, rows, dim, *caps, value_bytes, index_bytes, model)
    return min(ROW_ALGORITHMS, key=lambda a: (costs[a], ROW_ALGORITHMS.index(a)))   # ties: allgather


# ---------------------------------------------------------------- agreement on static facts
_AGREED = _comm.BoundedCache(4096)   # (group key, key, facts) -> algorithm
_FIELDS = ("rows", "D", "dtype", "capacity", "owner_capacity", "union_capacity", "algorithm")
_ALGO_CODES = ("auto",) + ROW_ALGORITHMS


def _local_check(x, capacity, owner_capacity, union_capacity, algorithm, out=None) -> tuple[int, str]:
    if not isinstance(x, torch.Tensor):
        return E_DTYPE, f"tensor must be a torch.Tensor, got {type(x).__name__}"
    if x.dim() != 2:
        return E_SHAPE, f"tensor must be 2-D (rows x D), got shape {tuple(x.shape)}"
    if not x.is_floating_point() or x.dtype not in DTYPES:
        return E_DTYPE, f"tensor must be float32, float16, bfloat16 or float64, got {x.dtype}"
    for name, c in (("capacity", capacity), ("owner_capacity", owner_capacity), ("union_capacity", union_capacity)):
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            return E_MISUSE, f"{name} must be an int >= 0, got {c!r}"
    if algorithm not in _ALGO_CODES:
        return E_MISUSE, f"algorithm must be one of {_ALGO_CODES}, got {algorithm!r}"
    if out is not None and not (isinstance(out, torch.Tensor) and out.shape == x.shape and out.dtype == x.dtype
                                and out.device == x.device):
        return E_MISUSE, "out must be a tensor of the input's shape, dtype and device"
    return 0, ""


def _agree(group, key, facts: tuple, error: tuple[int, str], device, stats) -> str:
    """The algorithm for these facts, agreed by a header all_gather the first time they are seen
    (or whenever this rank has an error); raises on every rank on bad input or a mismatch."""
    k = (_comm.group_key(group), repr(key), facts)
    found = _AGREED.get(k)
    code, msg = error
    if found is not None and not code:
        return found
    world = _comm.world(group)
    if world == 1:
        if code:
            raise CollectiveInputError(f"rows_allreduce: {msg}")
        return "local"
    algorithm = facts[-1]
    h = torch.tensor([code, *facts[:2], dtype_code(facts[2]), *facts[3:6], _ALGO_CODES.index(algorithm)
                      if algorithm in _ALGO_CODES else -1, costmodel.model_state(group)], dtype=torch.int64)
    table = _comm.all_gather(h.to(device), group=group, stats=stats).cpu().tolist()
    bad = [r for r, row in enumerate(table) if row[0]]
    if bad:
        detail = ", ".join(sorted({ERRORS.get(table[r][0], "error") for r in bad}))
        mine = f" (this rank: {msg})" if code else ""
        raise CollectiveInputError(f"rows_allreduce: bad input on rank(s) {bad}: {detail}{mine}")
    for i, name in enumerate(_FIELDS):
        col = [row[1 + i] for row in table]
        if len(set(col)) > 1:
            if name == "dtype":
                col = [str(DTYPES[c]) if 0 <= c < len(DTYPES) else "?" for c in col]
            elif name == "algorithm":
                col = [_ALGO_CODES[c] if 0 <= c < len(_ALGO_CODES) else "?" for c in col]
            raise CollectiveInputError(f"rows_allreduce: {name} differs across ranks: {col}")
    if algorithm == "auto":
        model = costmodel.agreed_cost_model([row[-1] for row in table], group)
        vb = torch.empty((), dtype=facts[2]).element_size()
        algorithm = _choose(world, facts[0], facts[1], facts[3:6], vb, wire_index_dtype(facts[0] + 1).itemsize,
                            model)
    _AGREED.put(k, algorithm)
    return algorithm


# ---------------------------------------------------------------- entry point
def rows_allreduce(tensor: torch.Tensor, *, capacity: int = 0, owner_capacity: int | None = None,
                   union_capacity: int | None = None, algorithm: str = "auto", group=None, key="rows",
                   stats: CommStats | None = None, out: torch.Tensor | None = None) -> RowsResult:
    """Sum a row-sparse ``(rows, D)`` tensor over ``group``, sending only its nonzero rows.

    Every rank gets bitwise the same sum; no row is dropped (see the module doc for the wire,
    the capacities and the one host read per call).

    Args:
        tensor: 2-D floating tensor (fp32, fp16, bf16 or fp64), the same shape on every rank.
        capacity: rows per rank in ``"allgather"``'s first round (0: a count round, then exact).
        owner_capacity: ``"hashed"``: rows per (rank, owner) in the all_to_all;
            default ``ceil(capacity / P)``.
        union_capacity: ``"hashed"``: summed rows per owner in the all_gather; default
            ``owner_capacity``.
        algorithm: ``"allgather"``, ``"hashed"`` or ``"auto"`` (the cost model).
        group: the process group (default: the world).
        key: names the call site for the once-per-facts agreement (e.g. the parameter's name).
        stats: charged with the bytes, rounds and the algorithm (``calls=1``).
        out: where the sum is written (``tensor``'s shape and dtype), ``tensor`` itself included:
            then only the rows this rank sent are zeroed before the sums land, no pass over the
            whole tensor (a DDP bucket's view).  Default: a new tensor.

    Returns:
        :class:`RowsResult`.

    Raises:
        CollectiveInputError: (a ``ValueError``) on every rank when any rank's tensor is not 2-D or
            not floating point, a capacity is not an int >= 0, ``algorithm`` is unknown, or the
            shape, dtype, capacities or algorithm differ across ranks.
    """
    world = _comm.world(group)
    if owner_capacity is None:
        owner_capacity = -(-capacity // world) if isinstance(capacity, int) and capacity > 0 else 0
    if union_capacity is None:
        union_capacity = owner_capacity
    error = _local_check(tensor, capacity, owner_capacity, union_capacity, algorithm, out)
    ok = error[0] == 0
    device = _comm.comm_device(group, tensor if isinstance(tensor, torch.Tensor) else None)
    shape = tuple(tensor.shape) if ok else (-1, -1)
    facts = (shape[0], shape[1], tensor.dtype if ok else None,
             capacity if ok else -1, owner_capacity if ok else -1, union_capacity if ok else -1, algorithm)
    chosen = _agree(group, key, facts, error, device, stats)
    x = tensor.contiguous()
    if chosen == "local":
        mask = nonzero_rows(x)
        count = mask.sum()
        total = out.copy_(x) if out is not None else x.clone()
        result = RowsResult(total, "local", [int(count)], [[int(count)]], count)
    elif chosen == "allgather":
        result = _allgather(x, capacity, group, stats, out)
    else:
        result = _hashed(x, owner_capacity, union_capacity, group, stats, out)
    if stats is not None:
        stats.add(calls=1, algorithm=f"rows_{result.algorithm}")
    return result


# ---------------------------------------------------------------- device-side slot filling
def _slots(mask: torch.Tensor, rank_in: torch.Tensor, rows_of: torch.Tensor, segment: torch.Tensor | None,
           lo: int, cap: int, segments: int, empty: int) -> torch.Tensor:
    """Slot table of ``segments * cap`` row indices (``empty`` where unused), on the device:
    the rows whose rank among the marked rows of their segment lies in ``[lo, lo + cap)``.

    ``mask``: which entries are marked; ``rank_in``: each entry's 0-based rank within its
    segment; ``rows_of``: the row index each entry stands for; ``segment``: each entry's segment
    (None: one segment).  One scatter; unused entries go to a spare slot that is cut off."""
    n = mask.numel()
    table = torch.full((segments * cap + 1,), empty, dtype=torch.int64, device=mask.device)
    if n == 0 or cap == 0:
        return table[:-1]
    pos = rank_in - lo
    keep = mask & (pos >= 0) & (pos < cap)
    target = pos if segment is None else segment * cap + pos
    target = torch.where(keep, target, torch.full_like(target, segments * cap))
    table.scatter_(0, target, rows_of)
    return table[:-1]


def _take_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` where ``idx == rows`` (empty slot) gives a row of zeros."""
    n = x.shape[0]
    rows = x.index_select(0, idx.clamp(max=max(n - 1, 0))) if n else x.new_zeros((idx.numel(), x.shape[1]))
    return rows.masked_fill_((idx >= n).unsqueeze(1), 0)


_OWNERS = _comm.BoundedCache(4)   # (rows, world, device) -> _owners(...)


def _owners(n: int, world: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Per row its hash owner (:func:`commpress.ops.hash_owner`, as the element-level ``"hashed"``
    sum); the rows grouped by owner, ascending within a group; the owner of each grouped position;
    the group offsets.  Computed once per ``(rows, P, device)`` and cached, with the torch reference
    of the hash (a sort of the rows: no kernel compiled in every rank process for a one-off)."""
    key = (n, world, str(device))
    found = _OWNERS.get(key)
    if found is None:
        owner = reference.hash_owner(torch.arange(n, device=device), world)
        seg, order = torch.sort(owner, stable=True)
        sizes = torch.bincount(owner, minlength=world).tolist()
        offs = [0]
        for c in sizes:
            offs.append(offs[-1] + c)
        found = (owner, order, seg, offs)
        _OWNERS.put(key, found)
    return found


_OWNER_IDS = _comm.BoundedCache(4)   # (rows, world, device) -> int32 owner of each row


def _owner_ids(n: int, world: int, device) -> torch.Tensor:
    """Per row its hash owner as int32: all ``"allgather"`` needs (the counts per owner that size a
    later ``"hashed"`` call), cached at 4 bytes a row; :func:`_owners`' tables (24 bytes a row)
    only exist where ``"hashed"`` runs."""
    key = (n, world, str(device))
    found = _OWNER_IDS.get(key)
    if found is None:
        full = _OWNERS.get(key)
        found = (full[0] if full is not None else reference.hash_owner(torch.arange(n, device=device), world)
                 ).to(torch.int32)
        _OWNER_IDS.put(key, found)
    return found


def _owner_counts(mask: torch.Tensor, world: int) -> torch.Tensor:
    """Nonzero rows per hash owner (int64 ``[P]``, on the device)."""
    owner = _owner_ids(mask.numel(), world, mask.device)
    return torch.zeros(world, dtype=torch.int64, device=mask.device).index_add_(0, owner, mask.to(torch.int64))


def _host_meta(gathered: torch.Tensor, layout: Layout, sig: int, what: str) -> list[list[int]]:
    """The one host read: every rank's status word (judged: raises on every rank) and counts."""
    _, _, off, nb = layout.specs[0]
    head = gathered[:, :off + nb].cpu().numpy()
    status = head[:, :wire.STATUS_BYTES].view("int32")
    sigs = status[:, 1].tolist()
    if len(set(sigs)) > 1:   # first: a hashed owner forwards a sender's mismatch as an error flag
        raise CollectiveInputError(f"{what}: shape, dtype, capacities or algorithm differ across ranks "
                                   f"(signatures {sigs})")
    wire.judge_bytes(status, sig, what)
    return head[:, off:off + nb].view("int64").tolist()


def _message(layout: Layout, parts, sig: int, device, flag: torch.Tensor | None = None) -> torch.Tensor:
    msg = torch.empty(layout.width, dtype=torch.uint8, device=device)
    with wire.device_error(flag):
        layout.write(msg, parts, wire.status_word(device, sig=sig))
    return msg


def _target(x: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """Where the sums are taken: ``out`` itself where its dtype is the sums' (``True``: it is ``x``,
    whose own rows must be zeroed before anything is added), else a zeroed buffer."""
    adt = acc_dtype(x.dtype)
    if out is None or out.dtype != adt:
        return torch.zeros(x.shape, dtype=adt, device=x.device), False
    if out.data_ptr() == x.data_ptr() and out.stride() == x.stride():
        return out, True
    return out.zero_(), False


def _finish(acc: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if out is not None:
        return out if acc is out else out.copy_(acc)
    return acc if acc.dtype == dtype else acc.to(dtype)


def _zero_rows(acc: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    """Zero the rows of ``acc`` listed in ``pieces`` (this rank's own rows, when summing in place)."""
    rows = torch.cat([p.long() for p in pieces]) if pieces else None
    if rows is not None and rows.numel():
        acc.index_fill_(0, rows, 0)


# ---------------------------------------------------------------- allgather
def _allgather(x: torch.Tensor, cap: int, group, stats, out) -> RowsResult:
    """Round 1: every rank's first ``cap`` nonzero rows; overflow: the rest, sized by the largest."""
    n, d = x.shape
    world, me, dev = _comm.world(group), _comm.rank(group), x.device
    idt = wire_index_dtype(n + 1)
    with codec_timer(stats, "compress"):
        mask = nonzero_rows(x)
        rank_in = torch.cumsum(mask, 0) - 1
        meta = torch.cat([mask.sum().reshape(1), _owner_counts(mask, world)])
        idx = _slots(mask, rank_in, torch.arange(n, device=dev), None, 0, cap, 1, n)
        parts = (meta, idx.to(idt), _take_rows(x, idx))
    layout = Layout.of(parts)
    sig = wire.signature("rows_allgather", n, d, str(x.dtype), cap)
    gathered = _comm.all_gather(_message(layout, parts, sig, dev), group=group, stats=stats)
    metas = _host_meta(gathered, layout, sig, "rows_allreduce")
    counts = [m[0] for m in metas]
    rounds = [(layout, gathered, [min(c, cap) for c in counts], idx)]   # (layout, rows, valid per rank, my slots)
    extra = max(counts) - cap
    if extra > 0:
        with codec_timer(stats, "compress"):
            idx = _slots(mask, rank_in, torch.arange(n, device=dev), None, cap, extra, 1, n)
            parts = (idx.to(idt), _take_rows(x, idx))
        layout = Layout.of(parts)
        gathered = _comm.all_gather(_message(layout, parts, sig, dev), group=group, stats=stats)
        rounds.append((layout, gathered, [max(c - cap, 0) for c in counts], idx))
    with codec_timer(stats, "decompress"):
        acc, own = _target(x, out)
        if own:
            _zero_rows(acc, [slots[:valid[me]] for _, _, valid, slots in rounds])
        touched = torch.zeros(n, dtype=torch.bool, device=dev)
        for lay, rows, valid, _ in rounds:
            for r in range(world):   # rank order on every rank: bitwise the same sums
                gi, gv = lay.read(rows[r])[-2:]
                gi, gv = gi[:valid[r]].long(), gv[:valid[r]]
                acc.index_add_(0, gi, gv.to(acc.dtype))
                touched[gi] = True
    return RowsResult(_finish(acc, out, x.dtype), "allgather", counts, [m[1:] for m in metas], touched.sum(),
                      int(extra > 0))


# ---------------------------------------------------------------- hashed (ZEN)
def _hashed(x: torch.Tensor, s: int, u_cap: int, group, stats, out) -> RowsResult:
    """All_to_all of ``s`` rows per owner, owners sum (rank order), all_gather of ``u_cap`` summed
    rows per owner; one overflow all_gather for the rows that did not fit either."""
    n, d = x.shape
    world, me, dev = _comm.world(group), _comm.rank(group), x.device
    idt = wire_index_dtype(n + 1)
    sig = wire.signature("rows_hashed", n, d, str(x.dtype), s, u_cap)
    _, order, seg, offs = _owners(n, world, dev)
    with codec_timer(stats, "compress"):
        mask = nonzero_rows(x)
        sorted_mask = mask[order]
        run = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), torch.cumsum(sorted_mask, 0)])
        starts = run[torch.tensor(offs, device=dev)]                 # [P + 1]
        per_owner = starts[1:] - starts[:-1]                         # my rows per owner
        rank_in = run[1:] - 1 - starts[:-1][seg]
        send_idx = _slots(sorted_mask, rank_in, order, seg, 0, s, world, n).reshape(world, s)
        rows = _take_rows(x, send_idx.reshape(-1)).reshape(world, s, d)
        pieces = [(per_owner[o:o + 1], send_idx[o].to(idt), rows[o]) for o in range(world)]
    a2a = Layout.of(pieces[0])
    send = torch.empty(world, a2a.width, dtype=torch.uint8, device=dev)
    for o in range(world):
        a2a.write(send[o], pieces[o], wire.status_word(dev, sig=sig))
    recv = _comm.all_to_all_(torch.empty_like(send), send, group=group, stats=stats)

    # the owner: sum what each rank sent, in rank order, over its own rows
    with codec_timer(stats, "decompress"):
        members = order[offs[me]:offs[me + 1]]
        L = members.numel()
        part = torch.zeros(L + 1, d, dtype=acc_dtype(x.dtype), device=dev)
        touched = torch.zeros(L + 1, dtype=torch.bool, device=dev)
        statuses = wire.read_status(recv)
        forwarded = (((statuses[:, 0] >> 8) & 0xFF) != 0).any() | (statuses[:, 1] != sig).any()
        for r in range(world):
            _, gi, gv = a2a.read(recv[r])
            pos = torch.searchsorted(members, gi.long())              # an empty slot (row n) -> L
            part.index_add_(0, pos, gv.to(part.dtype))
            touched[pos] = True
        touched[L] = False
        union = touched.sum()
        urank = torch.cumsum(touched, 0) - 1
        upos = _slots(touched, urank, torch.arange(L + 1, device=dev), None, 0, u_cap, 1, L)
        members_pad = torch.cat([members, torch.full((1,), n, dtype=torch.int64, device=dev)])
        my_over = (per_owner - s).clamp(min=0).sum()
        meta = torch.cat([mask.sum().reshape(1), union.reshape(1), my_over.reshape(1), per_owner])
        parts = (meta, members_pad[upos].to(idt), part[upos].to(x.dtype))
    layout = Layout.of(parts)
    gathered = _comm.all_gather(_message(layout, parts, sig, dev, forwarded), group=group, stats=stats)
    metas = _host_meta(gathered, layout, sig, "rows_allreduce")
    union_over = [max(m[1] - u_cap, 0) for m in metas]
    send_over = [m[2] for m in metas]
    over = None
    if max(union_over) or max(send_over):
        over = _hashed_overflow(x, mask, sorted_mask, rank_in, order, seg, touched, urank, members_pad, part,
                                s, u_cap, union_over, send_over, sig, group, stats)
    with codec_timer(stats, "decompress"):
        acc, own = _target(x, out)
        if own:   # this rank's rows: the first round's (per owner) and the overflow's
            mine = [send_idx[o, :min(c, s)] for o, c in enumerate(metas[me][3:])]
            _zero_rows(acc, mine + ([over[me][2]] if over else []))
        for o in range(world):   # owners' rows are disjoint: a copy each
            _, gi, gv = layout.read(gathered[o])
            k = min(metas[o][1], u_cap)
            acc.index_copy_(0, gi[:k].long(), gv[:k].to(acc.dtype))
        if over:
            for ui, uv, _, _ in over:
                acc.index_copy_(0, ui.long(), uv.to(acc.dtype))
            for _, _, si, sv in over:   # rank order
                acc.index_add_(0, si.long(), sv.to(acc.dtype))
    union_all = torch.tensor(sum(m[1] for m in metas), dtype=torch.int64, device=dev)
    counts = [m[0] for m in metas]
    return RowsResult(_finish(acc, out, x.dtype), "hashed", counts, [m[3:] for m in metas], union_all,
                      int(over is not None), [m[1] for m in metas])


def _hashed_overflow(x, mask, sorted_mask, rank_in, order, seg, touched, urank, members_pad, part,
                     s, u_cap, union_over, send_over, sig, group, stats) -> list[tuple]:
    """One all_gather of ``[summed rows beyond union_capacity (as owner) | own rows beyond
    owner_capacity]``; returns each rank's ``(union rows, their sums, own rows, their values)``,
    cut to the valid entries."""
    n, d = x.shape
    world, dev = _comm.world(group), x.device
    idt = wire_index_dtype(n + 1)
    U, S = max(union_over), max(send_over)
    L = members_pad.numel() - 1
    with codec_timer(stats, "compress"):
        upos = _slots(touched, urank, torch.arange(L + 1, device=dev), None, u_cap, U, 1, L)
        # rows beyond s in every owner's segment, in one table: segment-major, then compacted
        big = _slots(sorted_mask, rank_in, order, seg, s, S, world, n)   # [P * S], n where unused
        keep = big < n
        kpos = torch.cumsum(keep, 0) - 1
        send_idx = _slots(keep, kpos, big, None, 0, S, 1, n)
        parts = (members_pad[upos].to(idt), part[upos].to(x.dtype), send_idx.to(idt), _take_rows(x, send_idx))
    layout = Layout.of(parts)
    gathered = _comm.all_gather(_message(layout, parts, sig, dev), group=group, stats=stats)
    out = []
    for r in range(world):
        ui, uv, si, sv = layout.read(gathered[r])
        a, b = union_over[r], send_over[r]
        out.append((ui[:a], uv[:a], si[:b], sv[:b]))
    return out


# ---------------------------------------------------------------- reduce-scatter (FSDP2's layout)
def row_scatter_bytes(world: int, rows: int, dim: int, dtype: torch.dtype, capacity: int) -> dict[str, float]:
    """Bytes one rank sends in a :func:`rows_reduce_scatter` call without overflow (``"scatter"``)
    and in a dense ``reduce_scatter`` of the same tensor (``"dense"``: ``n·(P−1)/P``).

    Args:
        world: ranks ``P``.
        rows, dim, dtype: the whole (padded) tensor: ``P`` shards of ``rows / P`` rows.
        capacity: rows per (rank, owner) of the first round.
    """
    vb = torch.empty((), dtype=dtype).element_size()
    shard = -(-rows // max(world, 1))
    w = _widths(world, dim, vb, wire_index_dtype(shard + 1).itemsize, 0, capacity, 0)["a2a"]
    w += align8(8 * world)   # the per-owner counts and the NaN flag ride in every message
    return {"scatter": (world - 1) * w, "dense": rows * dim * vb * (world - 1) / max(world, 1)}


def _scatter_check(chunks, capacity, world, out) -> tuple[int, str]:
    if not isinstance(chunks, torch.Tensor):
        return E_DTYPE, f"chunks must be a torch.Tensor, got {type(chunks).__name__}"
    if chunks.dim() != 3 or chunks.shape[0] != world:
        return E_SHAPE, f"chunks must be 3-D (P={world} x rows x D), got shape {tuple(chunks.shape)}"
    if not chunks.is_floating_point() or chunks.dtype not in DTYPES:
        return E_DTYPE, f"chunks must be float32, float16, bfloat16 or float64, got {chunks.dtype}"
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        return E_MISUSE, f"capacity must be an int >= 0, got {capacity!r}"
    if out is not None and not (isinstance(out, torch.Tensor) and out.shape == chunks.shape[1:]
                                and out.dtype == chunks.dtype and out.device == chunks.device):
        return E_MISUSE, "out must be a tensor of one chunk's shape, dtype and device"
    return 0, ""


def rows_reduce_scatter(chunks: torch.Tensor, *, capacity: int = 0, group=None, key="rows_rs",
                        stats: CommStats | None = None, out: torch.Tensor | None = None) -> RowsResult:
    """Reduce-scatter of a row-sparse tensor in FSDP2's dim-0 layout, sending only nonzero rows.

    ``chunks[j]`` (``rows x D``) are the rows rank ``j`` owns (FSDP2's shard ``j`` of a parameter
    sharded on dim 0, padding included); every rank gets the sum over the ranks of its own chunk.
    Lossless: equal to a dense ``reduce_scatter`` (SUM) up to fp32 summation order (bitwise at
    P = 2), deterministic (the owner adds the ranks' rows in rank order), no row ever dropped.

    Wire: one ``all_to_all``: to owner ``j`` the status word, this rank's nonzero rows per owner
    (``P`` int64, so every rank learns the whole count matrix) and a NaN/inf flag, then up to
    ``capacity`` (local row index, row) entries of chunk ``j``; ``(P−1)·w`` bytes
    (:func:`row_scatter_bytes`).  Rows beyond ``capacity`` go in one more ``all_to_all`` sized by
    the largest leftover (:attr:`RowsResult.overflow_rounds`).  The one host read is the received
    headers (the counts), as :func:`rows_allreduce`'s.  Static facts are agreed by a header round
    the first time a ``(group, key, facts)`` is seen.

    Args:
        chunks: ``(P, rows, D)`` floating tensor (a strided view is fine: it is not copied whole).
        capacity: rows per (rank, owner) in the first round (0: every row in the second).
        group: the process group (default: the world).
        key: names the call site for the once-per-facts agreement.
        stats: charged with the bytes and rounds.
        out: ``(rows, D)`` where this rank's sum is written (default: a new tensor).

    Returns:
        :class:`RowsResult`: ``sum`` this rank's chunk of the sum, ``algorithm`` ``"scatter"``
        (``"local"`` on one rank), ``counts`` each rank's nonzero rows, ``owner_counts[r][j]``
        rank ``r``'s rows for owner ``j``, ``union`` this rank's shard rows nonzero on some rank
        (a device scalar), ``nonfinite``.

    Raises:
        CollectiveInputError: on every rank for bad input or facts that differ across ranks.
    """
    world = _comm.world(group)
    error = _scatter_check(chunks, capacity, world, out)
    ok = error[0] == 0
    device = _comm.comm_device(group, chunks if isinstance(chunks, torch.Tensor) else None)
    facts = ((chunks.shape[0] * chunks.shape[1], chunks.shape[2], chunks.dtype, 0, capacity, 0, "scatter") if ok
             else (-1, -1, None, -1, -1, -1, "scatter"))
    chosen = _agree(group, ("scatter", key), facts, error, device, stats)
    if chosen == "local":
        mask = nonzero_rows(chunks[0])
        count = mask.sum()
        total = out.copy_(chunks[0]) if out is not None else chunks[0].clone()
        result = RowsResult(total, "local", [int(count)], [[int(count)]], count,
                            nonfinite=not bool(torch.isfinite(chunks[0]).all()))
    else:
        result = _scatter(chunks, capacity, group, stats, out)
    if stats is not None:
        stats.add(calls=1, algorithm=f"rows_{result.algorithm}")
    return result


def _scatter(chunks: torch.Tensor, cap: int, group, stats, out) -> RowsResult:
    """All_to_all of ``cap`` rows per (rank, owner), the owner sums in rank order; one more
    all_to_all for what did not fit."""
    P, L, d = chunks.shape
    me, dev = _comm.rank(group), chunks.device
    idt = wire_index_dtype(L + 1)
    sig = wire.signature("rows_scatter", P * L, d, str(chunks.dtype), cap)
    with codec_timer(stats, "compress"):
        if L and d:
            hi, lo = chunks.amax(dim=2), chunks.amin(dim=2)          # [P, L], no temporary of chunks' size
            mask = (hi != 0) | (lo != 0)
            bad = (mask & ~(torch.isfinite(hi) & torch.isfinite(lo))).any().reshape(1).to(torch.int64)
        else:
            mask = torch.zeros(P, L, dtype=torch.bool, device=dev)
            bad = torch.zeros(1, dtype=torch.int64, device=dev)
        rank_in = (torch.cumsum(mask, 1) - 1).reshape(-1)
        seg = torch.arange(P, device=dev).repeat_interleave(L)
        local = torch.arange(L, device=dev).repeat(P)
        flat = mask.reshape(-1)
        meta = torch.cat([mask.sum(1), bad])

        def fill(lo_: int, c: int) -> torch.Tensor:
            idx = _slots(flat, rank_in, local, seg, lo_, c, P, L).reshape(P, c)
            rows = chunks[torch.arange(P, device=dev).unsqueeze(1), idx.clamp(max=max(L - 1, 0))] if L else \
                chunks.new_zeros((P, c, d))
            return idx, rows.masked_fill_((idx >= L).unsqueeze(2), 0)

        idx, rows = fill(0, cap)
    parts = [(meta, idx[o].to(idt), rows[o]) for o in range(P)]
    layout = Layout.of(parts[0])
    recv = _exchange(layout, parts, sig, dev, group, stats)
    metas = _host_meta(recv, layout, sig, "rows_reduce_scatter")
    matrix = [m[:P] for m in metas]
    rounds = [(layout, recv, [min(m[me], cap) for m in matrix])]
    extra = max(max(row) for row in matrix) - cap
    if extra > 0:
        with codec_timer(stats, "compress"):
            idx2, rows2 = fill(cap, extra)
        parts = [(idx2[o].to(idt), rows2[o]) for o in range(P)]
        lay2 = Layout.of(parts[0])
        rounds.append((lay2, _exchange(lay2, parts, sig, dev, group, stats), [max(m[me] - cap, 0) for m in matrix]))
    with codec_timer(stats, "decompress"):
        adt = acc_dtype(chunks.dtype)
        acc = out.zero_() if out is not None and out.dtype == adt else torch.zeros(L, d, dtype=adt, device=dev)
        touched = torch.zeros(L, dtype=torch.bool, device=dev)
        for lay, got, valid in rounds:
            for r in range(P):   # rank order on every owner: deterministic sums
                gi, gv = lay.read(got[r])[-2:]
                gi, gv = gi[:valid[r]].long(), gv[:valid[r]]
                acc.index_add_(0, gi, gv.to(adt))
                touched[gi] = True
    total = _finish(acc, out, chunks.dtype)
    return RowsResult(total, "scatter", [sum(row) for row in matrix], matrix, touched.sum(), int(extra > 0),
                      nonfinite=any(m[P] for m in metas))


def _exchange(layout: Layout, parts, sig: int, dev, group, stats) -> torch.Tensor:
    """One all_to_all of ``parts[o]`` (behind the status word) to each owner ``o``."""
    send = torch.empty(len(parts), layout.width, dtype=torch.uint8, device=dev)
    for o, piece in enumerate(parts):
        layout.write(send[o], piece, wire.status_word(dev, sig=sig))
    return _comm.all_to_all_(torch.empty_like(send), send, group=group, stats=stats)
