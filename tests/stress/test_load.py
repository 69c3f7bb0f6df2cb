"""The load stress test (`python -m tests.stress.load`) at small scale: the invariants it reports hold (nothing lost, each group
taken once, loads back to zero, no re-submission, no hang), and its re-submission check
catches a client that does re-submit. Figures are reported by the bench, not asserted."""

from __future__ import annotations

import asyncio

import pytest

from tests.stress.load import (
    InstantEngines,
    LoadBenchError,
    bench_buffer_actor,
    counting_client_class,
    format_buffer,
    format_router,
    router_load,
)


def test_in_process_loop_takes_every_group_once():
    r = bench_buffer_actor(groups=100, samples=8, batch_size=32, loops=["in-process"])
    x = r["loops"]["in-process"]
    assert r["ok"] and r["groups"] == 128  # rounded up to whole steps
    assert x["accounting"]["consumed"] == x["accounting"]["created"] == 128
    assert x["samples"] == 128 * 8
    assert 64 * 128 * 8 <= x["tokens"] <= 4096 * 128 * 8
    assert "| in-process |" in format_buffer(r)


def test_unknown_driver_loop_is_refused():
    with pytest.raises(LoadBenchError, match="unknown driver loop"):
        bench_buffer_actor(groups=8, samples=2, batch_size=4, loops=["async"])


def test_instant_engines_are_deterministic_per_sample():
    from rlkit.buffers.sample import Sample, SampleStatus
    from rlkit.rollout.config import SamplingConfig

    def one(seed: int) -> Sample:
        s = Sample(index=3, group_id=0, prompt_ids=[1, 2])
        asyncio.run(InstantEngines(seed=seed).generate(s, SamplingConfig(), max_new_tokens=4096,
                                                       version=2))
        return s

    a, b = one(0), one(0)
    assert a.response_ids == b.response_ids and 64 <= len(a.response_ids) <= 4096
    assert a.status is SampleStatus.DONE and set(a.versions) == {2}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_groups_through_the_ray_actor_are_taken_exactly_once():
    r = bench_buffer_actor(groups=96, samples=8, batch_size=32, loops=["sync", "stream"])
    assert r["ok"]
    for loop in ("sync", "stream"):
        x = r["loops"][loop]
        a = x["accounting"]
        assert a["balanced"] and a["created"] == a["trained"] == a["consumed"] == 96
        assert not a["missing"] and not a["taken_twice"] and a["dropped"] == 0
        assert set(x["memory_mb"]) == {"driver", "rollout_actor", "consumer"}
        assert all(m["peak_mb"] > 0 for m in x["memory_mb"].values())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from rlkit.demo_models import build_tiny
    from rlkit.rollout.engines.config import EngineConfig, RouterConfig
    from rlkit.rollout.engines.fleet import EngineFleet

    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny(path, arch="qwen2")
    engine = EngineConfig(num_engines=2, cpu_threads=1, max_running_requests=16,
                          startup_timeout_s=300)
    with EngineFleet(str(path), engine, RouterConfig(),
                     log_dir=tmp_path_factory.mktemp("fleet-logs")) as f:
        yield f


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_streamed_requests_with_aborts_keep_every_invariant(fleet):
    r = asyncio.run(router_load(fleet, concurrency=16, max_new_tokens=128, cancel_fraction=0.25,
                                abort_alls=2, hang_timeout_s=300, seed=1))
    assert r.checks == {k: True for k in r.checks}, format_router(r.__dict__)
    assert r.ok and r.hung == 0 and not any(r.loads_after.values())
    assert r.abort_alls == 2 and r.resumptions > 0  # abort_all stopped requests mid-flight
    assert r.cancelled >= 1
    assert r.posts == r.generate_calls == r.router_generate_requests
    assert r.engine_reported_tokens == r.tokens > 0
    assert r.finished + r.cancelled + r.aborted_partial == 16


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resubmission_check_catches_a_client_that_resubmits(fleet):
    class Resubmitting(counting_client_class()):  # type: ignore[misc]
        """A faulty client: an aborted request is sent again inside the same generate call."""

        async def _generate_once(self, sample, *args, **kwargs):
            outcome = await super()._generate_once(sample, *args, **kwargs)
            if outcome is None and not sample.status.terminal:
                return await super()._generate_once(sample, *args, **kwargs)
            return outcome

    r = asyncio.run(router_load(fleet, concurrency=8, max_new_tokens=128, cancel_fraction=0.0,
                                abort_alls=1, hang_timeout_s=300, seed=2,
                                client_class=Resubmitting))
    assert r.abort_alls == 1
    assert r.resubmitted_samples and not r.checks["no_resubmission"] and not r.ok
    assert r.router_generate_requests == r.posts > r.generate_calls
