"""Bench policy specs (`name[@value][+option...]`, see rollout.policy_names) as rollout
configs."""

from __future__ import annotations

from typing import Any

from rlkit.rollout.config import RolloutConfig
from rlkit.rollout.policy_names import POLICIES, PolicySpecError, describe_specs


def policy_config(spec: str, base: "RolloutConfig | None" = None) -> "RolloutConfig":
    """The rollout config a bench spec names: `base` (default: the schema's defaults) with the
    policy and the knobs the spec sets."""
    head, *options = spec.strip().split("+")
    name, at, value = head.partition("@")
    info = POLICIES.get(name)
    if info is None:
        raise PolicySpecError(f"policy spec {spec!r}: unknown policy {name!r} (known: {describe_specs()})")
    updates: dict[str, Any] = {"policy": name}
    if at:
        if not info.arg:
            raise PolicySpecError(f"policy spec {spec!r}: {name} takes no @value")
        try:
            number = float(value)
        except ValueError:
            raise PolicySpecError(f"policy spec {spec!r}: @{value!r} is not a number") from None
        updates.update({key: number for key in info.arg})
    for opt in options:
        if opt not in info.options:
            known = ", ".join(f"+{o}" for o in info.options) or "none"
            raise PolicySpecError(f"policy spec {spec!r}: {name} has no option +{opt} ({known})")
        updates.update(info.options[opt])
    data = (base or RolloutConfig()).model_dump()
    for key, v in updates.items():
        *path, last = key.split(".")
        node = data
        for part in path:
            node = node[part]
        node[last] = v
    try:
        return RolloutConfig.model_validate(data)
    except ValueError as e:
        raise PolicySpecError(f"policy spec {spec!r}: {e}") from None
