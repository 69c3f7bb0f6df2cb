"""Engine faults in virtual time: the real manager, policies and health monitor over simulated
engines that are killed or hung in the middle of a step (rollout.health, rollout.manager)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlkit.buffers import ListPromptSource, RolloutBuffer, SampleStatus
from rlkit.buffers.source import records_from_token_lists
from rlkit.rollout.config import HealthConfig, SamplingConfig
from rlkit.rollout.health import EngineMonitor, EnginesDown
from rlkit.rollout.manager import RolloutManager, batch_target
from rlkit.rollout.policies import PartialPolicy, SyncPolicy
from rlkit.rollout.reward_scheduler import RewardScheduler
from rlkit.sim.clock import run_virtual
from rlkit.sim.engine import SimEngines, SimRestarter
from tests.manager.fakes import constant_reward
from tests.sim.helpers import cluster

MAX_NEW = 200
HEALTH = HealthConfig(interval_s=1.0, probe_timeout_s=2.0, hung_after_timeouts=2,
                      restart_backoff_s=1.0, max_restarts=2, wait_for_engine_s=120.0)


def make(policy, *, engines=2, rows=40, restart_s: float | None = 5.0, health=HEALTH, n=4):
    buf = RolloutBuffer(
        ListPromptSource(records_from_token_lists([[1, i] for i in range(rows)]), shuffle=False),
        n_samples_per_prompt=n, max_staleness=3,
    )
    sim = SimEngines(cluster(engines))
    restarter = SimRestarter(sim, restart_s) if restart_s is not None else None
    monitor = EngineMonitor(sim, health, restarter, needs_weights=False)
    mgr = RolloutManager(buf, sim, policy, SamplingConfig(max_new_tokens=MAX_NEW),
                         RewardScheduler(constant_reward), health=monitor)
    return buf, sim, monitor, mgr


def accounted(buf: RolloutBuffer) -> None:
    """Every group created is in exactly one place or dropped with a reason."""
    assert buf.stats()["balanced"]


def lost_spans(report):
    return [s for s in report.timeline if s.outcome == "lost"]


async def fault_after(seconds: float, fault) -> None:
    await asyncio.sleep(seconds)
    fault()


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_lost_engine_mid_step_loses_no_token_and_comes_back(fault):
    buf, sim, monitor, mgr = make(SyncPolicy())

    async def main():
        victim = sim.workers()[1]
        inject = asyncio.ensure_future(fault_after(0.5, lambda: getattr(sim, fault)(victim)))
        report = await mgr.run_step(8, 0)
        await inject
        await asyncio.sleep(30)  # the restart (backoff + 5 s start) lands meanwhile
        second = await mgr.run_step(8, 0)
        await mgr.close()
        await sim.aclose()
        return victim, report, second

    victim, report, second = run_virtual(main)
    # The step completed its target on the engine left; nothing was dropped.
    assert len(report.completed) == 8 and not report.dropped and report.engine_failures == 0
    lost = lost_spans(report)
    assert lost and all(s.worker == victim for s in lost)
    assert report.requests_relaunched == len(lost)
    # Each lost request went on elsewhere from where it stopped: no token generated twice.
    by_sample = {}
    for s in sorted(report.timeline, key=lambda s: s.start):
        by_sample.setdefault((s.group_id, s.sample_index), []).append(s)
    for s in lost:
        after = [x for x in by_sample[(s.group_id, s.sample_index)] if x.start >= s.end]
        assert after and after[0].worker != victim
        assert after[0].response_before == s.response_before + s.tokens
    assert report.relaunched_tokens == sum(s.response_before + s.tokens for s in lost)
    assert report.relaunched_tokens > 0  # the victim had streamed something
    for g in buf.take(8, timeout=0):
        assert all(len(s.response_ids) == MAX_NEW for s in g.samples)
    # The engine was restarted under a new id and serves again in the next step.
    assert monitor.counts["lost"] == 1 and monitor.counts["restarted"] == 1
    assert victim not in sim.workers() and len(sim.workers()) == 2
    new = next(w for w in sim.workers() if w.startswith(victim.split("~")[0]) and w != victim)
    assert any(s.worker == new for s in second.timeline)
    assert second.engines["engines/serving"] == 2 and second.engines["engines/restarted"] == 1
    accounted(buf)


def test_partial_policy_keeps_partials_and_relaunches_through_a_kill():
    buf, sim, monitor, mgr = make(PartialPolicy(over_provision=2.0))

    async def main():
        inject = asyncio.ensure_future(fault_after(0.3, lambda: sim.kill(sim.workers()[0])))
        reports = []
        for v in range(3):
            reports.append(await mgr.run_step(batch_target(buf, 4), v))
            assert len(buf.take(4, timeout=0)) == 4
        await inject
        await mgr.close()
        await sim.aclose()
        return reports

    reports = run_virtual(main)
    assert sum(r.requests_relaunched for r in reports) > 0
    assert not any(r.dropped for r in reports)
    accounted(buf)


def test_every_engine_down_parks_every_group_with_its_tokens():
    buf, sim, monitor, mgr = make(SyncPolicy(), restart_s=None)

    async def main():
        tokens_at_kill = {}

        def kill_all():
            for w in sim.workers():
                sim.kill(w)

        inject = asyncio.ensure_future(fault_after(0.5, kill_all))
        with pytest.raises(EnginesDown, match="every engine is down"):
            await mgr.run_step(8, 0)
        await inject
        await mgr.close()
        await sim.aclose()
        return tokens_at_kill

    run_virtual(main)
    st_ = buf.stats()
    assert st_["in_flight"] == 0 and st_["partial"] == 8 and st_["dropped"] == 0
    parked = buf.acquire(8)  # partials come back first, with what they had
    assert sum(len(s.response_ids) for g in parked for s in g.samples) > 0
    assert all(s.status in (SampleStatus.PARTIAL, SampleStatus.PENDING) for g in parked
               for s in g.samples)
    accounted(buf)


def test_a_failing_request_on_healthy_engines_still_fails_its_sample():
    """The monitor probes; every engine answers; the sample fails as before (no relaunch)."""
    buf, sim, monitor, mgr = make(SyncPolicy())
    real = sim.generate
    calls = {"n": 0}

    async def flaky(sample, sampling, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            sample.start_request()
            sample.interrupt()
            from rlkit.rollout.engine_api import EngineError
            raise EngineError("HTTP 400: bad request")
        return await real(sample, sampling, **kw)

    sim.generate = flaky  # type: ignore[method-assign]

    async def main():
        r = await mgr.run_step(4, 0)
        await mgr.close()
        await sim.aclose()
        return r

    report = run_virtual(main)
    assert report.engine_failures == 1 and report.dropped == {"engine_failed": 1}
    assert report.requests_relaunched == 0 and monitor.counts["lost"] == 0


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kills=st.lists(st.tuples(st.floats(0.05, 3.0), st.integers(0, 2), st.sampled_from(["kill", "hang"])),
               min_size=1, max_size=3),
    partial=st.booleans(),
)
def test_faults_at_any_time_lose_nothing(kills, partial):
    """Any faults at any times over three steps: every step completes its target (an engine
    always comes back), nothing is dropped, accounting balances, and every trained response
    is whole (generated exactly once to its budget)."""
    policy = PartialPolicy(over_provision=1.5) if partial else SyncPolicy()
    buf, sim, monitor, mgr = make(policy, engines=3, restart_s=2.0,
                                  health=HEALTH.model_copy(update={"max_restarts": 5}))

    async def inject():
        t = 0.0
        for at, which, kind in sorted(kills):
            await asyncio.sleep(at - t)
            t = at
            serving = sim.workers()
            if len(serving) > 1:  # keep one: a whole outage is the test above
                getattr(sim, kind)(serving[which % len(serving)])

    async def main():
        task = asyncio.ensure_future(inject())
        reports = []
        for v in range(3):
            reports.append(await mgr.run_step(batch_target(buf, 4), v))
            for g in buf.take(4, timeout=0):
                assert all(len(s.response_ids) == MAX_NEW and s.status is SampleStatus.TRUNCATED
                           for s in g.samples)
        await task
        await mgr.close()
        await sim.aclose()
        return reports

    reports = run_virtual(main)
    assert not any(r.dropped for r in reports)
    accounted(buf)


def test_engines_held_for_a_weight_sync_are_probed_for_an_answer_only():
    """A weight sync pauses every engine, and a paused engine queues generations: a generation
    probe would time out on all of them and declare them hung (a sync longer than
    hung_after_timeouts x probe_timeout_s, or one that failed and left them paused). Held,
    the monitor asks only that each answers: the paused one stays, the dead one is lost."""
    class PausedEngines:
        def __init__(self):
            self.up, self.dead, self.asked = ["a", "b"], {"b"}, []

        def workers(self):
            return list(self.up)

        async def probe(self, worker, timeout_s, *, generate=True):
            self.asked.append((worker, generate))
            if worker in self.dead:
                return f"{worker}: connection refused"
            return f"timeout: paused, {worker} queues it" if generate else None

        async def progress(self, worker, timeout_s):
            return None  # a paused engine reports nothing new

        async def remove_worker(self, worker):
            self.up.remove(worker)

        async def abort_worker(self, worker):
            return 0

    async def main():
        engines = PausedEngines()
        monitor = EngineMonitor(engines, HEALTH, None, needs_weights=False)
        monitor.hold(True)
        assert await monitor.sweep() == 1 and engines.up == ["a"]  # b is dead, a only paused
        assert all(not generate for _, generate in engines.asked)
        monitor.hold(False)
        assert await monitor.sweep() == 1 and engines.up == []  # not held: a would be hung
        return monitor

    monitor = run_virtual(main())
    assert monitor.counts["lost"] == 2
