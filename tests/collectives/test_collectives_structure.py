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
