"""The layout static tools read: rollout/, train/ and buffers/ stay top-level folders, and
rlkit/rollout, rlkit/train, rlkit/buffers are committed symlinks to them, so `rlkit.rollout...`
is a real path that an editor or type checker resolves without running an import hook; and only
`rlkit` is importable from the install (a user's own `train.py` never meets rlkit's `train`).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINKED = ("rollout", "train", "buffers")
# Where rlkit.* imports are written (the tests included): each real file once, links not followed.
SOURCES = ("rlkit", *LINKED, "tests")


def source_files() -> list[Path]:
    return [Path(d, f) for folder in SOURCES for d, _, files in os.walk(ROOT / folder)
            for f in sorted(files) if f.endswith(".py")]


def imported_rlkit_modules() -> set[str]:
    """Every rlkit.* module named by an `import` or absolute `from ... import` in the tree."""
    found: set[str] = set()
    for f in source_files():
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
    return {m for m in found if m == "rlkit" or m.startswith("rlkit.")}


def test_the_symlinks_point_at_the_top_level_folders():
    for name in LINKED:
        link = ROOT / "rlkit" / name
        assert link.is_symlink() and os.readlink(link) == f"../{name}", link  # relative: clones move
        assert link.resolve() == (ROOT / name).resolve()


def test_a_static_resolver_finds_every_rlkit_module_imported_in_the_tree():
    """jedi, given only the repository root as its path (no install, no import hook), finds the
    file of each module; one probe script, each distinct module once, keeps it fast."""
    jedi = pytest.importorskip("jedi")
    modules = sorted(imported_rlkit_modules())
    assert {"rlkit.rollout.manager", "rlkit.train.batch", "rlkit.buffers.buffer"} <= set(modules)
    code = "".join(f"import {m}\n" for m in modules)
    project = jedi.Project(ROOT, sys_path=[str(ROOT)], smart_sys_path=False)
    script = jedi.Script(code, path=ROOT / "_layout_probe.py", project=project)
    unresolved = []
    for line, module in enumerate(modules, start=1):
        want = ROOT.joinpath(*module.split("."))
        want = want / "__init__.py" if want.is_dir() else want.with_suffix(".py")
        col = len("import ") + len(module) - len(module.rsplit(".", 1)[-1])  # the last name
        got = {Path(n.module_path).resolve() for n in script.goto(line, col) if n.module_path}
        if want.resolve() not in got:
            unresolved.append(module)
    assert unresolved == [], f"{len(unresolved)}/{len(modules)} unresolved: {unresolved}"


def test_only_rlkit_is_importable_from_outside_the_repository(tmp_path):
    """From a folder outside the checkout, with the install's python: the editable install (or
    a wheel) exposes `rlkit` alone, never the folders it maps; a `.pth` naming the repository
    root, or setuptools' `compat` editable mode, would make `import train` work."""
    probe = (
        "import importlib, importlib.util\n"
        "assert importlib.util.find_spec('rlkit.rollout'), 'rlkit.rollout not installed'\n"
        f"for name in {LINKED!r}:\n"
        "    try:\n"
        "        importlib.import_module(name); print(name, 'imported')\n"
        "    except Exception as e:\n"
        "        print(name, type(e).__name__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the install alone
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:-1] == [f"{n} ModuleNotFoundError" for n in LINKED]


def test_package_discovery_follows_the_symlinks():
    """pyproject.toml's find (setuptools walks with followlinks): the wheel's rlkit.rollout."""
    tomllib = pytest.importorskip("tomllib")
    from setuptools import find_packages

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    found = set(find_packages(str(ROOT), include=find["include"]))
    assert {f"rlkit.{n}" for n in LINKED} | {"rlkit.rollout.engines"} <= found
    assert not found & set(LINKED), "a top-level rollout/train/buffers package would be installed"
