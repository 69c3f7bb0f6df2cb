"""Compatibility alias: the demo models live in `rollout.demo_models`, a library module, which
code outside the CLI layer must import instead (`rollout`, `train` and `buffers` never import
`rlkit`). Kept so scripts that import `rlkit.demo_models` keep working."""

from rlkit.rollout.demo_models import *  # noqa: F401,F403
