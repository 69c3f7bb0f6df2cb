"""The import graph of rlkit's packages: no cycles between modules, and the dependency
direction of DESIGN.md (`rlkit` -> `rollout`, `train` -> `buffers`; the library packages never
import the CLI layer).

Every import counts, also one inside a function (a lazy import still ties the two modules
together: each needs the other to work), except those under `if TYPE_CHECKING:` (annotations
only, never executed). A package's implicit import of its parents (`import a.b` runs
`a/__init__`) is not an edge: a package's `__init__` re-exporting its submodules is fine.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("buffers", "rollout", "train", "rlkit")
LIBRARIES = ("buffers", "rollout", "train")
# A cycle in code another change owned when this test was written (`rlkit bench load`: the actor
# module imports the bench's helpers, the bench imports the actor lazily). Each entry must still
# be a cycle, so it is removed once fixed; no other cycle may appear.
KNOWN_CYCLES = [["rlkit.bench.load", "rlkit.bench.load_actor"]]


def module_files() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports, resolved to the module (a `from a import b` whose
    b is a submodule is an edge to a.b)."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (child.level - 1)]
                    base = ".".join([*pkg, base] if base else pkg)
                for a in child.names:  # `from pkg import submodule` is an edge to the submodule
                    sub = f"{base}.{a.name}"
                    found.add(sub if sub in modules else base)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return out


def test_no_import_cycles():
    found = cycles(import_graph())
    new = [c for c in found if c not in KNOWN_CYCLES]
    assert new == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in new)
    assert [c for c in KNOWN_CYCLES if c not in found] == [], "fixed: drop it from KNOWN_CYCLES"


def test_libraries_never_import_the_cli_layer_and_point_one_way():
    graph = import_graph()
    wrong = sorted(
        f"{m} -> {d}" for m, deps in graph.items() for d in deps
        if (m.split(".")[0] in LIBRARIES and d.split(".")[0] == "rlkit")  # nothing of rlkit
        or (m.split(".")[0] == "buffers" and d.split(".")[0] != "buffers")  # buffers: a leaf
        or ({m.split(".")[0], d.split(".")[0]} == {"rollout", "train"})  # siblings
    )
    assert wrong == []


def test_the_graph_sees_lazy_imports_and_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    modules = module_files()
    # rlkit.driver.run imports the cluster inside train(): a lazy import is an edge
    assert "rlkit.driver.cluster" in imports_of("rlkit.driver.run", modules["rlkit.driver.run"], modules)
