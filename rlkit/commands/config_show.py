"""`rlkit config show RECIPE [key.path=value ...]`: print the resolved, validated recipe."""

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


def run(args: argparse.Namespace) -> int:
    from rlkit.config import dump_recipe, load_recipe

    recipe, overrides = split_recipe_args(args)
    print(dump_recipe(load_recipe(recipe, overrides)), end="")
    return 0
