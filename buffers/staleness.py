"""The staleness rule: how far behind the consumer a group may be, and what happens past that."""

from __future__ import annotations

import enum


class StalenessPolicy(str, enum.Enum):
    DROP = "drop"  # drop the group, counted with reason 'stale'
    REGENERATE = "regenerate"  # forget the responses and generate again from the prompt
    CORRECT = "correct"  # keep it, flagged; the trainer must apply off-policy correction


def staleness(oldest_version: int | None, consumer_version: int) -> int:
    """Versions the oldest token lags behind the consumer (0 for a group with no tokens)."""
    if oldest_version is None:
        return 0
    return max(0, consumer_version - oldest_version)
