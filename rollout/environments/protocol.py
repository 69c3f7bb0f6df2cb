"""What an environment is to rlkit: made per episode from its prompt, stepped with the model's
turns, answering with an observation (text the generator tokenizes once, with the chat
template's turn markers, and appends with loss mask 0), whether the episode is done, and
optionally a reward. Environments that can be parked in a checkpoint say so by implementing
`snapshot`/`restore` (plain JSON data); one that cannot is started again from its prompt when a
run resumes from a checkpoint (and that is counted).

    make(prompt: EpisodePrompt, **kwargs) -> Environment      # the plugin: a factory

Pure: no HTTP, Ray or torch, so it runs in tests and in the simulator unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class EpisodePrompt:
    """What an environment is made from: the prompt record's text, label and metadata."""

    text: str
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    index: int = 0  # the prompt's position in its source (seeds per-prompt randomness)
    epoch: int = 0  # the pass over the data that drew it
    slot: int = 0  # which of its group's responses this episode is (Sample.slot): a group's
    # episodes all face the same environment, so only per-response randomness (a sampled user
    # simulator, the simulator's traced episodes) reads it


@dataclass(frozen=True)
class Observation:
    """The environment's answer to one model turn."""

    text: str  # what the model reads next ("" when done with nothing to say)
    done: bool = False
    reward: float | None = None  # the episode's reward when done, if the environment gives one
    info: dict[str, Any] = field(default_factory=dict)  # e.g. {"tool": "calc", "error": ...}


@runtime_checkable
class Environment(Protocol):
    async def reset(self) -> str | None:
        """Start the episode; an optional first observation (None: the prompt is enough)."""
        ...

    async def step(self, action: str) -> Observation:
        """The model's turn (its text, as generated) -> the observation."""
        ...


@runtime_checkable
class Snapshotting(Protocol):
    """An environment whose state survives a checkpoint."""

    def snapshot(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any]) -> None: ...


class EnvironmentFactory(Protocol):
    def __call__(self, prompt: EpisodePrompt, **kwargs: Any) -> Environment: ...


def can_snapshot(env: object) -> bool:
    return isinstance(env, Snapshotting)
