"""Ranked dispatch (StreamRL): the cost models, placement of every request, long-tail engines,
longest-first admission, the admission gate's invariants; and the ranker feeding tail batching
(proactive deferral) and partial rollouts (adaptive over-provisioning)."""

from __future__ import annotations

import asyncio
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from rlkit.buffers.group import Group, PromptRecord
from rlkit.rollout.dispatch import AdmissionGate, Dispatcher, EngineModel, InFlightSizer, LengthWindow
from rlkit.rollout.policies import PartialPolicy, RankedDispatchPolicy, SyncPolicy, TailBatchingPolicy
from rlkit.rollout.rankers.basic import PromptLengthRanker
from rlkit.sim.oracle import OracleRanker
from rlkit.sim.clock import run_virtual
from rlkit.sim.engine import SimConfig
from rlkit.sim.simulate import run_simulation
from rlkit.rollout.engines.profile import constant_profile
from rlkit.sim.trace import TraceSpec, generate_trace

TRACE = generate_trace(TraceSpec(rows=256, epochs=2, cap=2048, group_size=4, batch_size=8))
PROFILE = constant_profile([0.004, 0.006, 0.012], [1, 16, 64], kv_s_per_token=2e-8,
                           max_running_requests=64)


def group(gid: int, predicted: float, n: int = 2) -> Group:
    g = Group.new(gid, PromptRecord((1, 2), ""), n, gid * n, 0)
    g.predicted_length = predicted
    return g


def test_makespan_follows_the_shrinking_batch():
    flat = EngineModel(slots=8)
    assert flat.makespan([10, 20]) == 20  # 10 steps at batch 2, 10 at batch 1
    linear = EngineModel(slots=8, ptl=lambda b, kv: float(b))
    assert linear.makespan([10, 20]) == 10 * 2 + 10 * 1
    assert EngineModel(slots=1).makespan([10, 20]) == 30  # one at a time


def test_streamrl_algorithm_2_splits_and_the_fluid_model_may_not():
    lengths = LengthWindow(100)
    lengths.add([100] * 50 + [4000] * 10)
    groups = [group(i, 4000 if i < 2 else 100) for i in range(10)]
    engine = EngineModel(slots=64, ptl=lambda b, kv: 0.002 + 0.0001 * b)
    published = Dispatcher(engine, alpha=0.2, cost_model="streamrl")
    plan = published.plan(["a", "b", "c", "d"], groups, 2, lengths)
    assert 1 <= len(plan.long_workers) <= 3 and plan.threshold == 4000
    assert set(published.place(groups[0], 2, {})) <= set(plan.long_workers)
    assert set(published.place(groups[5], 2, {})) <= set(plan.regular_workers)
    # fluid: no split before the ranker has shown it finds the long tail
    fluid = Dispatcher(engine, alpha=0.2, cost_model="fluid")
    assert fluid.plan(["a", "b", "c", "d"], groups, 2, lengths).long_workers == ()
    # ... and a split only where the makespan model says it pays
    for g in groups * 3:
        g.samples[0].response_ids = [1] * int(g.predicted_length)
        fluid.observe(g)
    assert fluid.recall() == 1.0
    assert fluid.plan(["a", "b", "c", "d"], groups, 2, lengths).cost > 0


def test_requests_of_a_group_spread_over_its_pool_by_in_flight_counts():
    d = Dispatcher(EngineModel(slots=8), alpha=0.5, cost_model="streamrl")
    lengths = LengthWindow(10)
    lengths.add([1, 100])
    d.plan(["a", "b", "c"], [group(0, 100), group(1, 1)], 4, lengths)
    regular = d.plan_.regular_workers
    assert d.place(group(2, 1), 4, {w: 0 for w in regular}) == [regular[i % len(regular)]
                                                                 for i in range(4)]
    busy = {regular[0]: 5}
    assert regular[0] not in d.place(group(3, 1), 1, busy)


def run_ranked(policy, *, steps=4, timeline=None, engines=4, trace=TRACE, batch=8):
    return run_simulation(SimConfig(engines, PROFILE), trace, policy, steps=steps,
                          batch_size=batch, ranker=OracleRanker(trace), timeline_path=timeline,
                          final_step=False)


def test_long_tail_requests_run_on_the_dedicated_engines_and_every_request_is_placed(tmp_path):
    dispatcher = Dispatcher(EngineModel(slots=64, ptl=PROFILE.ptl), alpha=0.25,
                            cost_model="streamrl")
    plans = []

    class Spy(SyncPolicy):
        async def run(self, step):
            await super().run(step)
            plans.append(dispatcher.plan_)

    tl = tmp_path / "timeline.jsonl"
    results = run_ranked(RankedDispatchPolicy(Spy(), dispatcher), timeline=tl)
    spans = [json.loads(x) for x in tl.read_text().splitlines() if '"kind"' not in x]
    assert spans and all(s["worker"] for s in spans)  # nothing left to the router
    assert results[0].long_engines == 0  # no lengths known yet: no split
    split_steps = [r.step for r in results if r.long_engines]
    assert split_steps, "the published model always splits once lengths are known"
    for step in split_steps:
        plan = plans[step]
        long_groups = {gid for gid, p in results[step].group_predictions if p >= plan.threshold}
        assert long_groups
        for s in spans:
            if s["step"] == step:
                in_long = s["worker"] in plan.long_workers
                assert in_long == (s["group_id"] in long_groups), s


def test_longest_predicted_work_is_admitted_first_within_an_engine():
    dispatcher = Dispatcher(EngineModel(slots=2), alpha=0.2)
    gates = {}

    class Spy(SyncPolicy):
        async def run(self, step):
            await super().run(step)
            gates.update(step.requests.gates)

    run_ranked(RankedDispatchPolicy(Spy(), dispatcher), steps=2)
    assert gates
    for gate in gates.values():
        queued = gate.admitted[gate.slots:]  # the first `slots` entered at once
        assert queued == sorted(queued, reverse=True) or len(set(queued)) < len(queued)


def test_under_partial_the_dispatcher_keeps_the_policys_order_and_admits_first_come():
    """A partial step ends at its target: LPT would put the resumed groups (closest to done,
    APRIL resumes them first) last, so a dispatcher that does not split only places."""
    resumed = group(1, predicted=500.0)
    for s in resumed.samples:
        s.response_ids.extend([7] * 450)  # 50 tokens left
    fresh_long, fresh_short = group(2, predicted=900.0), group(3, predicted=100.0)
    groups = [resumed, fresh_long, fresh_short]
    lpt = Dispatcher(EngineModel(slots=2))
    assert lpt.order(groups) == [fresh_long, fresh_short, resumed]
    assert lpt.priority(fresh_long) > lpt.priority(resumed)
    place_only = Dispatcher(EngineModel(slots=2), split=False)
    assert place_only.order(groups) == groups
    assert {place_only.priority(g) for g in groups} == {0.0}  # the gate's ties: arrival order


@settings(max_examples=60)
@given(slots=st.integers(1, 4), works=st.lists(st.floats(1, 1000), min_size=1, max_size=25),
       holds=st.lists(st.floats(0.01, 5.0), min_size=25, max_size=25),
       cancel=st.sets(st.integers(0, 24)), close_at=st.none() | st.floats(0.5, 20.0))
def test_the_gate_never_exceeds_its_slots_and_never_idles_while_work_waits(
        slots, works, holds, cancel, close_at):
    async def main():
        gate = AdmissionGate(slots)
        admitted = []

        def check():
            waiting = [f for _, _, f in gate._waiting if not f.done()]
            assert 0 <= gate.running <= slots
            assert gate.running == slots or not waiting, "a free slot while work waits"

        async def request(i, work):
            await asyncio.sleep(i * 0.1)
            try:
                await gate.acquire(work)
            except Exception:  # GateClosed
                return
            try:
                check()
                admitted.append(work)
                await asyncio.sleep(holds[i])
            finally:
                gate.release()
            check()

        tasks = [asyncio.ensure_future(request(i, w)) for i, w in enumerate(works)]
        await asyncio.sleep(0.05)
        for i in cancel:
            if i < len(tasks):
                tasks[i].cancel()
        if close_at is not None:
            await asyncio.sleep(close_at)
            gate.close()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, AssertionError):
                raise r
        assert gate.running == 0 and not [f for _, _, f in gate._waiting if not f.done()]

    run_virtual(asyncio.wait_for(main(), 1000))


def test_the_gate_admits_the_longest_waiting_work_first():
    async def main():
        gate = AdmissionGate(1)
        await gate.acquire(1.0)
        waiters = [asyncio.ensure_future(gate.acquire(w)) for w in (5.0, 50.0, 20.0)]
        await asyncio.sleep(0)
        for _ in waiters:
            gate.release()
            await asyncio.sleep(0)
        await asyncio.gather(*waiters)
        return gate.admitted

    assert run_virtual(main()) == [1.0, 50.0, 20.0, 5.0]


def test_proactive_tail_batching_never_runs_a_prompt_predicted_long_in_a_short_round(tmp_path):
    seen = []

    class Spy(TailBatchingPolicy):
        def _skip_predicted_long(self, step, groups):
            keep, deferred = super()._skip_predicted_long(step, groups)
            threshold = self.long_threshold(step)
            if threshold is not None:
                seen.append((threshold, [g.predicted_length for g in keep],
                             [g for g in groups if g not in keep]))
            return keep, deferred

    buf_steps = run_simulation(SimConfig(4, PROFILE), TRACE, Spy(proactive=True), steps=12,
                               batch_size=8, ranker=OracleRanker(TRACE), final_step=False)
    assert seen and any(d for _, _, d in seen), "nothing was ever predicted long"
    for threshold, kept, deferred in seen:
        assert all(p < threshold for p in kept)
        assert all(g.predicted_length >= threshold and g.lane.value == "long" for g in deferred)
    short = [r for r in buf_steps if r.round == "short"]
    reactive = run_simulation(SimConfig(4, PROFILE), TRACE, TailBatchingPolicy(), steps=12,
                              batch_size=8, ranker=OracleRanker(TRACE), final_step=False)
    # with the long ones gone before they start, short rounds train shorter responses
    assert max(r.max_response_length for r in short) <= max(
        r.max_response_length for r in reactive if r.round == "short")


def test_adaptive_over_provisioning_stays_in_bounds_and_launches_fewer_on_saturated_engines():
    saturated = EngineModel(slots=64, ptl=lambda b, kv: 0.001 * b)  # throughput flat in b
    roomy = EngineModel(slots=64)  # no latency model: every slot counts
    launched = {}
    for name, engine in (("saturated", saturated), ("roomy", roomy)):
        policy = PartialPolicy(sizer=InFlightSizer(engine, 0.9), min_factor=1.0, max_factor=3.0)
        results = run_simulation(SimConfig(2, PROFILE), TRACE, policy, steps=6, batch_size=8,
                                 ranker=OracleRanker(TRACE), final_step=False)
        launched[name] = [r.groups_completed + r.groups_carried_over for r in results[1:]]
    assert all(8 <= k <= 24 for k in launched["saturated"] + launched["roomy"])
    assert sum(launched["saturated"]) < sum(launched["roomy"])


def test_a_ranker_that_predicts_everything_long_neither_stalls_nor_drains_the_data():
    class Alarmist(PromptLengthRanker):
        def predict(self, groups):
            return [1e9] * len(groups)

    results = run_simulation(SimConfig(2, PROFILE), TRACE, TailBatchingPolicy(proactive=True),
                             steps=8, batch_size=8, ranker=Alarmist(), final_step=False)
    assert all(r.groups_completed >= 8 for r in results)
    # a short round defers at most 4 x its launch (10) up front, then runs what it draws
    # (plus what it defers reactively at its end, at most its launch)
    assert all(r.prompts_deferred <= 40 + 10 for r in results)
