"""Scheduling policies: what to launch, where, and when a rollout step is over.

Each policy is a short loop over a `Step` (rollout.manager): `launch` groups taken from the
buffer, `next_event` to see what happened, `stop` to abort and park what is unfinished (each
group where the policy says). Policies are pure scheduling logic: no HTTP, Ray or torch; the
same code runs on real and simulated engines. `rollout.policy_names.POLICIES` is the one list
of them (data); `registry.BUILDERS` builds each from the recipe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlkit.rollout.policies.partial import PartialPolicy
from rlkit.rollout.policies.ranked_dispatch import RankedDispatchPolicy
from rlkit.rollout.policies.registry import BUILDERS
from rlkit.rollout.policies.sync import SyncPolicy
from rlkit.rollout.policies.tail_batching import TailBatchingPolicy
from rlkit.rollout.policy_names import POLICIES, POLICY_NAMES, PolicySpecError

if TYPE_CHECKING:
    from rlkit.rollout.config import RolloutConfig
    from rlkit.rollout.manager import RolloutPolicy


def make_policy(cfg: "RolloutConfig") -> "RolloutPolicy":
    """The policy a rollout config names (`rollout.policy` and its knobs)."""
    return BUILDERS[cfg.policy](cfg)


__all__ = [
    "POLICIES", "POLICY_NAMES", "PartialPolicy", "PolicySpecError", "RankedDispatchPolicy",
    "SyncPolicy",
    "TailBatchingPolicy", "make_policy",
]
# policy_config (bench specs -> RolloutConfig) is rollout.policies.specs: it builds a
# RolloutConfig, so importing the policies does not load the recipe schema.
