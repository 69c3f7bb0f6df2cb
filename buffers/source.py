"""Where fresh prompts come from: the PromptSource protocol and its epoch/shuffle order.

The order is a pure function of (seed, epoch, number of rows), so a source restored from
`state_dict()` continues with exactly the prompts an uninterrupted run would have drawn.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from rlkit.buffers.group import PromptRecord


@runtime_checkable
class PromptSource(Protocol):
    def next_prompt(self) -> PromptRecord:
        """The next prompt; cycles through epochs, reshuffling each one."""
        ...

    def __len__(self) -> int:
        """Rows in one epoch (distinct `source_index` values)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the data (path, rows, ...): a saved state only loads onto a match."""
        ...


class EpochOrder:
    """Walks row positions 0..n-1 epoch after epoch, in a seeded per-epoch shuffle."""

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True) -> None:
        if num_rows <= 0:
            raise ValueError("a prompt source needs at least one row")
        self.num_rows = num_rows
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.num_rows))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next(self) -> tuple[int, int]:
        """(row position, epoch) of the next prompt."""
        if self.position >= self.num_rows:
            self.epoch += 1
            self.position = 0
            self._order = self._permutation(self.epoch)
        row = self._order[self.position]
        self.position += 1
        return row, self.epoch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "shuffle": self.shuffle, "num_rows": self.num_rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("seed", "shuffle", "num_rows"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"prompt order: saved {key}={state[key]!r} but this run has "
                    f"{getattr(self, key)!r}"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._permutation(self.epoch)


class ListPromptSource:
    """Prompts held in memory (tests, the simulator, generated data sets)."""

    def __init__(
        self,
        records: Sequence[PromptRecord],
        seed: int = 0,
        shuffle: bool = True,
        name: str = "list",
    ) -> None:
        self._records = list(records)
        self._order = EpochOrder(len(self._records), seed, shuffle)
        self._name = name

    def __len__(self) -> int:
        return len(self._records)

    def next_prompt(self) -> PromptRecord:
        row, epoch = self._order.next()
        r = self._records[row]
        return PromptRecord(r.ids, r.text, r.label, r.metadata, source_index=row, epoch=epoch)

    def state_dict(self) -> dict[str, Any]:
        return {"order": self._order.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._order.load_state_dict(state["order"])

    def fingerprint(self) -> dict[str, Any]:
        return {"source": self._name, "rows": len(self._records)}


def records_from_token_lists(
    prompts: Sequence[Sequence[int]], label: Callable[[int], Any] = lambda i: None
) -> list[PromptRecord]:
    """Build records from raw token id lists (benchmarks and tests)."""
    return [
        PromptRecord(tuple(ids), text="", label=label(i), source_index=i)
        for i, ids in enumerate(prompts)
    ]
