"""Scheduling policies: what to launch, where, and when a rollout step is over.

Each policy is a short loop over a `Step` (rollout.manager): `launch` groups taken from the
buffer, `next_event` to wait, `stop` to abort and park what is unfinished. Policies are pure
scheduling logic: no HTTP, Ray or torch; the same code runs on real and simulated engines.
"""

from __future__ import annotations

from rollout.config import AVAILABLE_POLICIES, RolloutConfig
from rollout.manager import RolloutPolicy
from rollout.policies.partial import PartialPolicy
from rollout.policies.sync import SyncPolicy

def make_policy(cfg: RolloutConfig) -> RolloutPolicy:
    if cfg.policy == "sync":
        return SyncPolicy()
    if cfg.policy == "partial":
        return PartialPolicy(over_provision=cfg.over_provision)
    raise ValueError(
        f"rollout.policy={cfg.policy!r} is not available yet "
        f"(available: {', '.join(AVAILABLE_POLICIES)})"
    )


__all__ = ["PartialPolicy", "SyncPolicy", "make_policy"]
