"""Imported by the rank processes' forkserver (:mod:`distributed`): numba's CPU target loads its
typing and lowering registries once there (about 0.5 s) instead of in every rank that first
calls a numba kernel. Starts no thread and compiles nothing."""

try:
    from numba.core.registry import cpu_target
except ImportError:   # numba is optional: the torch backend then
    pass
else:
    cpu_target.target_context.refresh()
