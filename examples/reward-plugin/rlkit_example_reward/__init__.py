"""Example rlkit plugins: a reward and a group filter, in one pip package.

A reward is `fn(sample, **kwargs) -> float` (sync or async). `sample` has `.prompt`,
`.response`, `.label`, `.metadata`, `.finish_reason`, `.truncated`; kwargs are the recipe's
`rollout.reward.kwargs` and the data set's metadata columns.

A group filter (dynamic sampling) is `fn(group, **kwargs) -> bool | str`: True keeps a complete
group, False or a reason string filters it out. `group` has `.rewards`, `.response_lengths`,
`.finish_reasons`, `.prompt`, `.label`, `.metadata`; kwargs are `rollout.filter.kwargs`.
"""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def concise_math(sample, *, max_chars: int = 200, **_) -> float:
    """1.0 for the right \\boxed{} answer in at most max_chars characters, less beyond that;
    0.0 for a wrong, missing or truncated answer."""
    answers = _BOXED.findall(sample.response)
    if sample.truncated or not answers or answers[-1].strip() != str(sample.label).strip():
        return 0.0
    overflow = max(0, len(sample.response) - max_chars)
    return max(0.1, 1.0 - overflow / max(1, max_chars))


def min_spread(group, *, spread: float = 0.5, **_) -> bool | str:
    """Keep groups whose rewards differ by at least `spread` (a stricter DAPO filter)."""
    if max(group.rewards) - min(group.rewards) < spread:
        return "narrow"
    return True
