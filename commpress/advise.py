"""Will compression pay on my cluster?  A prediction from a few numbers, before any run.

``python -m commpress.advise --params 25e6 --compute-ms 100 --world 8 --bandwidth 1gbit``
(or :func:`advise` from Python) prints, for plain DDP and for each compressor, the predicted step
time and the bytes one rank sends per step, the bound ``1 / (1 − c)`` and which compressors pay.

The model (all inputs are the user's; nothing is sent anywhere)
---------------------------------------------------------------
* The gradient is ``N`` fp32 elements (``--params``), reduced as one flat tensor per step (DDP's
  buckets each add their own latency: ``ceil(4N / 25 MB)`` buckets; that is left out).
* A link is α-β (:class:`commpress.collectives.costmodel.CostModel`): ``α`` = the latency
  (``--latency-us``) per message, ``β`` = 8 / the bandwidth in bits per second (``--bandwidth``).
* **Messages and bytes** of each kind's collective are the library's own:
  plain DDP is a ring all-reduce of ``4N`` bytes (:func:`commpress.collectives.accounting.all_reduce_cost`:
  ``2(P−1)`` messages, ``2·4N·(P−1)/P`` bytes); a compressor's are
  :func:`commpress.collectives.hierarchy.kind_terms` (``sum``: ring all-reduce of its payload;
  ``gather``: two-phase all-to-all + all-gather, or one all-gather at ``P <= 2``; ``sparse``: the
  fixed-capacity all-gather or dense ring, whichever is smaller; ``lowrank``: PowerSGD's two
  all-reduces of the P and Q factors).  Payload sizes are probed on ``min(N, 2**20)`` elements and
  scaled to ``N``.  PowerSGD compresses matrices: the tensors named by ``--tensors`` (e.g.
  ``4096x4096,50257x768``) by their shapes, and the rest of the ``N`` elements as square matrices of
  side ``--matrix-side`` (1024).
* **Two levels** (``--gpus-per-node G`` with ``1 < G < P`` needs ``--intra-bandwidth``): every
  all-reduce is priced as commpress's two-level path (:mod:`commpress.collectives.hierarchy`), with
  ``s = ceil(N / G)`` and ``M = P / G`` nodes::

      comm = intra reduce-scatter (G−1 messages, 4s(G−1) bytes, fp32)
           + inter all-reduce of s elements among M ranks (the kind's terms above, inter link)
           + intra all-gather     (G−1 messages, 4s(G−1) bytes, fp32)

  and each rank codes only its shard (codec / G).  With ``G = P`` (one node) the flat collective
  runs on the intra link (when ``--intra-bandwidth`` is given).
* **Plain DDP across nodes** (``1 < G < P``): the ``"ddp"`` row is the two-level dense path above
  (what NCCL's rings reach with a NIC per GPU: each GPU's link carries ``1/G`` of the inter-node
  bytes); ``--flat-ddp`` adds the row ``"ddp(flat ring)"`` after it: PyTorch DDP's one ring over
  all ``P`` ranks as gloo runs it, each of its ``2(P−1)`` steps waiting for a chunk of ``4N/P``
  bytes over the inter-node link (``2(P−1)`` messages, ``2·4N·(P−1)/P`` bytes at
  ``--bandwidth``): the fair baseline where a node has one link (the emulated 2 × 2 cluster).
  Speedups and the bound stay relative to ``"ddp"``.
* **Codec** (compress + decompress, under error feedback for biased compressors, as the hooks
  run them, the residual kept as ``--residual-storage``, the hooks' default ``int8``): measured
  here on ``--device`` (a tensor of ``min(N, 2**22)`` elements per compressor, best of 3, scaled to
  ``N``: a smaller model is timed at its own size, in the caches it fits; on a CPU with one torch
  thread, as ``torchrun`` runs each rank), or ``--codec-ns-per-element X``
  for another machine (compress + decompress ns per element, split evenly between the two).  The
  collective's extra passes are charged too: two-phase quantized decodes twice and re-encodes
  ``1/P`` (``t_c(1 + 1/P) + 2 t_d``), the one-shot all-gather decodes ``P`` pieces (``t_c + P t_d``).
  ``--ranks-per-core R`` (CPU ranks oversubscribed, ``R`` sharing each core): the codec's seconds
  times ``R``, since the ranks of a core code at once, in lockstep with their collectives.
* **Per-round cost** (``--round-ms``): the hook's seconds per collective round beyond the α-β
  model (Python, the hand-off to its worker thread, the wait for the slower rank), charged as
  ``"auto"`` charges it (:func:`commpress.auto.decide.codec_seconds`: ``call_s`` = ``round_ms``
  × :func:`commpress.auto.decide.kind_rounds` of the kind, the two-level path two intra-node
  rounds more).  Not measured here: it needs the group (``"auto"`` measures it from its units'
  calls and reports it as ``stats.as_dict()["auto_network"]["round_ms"]``;
  ``python -m benchmarks advisecheck`` measures it on each emulated cluster at a tiny bucket).
  Default 0.  Plain DDP's rows pay none (PyTorch's own all-reduce).
* **The dense part** (``--dense-params D``): the hooks send a model's 1-D tensors (biases, norms)
  uncompressed in a dense part of each bucket (fp16/bf16 excepted: they cast every tensor).  Where
  the compressor's messages carry it (:func:`commpress.collectives.carries_dense`: a gather kind
  flat, a sparse kind flat at ``P <= 2``) its ``4D`` bytes ride in them; elsewhere (two levels,
  PowerSGD, a sparse kind at ``P > 2``) it takes an all-reduce of its own over all ``P`` ranks
  (a ring: ``2(P−1)`` messages, on the inter-node link where there are nodes) and one round more.
  ``D`` is taken out of the compressed elements.  Default: a dense part present, its size
  negligible (its round and messages counted, no bytes); ``0``: none (no 1-D tensors).
* **Step** = ``compute + max(0, comm − overlap·compute) + codec + rounds``: ``--overlap`` is the
  fraction of the compute during which communication may run hidden (DDP overlaps the backward
  pass only partly; 0, the default, is the conservative bound).  The codec is never hidden.
* **Bound**: ``c`` is the exposed communication's share of plain DDP's step; no compressor makes a
  step faster than ``1 / (1 − c)`` = DDP's step / compute, since every step is at least
  ``compute``.  ``speedup`` = DDP's step / the row's step; a row ``pays`` when it is above 1.
  ``price`` is :class:`commpress.auto.decide.Prices`'s prior of the steps to reach DDP's quality
  (1 = as many; a prior from the project's runs, not a measurement of your model), and
  ``to_target`` = speedup / price, the predicted gain in time to a target.

Bandwidths are written ``<number><unit>``, the unit one of ``kbit``, ``mbit``, ``gbit``, ``tbit``
(bits per second, powers of 1000): ``100mbit``, ``1gbit``, ``2.5gbit``, ``400gbit``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from .collectives.accounting import all_gather_cost, all_reduce_cost, reduce_scatter_cost
from .collectives.core import carries_dense
from .collectives.costmodel import CostModel
from .collectives.hierarchy import kind_terms
from .compressors import available, get
from .feedback import ErrorFeedback
from .storage import HOOK_DEFAULT, check_storage

#: Named links: bandwidth and per-message latency (rough published figures, not measurements).
PROFILES: dict[str, dict[str, Any]] = {
    "1gbit-ethernet": {"bandwidth": "1gbit", "latency_us": 50.0},
    "10gbit-ethernet": {"bandwidth": "10gbit", "latency_us": 25.0},
    "25gbit-ethernet": {"bandwidth": "25gbit", "latency_us": 15.0},
    "100gbit-ib": {"bandwidth": "100gbit", "latency_us": 3.0},
    "400gbit-ib": {"bandwidth": "400gbit", "latency_us": 2.0},
    "nvlink-node": {"bandwidth": "2400gbit", "latency_us": 3.0},
}

#: What is compared when ``compressors`` is not given.
DEFAULT_COMPRESSORS: tuple[str, ...] = (
    "fp16", "bf16", "blockquant(bits=8)", "blockquant(bits=4)", "topk(ratio=0.1)", "topk(ratio=0.01)",
    "powersgd(rank=4)", "powersgd(rank=1)",
)

DEFAULT_LATENCY_US = 50.0
DEFAULT_INTRA_LATENCY_US = 5.0
#: the residual storage the DDP and FSDP2 hooks keep by default (``register(residual_storage=)``)
DEFAULT_RESIDUAL_STORAGE = HOOK_DEFAULT
#: the row of PyTorch DDP's one flat ring across nodes (``1 < gpus_per_node < world``)
FLAT_DDP = "ddp(flat ring)"
PROBE_ELEMENTS = 1 << 22   # codec timing
_BYTES_PROBE = 1 << 20     # payload-size probe
_STEADY = 1 << 30          # past any density warm-up
_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_BW_RE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit|tbit)$")
_SPEC_RE = re.compile(r"^([a-z0-9_]+)(?:\((\w+)=([0-9.eE+-]+)\))?$")
_SHAPE_RE = re.compile(r"^\d+(?:x\d+)+$")


def parse_bandwidth(text: Any, arg: str = "--bandwidth") -> float:
    """Bits per second from ``"<number><unit>"`` (unit ``kbit``/``mbit``/``gbit``/``tbit``)."""
    m = _BW_RE.match(text.strip().lower()) if isinstance(text, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"{arg} must be a positive number followed by one of {tuple(_UNITS)} "
                         f"(bits per second, e.g. '1gbit', '100mbit', '2.5gbit'), got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_compressor(spec: str) -> tuple[str, Any]:
    """``"blockquant(bits=4)"`` -> ``("blockquant(bits=4)", compressor)``: a registered name, with
    at most one ``param=value``."""
    m = _SPEC_RE.match(spec.strip()) if isinstance(spec, str) else None
    if m is None or m.group(1) not in available():
        raise ValueError(f"--compressors: each must be NAME or NAME(param=value) with NAME one of "
                         f"{available()}, got {spec!r}")
    name, key, raw = m.groups()
    params: dict[str, Any] = {}
    if key is not None:
        try:
            value: Any = int(raw) if re.fullmatch(r"[+-]?\d+", raw) else float(raw)
        except ValueError:
            raise ValueError(f"--compressors: {spec!r}: {key} must be a number, got {raw!r}") from None
        params[key] = value
    try:
        comp = get(name, **params)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--compressors: {spec!r}: {e}") from None
    label = name if key is None else f"{name}({key}={params[key]:g})"
    return label, comp


def parse_shapes(spec: Any) -> list[tuple[int, ...]]:
    """``"4096x4096,50257x768"`` (or a list of shapes) -> ``[(4096, 4096), (50257, 768)]``."""
    if spec is None or spec == "":
        return []
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for it in items:
        if isinstance(it, str) and _SHAPE_RE.match(it.strip()):
            shape = tuple(int(x) for x in it.strip().split("x"))
        elif isinstance(it, (tuple, list)) and it and all(isinstance(x, int) and not isinstance(x, bool) for x in it):
            shape = tuple(it)
        else:
            raise ValueError(f"--tensors: each must be dimensions joined by 'x' (e.g. 4096x4096), got {it!r}")
        if min(shape) < 1:
            raise ValueError(f"--tensors: dimensions must be >= 1, got {it!r}")
        out.append(shape)
    return out


@dataclass(frozen=True)
class _Link:
    bits_per_s: float
    latency_s: float

    @property
    def model(self) -> CostModel:   # α-β only: the local work is in the codec
        return CostModel(self.latency_s, 8.0 / self.bits_per_s, 0.0, 0.0)

    def seconds(self, messages: float, nbytes: float) -> float:
        return self.model.time(messages, nbytes)


def _number(value: Any, arg: str, *, lo: float, lo_open: bool = False, hi: float | None = None,
            integer: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > lo if lo_open else value >= lo) and (hi is None or value <= hi)
    ok = ok and (not integer or float(value).is_integer())
    if not ok:
        rng = f"{'>' if lo_open else '>='} {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
        raise ValueError(f"{arg} must be {'an integer' if integer else 'a finite number'} {rng}, got {value!r}")
    return int(value) if integer else float(value)


# ---------------------------------------------------------------- terms
def _terms(comp: Any, n: int, P: int, shapes: list[tuple[int, ...]], side: int, total: int) -> tuple[float, float]:
    """(messages, bytes one rank sends) of ``comp``'s all-reduce of ``n`` of the model's ``total``
    elements among ``P`` ranks (kind_terms; bytes probed small and scaled, PowerSGD by shapes)."""
    if P <= 1 or n == 0:
        return 0.0, 0.0
    if comp.aggregation == "lowrank":
        listed = sum(math.prod(s) for s in shapes)
        m, b = 0.0, 0.0
        if listed:
            m, b, _, _ = kind_terms(comp, listed, P, torch.float32, None, shapes)
        rest = total - listed
        if rest > 0:
            ms, bs, _, _ = kind_terms(comp, side * side, P, torch.float32, None, [(side, side)])
            m, b = max(m, ms), b + bs * rest / (side * side)
        return m, b * n / total   # a shard holds its share of the matrices
    probe = min(n, _BYTES_PROBE)
    m, b, _, _ = kind_terms(comp, probe, P, torch.float32, (probe,), None)
    return m, b * n / probe


def _codec_passes(comp: Any, P: int) -> tuple[float, float]:
    """(compress passes, decompress passes) over the data in the kind's collective."""
    if comp.aggregation == "gather" and P > 1:
        return (1.0, float(P)) if P <= 2 else (1.0 + 1.0 / P, 2.0)
    return 1.0, 1.0


def dense_rounds(comp: Any, world: int, two_level: bool = False) -> int:
    """Rounds of its own the hooks' dense part takes per bucket with ``comp`` on ``world`` ranks:
    0 where ``comp``'s messages carry it (:func:`~commpress.collectives.carries_dense`) or where
    there is none (the casts send every tensor), else 1 (an all-reduce of its own)."""
    if world <= 1 or getattr(comp, "casts", False):
        return 0
    if comp.aggregation != "lowrank" and carries_dense(comp, world=world, hierarchy=True if two_level else None):
        return 0
    return 1


def measure_codec(comp: Any, device: str | torch.device = "cpu", numel: int = PROBE_ELEMENTS,
                  reps: int = 3, storage: str = DEFAULT_RESIDUAL_STORAGE, threads: int | None = 1
                  ) -> tuple[float, float]:
    """(compress, decompress) seconds per element of ``comp`` on ``device``: best of ``reps`` on a
    ``numel`` tensor (a square-ish matrix for PowerSGD), under error feedback when ``comp`` is
    biased (as the hooks run it, the residual kept as ``storage``), after one untimed warm-up.
    On a CPU with ``threads`` torch threads (1: a rank under ``torchrun``; ``None``: as set here)."""
    dev = torch.device(device)
    if dev.type == "cpu" and threads is not None:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return measure_codec(comp, dev, numel, reps, storage, None)
        finally:
            torch.set_num_threads(before)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(numel, generator=g).to(dev)
    if comp.aggregation == "lowrank":
        rows = 1 << (max(numel.bit_length() - 1, 0) // 2)
        x = x[: rows * (numel // rows)].view(rows, numel // rows)
    coder = comp if comp.unbiased else ErrorFeedback(comp, storage=storage)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    best_c = best_d = math.inf
    for i in range(reps + 1):
        t0 = time.perf_counter()
        p = coder.compress_fixed(x, step=_STEADY, key=("advise",))
        sync()
        t1 = time.perf_counter()
        comp.decompress(p)
        sync()
        t2 = time.perf_counter()
        if i:   # the first run warms up (JIT, allocations, residual)
            best_c, best_d = min(best_c, t1 - t0), min(best_d, t2 - t1)
    return best_c / x.numel(), best_d / x.numel()


# ---------------------------------------------------------------- the prediction
def advise(params: float, compute_ms: float, world: int, bandwidth: str | None = None,
           latency_us: float | None = None, *, profile: str | None = None, gpus_per_node: int = 1,
           intra_bandwidth: str | None = None, intra_latency_us: float = DEFAULT_INTRA_LATENCY_US,
           overlap: float = 0.0, compressors: Sequence[str] | None = None, tensors: Any = None,
           matrix_side: int = 1024, codec_ns_per_element: float | Mapping[str, float] | None = None,
           device: str | None = None, probe_elements: int = PROBE_ELEMENTS, reps: int = 3,
           round_ms: float = 0.0, ranks_per_core: float = 1.0,
           residual_storage: str = DEFAULT_RESIDUAL_STORAGE, flat_ddp: bool = False,
           dense_params: int | None = None) -> dict[str, Any]:
    """Predicted step time and bytes of plain DDP and of each compressor (see the module doc).

    ``codec_ns_per_element``: compress + decompress ns per element, one number for every
    compressor or a dict by row name (missing rows are measured); ``None``: measured on
    ``device`` (CUDA when available, else CPU).  ``round_ms``: the hook's seconds per collective
    round beyond the α-β model (ms, ``"auto"``'s per-round cost); ``ranks_per_core``: CPU ranks
    sharing a core (the codec's seconds times it); ``residual_storage``: how error feedback keeps
    its residuals in the measured codec (the hooks' ``residual_storage``); ``dense_params``: the
    elements the hooks send uncompressed (1-D tensors; ``None``: present, negligible in size; 0:
    none; see the module doc).  Bad input raises
    ``ValueError`` naming the argument.  Returns ``{"rows": [...], "bound": ..., "comm_fraction":
    ..., "codec": ..., "best": ..., "inputs": {...}}``; each row has ``compressor``, ``step_ms``,
    ``bytes`` (one rank sends per step), ``comm_ms``, ``codec_ms``, ``round_ms`` (the per-round
    cost it pays), ``speedup``, ``pays``, ``price``, ``to_target``; ``flat_ddp`` with ``1 <
    gpus_per_node < world``: a row ``"ddp(flat ring)"`` follows ``"ddp"`` (see the module doc).
    """
    N = _number(params, "--params", lo=1, integer=True)
    C = _number(compute_ms, "--compute-ms", lo=0, lo_open=True) / 1e3
    P = _number(world, "--world", lo=1, integer=True)
    G = _number(gpus_per_node, "--gpus-per-node", lo=1, integer=True)
    if P % G:
        raise ValueError(f"--gpus-per-node must divide --world={P}, got {G}")
    f = _number(overlap, "--overlap", lo=0, hi=1)
    side = _number(matrix_side, "--matrix-side", lo=1, integer=True)
    probe = _number(probe_elements, "probe_elements", lo=16, integer=True)
    reps = _number(reps, "reps", lo=1, integer=True)
    round_s = _number(round_ms, "--round-ms", lo=0) / 1e3
    R = _number(ranks_per_core, "--ranks-per-core", lo=1)
    storage = check_storage(residual_storage, "--residual-storage")
    D = 0 if dense_params is None else _number(dense_params, "--dense-params", lo=0, integer=True)
    if D >= N:
        raise ValueError(f"--dense-params must be below --params={N}, got {D}")
    if not isinstance(flat_ddp, bool):
        raise ValueError(f"--flat-ddp must be a bool, got {flat_ddp!r}")
    if profile is not None and profile not in PROFILES:
        raise ValueError(f"--profile must be one of {sorted(PROFILES)}, got {profile!r}")
    prof = PROFILES.get(profile, {})
    if bandwidth is None and not prof:
        raise ValueError(f"--bandwidth or --profile (one of {sorted(PROFILES)}) is required")
    bw_text = bandwidth if bandwidth is not None else prof["bandwidth"]
    lat = latency_us if latency_us is not None else prof.get("latency_us", DEFAULT_LATENCY_US)
    inter = _Link(parse_bandwidth(bw_text), _number(lat, "--latency-us", lo=0) / 1e6)
    shapes = parse_shapes(tensors)
    if sum(math.prod(s) for s in shapes) > N:
        raise ValueError(f"--tensors: the listed tensors hold more than --params={N} elements")
    nodes = P // G
    intra = None
    if intra_bandwidth is not None:
        intra = _Link(parse_bandwidth(intra_bandwidth, "--intra-bandwidth"),
                      _number(intra_latency_us, "--intra-latency-us", lo=0) / 1e6)
    elif G > 1 and nodes > 1:
        raise ValueError("--intra-bandwidth is required with --gpus-per-node > 1 (e.g. '400gbit')")
    two_level = G > 1 and nodes > 1
    flat_link = intra if (nodes == 1 and intra is not None) else inter
    specs = list(DEFAULT_COMPRESSORS if compressors is None else compressors)
    if not specs and compressors is not None:
        raise ValueError("--compressors must name at least one compressor")
    parsed = [parse_compressor(s) for s in specs]
    if isinstance(codec_ns_per_element, Mapping):
        given = {str(k): _number(v, f"--codec-ns-per-element[{k}]", lo=0) for k, v in codec_ns_per_element.items()}
    elif codec_ns_per_element is not None:
        x = _number(codec_ns_per_element, "--codec-ns-per-element", lo=0)
        given = {label: x for label, _ in parsed}
    else:
        given = {}
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if any(label not in given for label, _ in parsed):
        try:
            torch.empty(1, device=dev)
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"--device must be a torch device available here, got {dev!r} ({e})") from None

    def collective(comp: Any | None, n: int = N) -> tuple[float, float, float]:
        """(comm seconds, bytes sent, bytes sent across nodes) of ``n`` elements; ``comp=None``:
        plain DDP."""
        if not two_level:
            if comp is None:
                b, _, m = all_reduce_cost(4 * n, P)
            else:
                m, b = _terms(comp, n, P, shapes, side, N)
            return flat_link.seconds(m, b), b, (b if nodes > 1 else 0.0)
        s = -(-n // G)
        rs_b, _, rs_m = reduce_scatter_cost(4 * s, G)
        ag_b, _, ag_m = all_gather_cost(4 * s, G)
        if comp is None:
            ib, _, im = all_reduce_cost(4 * s, nodes)
        else:
            im, ib = _terms(comp, s, nodes, shapes, side, N)
        t = intra.seconds(rs_m, rs_b) + inter.seconds(im, ib) + intra.seconds(ag_m, ag_b)
        return t, rs_b + ib + ag_b, ib

    from .auto.candidates import Candidate
    from .auto.decide import Prices
    prices = Prices()

    def price(comp: Any) -> float | None:
        cfg = comp.config()
        try:
            if comp.name in ("fp16", "bf16"):
                return prices.price(Candidate("bf16"))
            if comp.name == "identity":
                return 1.0
            if comp.name == "blockquant":
                return prices.price(Candidate("blockquant", int(cfg.get("bits", 0))))
            if comp.name == "topk":
                return prices.price(Candidate("topk", float(cfg.get("ratio", 0))))
            if comp.name == "powersgd":
                return prices.price(Candidate("powersgd", int(cfg.get("rank", 0))))
        except (ValueError, KeyError):
            return None
        return None

    def _with_dense(comp: Any, comm: float, nbytes: float, ibytes: float) -> tuple[float, float, float, int]:
        """The dense part's ``4D`` bytes added to ``comp``'s collective: in its messages, or in an
        all-reduce of its own over all ``P`` ranks (ring; on the flat group's link, the inter-node
        one where there are nodes), one round more (returned).  None without 1-D tensors or
        for a cast (it sends every tensor)."""
        if dense_params == 0 or getattr(comp, "casts", False):
            return comm, nbytes, ibytes, 0
        extra = dense_rounds(comp, P, two_level)
        db, _, dm = all_reduce_cost(4 * D, P)
        comm += flat_link.seconds(dm if extra else 0, db)
        return comm, nbytes + db, ibytes + (db if nodes > 1 else 0.0), extra

    def step(comm: float, codec: float) -> float:
        return C + max(0.0, comm - f * C) + codec

    comm0, bytes0, inter0 = collective(None)
    ddp_step = step(comm0, 0.0)
    c = (ddp_step - C) / ddp_step
    rows = [{"compressor": "ddp", "step_ms": 1e3 * ddp_step, "bytes": bytes0, "inter_node_bytes": inter0,
             "comm_ms": 1e3 * comm0, "codec_ms": 0.0, "round_ms": 0.0, "speedup": 1.0, "pays": False,
             "price": 1.0, "to_target": 1.0}]
    if two_level and flat_ddp:   # PyTorch DDP's one ring over all P ranks, every step across the inter-node link
        fb, _, fm = all_reduce_cost(4 * N, P)
        ft = inter.seconds(fm, fb)
        fstep = step(ft, 0.0)
        rows.append({"compressor": FLAT_DDP, "step_ms": 1e3 * fstep, "bytes": fb, "inter_node_bytes": fb,
                     "comm_ms": 1e3 * ft, "codec_ms": 0.0, "round_ms": 0.0, "speedup": ddp_step / fstep,
                     "pays": ddp_step / fstep > 1.0, "price": 1.0, "to_target": ddp_step / fstep})
    from .auto.decide import kind_rounds
    measured = []
    for label, comp in parsed:
        if label in given:
            t_c = t_d = given[label] * 1e-9 / 2
        else:
            t_c, t_d = measure_codec(comp, dev, max(16, min(probe, N)), reps, storage)
            measured.append(label)
        pc, pd = _codec_passes(comp, nodes if two_level else P)
        n = N if getattr(comp, "casts", False) else N - D   # the elements it compresses
        codec = R * (pc * t_c + pd * t_d) * n / (G if two_level else 1)
        # auto's call_s: round_s per round of the kind (two-level: two intra-node rounds more)
        rounds = (kind_rounds(comp.aggregation, nodes if two_level else P) + (2 if two_level else 0)) if P > 1 else 0
        comm, nbytes, ibytes, extra = _with_dense(comp, *collective(comp, n))
        rounds += extra
        t = step(comm, codec + rounds * round_s)
        pr = price(comp)
        speed = ddp_step / t
        rows.append({"compressor": label, "step_ms": 1e3 * t, "bytes": nbytes, "inter_node_bytes": ibytes,
                     "comm_ms": 1e3 * comm, "codec_ms": 1e3 * codec, "round_ms": 1e3 * rounds * round_s,
                     "speedup": speed, "pays": speed > 1.0,
                     "price": pr, "to_target": None if pr is None else speed / pr,
                     "codec_ns_per_element": 1e9 * (t_c + t_d)})
    if measured:
        on = f"{dev}, one thread" if torch.device(dev).type == "cpu" else dev
        where = (f"measured on {on} ({max(16, min(probe, N))} elements, best of {reps}, scaled to {N}; "
                 f"residuals {storage})")
        codec_src = where if len(measured) == len(parsed) else f"{where} for {measured}; given for the rest"
    else:
        codec_src = "given (--codec-ns-per-element)"
    comp_rows = [r for r in rows if r["compressor"] not in ("ddp", FLAT_DDP)]
    best = max(comp_rows, key=lambda r: r["speedup"]) if comp_rows else None
    priced = [r for r in comp_rows if r["to_target"] is not None]
    best_t = max(priced, key=lambda r: r["to_target"]) if priced else None
    return {
        "rows": rows,
        "bound": 1.0 / (1.0 - c),
        "comm_fraction": c,
        "codec": codec_src,
        "best": None if best is None or best["speedup"] <= 1 else best["compressor"],
        "best_to_target": None if best_t is None or best_t["to_target"] <= 1 else best_t["compressor"],
        "inputs": {"params": N, "compute_ms": 1e3 * C, "world": P, "gpus_per_node": G,
                   "bandwidth_bits_per_s": inter.bits_per_s, "latency_us": 1e6 * inter.latency_s,
                   "intra_bandwidth_bits_per_s": None if intra is None else intra.bits_per_s,
                   "intra_latency_us": None if intra is None else 1e6 * intra.latency_s,
                   "path": "two_level" if two_level else ("flat, intra-node" if flat_link is intra else "flat"),
                   "overlap": f, "profile": profile, "tensors": ["x".join(map(str, s)) for s in shapes],
                   "matrix_side": side, "round_ms": 1e3 * round_s, "ranks_per_core": R,
                   "residual_storage": storage, "dense_params": dense_params},
    }


def _mb(b: float) -> str:
    return f"{b / 1e9:.3g} GB" if b >= 1e9 else f"{b / 1e6:.3g} MB"


def format_table(result: Mapping[str, Any]) -> str:
    """The human-readable report of :func:`advise`'s result."""
    inp = result["inputs"]
    two = inp["path"] == "two_level"
    col, key = ("inter-node", "inter_node_bytes") if two else ("bytes/rank", "bytes")
    lines = [
        f"{inp['params']:.4g} parameters, {inp['compute_ms']:g} ms compute, {inp['world']} ranks "
        f"({inp['gpus_per_node']} per node, path {inp['path']}), link {inp['bandwidth_bits_per_s'] / 1e9:g} Gbit/s "
        f"+ {inp['latency_us']:g} us/message, overlap {inp['overlap']:g}, {inp['round_ms']:g} ms per hook round, "
        f"{inp['ranks_per_core']:g} rank(s) per core",
        f"codec: {result['codec']}",
        f"plain DDP: communication is {100 * result['comm_fraction']:.1f}% of the step; no compressor can "
        f"beat {result['bound']:.2f}x (1 / (1 - c))",
        "",
        f"{'compressor':<22}{'step ms':>10}{'comm ms':>10}{'codec ms':>10}{'round ms':>10}{'bytes/rank':>13}"
        f"{'speedup':>9}{'price':>7}{'to target':>11}",
    ]
    for r in result["rows"]:
        pr = "-" if r["price"] is None else f"{r['price']:.2f}"
        tt = "-" if r["to_target"] is None else f"{r['to_target']:.2f}x"
        lines.append(f"{r['compressor']:<22}{r['step_ms']:>10.1f}{r['comm_ms']:>10.1f}{r['codec_ms']:>10.1f}"
                     f"{r.get('round_ms', 0.0):>10.1f}"
                     f"{_mb(r[key]):>13}{r['speedup']:>8.2f}x{pr:>7}{tt:>11}")
    lines.append("")
    if result["best"] is None:
        lines.append("verdict: no compressor pays here; stay with plain DDP.")
    else:
        best = next(r for r in result["rows"] if r["compressor"] == result["best"])
        lines.append(f"verdict: {best['compressor']} pays most per step, {best['speedup']:.2f}x "
                     f"(of at most {result['bound']:.2f}x).")
        if result["best_to_target"] is not None:
            bt = next(r for r in result["rows"] if r["compressor"] == result["best_to_target"])
            lines.append(f"counting the prior convergence price: {bt['compressor']}, {bt['to_target']:.2f}x "
                         f"to the same quality.")
        else:
            lines.append("counting the prior convergence price, none pays: stay with plain DDP.")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m commpress.advise",
        description="Predict whether gradient compression pays on a cluster (see commpress/advise.py).",
        epilog="Bandwidths: <number><unit>, unit kbit|mbit|gbit|tbit (bits/s), e.g. 1gbit, 400gbit. "
               "Profiles: " + ", ".join(f"{k} ({v['bandwidth']}, {v['latency_us']:g} us)" for k, v in PROFILES.items()))
    p.add_argument("--params", required=True, help="parameters of the model (e.g. 25e6)")
    p.add_argument("--compute-ms", required=True, help="compute time of one step without communication, ms")
    p.add_argument("--world", required=True, help="number of ranks (GPUs)")
    p.add_argument("--bandwidth", help="link between nodes (all ranks when one per node), e.g. 1gbit")
    p.add_argument("--latency-us", help=f"per-message latency of that link (default: the profile's, else {DEFAULT_LATENCY_US:g})")
    p.add_argument("--profile", help=f"a named link: {', '.join(PROFILES)}; --bandwidth/--latency-us override it")
    p.add_argument("--gpus-per-node", default="1", help="ranks per node (default 1)")
    p.add_argument("--intra-bandwidth", help="link inside a node, e.g. 400gbit (needed with --gpus-per-node > 1)")
    p.add_argument("--intra-latency-us", default=str(DEFAULT_INTRA_LATENCY_US), help="per-message latency inside a node")
    p.add_argument("--overlap", default="0", help="fraction of compute that hides communication, in [0, 1] (default 0)")
    p.add_argument("--compressors", nargs="+", help=f"rows to predict (default: {' '.join(DEFAULT_COMPRESSORS)})")
    p.add_argument("--tensors", help="shapes of the largest tensors, e.g. 4096x4096,50257x768 (PowerSGD)")
    p.add_argument("--matrix-side", default="1024", help="side of the square matrices assumed for the rest (PowerSGD)")
    p.add_argument("--codec-ns-per-element", help="compress + decompress ns per element (instead of measuring here)")
    p.add_argument("--device", help="where to measure the codec (default: cuda if available, else cpu)")
    p.add_argument("--residual-storage", default=DEFAULT_RESIDUAL_STORAGE,
                   help=f"error feedback's residual storage in the measured codec (default {DEFAULT_RESIDUAL_STORAGE}, "
                        "the hooks' default; fp32, bf16, int8, int4)")
    p.add_argument("--round-ms", default="0", help="the hook's cost per collective round beyond the alpha-beta model, "
                   "ms (what 'auto' reports as round_ms; default 0)")
    p.add_argument("--ranks-per-core", default="1", help="CPU ranks sharing one core (oversubscribed): the codec "
                   "costs this many times its time on a core of its own (default 1)")
    p.add_argument("--flat-ddp", action="store_true", help="with --gpus-per-node: also price PyTorch DDP's one "
                   "flat ring over all ranks (row 'ddp(flat ring)'; gloo, or one link per node)")
    p.add_argument("--dense-params", help="elements the hooks send uncompressed (1-D tensors: biases, norms); "
                   "default: present, negligible in size (their collective round counted); 0: none")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def _num(text: str | None, arg: str, integer: bool = False) -> float | int | None:
    if text is None:
        return None
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{arg} must be a number, got {text!r}") from None
    return int(v) if integer and v.is_integer() else v


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    a = parser.parse_args(argv)
    try:
        result = advise(
            _num(a.params, "--params", True), _num(a.compute_ms, "--compute-ms"), _num(a.world, "--world", True),
            a.bandwidth, _num(a.latency_us, "--latency-us"), profile=a.profile,
            gpus_per_node=_num(a.gpus_per_node, "--gpus-per-node", True), intra_bandwidth=a.intra_bandwidth,
            intra_latency_us=_num(a.intra_latency_us, "--intra-latency-us"), overlap=_num(a.overlap, "--overlap"),
            compressors=a.compressors, tensors=a.tensors, matrix_side=_num(a.matrix_side, "--matrix-side", True),
            codec_ns_per_element=_num(a.codec_ns_per_element, "--codec-ns-per-element"), device=a.device,
            round_ms=_num(a.round_ms, "--round-ms"), ranks_per_core=_num(a.ranks_per_core, "--ranks-per-core"),
            residual_storage=a.residual_storage, flat_ddp=a.flat_ddp,
            dense_params=_num(a.dense_params, "--dense-params", True))
    except ValueError as e:
        parser.error(str(e))   # SystemExit(2) with the message on stderr
    print(json.dumps(result, indent=1) if a.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
