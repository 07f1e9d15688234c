"""The collectives package's modules import each other without cycles (one direction of
dependency: wire → _codec → the protocols → core)."""

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
