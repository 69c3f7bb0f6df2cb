"""The router supervised like an engine (rollout.health): a killed or stopped sglang-router is
found by the monitor, the requests that went through it keep their tokens and go on once it is
restarted in front of the engines serving then, and when it cannot come back the step stops with
RouterDown, every group parked with its tokens. No router outlives the process that started it.

Two halves: the monitor's router logic in virtual time, over simulated engines behind a fake
router (fast, exact); and the real sglang-router in front of two real built-in tiny engines, the
router killed or stopped from the test at a point it controls (after N tokens streamed through
it, EngineClient.on_routed_tokens), never after a guessed delay."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from rlkit.buffers import ListPromptSource, RolloutBuffer, Sample, SampleStatus
from rlkit.buffers.source import records_from_token_lists
from rlkit.common.control_token import CONTROL_TOKEN_ENV
from rlkit.driver.rollout_service import RolloutService
from rlkit.rollout.config import HealthConfig, RolloutConfig, SamplingConfig
from rlkit.rollout.engine_api import EngineError, RouterLost
from rlkit.rollout.engines.config import EngineConfig, RouterConfig
from rlkit.rollout.engines.fleet import start_engine
from rlkit.rollout.engines.process import http_ok
from rlkit.rollout.health import ROUTER, EngineMonitor, RouterDown
from rlkit.rollout.http.client import EngineClient
from rlkit.rollout.http.router import Router, RouterProcessHandle
from rlkit.rollout.manager import RolloutManager
from rlkit.rollout.policies import SyncPolicy
from rlkit.rollout.reward_scheduler import RewardScheduler
from rlkit.sim.clock import run_virtual
from rlkit.sim.engine import SimEngines, SimRestarter
from tests.manager.fakes import constant_reward
from tests.rollout.fake_worker import FakeWorker, answer_sse, tokens_chunk
from tests.sim.helpers import cluster

MAX_NEW = 200
HEALTH = HealthConfig(interval_s=1.0, probe_timeout_s=2.0, hung_after_timeouts=2,
                      restart_backoff_s=1.0, max_restarts=2, wait_for_engine_s=120.0)


# -- virtual time: simulated engines behind a fake router ----------------------------------------
class RoutedSim(SimEngines):
    """Simulated engines behind a router that can die: its own worker list (`listed`), which,
    as EngineClient's add_worker/remove_worker do, changes after the client's own list and
    fails while the router is down; a request through it breaks when it dies."""

    def __init__(self, engines: int) -> None:
        super().__init__(cluster(engines))
        self.router = "up"  # up | dead
        self.down = False  # declared lost (abort_routed) until restarted: requests fail at once
        self.listed = set(self.workers())
        self._routed: dict[asyncio.Task, str | None] = {}  # task -> why it was ended
        self._next = 0

    async def generate(self, sample, sampling, *, max_new_tokens, version, worker=None):
        if worker is not None:  # pinned: straight to the engine
            return await super().generate(sample, sampling, max_new_tokens=max_new_tokens,
                                          version=version, worker=worker)
        if self.down:
            raise RouterLost()
        if self.router != "up" or not self.listed:
            raise EngineError("router: connection refused")
        listed = sorted(self.listed)
        self._next += 1
        task = asyncio.current_task()
        self._routed[task] = None
        try:
            return await super().generate(sample, sampling, max_new_tokens=max_new_tokens,
                                          version=version, worker=listed[self._next % len(listed)])
        except asyncio.CancelledError:
            why = self._routed.get(task)
            if why is None or task.uncancel() != 0:
                raise
            if why == "lost":
                raise RouterLost() from None
            raise EngineError("router: connection reset after tokens") from None
        finally:
            self._routed.pop(task, None)

    def end_routed(self, why: str) -> int:
        n = 0
        for task, ended in list(self._routed.items()):
            if ended is None and not task.done():
                self._routed[task] = why
                task.cancel()
                n += 1
        return n

    def kill_router(self) -> None:
        self.router = "dead"
        self.end_routed("reset")  # its streams break, the tokens that arrived kept

    async def remove_worker(self, worker: str) -> None:
        await super().remove_worker(worker)
        if not self.down:
            if self.router != "up":
                raise EngineError("router: connection refused")
            self.listed.discard(worker)

    async def add_worker(self, worker: str) -> None:
        await super().add_worker(worker)  # the client's list first
        if not self.down:
            if self.router != "up":
                raise EngineError("router: connection refused")
            self.listed.add(worker)


class FakeRouter:
    """The monitor's RouterHandle over RoutedSim: restarts take `start_s`; the first `fail`
    restarts fail."""

    def __init__(self, sim: RoutedSim, start_s: float = 0.5, fail: int = 0) -> None:
        self.sim = sim
        self.start_s = start_s
        self.fail = fail
        self.given: list[list[str]] = []  # the workers of each restart

    async def probe(self, timeout_s: float) -> str | None:
        if self.sim.router == "dead":
            return "ClientConnectorError: connection refused"
        return None

    async def abort_routed(self) -> int:
        self.sim.down = True
        return self.sim.end_routed("lost")

    async def restart(self, workers: list[str]) -> str:
        self.sim.router = "dead"  # what was left of it is killed first
        await asyncio.sleep(self.start_s)
        if self.fail:
            self.fail -= 1
            raise RuntimeError("the router did not start")
        self.given.append(list(workers))
        self.sim.listed = set(workers)
        self.sim.router, self.sim.down = "up", False
        return f"http://router-{len(self.given)}"


def make(*, engines=2, rows=40, health=HEALTH, restart_s=0.5, router_start_s=0.5, fail=0, n=4):
    buf = RolloutBuffer(
        ListPromptSource(records_from_token_lists([[1, i] for i in range(rows)]), shuffle=False),
        n_samples_per_prompt=n, max_staleness=3,
    )
    sim = RoutedSim(engines)
    router = FakeRouter(sim, router_start_s, fail)
    monitor = EngineMonitor(sim, health, SimRestarter(sim, restart_s), needs_weights=False,
                            router=router)
    mgr = RolloutManager(buf, sim, SyncPolicy(), SamplingConfig(max_new_tokens=MAX_NEW),
                         RewardScheduler(constant_reward), health=monitor)
    return buf, sim, router, monitor, mgr


async def after(seconds: float, fault) -> None:
    await asyncio.sleep(seconds)
    fault()


def router_events(monitor: EngineMonitor) -> list[str]:
    return [e["event"] for e in monitor.events if e["worker"] == ROUTER]


def test_sim_a_killed_router_mid_step_relaunches_its_requests_with_their_tokens():
    buf, sim, router, monitor, mgr = make()

    async def main():
        inject = asyncio.ensure_future(after(0.5, sim.kill_router))
        report = await mgr.run_step(8, 0)
        await inject
        # a step whose batch is already ready still reports the counts (every step's row has them)
        empty = await mgr.run_step(0, 0)
        await mgr.close()
        await sim.aclose()
        return report, empty

    report, empty = run_virtual(main)
    assert empty.engines["router/lost"] == 1 and empty.engines["router/restarts"] == 1
    assert len(report.completed) == 8 and not report.dropped and report.engine_failures == 0
    assert report.requests_relaunched > 0 and report.relaunched_tokens > 0
    lost = [s for s in report.timeline if s.outcome == "lost"]
    assert len(lost) == report.requests_relaunched
    assert report.engines["router/lost"] == 1 and report.engines["router/restarts"] == 1
    assert report.engines["engines/lost"] == 0  # the engines behind it were fine
    assert router.given == [sim.workers()] and sim.listed == set(sim.workers())
    for g in buf.take(8, timeout=0):  # each response went on from where it stopped
        assert all(len(s.response_ids) == MAX_NEW for s in g.samples)
    assert buf.stats()["balanced"]


def test_sim_the_router_and_an_engine_lost_together_and_the_engine_admitted_while_it_is_down():
    # The router's first restart fails, so the engine's restart (0.5 s) is admitted while the
    # router is down: the client lists it, and the router's next restart registers it.
    buf, sim, router, monitor, mgr = make(fail=1, router_start_s=0.1)

    async def main():
        victim = sim.workers()[0]

        def both():
            sim.kill(victim)
            sim.kill_router()

        inject = asyncio.ensure_future(after(0.5, both))
        report = await mgr.run_step(8, 0)
        await inject
        while monitor.counts["back"] < 1 or not monitor.routing:
            await asyncio.sleep(0.5)
        await mgr.close()
        await sim.aclose()
        return victim, report

    victim, report = run_virtual(main)
    assert len(report.completed) == 8 and not report.dropped and buf.stats()["balanced"]
    assert monitor.counts["lost"] == 1 and monitor.counts["restarted"] == 1
    assert router_events(monitor) == ["lost", "restart_failed", "restarted"]
    kinds = [(e["event"], e["worker"]) for e in monitor.events]
    back = next(i for i, (kind, _) in enumerate(kinds) if kind == "back")
    new = kinds[back][1]
    assert kinds.index(("restart_failed", ROUTER)) < back < kinds.index(("restarted", ROUTER))
    # the lost engine is in neither list; the one admitted while the router was down is in both
    assert victim not in sim.workers() and new in sim.workers()
    assert sim.listed == set(sim.workers()) and len(sim.listed) == 2
    assert router.given == [sim.workers()]


def test_sim_admit_on_a_dead_router_not_found_yet_keeps_the_engine():
    _, sim, router, monitor, _ = make()
    monitor.needs_weights = True  # the restarted engine waits for `admit`, as in a run

    async def main():
        victim = sim.workers()[0]
        await monitor.lose(victim, "test")
        while not monitor.awaiting_weights:
            await asyncio.sleep(0.1)
        new = monitor.awaiting_weights[0]
        sim.router = "dead"  # the monitor does not know yet
        await monitor.admit([new])  # the router fails it: found dead, its restart registers it
        while not monitor.routing:
            await asyncio.sleep(0.1)
        await monitor.close()
        await sim.aclose()
        return new

    new = run_virtual(main)
    assert [e["event"] for e in monitor.events if e["worker"] == new] == ["restarted", "add_failed", "back"]
    assert router_events(monitor) == ["lost", "restarted"]
    assert new in sim.workers() and sim.listed == set(sim.workers()) and len(sim.listed) == 2


def test_sim_admit_on_a_router_that_answers_still_raises():
    _, sim, router, monitor, _ = make()

    async def main():
        async def refuse(worker):
            raise EngineError("router refused worker")

        sim.add_worker = refuse
        with pytest.raises(EngineError, match="refused"):
            await monitor.admit(["sim-0"])
        await monitor.close()
        await sim.aclose()

    run_virtual(main)
    assert monitor.routing and router_events(monitor) == []


def test_sim_a_hung_router_is_found_by_the_watch():
    _, sim, router, monitor, _ = make()

    class Hung(FakeRouter):
        hung = True

        async def probe(self, timeout_s):
            if self.hung:
                await asyncio.sleep(timeout_s)
                return f"timeout: no answer in {timeout_s} s"
            return None

        async def restart(self, workers):
            self.hung = False
            return await super().restart(workers)

    monitor.router = Hung(sim)

    async def main():
        monitor.start()
        while monitor.router_counts["restarted"] < 1:
            await asyncio.sleep(0.5)
        await monitor.close()
        await sim.aclose()

    run_virtual(main)
    lost = [e for e in monitor.events if e["worker"] == ROUTER and e["event"] == "lost"]
    assert len(lost) == 1 and lost[0]["detail"].startswith("hung (2 probes timed out")
    assert monitor.metrics()["router/restarts"] == 1


def router_down_step(sim, mgr, match: str) -> tuple[float, Exception]:
    """The router killed 0.5 s into a step that cannot get it back: RouterDown matching `match`;
    the virtual time the step ended at, and the error."""

    async def main():
        loop = asyncio.get_running_loop()
        inject = asyncio.ensure_future(after(0.5, sim.kill_router))
        with pytest.raises(RouterDown, match=match) as e:
            await mgr.run_step(8, 0)
        await inject
        await mgr.close()
        await sim.aclose()
        return loop.time(), e.value

    return run_virtual(main)


def test_sim_no_restart_left_parks_every_group_with_router_down():
    buf, sim, router, monitor, mgr = make(health=HEALTH.model_copy(update={"max_restarts": 0}))
    router_down_step(sim, mgr, "the router is down and cannot be restarted")
    st = buf.stats()
    assert st["in_flight"] == 0 and st["partial"] == 8 and st["dropped"] == 0 and st["balanced"]
    parked = buf.acquire(8)
    assert sum(len(s.response_ids) for g in parked for s in g.samples) > 0
    assert all(s.status in (SampleStatus.PARTIAL, SampleStatus.PENDING) for g in parked
               for s in g.samples)
    assert router_events(monitor) == ["lost", "gave_up"]


def test_sim_every_router_restart_failing_ends_in_router_down_at_once():
    buf, sim, router, monitor, mgr = make(fail=5)  # max_restarts=2: both fail
    ended, error = router_down_step(sim, mgr, "cannot be restarted.*restart_failed")
    # lost at 0.5, then backoff 1 + start 0.5 + backoff 2 + start 0.5: not wait_for_engine_s
    assert ended < 10 and "max_restarts=2" in str(error)
    assert router_events(monitor) == ["lost", "restart_failed", "restart_failed", "gave_up"]
    st = buf.stats()
    assert st["in_flight"] == 0 and st["partial"] == 8 and st["dropped"] == 0 and st["balanced"]


def test_sim_a_router_not_back_within_wait_for_engine_s_is_router_down():
    buf, sim, router, monitor, mgr = make(
        router_start_s=500.0, health=HEALTH.model_copy(update={"wait_for_engine_s": 30.0}))
    router_down_step(sim, mgr, "was not back within 30 s")
    assert buf.stats()["dropped"] == 0 and buf.stats()["partial"] == 8


# -- the client's side: a fake worker stands in for the router -----------------------------------
async def test_the_client_ends_routed_requests_and_follows_the_new_router(worker):
    """abort_routed ends the requests sent to the router (RouterLost, tokens kept), not those
    pinned to an engine; while the router is down a routed request fails at once and the
    router's worker list is left alone (add_worker lists the engine here only); follow_router
    moves requests to the new URL. on_routed_tokens counts tokens through the router only."""
    class Admin:
        calls: list[str] = []

        def add_worker(self, url):
            self.calls.append(url)

    engine, new_router = await FakeWorker().start(), await FakeWorker().start()
    stream = "\n".join(tokens_chunk([11 + i], [-0.1], total=i + 1, finish=None) for i in range(3))
    worker.generate.append(answer_sse(stream, stall_after=2))  # the router: stalls after 2 tokens
    engine.generate.append(answer_sse(stream, stall_after=1))
    done = "\n".join([tokens_chunk([21], [-0.1], total=1, finish=None),
                      tokens_chunk([22], [-0.1], total=2, finish={"type": "length"})])
    new_router.generate.append(answer_sse(done))
    counts: list[int] = []
    c = await EngineClient(worker.url, worker_urls=[engine.url], router_admin=Admin(),
                           on_routed_tokens=counts.append).connect()
    sampling = SamplingConfig(max_new_tokens=10)
    try:
        routed = Sample(index=0, group_id=0, prompt_ids=[1])
        pinned = Sample(index=1, group_id=0, prompt_ids=[1])
        task = asyncio.create_task(c.generate(routed, sampling, max_new_tokens=10, version=0))
        keep = asyncio.create_task(c.generate(pinned, sampling, max_new_tokens=10, version=0,
                                              worker=engine.url))
        while len(routed.response_ids) < 2 or not pinned.response_ids:
            await asyncio.sleep(0.01)
        assert await c.abort_routed() == 1
        with pytest.raises(RouterLost):
            await task
        assert routed.response_ids == [11, 12] and routed.status is SampleStatus.PARTIAL
        assert not keep.done() and counts == [1, 2]
        with pytest.raises(RouterLost):  # down: not sent
            await c.generate(routed, sampling, max_new_tokens=8, version=0)
        await c.add_worker("http://127.0.0.1:9")
        assert c.workers() == [engine.url, "http://127.0.0.1:9"] and Admin.calls == []
        c.follow_router(new_router.url)
        await c.generate(routed, sampling, max_new_tokens=8, version=0)
        assert routed.response_ids == [11, 12, 21, 22] and counts == [1, 2, 3, 4]
        keep.cancel()
        await asyncio.gather(keep, return_exceptions=True)
    finally:
        await c.close()
        await engine.stop()
        await new_router.stop()
    assert len(worker.calls("/generate")) == 1 and len(new_router.calls("/generate")) == 1


# -- the real sglang-router in front of two real built-in engines --------------------------------
TOKEN = "router-supervision-test-token-0123456789"
ENGINE_CFG = {"num_engines": 2, "cpu_threads": 1, "max_running_requests": 16, "startup_timeout_s": 120}
KILL_AT = 24  # tokens streamed through the router before it is killed or stopped: each of the
# 8 requests has a few, none is finished (48 each)
REAL_HEALTH = dict(interval_s=0.5, probe_timeout_s=4.0, hung_after_timeouts=2,
                   restart_backoff_s=0.2, wait_for_engine_s=120.0)


@pytest.fixture(scope="module")
def real_engines(tiny_model_dir, tmp_path_factory):
    """Two built-in engines with a control token, as in a run (the router then runs under
    token_exec with its parent watchdog)."""
    old = os.environ.get(CONTROL_TOKEN_ENV)
    os.environ[CONTROL_TOKEN_ENV] = TOKEN
    logs = tmp_path_factory.mktemp("engines")
    config = EngineConfig(**ENGINE_CFG)
    procs = []
    try:
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(start_engine, str(tiny_model_dir), config, i, logs) for i in range(2)]:
                procs.append(f.result())
        yield [p.url for p in procs]
    finally:
        for p in procs:
            p.stop()
        if old is None:
            os.environ.pop(CONTROL_TOKEN_ENV, None)
        else:
            os.environ[CONTROL_TOKEN_ENV] = old


class RouterFault:
    """EngineClient.on_routed_tokens: once `tokens` tokens have streamed through the router,
    send `sig` to its process group (SIGKILL: dead; SIGSTOP: hung), from the client's own
    stream handling, so it lands mid-step on requests that hold tokens, every time."""

    def __init__(self, router, sig: int, tokens: int = KILL_AT) -> None:
        self.router, self.sig, self.tokens = router, sig, tokens
        self.fired: dict | None = None

    def __call__(self, total: int) -> None:
        if self.fired is None and total >= self.tokens:
            pid = self.router.process.pid
            self.fired = {"pid": pid, "url": self.router.url, "tokens": total,
                          "group": [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]}
            os.killpg(pid, self.sig)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not all(gone(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


async def router_step(urls, tmp_path, sig: int, **health):
    """One sync rollout step (4 groups x 2 responses of 48 tokens) through a router of its own,
    with the router killed or stopped once KILL_AT tokens went through it."""
    router = Router(RouterConfig(health_check_interval_s=1, health_failure_threshold=2),
                    log_path=tmp_path / "router.log")
    await asyncio.to_thread(router.start, urls)
    client = await EngineClient(router.url, worker_urls=urls, router_admin=router).connect()
    fault = client.on_routed_tokens = RouterFault(router, sig)
    cfg = RolloutConfig(batch_size=4, n_samples_per_prompt=2,
                        sampling=SamplingConfig(max_new_tokens=48, ignore_eos=True),
                        health=HealthConfig(**{**REAL_HEALTH, **health}))
    source = ListPromptSource(records_from_token_lists([[5, 9, 13, i] for i in range(8)]),
                              shuffle=False)
    service = RolloutService.from_config(cfg, source, client, constant_reward,
                                         router=RouterProcessHandle(router, client))
    outcome: object
    try:
        try:
            outcome = await service.run_step(0)
        except RouterDown as e:
            outcome = e
        workers = {w.url for w in await asyncio.to_thread(router.list_workers)} \
            if router.process is not None and router.process.alive() else set()
        return outcome, service, router, client, fault, workers
    finally:
        await service.manager.close()
        await client.close()
        await asyncio.to_thread(router.stop)
        if fault.fired:  # a stopped router left behind by a failed test: not ours to keep
            for pid in fault.fired["group"]:
                if not gone(pid):
                    os.kill(pid, signal.SIGKILL)


def check_relaunched(outcome, service, router, client, fault, workers, urls) -> None:
    assert fault.fired is not None, "the router fault never fired"
    report = outcome.report
    assert len(outcome.completed) == 4 and not report.dropped and report.engine_failures == 0
    assert report.requests_relaunched > 0 and report.relaunched_tokens > 0
    assert outcome.metrics["rollout/requests_relaunched"] == report.requests_relaunched
    assert any(s.outcome == "lost" and s.tokens + s.response_before > 0 for s in report.timeline)
    m = service.manager.health.metrics()
    assert m["router/lost"] == 1 and m["router/restarts"] == 1 and m["engines/lost"] == 0
    # the new router: a fresh port, listing both engines; the client follows it
    assert client.router_url == router.url != fault.fired["url"]
    assert workers == set(urls)
    assert wait_gone(fault.fired["group"], 30)  # what was left of the old one was killed
    st = service.buffer.stats()
    assert st["balanced"] and st["dropped"] == 0 and st["ready"] == 4
    for g in service.buffer.take(4, timeout=0):  # every response went on to its budget
        assert all(len(s.response_ids) == 48 for s in g.samples)


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig,found", [(signal.SIGKILL, "dead ("),  # killed: refused at once
                                       (signal.SIGSTOP, "hung (2 probes timed out")])  # stopped
async def test_a_router_lost_mid_step_is_restarted_and_its_requests_go_on(real_engines, tmp_path,
                                                                          sig, found):
    got = await router_step(real_engines, tmp_path, sig)
    check_relaunched(*got, real_engines)
    lost = next(e for e in got[1].manager.health.events if e["worker"] == ROUTER)
    assert lost["event"] == "lost" and lost["detail"].startswith(found)


@pytest.mark.integration
@pytest.mark.timeout(300)
async def test_a_router_with_no_restart_left_stops_the_step_with_every_group_parked(real_engines,
                                                                                  tmp_path):
    outcome, service, router, client, fault, _ = await router_step(
        real_engines, tmp_path, signal.SIGKILL, max_restarts=0)
    assert fault.fired is not None
    assert isinstance(outcome, RouterDown) and "the router is down and cannot be restarted" in str(outcome)
    st = service.buffer.stats()
    assert st["in_flight"] == 0 and st["dropped"] == 0 and st["balanced"]
    assert st["partial"] + st["ready"] == 4 and st["partial"] >= 1
    parked = service.buffer.acquire(4)
    assert sum(len(s.response_ids) for g in parked for s in g.samples) > 0  # kept their tokens
    assert service.manager.health.metrics()["router/restarts"] == 0


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_the_router_exits_when_the_process_that_started_it_dies(tmp_path):
    """The router's parent watchdog (token_exec --parent-pid): its starter is SIGKILLed, so
    nothing stops the router; it must exit by itself."""
    code = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from rlkit.rollout.engines.config import RouterConfig
        from rlkit.rollout.http.router import Router
        router = Router(RouterConfig(), log_path=Path({str(tmp_path / "router.log")!r}))
        router.start([])
        print(router.process.pid, router.url, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, CONTROL_TOKEN_ENV: TOKEN})
    group: list[int] = []
    try:
        pid_s, url = parent.stdout.readline().split()
        pid = int(pid_s)
        group = [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
        assert len(group) >= 2  # token_exec and the router it runs
        assert "--parent-pid" in psutil.Process(pid).cmdline()
        parent.kill()
        parent.wait(30)
        assert wait_gone(group, 60), f"the router outlived its parent: {group}"
        assert not http_ok(f"{url}/health")
    finally:
        if parent.poll() is None:
            parent.kill()
        for p in group:
            if not gone(p):
                os.kill(p, signal.SIGKILL)
