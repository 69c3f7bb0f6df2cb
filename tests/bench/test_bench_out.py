"""`--out DIR` means one thing for every `rlkit bench` command: the folder its report files go in,
created if missing; a path that cannot be that folder is one line naming it, before any work."""

from __future__ import annotations

import argparse
import importlib

import pytest

from rlkit.bench.report import OutFolderError, out_folder, write_report
from rlkit.cli import COMMANDS, main

BENCHES = {words[1]: module for words, module, _ in COMMANDS if words[0] == "bench"}


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_command_has_the_same_out_option(name):
    parser = argparse.ArgumentParser()
    importlib.import_module(BENCHES[name]).add_arguments(parser)
    (out,) = [a for a in parser._actions if "--out" in a.option_strings]
    assert (out.default, out.metavar) == (f"runs/bench-{name}", "DIR")


@pytest.mark.parametrize("name", BENCHES)
@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_file_for_out_is_one_line_naming_it(name, where, tmp_path, capsys):
    file = tmp_path / "report.json"
    file.write_text("{}")
    out = file if where == "a file" else file / "sub"
    assert main(["bench", name, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rlkit: --out {out}: ") and "\n" not in err, err
    assert file.read_text() == "{}"  # untouched


def test_the_folder_is_created_and_the_report_written(tmp_path, capsys):
    out = out_folder(tmp_path / "a" / "b")
    assert out.is_dir()
    written = write_report(out, "x", {"figure": 1.5}, "| table |")
    assert [p.name for p in written] == ["x.md", "x.json"]
    assert (out / "x.json").read_text() == '{\n "figure": 1.5\n}\n'
    assert "wrote" in capsys.readouterr().err


def test_an_unwritable_place_is_named(tmp_path, monkeypatch):
    def refuse(self, *a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(tmp_path), "mkdir", refuse)
    with pytest.raises(OutFolderError, match=r"--out .*/x: cannot create the folder \(Permission denied\)"):
        out_folder(tmp_path / "x")
    monkeypatch.undo()
    monkeypatch.setattr("os.access", lambda *a: False)
    with pytest.raises(OutFolderError, match="the folder is not writable"):
        out_folder(tmp_path)
