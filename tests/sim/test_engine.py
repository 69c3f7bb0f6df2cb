"""Simulated engines: timing model, work conservation, KV capacity, abort, determinism."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlkit.buffers.sample import Sample, SampleStatus
from rlkit.rollout.engine_api import EngineError, Engines
from rlkit.sim.clock import run_virtual
from rlkit.sim.engine import SimConfig, SimEngines
from rlkit.rollout.engines.profile import constant_profile
from tests.sim.helpers import SAMPLING, InvariantChecker, cluster, generate_all, small_profile


def test_implements_the_engines_protocol():
    assert isinstance(SimEngines(cluster()), Engines)


def test_one_request_takes_prefill_plus_every_decode_step():
    """The prefill forward samples the first token; n - 1 decode steps make the rest, step i
    attending to p + i tokens."""
    p, n = 30, 50
    prof = small_profile()

    async def main():
        engines = SimEngines(cluster(profile=prof))
        loop = asyncio.get_running_loop()
        [s] = await generate_all(engines, [p], [n])
        return loop.time(), s, engines.stats()["sim-0"]

    t, s, stats = run_virtual(main)
    expected = p * 1e-4 + (n - 1) * 0.010 + 1e-6 * ((n - 1) * p + n * (n - 1) / 2)
    assert t == pytest.approx(expected, rel=1e-9)
    assert s.status is SampleStatus.TRUNCATED and s.finish_reason == "length"
    assert len(s.response_ids) == n and s.versions == [0] * n
    assert stats.tokens == n and stats.decode_steps == n - 1
    assert stats.busy_s == pytest.approx(expected, rel=1e-9)


def test_continuous_batching_runs_requests_together():
    """Constant PTL, no KV term: makespan = one prefill (which makes every first token) + the
    longest budget's remaining steps."""
    prof = constant_profile(0.01, prefill_s_per_token=0.001)

    async def main():
        engines = SimEngines(SimConfig(1, prof))
        loop = asyncio.get_running_loop()
        samples = await generate_all(engines, [10, 20, 30], [5, 40, 20])
        return loop.time(), samples

    t, samples = run_virtual(main)
    assert t == pytest.approx(60 * 0.001 + 39 * 0.01)
    assert [len(s.response_ids) for s in samples] == [5, 40, 20]


workloads = st.fixed_dictionaries({
    "engines": st.integers(1, 3),
    "capacity": st.one_of(st.none(), st.integers(120, 600)),
    "reserve": st.sampled_from([0.0, 0.3, 1.0]),
    "router": st.sampled_from(["round_robin", "least_load"]),
    "stream": st.booleans(),
    "max_prefill": st.one_of(st.none(), st.integers(30, 200)),
    "cores": st.one_of(st.none(), st.sampled_from([1.0, 2.0])),
    "requests": st.lists(
        st.tuples(st.integers(1, 40), st.integers(1, 80), st.floats(0, 0.5)),
        min_size=1, max_size=25,
    ),
})


def _run_workload(w):
    checker = InvariantChecker()
    cfg = SimConfig(w["engines"], small_profile(), kv_capacity_tokens=w["capacity"],
                    reserve_ratio=w["reserve"], router=w["router"], stream_spans=w["stream"],
                    max_prefill_tokens=w["max_prefill"], cpu_cores=w["cores"],
                    chunk_cpu_s=0.002 if w["cores"] else 0.0)
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
    # the prefill's token, 10 steps done, the 11th finished
    assert {len(s.response_ids) for s in samples} == {12}
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
    assert a.status is SampleStatus.PARTIAL and len(a.response_ids) == 21  # prefill + 20 steps
    assert b.status is SampleStatus.TRUNCATED and len(b.response_ids) == 50
    assert stats.tokens == 71  # the cancelled request's tokens are counted, once


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
    assert t_one == pytest.approx(0.05 + 9 * 0.01)
    assert 0.2 <= t_abort <= 0.2 + 0.01 + 1e-9
    assert len(a.response_ids) == 10
    # on the engine from 0.05 s (first token), aborted at 0.11 s, exactly when its 6th step
    # ends: no step in progress
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
    # the prefill makes the first tokens; K of decode step i (1..9): paged 1010 + 2i, padded
    # 2 x (1000 + i)
    assert paged == pytest.approx(9 * 0.01 + 1e-5 * (9 * 1010 + 2 * 45))
    assert padded == pytest.approx(9 * 0.01 + 1e-5 * (9 * 2000 + 2 * 45))


def test_a_one_token_request_ends_with_its_prefill():
    prof = constant_profile(0.01, prefill_s_per_token=0.001)

    async def main():
        engines = SimEngines(SimConfig(1, prof))
        loop = asyncio.get_running_loop()
        [s] = await generate_all(engines, [20], [1])
        return loop.time(), s, engines.stats()["sim-0"]

    t, s, stats = run_virtual(main)
    assert t == pytest.approx(0.02)
    assert len(s.response_ids) == 1 and s.status is SampleStatus.TRUNCATED
    assert stats.decode_steps == 0 and stats.tokens == 1


@pytest.mark.parametrize("layout", ["padded", "paged"])
def test_prefill_forwards_padding_quadratic_cost_and_token_limit(layout):
    """Three requests arrive together. Padded: rows x longest <= 100 admits two prompts of 40
    in the first forward; the prompt of 10 waits one decode step for the second forward.
    Paged: 40 + 40 + 10 tokens fit one forward."""
    prof = constant_profile(0.01, prefill_s_per_forward=0.001, prefill_s_per_token=1e-5,
                            prefill_s_per_token_sq=1e-7, max_prefill_tokens=100)

    async def main():
        engines = SimEngines(SimConfig(1, prof, kv_layout=layout))
        loop = asyncio.get_running_loop()
        samples = await generate_all(engines, [40, 40, 10], [5, 5, 5])
        return loop.time(), samples, engines.stats()["sim-0"]

    t, samples, stats = run_virtual(main)
    assert [len(s.response_ids) for s in samples] == [5, 5, 5]
    if layout == "padded":
        first = 0.001 + 1e-5 * 2 * 40 + 1e-7 * 2 * 40 ** 2
        second = 0.001 + 1e-5 * 10 + 1e-7 * 10 ** 2
        # forward, one step, forward, then the third request's 4 remaining steps
        assert t == pytest.approx(first + 0.01 + second + 4 * 0.01)
        assert stats.prefill_s == pytest.approx(first + second)
    else:
        only = 0.001 + 1e-5 * 90 + 1e-7 * (2 * 40 ** 2 + 10 ** 2)
        assert t == pytest.approx(only + 4 * 0.01)
    assert stats.prefill_tokens == 90


def test_shared_cores_slow_busy_engines_and_an_idle_one_speeds_up_the_other():
    """One core for two engines: both run at half speed until the shorter request ends, then
    the other runs at full speed."""
    prof = constant_profile(0.01)

    async def main():
        engines = SimEngines(SimConfig(2, prof, cpu_cores=1.0))
        loop = asyncio.get_running_loop()
        ends = {}

        async def one(i, budget):
            s = Sample(i, i, [1])
            await engines.generate(s, SAMPLING, max_new_tokens=budget, version=0)
            ends[i] = loop.time()

        await asyncio.gather(one(0, 11), one(1, 21))  # round robin: one per engine
        return ends

    ends = run_virtual(main)
    assert ends[0] == pytest.approx(10 * 0.02)
    assert ends[1] == pytest.approx(10 * 0.02 + 10 * 0.01)


def test_background_load_and_serving_cpu_share_the_cores():
    prof = constant_profile(0.01)

    async def steps_time(**cfg):
        engines = SimEngines(SimConfig(1, prof, **cfg))
        loop = asyncio.get_running_loop()
        await generate_all(engines, [1], [11])
        return loop.time() / 10

    # 2 cores: 1 background thread + 1 engine fit; 3 background threads make the engine 2/4
    assert run_virtual(steps_time(cpu_cores=2.0, background_load=1.0)) == pytest.approx(0.01)
    assert run_virtual(steps_time(cpu_cores=2.0, background_load=3.0)) == pytest.approx(0.02)
    # serving CPU 5 ms per chunk of 1 token on a 10 ms step: demand 1.5 on one core
    assert run_virtual(steps_time(cpu_cores=1.0, chunk_cpu_s=0.005)) == pytest.approx(0.015)
    # the same per chunk of 5 tokens: demand 1.1
    assert run_virtual(steps_time(cpu_cores=1.0, chunk_cpu_s=0.005, stream_interval=5)) \
        == pytest.approx(0.011)


def test_abort_poll_follows_the_clients_back_off():
    """POST abort and GET loads take a round trip each; a busy worker is asked again after
    10 ms. Abort at 0.105 s: it lands at 0.106 and takes effect at the step boundary 0.11;
    the first loads (0.108) still sees it busy; the second round (0.119-0.123) sees it idle."""
    prof = constant_profile(0.01)
    cfg = SimConfig(1, prof, control_rtt_s=0.002, abort_poll_s=(0.01, 0.04))

    async def main():
        engines = SimEngines(cfg)
        loop = asyncio.get_running_loop()
        s = Sample(0, 0, [1])
        task = asyncio.create_task(engines.generate(s, SAMPLING, max_new_tokens=1000, version=0))
        await asyncio.sleep(0.105)
        await engines.abort_all()
        t = loop.time()
        await task
        return t, s

    t, s = run_virtual(main)
    assert t == pytest.approx(0.123)
    assert s.status is SampleStatus.PARTIAL and len(s.response_ids) == 12  # prefill + 11 steps


def test_config_from_a_profiles_serving_object():
    prof = constant_profile(0.01)
    prof.extra["serving"] = {"cpu_cores": 2, "chunk_cpu_s": 2e-4, "stream_interval": 8,
                             "abort_poll_s": [0.01, 0.2], "request_latency_s": 0.0015,
                             "note": "unknown keys are ignored"}
    cfg = SimConfig.from_profile(2, prof, request_latency_s=0.0)
    assert (cfg.cpu_cores, cfg.chunk_cpu_s, cfg.stream_interval) == (2, 2e-4, 8)
    assert cfg.abort_poll_s == (0.01, 0.2) and cfg.request_latency_s == 0.0
    assert SimConfig.from_profile(1, constant_profile(0.01)).cpu_cores is None
    with pytest.raises(ValueError):
        SimConfig(1, prof, abort_poll_s=(0.2, 0.01))


def test_engines_busy_together_interfere():
    """Two cores for two engines (no time-slicing) but 25% interference: steps take 1.25 x
    while both are busy."""
    prof = constant_profile(0.01)

    async def main():
        engines = SimEngines(SimConfig(2, prof, cpu_cores=2.0, cpu_interference=0.25))
        loop = asyncio.get_running_loop()
        ends = {}

        async def one(i, budget):
            await engines.generate(Sample(i, i, [1]), SAMPLING, max_new_tokens=budget, version=0)
            ends[i] = loop.time()

        await asyncio.gather(one(0, 11), one(1, 21))
        return ends

    ends = run_virtual(main)
    assert ends[0] == pytest.approx(10 * 0.0125)
    assert ends[1] == pytest.approx(10 * 0.0125 + 10 * 0.01)


def test_a_request_arriving_during_a_prefill_is_admitted_after_one_decode_step():
    prof = constant_profile(0.01, prefill_s_per_token=0.001)

    async def main():
        engines = SimEngines(SimConfig(1, prof))
        loop = asyncio.get_running_loop()
        a = asyncio.create_task(engines.generate(Sample(0, 0, [1] * 100), SAMPLING,
                                                 max_new_tokens=1000, version=0))
        await asyncio.sleep(0.05)  # a's prefill runs until 0.1
        b = Sample(1, 1, [1] * 10)
        await engines.generate(b, SAMPLING, max_new_tokens=5, version=0)
        t = loop.time()
        await engines.abort_all()
        await a
        return t, b

    t, b = run_virtual(main)
    # a's prefill to 0.1, one decode step to 0.11, b's prefill (10 tokens) to 0.12, 4 steps
    assert t == pytest.approx(0.16)
    assert len(b.response_ids) == 5


def test_new_weights_mid_request_stamp_the_tokens_decoded_after_them():
    """Async mode's mid-step sync: a request running when the weights change keeps its tokens
    and decodes the rest with the new version (SGLang's update keeps requests; rlkit's client
    stamps each chunk), at the step boundary after the update; timing is unchanged."""
    prof = constant_profile(0.01, prefill_s_per_token=0.0)

    async def main(update_at):
        engines = SimEngines(SimConfig(1, prof))
        loop = asyncio.get_running_loop()
        if update_at is not None:
            loop.call_later(update_at, engines.set_weights_version, 3)
        samples = await generate_all(engines, [4, 4], [100, 20])
        return loop.time(), samples

    t0, plain = run_virtual(lambda: main(None))
    t1, (long, short) = run_virtual(lambda: main(0.305))  # during the 31st decode step
    assert t1 == pytest.approx(t0)
    assert short.versions == [0] * 20  # finished before the update
    assert long.versions == [0] * 32 + [3] * 68  # the step in progress ends, then version 3
    assert [len(s.response_ids) for s in plain] == [100, 20]
