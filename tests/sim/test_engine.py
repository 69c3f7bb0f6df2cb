"""Simulated engines: timing model, work conservation, KV capacity, abort, determinism."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from buffers.sample import Sample, SampleStatus
from rollout.engine_api import EngineError, Engines
from rollout.sim.clock import run_virtual
from rollout.sim.engine import SimConfig, SimEngines
from rollout.sim.profile import constant_profile
from tests.sim.helpers import SAMPLING, InvariantChecker, cluster, generate_all, small_profile


def test_implements_the_engines_protocol():
    assert isinstance(SimEngines(cluster()), Engines)


def test_one_request_takes_prefill_plus_every_decode_step():
    p, n = 30, 50
    prof = small_profile()

    async def main():
        engines = SimEngines(cluster(profile=prof))
        loop = asyncio.get_running_loop()
        [s] = await generate_all(engines, [p], [n])
        return loop.time(), s, engines.stats()["sim-0"]

    t, s, stats = run_virtual(main)
    expected = p * 1e-4 + n * 0.010 + 1e-6 * (n * p + n * (n - 1) / 2)
    assert t == pytest.approx(expected, rel=1e-9)
    assert s.status is SampleStatus.TRUNCATED and s.finish_reason == "length"
    assert len(s.response_ids) == n and s.versions == [0] * n
    assert stats.tokens == n and stats.decode_steps == n
    assert stats.busy_s == pytest.approx(expected, rel=1e-9)


def test_continuous_batching_runs_requests_together():
    """Constant PTL, no KV term: makespan = one prefill + the longest budget's steps."""
    prof = constant_profile(0.01, prefill_s_per_token=0.001)

    async def main():
        engines = SimEngines(SimConfig(1, prof))
        loop = asyncio.get_running_loop()
        samples = await generate_all(engines, [10, 20, 30], [5, 40, 20])
        return loop.time(), samples

    t, samples = run_virtual(main)
    assert t == pytest.approx(60 * 0.001 + 40 * 0.01)
    assert [len(s.response_ids) for s in samples] == [5, 40, 20]


workloads = st.fixed_dictionaries({
    "engines": st.integers(1, 3),
    "capacity": st.one_of(st.none(), st.integers(120, 600)),
    "reserve": st.sampled_from([0.0, 0.3, 1.0]),
    "router": st.sampled_from(["round_robin", "least_load"]),
    "stream": st.booleans(),
    "requests": st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 80), st.floats(0, 0.5)),
        min_size=1, max_size=25,
    ),
})


def _run_workload(w):
    checker = InvariantChecker()
    cfg = SimConfig(w["engines"], small_profile(), kv_capacity_tokens=w["capacity"],
                    reserve_ratio=w["reserve"], router=w["router"], stream_spans=w["stream"])
    prompts = [p for p, _, _ in w["requests"]]
    budgets = [b for _, b, _ in w["requests"]]
    arrivals = [a for _, _, a in w["requests"]]

    async def main():
        engines = SimEngines(cfg, observer=checker)
        samples = await generate_all(engines, prompts, budgets, arrivals)
        stats = engines.stats()
        segments = engines.drain_segments()
        await engines.aclose()
        return samples, stats, segments

    samples, stats, segments = run_virtual(main)
    return cfg, checker, budgets, samples, stats, segments


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads)
def test_work_conservation_capacity_and_no_idle_with_work(w):
    cfg, checker, budgets, samples, stats, segments = _run_workload(w)
    # every request generates exactly its budget, no token lost or invented
    assert [len(s.response_ids) for s in samples] == budgets
    assert all(s.status is SampleStatus.TRUNCATED for s in samples)
    assert sum(st_.tokens for st_ in stats.values()) == sum(budgets)
    per_sample: dict[int, int] = {}
    for seg in segments:
        per_sample[seg.sample_index] = per_sample.get(seg.sample_index, 0) + seg.tokens
    assert [per_sample[s.index] for s in samples] == budgets
    # the KV capacity is never exceeded, at any event (the checker also asserts it)
    if cfg.capacity is not None:
        assert max(checker.max_kv.values()) <= cfg.capacity
    assert checker.events > 0


@settings(max_examples=15, deadline=None)
@given(workloads)
def test_same_workload_same_result(w):
    *_, segments_a = _run_workload(w)
    *_, segments_b = _run_workload(w)
    assert segments_a == segments_b


def test_preemption_under_kv_pressure_keeps_tokens_and_capacity():
    checker = InvariantChecker()
    cfg = SimConfig(1, small_profile(), kv_capacity_tokens=100, reserve_ratio=0.0)

    async def main():
        engines = SimEngines(cfg, observer=checker)
        samples = await generate_all(engines, [10] * 4, [60] * 4)
        return samples, engines.stats()["sim-0"], engines.drain_segments()

    samples, stats, segments = run_virtual(main)
    assert [len(s.response_ids) for s in samples] == [60] * 4
    assert stats.preemptions > 0
    assert any(seg.outcome == "preempt" for seg in segments)
    assert checker.max_kv["sim-0"] <= 100
    # a preempted request is re-prefilled with its response: prefill exceeds the prompts
    assert stats.prefill_tokens > 40


def test_a_request_larger_than_the_kv_cache_is_refused():
    async def main():
        engines = SimEngines(SimConfig(1, small_profile(), kv_capacity_tokens=50))
        s = Sample(0, 0, [1] * 20)
        with pytest.raises(EngineError, match="KV"):
            await engines.generate(s, SAMPLING, max_new_tokens=40, version=0)

    run_virtual(main)


def test_abort_all_ends_everything_within_one_step_and_keeps_tokens():
    prof = constant_profile(0.01)

    async def main():
        engines = SimEngines(SimConfig(2, prof))
        loop = asyncio.get_running_loop()
        samples = [Sample(i, i, [1] * 5) for i in range(6)]
        tasks = [asyncio.create_task(
            engines.generate(s, SAMPLING, max_new_tokens=1000, version=3)) for s in samples]
        await asyncio.sleep(0.105)
        t_abort = loop.time()
        await engines.abort_all()
        t_idle = loop.time()
        served = await asyncio.gather(*tasks)
        loads = await engines.loads()
        # the engines take new work after an abort
        again = Sample(99, 99, [1] * 5)
        await engines.generate(again, SAMPLING, max_new_tokens=3, version=4)
        return samples, served, t_abort, t_idle, loads, again

    samples, served, t_abort, t_idle, loads, again = run_virtual(main)
    assert t_idle - t_abort <= 0.01 + 1e-9  # at most the step in progress
    assert all(s.status is SampleStatus.PARTIAL for s in samples)
    assert {len(s.response_ids) for s in samples} == {11}  # 10 steps done, the 11th finished
    assert all(v == 3 for s in samples for v in s.versions)
    assert set(served) == {"sim-0", "sim-1"}
    assert loads == {"sim-0": 0, "sim-1": 0}
    assert len(again.response_ids) == 3 and again.status is SampleStatus.TRUNCATED


def test_cancelling_a_request_keeps_its_tokens_and_leaves_others_running():
    prof = constant_profile(0.01)

    async def main():
        engines = SimEngines(SimConfig(1, prof))
        a, b = Sample(0, 0, [1]), Sample(1, 1, [1])
        ta = asyncio.create_task(engines.generate(a, SAMPLING, max_new_tokens=100, version=0))
        tb = asyncio.create_task(engines.generate(b, SAMPLING, max_new_tokens=50, version=0))
        await asyncio.sleep(0.205)
        ta.cancel()
        with pytest.raises(asyncio.CancelledError):
            await ta
        await tb
        return a, b, engines.stats()["sim-0"]

    a, b, stats = run_virtual(main)
    assert a.status is SampleStatus.PARTIAL and len(a.response_ids) == 20
    assert b.status is SampleStatus.TRUNCATED and len(b.response_ids) == 50
    assert stats.tokens == 70  # the cancelled request's tokens are counted, once


def test_routing():
    async def main():
        rr = SimEngines(SimConfig(3, small_profile()))
        samples = [Sample(i, i, [1]) for i in range(6)]
        served = [await rr.generate(s, SAMPLING, max_new_tokens=1, version=0) for s in samples]
        pinned = await rr.generate(Sample(9, 9, [1]), SAMPLING, max_new_tokens=1, version=0,
                                   worker="sim-2")
        with pytest.raises(EngineError, match="unknown worker"):
            await rr.generate(Sample(10, 10, [1]), SAMPLING, max_new_tokens=1, version=0,
                              worker="nope")
        return served, pinned

    served, pinned = run_virtual(main)
    assert served == ["sim-0", "sim-1", "sim-2"] * 2
    assert pinned == "sim-2"


def test_serving_overheads_delay_requests_and_aborts():
    prof = constant_profile(0.01)
    cfg = SimConfig(1, prof, request_latency_s=0.05, abort_latency_s=0.2)

    async def main():
        engines = SimEngines(cfg)
        loop = asyncio.get_running_loop()
        a = Sample(0, 0, [1])
        await engines.generate(a, SAMPLING, max_new_tokens=10, version=0)
        t_one = loop.time()
        b, c = Sample(1, 1, [1]), Sample(2, 2, [1])
        tb = asyncio.create_task(engines.generate(b, SAMPLING, max_new_tokens=100, version=0))
        await asyncio.sleep(0.1)
        tc = asyncio.create_task(engines.generate(c, SAMPLING, max_new_tokens=100, version=0))
        await asyncio.sleep(0.01)  # c is still on its way
        t0 = loop.time()
        await engines.abort_all()
        t_abort = loop.time() - t0
        await asyncio.gather(tb, tc)
        return t_one, t_abort, a, b, c

    t_one, t_abort, a, b, c = run_virtual(main)
    assert t_one == pytest.approx(0.05 + 10 * 0.01)
    assert 0.2 <= t_abort <= 0.2 + 0.01 + 1e-9
    assert len(a.response_ids) == 10
    # on the engine from 0.05 s, aborted at 0.11 s: 6 steps done and the 7th in progress
    assert b.status is SampleStatus.PARTIAL and len(b.response_ids) == 7
    assert c.status is SampleStatus.PENDING and c.response_ids == []


def test_padded_kv_layout_charges_every_row_the_longest_context():
    prof = constant_profile(0.01, kv_s_per_token=1e-5)

    async def run_layout(layout):
        engines = SimEngines(SimConfig(1, prof, kv_layout=layout))
        loop = asyncio.get_running_loop()
        await generate_all(engines, [1000, 10], [10, 10])
        return loop.time()

    paged = run_virtual(run_layout("paged"))
    padded = run_virtual(run_layout("padded"))
    # K per step: paged 1010 + 2i, padded 2 x (1000 + i)
    assert paged == pytest.approx(10 * 0.01 + 1e-5 * (10 * 1010 + 2 * 45))
    assert padded == pytest.approx(10 * 0.01 + 1e-5 * (10 * 2000 + 2 * 45))
