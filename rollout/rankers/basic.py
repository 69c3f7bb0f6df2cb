"""The cheap rankers: prompt length (baseline) and per-prompt history. (The oracle, which
replays a trace's true lengths for benchmarks, lives with the simulator: rlkit.sim.oracle.)"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

from rlkit.buffers.group import Group
from rlkit.rollout.rankers.lengths import group_lengths, mean_turns, prompt_key


class Stateless:
    """The learning half of the LengthRanker protocol for a ranker that learns nothing."""

    def observe(self, group: Group) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class PromptLengthRanker(Stateless):
    """Longer prompts, longer answers: the baseline every other ranker must beat."""

    name = "prompt_length"

    def predict(self, groups: Sequence[Group]) -> list[float]:
        return [float(len(g.prompt.ids)) for g in groups]


@dataclass
class HistoryRanker:
    """A per-prompt running estimate of the mean response length, from earlier epochs.

    A finished group updates its prompt's estimate (an exponential moving average with weight
    `decay` on the past, so lengths that grow with training are followed); a parked group's
    responses so far are a lower bound until it finishes. A prompt never seen is predicted at
    the median of recent groups (0 before any): mid-pack, where the mean of a long-tailed
    distribution would rank every unknown prompt among the longest. Episodes' turns
    (`predict_turns`) are estimated the same way, from the same groups.
    """

    decay: float = 0.5
    window: int = 1024
    name: str = "history"
    _estimate: dict[int, float] = field(default_factory=dict)
    _floor: dict[int, float] = field(default_factory=dict)
    _recent: deque = field(default_factory=deque)
    _turns: dict[int, float] = field(default_factory=dict)
    _recent_turns: deque = field(default_factory=deque)

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"history ranker: decay must be in [0, 1), got {self.decay}")
        self._recent = deque(self._recent, maxlen=self.window)
        self._recent_turns = deque(self._recent_turns, maxlen=self.window)

    def predict_turns(self, groups: Sequence[Group]) -> list[float]:
        """Expected mean model turns of each group's episodes."""
        fallback = statistics.median(self._recent_turns) if self._recent_turns else 1.0
        return [self._turns.get(prompt_key(g), fallback) for g in groups]

    def predict(self, groups: Sequence[Group]) -> list[float]:
        fallback = statistics.median(self._recent) if self._recent else 0.0
        out = []
        for g in groups:
            key = prompt_key(g)
            estimate = self._estimate.get(key, fallback)
            out.append(max(estimate, self._floor.get(key, 0.0)))
        return out

    def observe(self, group: Group) -> None:
        lengths, exact = group_lengths(group)
        if not lengths:
            return
        key, mean = prompt_key(group), sum(lengths) / len(lengths)
        if not exact:  # parked: at least this long
            self._floor[key] = max(self._floor.get(key, 0.0), mean)
            return
        self._floor.pop(key, None)
        self._estimate[key] = self._moved(self._estimate.get(key), mean)
        self._recent.append(mean)
        turns = mean_turns(group)
        self._turns[key] = self._moved(self._turns.get(key), turns)
        self._recent_turns.append(turns)

    def _moved(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "estimate": [[k, v] for k, v in self._estimate.items()],
                "floor": [[k, v] for k, v in self._floor.items()], "recent": list(self._recent),
                "turns": [[k, v] for k, v in self._turns.items()],
                "recent_turns": list(self._recent_turns)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._estimate = {int(k): float(v) for k, v in state["estimate"]}
        self._floor = {int(k): float(v) for k, v in state["floor"]}
        self._recent = deque(map(float, state["recent"]), maxlen=self.window)
        # (absent in states saved before rankers learned turns)
        self._turns = {int(k): float(v) for k, v in state.get("turns", [])}
        self._recent_turns = deque(map(float, state.get("recent_turns", [])), maxlen=self.window)
