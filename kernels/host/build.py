"""Build kernels/*.cu for the host (CI has no GPU): ``python kernels/host/build.py [--tsan] [--out DIR]``.

Writes ``DIR/host_kernels.cpp`` (the .cu sources included after ``cuda_shim.h``, plus one
trampoline per ``extern "C" __global__`` kernel and a table of them) and compiles it with ``g++``
(``$CXX``) into ``DIR/libcommpress_host[_tsan].<hash>.so``; with ``--tsan-driver`` it builds
``DIR/tsan_driver`` instead (kernels/host/tsan_driver.cpp and the kernels, ``-fsanitize=thread``).
Prints the path.

The library's C API, used by ``commpress.ops.cuda_backend.HostLauncher`` and by the TSan driver:

* ``int cuhost_launch(const char* name, long long grid, int threads, void** args)``: runs kernel
  ``name`` like ``cuLaunchKernel`` (``args[i]`` points at parameter ``i``); 0 when done, -1 when no
  kernel has that name, -2 when ``threads`` is not a positive multiple of 32, -3 when a block
  deadlocked: its threads wait at a barrier that some never reach (fibers only; the threads
  build, for TSan, hangs there).
* ``const char* cuhost_signature(const char* name)``: the kernel's parameter types, comma
  separated (``i32 i64 u32 u64 f32 f64`` and pointers such as ``const i32*``), or NULL.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNELS = HERE.parent
SOURCES = ("commpress_ops.cu",)
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)', re.S)
_TYPES = {"int": "i32", "i64": "i64", "long long": "i64", "u32": "u32", "unsigned": "u32",
          "unsigned int": "u32", "u64": "u64", "unsigned long long": "u64", "float": "f32",
          "double": "f64", "u8": "u8", "unsigned char": "u8"}


def kernels(source: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """``[(name, [(c_type, short_type), ...]), ...]`` of the ``extern "C" __global__`` kernels."""
    found = []
    for name, params in _KERNEL.findall(source):
        out = []
        for p in (q.strip() for q in params.split(",") if q.strip()):
            ctype = re.sub(r"\s*\b\w+$", "", p).strip()  # drop the parameter name
            const = ctype.startswith("const ")
            base = ctype[6:] if const else ctype
            ptr = base.endswith("*")
            base = base.rstrip("*").strip()
            if base not in _TYPES:
                raise ValueError(f"kernel {name}: parameter type {ctype!r} not understood")
            short = ("const " if const else "") + _TYPES[base] + ("*" if ptr else "")
            out.append((ctype, short))
        found.append((name, out))
    return found


def generate() -> str:
    """The C++ translation unit: shim, sources, trampolines, launch table."""
    lines = ['#include "cuda_shim.h"']
    table = []
    for src in SOURCES:
        lines.append(f'#include "{(KERNELS / src).as_posix()}"')
    lines.append("namespace {")
    for src in SOURCES:
        for name, params in kernels((KERNELS / src).read_text()):
            call = ", ".join(f"*({ctype}*)a[{i}]" for i, (ctype, _) in enumerate(params))
            lines.append(f"void tramp_{name}(void** a) {{ (void)a; {name}({call}); }}")
            sig = ",".join(short for _, short in params)
            table.append(f'  {{"{name}", "{sig}", tramp_{name}}},')
    lines += ["struct Entry { const char* name; const char* sig; void (*fn)(void**); };",
              "const Entry kTable[] = {", *table, "};",
              "const Entry* find(const char* name) {",
              "  for (const Entry& e : kTable) if (std::strcmp(e.name, name) == 0) return &e;",
              "  return nullptr;", "}", "}  // namespace",
              'extern "C" const char* cuhost_signature(const char* name) {',
              "  const Entry* e = find(name);", "  return e ? e->sig : nullptr;", "}",
              'extern "C" int cuhost_launch(const char* name, long long grid, int threads, void** args) {',
              "  const Entry* e = find(name);", "  if (!e) return -1;",
              "  if (threads <= 0 || threads % 32) return -2;",
              "  if (!cuhost::launch((unsigned)grid, (unsigned)threads, [&] { e->fn(args); })) return -3;",
              "  return 0;", "}"]
    return "\n".join(lines) + "\n"


def build(out: Path, tsan: bool = False, cxx: str | None = None) -> Path:
    """Generate and compile; skips the compiler when a library of the same inputs and flags exists."""
    out.mkdir(parents=True, exist_ok=True)
    text = generate()
    cxx = cxx or os.environ.get("CXX") or "g++"
    flags = ["-std=c++17", "-shared", "-fPIC", "-pthread", "-ffp-contract=off", "-fno-fast-math",
             "-Wall", "-Werror", "-Wno-unused-function", "-Wno-unknown-pragmas", "-I", str(HERE)]
    flags += ["-O1", "-g", "-fsanitize=thread"] if tsan else ["-O2"]
    inputs = text + "".join((KERNELS / s).read_text() for s in SOURCES) + (HERE / "cuda_shim.h").read_text()
    tag = hashlib.sha256((inputs + cxx + " ".join(flags)).encode()).hexdigest()[:12]
    cpp = out / f"host_kernels{'_tsan' if tsan else ''}.cpp"
    lib = out / f"libcommpress_host{'_tsan' if tsan else ''}.{tag}.so"
    if lib.exists():
        return lib
    cpp.write_text(text)
    tmp = lib.with_suffix(".tmp")
    subprocess.run([cxx, *flags, "-o", str(tmp), str(cpp)], check=True)
    tmp.replace(lib)  # atomic: concurrent builders never load a half-written library
    return lib


def build_tsan_driver(out: Path, cxx: str | None = None) -> Path:
    """``tsan_driver.cpp`` linked with the kernels, all built with ``-fsanitize=thread``."""
    out.mkdir(parents=True, exist_ok=True)
    cpp = out / "host_kernels_tsan_driver.cpp"
    cpp.write_text(generate())
    exe = out / "tsan_driver"
    cxx = cxx or os.environ.get("CXX") or "g++"
    subprocess.run([cxx, "-std=c++17", "-O1", "-g", "-fsanitize=thread", "-pthread", "-ffp-contract=off",
                    "-Wall", "-Werror", "-Wno-unused-function", "-Wno-unknown-pragmas", "-I", str(HERE),
                    "-o", str(exe), str(HERE / "tsan_driver.cpp"), str(cpp)], check=True)
    return exe


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "build")
    ap.add_argument("--tsan", action="store_true", help="build with -fsanitize=thread")
    ap.add_argument("--tsan-driver", action="store_true", help="build the TSan driver executable instead")
    args = ap.parse_args(argv)
    print(build_tsan_driver(args.out) if args.tsan_driver else build(args.out, args.tsan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
