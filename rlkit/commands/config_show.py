"""`rlkit config show RECIPE [key.path=value ...]`: print the resolved, validated recipe, each
key marked with where its value came from: `written: FILE` (or `command line`), `alias of OLD:
FILE` (written under a moved key), `default` or `derived` (computed from other keys)."""

from __future__ import annotations

import argparse


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """The recipe file and overrides, shared by every command that loads a recipe."""
    parser.add_argument("recipe", nargs="?", help="YAML recipe (defaults only when omitted)")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="overrides")


def split_recipe_args(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """`rlkit x a=b` has no recipe file: a first positional with '=' is an override."""
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe and not recipe.endswith((".yaml", ".yml")):
        overrides.insert(0, recipe)
        recipe = None
    return recipe, overrides


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser)
    parser.add_argument("--no-defaults", action="store_true",
                        help="leave out the keys at their default: what was written or derived")
    parser.add_argument("--plain", action="store_true",
                        help="the resolved recipe as plain YAML, without the marks")


def run(args: argparse.Namespace) -> int:
    from rlkit.config import dump_recipe
    from rlkit.config.loader import load_with_sources
    from rlkit.config.provenance import annotated_dump

    recipe_path, overrides = split_recipe_args(args)
    recipe, sources = load_with_sources(recipe_path, overrides)
    if args.plain:
        print(dump_recipe(recipe), end="")
    else:
        print(annotated_dump(recipe, sources, defaults=not args.no_defaults), end="")
    return 0
