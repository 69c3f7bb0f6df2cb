"""A prompt and its n samples: the unit GRPO scores and the unit the buffer schedules."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from rlkit.buffers.sample import Sample, SampleStatus


class Lane(str, enum.Enum):
    REGULAR = "regular"
    LONG = "long"  # deferred by tail batching or predicted long by a ranker


@dataclass(frozen=True, eq=False)
class PromptRecord:
    """A dataset row, tokenized. `source_index` is the row's position in the dataset."""

    ids: tuple[int, ...]
    text: str
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    source_index: int = -1
    epoch: int = 0

    def to_state(self) -> dict[str, Any]:
        return {
            "ids": list(self.ids),
            "text": self.text,
            "label": self.label,
            "metadata": self.metadata,
            "source_index": self.source_index,
            "epoch": self.epoch,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "PromptRecord":
        return cls(
            ids=tuple(state["ids"]),
            text=state["text"],
            label=state["label"],
            metadata=dict(state["metadata"]),
            source_index=int(state["source_index"]),
            epoch=int(state["epoch"]),
        )


@dataclass(eq=False, slots=True)
class Group:
    """A prompt and its samples. The group needs `target_n` finished samples; a policy may
    launch more (speculative responses, tail batching), and `settle` keeps the first
    `target_n` to finish."""

    group_id: int
    prompt: PromptRecord
    samples: list[Sample]
    target_n: int
    lane: Lane = Lane.REGULAR
    predicted_length: float | None = None
    predicted_turns: float | None = None  # multi-turn rollouts: a ranker's mean model turns
    birth_version: int = 0  # policy version when the group was first handed out
    attempts: int = 0  # times handed to the manager (1 + resumptions)
    deferrals: int = 0  # times parked in the long queue (tail batching bounds this)
    stale_corrected: bool = False  # kept past max_staleness under the `correct` policy

    @classmethod
    def new(
        cls, group_id: int, prompt: PromptRecord, n: int, first_index: int, version: int
    ) -> "Group":
        samples = [Sample(first_index + i, group_id, prompt.ids, slot=i) for i in range(n)]
        return cls(group_id, prompt, samples, target_n=n, birth_version=version)

    @property
    def n(self) -> int:
        return self.target_n

    # -- progress -----------------------------------------------------------------------
    @property
    def is_complete(self) -> bool:
        """At least target_n samples are terminal and rewarded (or failed)."""
        return sum(1 for s in self.samples if s.is_finished) >= self.target_n

    @property
    def failed(self) -> list[Sample]:
        return [s for s in self.samples if s.status is SampleStatus.FAILED]

    def to_generate(self) -> list[Sample]:
        """Samples that still need (more) generation."""
        return [s for s in self.samples if not s.status.terminal]

    @property
    def tokens(self) -> int:
        return sum(len(s.response_ids) for s in self.samples)

    @property
    def has_tokens(self) -> bool:
        return any(s.response_ids for s in self.samples)

    def oldest_version(self) -> int | None:
        """The policy version of the oldest generated token (None before any token)."""
        olds = [v for s in self.samples if (v := s.oldest_version()) is not None]
        return min(olds) if olds else None

    # -- shaping --------------------------------------------------------------------------
    def first_finished(self) -> list[Sample]:
        """The (up to) target_n samples that finished first: the ones a settled group keeps."""
        done = [s for s in self.samples if s.is_finished]
        if len(done) > self.target_n:
            done.sort(key=lambda s: (s.finished_at is None, s.finished_at or 0.0, s.index))
        return done[: self.target_n]

    @property
    def trainable(self) -> bool:
        """Complete, and none of the samples it would keep failed."""
        kept = self.first_finished()
        return len(kept) == self.target_n and all(
            s.status is not SampleStatus.FAILED for s in kept
        )

    def settle(self) -> list[Sample]:
        """Keep exactly target_n samples: the first to finish. Returns the surplus removed."""
        if len(self.samples) == self.target_n:
            return []
        return self._keep(set(map(id, self.first_finished())))

    def trim(self) -> list[Sample]:
        """Keep target_n samples, the furthest along (finished, then most tokens): used when an
        unfinished group is parked, so it resumes without speculative extras."""
        if len(self.samples) <= self.target_n:
            return []
        ranked = sorted(
            self.samples, key=lambda s: (not s.is_finished, -len(s.response_ids), s.index)
        )
        return self._keep(set(map(id, ranked[: self.target_n])))

    def _keep(self, keep: set[int]) -> list[Sample]:
        surplus = [s for s in self.samples if id(s) not in keep]
        self.samples = [s for s in self.samples if id(s) in keep]
        return surplus

    def regenerate(self, version: int) -> None:
        """Throw the responses away and start again from the prompt."""
        self.trim()
        for s in self.samples:
            s.reset()
        self.birth_version = version
        self.stale_corrected = False

    def interrupt(self) -> None:
        """An abort ended the group's in-flight requests: park non-terminal samples."""
        for s in self.samples:
            s.interrupt()

    # -- persistence ----------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "prompt": self.prompt.to_state(),
            "samples": [s.to_state() for s in self.samples],
            "target_n": self.target_n,
            "lane": self.lane.value,
            "predicted_length": self.predicted_length,
            "predicted_turns": self.predicted_turns,
            "birth_version": self.birth_version,
            "attempts": self.attempts,
            "deferrals": self.deferrals,
            "stale_corrected": self.stale_corrected,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Group":
        prompt = PromptRecord.from_state(state["prompt"])
        return cls(
            group_id=int(state["group_id"]),
            prompt=prompt,
            samples=[Sample.from_state(s, prompt.ids) for s in state["samples"]],
            target_n=int(state["target_n"]),
            lane=Lane(state["lane"]),
            predicted_length=state["predicted_length"],
            predicted_turns=state.get("predicted_turns"),  # absent in states saved before it
            birth_version=int(state["birth_version"]),
            attempts=int(state["attempts"]),
            deferrals=int(state.get("deferrals", 0)),  # absent in states saved before it existed
            stale_corrected=bool(state["stale_corrected"]),
        )
