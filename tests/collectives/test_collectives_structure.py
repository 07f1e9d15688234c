"""The collectives package's modules import each other without cycles (one direction of
dependency: wire → the protocols → core)."""

import ast
import os

import commpress.collectives as C


def _graph():
    base = os.path.dirname(C.__file__)
    graph = {}
    for f in os.listdir(base):
        if f.endswith(".py") and f != "__init__.py":
            tree = ast.parse(open(os.path.join(base, f)).read())
            deps = set()
            for node in ast.walk(tree):  # function-level imports count too
                if isinstance(node, ast.ImportFrom) and node.level == 1:
                    deps |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
            graph[f[:-3]] = deps
    return graph


def test_no_import_cycles():
    graph = _graph()

    def cycle(node, path):
        for dep in graph.get(node, ()):
            if dep in path:
                return path[path.index(dep):] + [dep]
            found = cycle(dep, path + [dep])
            if found:
                return found
        return None

    assert graph["wire"] == set()
    for module in graph:
        assert cycle(module, [module]) is None, cycle(module, [module])


def test_nothing_outside_collectives_imports_its_private_modules():
    """The hooks (and everything else) use the collectives' public functions only:
    ``collectives._comm`` and friends can change their layout freely."""
    root = os.path.dirname(os.path.dirname(C.__file__))
    offenders = []
    for dirpath, _, files in os.walk(root):
        if os.path.commonpath([dirpath, os.path.dirname(C.__file__)]) == os.path.dirname(C.__file__):
            continue
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    mods = [node.module + "." + a.name for a in node.names]
                elif isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                else:
                    continue
                for m in mods:
                    parts = m.split(".")
                    if "collectives" in parts and any(p.startswith("_") for p in parts[parts.index("collectives") + 1:]):
                        offenders.append((os.path.relpath(path, root), m))
    assert offenders == []


def test_bounded_cache_is_lru_and_safe_across_threads():
    import threading

    from commpress.collectives._comm import BoundedCache

    cache = BoundedCache(3)
    for k in "abc":
        cache.put(k, k.upper())
    assert cache.get("a") == "A"          # "a" is now the most recently used
    cache.put("d", "D")                   # evicts "b", the least recently used
    assert "b" not in cache and all(k in cache for k in "acd")

    def hammer(tag):
        for i in range(2000):
            cache.put((tag, i % 7), i)
            cache.get((tag, (i + 3) % 7))

    threads = [threading.Thread(target=hammer, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache._d) == 3


def test_wire_layout_constants_are_defined_in_wire_only():
    """Every wire-format fact (status word, sum slots, the validation header's slots and
    codes) is assigned in ``wire.py``; the other modules import it."""
    facts = {"STATUS_BYTES", "SUM_SLOTS", "NONFINITE", "HEADER_FIXED", "SKETCH", "DTYPES", "ALGORITHM_CODES",
             "KINDS", "ERRORS", "H_ERROR", "H_NUMEL", "H_DTYPE", "H_ALGORITHM", "H_KIND", "H_CONFIG",
             "H_COUNT", "H_MODEL"}
    base = os.path.dirname(C.__file__)
    owners = {}
    for f in sorted(os.listdir(base)):
        if not f.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(base, f)).read())
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            for t in targets:
                names = [e.id for e in t.elts] if isinstance(t, ast.Tuple) else [getattr(t, "id", None)]
                owners.update({n: owners.get(n, set()) | {f} for n in names if n in facts})
    assert owners == {n: {"wire.py"} for n in facts}, owners
