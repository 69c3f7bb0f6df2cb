"""Output-length rankers (StreamRL §5.2): predict how long each group's responses will be, so
dispatch can give the long tail its own engines, order work longest first, defer predicted-long
prompts to tail batching's long queue, and size partial rollouts' over-provisioning.

A ranker is any object with this protocol; rlkit resolves `rollout.ranker.name` to a factory
called with `rollout.ranker.kwargs` (built-in name, `rlkit.rankers` entry point, or dotted path:
the rule every plugin kind follows). Pure Python: no torch, HTTP or Ray (`learned` imports
scikit-learn when it first fits).

Only the order of predictions drives dispatch and deferral; the values feed cost models, so
they are expected response lengths in tokens (the mean over a group's responses). With
multi-turn rollouts a response is an episode: its length counts model and observation tokens,
and a ranker may also predict its model turns (`TurnRanker`).
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

from rlkit.buffers.group import Group
from rlkit.rollout.rankers.lengths import group_lengths, group_turns, mean_length, mean_turns, prompt_key


@runtime_checkable
class LengthRanker(Protocol):
    name: str

    def predict(self, groups: Sequence[Group]) -> list[float]:
        """Expected mean response length of each group, in tokens."""
        ...

    def observe(self, group: Group) -> None:
        """A group finished (its kept responses' lengths are exact) or was parked (its
        responses so far are lower bounds): learn from it."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Plain data (JSON), saved with the buffer's checkpoint."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class TurnRanker(Protocol):
    """Optional, for multi-turn rollouts: a ranker that also predicts episodes' model turns
    (`history` and `learned` do). The manager reports its recall beside the length recall."""

    def predict_turns(self, groups: Sequence[Group]) -> list[float]:
        """Expected mean model turns of each group's episodes."""
        ...


def builtin_rankers() -> dict[str, Any]:
    from rlkit.rollout.rankers.basic import HistoryRanker, PromptLengthRanker
    from rlkit.rollout.rankers.learned import LearnedRanker

    return {"prompt_length": PromptLengthRanker, "history": HistoryRanker,
            "learned": LearnedRanker}


__all__ = ["LengthRanker", "TurnRanker", "builtin_rankers", "group_lengths", "group_turns",
           "mean_length", "mean_turns", "prompt_key"]
