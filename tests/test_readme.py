"""Every ```python block of README.md and of the docs pages (docs/*.md) runs as written.

A block preceded by ``<!-- readme-test: 2 ranks -->`` runs on 2 gloo ranks (the process
group already initialized and ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``
set, as torchrun + ``init_process_group`` leave them); the others run in one process.
``<!-- readme-test: 1 rank, needs transformers -->`` names modules of an optional extra:
the block is skipped where one is missing.  Each block runs alone, in a temporary working
directory.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

from distributed import run

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*readme-test:\s*(\d+)\s+ranks?\s*(?:,\s*needs\s+([\w. ]+?))?\s*-->")


def snippets(page: Path = README) -> list[tuple[int, int, str, list[str]]]:
    """``(line, ranks, code, needs)`` of every python block of ``page`` (ranks 1 unless marked)."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i + 1
            j = start
            while lines[j].strip() != "```":
                j += 1
            prev = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
            m = MARKER.search(prev)
            needs = m.group(2).split() if m and m.group(2) else []
            out.append((start + 1, int(m.group(1)) if m else 1, "\n".join(lines[start:j]), needs))
            i = j
        i += 1
    return out


def _exec(rank, world, code, where, workdir):
    os.environ["COMMPRESS_BACKEND"] = "torch"   # small tensors: the reference ops, no JIT in each rank
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")   # what torchrun sets (accelerate reads them)
    os.chdir(os.path.join(workdir, f"rank{rank}"))
    exec(compile(code, where, "exec"), {"__name__": "__readme__"})
    return True


SNIPPETS = snippets()
ALL = [(f"{page.relative_to(ROOT)}:{line}", ranks, code, needs)
       for page in PAGES for line, ranks, code, needs in snippets(page)]


def test_readme_has_snippets_and_speaks_of_itself():
    assert len(SNIPPETS) >= 5 and sum(r > 1 for _, r, _, _ in SNIPPETS) >= 3
    text = README.read_text()
    assert not re.search(r"\bissue \d+", text, re.I)          # no pointers to the tracker
    assert "](../" not in text and "../shared" not in text     # nothing outside the repository
    assert len(text.splitlines()) <= 250                          # a newcomer's page; the rest is in docs/
    overhead = (ROOT / "docs" / "results" / "overhead.md").read_text()
    assert "# Overhead (hot path)" in overhead and "benchmarks overhead" in overhead  # measured, with its command


@pytest.mark.timeout(180)
@pytest.mark.parametrize("where,ranks,code,needs", ALL, ids=[w for w, _, _, _ in ALL])
def test_readme_snippet_runs(where, ranks, code, needs, tmp_path, monkeypatch):
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (an optional extra)")
    for r in range(ranks):
        (tmp_path / f"rank{r}").mkdir()
    if ranks == 1:
        monkeypatch.chdir(tmp_path / "rank0")
        exec(compile(code, where, "exec"), {"__name__": "__readme__"})
    else:
        assert run(_exec, ranks, code, where, str(tmp_path), timeout=150) == [True] * ranks
