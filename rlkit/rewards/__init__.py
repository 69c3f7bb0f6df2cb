"""Reward plugins.

A reward is a function `(sample, **kwargs) -> float`, sync or async. `sample` is a
`RewardInput`: the decoded prompt and response, the data set's label and metadata, token ids
and how the response ended. kwargs are the data set's metadata columns
(`data.metadata_keys`) and the recipe's `rollout.reward.kwargs`.

`rollout.reward.name` finds it as, in order: a built-in name (math, exact_match, format); an
entry point in the `rlkit.rewards` group (so `pip install my-rewards` is all a user does); a
dotted path `pkg.module:function` (or `pkg.module.function`).
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol, Union

from rlkit.plugins import PluginNotFound, resolve_plugin, signature_problem

__all__ = ["RewardFn", "RewardInput", "RewardNotFound", "call_reward", "is_async",
           "resolve_reward", "signature_problem"]


class RewardFn(Protocol):
    def __call__(self, sample: "RewardInput", **kwargs: Any) -> Union[float, Awaitable[float]]: ...


@dataclass(frozen=True)
class RewardInput:
    """What a reward function sees of one sample."""

    prompt: str
    response: str
    label: Any
    metadata: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None  # stop | length
    prompt_ids: tuple[int, ...] = ()
    response_ids: tuple[int, ...] = ()
    index: int = 0
    group_id: int = 0

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


# Raised when a reward name resolves to nothing (the one rule for every plugin kind).
RewardNotFound = PluginNotFound


def resolve_reward(name: str) -> Callable[..., Any]:
    """A built-in name, an entry point name in 'rlkit.rewards', or a dotted path."""
    return resolve_plugin("reward", name)


def call_reward(fn: Callable[..., Any]) -> Callable[[RewardInput, dict[str, Any]], Awaitable[Any]]:
    """An async caller for fn: coroutines are awaited; sync functions run in a worker thread,
    so a slow reward never blocks generation."""
    names = _keyword_names(fn)

    def kwargs_for(kwargs: dict[str, Any]) -> dict[str, Any]:
        return kwargs if names is None else {k: v for k, v in kwargs.items() if k in names}

    if is_async(fn):
        async def call_async(sample: RewardInput, kwargs: dict[str, Any]) -> Any:
            return await fn(sample, **kwargs_for(kwargs))

        return call_async

    async def call_sync(sample: RewardInput, kwargs: dict[str, Any]) -> Any:
        result = await asyncio.to_thread(fn, sample, **kwargs_for(kwargs))
        if inspect.isawaitable(result):
            result = await result
        return result

    return call_sync


def is_async(fn: Callable[..., Any]) -> bool:
    """A coroutine function, or an object whose __call__ is one: awaited, not run in a thread."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _keyword_names(fn: Callable[..., Any]) -> set[str] | None:
    """The keyword arguments fn takes after the sample; None when it takes any (**kwargs, or a
    signature inspect cannot read)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
