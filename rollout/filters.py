"""Group filters (dynamic sampling, DAPO): decide whether a complete, rewarded group is trained.

A filter is a plugin `(group: FilterInput, **kwargs) -> bool | str`: True keeps the group;
False, or a non-empty string naming the reason, filters it out. rlkit resolves it by name
(built-in, `rlkit.filters` entry point, or dotted path: the rule every plugin kind follows);
the manager only sees the `GroupFilter` built from it here.

A filtered group does not count toward the step's target, so the policy launches another in
its place; it is dropped with reason `filtered:<reason>` and its tokens are counted; it never
goes back to a queue (a zero-variance prompt is not a long prompt). Filters run in the
rollout's event loop, once per complete group: keep them cheap and synchronous.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from rlkit.common.errors import UserError
from rlkit.buffers.group import Group


class FilterFailure(UserError, RuntimeError):
    """The filter raised or returned something that is neither a bool nor a reason string."""


@dataclass(frozen=True)
class FilterInput:
    """What a filter sees of a complete group: its kept samples (the first n to finish)."""

    group_id: int
    prompt: str
    label: Any
    metadata: dict[str, Any]
    rewards: tuple[float, ...]
    response_lengths: tuple[int, ...]
    finish_reasons: tuple[str | None, ...]


def filter_input(group: Group) -> FilterInput:
    kept = group.first_finished()
    return FilterInput(
        group_id=group.group_id,
        prompt=group.prompt.text,
        label=group.prompt.label,
        metadata=dict(group.prompt.metadata),
        rewards=tuple(float(s.reward) for s in kept if s.reward is not None),
        response_lengths=tuple(len(s.response_ids) for s in kept),
        finish_reasons=tuple(s.finish_reason for s in kept),
    )


def zero_variance(group: FilterInput, *, tolerance: float = 0.0) -> bool | str:
    """DAPO's dynamic-sampling filter: a group whose rewards are all equal has zero advantage
    under GRPO and teaches nothing; filter it out ('all_equal')."""
    r = group.rewards
    if len(r) >= 2 and max(r) - min(r) <= tolerance:
        return "all_equal"
    return True


def builtin_filters() -> dict[str, Callable[..., Any]]:
    return {"zero_variance": zero_variance}


@dataclass
class GroupFilter:
    """A resolved filter plugin with its recipe kwargs, as the manager applies it.

    `max_filtered_ratio`: once a step has filtered `ratio x target` groups, the filter stands
    down for the rest of that step (counted as `exhausted`), so a run whose every group is
    filtered (all prompts solved, say) slows down but never samples forever."""

    fn: Callable[..., Any]
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    max_filtered_ratio: float = 10.0

    def limit(self, target: int) -> int:
        return max(1, math.ceil(self.max_filtered_ratio * target))

    def reason(self, group: Group) -> str | None:
        """None to keep the group, else why it is filtered out. Raises FilterFailure."""
        try:
            verdict = self.fn(filter_input(group), **self.kwargs)
        except Exception as e:  # a user plugin: name it and the group, stop the step loudly
            raise FilterFailure(
                f"filter {self.name!r} raised on group {group.group_id}: {type(e).__name__}: {e}"
            ) from e
        if verdict is True:
            return None
        if verdict is False:
            return self.name
        if isinstance(verdict, str) and verdict:
            return verdict
        raise FilterFailure(
            f"filter {self.name!r} returned {verdict!r} for group {group.group_id}; expected True "
            "(keep), False or a non-empty reason string (filter out)"
        )
