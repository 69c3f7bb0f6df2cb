"""RolloutManager with the sync and partial policies over fake engines: targets met, partial
groups parked with their tokens and resumed first, failures recorded and counted, nothing
lost on abort or cancellation."""

import asyncio

import pytest

from rlkit.buffers import ListPromptSource, Place, RolloutBuffer, SampleStatus
from rlkit.buffers.source import records_from_token_lists
from rlkit.rollout.config import SamplingConfig
from rlkit.rollout.engine_api import EngineError
from rlkit.rollout.manager import EnginesFailing, RolloutManager
from rlkit.rollout.policies import PartialPolicy, SyncPolicy
from rlkit.rollout.reward_scheduler import RewardFailure, RewardScheduler
from tests.manager.fakes import FakeEngines, constant_reward


def long_tail(sample) -> int:
    """Prompts 0 and 1 are long (the tail); the rest short; lengths vary a little by slot."""
    base = 400 if sample.group_id in (0, 1) else 8
    return base + 2 * sample.slot


def make(policy, *, n=2, rows=20, length=long_tail, reward=constant_reward, max_new=1000,
         on_error="drop_group", timeout=5.0, max_staleness=3, **engine_kw):
    buf = RolloutBuffer(
        ListPromptSource(records_from_token_lists([[1, i] for i in range(rows)]), shuffle=False),
        n_samples_per_prompt=n, max_staleness=max_staleness,
    )
    engines = FakeEngines(length, **engine_kw)
    mgr = RolloutManager(buf, engines, policy, SamplingConfig(max_new_tokens=max_new),
                         RewardScheduler(reward, timeout_s=timeout, on_error=on_error))
    return buf, engines, mgr


async def test_sync_completes_exactly_the_target_and_waits_for_the_tail():
    buf, engines, mgr = make(SyncPolicy())
    r = await mgr.run_step(target=4, version=0)
    assert len(r.completed) == 4 and r.groups_launched == 4
    assert r.groups_carried_over == 0 and r.tokens_discarded == 0
    assert engines.aborts == 0
    groups = buf.take_nowait(10)
    assert len(groups) == 4
    assert all(s.reward is not None and s.status is SampleStatus.DONE for g in groups for s in g.samples)
    # the step waited for the long prompts
    assert max(len(s.response_ids) for g in groups for s in g.samples) >= 400
    assert r.tokens_generated == sum(len(s.response_ids) for g in groups for s in g.samples)
    assert buf.stats()["balanced"]


async def test_partial_stops_at_target_parks_the_tail_and_resumes_it_first():
    buf, engines, mgr = make(PartialPolicy(over_provision=2.0))
    r1 = await mgr.run_step(target=3, version=0)
    assert len(r1.completed) >= 3
    assert r1.groups_launched == 6
    assert engines.aborts == 1
    assert r1.groups_carried_over == 6 - len(r1.completed)
    parked = buf.queued(Place.PARTIAL)
    assert {g.group_id for g in parked} == {0, 1}  # the long prompts
    tokens_before = {g.group_id: g.tokens for g in parked}
    parked_lengths = {len(s.response_ids) for g in parked for s in g.samples} - {0}
    assert all(t > 0 for t in tokens_before.values())  # aborted with their tokens
    assert r1.tokens_discarded == 0
    assert all(s.status in (SampleStatus.PARTIAL, SampleStatus.PENDING)
               for g in parked for s in g.samples)
    trained = buf.take_nowait(3)

    r2 = await mgr.run_step(target=3, version=1)
    assert r2.groups_resumed == 2
    # the timeline shows where each resumed request picked up
    assert {sp.response_before for sp in r2.timeline if sp.group_id in (0, 1)} >= parked_lengths
    assert all(sp.response_before == 0 for sp in r2.timeline if sp.group_id not in (0, 1))
    assert buf.stats()["balanced"]
    # the resumed groups kept their old tokens (version 0) and continued under version 1
    resumed = [g for g in buf.queued(Place.READY) + buf.queued(Place.PARTIAL) if g.group_id in (0, 1)]
    for g in resumed:
        assert g.tokens >= tokens_before[g.group_id]
        assert all(s.versions == sorted(s.versions) for s in g.samples)
    assert {g.group_id for g in trained}.isdisjoint({0, 1})


async def test_partial_resumes_long_groups_to_completion_across_steps():
    def tail(sample):
        return 60 if sample.group_id in (0, 1) else 8

    buf, _, mgr = make(PartialPolicy(over_provision=2.0), rows=10, length=tail, max_staleness=50)
    spans = []
    for version in range(30):
        r = await mgr.run_step(target=2, version=version)
        spans.append(r.max_versions_per_sample)
        buf.take_nowait(len(r.completed))
        buf.set_version(version + 1)
        if {0, 1} & set(r.completed):
            break
    assert {0, 1} & set(r.completed)  # the long groups finished, across several steps
    assert max(spans) >= 2  # a sample was generated across policy versions
    assert r.resumed_token_share > 0 and r.tokens_from_earlier > 0
    stats = buf.stats()
    assert stats["balanced"] and stats["discarded_tokens"] == 0


async def test_resume_sends_only_the_remaining_budget():
    buf, engines, mgr = make(PartialPolicy(over_provision=2.0), max_new=300)
    await mgr.run_step(target=3, version=0)
    parked = buf.queued(Place.PARTIAL)
    for _ in range(10):
        if not buf.queued(Place.PARTIAL):
            break
        r = await mgr.run_step(target=1, version=0)
        buf.take_nowait(len(r.completed))
    for gid in (0, 1):
        g = next(g for g in parked if g.group_id == gid)
        assert all(len(s.response_ids) <= 300 for s in g.samples)
        assert all(s.status is SampleStatus.TRUNCATED for s in g.samples)  # capped at 300 < 400


async def test_reward_failure_drops_the_group_with_a_reason_and_counts_it():
    async def reward(sample, group):
        if group.group_id == 2:
            raise ValueError("cannot parse answer")
        return 1.0

    buf, _, mgr = make(SyncPolicy(), reward=reward, length=lambda s: 5)
    r = await mgr.run_step(target=4, version=0)
    assert len(r.completed) == 4 and 2 not in r.completed
    assert r.dropped == {"reward_failed": 1} and r.reward_failures >= 1
    assert buf.stats()["dropped_by_reason"] == {"reward_failed": 1}
    assert mgr.rewards.failures["error"] >= 1
    assert buf.stats()["balanced"]


async def test_reward_failure_fails_the_step_when_asked_and_loses_nothing():
    async def reward(sample, group):
        if group.group_id == 1:
            raise ValueError("judge down")
        await asyncio.sleep(0.01)
        return 1.0

    buf, _, mgr = make(SyncPolicy(), reward=reward, on_error="fail_step", length=lambda s: 20)
    with pytest.raises(RewardFailure, match="judge down"):
        await mgr.run_step(target=4, version=0)
    stats = buf.stats()
    assert stats["balanced"] and stats["in_flight"] == 0 and stats["dropped"] == 0
    g1 = next(g for g in buf.queued(Place.PARTIAL) if g.group_id == 1)
    assert any("judge down" in (s.error or "") for s in g1.samples)  # recorded on the sample


async def test_reward_timeout_and_invalid_values_are_recorded():
    async def reward(sample, group):
        if group.group_id == 0:
            await asyncio.sleep(10)
        return "yes" if group.group_id == 1 else 1.0

    buf, _, mgr = make(SyncPolicy(), reward=reward, timeout=0.05, length=lambda s: 4)
    r = await mgr.run_step(target=3, version=0)
    assert mgr.rewards.failures["timeout"] >= 1 and mgr.rewards.failures["invalid"] >= 1
    assert r.dropped["reward_failed"] == 2
    dropped_errors = {s.error for g in (buf.queued(Place.READY)) for s in g.samples}
    assert dropped_errors == {None}


async def test_engine_errors_drop_groups_and_an_outage_fails_the_step():
    buf, _, mgr = make(SyncPolicy(), length=lambda s: 4, fail=lambda s: s.group_id == 0)
    r = await mgr.run_step(target=3, version=0)
    assert r.dropped == {"engine_failed": 1} and r.engine_failures >= 1
    assert 0 not in r.completed

    buf, _, mgr = make(SyncPolicy(), length=lambda s: 4, fail=lambda s: True)
    with pytest.raises(EnginesFailing, match="worker crashed"):
        await mgr.run_step(target=2, version=0)
    assert buf.stats()["balanced"] and buf.stats()["in_flight"] == 0


async def test_speculative_responses_keep_the_first_n_and_cancel_the_rest():
    class Speculative:
        name = "speculative"

        async def run(self, step):
            for g in step.buffer.acquire(2):
                step.launch(g, responses=4)
            while step.completed < 2:
                await step.next_event()

    buf, _, mgr = make(Speculative(), n=2, length=lambda s: 4 + 40 * (s.slot % 2))
    r = await mgr.run_step(target=2, version=0)
    for g in buf.take_nowait(2):
        assert sorted(s.slot for s in g.samples) == [0, 2]  # the short responses finished first
    assert r.tokens_discarded > 0  # the cancelled long responses' tokens
    cancelled = [s for s in r.timeline if s.outcome == "cancelled"]
    assert len(cancelled) == 4


async def test_cancelling_a_step_parks_everything_with_its_tokens():
    buf, engines, mgr = make(SyncPolicy())
    task = asyncio.create_task(mgr.run_step(target=4, version=0))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    stats = buf.stats()
    assert stats["in_flight"] == 0 and stats["balanced"] and stats["dropped"] == 0
    assert stats["partial"] + stats["ready"] == 4
    assert sum(g.tokens for g in buf.queued(Place.PARTIAL)) > 0
    assert engines.aborts == 1 and not engines._running


async def test_a_failing_abort_still_parks_everything_and_is_raised():
    buf, engines, mgr = make(PartialPolicy(over_provision=2.0))

    async def unreachable() -> None:
        raise EngineError("fake0: connection refused")

    engines.abort_all = unreachable
    with pytest.raises(EngineError, match="connection refused"):
        await mgr.run_step(target=3, version=0)
    stats = buf.stats()
    assert stats["in_flight"] == 0 and stats["balanced"] and stats["dropped"] == 0
    assert stats["partial"] + stats["ready"] == 6
    assert sum(g.tokens for g in buf.queued(Place.PARTIAL)) > 0
    assert not engines._running


async def test_a_slow_reward_does_not_hold_the_abort():
    async def reward(sample, group):
        if sample.slot == 1 and group.group_id in (0, 1):
            await asyncio.sleep(30)  # a slow judge on the tail groups
        return 1.0

    buf, _, mgr = make(PartialPolicy(2.0), reward=reward, length=lambda s: 4 + 300 * (s.group_id < 2))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    r = await mgr.run_step(target=3, version=0)
    assert loop.time() - t0 < 10
    assert len(r.completed) >= 3 and buf.stats()["balanced"]


async def test_timeline_records_every_request():
    buf, engines, mgr = make(PartialPolicy(2.0))
    r = await mgr.run_step(target=3, version=0)
    assert len(r.timeline) == engines.requests
    assert {s.worker for s in r.timeline} == {"fake0", "fake1"}
    assert sum(s.tokens for s in r.timeline) == r.tokens_generated
    assert {s.outcome for s in r.timeline} <= {"stop", "length", "abort", "cancelled"}
    assert all(s.end >= s.start for s in r.timeline)


async def test_a_group_whose_requests_all_end_unfinished_is_parked_not_waited_for():
    """An engine that aborts requests on its own (restart, preemption): the step must not hang
    waiting for a group nothing works on any more."""
    class AbortingEngines(FakeEngines):
        async def generate(self, sample, sampling, *, max_new_tokens, version, worker=None):
            if sample.group_id == 0 and sample.requests == 0:
                sample.start_request()
                sample.append([1, 2], [-0.1, -0.2], version, finish_reason="abort")
                return "fake0"
            return await super().generate(sample, sampling, max_new_tokens=max_new_tokens,
                                          version=version, worker=worker)

    buf = RolloutBuffer(ListPromptSource(records_from_token_lists([[1, i] for i in range(9)]),
                                         shuffle=False), n_samples_per_prompt=2)
    mgr = RolloutManager(buf, AbortingEngines(lambda s: 6), SyncPolicy(), SamplingConfig(max_new_tokens=50),
                         RewardScheduler(constant_reward))
    r = await asyncio.wait_for(mgr.run_step(target=3, version=0), 10)
    # parked, then resumed first (with its two tokens) and finished in the same step
    assert sorted(r.completed) == [0, 1, 2]
    assert r.groups_launched == 4 and r.groups_resumed == 1
    g0 = next(g for g in buf.take_nowait(3) if g.group_id == 0)
    assert g0.samples[0].response_ids[:2] == [1, 2] and len(g0.samples[0].response_ids) == 6


async def test_an_unexpected_error_in_an_engine_fails_the_step_loudly():
    class Broken(FakeEngines):
        async def generate(self, sample, *a, **k):
            raise KeyError("bug in an engine wrapper")

    buf = RolloutBuffer(ListPromptSource(records_from_token_lists([[1]])), n_samples_per_prompt=1)
    mgr = RolloutManager(buf, Broken(lambda s: 3), SyncPolicy(), SamplingConfig(), RewardScheduler(constant_reward))
    with pytest.raises(KeyError, match="bug in an engine wrapper"):
        await asyncio.wait_for(mgr.run_step(target=1, version=0), 10)
    assert buf.stats()["balanced"] and buf.stats()["in_flight"] == 0


async def test_a_group_the_staleness_rule_drops_on_arrival_is_not_part_of_the_batch():
    """Weights that move while a group is generating (one-step async) can make it stale by the
    time it completes: the buffer drops it, and the step must not count it toward the target."""
    buf, engines, mgr = make(SyncPolicy(), max_staleness=0)

    async def bump_version_mid_step():
        while not engines._running:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.02)  # the short groups (8 tokens) are done, the long ones are not
        buf.set_version(1)  # new weights: what is generated from now on is version 1
        mgr.current.version = 1

    bumper = asyncio.create_task(bump_version_mid_step())
    r = await mgr.run_step(target=4, version=0)
    await bumper
    stats = buf.stats()
    # the long groups 0 and 1 arrived stale and were dropped; replacements made up the target
    assert sorted(r.completed) == [2, 3, 4, 5] and r.groups_launched == 6
    # (the bump's sweep also dropped 2 and 3, complete at version 0 but not yet trained)
    assert stats["dropped_by_reason"] == {"stale": 4} and stats["ready"] == 2
    assert [g.group_id for g in buf.take_nowait(2)] == [4, 5]
    assert stats["balanced"]


async def test_partial_under_a_lag_bound_waits_for_no_more_last_chance_groups_than_its_target():
    """One version ahead (async) under max_token_lag=1 every group is on its last chance: a
    surplus one would be trained a version later, past the bound, and restarted. The step
    launches only its target of them, over_provision notwithstanding, and completes exactly
    those (before, it launched 4 for a target of 2, waited for all and left 2 to restart)."""
    buf = RolloutBuffer(
        ListPromptSource(records_from_token_lists([[1, i] for i in range(20)]), shuffle=False),
        n_samples_per_prompt=2, max_staleness=5, max_token_lag=1)
    mgr = RolloutManager(buf, FakeEngines(lambda s: 8), PartialPolicy(over_provision=2.0),
                         SamplingConfig(max_new_tokens=100), RewardScheduler(constant_reward))
    buf.begin_production(1)  # engines at version 0, trained at 1: fresh tokens lag 2 there
    r = await mgr.run_step(target=2, version=0)
    assert (r.groups_launched, len(r.completed)) == (2, 2)
    buf.set_version(1)
    assert len(buf.take_nowait(2)) == 2 and buf.count(Place.READY) == 0
    buf.set_producer_version(1)
    buf.begin_production(2)
    r = await mgr.run_step(target=2, version=1)
    assert (r.groups_launched, len(r.completed)) == (2, 2)
    stats = buf.stats()
    assert stats["lag_restarts"] == 0 and stats["discarded_tokens"] == 0 and stats["balanced"]


async def test_partial_over_provisions_groups_that_may_wait_a_step_under_the_bound():
    """In sync mode a fresh group may be resumed once: over-provisioning is kept, the tail
    parked; next step the parked groups are on their last chance and are waited for."""
    def tail(sample):
        return 200 if sample.group_id in (0, 1) else 8

    buf = RolloutBuffer(
        ListPromptSource(records_from_token_lists([[1, i] for i in range(20)]), shuffle=False),
        n_samples_per_prompt=2, max_staleness=5, max_token_lag=1)
    mgr = RolloutManager(buf, FakeEngines(tail), PartialPolicy(over_provision=2.0),
                         SamplingConfig(max_new_tokens=300), RewardScheduler(constant_reward))
    r = await mgr.run_step(target=3, version=0)
    assert r.groups_launched == 6 and {g.group_id for g in buf.queued(Place.PARTIAL)} == {0, 1}
    buf.take_nowait(3)
    for v in (1,):
        buf.set_version(v)
        buf.set_producer_version(v)
        buf.begin_production(v)
    r = await mgr.run_step(target=3, version=1)
    assert {0, 1} <= set(r.completed)  # waited for: resumed again, their version-0 tokens lag 2
    assert buf.stats()["lag_restarts"] == 0 and buf.stats()["balanced"]
