"""`rlkit train RECIPE [key.path=value ...]`: run a training job."""

from __future__ import annotations

import argparse
import sys

from rlkit.commands.config_show import add_recipe_arguments, split_recipe_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_recipe_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from rlkit.config import load_recipe
    from rlkit.driver.run import run_dir_of, train

    recipe_path, overrides = split_recipe_args(args)
    recipe = load_recipe(recipe_path, overrides)  # validate before anything starts
    try:
        state = train(recipe)
    except Exception as e:
        # Bad input (data, model, reward, checkpoint) or a piece that would not start: the
        # message names what and where; a traceback (through Ray's wrapper) adds nothing.
        cause = getattr(e, "cause", None) or e  # a RayTaskError carries the actor's error
        if isinstance(cause, _reported_errors()):
            print(f"rlkit: {cause}", file=sys.stderr)
            return 2
        raise
    print(f"rlkit train: {state.step} steps done, policy version {state.version}; "
          f"outputs in {run_dir_of(recipe)}", file=sys.stderr)
    return 0


def _reported_errors() -> tuple[type[BaseException], ...]:
    from buffers.buffer import BufferStateError
    from rlkit.checkpoint import CheckpointError
    from rlkit.data.prompts import DataError
    from rlkit.demo_models import DemoModelError
    from rlkit.plugins import PluginNotFound
    from rollout.filters import FilterFailure
    from rollout.engines.process import ProcessStartError
    from rollout.engines.sglang_launcher import SGLangNotInstalled
    from rollout.router import RouterError
    from train.hf_arch import UnsupportedModelError
    from train.megatron.checkpoint import CheckpointError as TrainerCheckpointError

    return (BufferStateError, CheckpointError, DataError, DemoModelError, PluginNotFound,
            FilterFailure, ProcessStartError, SGLangNotInstalled, RouterError, UnsupportedModelError,
            TrainerCheckpointError)
