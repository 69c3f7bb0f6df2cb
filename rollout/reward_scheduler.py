"""Reward scheduling: score each sample as soon as it finishes, with a timeout, concurrently
with generation; record every failure on the sample and count it.

The reward function itself is a plugin resolved by rlkit (rlkit.rewards); here it is just an
async callable, so the manager and the simulator never import user code paths.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import sys
from collections import Counter
from typing import Awaitable, Callable

from rlkit.buffers.group import Group
from rlkit.buffers.sample import Sample

# (sample, group) -> reward. Sync user functions are wrapped into this by rlkit.rewards.
ScoreFn = Callable[[Sample, Group], Awaitable[float]]

# RewardScheduler.failures' keys; step metrics rollout/reward_failures/<kind>
REWARD_FAILURE_KINDS = ("error", "timeout", "invalid")


class RewardFailure(RuntimeError):
    """A reward failed and the recipe says the step fails with it (reward.on_error=fail_step)."""


class RewardScheduler:
    """Scores samples: `score` is awaited under `timeout_s`; a timeout, an exception and a value
    check_reward_value rejects each fail the sample with the reason (sample.error) and count in
    `failures` by kind: timeout, error, invalid. The timeout cancels the call; what a cancelled
    sync reward leaves behind is the runner's business (rlkit.rewards.worker)."""

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
            if getattr(e, "reward_invalid", False):  # its value could not even reach us
                return self._fail(sample, "invalid", str(e))
            return self._fail(sample, "error", f"reward raised {describe_error(e)}")
        problem = check_reward_value(value)
        if problem:
            return self._fail(sample, "invalid", problem)
        sample.set_reward(reward_float(value))
        return True

    def _fail(self, sample: Sample, kind: str, message: str) -> bool:
        self.failures[kind] += 1
        sample.fail(message)
        return False


def describe_error(e: BaseException) -> str:
    """'TypeName: message' of what the reward raised; for a call that ran elsewhere (a worker
    process) the error it reported (`reward_error`), not the wrapper's type."""
    remote = getattr(e, "reward_error", None)
    return remote if isinstance(remote, str) else f"{type(e).__name__}: {e}"


def check_reward_value(value: object) -> str | None:
    """Why a reward function's return value breaks the contract (None if it is fine).

    Accepted: any real number (int, float, numpy integer/floating, Fraction) that is finite as a
    float, and booleans (Python or numpy), which score 1.0 / 0.0 (`return answer == label` is a
    common, unambiguous reward). Rejected: NaN and +-inf (numpy's too), None, strings, numpy
    arrays and tensors (even with one element: say which number you mean), and anything else."""
    if _is_bool(value):
        return None
    if not isinstance(value, numbers.Real):  # int, float, numpy scalars, Fraction
        return f"reward returned {value!r} ({type(value).__name__}); expected a float"
    try:
        as_float = float(value)
    except (OverflowError, ValueError, TypeError) as e:  # 10**400, a Real with a broken __float__
        return f"reward returned {_short(value)} which is not a float ({type(e).__name__}: {e})"
    if not math.isfinite(as_float):
        return f"reward returned {value!r}; expected a finite float"
    return None


def reward_float(value: object) -> float:
    """The float of a value check_reward_value accepted."""
    return float(bool(value)) if _is_bool(value) else float(value)  # type: ignore[arg-type]


def _is_bool(value: object) -> bool:
    if isinstance(value, bool):
        return True
    np = sys.modules.get("numpy")  # a numpy bool can only come from code that imported numpy
    return np is not None and isinstance(value, np.bool_)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
