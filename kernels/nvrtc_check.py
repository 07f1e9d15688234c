"""Compile kernels/*.cu with NVRTC, the compiler CuPy uses at run time (no GPU needed).

    python kernels/nvrtc_check.py [--arch 80 90] [--lib /path/to/libnvrtc.so.12]

libnvrtc is taken from ``--lib``, ``$NVRTC_LIB``, the ``nvidia-cuda-nvrtc-cu12`` wheel of this
Python (``pip install nvidia-cuda-nvrtc-cu12``), or the system's loader path.  Each source is
compiled for each virtual architecture with the options the cuda backend passes
(``commpress.ops.cuda_backend.NVRTC_OPTIONS``); any error or warning in the log fails the check,
and so does a flush-to-zero float instruction in the PTX (the kernels keep subnormals).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import site
import sys
from pathlib import Path

KERNELS = Path(__file__).resolve().parent
sys.path.insert(0, str(KERNELS.parent))
from commpress.ops.cuda_backend import NVRTC_OPTIONS  # noqa: E402  (the options the backend uses)


def find_nvrtc(explicit: str | None = None) -> str:
    if explicit or os.environ.get("NVRTC_LIB"):
        return explicit or os.environ["NVRTC_LIB"]
    for base in site.getsitepackages() + [site.getusersitepackages()] + sys.path:
        hits = sorted(glob.glob(os.path.join(base, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.*")))
        hits = [h for h in hits if ".alt." not in h and "builtins" not in h]
        if hits:
            return hits[-1]
    return "libnvrtc.so"


def _check(lib, rc: int, what: str) -> None:
    if rc != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"{what}: {lib.nvrtcGetErrorString(rc).decode()}")


def compile_source(lib, source: str, name: str, arch: int) -> tuple[int, str]:
    """(PTX size, compiler log) of ``source`` for ``compute_<arch>``; RuntimeError when it does not
    compile or its PTX flushes subnormals (an ``.ftz`` instruction)."""
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in NVRTC_OPTIONS] + [f"--gpu-architecture=compute_{arch}".encode()]
        argv = (ctypes.c_char_p * len(opts))(*opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace").strip()
        if rc != 0:
            raise RuntimeError(f"{name} for compute_{arch} does not compile:\n{log}")
        ptx = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(ptx)), "nvrtcGetPTXSize")
        text = ctypes.create_string_buffer(ptx.value)
        _check(lib, lib.nvrtcGetPTX(prog, text), "nvrtcGetPTX")
        ftz = [line.strip() for line in text.value.decode().splitlines() if ".ftz" in line]
        if ftz:
            raise RuntimeError(f"{name} for compute_{arch}: {len(ftz)} flush-to-zero instructions "
                               f"(subnormals lost), first: {ftz[0]}")
        return ptx.value, log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--lib")
    args = ap.parse_args(argv)
    path = find_nvrtc(args.lib)
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        print(f"nvrtc_check: cannot load {path}: {exc}\n  install it: pip install nvidia-cuda-nvrtc-cu12",
              file=sys.stderr)
        return 2
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    sources = sorted(KERNELS.glob("*.cu"))
    if not sources:
        print("nvrtc_check: no kernels/*.cu", file=sys.stderr)
        return 1
    failed = False
    for src in sources:
        for arch in args.arch:
            try:
                size, log = compile_source(lib, src.read_text(), src.name, arch)
            except RuntimeError as exc:
                print(f"nvrtc_check: {exc}", file=sys.stderr)
                failed = True
                continue
            if log:
                print(f"nvrtc_check: {src.name} compute_{arch} warnings:\n{log}", file=sys.stderr)
                failed = True
            else:
                print(f"nvrtc_check: {src.name} compiles for compute_{arch} with NVRTC "
                      f"{major.value}.{minor.value} ({size} bytes of PTX)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
