"""`rlkit train RECIPE [key.path=value ...]`: run a training job."""

from __future__ import annotations

import argparse
import sys

from rlkit.commands.config_show import add_recipe_arguments, split_recipe_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from rlkit.config import load_recipe
    from rlkit.driver.lifecycle import run_dir_of
    from rlkit.driver.run import train

    recipe_path, overrides = split_recipe_args(args)
    recipe = load_recipe(recipe_path, overrides)  # validate before anything starts
    state = train(recipe)  # errors a user can fix are reported by rlkit.cli.main
    print(f"rlkit train: {state.step} steps done, policy version {state.version}; "
          f"outputs in {run_dir_of(recipe)}", file=sys.stderr)
    return 0

