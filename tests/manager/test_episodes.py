"""Multi-turn episodes (rollout/episodes.py), known-answer: a scripted model plays the guessing
game by bisection through a character-level codec. An episode aborted at every model token,
and at every tool call, then resumed (with its environment in memory, or from a checkpoint
through the environment's snapshot), ends with exactly the tokens, loss mask and observations
of the uninterrupted episode; model tokens carry the version of the step that made them and
observations the version of the tokens they follow. Then through the real manager with the
partial policy over several steps: every episode is trained once, accounting balances."""

from __future__ import annotations

import asyncio
import re

import pytest

from rlkit.buffers import Group, ListPromptSource, PromptRecord, SampleStatus
from rlkit.buffers.buffer import Place
from rlkit.buffers.sample import Sample
from rlkit.rollout.environments.guess_number import guess_number
from rlkit.rollout.config import SamplingConfig
from rlkit.rollout.episodes import STATE_KEY, EpisodeRunner, EpisodeStep, multi_turn

SECRET = 37
STOP = "."


class CharCodec:
    """One token per character; an observation is wrapped in [ ] (its turn markers)."""

    def decode(self, ids):
        return "".join(map(chr, ids))

    def encode_observation(self, text):
        return [ord(c) for c in f"[{text}]"]


def next_turn(response: str) -> str:
    """The scripted model: bisect on the answers so far."""
    lo, hi = 1, 100
    for guess, answer in re.findall(r"guess (\d+)\.\[(\w+)\]", response):
        if answer == "higher":
            lo = int(guess) + 1
        elif answer == "lower":
            hi = int(guess) - 1
    return f"guess {(lo + hi) // 2}{STOP}"


class ScriptedModel:
    """`generate` for EpisodeStep: the model's turn token by token. `abort_at`: the model token
    (counted over the whole run) at which the request is aborted, as a step's stop does."""

    def __init__(self, sample: Sample, abort_at: int | None = None) -> None:
        self.sample, self.abort_at, self.made, self.version = sample, abort_at, 0, 0

    async def generate(self, sampling: SamplingConfig) -> None:
        s = self.sample
        s.start_request()
        start = s.metadata[STATE_KEY]["turn_start"]
        text = CharCodec().decode(s.response_ids)
        turn = next_turn(text[:start])
        for ch in turn[len(text) - start:]:
            if self.abort_at is not None and self.made == self.abort_at:
                self.abort_at = None
                s.interrupt()
                return
            if len(s.response_ids) >= sampling.max_new_tokens:
                s.append([], [], self.version, finish_reason="length")
                return
            s.append([ord(ch)], [-0.1], self.version)
            self.made += 1
        s.append([], [], self.version, finish_reason="stop")


def group() -> Group:
    prompt = PromptRecord(ids=(1, 2), text="guess", label=SECRET, source_index=0)
    return Group(group_id=0, prompt=prompt, target_n=1,
                 samples=[Sample(index=0, group_id=0, prompt_ids=prompt.ids)])


def runner(budget: int = 400) -> EpisodeRunner:
    return EpisodeRunner(multi_turn, guess_number, CharCodec(),
                         SamplingConfig(max_new_tokens=budget, stop=[STOP]), env_kwargs={"max_turns": 12})


def play(r: EpisodeRunner, g: Group, model: ScriptedModel, stop_at_tool: int | None = None) -> None:
    """One step of the episode; `stop_at_tool`: the step ends while the k-th tool call runs."""
    stopped = asyncio.Event()
    calls = 0
    step_tool = r.tools.step

    async def tool(env, action):
        nonlocal calls
        calls += 1
        if calls == stop_at_tool:
            stopped.set()
            await asyncio.sleep(0)  # the stop is seen before the tool answers
        return await step_tool(env, action)

    r.tools.step = tool
    try:
        asyncio.run(r.run(g.samples[0], g, EpisodeStep(model.generate, stopped, lambda: model.version)))
    finally:
        r.tools.step = step_tool


def uninterrupted() -> Sample:
    g, r = group(), runner()
    play(r, g, ScriptedModel(g.samples[0]))
    return g.samples[0]


def test_the_scripted_episode_bisects_to_the_secret_with_masked_observations():
    s = uninterrupted()
    text = CharCodec().decode(s.response_ids)
    assert text.startswith("[I am thinking of a number from 1 to 100. Guess it.]guess 50.[lower]")
    assert text.endswith(f"guess {SECRET}.")  # the environment ends it: no observation after
    assert s.status is SampleStatus.DONE and s.reward == 1.0 and s.finish_reason == "stop"
    observed = {i for m in re.finditer(r"\[[^\]]*\]", text) for i in range(m.start(), m.end())}
    assert [i for i, m in enumerate(s.loss_mask) if m == 0] == sorted(observed)
    assert s.metadata[STATE_KEY]["phase"] == "done" and s.metadata[STATE_KEY]["turns"] == 3


def resumed(abort_at=None, stop_at_tool=None, through_checkpoint=False, version_bump=False):
    g, r = group(), runner()
    model = ScriptedModel(g.samples[0], abort_at)
    play(r, g, model, stop_at_tool)
    s = g.samples[0]
    parked = s.status
    if through_checkpoint:  # a new runner: the environment must come from the snapshot
        s = Sample.from_state(s.to_state(), g.prompt.ids)
        g.samples[0] = s
        r = runner()
        model = ScriptedModel(s)
    if version_bump:
        model.version = 1  # the next step runs with new weights
    play(r, g, model)
    return parked, s, r


@pytest.mark.parametrize("through_checkpoint", [False, True])
def test_an_episode_aborted_at_any_model_token_ends_as_the_uninterrupted_one(through_checkpoint):
    whole = uninterrupted()
    made = sum(whole.loss_mask)
    for k in range(made):
        parked, s, r = resumed(abort_at=k, through_checkpoint=through_checkpoint)
        assert parked in (SampleStatus.PARTIAL, SampleStatus.PENDING), k
        assert (s.response_ids, s.loss_mask, s.reward) == (whole.response_ids, whole.loss_mask, 1.0), k
        assert r.counts["episodes_restarted"] == 0
        assert r.counts["episodes_restored"] == (1 if through_checkpoint else 0)


@pytest.mark.parametrize("through_checkpoint", [False, True])
def test_an_episode_stopped_during_any_tool_call_reruns_it_and_ends_the_same(through_checkpoint):
    whole = uninterrupted()
    for call in range(1, 4):
        parked, s, r = resumed(stop_at_tool=call, through_checkpoint=through_checkpoint)
        assert parked is SampleStatus.PARTIAL
        assert (s.response_ids, s.loss_mask) == (whole.response_ids, whole.loss_mask), call


def test_versions_are_stamped_per_span_across_a_resume():
    whole = uninterrupted()
    parked, s, _ = resumed(abort_at=12, version_bump=True)
    assert s.response_ids == whole.response_ids
    model = [v for v, m in zip(s.versions, s.loss_mask) if m == 1]
    assert model[:12] == [0] * 12 and set(model[12:]) == {1}
    first_new = s.versions.index(1)
    assert all(m == 1 for m in s.loss_mask[first_new:first_new + 1])  # a model token opens v1
    assert s.versions == sorted(s.versions)


def test_an_environment_without_a_snapshot_restarts_from_the_prompt_and_is_counted():
    class Forgetful:
        def __init__(self, prompt, **kw):
            self.env = guess_number(prompt, **kw)

        async def reset(self):
            return await self.env.reset()

        async def step(self, action):
            return await self.env.step(action)

    g = group()
    r = EpisodeRunner(multi_turn, Forgetful, CharCodec(), SamplingConfig(max_new_tokens=400, stop=[STOP]))
    play(r, g, ScriptedModel(g.samples[0], abort_at=20))
    s = Sample.from_state(g.samples[0].to_state(), g.prompt.ids)
    g.samples[0] = s
    r2 = EpisodeRunner(multi_turn, Forgetful, CharCodec(), SamplingConfig(max_new_tokens=400, stop=[STOP]))
    play(r2, g, ScriptedModel(s))
    assert r2.counts["episodes_restarted"] == 1 and s.response_ids == uninterrupted().response_ids


def test_the_budget_ends_an_episode_as_a_truncation_at_a_token_or_an_observation():
    for budget in (30, 60, 61, 75):
        g, r = group(), runner(budget)
        play(r, g, ScriptedModel(g.samples[0]))
        s = g.samples[0]
        assert s.status is SampleStatus.TRUNCATED and len(s.response_ids) <= budget, budget
        assert s.index not in r.envs


# -- through the manager, over steps ------------------------------------------------------------
class ScriptedEngines:
    """Engines (rollout/engine_api.py) whose model is `next_turn`, a character per tick, and
    whose requests an abort ends with their tokens, as the real client's do."""

    def __init__(self) -> None:
        self._running: set[asyncio.Task] = set()
        self.requests = 0

    def workers(self):
        return ["w0", "w1"]

    async def loads(self):
        return {"w0": 0, "w1": 0}

    async def abort_all(self):
        for t in list(self._running):
            t.cancel()
        while self._running:
            await asyncio.sleep(0.001)

    async def generate(self, sample, sampling, *, max_new_tokens, version, worker=None):
        self.requests += 1
        sample.start_request()
        task = asyncio.current_task()
        self._running.add(task)
        try:
            start = sample.metadata[STATE_KEY]["turn_start"]
            text = CharCodec().decode(sample.response_ids)
            turn = next_turn(text[:start])
            for ch in turn[len(text) - start:][:max_new_tokens]:
                await asyncio.sleep(0.001)
                sample.append([ord(ch)], [-0.1], version)
            finish = "stop" if CharCodec().decode(sample.response_ids[start:]) == turn else "length"
            sample.append([], [], version, finish_reason=finish)
            return worker or "w0"
        except asyncio.CancelledError:
            sample.interrupt()  # aborted: keeps its tokens, as the client does
            return worker or "w0"
        finally:
            self._running.discard(task)


def test_partial_rollouts_park_episodes_mid_turn_and_on_tools_and_every_one_ends_as_played_through():
    """The partial policy over 5 steps: steps end with episodes mid-turn or on a tool call; they
    resume in later steps; every trained episode is exactly the uninterrupted game for its
    secret, with its observations masked; the buffer's accounting balances."""
    from rlkit.buffers.source import records_from_token_lists
    from rlkit.config import load_recipe
    from rlkit.driver.rollout_service import RolloutService

    r = load_recipe(None, ["rollout.batch_size=3", "rollout.n_samples_per_prompt=2",
                           "rollout.policy=partial", "rollout.partial.over_provision=2.0",
                           "rollout.max_staleness=20", "rollout.sampling.max_new_tokens=400",
                           "train.algorithm.off_policy_correction=tis"])
    secrets = [1 + (37 * i) % 100 for i in range(60)]
    source = ListPromptSource(records_from_token_lists([[1, i] for i in range(60)], label=lambda i: secrets[i]),
                              shuffle=False)

    async def score(sample, group):
        raise AssertionError("the environment gives every reward")

    service = RolloutService.from_config(r.rollout, source, ScriptedEngines(), score)
    service.manager.episodes = EpisodeRunner(
        multi_turn, guess_number, CharCodec(), SamplingConfig(max_new_tokens=400, stop=[STOP]),
        env_kwargs={"max_turns": 12})

    def played_through(secret):
        g = group()
        g.prompt = PromptRecord(ids=(1, 2), text="", label=secret, source_index=0)
        play(runner(), g, ScriptedModel(g.samples[0]))
        return g.samples[0]

    envs = service.manager.episodes.envs
    dropped: list[int] = []

    async def steps():
        trained = []
        for v in range(5):
            report = await service.run_step(v)
            # Parked episodes keep their environments, and only they do.
            parked = {s.index for g in service.buffer.queued(Place.PARTIAL) for s in g.samples
                      if s.response_ids and not s.status.terminal}
            assert parked <= set(envs) <= {s.index for g in service.buffer.queued(Place.PARTIAL)
                                           for s in g.samples}, v
            if v == 1:  # a parked group dropped (as a filter or the staleness rule would)
                g = next(g for g in service.buffer.queued(Place.PARTIAL) if set(envs) & {s.index for s in g.samples})
                dropped.extend(s.index for s in g.samples)
                service.buffer.drop(g, "test")
            trained += (await service.take(3)).refs
            assert report.buffer["balanced"], v
            await service.set_version(v + 1)
        return trained

    trained = asyncio.run(steps())
    assert dropped and not set(dropped) & set(envs)  # its environments were forgotten
    assert len(trained) == 15
    assert sum(service.manager.episodes.counts[k] for k in ("env_steps_rerun",)) > 0 or any(
        s.requests > 1 for g in trained for s in g.samples)
    resumed = 0
    for g in trained:
        want = played_through(g.prompt.label)
        for s in g.samples:
            assert (s.response_ids, s.loss_mask, s.reward) == (want.response_ids, want.loss_mask, 1.0)
            resumed += s.requests > int(s.metadata[STATE_KEY]["turns"])
    assert resumed > 0  # some turn was aborted and resumed from its tokens in a later step
