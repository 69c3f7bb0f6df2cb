"""An environment: reach a target number from a start number, one move per model turn.

A move is `+N`, `-N` or `*N` with N from 1 to 9: the last one written in the turn, so
`<move>*3</move>` and "double it: *2" both work. The environment answers with the new value.
The episode ends when the value is the target (reward 1.0) or after `max_turns` turns
(reward 0.0). A turn without a valid move gets an error observation and still counts.

Start and target are fixed per prompt (drawn from `seed`, the prompt's index and its text), so
a prompt's episodes replay exactly. Model text is only matched by a regular expression, never
executed. The whole state is two integers, so snapshot/restore are one line each and a parked
episode survives a checkpoint.

A move is NOT idempotent: a tool call abandoned when a rollout step ends may already have run,
and it is re-run on resume. rlkit restores the snapshot it took before the call, so a re-run
applies the move once."""

from __future__ import annotations

import random
import re
from typing import Any

from rlkit.rollout.environments.protocol import EpisodePrompt, Observation

MOVE = re.compile(r"([+\-*])\s*([1-9])(?!\d)")
LIMIT = 10_000  # a move past it is refused (no runaway *9 chains)


class ReachTargetEnv:
    def __init__(self, prompt: EpisodePrompt, max_turns: int = 8, high: int = 60, seed: int = 0) -> None:
        if not 1 <= max_turns <= 100 or not 10 <= high <= LIMIT:
            raise ValueError(f"need 1 <= max_turns <= 100 and 10 <= high <= {LIMIT}, got {max_turns} and {high}")
        rng = random.Random(f"{seed}:{prompt.index}:{prompt.text}")
        self.start, self.target = rng.randint(1, 9), rng.randint(10, high)
        self.max_turns = max_turns  # hinted_turns shows it: "[turn 3/8] now 24"
        self.value, self.turns = self.start, 0

    async def reset(self) -> str | None:
        return (f"Reach {self.target} from {self.start} in at most {self.max_turns} moves. "
                "A move is +N, -N or *N with N from 1 to 9, e.g. <move>*3</move>")

    async def step(self, action: str) -> Observation:
        self.turns += 1
        moves = MOVE.findall(action)
        if not moves:
            text, info = "<error>no move: write +N, -N or *N with N from 1 to 9</error>", {"error": "no move"}
        else:
            op, n = moves[-1][0], int(moves[-1][1])
            value = self.value + n if op == "+" else self.value - n if op == "-" else self.value * n
            if abs(value) > LIMIT:
                text, info = f"<error>{value} is beyond {LIMIT}; still {self.value}</error>", {"error": "range"}
            else:
                self.value, text, info = value, f"now {value}", {}
        if self.value == self.target:
            return Observation(text, done=True, reward=1.0, info={"turns": self.turns})
        if self.turns >= self.max_turns:
            return Observation(text, done=True, reward=0.0, info={"turns": self.turns})
        return Observation(text, info=info)

    def snapshot(self) -> dict[str, Any]:
        return {"value": self.value, "turns": self.turns}

    def restore(self, state: dict[str, Any]) -> None:
        self.value, self.turns = int(state["value"]), int(state["turns"])


def reach_target(prompt: EpisodePrompt, **kwargs: Any) -> ReachTargetEnv:
    """The factory rlkit calls once per episode: fn(EpisodePrompt, **rollout.episode.env_kwargs)."""
    return ReachTargetEnv(prompt, **kwargs)
