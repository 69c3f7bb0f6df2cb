"""The one list of rollout policies: the recipe schema, `make_policy`, `rlkit bench rollout` and
`rlkit bench suite` all read it, and the recipe's "off-policy correction required" rule asks
each entry whether its tokens can be off-policy.

Imports nothing from rollout.manager or rollout.config at import time (rollout.config reads the
names from here; the policies take the config and the Step only as arguments).

Bench specs name a policy with its knobs: `name[@value][+option...]`, e.g. `partial@1.5`
(over-provision 1.5), `tail_batching@1.5` (eta 1.5 for prompts and responses),
`tail_batching+resume`, `ranked_dispatch+partial+oracle`, `partial+adaptive+history`.
`rollout.policies.specs.policy_config(spec)` turns one into a RolloutConfig (it needs
rollout.config, which reads this module: so it lives apart).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from rlkit.rollout.policies.partial import PartialPolicy
from rlkit.rollout.policies.ranked_dispatch import RankedDispatchPolicy
from rlkit.rollout.policies.sync import SyncPolicy
from rlkit.rollout.policies.tail_batching import TailBatchingPolicy

if TYPE_CHECKING:
    from rlkit.rollout.config import RolloutConfig
    from rlkit.rollout.dispatch import EngineModel
    from rlkit.rollout.manager import RolloutPolicy


@dataclass(frozen=True)
class PolicyInfo:
    name: str
    summary: str
    build: Callable[["RolloutConfig"], "RolloutPolicy"]
    # Why the policy's batches can hold tokens from older policy versions, or None: the recipe
    # then requires an explicit train.algorithm.off_policy_correction.
    off_policy: Callable[["RolloutConfig"], str | None] = lambda cfg: None
    arg: tuple[str, ...] = ()  # recipe keys (under rollout.) a bench spec's "@value" sets
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # "+option" -> keys


# "+ranker" options any policy spec takes (rollout.ranker.name); the oracle's trace comes from
# the benchmark that builds the ranker.
RANKER_OPTIONS = {name: {"ranker.name": name}
                  for name in ("history", "learned", "prompt_length", "oracle")}


def engine_model(cfg: "RolloutConfig") -> "EngineModel":
    """The capacity and latency model dispatch and adaptive sizing plan with: slots per engine,
    KV capacity, and the per-token latency of rollout.dispatch.profile (if set)."""
    from rlkit.rollout.dispatch import EngineModel

    slots = cfg.dispatch.slots_per_engine or cfg.engine.max_running_requests
    kv, ptl = cfg.engine.max_total_tokens, None
    if cfg.dispatch.profile is not None:
        from rlkit.rollout.sim.profile import load_profile

        profile = load_profile(cfg.dispatch.profile)
        ptl = profile.ptl
        kv = kv or profile.kv_capacity_tokens
    return EngineModel(slots=slots, kv_tokens=kv, ptl=ptl)


def _partial(cfg: "RolloutConfig") -> PartialPolicy:
    a = cfg.adaptive_over_provision
    if not a.enabled:
        return PartialPolicy(over_provision=cfg.over_provision)
    from rlkit.rollout.dispatch import InFlightSizer

    return PartialPolicy(over_provision=cfg.over_provision,
                         sizer=InFlightSizer(engine_model(cfg), a.utilization),
                         min_factor=a.min, max_factor=a.max)


def _ranked(cfg: "RolloutConfig") -> RankedDispatchPolicy:
    from rlkit.rollout.dispatch import Dispatcher

    partial = cfg.ranked_dispatch.base == "partial"
    d = cfg.dispatch
    # The fluid model predicts when everything finishes (a sync step); a partial step ends at
    # its target and parks the rest, so under partial it places and orders only.
    return RankedDispatchPolicy(
        _partial(cfg) if partial else SyncPolicy(),
        Dispatcher(engine_model(cfg), alpha=d.alpha, objective=d.objective,
                   cost_model=d.cost_model, min_recall=d.min_recall, split=not partial))


def _tail_off_policy(cfg: "RolloutConfig") -> str | None:
    if cfg.tail_batching.deferred == "resume":
        return ("rollout.tail_batching.deferred=resume continues deferred responses across "
                "policy versions")
    return None


POLICIES: dict[str, PolicyInfo] = {
    p.name: p
    for p in (
        PolicyInfo(
            "sync", "launch exactly batch_size groups and wait for every one",
            build=lambda cfg: SyncPolicy(),
        ),
        PolicyInfo(
            "partial", "APRIL: over-provision, abort at batch_size complete, resume the rest first",
            build=_partial,
            off_policy=lambda cfg: "rollout.policy=partial resumes responses across policy versions",
            arg=("over_provision",),
            options={"adaptive": {"adaptive_over_provision.enabled": True}, **RANKER_OPTIONS},
        ),
        PolicyInfo(
            "tail_batching",
            "Flexes/RollPacker: speculative short rounds defer unfinished prompts to long rounds",
            build=lambda cfg: TailBatchingPolicy.from_config(cfg),
            off_policy=_tail_off_policy,
            arg=("tail_batching.eta_prompts", "tail_batching.eta_responses"),
            options={"resume": {"tail_batching.deferred": "resume"},
                     "proactive": {"tail_batching.proactive": True}, **RANKER_OPTIONS},
        ),
        PolicyInfo(
            "ranked_dispatch",
            "StreamRL: sync or partial, each group placed by predicted length (long tail on its "
            "own engines) and admitted longest first",
            build=_ranked,
            off_policy=lambda cfg: (
                "rollout.ranked_dispatch.base=partial resumes responses across policy versions"
                if cfg.ranked_dispatch.base == "partial" else None),
            arg=("over_provision",),
            options={"partial": {"ranked_dispatch.base": "partial"},
                     "streamrl": {"dispatch.cost_model": "streamrl"},
                     "sum": {"dispatch.cost_model": "streamrl", "dispatch.objective": "sum"},
                     "adaptive": {"ranked_dispatch.base": "partial",
                                  "adaptive_over_provision.enabled": True},
                     **RANKER_OPTIONS},
        ),
    )
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


class PolicySpecError(ValueError):
    """A bench policy spec that names no policy, or a knob the policy does not have."""


def describe_specs() -> str:
    """One line per policy, for --help texts."""
    out = []
    for p in POLICIES.values():
        extra = "".join(
            [f" [@{'/'.join(a.split('.')[-1] for a in p.arg)}]" if p.arg else ""]
            + [f" [+{o}]" for o in p.options]
        )
        out.append(f"{p.name}{extra}: {p.summary}")
    return "; ".join(out)
