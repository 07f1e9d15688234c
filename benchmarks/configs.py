"""The configurations the training sweep compares, and how each is attached to a DDP model.

A configuration is one of

* ``ddp`` — DDP's own dense all_reduce (no hook);
* ``torch-fp16`` / ``torch-bf16`` — PyTorch's ``fp16_compress_hook`` / ``bf16_compress_hook``
  (the 16-bit all-reduce, the honest baseline for any compressor); the bf16 hook
  needs NCCL, so on gloo it is reported as unavailable and commpress's ``bf16``
  stands in;
* ``torch-powersgd-rN`` — PyTorch's ``powerSGD_hook`` at rank N.  That hook waits
  on new collectives inside future callbacks and deadlocks on gloo when DDP has
  several buckets, so these configurations run with ONE bucket
  (``bucket_cap_mb=10000``); every other configuration keeps DDP's default buckets;
* ``auto`` — ``commpress.ddp.register(model, "auto", check_every=20, every=100)``: a compressor per bucket
  (:mod:`commpress.auto`); the rows carry each bucket's choice (``auto``);
* ``sparse-rows`` / ``sparse-rows+<compressor>-<setting>`` — ``commpress.ddp.register(model,
  "identity" or compressor, sparse_rows="auto", **params)`` (issue 52): the gradients found
  row-sparse (the embedding tables of the ``rec`` task) are summed exactly as (row indices, rows),
  the rest goes dense (identity: losses equal DDP's up to summation order) or through the
  compressor; skipped, saying so, while ``register`` has no ``sparse_rows=``;
* ``<compressor>-<setting>`` — ``commpress.ddp.register(model, compressor, **params)``; the
  sparsifiers (topk, dgc, randomk) also pass ``optimizer=`` (the hook takes over the
  optimizer's SGD momentum: DGC's momentum correction; nothing changes for AdamW) and keep
  their default density warm-up; the ``convergence`` group adds variants of topk 1% (``STUDY``).

Bytes are counted per rank per step with commpress's convention
(:mod:`commpress.collectives.accounting`): an ``all_reduce`` of ``n`` bytes
sends ``2·n·(P−1)/P``.  For the PyTorch hooks they are computed from the hook's
known payload (fp16: 2 bytes per element; PowerSGD: the P and Q factors plus the
tensors it leaves uncompressed, three all_reduces), for commpress from the
hook's ``state.stats``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

ONE_BUCKET_MB = 10_000


@dataclass(frozen=True)
class Config:
    """One sweep configuration."""

    name: str
    kind: str                      # "ddp" | "torch_fp16" | "torch_bf16" | "torch_powersgd" | "commpress"
    compressor: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    takeover: bool = False         # commpress: register(..., optimizer=opt)

    @property
    def bucket_cap_mb(self) -> float | None:
        return ONE_BUCKET_MB if self.kind == "torch_powersgd" else None

    def describe(self) -> str:
        if self.kind == "commpress":
            args = ", ".join([f"{k}={v}" for k, v in self.params.items()]
                             + (["optimizer=opt"] if self.takeover else []))
            return f"commpress {self.compressor}({args})"
        if self.kind == "torch_powersgd":
            return f"torch powerSGD_hook rank {self.params['rank']} (one DDP bucket)"
        return {"ddp": "DDP dense all_reduce", "torch_fp16": "torch fp16_compress_hook",
                "torch_bf16": "torch bf16_compress_hook"}[self.kind]


#: Compressors whose configs take over the optimizer's momentum (``optimizer=``) by default.
TAKEOVER = ("topk", "dgc", "randomk")


def _cp(name: str, compressor: str, **params: Any) -> Config:
    return Config(name, "commpress", compressor, params, takeover=compressor in TAKEOVER)


ALL: list[Config] = [
    Config("ddp", "ddp"),
    Config("torch-fp16", "torch_fp16"),
    Config("torch-bf16", "torch_bf16"),
    Config("torch-powersgd-r1", "torch_powersgd", params={"rank": 1}),
    Config("torch-powersgd-r2", "torch_powersgd", params={"rank": 2}),
    Config("torch-powersgd-r4", "torch_powersgd", params={"rank": 4}),
    _cp("identity", "identity"),
    _cp("fp16", "fp16"),
    _cp("bf16", "bf16"),
    _cp("topk-10%", "topk", ratio=0.1),
    _cp("topk-1%", "topk", ratio=0.01),
    _cp("topk-0.1%", "topk", ratio=0.001),
    _cp("dgc-10%", "dgc", ratio=0.1),
    _cp("dgc-1%", "dgc", ratio=0.01),
    _cp("dgc-0.1%", "dgc", ratio=0.001),
    _cp("randomk-1%", "randomk", ratio=0.01),
    _cp("blockquant-8bit", "blockquant", bits=8),
    _cp("blockquant-4bit", "blockquant", bits=4),
    _cp("blockquant-2bit", "blockquant", bits=2),
    _cp("signsgd", "signsgd"),
    _cp("qsgd", "qsgd"),
    _cp("fp8-e4m3", "fp8", format="e4m3"),
    _cp("fp8-e5m2", "fp8", format="e5m2"),
    _cp("mx-fp8", "mx", element="fp8_e4m3"),
    _cp("mx-fp6", "mx", element="fp6_e2m3"),
    _cp("mx-fp4", "mx", element="fp4_e2m1"),
    _cp("powersgd-r2", "powersgd", rank=2),
    _cp("powersgd-r4", "powersgd", rank=4),
    # a compressor per bucket, chosen from the measured overlap and codec cost and the network
    # calibrated at binding (commpress.auto); check points every 20 steps, so that a run of the
    # demo's length sees more than the first decision.  The optimizer keeps its momentum (as for
    # bf16 and blockquant): an all-dense plan then runs DDP's own all_reduce between check points
    Config("auto", "commpress", "auto", {"check_every": 20, "every": 100}),
]
#: Variants of topk 1% for the convergence study (momentum correction, masking, density warm-up): by name or the "convergence" group,
#: not in "all".  nomc: the optimizer keeps its momentum (no optimizer=); nowarmup: no density
#: warm-up; mask: DGC's momentum factor masking.  And blockquant 4-bit with momentum correction (mc:
#: optimizer=), the two without joined buckets (nojoin: ``join_buckets=False``) and blockquant with
#: every bucket held (joinall: ``join_buckets=inf``), and blockquant and ``"auto"`` run in the hook
#: call (inline: ``overlap=False``, no worker thread), and ``"auto"`` told the optimizer (opt), by name only.
STUDY: list[Config] = [
    Config("topk-1%-nomc", "commpress", "topk", {"ratio": 0.01}),
    Config("topk-1%-nowarmup", "commpress", "topk", {"ratio": 0.01, "density_warmup": 0}, takeover=True),
    Config("topk-1%-mask", "commpress", "topk", {"ratio": 0.01, "momentum_masking": True}, takeover=True),
    Config("blockquant-4bit-mc", "commpress", "blockquant", {"bits": 4}, takeover=True),
    # a round per bucket (join_buckets=False), against the default that joins a CPU rank's rounds
    Config("blockquant-4bit-nojoin", "commpress", "blockquant", {"bits": 4, "join_buckets": False}),
    Config("topk-1%-nojoin", "commpress", "topk", {"ratio": 0.01, "join_buckets": False}, takeover=True),
    # every bucket held whatever its wire (join_buckets=inf: one round a step), against the 1.5 ms limit
    Config("blockquant-4bit-joinall", "commpress", "blockquant", {"bits": 4, "join_buckets": float("inf")}),
    # each bucket run in DDP's hook call on the backward's thread (overlap=False), against the worker thread
    Config("blockquant-4bit-inline", "commpress", "blockquant", {"bits": 4, "overlap": False}),
    Config("auto-inline", "commpress", "auto", {"check_every": 20, "every": 100, "overlap": False}),
    # "auto" told the optimizer (optimizer=): SGD's momentum taken over; an adaptive one (the LM's
    # AdamW) leaves the sparsifiers out of the candidates
    Config("auto-opt", "commpress", "auto", {"check_every": 20, "every": 100}, takeover=True),
    # "auto" as a user registers it (its default check points) with optimizer=, and powersgd rank 1
    # fixed with and without momentum correction (issue 55.8: what "auto" chose at 100 Mbit/s)
    Config("auto-opt-defaults", "commpress", "auto", {}, takeover=True),
    Config("powersgd-r1", "commpress", "powersgd", {"rank": 1}),
    Config("powersgd-r1-mc", "commpress", "powersgd", {"rank": 1}, takeover=True),
    # lean error feedback (issue 50): residuals in 8 bits (stochastic rounding; the hooks' default),
    # committed per unit (rollback="unit": no pending copy between steps), and in fp32 (exact: the
    # default until the runs of docs/results/memory.md)
    Config("blockquant-4bit-int8res", "commpress", "blockquant",
           {"bits": 4, "residual_storage": "int8", "rollback": "unit"}),
    Config("topk-1%-int8res", "commpress", "topk", {"ratio": 0.01, "residual_storage": "int8", "rollback": "unit"},
           takeover=True),
    Config("auto-int8res", "commpress", "auto",
           {"check_every": 20, "every": 100, "residual_storage": "int8", "rollback": "unit"}),
    # residuals in 4 bits (0.56 B a residual: live + pending 1.13 B/param with the NaN rule kept)
    Config("blockquant-4bit-int4res", "commpress", "blockquant", {"bits": 4, "residual_storage": "int4"}),
    Config("topk-1%-int4res", "commpress", "topk", {"ratio": 0.01, "residual_storage": "int4"}, takeover=True),
    Config("auto-int4res", "commpress", "auto", {"check_every": 20, "every": 100, "residual_storage": "int4"}),
    Config("blockquant-4bit-fp32res", "commpress", "blockquant", {"bits": 4, "residual_storage": "fp32"}),
    Config("topk-1%-fp32res", "commpress", "topk", {"ratio": 0.01, "residual_storage": "fp32"}, takeover=True),
    Config("auto-fp32res", "commpress", "auto", {"check_every": 20, "every": 100, "residual_storage": "fp32"}),
    # no residual at all: unbiased stochastic rounding instead of error feedback (ZeRO++ qgZ's choice)
    Config("blockquant-4bit-sr", "commpress", "blockquant", {"bits": 4, "stochastic": True}),
]
#: Issue 52's lossless row-sparse path (the ``rec`` task's embedding tables), alone and beside a lossy
#: compressor on the rest of the model: by name or the "sparse" group, not in "all" (on a model
#: without row-sparse gradients they are identity / the compressor, with a check each step).
SPARSE: list[Config] = [
    Config("sparse-rows", "commpress", "identity", {"sparse_rows": "auto"}),
    Config("sparse-rows+blockquant-4bit", "commpress", "blockquant", {"bits": 4, "sparse_rows": "auto"}),
]
BY_NAME = {c.name: c for c in ALL + STUDY + SPARSE}
QUICK = ["ddp", "torch-fp16", "torch-bf16", "bf16", "torch-powersgd-r1", "torch-powersgd-r4", "topk-1%",
         "blockquant-4bit", "powersgd-r4"]
GROUPS = {
    "all": [c.name for c in ALL],
    "quick": QUICK,
    "torch": [c.name for c in ALL if c.kind != "commpress"],
    "commpress": [c.name for c in ALL if c.kind == "commpress"],
    "convergence": ["ddp", "topk-1%"] + [c.name for c in STUDY if c.compressor == "topk"],
    "sparse": ["ddp", "torch-fp16", "blockquant-4bit", "topk-1%", "auto"] + [c.name for c in SPARSE],
    "memory": ["ddp", "blockquant-4bit", "blockquant-4bit-fp32res", "blockquant-4bit-int8res", "blockquant-4bit-sr",
               "topk-1%", "topk-1%-fp32res", "topk-1%-int8res", "auto", "auto-fp32res", "auto-int8res"],
    "int4": ["ddp", "blockquant-4bit-int4res", "topk-1%-int4res", "auto-int4res"],
}


def resolve(spec: str | None, quick: bool) -> list[Config]:
    """Config names / groups (comma-separated) to configs, in order, without duplicates."""
    names: list[str] = []
    for item in (spec or ("quick" if quick else "all")).split(","):
        item = item.strip()
        if not item:
            continue
        group = GROUPS.get(item)
        if group is None and item not in BY_NAME:
            raise ValueError(f"unknown config {item!r}; choose from groups {sorted(GROUPS)} "
                             f"or configs {[c.name for c in ALL + STUDY + SPARSE]}")
        for n in group or [item]:
            if n not in names:
                names.append(n)
    return [BY_NAME[n] for n in names]


def ddp_module():
    """commpress's DDP hook module, or ``None`` while it does not exist yet."""
    for name in ("commpress.ddp", "commpress.hooks.ddp"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "register"):
            return mod
    return None


def unavailable_reason(cfg: Config) -> str | None:
    """Why ``cfg`` cannot run in this checkout (``None`` when it can)."""
    if cfg.kind == "torch_bf16":
        # The sweep runs gloo on CPU; DDP refuses this hook there at registration with
        # "TypeError: BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+".
        return (f"PyTorch's bf16_compress_hook raises TypeError on gloo/CPU (torch {torch.__version__}: "
                "it requires CUDA 11+ and NCCL 2.10+); commpress bf16 is the bf16 baseline here")
    if cfg.kind != "commpress":
        return None
    import commpress

    if ddp_module() is None:
        return "commpress.ddp.register is not available in this checkout"
    if cfg.compressor not in commpress.available() and cfg.compressor != "auto":
        return f"compressor {cfg.compressor!r} is not registered"
    if "sparse_rows" in cfg.params and not has_sparse_rows():
        return ("commpress.ddp.register has no sparse_rows= in this checkout (the lossless row-sparse path "
                "is not wired into the DDP hook yet)")
    return None


def has_sparse_rows() -> bool:
    """Whether commpress's ``register`` takes ``sparse_rows=`` (issue 52)."""
    import inspect

    mod = ddp_module()
    if mod is None:
        return False
    try:
        return "sparse_rows" in inspect.signature(mod.register).parameters
    except (TypeError, ValueError):
        return False


def row_sparse(grad: torch.Tensor, max_density: float = 0.5) -> bool:
    """A 2-D gradient with at most ``max_density`` of its rows nonzero (what ``sparse_rows="auto"``
    would send as rows; used to leave such gradients out of the codec's measure)."""
    if grad.dim() != 2 or grad.shape[0] < 2:
        return False
    return float((grad != 0).any(1).float().mean()) <= max_density


# ---------------------------------------------------------------------------
# attaching to a DDP model (runs inside a rank)
# ---------------------------------------------------------------------------

def attach(ddp: nn.parallel.DistributedDataParallel, cfg: Config, seed: int,
           optimizer: torch.optim.Optimizer | None = None) -> Any:
    """Register ``cfg``'s communication hook on ``ddp``; returns the hook state (or None).
    ``optimizer`` is handed to commpress configs with ``takeover``."""
    if cfg.kind == "ddp":
        return None
    if cfg.kind == "torch_fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if cfg.kind == "torch_bf16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return None
    if cfg.kind == "torch_powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=cfg.params["rank"],
                                   start_powerSGD_iter=2, use_error_feedback=True, warm_start=True,
                                   random_seed=seed)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
        return state
    if cfg.kind == "commpress":
        mod = ddp_module()
        if mod is None:
            raise RuntimeError("commpress.ddp.register is not available")
        extra = {"optimizer": optimizer} if cfg.takeover and optimizer is not None else {}
        return mod.register(ddp, cfg.compressor, **cfg.params, **extra)
    raise ValueError(f"unknown config kind {cfg.kind!r}")


def ring_all_reduce_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in a ring all_reduce of ``nbytes`` (commpress's accounting convention)."""
    return 0 if world <= 1 else (2 * int(nbytes) * (world - 1)) // world


def torch_powersgd_payload(params: list[torch.Tensor], rank: int, min_compression_rate: float = 2.0
                           ) -> tuple[int, int, int]:
    """Elements PyTorch's powerSGD_hook sends: ``(uncompressed, sum P, sum Q)``.

    Mirrors the hook: each gradient is viewed as ``shape[0] x rest``; it is
    compressed when ``(n + m)·r·min_compression_rate < n·m`` with
    ``r = min(n, m, rank)``, else all-reduced as it is (1-D tensors included).
    """
    unc = ps = qs = 0
    for p in params:
        n = p.shape[0] if p.dim() > 0 else 1
        m = p.numel() // max(n, 1)
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            ps += n * r
            qs += m * r
        else:
            unc += p.numel()
    return unc, ps, qs


def hook_bytes(cfg: Config, params: list[torch.Tensor], world: int) -> dict[str, int]:
    """Per-rank, per-step ``payload_bytes`` / ``bytes_sent`` / ``dense_bytes`` of the non-commpress configs."""
    numel = sum(p.numel() for p in params)
    dense = ring_all_reduce_bytes(4 * numel, world)
    if cfg.kind == "ddp":
        return {"payload_bytes": 4 * numel, "bytes_sent": dense, "dense_bytes": dense}
    if cfg.kind in ("torch_fp16", "torch_bf16"):
        return {"payload_bytes": 2 * numel, "bytes_sent": ring_all_reduce_bytes(2 * numel, world),
                "dense_bytes": dense}
    if cfg.kind == "torch_powersgd":
        unc, ps, qs = torch_powersgd_payload(params, cfg.params["rank"])
        sent = sum(ring_all_reduce_bytes(4 * n, world) for n in (unc, ps, qs) if n)
        return {"payload_bytes": 4 * (unc + ps + qs), "bytes_sent": sent, "dense_bytes": dense}
    raise ValueError(f"hook_bytes is for torch configs, not {cfg.kind!r}")
