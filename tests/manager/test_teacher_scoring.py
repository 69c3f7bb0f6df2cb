"""Teacher scoring in the manager (rollout.frozen_engines' teacher): every completed sample gets
one teacher logprob per response token with its reward, never while parked; a failing teacher
fails the sample (counted as 'teacher'); an abort cancels the teacher calls under way, and the
group's samples are scored when it resumes. (The teacher's HTTP path against the built-in
engine and an HF forward: tests/rollout/test_frozen_groups.py.)"""

import asyncio

from rlkit.buffers import ListPromptSource, Place, RolloutBuffer, SampleStatus
from rlkit.buffers.source import records_from_token_lists
from rlkit.rollout.config import SamplingConfig
from rlkit.rollout.manager import RolloutManager
from rlkit.rollout.policies import PartialPolicy, SyncPolicy
from rlkit.rollout.reward_scheduler import RewardScheduler
from tests.manager.fakes import FakeEngines, constant_reward


def teacher_of(sample) -> list[float]:
    """A known answer: -(token id + position) / 100 per response token."""
    return [-(t + i) / 100 for i, t in enumerate(sample.response_ids)]


def make(policy, teacher, length=lambda s: 8, rows=20):
    buf = RolloutBuffer(ListPromptSource(records_from_token_lists([[1, i] for i in range(rows)]),
                                         shuffle=False), n_samples_per_prompt=2)
    rewards = RewardScheduler(constant_reward, teacher=teacher)
    return buf, rewards, RolloutManager(buf, FakeEngines(length), policy,
                                        SamplingConfig(max_new_tokens=1000), rewards)


async def test_every_completed_sample_gets_its_teacher_logprobs_with_its_reward():
    calls = []

    async def teacher(sample):
        assert sample.status in (SampleStatus.DONE, SampleStatus.TRUNCATED)  # never parked
        calls.append(sample.index)
        return teacher_of(sample)

    buf, rewards, mgr = make(SyncPolicy(), teacher)
    await asyncio.wait_for(mgr.run_step(target=3, version=0), 20)
    groups = buf.take(3, timeout=0)
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 6 and sorted(calls) == sorted(s.index for s in samples)
    for s in samples:
        assert s.reward is not None and s.teacher_logprobs == teacher_of(s)
        s.check()


async def test_a_failing_teacher_fails_the_sample_and_is_counted():
    async def teacher(sample):
        if sample.group_id == 0:
            raise RuntimeError("teacher down")
        return teacher_of(sample)

    buf, rewards, mgr = make(SyncPolicy(), teacher)
    report = await asyncio.wait_for(mgr.run_step(target=3, version=0), 20)
    assert rewards.failures["teacher"] == 2 and report.reward_failures == 2
    assert sum(report.dropped.values()) == 1  # group 0 (rollout.reward.on_error: drop_group)
    ready = buf.take(3, timeout=0)
    assert 0 not in {g.group_id for g in ready}
    assert all(s.teacher_logprobs == teacher_of(s) for g in ready for s in g.samples)


async def test_an_abort_cancels_the_teacher_and_the_resumed_group_is_scored():
    """Partial rollouts: groups 0 and 1 complete their responses, but the teacher does not
    answer for them; the others complete the step, whose end cancels those calls (the samples keep their tokens,
    unscored), and the next step scores them without generating again."""
    release = asyncio.Event()
    started, cancelled = [], []

    async def teacher(sample):
        if sample.group_id in (0, 1) and not release.is_set():
            started.append(sample.index)
            try:
                await asyncio.Event().wait()  # hangs until cancelled
            except asyncio.CancelledError:
                cancelled.append(sample.index)
                raise
        return teacher_of(sample)

    buf, rewards, mgr = make(PartialPolicy(over_provision=2.0), teacher)
    await asyncio.wait_for(mgr.run_step(target=3, version=0), 20)
    assert started and sorted(cancelled) == sorted(started)
    parked = {s.index: s for g in buf.queued(Place.PARTIAL) for s in g.samples}
    for i in started:  # complete, unscored, parked with its tokens
        s = parked[i]
        assert s.status in (SampleStatus.DONE, SampleStatus.TRUNCATED)
        assert s.reward is None and s.teacher_logprobs is None and s.response_ids
    tokens = {i: list(parked[i].response_ids) for i in started}

    release.set()
    buf.set_version(1)
    await asyncio.wait_for(mgr.run_step(target=3, version=1), 20)
    ready = {s.index: s for g in buf.queued(Place.READY) for s in g.samples}
    for i in started:
        s = ready[i]
        assert s.response_ids == tokens[i]  # scored, not generated again
        assert s.reward is not None and s.teacher_logprobs == teacher_of(s)
    assert buf.stats()["balanced"]


async def test_a_teacher_group_that_cannot_come_back_stops_the_step():
    """Its monitor's EnginesDown is no sample's failure: every group would fail and the step
    would sample forever. The step stops with it, its groups parked with their tokens."""
    import pytest

    from rlkit.rollout.health import EnginesDown

    async def teacher(sample):
        raise EnginesDown("frozen engine group 'teacher': every engine is down")

    buf, rewards, mgr = make(SyncPolicy(), teacher)
    with pytest.raises(EnginesDown, match="teacher"):
        await asyncio.wait_for(mgr.run_step(target=3, version=0), 20)
    assert not rewards.failures and buf.stats()["balanced"]
    parked = [s for place in (Place.PARTIAL, Place.IN_FLIGHT) for g in buf.queued(place) for s in g.samples]
    assert parked and all(s.response_ids and s.teacher_logprobs is None for s in parked)


async def test_a_reward_failing_for_every_sample_stops_the_step_instead_of_sampling_forever():
    """A judge that never gives a verdict: each group is dropped (counted) and the policy
    samples more, until more than 4 x the target were dropped; then the step stops, saying why."""
    import pytest

    from rlkit.rollout.reward_scheduler import RewardFailure

    async def no_verdict(sample, group):
        raise ValueError("no verdict (yes, no) in the judge's answer 'hmm'")

    buf = RolloutBuffer(ListPromptSource(records_from_token_lists([[1, i] for i in range(200)]),
                                         shuffle=False), n_samples_per_prompt=2)
    rewards = RewardScheduler(no_verdict)
    mgr = RolloutManager(buf, FakeEngines(lambda s: 4), SyncPolicy(),
                         SamplingConfig(max_new_tokens=1000), rewards)
    with pytest.raises(RewardFailure, match=r"groups dropped for failing rewards.*no verdict"):
        await asyncio.wait_for(mgr.run_step(target=3, version=0), 20)
    assert rewards.failures["error"] > 4 * 3 and buf.stats()["balanced"]
