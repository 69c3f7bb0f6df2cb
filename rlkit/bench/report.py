"""`--out DIR` of every `rlkit bench` command: the folder its report files go in.

One meaning for all of them: DIR is a folder (created if missing, default `runs/bench-<name>`)
and the command writes `<name>.json` (every figure) and `<name>.md` (the table it prints) into
it, beside whatever else it produces there (suite: chart, traces, timelines; e2e: its run
folders; engine: PTL profiles). The folder is checked before any work starts, so a path that
cannot be used fails at once with one line naming it, not with a traceback after the bench ran.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from rlkit.common.errors import UserError


class OutFolderError(UserError):
    """`--out` names a path that cannot be the report folder."""


def default_out(bench: str) -> str:
    return f"runs/bench-{bench}"


def add_out_argument(parser: argparse.ArgumentParser | Any, bench: str) -> None:
    """`--out DIR` (default runs/bench-<bench>) on a bench's parser or argument group."""
    parser.add_argument(
        "--out", default=default_out(bench), metavar="DIR",
        help=f"folder the report is written into ({bench}.json, {bench}.md, ...); created if "
        "missing (default: %(default)s)",
    )


def out_folder(path: str | os.PathLike[str]) -> Path:
    """The report folder, created if missing; an OutFolderError (naming the path and why) when
    it is an existing file, lies under one, or cannot be created or written."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise OutFolderError(f"--out {out}: is a file; --out names the folder the report goes in")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a parent is a file
        raise OutFolderError(f"--out {out}: a parent of it is a file, not a folder") from None
    except NotADirectoryError:
        raise OutFolderError(f"--out {out}: a parent of it is a file, not a folder") from None
    except OSError as e:
        raise OutFolderError(f"--out {out}: cannot create the folder ({e.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise OutFolderError(f"--out {out}: the folder is not writable")
    return out


def write_report(out: Path, bench: str, result: Any, table: str | None = None) -> list[Path]:
    """Write OUT/<bench>.json (and OUT/<bench>.md when there is a table); say so on stderr (stdout
    stays the table or the `--json` the command prints)."""
    written = []
    if table is not None:
        written.append(out / f"{bench}.md")
        written[-1].write_text(table + "\n")
    written.append(out / f"{bench}.json")
    written[-1].write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {', '.join(map(str, written))}", file=sys.stderr)
    return written
