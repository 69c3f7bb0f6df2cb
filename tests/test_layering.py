"""The import graph of rlkit's packages: no cycles between modules, and the dependency
direction of docs/design.md: the libraries (`rlkit.buffers`, `rlkit.common`, `rlkit.rollout`,
`rlkit.train`) never import the rest of `rlkit`; `common` is a leaf; `buffers` imports only
`common`; `rollout` and `train` are siblings; the measuring tools (`rlkit.sim`, `rlkit.bench`)
and the built-in engine are imported by nothing in the runtime.

Every import counts: one inside a function (a lazy import still ties the two modules together:
each needs the other to work) and one under `if TYPE_CHECKING:` (a type-only cycle is still two
modules that must be read together, and it hides a real one the day someone drops the guard).
A package's implicit import of its parents (`import a.b` runs `a/__init__`) is not an edge: a
package's `__init__` re-exporting its submodules is fine. No cycle is whitelisted.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("rlkit.buffers", "rlkit.common", "rlkit.rollout", "rlkit.train")
# Measuring tools: they import the runtime, the runtime never imports them; only other tools
# and the command line do.
TOOLS = ("rlkit.sim", "rlkit.bench")
TOOL_USERS = (*TOOLS, "rlkit.commands", "rlkit.cli")
BUILTIN_ENGINE = "rlkit.rollout.engines.builtin"  # a server process, started by module name


def within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def library_of(module: str) -> str:
    """The library a module belongs to, or 'rlkit' for the rest of the package."""
    return next((lib for lib in LIBRARIES if within(module, lib)), "rlkit")


def package_dirs(root: Path = ROOT) -> list[Path]:
    """Every folder under rlkit/, walked as setuptools' discovery walks it: into the symlinks
    rlkit/rollout, rlkit/train, rlkit/buffers (the top-level folders), so each file once."""
    out = []
    for d, dirs, _ in os.walk(root / "rlkit", followlinks=True):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        out.append(Path(d))
    return out


def module_files(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for d in package_dirs(root):
        for f in sorted(d.glob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports (lazily, type-only or at the top), resolved to the
    module (a `from a import b` whose b is a submodule is an edge to a.b)."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            for a in node.names:  # `from pkg import submodule` is an edge to the submodule
                sub = f"{base}.{a.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = module_files(root)
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
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_libraries_never_import_the_rest_of_rlkit_and_point_one_way():
    graph = import_graph()
    wrong = sorted(
        f"{m} -> {d}" for m, deps in graph.items() for d in deps
        if (library_of(m) != "rlkit" and library_of(d) == "rlkit")  # nothing of rlkit's spine
        # shared by every library (errors, the control token, the engine's HTTP API): a leaf
        or (library_of(m) == "rlkit.common" and library_of(d) != "rlkit.common")
        or (library_of(m) == "rlkit.buffers" and library_of(d) not in ("rlkit.buffers", "rlkit.common"))
        or ({library_of(m), library_of(d)} == {"rlkit.rollout", "rlkit.train"})  # siblings
    )
    assert wrong == []


def test_the_rollout_side_s_scheduling_core_imports_no_http():
    """The buffer, manager, policies, rankers, dispatcher and episodes run unchanged in tests and
    the simulator: only the HTTP layer itself and the engine launchers import rlkit.rollout.http."""
    graph = import_graph()
    wrong = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                   if within(d, "rlkit.rollout.http") and within(m, "rlkit.rollout", "rlkit.buffers")
                   and not within(m, "rlkit.rollout.http", "rlkit.rollout.engines"))
    assert wrong == []


def test_the_runtime_never_imports_the_measuring_tools_or_the_builtin_engine():
    graph = import_graph()
    wrong = sorted(
        f"{m} -> {d}" for m, deps in graph.items() for d in deps
        if (within(d, *TOOLS) and not within(m, *TOOL_USERS))
        or (within(d, BUILTIN_ENGINE) and not within(m, BUILTIN_ENGINE, *TOOL_USERS))
    )
    assert wrong == []


def test_the_graph_sees_lazy_and_type_only_imports_and_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    modules = module_files()
    # rlkit.driver.run imports the cluster inside train(): a lazy import is an edge
    assert "rlkit.driver.cluster" in imports_of("rlkit.driver.run", modules["rlkit.driver.run"], modules)
    # the top-level folders are in the one namespace, through the symlinks
    assert modules["rlkit.buffers.buffer"].resolve() == ROOT / "buffers" / "buffer.py"


def test_every_source_folder_is_a_package_that_the_wheel_installs():
    """pyproject.toml's package discovery finds packages by their __init__.py: a folder without
    one would work in an editable install (as a namespace folder) and be missing from a wheel."""
    missing = sorted(str(d.relative_to(ROOT)) for d in package_dirs()
                     if any(d.glob("*.py")) and not (d / "__init__.py").exists())
    assert missing == []


def test_the_gpu_planner_imports_only_the_standard_library():
    """rlkit.gpu_plan (`rlkit plan`'s search) is pure: its stage-time models are passed in, so it
    imports no project module and no torch, Ray or HTTP library, not even lazily."""
    import sys

    tree = ast.parse(module_files()["rlkit.gpu_plan"].read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom) and n.module and not n.level}
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))
    assert roots <= set(sys.stdlib_module_names), sorted(roots - set(sys.stdlib_module_names))
