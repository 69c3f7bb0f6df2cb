"""Reward plugins.

A reward is a function `(sample, **kwargs) -> float`, sync or async. `sample` is a
`RewardInput`: the decoded prompt and response, the data set's label and metadata, token ids
and how the response ended. kwargs are the data set's metadata columns
(`data.metadata_keys`) and the recipe's `rollout.reward.kwargs`.

`rollout.reward.name` finds it as, in order: a built-in name (math, exact_match, format, judge); an
entry point in the `rlkit.rewards` group (so `pip install my-rewards` is all a user does); a
dotted path `pkg.module:function` (or `pkg.module.function`).

Sync functions run in worker processes by default (`rollout.reward.isolation`), so they must be
importable by name (module level); see rlkit.rewards.worker for why and for the thread option.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from rlkit.plugins import PluginNotFound, resolve_plugin, signature_problem
from rlkit.rewards.input import RewardFn, RewardInput

if TYPE_CHECKING:
    from rlkit.rewards.worker import ProcessRewardRunner, ThreadRewardRunner

__all__ = ["RewardFn", "RewardInput", "RewardNotFound", "call_reward", "engine_group", "is_async",
           "make_runner", "resolve_reward", "signature_problem"]


# Raised when a reward name resolves to nothing (the one rule for every plugin kind).
RewardNotFound = PluginNotFound


def engine_group(name: str) -> Any:
    """The run's frozen engine group `name` (rollout.frozen_engines), for an async reward: its
    `generate_text(prompt, ...)` and `score(ids, start, temperature=...)` go through the
    group's limits and retries (rlkit.rollout.http.frozen_groups.FrozenGroup)."""
    from rlkit.rollout.http.frozen_groups import engine_group as find

    return find(name)


def resolve_reward(name: str) -> Callable[..., Any]:
    """A built-in name, an entry point name in 'rlkit.rewards', or a dotted path."""
    return resolve_plugin("reward", name)


def call_reward(
    fn: Callable[..., Any], runner: "ProcessRewardRunner | ThreadRewardRunner | None" = None
) -> Callable[[RewardInput, dict[str, Any]], Awaitable[Any]]:
    """An async caller for fn: coroutines are awaited on the loop; sync functions run on
    `runner` (default: a ProcessRewardRunner with 4 workers), never on the loop's default
    executor, so a sync reward that never returns can be stopped (process) or at least cannot
    starve other work or block exit (thread). See rlkit.rewards.worker."""
    from rlkit.rewards.worker import ProcessRewardRunner, picklable_reference

    names = _keyword_names(fn)

    def kwargs_for(kwargs: dict[str, Any]) -> dict[str, Any]:
        return kwargs if names is None else {k: v for k, v in kwargs.items() if k in names}

    if is_async(fn):
        async def call_async(sample: RewardInput, kwargs: dict[str, Any]) -> Any:
            return await fn(sample, **kwargs_for(kwargs))

        return call_async

    runner = ProcessRewardRunner() if runner is None else runner
    if isinstance(runner, ProcessRewardRunner):
        fn_bytes = picklable_reference(fn)  # fails here, at load, not on the first sample

        async def call_in_process(sample: RewardInput, kwargs: dict[str, Any]) -> Any:
            return await runner.run(fn_bytes, sample, kwargs_for(kwargs))

        call_in_process.runner = runner  # type: ignore[attr-defined]
        return call_in_process

    async def call_in_thread(sample: RewardInput, kwargs: dict[str, Any]) -> Any:
        result = await runner.run(fn, sample, kwargs_for(kwargs))
        if inspect.isawaitable(result):
            result = await result
        return result

    call_in_thread.runner = runner  # type: ignore[attr-defined]
    return call_in_thread


def make_runner(isolation: str, workers: int = 4, max_stuck: int = 8) -> "ProcessRewardRunner | ThreadRewardRunner":
    """The runner for sync rewards named by rollout.reward.isolation (process | thread)."""
    from rlkit.rewards.worker import ProcessRewardRunner, ThreadRewardRunner

    if isolation == "process":
        return ProcessRewardRunner(workers)
    if isolation == "thread":
        return ThreadRewardRunner(workers, max_stuck)
    raise ValueError(f"reward isolation must be 'process' or 'thread', got {isolation!r}")


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
