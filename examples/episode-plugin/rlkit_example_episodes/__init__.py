"""Example rlkit episode plugins, in one pip package: the `reach_target` environment
(reach_target.py) and the `hinted_turns` generator (generator.py), registered by entry points
in pyproject.toml. See README.md for the recipe keys."""

from rlkit_example_episodes.generator import hinted_turns
from rlkit_example_episodes.reach_target import ReachTargetEnv, reach_target

__all__ = ["ReachTargetEnv", "hinted_turns", "reach_target"]
