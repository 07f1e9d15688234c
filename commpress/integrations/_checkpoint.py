"""Per-rank hook-state files inside a framework's checkpoint folder (shared by the integrations).

Error-feedback residuals, step counters and PowerSGD factors are per rank, so each
rank writes its own ``commpress_rank{r}.pt`` (``r`` the global rank) into the folder
the framework saves, and reads its own back.  Whether the folder holds the files
is agreed by all ranks before anyone loads (one ``all_gather_object`` of a bool):
a hook state restored on some ranks only would make ranks disagree on the step
counter (warm-up, noise seeds) and desynchronize the collectives.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger("commpress")

FILE_TEMPLATE = "commpress_rank{rank}.pt"


def state_file(directory: str | os.PathLike, rank: int | None = None) -> str:
    """The path of ``rank``'s hook state (this process's global rank by default) in ``directory``."""
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return os.path.join(os.fspath(directory), FILE_TEMPLATE.format(rank=rank))


def save(state: Any, directory: str | os.PathLike) -> str:
    """Write ``state.state_dict()`` to this rank's file in ``directory`` (atomically: temp file + rename)."""
    os.makedirs(directory, exist_ok=True)
    path = state_file(directory)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state.state_dict(), tmp)
    os.replace(tmp, path)
    return path


def load(state: Any, directory: str | os.PathLike, *, missing: str = "warn") -> bool:
    """Load this rank's file from ``directory`` into ``state`` (collective: every rank calls it).

    All ranks first agree on whether the folder holds their file.  When every
    rank's file is there, each loads its own (``state.load_state_dict`` checks
    rank, world size and configuration).  When none is, ``missing="warn"`` logs
    that the residuals start from zero (a checkpoint saved without commpress) and
    returns ``False``; ``missing="raise"`` raises ``FileNotFoundError``.  When only
    some ranks have theirs (another world size, a partial copy), every rank
    raises ``RuntimeError``.
    """
    path = state_file(directory)
    have = os.path.isfile(path)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flags: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(flags, have)
    else:
        flags = [have]
    if all(flags):
        state.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return True
    if any(flags):
        lacking = [r for r, f in enumerate(flags) if not f]
        raise RuntimeError(
            f"checkpoint {os.fspath(directory)!r} holds commpress hook states for some ranks only "
            f"(missing for ranks {lacking}, e.g. {os.path.basename(state_file(directory, lacking[0]))}): "
            "residuals are per rank, so resume with the world size that saved it and a complete copy "
            "of the folder on every node")
    if missing == "raise":
        raise FileNotFoundError(f"no commpress hook state in {os.fspath(directory)!r} (expected {path})")
    log.warning("commpress: no hook state in %s (saved without commpress?): error-feedback residuals "
                "start from zero, so the run is not bitwise the uninterrupted one", os.fspath(directory))
    return False
