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
import importlib
import inspect
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Awaitable, Callable, Protocol, Union

ENTRY_POINT_GROUP = "rlkit.rewards"


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


class RewardNotFound(LookupError):
    pass


def builtin_rewards() -> dict[str, Callable[..., Any]]:
    from rlkit.rewards import builtin

    return {"math": builtin.math_reward, "exact_match": builtin.exact_match, "format": builtin.boxed_format}


def resolve_reward(name: str) -> Callable[..., Any]:
    """A built-in name, an entry point name in 'rlkit.rewards', or a dotted path."""
    builtins = builtin_rewards()
    if name in builtins:
        return builtins[name]
    eps = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if name in eps:
        try:
            fn = eps[name].load()
        except Exception as e:
            raise RewardNotFound(
                f"reward {name!r}: entry point {eps[name].value!r} failed to load: "
                f"{type(e).__name__}: {e}"
            ) from None
        return _callable(fn, f"entry point {name!r} ({eps[name].value})")
    if ":" in name or "." in name:
        module, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
        try:
            mod = importlib.import_module(module)
        except (ImportError, TypeError, ValueError) as e:  # also '.mod' and ':fn' (no module)
            raise RewardNotFound(f"reward {name!r}: cannot import module {module!r} ({e})") from None
        if not hasattr(mod, attr):
            raise RewardNotFound(f"reward {name!r}: module {module!r} has no attribute {attr!r}")
        return _callable(getattr(mod, attr), name)
    raise RewardNotFound(
        f"reward {name!r} not found: not a built-in ({', '.join(builtins)}), no entry point of "
        f"that name in group {ENTRY_POINT_GROUP!r} (installed: "
        f"{', '.join(sorted(eps)) or 'none'}), and not a dotted path 'pkg.module:function'"
    )


def _callable(fn: Any, where: str) -> Callable[..., Any]:
    if not callable(fn):
        raise RewardNotFound(f"reward {where} is a {type(fn).__name__}, not a function")
    return fn


def signature_problem(fn: Callable[..., Any]) -> str | None:
    """Why `fn` cannot be called as fn(sample, **kwargs), or None."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # builtins and C functions: trust them
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional and not any(p.kind is p.VAR_POSITIONAL for p in params):
        return "it takes no positional argument for the sample"
    required = [p for p in positional[1:] if p.default is p.empty]
    if required:
        return f"it requires more than one positional argument ({', '.join(p.name for p in required)})"
    return None


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
