"""Guess the number: a game whose episodes vary widely in turns, for the long tail. The secret
is an integer in [1, high], fixed per prompt (its label if it is one, else drawn from the
prompt's index and `seed`). Each turn the model names a number (the last integer in its turn);
the answer is `higher`, `lower` or `correct`. The episode ends when it is correct (reward 1) or
after `max_turns` turns (reward 0); a turn with no number is answered `say a number` and
counts. A player that bisects needs about log2(high) turns, one that counts up needs up to
`high`: the spread of turns per episode is the point."""

from __future__ import annotations

import random
import re
from typing import Any

from rlkit.rollout.environments.protocol import EpisodePrompt, Observation

NUMBER = re.compile(r"-?\d+")


class GuessNumberEnv:
    def __init__(self, prompt: EpisodePrompt, high: int = 100, max_turns: int = 12, seed: int = 0,
                 intro: bool = True) -> None:
        if high < 1 or max_turns < 1:
            raise ValueError(f"high and max_turns must be >= 1, got {high} and {max_turns}")
        label = prompt.label
        if isinstance(label, int) and not isinstance(label, bool) and 1 <= label <= high:
            self.secret = label
        else:
            self.secret = random.Random(f"{seed}:{prompt.index}").randint(1, high)
        self.high, self.max_turns, self.intro = high, max_turns, intro
        self.turns = 0

    async def reset(self) -> str | None:
        """The rules as a first observation, unless `intro` is off (the prompt says them)."""
        return f"I am thinking of a number from 1 to {self.high}. Guess it." if self.intro else None

    async def step(self, action: str) -> Observation:
        self.turns += 1
        numbers = NUMBER.findall(action)
        if not numbers:
            answer, correct = "say a number", False
        else:
            guess = int(numbers[-1])
            correct = guess == self.secret
            answer = "correct" if correct else ("higher" if guess < self.secret else "lower")
        if correct:
            return Observation(answer, done=True, reward=1.0, info={"turns": self.turns})
        if self.turns >= self.max_turns:
            return Observation(answer, done=True, reward=0.0, info={"turns": self.turns})
        return Observation(answer, info={"turns": self.turns})

    def snapshot(self) -> dict[str, Any]:
        return {"secret": self.secret, "turns": self.turns}

    def restore(self, state: dict[str, Any]) -> None:
        self.secret, self.turns = int(state["secret"]), int(state["turns"])


def guess_number(prompt: EpisodePrompt, high: int = 100, max_turns: int = 12, seed: int = 0,
                 intro: bool = True) -> GuessNumberEnv:
    """The built-in `guess_number` environment's factory."""
    return GuessNumberEnv(prompt, high=high, max_turns=max_turns, seed=seed, intro=intro)
