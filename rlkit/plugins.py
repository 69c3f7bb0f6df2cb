"""One rule for finding every kind of plugin (rewards, group filters, length rankers,
environments, generators): a built-in name, an entry point in the kind's group (so `pip install
my-package` is all a user does), or a dotted path `pkg.module:attr` (or `pkg.module.attr`).
`PLUGIN_KINDS` is the one list of kinds."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Callable

from rlkit.common.errors import UserError

if TYPE_CHECKING:
    from rlkit.rollout.config import EpisodeConfig, FilterConfig, RankerConfig, SamplingConfig
    from rlkit.rollout.episodes import EpisodeRunner
    from rlkit.rollout.filters import GroupFilter
    from rlkit.rollout.rankers import LengthRanker


class PluginNotFound(UserError, LookupError):
    """A plugin name that resolves to nothing usable; the message says what was tried."""


@dataclass(frozen=True)
class PluginKind:
    name: str  # as messages name it: "reward"
    group: str  # entry point group
    builtins: Callable[[], dict[str, Any]]  # lazily: built-ins may import heavy libraries


def _reward_builtins() -> dict[str, Any]:
    from rlkit.rewards import builtin, judge

    return {"math": builtin.math_reward, "exact_match": builtin.exact_match,
            "format": builtin.boxed_format, "judge": judge.judge}


def _filter_builtins() -> dict[str, Any]:
    from rlkit.rollout.filters import builtin_filters

    return builtin_filters()


def _ranker_builtins() -> dict[str, Any]:
    from rlkit.rollout.rankers import builtin_rankers

    return builtin_rankers()


def _environment_builtins() -> dict[str, Any]:
    from rlkit.rollout.environments.calculator import calculator
    from rlkit.rollout.environments.guess_number import guess_number

    return {"calculator": calculator, "guess_number": guess_number}


def _generator_builtins() -> dict[str, Any]:
    from rlkit.rollout.episodes import GENERATOR_BUILTINS

    return dict(GENERATOR_BUILTINS)


PLUGIN_KINDS: dict[str, PluginKind] = {
    k.name: k
    for k in (
        PluginKind("reward", "rlkit.rewards", _reward_builtins),
        PluginKind("filter", "rlkit.filters", _filter_builtins),
        PluginKind("ranker", "rlkit.rankers", _ranker_builtins),  # factories: fn(**kwargs)
        # factories: fn(EpisodePrompt, **kwargs) -> Environment (rollout/environments/protocol.py)
        PluginKind("environment", "rlkit.environments", _environment_builtins),
        # async fn(EpisodeContext): one episode (rlkit/rollout/episodes.py)
        PluginKind("generator", "rlkit.generators", _generator_builtins),
    )
}


def resolve_plugin(kind: str | PluginKind, name: str) -> Callable[..., Any]:
    """A built-in name, an entry point name in the kind's group, or a dotted path."""
    k = PLUGIN_KINDS[kind] if isinstance(kind, str) else kind
    builtins = k.builtins()
    if name in builtins:
        return builtins[name]
    eps = {ep.name: ep for ep in entry_points(group=k.group)}
    if name in eps:
        try:
            fn = eps[name].load()
        except Exception as e:
            raise PluginNotFound(
                f"{k.name} {name!r}: entry point {eps[name].value!r} failed to load: "
                f"{type(e).__name__}: {e}"
            ) from None
        return _callable(k, fn, f"entry point {name!r} ({eps[name].value})")
    if ":" in name or "." in name:
        module, _, attr = name.partition(":") if ":" in name else name.rpartition(".")
        try:
            mod = importlib.import_module(module)
        except (ImportError, TypeError, ValueError) as e:  # also '.mod' and ':fn' (no module)
            raise PluginNotFound(f"{k.name} {name!r}: cannot import module {module!r} ({e})") from None
        if not hasattr(mod, attr):
            raise PluginNotFound(f"{k.name} {name!r}: module {module!r} has no attribute {attr!r}")
        return _callable(k, getattr(mod, attr), repr(name))
    raise PluginNotFound(
        f"{k.name} {name!r} not found: not a built-in ({', '.join(builtins)}), no entry point of "
        f"that name in group {k.group!r} (installed: {', '.join(sorted(eps)) or 'none'}), and "
        "not a dotted path 'pkg.module:function'"
    )


def _callable(kind: PluginKind, fn: Any, where: str) -> Callable[..., Any]:
    if not callable(fn):
        raise PluginNotFound(f"{kind.name} {where} is a {type(fn).__name__}, not a function")
    return fn


def signature_problem(fn: Callable[..., Any]) -> str | None:
    """Why `fn` cannot be called as fn(x, **kwargs), or None."""
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


def checked_plugin(kind: str, name: str, call: str) -> Callable[..., Any]:
    """A plugin resolved and checked callable as `call`, fn(x, **kwargs) (rewards, filters)."""
    fn = resolve_plugin(kind, name)
    problem = signature_problem(fn)
    if problem:
        raise PluginNotFound(f"{kind} {name!r} cannot be called as {call}: {problem}")
    return fn


def load_group_filter(cfg: "FilterConfig") -> "GroupFilter | None":
    """The recipe's group filter (rollout.filter), resolved and checked, or None."""
    from rlkit.rollout.filters import GroupFilter

    if cfg.name is None:
        return None
    fn = checked_plugin("filter", cfg.name, "fn(group, **kwargs)")
    return GroupFilter(fn, cfg.name, dict(cfg.kwargs), cfg.max_filtered_ratio)


def load_ranker(cfg: "RankerConfig", **extra: Any) -> "LengthRanker | None":
    """The recipe's length ranker (rollout.ranker): its factory called with the recipe's
    kwargs (and `extra`, e.g. a benchmark's trace for the oracle), or None when off."""
    from rlkit.rollout.rankers import LengthRanker

    if cfg.name is None:
        return None
    factory = resolve_plugin("ranker", cfg.name)
    try:
        ranker = factory(**{**cfg.kwargs, **extra})
    except TypeError as e:
        raise PluginNotFound(f"ranker {cfg.name!r}: cannot be built with kwargs "
                             f"{sorted({**cfg.kwargs, **extra})}: {e}") from None
    if not isinstance(ranker, LengthRanker):
        raise PluginNotFound(f"ranker {cfg.name!r} built a {type(ranker).__name__}, which lacks "
                             "predict / observe / state_dict / load_state_dict")
    return ranker


def environment_factory(cfg: "EpisodeConfig") -> Callable[..., Any]:
    """The recipe's environment factory, resolved, its signature checked against
    rollout.episode.env_kwargs: a misspelt argument fails here, naming the key, not in the
    first episode of the first step."""
    make_env = resolve_plugin("environment", cfg.environment or "")
    try:
        sig = inspect.signature(make_env)
    except (TypeError, ValueError):
        return make_env  # no signature to check (a C function): its first episode will say
    try:
        sig.bind(None, **cfg.env_kwargs)  # None: the EpisodePrompt each episode passes
    except TypeError as e:
        raise PluginNotFound(f"rollout.episode.env_kwargs {dict(cfg.env_kwargs)}: environment "
                             f"{cfg.environment!r} cannot take them ({e}); its factory is "
                             f"{getattr(make_env, '__name__', make_env)}{sig}") from None
    return make_env


def check_plugins(recipe: Any) -> None:
    """Every plugin the recipe names, resolved and (where it has a signature) checked against
    its kwargs, in the driver before anything starts. The processes that use them resolve them
    again; this only moves the error to where it costs nothing."""
    r = recipe.rollout
    for reward in (r.reward, recipe.eval.reward):
        if reward is not None:
            checked_plugin("reward", reward.name, "fn(sample, **kwargs)")
    load_group_filter(r.filter)
    if r.ranker.name is not None:
        resolve_plugin("ranker", r.ranker.name)
    if r.episode.generator is not None:
        resolve_plugin("generator", r.episode.generator)
        environment_factory(r.episode)


def load_episode_runner(cfg: "EpisodeConfig", sampling: "SamplingConfig", tokenizer: Any) -> "EpisodeRunner | None":
    """The recipe's multi-turn set-up (rollout.episode) over this tokenizer, or None when off."""
    make = episode_runners(cfg, tokenizer)
    return None if make is None else make(sampling)


def episode_runners(cfg: "EpisodeConfig", tokenizer: Any
                    ) -> "Callable[[SamplingConfig], EpisodeRunner] | None":
    """Fresh episode runners of the recipe's multi-turn set-up, one per call with the sampling
    given (evaluation's passes), or None when off. The plugins are resolved here, once: an
    unknown generator or environment fails now, not at the first episode."""
    from rlkit.rollout.environments.tools import ToolRunner
    from rlkit.rollout.episodes import EpisodeRunner, TokenizerCodec

    if cfg.generator is None:
        return None
    generator = resolve_plugin("generator", cfg.generator)
    make_env = environment_factory(cfg)
    codec = TokenizerCodec(tokenizer, cfg.observation_template)

    def make(sampling: "SamplingConfig") -> EpisodeRunner:
        turn = sampling.model_copy(update={"stop": [*sampling.stop, *cfg.turn_stop]})
        return EpisodeRunner(generator, make_env, codec, turn, env_kwargs=cfg.env_kwargs,
                             tools=ToolRunner(cfg.tool_concurrency, cfg.tool_timeout_s))
    return make
