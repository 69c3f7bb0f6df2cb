"""`rlkit prepare-model NAME`: build a demo model into the cache and print its folder."""

from __future__ import annotations

import argparse

from rlkit.rollout.demo_models import DEMO_MODELS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=DEMO_MODELS, help="which demo model to prepare")
    parser.add_argument("--force", action="store_true", help="rebuild even if already prepared")


def run(args: argparse.Namespace) -> int:
    from rlkit.rollout.demo_models import prepare_model

    print(prepare_model(args.name, force=args.force))
    return 0
