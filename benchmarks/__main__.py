"""``python -m benchmarks SUITE [options]``: run one benchmark suite.

Each suite is ``benchmarks/<suite>.py`` exposing ``main(argv) -> int``; it is
imported only when asked for.
"""

from __future__ import annotations

import importlib
import sys

SUITES = {
    "compressors": "compress/decompress speed and payload size of every compressor",
    "collectives": "sparse / quantized allreduce algorithms vs dense (supports --net RATE[,DELAY])",
    "kernels": "ops backends (torch reference, numba, CUDA) vs memcpy of the same bytes",
    "pipeline": "quantized gather_all allreduce: one message vs one per chunk, on an emulated link "
                "(--net 1gbit --numels ...)",
    "cpu": "where a training step's host CPU goes, per thread (loop, commpress worker, gloo), against its "
           "wall time, on an emulated link (--net 1gbit --configs ...)",
    "overhead": "hot-path overhead on loopback: DDP / allreduce / FSDP2 vs plain and PyTorch's hooks "
                "(--quick)",
    "auto2x2": "register(model, \"auto\", hierarchy=2) on an emulated 2 nodes x 2 ranks: its path per bucket "
               "against flat and two-level fixed (--nets 100mbit,10gbit)",
    "rounds": "the fixed cost of one gloo collective round, and a small model's DDP step with one round "
              "or one per bucket",
    "memory": "bytes per parameter the hooks keep: stats.memory_overhead_bytes against the RSS slope over "
              "two model sizes, DDP and FSDP2 vs plain and PyTorch's PowerSGD (--configs, --sizes 1024,2048)",
    "advisecheck": "python -m commpress.advise's predicted step times against measured ones on emulated clusters",
    "multinode": "torchrun across emulated nodes (namespaces, c10d rendezvous), SIGKILL + elastic bitwise resume",
    "sweep": "training sweep: every compression config on digits + a char LM, time to accuracy "
             "(--quick, --net 1gbit)",
}


def usage() -> str:
    lines = ["usage: python -m benchmarks SUITE [options]   (python -m benchmarks SUITE --help)", "", "suites:"]
    lines += [f"  {name:<12} {desc}" for name, desc in SUITES.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    suite, rest = argv[0], argv[1:]
    if suite not in SUITES:
        print(f"unknown suite {suite!r}\n\n{usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(f"benchmarks.{suite}")
    except ModuleNotFoundError as exc:
        if exc.name == f"benchmarks.{suite}":
            print(f"suite {suite!r} is not available in this checkout (benchmarks/{suite}.py is missing)",
                  file=sys.stderr)
            return 2
        raise
    if not hasattr(module, "main"):
        print(f"benchmarks/{suite}.py has no main(argv)", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
