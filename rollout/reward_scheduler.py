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
from rlkit.buffers.sample import Sample, SampleStatus
from rlkit.rollout.health import EnginesDown

# (sample, group) -> reward. Sync user functions are wrapped into this by rlkit.rewards.
ScoreFn = Callable[[Sample, Group], Awaitable[float]]
# sample -> the teacher's logprob of each response token (rollout.frozen_engines' teacher)
TeacherFn = Callable[[Sample], Awaitable[list[float]]]

# RewardScheduler.failures' keys; step metrics rollout/reward_failures/<kind> ('teacher': the
# teacher's scoring failed every try)
REWARD_FAILURE_KINDS = ("error", "timeout", "invalid", "teacher")


class RewardFailure(RuntimeError):
    """A reward failed and the recipe says the step fails with it (reward.on_error=fail_step)."""


class RewardScheduler:
    """Scores samples: `score` is awaited under `timeout_s`; a timeout, an exception and a value
    check_reward_value rejects each fail the sample with the reason (sample.error) and count in
    `failures` by kind: timeout, error, invalid. The timeout cancels the call; what a cancelled
    sync reward leaves behind is the runner's business (rlkit.rewards.worker)."""

    def __init__(self, score: ScoreFn, timeout_s: float = 30.0, on_error: str = "drop_group",
                 teacher: TeacherFn | None = None):
        if on_error not in ("drop_group", "fail_step"):
            raise ValueError(f"on_error must be drop_group or fail_step, got {on_error!r}")
        self._score = score
        self.timeout_s = timeout_s
        self.on_error = on_error
        # With a teacher every scored sample also gets the teacher's logprobs, concurrently
        # with its reward (the teacher's group has its own timeouts and retries).
        self.teacher = teacher
        self.failures: Counter[str] = Counter()  # by kind: REWARD_FAILURE_KINDS

    def wants(self, sample: Sample) -> bool:
        """Scoring is left to do for this (complete) sample: its reward, or with a teacher its
        teacher logprobs (an episode's environment may have given the reward already)."""
        if sample.status not in (SampleStatus.DONE, SampleStatus.TRUNCATED):
            return False
        return sample.reward is None or (self.teacher is not None and sample.teacher_logprobs is None)

    async def score(self, sample: Sample, group: Group) -> bool:
        """Set `sample.reward` (unless set) and, with a teacher, `sample.teacher_logprobs`, or
        fail the sample with the reason. True when scored. Both are set together, after both
        answered, so a sample is never rewarded without its teacher logprobs."""
        teacher = None
        if self.teacher is not None and sample.teacher_logprobs is None:
            # an empty response has nothing to score
            teacher = asyncio.ensure_future(self.teacher(sample)) if sample.response_ids else None
        try:
            value = sample.reward if sample.reward is not None else await self._reward(sample, group)
            if value is None:
                return False
            if teacher is not None:
                try:
                    sample.teacher_logprobs = list(await teacher)
                except (asyncio.CancelledError, EnginesDown):
                    raise  # a teacher that cannot come back stops the step, as the policy's engines do
                except Exception as e:  # noqa: BLE001 - the teacher's group counted its tries
                    return self._fail(sample, "teacher", f"teacher scoring failed: {describe_error(e)}")
            elif self.teacher is not None and sample.teacher_logprobs is None:
                sample.teacher_logprobs = []
            if sample.reward is None:
                sample.set_reward(value)
            return True
        finally:
            if teacher is not None and not teacher.done():
                teacher.cancel()  # the reward failed, or this call was cancelled (an abort)
                await asyncio.gather(teacher, return_exceptions=True)

    async def _reward(self, sample: Sample, group: Group) -> float | None:
        """The reward's value, or None with the sample failed and the failure counted."""
        try:
            value = await asyncio.wait_for(self._score(sample, group), self.timeout_s)
        except asyncio.TimeoutError:
            return self._fail_none(sample, "timeout", f"reward timed out after {self.timeout_s} s")
        except (asyncio.CancelledError, EnginesDown):
            raise  # a judge's engine group that cannot come back stops the step
        except Exception as e:  # a user plugin may raise anything: record it, never lose it
            if getattr(e, "reward_invalid", False):  # its value could not even reach us
                return self._fail_none(sample, "invalid", str(e))
            return self._fail_none(sample, "error", f"reward raised {describe_error(e)}")
        problem = check_reward_value(value)
        if problem:
            return self._fail_none(sample, "invalid", problem)
        return reward_float(value)

    def _fail_none(self, sample: Sample, kind: str, message: str) -> None:
        self._fail(sample, kind, message)
        return None

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
