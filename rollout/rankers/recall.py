"""How well a ranker finds the long tail: recall of the truly longest share of a step's groups
among the groups it predicted longest (StreamRL Table 4's measure, read as set overlap: with
equal set sizes precision equals recall). Groups are ranked by their mean response length,
since groups are what dispatch places."""

from __future__ import annotations

import math
import zlib
from typing import Sequence

SHARES = (0.2, 0.1, 0.05)


def recall_at(true_lengths: Sequence[float], predicted: Sequence[float], share: float) -> float:
    """|top-k by truth ∩ top-k by prediction| / k, k = ceil(share x n). Ties break by a fixed
    hash of the position, so a ranker that predicts all groups equal scores about `share`."""
    n = len(true_lengths)
    if n != len(predicted):
        raise ValueError(f"{n} true lengths but {len(predicted)} predictions")
    if n == 0:
        return float("nan")
    k = max(1, math.ceil(share * n))

    def top(values: Sequence[float]) -> set[int]:
        return set(sorted(range(n), key=lambda i: (-values[i], _tiebreak(i)))[:k])

    return len(top(true_lengths) & top(predicted)) / k


def recalls(true_lengths: Sequence[float], predicted: Sequence[float]) -> dict[str, float]:
    """{"recall@20": ..., "recall@10": ..., "recall@5": ...}."""
    return {f"recall@{round(s * 100)}": recall_at(true_lengths, predicted, s) for s in SHARES}


def _tiebreak(i: int) -> int:
    return zlib.crc32(i.to_bytes(8, "little"))
