"""`rlkit config docs`: regenerate the recipe reference (docs/recipe-reference.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "docs" / "recipe-reference.md"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="output file (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")


def run(args: argparse.Namespace) -> int:
    from rlkit.config.reference import render_reference

    text = render_reference()
    out = Path(args.out)
    if args.check:
        if not out.is_file() or out.read_text() != text:
            print(f"{out} is stale: run `rlkit config docs`")
            return 1
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return 0
