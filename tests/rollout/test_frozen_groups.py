"""A frozen engine group (rlkit.rollout.http.frozen_groups) over real HTTP: the teacher's scores of a
sample's response equal the model's own teacher-forced logprobs (an HF forward) at the rollout
temperature, single- and multi-turn (observation tokens scored too, masked later by the loss);
a group that hangs, errors or answers garbage is retried, counted by kind, and fails the call
cleanly; the limits (concurrency, rate) hold; a killed engine behind the group's router is
found by its monitor and restarted, and the request is retried on it."""

import asyncio
import json

import pytest
from aiohttp import web

from rlkit.buffers import Sample
from rlkit.rollout.config import FrozenEnginesConfig, HealthConfig, SamplingConfig
from rlkit.rollout.engines.config import EngineConfig, RouterConfig
from rlkit.rollout.engines.fleet import EngineFleet
from rlkit.rollout.http.frozen_groups import (FrozenCallFailed, FrozenGroup, RateLimit, engine_group,
                                         register, unregister)
from rlkit.rollout.health import EngineMonitor
from rlkit.rollout.http.client import EngineClient
from tests.rollout.helpers import LOGPROB_TOLERANCE, teacher_forced_logprobs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ENGINE = EngineConfig(num_engines=1, cpu_threads=1, max_running_requests=8, startup_timeout_s=120)


def group_cfg(**kw) -> FrozenEnginesConfig:
    return FrozenEnginesConfig(role="teacher", model="tiny", engine=ENGINE, **kw)


@pytest.fixture(scope="module")
def teacher_fleet(tiny_model_dir, tmp_path_factory):
    with EngineFleet(str(tiny_model_dir), ENGINE, RouterConfig(),
                     log_dir=tmp_path_factory.mktemp("teacher-logs")) as f:
        yield f


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_teacher_scores_equal_the_models_own_logprobs(teacher_fleet, tiny_model, temperature):
    async with teacher_fleet.client() as client:
        group = FrozenGroup("teacher", group_cfg(), client)
        # a sampled response, and an episode's: model turn, observation, model turn
        single = Sample(index=0, group_id=0, prompt_ids=[5, 9, 13, 17])
        await client.generate(single, SamplingConfig(max_new_tokens=12, temperature=temperature),
                              max_new_tokens=12, version=0)
        episode = Sample(index=1, group_id=1, prompt_ids=[7, 7, 7])
        episode.append([11, 12, 13], [-1.0, -1.0, -1.0], 0)
        episode.append([200, 201], [0.0, 0.0], 0, trainable=False)  # the environment's answer
        episode.append([14, 15], [-1.0, -1.0], 0, finish_reason="stop")
        for s in (single, episode):
            scored = await group.score(s.input_ids(), len(s.prompt_ids), temperature=temperature)
            want = teacher_forced_logprobs(tiny_model, s.prompt_ids, s.response_ids, temperature)
            assert len(scored) == len(s.response_ids)
            assert max(abs(a - b) for a, b in zip(scored, want)) < LOGPROB_TOLERANCE
        # the sampled tokens' own logprobs, from the same model: an identical teacher
        assert max(abs(a - b) for a, b in zip(
            await group.score(single.input_ids(), 4, temperature=temperature), single.logprobs)) < 1e-4
    assert group.requests == 3 and not group.failures


class Misbehaving:
    """A /generate that hangs, errors or answers garbage for its first `bad` requests (after
    which it answers well: a retry then succeeds)."""

    def __init__(self, how: str, bad: int) -> None:
        self.how, self.bad, self.calls = how, bad, 0
        self.in_flight = self.most_in_flight = 0
        # `gate`: requests wait until this many are in flight at once (a condition, not a sleep)
        self.gate = 0
        self._gate_open = asyncio.Event()

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        if self.in_flight >= self.gate:
            self._gate_open.set()
        try:
            body = await request.json()
            if self.calls <= self.bad:
                if self.how == "hang":
                    await asyncio.Event().wait()
                if self.how == "error":
                    return web.json_response({"error": {"message": "boom"}}, status=500)
                return web.Response(text="not json at all")
            await self._gate_open.wait()
            await asyncio.sleep(0.01)
            if "text" in body:
                return web.json_response({"text": "yes", "meta_info": {}})
            n = len(body["input_ids"]) - body["logprob_start_len"] - 1
            return web.json_response({"text": "", "meta_info": {
                "input_token_logprobs": [[-0.5, 1, None]] * n, "output_token_logprobs": []}})
        finally:
            self.in_flight -= 1


@pytest.fixture
async def misbehaving(request):
    server = Misbehaving(*request.param)
    app = web.Application()
    app.router.add_post("/generate", server.generate)
    runner = web.AppRunner(app, shutdown_timeout=0.1)  # a hung handler is not waited for
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    server.url = f"http://127.0.0.1:{port}"
    yield server
    await runner.cleanup()


@pytest.mark.parametrize("misbehaving,kind", [
    (("hang", 1), "timeout"), (("error", 1), "error"), (("garbage", 1), "bad_output")],
    indirect=["misbehaving"])
async def test_a_failed_try_is_counted_by_kind_and_retried(misbehaving, kind):
    async with EngineClient(None, worker_urls=[misbehaving.url]) as client:
        # 2 s a try: the hang costs it, and the answer after it never comes near it
        group = FrozenGroup("judge", group_cfg(timeout_s=2.0, retries=1), client)
        assert await group.generate_text("is 2 + 2 = 4?", sample=(3, 7)) == "yes"
    assert dict(group.failures) == {kind: 1} and group.retries == 1 and group.requests == 1
    # each try is a span of the step's timeline, on the group's lane, for its sample
    spans = group.take_spans()
    assert [(x.worker, x.group_id, x.sample_index, x.outcome) for x in spans] == [
        ("frozen:judge", 3, 7, kind), ("frozen:judge", 3, 7, "scored")]
    assert spans[0].end <= spans[1].start and group.take_spans() == []


@pytest.mark.parametrize("misbehaving", [("error", 10)], indirect=True)
async def test_a_call_failing_every_try_raises_with_the_last_reason(misbehaving):
    async with EngineClient(None, worker_urls=[misbehaving.url]) as client:
        group = FrozenGroup("judge", group_cfg(retries=2), client)
        with pytest.raises(FrozenCallFailed, match="failed 3 times.*error.*boom") as e:
            await group.score([1, 2, 3, 4], 2, temperature=1.0)
    assert e.value.kind == "error" and group.failures["error"] == 3 and group.failed_calls == 1


@pytest.mark.parametrize("misbehaving", [("error", 0)], indirect=True)
async def test_scores_of_the_wrong_length_are_bad_output(misbehaving):
    async with EngineClient(None, worker_urls=[misbehaving.url]) as client:
        group = FrozenGroup("teacher", group_cfg(retries=0), client)
        assert await group.score([1, 2, 3, 4, 5], 2, temperature=1.0) == [-0.5] * 3

        async def one_score(url, body):  # an engine that scores one token of three
            return {"text": "", "meta_info": {"input_token_logprobs": [[-0.5, 1, None]]}}

        group._post = one_score
        with pytest.raises(FrozenCallFailed, match="bad_output: scored 1 of 3 tokens"):
            await group.score([1, 2, 3, 4, 5], 2, temperature=1.0)
    assert group.failures["bad_output"] == 1


@pytest.mark.parametrize("misbehaving", [("error", 0)], indirect=True)
async def test_concurrency_is_bounded(misbehaving):
    misbehaving.gate = 3  # the first requests wait for 3 in flight: the bound is reached, by condition
    async with EngineClient(None, worker_urls=[misbehaving.url]) as client:
        group = FrozenGroup("judge", group_cfg(max_concurrency=3), client)
        assert await asyncio.gather(*(group.generate_text("q") for _ in range(12))) == ["yes"] * 12
    assert misbehaving.most_in_flight == 3 and group.requests == 12


async def test_the_rate_limit_spaces_requests_in_virtual_time():
    now = [0.0]
    slept = []

    async def fake_sleep(s):
        slept.append(s)
        now[0] += s

    limit = RateLimit(120, clock=lambda: now[0])  # 2 a second, a bucket of 2
    real_sleep = asyncio.sleep
    asyncio.sleep = fake_sleep
    try:
        for _ in range(6):
            await limit.take()
    finally:
        asyncio.sleep = real_sleep
    assert now[0] == pytest.approx(2.0)  # 2 at once, then one every 0.5 s
    assert RateLimit(0).rate == 0


def test_reward_plugins_find_a_group_by_name():
    class Dummy:
        name = "judge"
    register(Dummy())
    try:
        assert engine_group("judge").name == "judge"
        with pytest.raises(KeyError, match="no frozen engine group 'nope'.*judge"):
            engine_group("nope")
    finally:
        unregister("judge")


def test_group_names_and_one_teacher_are_checked():
    from rlkit.rollout.config import RolloutConfig

    t = {"role": "teacher", "model": "tiny"}
    assert RolloutConfig(frozen_engines={"t": t}).teacher == "t"
    with pytest.raises(ValueError, match="one group scores"):
        RolloutConfig(frozen_engines={"a": t, "b": t})
    with pytest.raises(ValueError, match="letters, digits"):
        RolloutConfig(frozen_engines={"a b": t})
    assert json.dumps(RolloutConfig().model_dump()["frozen_engines"]) == "{}"


# -- the built-in judge reward (rlkit.rewards.judge) ------------------------------------------
def reward_input(response="4"):
    from rlkit.rewards.input import RewardInput

    return RewardInput(prompt="2 + 2 = ?", response=response, label="4", metadata={},
                       finish_reason="stop", prompt_ids=(1,), response_ids=(2,), index=0, group_id=0)


def test_the_verdict_parser():
    from rlkit.rewards.judge import parse_verdict

    table = {"correct": 1.0, "not correct": 0.0}
    assert parse_verdict("It is NOT correct.", table) == 0.0
    assert parse_verdict("Correct!", table) == 1.0
    with pytest.raises(ValueError, match="no verdict"):
        parse_verdict("incorrectly", table)


@pytest.mark.parametrize("misbehaving,kind", [
    (("hang", 1), "timeout"), (("error", 1), "error"), (("garbage", 1), "bad_output")],
    indirect=["misbehaving"])
async def test_the_judge_reward_through_a_misbehaving_group(misbehaving, kind):
    """One bad try, counted by kind; the retry gives the verdict."""
    from rlkit.rewards.judge import judge

    async with EngineClient(None, worker_urls=[misbehaving.url]) as client:
        group = FrozenGroup("judge", FrozenEnginesConfig(role="judge", model="tiny", timeout_s=2.0,
                                                         retries=1), client)
        register(group)
        try:
            assert await judge(reward_input()) == 1.0
        finally:
            unregister("judge")
    assert dict(group.failures) == {kind: 1} and group.requests == 1


@pytest.mark.parametrize("misbehaving", [("hang", 100)], indirect=True)
async def test_a_hung_judge_fails_the_reward_and_an_abort_cancels_it(misbehaving):
    """Through the reward scheduler: a judge that never answers fails the sample (counted) once
    its tries are spent; a call cancelled (its group aborted) gives its slot back at once."""
    from rlkit.buffers.group import Group, PromptRecord
    from rlkit.rewards.judge import judge
    from rlkit.rollout.reward_scheduler import RewardScheduler

    async with EngineClient(None, worker_urls=[misbehaving.url]) as client:
        group = FrozenGroup("judge", FrozenEnginesConfig(role="judge", model="tiny", timeout_s=0.2,
                                                         retries=1, max_concurrency=1), client)
        register(group)
        try:
            async def score(sample, g):
                return await judge(reward_input())

            rewards = RewardScheduler(score, timeout_s=30)
            s = Sample(index=0, group_id=0, prompt_ids=[1])
            g = Group(group_id=0, prompt=PromptRecord(ids=(1,), text="2 + 2 = ?", label="4"),
                      samples=[s], target_n=1)
            s.append([2], [-1.0], 0, finish_reason="stop")
            assert await rewards.score(s, g) is False
            assert rewards.failures["error"] == 1 and "judge" in s.error and "timeout" in s.error
            assert group.failures["timeout"] == 2 and group.failed_calls == 1

            task = asyncio.ensure_future(judge(reward_input()))
            while misbehaving.in_flight == 0:
                await asyncio.sleep(0.01)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert group._slots._value == 1  # the one slot is free again
        finally:
            unregister("judge")


async def test_a_killed_engine_is_restarted_by_the_groups_monitor_and_the_call_retried(
        teacher_fleet, tiny_model_dir, tmp_path):
    """The group's engine is SIGKILLed; the next call fails, the monitor's probe finds the
    engine dead and restarts it (a fresh process, the same model), and the retry succeeds.
    (Last in the module: it kills the module's engine; the fleet stops the new one.)"""
    from rlkit.rollout.engines.fleet import start_engine

    fleet, restarted = teacher_fleet, []

    class Restarter:
        async def restart(self, worker):
            proc = await asyncio.to_thread(start_engine, str(tiny_model_dir), ENGINE, 1, tmp_path)
            fleet.engines.append(proc)
            restarted.append(proc.url)
            return proc.url

    async with fleet.client(router_admin=fleet.router) as client:  # as the rollout actor's
        monitor = EngineMonitor(client, HealthConfig(interval_s=3600, restart_backoff_s=0.1),
                                Restarter(), needs_weights=False)
        group = FrozenGroup("teacher", group_cfg(retries=2, timeout_s=30), client, monitor)
        assert len(await group.score([5, 9, 13, 17], 2, temperature=1.0)) == 2
        fleet.engines[0].kill()
        assert len(await group.score([5, 9, 13, 17], 2, temperature=1.0)) == 2
        assert restarted and client.workers() == restarted
        m = group.metrics()
        assert m["frozen/teacher/engines/lost"] == 1 and m["frozen/teacher/engines/restarted"] == 1
        assert m["frozen/teacher/failures/error"] >= 1 and m["frozen/teacher/requests"] == 2
        await monitor.close()
