"""What a reward function receives (`RewardInput`) and its signature (`RewardFn`): the contract
a reward plugin is written against. A module of its own so that the built-in rewards, which the
plugin resolver lists, need nothing that imports the resolver."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Awaitable, Protocol, Union


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
