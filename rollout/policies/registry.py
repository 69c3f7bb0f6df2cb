"""How each rollout policy is built from a RolloutConfig: `make_policy` (rollout.policies) calls
`BUILDERS[cfg.policy]`. The list of policies itself (names, summaries, off-policy rules, bench
spec knobs) is data in rollout.policy_names, which the schema reads without importing this.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from rlkit.rollout.policies.partial import PartialPolicy
from rlkit.rollout.policy_names import POLICY_NAMES
from rlkit.rollout.policies.ranked_dispatch import RankedDispatchPolicy
from rlkit.rollout.policies.sync import SyncPolicy
from rlkit.rollout.policies.tail_batching import TailBatchingPolicy

if TYPE_CHECKING:
    from rlkit.rollout.config import RolloutConfig
    from rlkit.rollout.dispatch import EngineModel
    from rlkit.rollout.manager import RolloutPolicy


def engine_model(cfg: "RolloutConfig") -> "EngineModel":
    """The capacity and latency model dispatch and adaptive sizing plan with: slots per engine,
    KV capacity, and the per-token latency of rollout.engine_model.profile (if set)."""
    from rlkit.rollout.dispatch import EngineModel

    slots = cfg.engine_model.slots_per_engine or cfg.engine.max_running_requests
    kv, ptl = cfg.engine.max_total_tokens, None
    if cfg.engine_model.profile is not None:
        from rlkit.rollout.engines.profile import load_profile

        profile = load_profile(cfg.engine_model.profile)
        ptl = profile.ptl
        kv = kv or profile.kv_capacity_tokens
    return EngineModel(slots=slots, kv_tokens=kv, ptl=ptl)


def _partial(cfg: "RolloutConfig") -> PartialPolicy:
    p = cfg.partial
    a = p.adaptive
    if not a.enabled:
        return PartialPolicy(over_provision=p.over_provision)
    from rlkit.rollout.dispatch import InFlightSizer

    return PartialPolicy(over_provision=p.over_provision,
                         sizer=InFlightSizer(engine_model(cfg), a.utilization),
                         min_factor=a.min, max_factor=a.max)


def _ranked(cfg: "RolloutConfig") -> RankedDispatchPolicy:
    from rlkit.rollout.dispatch import Dispatcher

    d = cfg.ranked_dispatch
    partial = d.base == "partial"
    # The fluid model predicts when everything finishes (a sync step); a partial step ends at
    # its target and parks the rest, so under partial it places and orders only.
    return RankedDispatchPolicy(
        _partial(cfg) if partial else SyncPolicy(),
        Dispatcher(engine_model(cfg), alpha=d.alpha, objective=d.objective,
                   cost_model=d.cost_model, min_recall=d.min_recall, split=not partial))


# How each policy is built from the recipe; the names, summaries and off-policy rules are
# rollout.policy_names' (data), and the two lists must name the same policies.
BUILDERS: dict[str, Callable[["RolloutConfig"], "RolloutPolicy"]] = {
    "sync": lambda cfg: SyncPolicy(),
    "partial": _partial,
    "tail_batching": lambda cfg: TailBatchingPolicy.from_config(cfg),
    "ranked_dispatch": _ranked,
}
assert tuple(BUILDERS) == POLICY_NAMES, "rollout.policy_names and the builders disagree"
