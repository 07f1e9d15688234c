"""What one rank does in the training sweep: build a task, attach a configuration, train, measure.

Runs inside rank processes started by :func:`benchmarks.netem.launch`
(``rank_main``).  Every configuration starts from the same seed: same initial
weights, same per-rank batches.  Timing: ``train_time`` is the sum of the
training-step wall times on rank 0 (evaluation is excluded); ``compute`` is the
median time of a forward+backward without synchronisation (``ddp.no_sync()``)
plus the measured optimizer step; ``compression`` is the compress+decompress
time of the configuration's codec on this model's gradient buckets measured in
the same process; communication is what remains of the step.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import configs as C
from .data import Clicks, digits, lm_batch, stdlib_text
from .models import CharLM, DigitsMLP, RecModel, n_params

LM_SIZES = {
    "full": dict(d_model=256, n_layers=4, n_heads=4, context=64),
    "quick": dict(d_model=64, n_layers=2, n_heads=2, context=32),
}


@dataclass
class Task:
    """A model, its optimizer, batches and evaluation."""

    name: str
    metric: str            # "accuracy" (higher is better) or "val_loss" (lower is better)
    model: nn.Module
    make_opt: Callable[[Any], torch.optim.Optimizer]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[nn.Module, int, int], float]
    info: dict[str, Any]


def _ce(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _bce(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(model(x), y)


#: The ``rec`` task's sizes (the same in 'full' and 'quick', like digits): 3.84M embedding parameters
#: (15.4 MB of fp32 gradient a step, about 123 ms of a 1 Gbit/s link for DDP's all_reduce at P = 2)
#: against about 21k in the MLP; 256 pairs per rank touch about 200 user rows and 100 item rows.
REC_SIZE = dict(n_users=100_000, n_items=20_000, dim=32, hidden=128)
REC_BATCH = 256
#: SGD with momentum 0.9; the tables' rows, each seen by a few pairs of the batch mean, need a large lr
REC_LR = {"embeddings": 50.0, "mlp": 0.2}


def rows_touched(data: Clicks, batch: int, seed: int, n: int = 32) -> dict[str, float]:
    """Mean distinct user and item ids in one rank's batch (the embedding rows its gradient has)."""
    gen = torch.Generator().manual_seed(seed)
    xs = [data.sample(batch, gen)[0] for _ in range(n)]
    return {"users": statistics.fmean(len(torch.unique(x[:, 0])) for x in xs),
            "items": statistics.fmean(len(torch.unique(x[:, 1])) for x in xs)}


def make_task(name: str, size: str, seed: int) -> Task:
    """``digits`` (MLP, SGD+momentum), ``lm`` (char transformer, AdamW) or ``rec`` (a click model
    with large embedding tables, SGD+momentum); ``size`` is 'full'/'quick'."""
    torch.manual_seed(seed)
    if name == "digits":
        xtr, ytr, xte, yte = digits(seed)
        # 1.1M parameters in both sizes: on a 1 Gbit/s link the gradient exchange is most of a
        # dense step (about 4.5 MB per step against a few ms of compute on one core)
        model = DigitsMLP(hidden=1024)
        bs = 32

        def batch(gen):
            idx = torch.randint(0, len(xtr), (bs,), generator=gen)
            return xtr[idx], ytr[idx]

        @torch.no_grad()
        def evaluate(m, rank, world):
            shard = slice(rank, None, world)
            correct = (m(xte[shard]).argmax(1) == yte[shard]).sum().float()
            tot = torch.stack([correct, torch.tensor(float(len(yte[shard])))])
            dist.all_reduce(tot)
            return float(tot[0] / tot[1])

        return Task("digits", "accuracy", model, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                    batch, _ce, evaluate,
                    {"model": f"MLP 64-{model.net[0].out_features}-{model.net[0].out_features}-10",
                     "params": n_params(model), "batch_per_rank": bs, "optimizer": "SGD lr 0.05 momentum 0.9",
                     "train": len(xtr), "test": len(xte)})
    if name == "lm":
        arch = LM_SIZES[size]
        train, val = stdlib_text(4_000_000 if size == "full" else 1_000_000)
        model = CharLM(**arch)
        # small per-rank batch: 4 ranks share 2 cores, so compute per step must stay small
        bs, ctx = (4, arch["context"])
        n_eval = 8
        eval_gen = torch.Generator().manual_seed(seed + 12345)
        ex, ey = lm_batch(val, 8 * n_eval, ctx, eval_gen)

        def batch(gen):
            return lm_batch(train, bs, ctx, gen)

        @torch.no_grad()
        def evaluate(m, rank, world):
            xs, ys = ex[rank::world], ey[rank::world]
            out = m(xs)
            s = nn.functional.cross_entropy(out.reshape(-1, 256), ys.reshape(-1), reduction="sum")
            tot = torch.stack([s, torch.tensor(float(ys.numel()))])
            dist.all_reduce(tot)
            return float(tot[0] / tot[1])

        return Task("lm", "val_loss", model, lambda p: torch.optim.AdamW(p, lr=2e-3, weight_decay=0.0),
                    batch, _ce, evaluate,
                    {"model": "char transformer d{d_model} L{n_layers} H{n_heads} ctx{context}".format(**arch),
                     "params": n_params(model), "batch_per_rank": bs, "optimizer": "AdamW lr 2e-3",
                     "train_bytes": len(train), "val_tokens": ey.numel()})
    if name == "rec":
        # issue 52: embedding tables whose gradient is mostly zero rows (a batch touches few ids)
        data = Clicks(REC_SIZE["n_users"], REC_SIZE["n_items"])
        model = RecModel(**REC_SIZE)
        bs = REC_BATCH
        emb = model.embedding_params()
        rest = [p for p in model.parameters() if all(p is not e for e in emb)]

        def make_opt(params):
            params = list(params)
            assert len(params) == len(emb) + len(rest), "rec's optimizer takes the model's own parameters"
            return torch.optim.SGD([{"params": emb, "lr": REC_LR["embeddings"]},
                                    {"params": rest, "lr": REC_LR["mlp"]}], momentum=0.9)

        def batch(gen):
            return data.sample(bs, gen)

        @torch.no_grad()
        def evaluate(m, rank, world):
            xs, ys = data.val_x[rank::world], data.val_y[rank::world]
            s = nn.functional.binary_cross_entropy_with_logits(m(xs), ys, reduction="sum")
            tot = torch.stack([s, torch.tensor(float(ys.numel()))])
            dist.all_reduce(tot)
            return float(tot[0] / tot[1])

        touched = rows_touched(data, bs, seed + 777)
        n_emb = sum(p.numel() for p in emb)
        return Task("rec", "val_loss", model, make_opt, batch, _bce, evaluate,
                    {"model": "click model: user table {n_users}x{dim}, item table {n_items}x{dim}, "
                              "MLP {h3}-{hidden}-{h2}-1".format(h3=3 * REC_SIZE["dim"], h2=REC_SIZE["hidden"] // 2,
                                                                 **REC_SIZE),
                     "params": n_params(model), "embedding_params": n_emb, "batch_per_rank": bs,
                     "optimizer": "SGD momentum 0.9, lr {embeddings:g} (tables) / {mlp:g} (MLP)".format(**REC_LR),
                     "rows_touched_per_rank": touched, "row_bytes": 4 * REC_SIZE["dim"],
                     "val": len(data.val_y), "bayes_val_loss": data.bayes_loss})
    raise ValueError(f"task must be 'digits', 'lm' or 'rec', got {name!r}")


def _bucket_numels(ddp: DDP) -> list[int]:
    """Element counts of DDP's gradient buckets (from DDP's logging data; fp32)."""
    try:
        sizes = ddp._get_ddp_logging_data().get("bucket_sizes", "")
        out = [int(s) // 4 for s in str(sizes).split(",") if s.strip()]
        if out and sum(out) == sum(p.numel() for p in ddp.parameters()):
            return out
    except Exception:  # noqa: BLE001 - private API; fall back to one bucket
        pass
    return [sum(p.numel() for p in ddp.parameters())]


def _median_time(fn: Callable[[], Any], repeat: int = 3) -> float:
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


#: A step long after any warm-up (the sparsifiers' density warm-up): steady-state payloads.
STEADY_STEP = 10**9


def codec_cost(cfg: C.Config, grads: list[torch.Tensor], buckets: list[int]) -> dict[str, float]:
    """Compress+decompress seconds of ``cfg``'s codec on these gradients, and the payload bytes.

    Local, single rank, no error feedback: the cost of the encode/decode arithmetic, and the
    payload size the compressor's contract gives for this model (``Payload.nbytes``).
    """
    flat = torch.cat([g.reshape(-1) for g in grads])
    if cfg.kind == "ddp":
        return {"compression_s": 0.0}
    if cfg.kind == "torch_fp16":
        return {"compression_s": _median_time(lambda: flat.half().float())}
    if cfg.kind == "torch_bf16":
        return {"compression_s": _median_time(lambda: flat.bfloat16().float())}
    if cfg.kind == "torch_powersgd":
        r = cfg.params["rank"]

        def psgd():
            for g in grads:
                if g.dim() < 2:
                    continue
                m = g.reshape(g.shape[0], -1)
                n_, k_ = m.shape
                rr = min(n_, k_, r)
                if (n_ + k_) * rr * 2 >= n_ * k_:
                    continue
                q = torch.randn(k_, rr)
                p, _ = torch.linalg.qr(m @ q)
                q = m.t() @ p
                _ = p @ q.t()
        return {"compression_s": _median_time(psgd)}
    if cfg.compressor == "auto":  # a codec per bucket, chosen at run time: taken from the hook's account
        return {"compression_s": 0.0}
    if "sparse_rows" in cfg.params:
        # the row-sparse gradients go as rows (no codec) and their payload depends on the batch:
        # the codec is measured on the rest, and the payload is left unstated
        rest = [g for g in grads if not C.row_sparse(g)]
        cost = codec_cost(C.Config(cfg.name, cfg.kind, cfg.compressor,
                                   {k: v for k, v in cfg.params.items() if k != "sparse_rows"}), rest, buckets)
        return {"compression_s": cost["compression_s"]}
    import commpress

    hook_only = ("momentum", "momentum_masking", "residual_storage", "rollback",
                 "sparse_rows")   # the hook's, not the compressor's
    comp = commpress.get(cfg.compressor, **{k: v for k, v in cfg.params.items() if k not in hook_only})
    # Mirror the hook's split: 1-D and small (< min_numel) gradients go dense (4 bytes/element); the
    # rest is one compressed unit (the whole model here; the hook does one per bucket), or one per
    # matrix for low-rank.
    min_numel = getattr(C.ddp_module(), "DEFAULT_MIN_NUMEL", 1024)
    big = [g for g in grads if g.dim() > 1 and g.numel() >= min_numel]
    dense_bytes = 4 * sum(g.numel() for g in grads if not (g.dim() > 1 and g.numel() >= min_numel))
    if comp.aggregation == "lowrank":
        pieces = [g for g in big if getattr(comp, "is_compressed", lambda t: True)(g)]
        dense_bytes += 4 * sum(g.numel() for g in big if not any(g is q for q in pieces))
    else:
        pieces = [torch.cat([g.reshape(-1) for g in big])] if big else []
    payload_bytes = 0

    def run():
        nonlocal payload_bytes
        payload_bytes = dense_bytes
        for i, t in enumerate(pieces):
            # a step after any density warm-up: the steady state's payload
            pl = comp.compress(t, step=STEADY_STEP, key=i, generator=torch.Generator().manual_seed(i))
            payload_bytes += pl.nbytes
            comp.decompress(pl)
    return {"compression_s": _median_time(run), "payload_bytes": payload_bytes}


def warm_up(task_name: str, size: str, cfg: C.Config, seed: int, rank: int, ddp_kwargs: dict,
            steps: int = 3) -> None:
    """A few untimed steps on a throwaway replica with the same hook.

    Triggers one-time costs (numba JIT compilation in codecs and collectives,
    DDP's bucket rebuild) so they are not charged to the timed run; the real
    run starts from fresh weights and optimizer state.
    """
    task = make_task(task_name, size, seed)
    ddp = DDP(task.model, **ddp_kwargs)
    opt = task.make_opt(ddp.parameters())
    state = C.attach(ddp, cfg, seed, opt)
    gen = torch.Generator().manual_seed(seed * 1000 + 900 + rank)
    for _ in range(steps):
        x, y = task.batch(gen)
        task.loss(ddp, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _close(state)
    del ddp, opt, task
    dist.barrier()


def train_one(task_name: str, size: str, cfg: C.Config, steps: int, eval_every: int, seed: int,
              rank: int, world: int, report: Callable[[dict], None], time_budget: float | None = None,
              max_steps: int | None = None) -> dict[str, Any]:
    """Train ``task_name`` under ``cfg``; returns rank-0 measurements.

    Without ``time_budget``: exactly ``steps`` steps.  With it: until rank 0's
    training time reaches ``time_budget`` seconds (checked at evaluation points,
    the decision broadcast so all ranks stop together) or ``max_steps`` steps.
    """
    kw = {} if cfg.bucket_cap_mb is None else {"bucket_cap_mb": cfg.bucket_cap_mb}
    warm_up(task_name, size, cfg, seed, rank, kw)
    task = make_task(task_name, size, seed)
    ddp = DDP(task.model, **kw)
    opt = task.make_opt(ddp.parameters())
    state = C.attach(ddp, cfg, seed, opt)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    calib_gen = torch.Generator().manual_seed(seed * 1000 + 500 + rank)
    rank0 = rank == 0

    # compute time: forward+backward without gradient synchronisation (no hook runs)
    def local_fb():
        x, y = task.batch(calib_gen)
        with ddp.no_sync():
            task.loss(ddp, x, y).backward()
        opt.zero_grad(set_to_none=True)

    def curve_point(step: int, t: float) -> dict[str, float]:
        ddp.eval()
        v = task.evaluate(task.model, rank, world)
        ddp.train()
        dist.barrier()
        return {"step": step, "time": t, task.metric: v}

    def should_stop(step: int, t: float) -> bool:
        if time_budget is None:
            return step >= steps
        flag = torch.tensor([1.0 if (t >= time_budget or step >= (max_steps or steps)) else 0.0])
        dist.broadcast(flag, 0)
        return bool(flag.item())

    if rank0:
        report({"event": "start", "task": task_name, "config": cfg.name,
                "total": steps if time_budget is None else None})
    curve = [curve_point(0, 0.0)]
    step_times, opt_times, cpu_times, train_time, last_loss = [], [], [], 0.0, float("nan")
    train_losses: list[float] = []   # rank 0's loss each step (a lossless config's equal DDP's)
    step, stop = 0, False
    sent_per_step: list[int] = []
    accounts: list[dict | None] = []  # the hook's step-time account per step (commpress only)
    while not stop:
        step += 1
        x, y = task.batch(gen)
        c0, t0 = time.process_time(), time.perf_counter()
        loss = task.loss(ddp, x, y)
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2, c2 = time.perf_counter(), time.process_time()
        step_times.append(t2 - t0)
        cpu_times.append(c2 - c0)
        opt_times.append(t2 - t1)
        train_time += t2 - t0
        last_loss = float(loss.detach())
        train_losses.append(last_loss)
        if state is not None and hasattr(state, "stats"):
            sent_per_step.append(int((state.stats.last_step or {}).get("bytes_sent", 0)))
            accounts.append((state.stats.last_step or {}).get("account"))
        if step % eval_every == 0 or (time_budget is None and step == steps):
            curve.append(curve_point(step, train_time))
            stop = should_stop(step, train_time)
        if rank0:
            report({"event": "step", "config": cfg.name, "step": step, "loss": last_loss,
                    task.metric: curve[-1][task.metric]})

    fb_s = _median_time(local_fb, repeat=5)
    # gradients of one more (local) step, to measure the codec and its payload on real data
    x, y = task.batch(calib_gen)
    with ddp.no_sync():
        task.loss(ddp, x, y).backward()
    params = [p for p in ddp.parameters() if p.grad is not None]
    grads = [p.grad.detach().clone() for p in params]
    opt.zero_grad(set_to_none=True)
    buckets = _bucket_numels(ddp)
    codec = codec_cost(cfg, grads, buckets)

    skip = min(3, max(0, steps - 3))             # first steps: DDP bucket rebuild, hook warm-up
    steady = step_times[skip:] or step_times
    step_s = statistics.median(steady)
    opt_s = statistics.median(opt_times[skip:] or opt_times)
    # host CPU of the whole rank process per step (every thread: loop, hook worker, gloo's threads)
    cpu_s = statistics.median(cpu_times[skip:] or cpu_times)
    out: dict[str, Any] = {
        "task": task_name, "config": cfg.name, "kind": cfg.kind, "describe": cfg.describe(),
        "compressor": cfg.compressor or "", "params": dict(cfg.params),
        "bucket_cap_mb": cfg.bucket_cap_mb or "default",
        "steps": step, "time_budget_s": time_budget, "metric": task.metric, "final": curve[-1][task.metric],
        "final_train_loss": last_loss, "train_time_s": train_time, "step_s": step_s, "cpu_s": cpu_s,
        "compute_s": fb_s + opt_s, "compression_s": codec["compression_s"],
        "task_info": task.info, "curve": curve, "train_losses": train_losses,
    }
    if cfg.kind == "commpress":
        st = state.stats.as_dict()
        last = st.get("last_step") or {}
        # median over the steady steps: the last step alone can be a dense fallback (non-finite grads)
        sent = sent_per_step[skip:] or sent_per_step or [int(last.get("bytes_sent", 0))]
        out.update(bytes_sent=int(statistics.median(sent)), bytes_sent_last=int(last.get("bytes_sent", 0)),
                   dense_bytes=int(last.get("dense_bytes", 0)),
                   payload_bytes=codec.get("payload_bytes"),   # None for "auto": its kinds vary by bucket
                   hook_s_per_step=float(last.get("hook_seconds", 0.0)),
                   algorithms=st.get("algorithms", {}), stats_steps=st.get("steps", 0),
                   account=_median_account(accounts[skip:]))
        if st.get("sparse_rows"):  # register(..., sparse_rows=): per parameter, its path, density, capacities
            out["sparse_rows"] = st["sparse_rows"]
        if "auto" in st:  # register(model, "auto"): each bucket's choice, predicted and measured ms
            out["auto"] = st["auto"]
            out["auto_network"] = st.get("auto_network")
        if cfg.compressor == "auto":  # its codecs change at run time: the hook's measured codec seconds
            out["compression_s"] = float(out["account"].get("codec_total", 0.0))
    else:
        out.update(C.hook_bytes(cfg, grads, world))
    out["ratio"] = out["dense_bytes"] / out["bytes_sent"] if out["bytes_sent"] else float("inf")
    out["comm_s"] = max(0.0, step_s - out["compute_s"] - out["compression_s"])
    _close(state)
    if rank0:
        report({"event": "done", "config": cfg.name, "result": out})
    return out


def _close(state: Any) -> None:
    """Release a commpress state's overlap worker and its process group (every rank at the same
    point: the group's destruction is collective): without it each config of a leg, and each
    throwaway warm-up replica, left an idle worker thread and a gloo group behind in the rank
    processes that run the next ones."""
    if state is not None and hasattr(state, "close"):
        state.close()


def _median_account(accounts: list[dict | None]) -> dict[str, float]:
    """Per part, the median over the steady steps of the hook's step-time account (seconds;
    the median drops the steps whose interval holds an evaluation)."""
    rows = [a for a in accounts if a]
    if not rows:
        return {}
    out = {k: statistics.median(float(a[k]) for a in rows) for k, v in rows[0].items()
           if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for name in sorted({n for a in rows for n in a.get("codec", {})}):
        out["codec." + name] = statistics.median(float(a.get("codec", {}).get(name, 0.0)) for a in rows)
    return out


def rank_main(rank: int, world_size: int, *, report: Callable[[dict], None], task: str, size: str,
              configs: list[dict], steps: int, eval_every: int, seed: int, equal_time: bool = True,
              time_budget: float | None = None, max_steps_factor: int = 4) -> list[dict]:
    """Entry point of a rank (``benchmarks.train:rank_main``): every config in turn.

    With ``equal_time``, ``ddp`` (first in the list) runs ``steps`` steps and its
    training time becomes every later config's time budget (``time_budget``
    passes one in when ``ddp`` ran in an earlier launch), capped at
    ``max_steps_factor * steps`` steps.
    """
    results = []
    for spec in configs:
        cfg = C.BY_NAME[spec["name"]]
        budget = time_budget if (equal_time and cfg.name != "ddp") else None
        res = train_one(task, size, cfg, steps, eval_every, seed, rank, world_size, report,
                        time_budget=budget, max_steps=max_steps_factor * steps)
        if cfg.name == "ddp" and equal_time:
            t = torch.tensor([res["train_time_s"]], dtype=torch.float64)
            dist.broadcast(t, 0)                 # rank 0's clock is the budget on every rank
            time_budget = float(t.item())
        results.append(res if rank == 0 else {"config": cfg.name})
    return results
