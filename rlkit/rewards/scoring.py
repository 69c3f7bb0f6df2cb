"""Turn the recipe's reward section into the manager's ScoreFn (sample, group) -> float."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from rlkit.buffers.group import Group
from rlkit.buffers.sample import Sample
from rlkit.plugins import checked_plugin
from rlkit.rewards import RewardInput, RewardNotFound, call_reward, make_runner
from rlkit.rollout.config import RewardConfig
from rlkit.rollout.reward_scheduler import ScoreFn

Decode = Callable[[Sequence[int]], str]


def load_reward(name: str) -> Callable[..., object]:
    return checked_plugin("reward", name, "fn(sample, **kwargs)")


def reward_input(sample: Sample, group: Group, decode: Decode) -> RewardInput:
    return RewardInput(
        prompt=group.prompt.text,
        response=decode(sample.response_ids),
        label=group.prompt.label,
        metadata=dict(group.prompt.metadata),
        finish_reason=sample.finish_reason,
        prompt_ids=tuple(sample.prompt_ids),
        response_ids=tuple(sample.response_ids),
        index=sample.index,
        group_id=group.group_id,
    )


def tokenizer_decode(tokenizer: Any) -> Decode:
    """What a reward reads as the response: the tokens as text, special tokens left out."""
    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=True)

    return decode


def make_score_fn(cfg: RewardConfig, decode: Decode, key: str = "rollout.reward") -> ScoreFn:
    """`key`: the recipe section `cfg` came from, named in errors (eval.reward for evaluation)."""
    try:
        fn = load_reward(cfg.name)
    except RewardNotFound as e:
        raise RewardNotFound(f"{key}.name: {e}") from None
    try:
        call = call_reward(fn, make_runner(cfg.isolation, cfg.workers, cfg.max_stuck))
    except ValueError as e:  # a sync function process isolation cannot import by name
        raise RewardNotFound(f"{key}.name={cfg.name!r}: {e}") from None

    async def score(sample: Sample, group: Group) -> float:
        kwargs = {**group.prompt.metadata, **cfg.kwargs}
        return await call(reward_input(sample, group, decode), kwargs)  # type: ignore[return-value]

    return score
