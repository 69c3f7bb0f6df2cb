"""Step events (what happened to which group, which workers it freed) and dynamic sampling
(the group filter) under every policy, over fake engines."""

import asyncio

import pytest

from rlkit.buffers import ListPromptSource, Place, RolloutBuffer
from rlkit.buffers.source import records_from_token_lists
from rlkit.rollout.config import SamplingConfig
from rlkit.rollout.filters import FilterFailure, GroupFilter, zero_variance
from rlkit.rollout.manager import EventKind, RolloutManager
from rlkit.rollout.policies import POLICY_NAMES, make_policy
from rlkit.rollout.policies.specs import policy_config
from rlkit.rollout.reward_scheduler import RewardScheduler
from tests.manager.fakes import FakeEngines


def lengths(sample) -> int:
    return (300 if sample.group_id % 5 == 1 else 8) + 2 * sample.slot


async def even_groups_all_equal(sample, group) -> float:
    """Even groups: every response scores 1 (zero variance); odd ones vary by slot."""
    return 1.0 if group.group_id % 2 == 0 else float(sample.slot % 2)


def make(policy, *, group_filter=None, reward=even_groups_all_equal, fail=lambda s: False, n=2):
    buf = RolloutBuffer(
        ListPromptSource(records_from_token_lists([[1, i] for i in range(64)]), shuffle=False),
        n_samples_per_prompt=n, max_staleness=10,
    )
    engines = FakeEngines(lengths, fail=fail)
    mgr = RolloutManager(buf, engines, policy, SamplingConfig(max_new_tokens=1000),
                         RewardScheduler(reward), group_filter=group_filter)
    return buf, engines, mgr


class Recorder:
    """A policy that launches four groups and records what next_event says of each."""

    name = "recorder"

    def __init__(self):
        self.events = []

    async def run(self, step):
        step.launch_all(step.buffer.acquire(4))
        while len(self.events) < 3:
            self.events.append(await step.next_event())
        await step.engines.abort_all()  # from outside the step: the long group ends unfinished
        self.events.append(await step.next_event())


async def test_next_event_says_what_happened_to_which_group_and_which_workers_it_freed():
    policy = Recorder()
    only_group_2 = GroupFilter(lambda g: g.group_id != 2, "no_two")
    buf, engines, mgr = make(policy, group_filter=only_group_2, reward=lambda s, g: _const(s),
                             fail=lambda s: s.group_id == 3)
    await mgr.run_step(target=4, version=0)
    kinds = {e.group.group_id: (e.kind, e.reason) for e in policy.events}
    assert kinds == {
        0: (EventKind.COMPLETED, None),
        1: (EventKind.PARKED, "interrupted"),
        2: (EventKind.FILTERED, "no_two"),
        3: (EventKind.DROPPED, "engine_failed"),
    }
    for e in policy.events:  # a request that failed through the router names no engine
        assert set(e.workers) <= set(engines.workers())
        assert e.workers or e.kind is EventKind.DROPPED
    assert buf.place_of(policy.events[-1].group) is Place.PARTIAL  # parked with its tokens
    assert buf.stats()["balanced"]


async def _const(sample) -> float:
    return 0.5


@pytest.mark.parametrize("spec", ["sync", "partial", "tail_batching", "tail_batching+resume"])
async def test_zero_variance_groups_never_reach_the_trainer_and_the_step_still_fills(spec):
    assert spec.split("+")[0] in POLICY_NAMES
    buf, _, mgr = make(make_policy(policy_config(spec)),
                       group_filter=GroupFilter(zero_variance, "zero_variance"))
    for version in range(3):
        r = await mgr.run_step(target=4, version=version)
        assert len(r.completed) >= 4
        ready = buf.take_nowait(4)
        assert len(ready) == 4
        for g in ready:
            rewards = {s.reward for s in g.samples}
            assert len(rewards) > 1, f"group {g.group_id} has zero variance"
        assert sum(r.filtered.values()) == r.filtered.get("all_equal", 0) > 0
        assert r.filtered_tokens > 0
        assert r.metrics()["rollout/filtered_groups"] == sum(r.filtered.values())
    stats = buf.stats()
    assert stats["dropped_by_reason"]["filtered:all_equal"] >= 3 and stats["balanced"]
    queued = buf.queued(Place.LONG) + buf.queued(Place.PARTIAL)
    # a filtered (even) prompt is never queued again; only unfinished groups wait
    assert all(g.group_id % 2 == 1 or not g.trainable for g in queued)


async def test_a_filter_that_raises_fails_the_step_naming_it_and_loses_nothing():
    def broken(group):
        raise KeyError("rewards")

    buf, _, mgr = make(make_policy(policy_config("partial")),
                       group_filter=GroupFilter(broken, "my_pkg:broken"))
    with pytest.raises(FilterFailure, match=r"filter 'my_pkg:broken' raised on group \d+: KeyError"):
        await mgr.run_step(target=3, version=0)
    stats = buf.stats()
    assert stats["balanced"] and stats["dropped"] == 0 and stats["in_flight"] == 0


async def test_a_filter_returning_neither_a_bool_nor_a_reason_is_refused():
    buf, _, mgr = make(make_policy(policy_config("sync")),
                       group_filter=GroupFilter(lambda g: 3, "numeric"))
    with pytest.raises(FilterFailure, match="returned 3 .* expected True"):
        await mgr.run_step(target=2, version=0)
    assert buf.stats()["balanced"]


async def test_a_filter_that_rejects_everything_stands_down_instead_of_sampling_forever():
    reject_all = GroupFilter(lambda g: False, "nothing_passes", max_filtered_ratio=1.5)
    buf, _, mgr = make(make_policy(policy_config("sync")), group_filter=reject_all)
    r = await asyncio.wait_for(mgr.run_step(target=4, version=0), 30)
    assert len(r.completed) == 4 and r.filtered == {"nothing_passes": 6}
    assert r.filter_exhausted == 4 and r.metrics()["rollout/filter_exhausted"] == 4
    assert buf.stats()["balanced"]


async def test_groups_ready_from_the_last_step_count_toward_the_next_target():
    from rlkit.rollout.manager import batch_target

    buf, engines, mgr = make(make_policy(policy_config("partial@3.0")))
    await mgr.run_step(target=2, version=0)
    surplus = buf.count(Place.READY) - 2
    buf.take_nowait(2)
    assert batch_target(buf, 2) == max(0, 2 - surplus)
    if surplus >= 2:  # the batch is already there: nothing is launched
        requests = engines.requests
        r = await mgr.run_step(target=batch_target(buf, 2), version=1)
        assert engines.requests == requests and r.groups_launched == 0
    for version in range(1, 6):  # the ready queue never grows past one batch
        await mgr.run_step(target=batch_target(buf, 2), version=version)
        assert len(buf.take_nowait(2)) == 2
        assert buf.count(Place.READY) < 2 + 6
