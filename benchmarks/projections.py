"""``python -m benchmarks.projections``: ``commpress.advise`` projected onto published cluster profiles.

``python -m benchmarks.projections [--doc docs/results/projections.md] [--json]``

Deterministic, no measurement, seconds on a CPU: for every cluster of the grid below it calls
:func:`commpress.advise.advise` (the model ``"auto"`` uses) with every input given, and prints
the markdown tables (or, with ``--doc``, replaces the generated part of that file, between
``BEGIN`` and ``END`` below; ``--json`` prints the rows instead).

The grid (every input named; the doc lists them with their sources):

* **Clusters**: nodes of ``GPUS_PER_NODE`` (8) GPUs, NVLink inside (advise's ``nvlink-node``
  profile as the intra-node link), ``WORLDS`` (64 to 1024) GPUs, and between nodes each of
  ``LINKS``: advise's ``25gbit-ethernet``, ``100gbit-ib`` and ``400gbit-ib`` profiles, *per GPU*
  (advise prices the ``G`` inter-node all-reduces of the two-level path as running side by
  side, each on its own link: one NIC per GPU), and the 25 Gbit/s profile's NIC shared by the
  node's 8 GPUs (3.125 Gbit/s per GPU, the profile's latency).
* **Models** ``MODELS``: 1B, 7B, 13B, 70B parameters (nominal counts), fp32 gradients, one
  all-reduce of all of them per step (data parallel; gradient accumulation syncs once per step).
  PowerSGD's matrices: square, of the model's hidden size (advise's ``matrix_side``).
* **Compute per step**: ``6 x params x tokens per GPU`` FLOPs at ``MFU`` (40%) of the H100's
  bf16 dense peak ``PEAK_FLOPS`` (989 TFLOP/s), with a global batch of ``GLOBAL_TOKENS``
  (2**22, about 4M tokens) split over the GPUs: 65,536 tokens per GPU at 64 GPUs, 4,096 at 1024.
* **Overlap** ``OVERLAPS``: 0 (advise's default: nothing hidden) and 2/3 (the backward pass, 4 of
  the 6 FLOPs per parameter and token, hides communication: the most DDP can hide, reached only
  without gradient accumulation).  The codec is never hidden.
* **Codec on the GPU** ``CODEC``: compress + decompress per element, from the H200 figures of
  ``docs/results/gpu.md`` (commit 4bbc0bb, 2**26 fp32 elements) where they exist, else assumed in
  units of that run's memcpy (0.134 ms); scaled to the H100 by the ratio of HBM bandwidths
  (``H200_HBM_GBS / H100_HBM_GBS``: the ops are memory-bound).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from commpress.advise import PROFILES, advise

GPUS_PER_NODE = 8
WORLDS = (64, 128, 256, 512, 1024)
#: (name, parameters, hidden size: PowerSGD's matrix side)
MODELS = (("1B", 1e9, 2048), ("7B", 7e9, 4096), ("13B", 13e9, 5120), ("70B", 70e9, 8192))
SHARED = "25gbit-ethernet, 1 NIC per node"
#: link label -> (bandwidth per GPU, latency us); the three profiles as advise names them
LINKS: dict[str, tuple[str, float]] = {
    "25gbit-ethernet": (PROFILES["25gbit-ethernet"]["bandwidth"], PROFILES["25gbit-ethernet"]["latency_us"]),
    "100gbit-ib": (PROFILES["100gbit-ib"]["bandwidth"], PROFILES["100gbit-ib"]["latency_us"]),
    "400gbit-ib": (PROFILES["400gbit-ib"]["bandwidth"], PROFILES["400gbit-ib"]["latency_us"]),
    SHARED: ("3.125gbit", PROFILES["25gbit-ethernet"]["latency_us"]),
}
INTRA = PROFILES["nvlink-node"]
PEAK_FLOPS = 989e12        # H100 SXM bf16 dense
MFU = 0.40
GLOBAL_TOKENS = 1 << 22    # per step, all GPUs together
OVERLAPS = (0.0, 2.0 / 3.0)

# Codec inputs: docs/results/gpu.md, one H200, commit 4bbc0bb, 2**26 fp32 elements, ms per op.
GPU_MD_ELEMENTS = 1 << 26
MEMCPY_MS = 0.134          # torch memcpy of the same tensor
H200_HBM_GBS = 4814.0      # the peak gpu_check read from the device
H100_HBM_GBS = 3350.0      # H100 SXM5, published
EF_MEMCPYS = 3.0           # error feedback: add the residual, keep the new one (24 B/element)
#: row name -> (compress + decompress ms at 2**26 on the H200, source)
CODEC: dict[str, tuple[float, str]] = {
    "bf16": (2 * MEMCPY_MS, "assumed: a cast each way, each at the memcpy's time"),
    "blockquant(bits=8)": (0.280 + 0.347 + EF_MEMCPYS * MEMCPY_MS,
                           "measured: compress 0.280 + decode and accumulate 0.347; "
                           "error feedback assumed 3 memcpys"),
    "blockquant(bits=4)": (0.458 + 0.283 + EF_MEMCPYS * MEMCPY_MS,
                           "measured (block 64): compress 0.458 + decode 0.283; "
                           "error feedback assumed 3 memcpys"),
    "topk(ratio=0.1)": (0.810 + MEMCPY_MS, "assumed as 1% (the same radix-select passes); "
                                           "decompress assumed 1 memcpy"),
    "topk(ratio=0.01)": (0.810 + MEMCPY_MS, "measured: top-k 1% with its residual 0.810; "
                                            "decompress assumed 1 memcpy"),
    "powersgd(rank=4)": (6 * MEMCPY_MS, "assumed: 6 memcpys (about 9 passes over the fp32 matrix: "
                                        "two skinny matmuls, the decompression, error feedback)"),
    "powersgd(rank=1)": (6 * MEMCPY_MS, "assumed: as rank 4 (memory-bound)"),
}
#: advise's DEFAULT_COMPRESSORS less fp16, bf16's twin here (the same bytes, the same codec)
COMPRESSORS = tuple(CODEC)

BEGIN = "<!-- BEGIN generated by python -m benchmarks.projections -->"
END = "<!-- END generated -->"


def codec_ns_per_element() -> dict[str, float]:
    """compress + decompress ns per element on the H100, by row name."""
    scale = H200_HBM_GBS / H100_HBM_GBS
    return {k: ms * 1e6 / GPU_MD_ELEMENTS * scale for k, (ms, _) in CODEC.items()}


def tokens_per_gpu(world: int) -> int:
    return GLOBAL_TOKENS // world


def compute_ms(params: float, world: int) -> float:
    """6 x params x tokens per GPU at MFU of the peak, in ms."""
    return 1e3 * 6.0 * params * tokens_per_gpu(world) / (PEAK_FLOPS * MFU)


def project(link: str, model: str, world: int, overlap: float) -> dict[str, Any]:
    """advise's result for one cluster of the grid."""
    params, side = next((p, s) for name, p, s in MODELS if name == model)
    bandwidth, latency = LINKS[link]
    return advise(int(params), compute_ms(params, world), world, bandwidth, latency,
                  gpus_per_node=GPUS_PER_NODE, intra_bandwidth=INTRA["bandwidth"],
                  intra_latency_us=INTRA["latency_us"], overlap=overlap, compressors=list(COMPRESSORS),
                  matrix_side=side, codec_ns_per_element=codec_ns_per_element())


def rows() -> list[dict[str, Any]]:
    """One row per (link, model, world, overlap, compressor), DDP's included."""
    out = []
    for link in LINKS:
        for model, _, _ in MODELS:
            for world in WORLDS:
                for f in OVERLAPS:
                    res = project(link, model, world, f)
                    for r in res["rows"]:
                        out.append({"link": link, "model": model, "world": world, "overlap": round(f, 4),
                                    "tokens_per_gpu": tokens_per_gpu(world),
                                    "compute_ms": res["inputs"]["compute_ms"], "bound": res["bound"],
                                    "comm_fraction": res["comm_fraction"], **r})
    return out


# ---------------------------------------------------------------- markdown
def _bytes(b: float) -> str:
    return f"{b / 1e9:.3g} GB" if b >= 1e9 else f"{b / 1e6:.3g} MB"


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(r) + " |" for r in body])


def _setups(all_rows: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    out: dict[tuple, list[dict[str, Any]]] = {}
    for r in all_rows:
        out.setdefault((r["link"], r["model"], r["world"], r["overlap"]), []).append(r)
    return out


def _best(rs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    return max((r for r in rs if r["compressor"] != "ddp"), key=lambda r: r[key])


def summary(all_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts of setups (link, model, world, overlap) where a compressor pays."""
    setups = _setups(all_rows)
    per = {}
    for link in LINKS:
        for f in OVERLAPS:
            mine = [rs for (lk, _, _, o), rs in setups.items() if lk == link and o == round(f, 4)]
            best = [_best(rs, "speedup") for rs in mine]
            bt = [_best([r for r in rs if r["to_target"] is not None], "to_target") for rs in mine]
            vs_bf16 = []
            for rs, b in zip(mine, best):
                bf = next(r for r in rs if r["compressor"] == "bf16")
                vs_bf16.append(bf["step_ms"] / b["step_ms"])
            per[(link, round(f, 4))] = {
                "setups": len(mine),
                "pays": sum(b["speedup"] > 1.0 for b in best),
                "pays_10": sum(b["speedup"] > 1.1 for b in best),
                "pays_to_target": sum(b["to_target"] > 1.0 for b in bt),
                "beats_bf16_10": sum(v > 1.1 for v in vs_bf16),
                "max": max(b["speedup"] for b in best),
                "min_best": min(b["speedup"] for b in best),
                "max_to_target": max(b["to_target"] for b in bt),
                "max_bound": max(rs[0]["bound"] for rs in mine),
            }
    total = len(setups)
    return {"per": per, "setups": total,
            "pays_10": sum(v["pays_10"] for v in per.values()),
            "pays_to_target": sum(v["pays_to_target"] for v in per.values()),
            "beats_bf16_10": sum(v["beats_bf16_10"] for v in per.values())}


def render(all_rows: list[dict[str, Any]]) -> str:
    setups = _setups(all_rows)
    s = summary(all_rows)
    lines = [BEGIN, "", "### Headline", ""]
    head = ["link between nodes (per GPU)", "overlap", "best speedup per step (range over the 20)",
            "pays per step (> 1.0x)", "pays > 10%", "> 10% over the bf16 row", "pays to target (prior price)",
            "bound 1/(1-c), max"]
    body = []
    for (link, f), v in s["per"].items():
        bw = LINKS[link][0]
        body.append([f"{link} ({bw})", f"{f:.2g}", f"{v['min_best']:.2f}x - {v['max']:.2f}x",
                     f"{v['pays']} of {v['setups']}", f"{v['pays_10']} of {v['setups']}",
                     f"{v['beats_bf16_10']} of {v['setups']}",
                     f"{v['pays_to_target']} of {v['setups']} (best {v['max_to_target']:.2f}x)",
                     f"{v['max_bound']:.2f}x"])
    lines += _table(head, body)
    lines += ["", f"Of the {s['setups']} setups (link x model x GPUs x overlap), a compressor is more than 10% "
              f"faster per step than fp32 DDP in {s['pays_10']}, more than 10% faster than the bf16 row in "
              f"{s['beats_bf16_10']}, and faster to the target once its prior price in steps is counted in "
              f"{s['pays_to_target']}.", ""]

    lines += ["### Compute per step", ""]
    head = ["GPUs", "tokens per GPU"] + [f"{m} compute ms" for m, _, _ in MODELS]
    lines += _table(head, [[str(w), f"{tokens_per_gpu(w):,}"]
                           + [f"{compute_ms(p, w):.0f}" for _, p, _ in MODELS] for w in WORLDS])

    lines += ["", "### Codec on the GPU (compress + decompress)", ""]
    ns = codec_ns_per_element()
    lines += _table(["compressor", "ms at 2**26 on the H200", "ns/element on the H100", "source"],
                    [[k, f"{ms:.3f}", f"{ns[k]:.4f}", src] for k, (ms, src) in CODEC.items()])

    lines += ["", "### Bytes one GPU sends per step", "",
              "Across nodes (inter-node link); every row also sends DDP's intra-node reduce-scatter and "
              "all-gather in fp32 over NVLink (the last column), which no compressor shrinks in "
              "commpress's two-level path.  The same for every link and overlap.", ""]
    head = ["model", "GPUs", "DDP"] + list(COMPRESSORS) + ["intra-node, every row"]
    body = []
    for model, _, _ in MODELS:
        for w in WORLDS:
            rs = setups[(next(iter(LINKS)), model, w, 0.0)]
            by = {r["compressor"]: r for r in rs}
            body.append([model, str(w), _bytes(by["ddp"]["inter_node_bytes"])]
                        + [_bytes(by[c]["inter_node_bytes"]) for c in COMPRESSORS]
                        + [_bytes(by["ddp"]["bytes"] - by["ddp"]["inter_node_bytes"])])
    lines += _table(head, body)

    lines += ["", "### Step time per cluster", "",
              "Each cell: the predicted step in ms (its speedup over DDP's step).  `c`: the exposed "
              "communication's share of DDP's step; `bound` = 1/(1-c).  **Best**: the fastest row per step, "
              "then the best counting its prior price in steps (advise's `to_target`; `-`: none above 1).", ""]
    for link in LINKS:
        for f in OVERLAPS:
            lines += [f"#### {link} ({LINKS[link][0]} per GPU), overlap {f:.2g}", ""]
            head = ["model", "GPUs", "compute ms", "DDP ms", "c", "bound"] + list(COMPRESSORS) + ["best", "best to target"]
            body = []
            for model, _, _ in MODELS:
                for w in WORLDS:
                    rs = setups[(link, model, w, round(f, 4))]
                    by = {r["compressor"]: r for r in rs}
                    d = by["ddp"]
                    b = _best(rs, "speedup")
                    bt = _best([r for r in rs if r["to_target"] is not None], "to_target")
                    body.append([model, str(w), f"{d['compute_ms']:.0f}", f"{d['step_ms']:.0f}",
                                 f"{d['comm_fraction']:.2f}", f"{d['bound']:.2f}x"]
                                + [f"{by[c]['step_ms']:.0f} ({by[c]['speedup']:.2f}x)" for c in COMPRESSORS]
                                + [f"{b['compressor']} {b['speedup']:.2f}x" if b["speedup"] > 1 else "-",
                                   f"{bt['compressor']} {bt['to_target']:.2f}x" if bt["to_target"] > 1 else "-"])
            lines += _table(head, body) + [""]
    lines.append(END)
    return "\n".join(lines) + "\n"


def write_doc(path: Path, block: str) -> None:
    """Replace the generated block of ``path`` (between BEGIN and END), or write the block alone."""
    if not path.exists():
        path.write_text(block)
        return
    text = path.read_text()
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise SystemExit(f"{path}: no generated block ({BEGIN!r} ... {END!r}) to replace")
    path.write_text(text[:i] + block.rstrip("\n") + text[j + len(END):])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.projections", description=__doc__.split("\n\n")[0])
    p.add_argument("--doc", help="replace the generated block of this markdown file (else print it)")
    p.add_argument("--json", action="store_true", help="print every row as JSON instead")
    a = p.parse_args(argv)
    all_rows = rows()
    if a.json:
        print(json.dumps({"rows": all_rows}, indent=1))
    elif a.doc:
        write_doc(Path(a.doc), render(all_rows))
    else:
        print(render(all_rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
