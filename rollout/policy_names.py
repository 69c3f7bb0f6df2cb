"""The one list of rollout policies, as data: names, one-line summaries, each policy's declared
off-policy rule, and the knobs a bench spec may set. No code of any policy is imported here: the
recipe schema (`rollout.config`), the builders (`rollout.policies.registry`) and the benches all
read this module.

A bench spec names a policy with its knobs: `name[@value][+option...]`, e.g. `partial@1.5`
(over-provision 1.5), `tail_batching@1.5` (eta 1.5 for prompts and responses),
`tail_batching+resume`, `ranked_dispatch+partial+oracle`, `partial+adaptive+history`
(`rollout.policies.specs.policy_config` turns one into a RolloutConfig).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class OffPolicy:
    """A policy's batches can hold tokens of older policy versions (the recipe then requires an
    explicit train.algorithm.off_policy_correction) when every `when` key (a path under
    `rollout.`) has its value; an empty `when` means always."""

    reason: str
    when: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicyDecl:
    name: str
    summary: str
    off_policy: OffPolicy | None = None
    arg: tuple[str, ...] = ()  # recipe keys (under rollout.) a bench spec's "@value" sets
    options: dict[str, dict[str, Any]] = field(default_factory=dict)  # "+option" -> keys


# "+ranker" options any policy spec takes (rollout.ranker.name); the oracle's trace comes from
# the benchmark that builds the ranker.
RANKER_OPTIONS = {name: {"ranker.name": name}
                  for name in ("history", "learned", "prompt_length", "oracle")}

POLICIES: dict[str, PolicyDecl] = {
    p.name: p
    for p in (
        PolicyDecl("sync", "launch exactly batch_size groups and wait for every one"),
        PolicyDecl(
            "partial", "APRIL: over-provision, abort at batch_size complete, resume the rest first",
            off_policy=OffPolicy("rollout.policy=partial resumes responses across policy versions"),
            arg=("partial.over_provision",),
            options={"adaptive": {"partial.adaptive.enabled": True}, **RANKER_OPTIONS},
        ),
        PolicyDecl(
            "tail_batching",
            "Flexes/RollPacker: speculative short rounds defer unfinished prompts to long rounds",
            off_policy=OffPolicy("rollout.tail_batching.deferred=resume continues deferred "
                                 "responses across policy versions",
                                 when={"tail_batching.deferred": "resume"}),
            arg=("tail_batching.eta_prompts", "tail_batching.eta_responses"),
            options={"resume": {"tail_batching.deferred": "resume"},
                     "proactive": {"tail_batching.proactive": True},
                     "fixed": {"tail_batching.adaptive": False}, **RANKER_OPTIONS},
        ),
        PolicyDecl(
            "ranked_dispatch",
            "StreamRL: sync or partial, each group placed by predicted length (long tail on its "
            "own engines) and admitted longest first",
            off_policy=OffPolicy("rollout.ranked_dispatch.base=partial resumes responses across "
                                 "policy versions", when={"ranked_dispatch.base": "partial"}),
            arg=("partial.over_provision",),
            options={"partial": {"ranked_dispatch.base": "partial"},
                     "streamrl": {"ranked_dispatch.cost_model": "streamrl"},
                     "sum": {"ranked_dispatch.cost_model": "streamrl",
                             "ranked_dispatch.objective": "sum"},
                     "adaptive": {"ranked_dispatch.base": "partial",
                                  "partial.adaptive.enabled": True},
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
