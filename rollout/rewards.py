"""Reward scheduling: score each sample as soon as it finishes, with a timeout, concurrently
with generation; record every failure on the sample and count it.

The reward function itself is a plugin resolved by rlkit (rlkit.rewards); here it is just an
async callable, so the manager and the simulator never import user code paths.
"""

from __future__ import annotations

import asyncio
import math
import numbers
from collections import Counter
from typing import Awaitable, Callable

from buffers.group import Group
from buffers.sample import Sample

# (sample, group) -> reward. Sync user functions are wrapped into this by rlkit.rewards.
ScoreFn = Callable[[Sample, Group], Awaitable[float]]


class RewardFailure(RuntimeError):
    """A reward failed and the recipe says the step fails with it (reward.on_error=fail_step)."""


class RewardScheduler:
    def __init__(self, score: ScoreFn, timeout_s: float = 30.0, on_error: str = "drop_group"):
        if on_error not in ("drop_group", "fail_step"):
            raise ValueError(f"on_error must be drop_group or fail_step, got {on_error!r}")
        self._score = score
        self.timeout_s = timeout_s
        self.on_error = on_error
        self.failures: Counter[str] = Counter()  # by kind: error, timeout, invalid

    async def score(self, sample: Sample, group: Group) -> bool:
        """Set `sample.reward`, or fail the sample with the reason. True when rewarded."""
        try:
            value = await asyncio.wait_for(self._score(sample, group), self.timeout_s)
        except asyncio.TimeoutError:
            return self._fail(sample, "timeout", f"reward timed out after {self.timeout_s} s")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a user plugin may raise anything: record it, never lose it
            return self._fail(sample, "error", f"reward raised {type(e).__name__}: {e}")
        problem = check_reward_value(value)
        if problem:
            return self._fail(sample, "invalid", problem)
        sample.set_reward(float(value))
        return True

    def _fail(self, sample: Sample, kind: str, message: str) -> bool:
        self.failures[kind] += 1
        sample.fail(message)
        return False


def check_reward_value(value: object) -> str | None:
    """Why a reward function's return value breaks the contract (None if it is fine)."""
    if not isinstance(value, numbers.Real):  # int, float, bool, numpy scalars
        return f"reward returned {value!r} ({type(value).__name__}); expected a float"
    if not math.isfinite(float(value)):
        return f"reward returned {value!r}; expected a finite float"
    return None
