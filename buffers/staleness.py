"""The staleness rule: how far behind the consumer a group may be, and what happens past that;
and the lag of single tokens (a trained token's lag = the trainer's version - the version that
generated it)."""

from __future__ import annotations

import bisect
import enum
from typing import Iterable

from rlkit.buffers.sample import Sample

# Trained tokens are counted by lag 0, 1, 2 and 3+ (the trainer's mismatch telemetry,
# train/algorithms/mismatch.py, buckets them the same way).
LAG_BUCKETS = 4


class StalenessPolicy(str, enum.Enum):
    DROP = "drop"  # drop the group, counted with reason 'stale'
    REGENERATE = "regenerate"  # forget the responses and generate again from the prompt
    CORRECT = "correct"  # keep it, flagged; the trainer must apply off-policy correction


def staleness(oldest_version: int | None, consumer_version: int) -> int:
    """Versions the oldest token lags behind the consumer (0 for a group with no tokens)."""
    if oldest_version is None:
        return 0
    return max(0, consumer_version - oldest_version)


def lag_counts(samples: Iterable[Sample], consumer_version: int) -> tuple[list[int], int]:
    """The trained tokens (loss mask 1) of `samples` by lag behind `consumer_version`: counts
    at lag 0, 1, 2 and 3+ (LAG_BUCKETS; a token newer than the consumer counts as lag 0), and
    the largest lag of any of them (0 when there are none). Versions never decrease along a
    response, so a sample costs one bisection per distinct version unless some of its tokens
    are masked out (a multi-turn episode's observations)."""
    counts = [0] * LAG_BUCKETS
    most = 0
    for s in samples:
        versions = s.versions
        if not versions:
            continue
        if 0 in s.loss_mask:
            spans = _masked_spans(versions, s.loss_mask)
        else:
            spans = _spans(versions)
        for version, n in spans:
            lag = max(0, consumer_version - version)
            counts[min(lag, LAG_BUCKETS - 1)] += n
            most = max(most, lag)
    return counts, most


def _spans(versions: list[int]) -> list[tuple[int, int]]:
    """(version, tokens) of each run of a sorted list."""
    out, i = [], 0
    while i < len(versions):
        j = bisect.bisect_right(versions, versions[i], i)
        out.append((versions[i], j - i))
        i = j
    return out


def _masked_spans(versions: list[int], mask: list[int]) -> list[tuple[int, int]]:
    tokens: dict[int, int] = {}
    for v, m in zip(versions, mask):
        if m:
            tokens[v] = tokens.get(v, 0) + 1
    return list(tokens.items())
