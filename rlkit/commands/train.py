"""`rlkit train RECIPE [key.path=value ...]`: run a training job."""

from __future__ import annotations

import argparse
import sys

from rlkit.commands.config_show import add_recipe_arguments, split_recipe_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from rlkit.config import load_recipe

    recipe_path, overrides = split_recipe_args(args)
    load_recipe(recipe_path, overrides)  # validate before anything starts
    print(
        "rlkit train: the recipe is valid, but the training driver is not built yet "
        "(issue 5: end-to-end GRPO with active partial rollouts).",
        file=sys.stderr,
    )
    return 2
