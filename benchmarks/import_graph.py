"""The import graph of ``src/fedforget``: module -> the package modules it imports, its
cycles, the imports that run back up the layers, and the function-level imports.

Layers, lowest first (a module may import its own layer and the ones below; the layer of a
module is that of its longest matching prefix in LAYERS, below, the one list of them):

    0 base       utilities, the registries, the typed train settings, the run's state
    1 data       datasets, partitions, models, client data, inputs, CUDA graphs
    2 methods    methods.* (the method API, the shared math and distillation, every method)
    3 config     config, smoke, the schemas
    4 training   evaluation, metrics, continual, the two trainers, checkpoints, the engine
    5 workflow   parse (validation of a whole config), runner, aggregation, figures, tables,
                 provenance, the pipeline, the reference
    6 interface  cli, __main__

Usage: python benchmarks/import_graph.py [--json]  (prints the counts; --json the whole graph)
``tests/test_import_graph.py`` runs it and holds the limits.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "fedforget"
PACKAGE = "fedforget"

# prefix -> layer; the longest matching prefix wins
LAYERS: dict[str, int] = {
    "utils": 0, "registry": 0, "train_spec": 0, "schedule": 0, "state": 0, "validation": 0, "progress": 0, "__init__": 0,
    "memory": 0,
    "data": 1, "partition": 1, "models": 1, "dropout": 1, "featcache": 1, "activations": 1, "landscape": 1, "inputs": 1, "cudagraph": 1,
    "clientdata": 1,
    "methods": 2,
    "config": 3, "smoke": 3, "schemas": 3,
    "evaluation": 4, "metrics": 4, "continual": 4,
    "vectorized": 4, "rundata": 4, "trainers": 4, "checkpoint": 4, "engine": 4,
    "runner": 5, "aggregate": 5, "plots": 5, "figures": 5, "paper_tables": 5, "provenance": 5,
    "pipeline": 5, "parsecache": 5, "parse": 5, "reference": 5, "finished": 5,
    "cli": 6, "__main__": 6,
}  # fmt: skip


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def layer(mod: str) -> int:
    parts = mod.split(".")
    for i in range(len(parts), 0, -1):
        key = ".".join(parts[:i])
        if key in LAYERS:
            return LAYERS[key]
    raise KeyError(f"module {mod!r} has no layer in LAYERS")


def resolve(mod: str, is_pkg: bool, node: ast.ImportFrom | ast.Import, modules: set[str]) -> list[str]:
    """The package modules an import statement in ``mod`` names."""
    out: list[str] = []
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.name.startswith(PACKAGE + "."):
                out.append(a.name[len(PACKAGE) + 1 :])
        return [m for m in out if m in modules]
    if node.level == 0:
        if not (node.module or "").startswith(PACKAGE):
            return []
        base = (node.module or "")[len(PACKAGE) + 1 :]
    else:
        here = mod.split(".") if mod != "__init__" else []
        if not is_pkg:
            here = here[:-1]
        up = node.level - 1
        here = here[: len(here) - up] if up else here
        base = ".".join(here + ([node.module] if node.module else []))
    for a in node.names:
        full = f"{base}.{a.name}" if base else a.name
        if full in modules:  # `from . import make_params` of a submodule
            out.append(full)
        elif base in modules or base == "":
            out.append(base or "__init__")
    return sorted(set(out))


def graph() -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """(module -> imported package modules, [(module, imported, line)] of imports inside
    functions or classes). Imports under ``if TYPE_CHECKING:`` count as edges: they never
    run, but a type a module needs from a higher layer is a dependency all the same."""
    files = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    modules = set(files)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    local: list[tuple[str, str, int]] = []
    for mod, path in files.items():
        tree = ast.parse(path.read_text())
        is_pkg = path.name == "__init__.py"

        def visit(node: ast.AST, nested: bool, mod: str = mod, is_pkg: bool = is_pkg) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in resolve(mod, is_pkg, child, modules):
                        if target == mod:
                            continue
                        edges[mod].add(target)
                        if nested:
                            local.append((mod, target, child.lineno))
                inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                visit(child, inner)

        visit(tree, False)
    return edges, local


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a module into a higher layer. A package's ``__init__`` importing its own
    submodules (the registry filling itself) does not count."""
    out = []
    for m, targets in sorted(edges.items()):
        for t in sorted(targets):
            if t.startswith(m + ".") or (m == "__init__"):
                continue
            if layer(t) > layer(m):
                out.append((m, t))
    return out


def report() -> dict:
    edges, local = graph()
    return {
        "modules": len(edges),
        "imports": sum(len(v) for v in edges.values()),
        "cycles": cycles(edges),
        "upward": [f"{a} -> {b}" for a, b in upward(edges)],
        "function_level": [f"{a}:{line} -> {b}" for a, b, line in local],
        "graph": {m: sorted(v) for m, v in sorted(edges.items())},
    }


def main() -> None:
    r = report()
    if "--json" in sys.argv:
        print(json.dumps(r, indent=1))
        return
    print(f"modules {r['modules']}, imports {r['imports']}")
    print(f"cycles {len(r['cycles'])}: " + "; ".join(" <-> ".join(c) for c in r["cycles"]))
    print(f"upward imports {len(r['upward'])}: " + "; ".join(r["upward"]))
    print(f"function-level imports {len(r['function_level'])}")


if __name__ == "__main__":
    main()
