"""A busy engine is not a hung one (rollout.health): a generation probe that times out behind the
engine's own work is judged by the engine's progress (`Engines.progress`), as SGLang's
/health_generate judges its own; only a timeout without progress counts toward
hung_after_timeouts. A stopped engine makes none and answers nothing, so it is still found hung.

Two halves: a real built-in tiny engine kept busy (its queue full behind 4 running requests) and
then SIGSTOPped, watched by the monitor over the real EngineClient; and the same two facts over
simulated engines in virtual time, whose probes queue as a real engine's do
(SimConfig.probe_queues). Every wait is on a condition the monitor reports, bounded."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from rlkit.buffers.sample import Sample
from rlkit.rollout.config import HealthConfig, SamplingConfig
from rlkit.rollout.engines.config import EngineConfig
from rlkit.rollout.engines.process import start_hf_server
from rlkit.rollout.health import EngineMonitor
from rlkit.rollout.http.client import EngineClient
from rlkit.rollout.http.protocol import progress_mark
from rlkit.sim.clock import run_virtual
from rlkit.sim.engine import SimEngines
from tests.sim.helpers import cluster

HUNG_AFTER = 2
BUSY_ROUNDS = 4  # busy probes to see before the engine is stopped: twice what declared it hung


async def until(condition, timeout_s: float, what: str, step_s: float = 0.05) -> None:
    """Wait for `condition()`, failing with `what` after `timeout_s` (of the loop's clock)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(step_s)


class Recorded:
    """Wraps an Engines' probe to record each answer (None, or why not)."""

    def __init__(self, engines) -> None:
        self.answers: list[str | None] = []
        self._probe = engines.probe
        engines.probe = self

    async def __call__(self, worker, timeout_s, *, generate=True):
        why = await self._probe(worker, timeout_s, generate=generate)
        self.answers.append(why)
        return why

    def timeouts_in_a_row(self) -> int:
        best = run = 0
        for why in self.answers:
            run = run + 1 if why is not None and why.startswith("timeout") else 0
            best = max(best, run)
        return best


def test_progress_mark_reads_each_entrys_scheduler_time_and_nothing_else():
    # SGLang 0.5.23: {"timestamp": ISO string, ..., "loads": [LoadSnapshot.to_dict(), ...]}
    a = {"timestamp": "2026-11-28T00:00:00+00:00", "loads": [{"dp_rank": 0, "timestamp": 10.5},
                                                             {"dp_rank": 1, "timestamp": 20.25}]}
    assert progress_mark(a) == 10_500_000 + 20_250_000
    b = {"loads": [{"dp_rank": 0, "timestamp": 10.5}, {"dp_rank": 1, "timestamp": 20.5}]}
    assert progress_mark(b) != progress_mark(a)
    assert progress_mark([{"num_reqs": 3, "timestamp": 1.0}]) == 1_000_000  # list shape
    # No scheduler time: progress cannot be told. A bare dict's timestamp is the answer's own.
    assert progress_mark({"loads": [{"num_running_reqs": 1}]}) is None
    assert progress_mark({"timestamp": 5.0, "num_running_reqs": 1}) is None
    assert progress_mark({"loads": [{"timestamp": True}]}) is None
    assert progress_mark("busy") is None and progress_mark(None) is None


# -- a real built-in engine --------------------------------------------------------------------
@pytest.fixture
def engine(tiny_model_dir, tmp_path):
    config = EngineConfig(num_engines=1, cpu_threads=1, max_running_requests=4,
                          startup_timeout_s=120)
    proc = start_hf_server(str(tiny_model_dir), config, log_path=Path(tmp_path) / "engine.log")
    try:
        yield proc
    finally:
        proc.kill()  # a stopped group too (SIGKILL needs no SIGCONT)
        proc.stop()


def _settled(tasks: set[asyncio.Task]):
    def done(t: asyncio.Task) -> None:
        tasks.discard(t)
        if not t.cancelled():
            t.exception()  # WorkerLost once the stopped engine is declared lost: expected
    return done


async def keep_busy(client: EngineClient, url: str, stop: asyncio.Event, in_flight: int = 24):
    """Keep `in_flight` long requests on the engine (4 run, the rest queue) until `stop`."""
    sampling = SamplingConfig(max_new_tokens=300, ignore_eos=True)
    tasks: set[asyncio.Task] = set()
    made = 0
    try:
        while not stop.is_set():
            while len(tasks) < in_flight:
                s = Sample(index=made, group_id=made, prompt_ids=[5, 9, 13, made % 97])
                t = asyncio.ensure_future(client.generate(s, sampling, max_new_tokens=300,
                                                          version=0, worker=url))
                tasks.add(t)
                t.add_done_callback(_settled(tasks))
                made += 1
            await asyncio.wait([*tasks, asyncio.ensure_future(stop.wait())],
                               return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.integration
@pytest.mark.timeout(300)
async def test_a_busy_real_engine_is_not_hung_and_the_same_engine_stopped_is(engine):
    url = engine.url
    health = HealthConfig(interval_s=0.2, probe_timeout_s=0.5, hung_after_timeouts=HUNG_AFTER,
                          max_restarts=0)
    client = await EngineClient(None, worker_urls=[url]).connect()
    probes = Recorded(client)
    monitor = EngineMonitor(client, health, None, needs_weights=False)
    stop = asyncio.Event()
    busy = asyncio.ensure_future(keep_busy(client, url, stop))
    try:
        # The probes queue behind the requests and time out, while the engine makes progress.
        monitor.start()
        await until(lambda: monitor.busy_probes[url] >= BUSY_ROUNDS or monitor.counts["lost"],
                    120, f"{BUSY_ROUNDS} busy probes")
        assert monitor.counts["lost"] == 0, (monitor.events, probes.answers)
        assert client.workers() == [url]
        # Timed out in a row, each: the rule before declared the engine hung at the second.
        assert probes.timeouts_in_a_row() >= HUNG_AFTER
        assert monitor.metrics()["engines/busy_probes"] >= BUSY_ROUNDS

        # The same engine stopped, busy as it was: no answer, no progress; hung.
        busy_before = sum(monitor.busy_probes.values())
        os.killpg(engine.process.pid, signal.SIGSTOP)
        answered = len(probes.answers)
        await until(lambda: monitor.counts["lost"] == 1, 60, "the stopped engine declared lost")
        lost = next(e for e in monitor.events if e["event"] == "lost")
        assert lost["worker"] == url
        assert lost["detail"].startswith(f"hung ({HUNG_AFTER} probes timed out without progress")
        assert client.workers() == []
        # At most one busy probe straddled the stop (its progress read before it).
        assert sum(monitor.busy_probes.values()) - busy_before <= 1
        # Found within its rounds, counted in probes (not seconds: a loaded box stretches those):
        # hung_after_timeouts of them, plus the one under way when it stopped.
        assert len(probes.answers) - answered <= HUNG_AFTER + 1, probes.answers[answered:]
    finally:
        stop.set()
        await monitor.close()
        await busy
        await client.close()


async def test_progress_of_an_unreachable_engine_is_none():
    client = await EngineClient(None, worker_urls=["http://127.0.0.1:9"]).connect()
    try:
        assert await client.progress("http://127.0.0.1:9", 1.0) is None
    finally:
        await client.close()


# -- simulated engines, virtual time ----------------------------------------------------------
SIM_HEALTH = HealthConfig(interval_s=1.0, probe_timeout_s=0.2, hung_after_timeouts=HUNG_AFTER,
                          max_restarts=0)


@pytest.mark.parametrize("progress_seen", [True, False])
def test_a_busy_simulated_engine_is_not_hung_and_a_hung_one_is(progress_seen):
    """A simulated engine with its queue full: each probe waits behind the queue and times
    out. Seeing its progress, the monitor keeps it; blind to progress (`progress_seen=False`:
    the rule before), it declares the busy engine hung. Then it hangs: hung in
    hung_after_timeouts rounds either way."""
    sim = SimEngines(cluster(1, probe_queues=True, max_running_requests=4))
    if not progress_seen:
        async def blind(worker, timeout_s):
            return None
        sim.progress = blind  # type: ignore[method-assign]
    [worker] = sim.workers()
    probes = Recorded(sim)
    monitor = EngineMonitor(sim, SIM_HEALTH, None, needs_weights=False)
    sampling = SamplingConfig(max_new_tokens=2000, ignore_eos=True)

    async def main():
        samples = [Sample(index=i, group_id=i, prompt_ids=[1] * 64) for i in range(64)]
        tasks = [asyncio.ensure_future(sim.generate(s, sampling, max_new_tokens=2000, version=0))
                 for s in samples]
        monitor.start()
        loop = asyncio.get_running_loop()
        if progress_seen:
            await until(lambda: monitor.busy_probes[worker] >= BUSY_ROUNDS
                        or monitor.counts["lost"], 600, "busy probes")
            assert monitor.counts["lost"] == 0, (monitor.events, probes.answers)
            assert sim.workers() == [worker]
            assert probes.timeouts_in_a_row() >= BUSY_ROUNDS
            assert sum(len(s.response_ids) for s in samples) > 0
            hung_at = loop.time()
            sim.hang(worker)
            await until(lambda: monitor.counts["lost"] == 1, 600, "the hung engine lost")
            found_s = loop.time() - hung_at
            # Probes run every interval_s after the last: within hung_after_timeouts rounds,
            # plus the probe under way (the busy one that straddled the hang).
            assert found_s <= (HUNG_AFTER + 1) * (SIM_HEALTH.interval_s + SIM_HEALTH.probe_timeout_s)
        else:
            await until(lambda: monitor.counts["lost"] == 1, 600, "the busy engine lost")
            assert monitor.busy_probes[worker] == 0
        lost = next(e for e in monitor.events if e["event"] == "lost")
        assert lost["detail"].startswith(f"hung ({HUNG_AFTER} probes timed out without progress")
        await monitor.close()
        await asyncio.gather(*tasks, return_exceptions=True)  # ended by abort_worker
        await sim.aclose()
        return [len(s.response_ids) for s in samples]

    tokens = run_virtual(main)
    assert sum(tokens) > 0
    assert all(n < 2000 for n in tokens)  # lost mid-work: nothing had finished


def test_a_queued_probe_answers_an_idle_simulated_engine_and_leaves_no_trace():
    sim = SimEngines(cluster(1, probe_queues=True))
    [worker] = sim.workers()

    async def main():
        first = await sim.progress(worker, 1.0)
        assert await sim.probe(worker, 1.0) is None  # a one-token request through the queue
        after = await sim.progress(worker, 1.0)
        await sim.aclose()
        return first, after

    first, after = run_virtual(main)
    assert after == first + 1  # its prefill forward was the worker's one step
    assert sim.stats()[worker].requests == 0 and sim.drain_segments() == []
