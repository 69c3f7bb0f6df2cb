"""The example episode plugin package (examples/episode-plugin), pip-installed as a user would:
its environment (`reach_target`) and generator (`hinted_turns`) resolve by their entry-point
names through rlkit's plugin rule (`load_episode_runner`, as the rollout actor builds its
runner). A scripted model plays a whole episode, known-answer (tokens, loss mask, reward).
Stopped during any tool call (before the call ran, or after it ran but before its answer came
back) or at any model token, then resumed in memory or from a checkpoint through the
environment's snapshot, the episode ends exactly as the uninterrupted one: the episode layer
puts the environment back as it was before an abandoned call, so even the built-in
`multi_turn` never applies a move twice."""

from __future__ import annotations

import asyncio
import functools
import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlkit.buffers import Group, PromptRecord, SampleStatus
from rlkit.buffers.sample import Sample
from rlkit.rollout.config import SamplingConfig
from rlkit.rollout.episodes import STATE_KEY, EpisodeRunner, EpisodeStep, multi_turn

ROOT = Path(__file__).resolve().parents[2]
STOP = "."
INTRO = ("Reach 49 from 2 in at most 8 moves. A move is +N, -N or *N with N from 1 to 9, "
         "e.g. <move>*3</move>")
# The scripted episode of prompt index 2 (start 2, target 49): a turn without a move (an error
# observation, which counts), then *9 *2 +9 +4. Observations are in { } (CharCodec).
WHOLE = ("{" + INTRO + "}"
         "hmm.{[turn 1/8] <error>no move: write +N, -N or *N with N from 1 to 9</error>}"
         "move *9.{[turn 2/8] now 18}"
         "move *2.{[turn 3/8] now 36}"
         "move +9.{[turn 4/8] now 45}"
         "move +4.")


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory):
    """pip-install the example package, as tests/rewards/test_rewards.py does the reward example
    (into a folder put on sys.path, so the test does not change the environment;
    importlib.metadata finds its entry points there)."""
    target = tmp_path_factory.mktemp("site")
    # built from a copy: setuptools writes build/ and *.egg-info beside the sources it builds
    src = tmp_path_factory.mktemp("src") / "episode-plugin"
    shutil.copytree(ROOT / "examples" / "episode-plugin", src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(src)],
        check=True,
    )
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    yield target
    sys.path.remove(str(target))
    for name in [m for m in sys.modules if m.split(".")[0] == "rlkit_example_episodes"]:
        sys.modules.pop(name)


class CharCodec:
    """One token per character; an observation is wrapped in { } (its turn markers)."""

    def decode(self, ids):
        return "".join(map(chr, ids))

    def encode_observation(self, text):
        return [ord(c) for c in "{" + text + "}"]


def next_turn(response: str) -> str:
    """The scripted model: one turn without a move, then greedy moves towards the target."""
    start, target = map(int, re.search(r"Reach (\d+) from (\d+)", response).groups()[::-1])
    if response.count("}") == 1:
        return "hmm" + STOP
    values = re.findall(r"now (-?\d+)", response)
    v = int(values[-1]) if values else start
    d = target - v
    if -9 <= d <= 9:
        move = f"+{d}" if d > 0 else f"-{-d}"
    elif d < 0:
        move = "-9"
    else:
        k = max((k for k in range(2, 10) if v * k <= target), default=None)
        move = f"*{k}" if k and v * k > v + 9 else "+9"
    return f"move {move}{STOP}"


class ScriptedModel:
    """`generate` for EpisodeStep: the model's turn token by token. `abort_at`: the model token
    (counted over the whole run) at which the request is aborted, as a step's stop does."""

    def __init__(self, sample: Sample, abort_at: int | None = None) -> None:
        self.sample, self.abort_at, self.made = sample, abort_at, 0

    async def generate(self, sampling: SamplingConfig) -> None:
        s = self.sample
        s.start_request()
        start = s.metadata[STATE_KEY]["turn_start"]
        text = CharCodec().decode(s.response_ids)
        for ch in next_turn(text[:start])[len(text) - start:]:
            if self.abort_at is not None and self.made == self.abort_at:
                self.abort_at = None
                s.interrupt()
                return
            if len(s.response_ids) >= sampling.max_new_tokens:
                s.append([], [], 0, finish_reason="length")
                return
            s.append([ord(ch)], [-0.1], 0)
            self.made += 1
        s.append([], [], 0, finish_reason="stop")


def group() -> Group:
    prompt = PromptRecord(ids=(1, 2), text="reach", source_index=2)
    return Group(group_id=0, prompt=prompt, target_n=1,
                 samples=[Sample(index=0, group_id=0, prompt_ids=prompt.ids)])


@functools.cache
def recipe():
    from rlkit.config import load_recipe

    return load_recipe(None, ["rollout.episode.generator=hinted_turns",
                              "rollout.episode.environment=reach_target",
                              "rollout.episode.env_kwargs={max_turns: 8, high: 60}",
                              f"rollout.episode.turn_stop=['{STOP}']",
                              "rollout.sampling.max_new_tokens=400"])


def recipe_runner() -> EpisodeRunner:
    """The runner the rollout actor would build from the recipe (its codec swapped for the
    character codec: the plugins never see tokens)."""
    from rlkit.plugins import load_episode_runner

    r = recipe()
    runner = load_episode_runner(r.rollout.episode, r.rollout.sampling, tokenizer=None)
    runner.codec = CharCodec()
    return runner


def play(r: EpisodeRunner, g: Group, model: ScriptedModel, stop_at_tool: int | None = None,
         ran: bool = False) -> None:
    """One step of the episode. `stop_at_tool`: the step ends during the k-th tool call, before
    the environment ran it, or (`ran`) after it ran but before its answer came back."""
    stopped = asyncio.Event()
    calls = 0
    step_tool = r.tools.step

    async def tool(env, action):
        nonlocal calls
        calls += 1
        if calls != stop_at_tool:
            return await step_tool(env, action)
        if ran:
            await step_tool(env, action)  # the move is made; its answer is lost with the step
        stopped.set()
        await asyncio.sleep(3600)  # cancelled: the episode parks on this call

    r.tools.step = tool
    try:
        asyncio.run(r.run(g.samples[0], g, EpisodeStep(model.generate, stopped, lambda: 0)))
    finally:
        r.tools.step = step_tool


def uninterrupted() -> Sample:
    g, r = group(), recipe_runner()
    play(r, g, ScriptedModel(g.samples[0]))
    return g.samples[0]


def resumed(abort_at=None, stop_at_tool=None, ran=False, through_checkpoint=False, make=recipe_runner):
    g, r = group(), make()
    model = ScriptedModel(g.samples[0], abort_at)
    play(r, g, model, stop_at_tool, ran)
    s = g.samples[0]
    parked = s.status
    if through_checkpoint:  # a new runner: the environment must come from its snapshot
        s = Sample.from_state(s.to_state(), g.prompt.ids)
        g.samples[0] = s
        r = make()
        model = ScriptedModel(s)
    play(r, g, model)
    return parked, s, r


def test_both_plugins_resolve_by_their_entry_point_names(installed_plugin):
    from rlkit.plugins import resolve_plugin

    assert resolve_plugin("environment", "reach_target").__module__ == "rlkit_example_episodes.reach_target"
    assert resolve_plugin("generator", "hinted_turns").__module__ == "rlkit_example_episodes.generator"
    r = recipe_runner()
    assert (r.generator.__name__, r.make_env.__name__) == ("hinted_turns", "reach_target")
    assert r.env_kwargs == {"max_turns": 8, "high": 60} and r.turn_sampling.stop == [STOP]


def test_a_whole_episode_is_the_known_transcript_with_masked_observations(installed_plugin):
    s = uninterrupted()
    text = CharCodec().decode(s.response_ids)
    assert text == WHOLE
    assert s.status is SampleStatus.DONE and s.reward == 1.0 and s.finish_reason == "stop"
    observed = {i for m in re.finditer(r"\{[^}]*\}", text) for i in range(m.start(), m.end())}
    assert [i for i, m in enumerate(s.loss_mask) if m == 0] == sorted(observed)
    assert all(m == 1 for i, m in enumerate(s.loss_mask) if i not in observed)
    assert s.metadata[STATE_KEY]["phase"] == "done" and s.metadata[STATE_KEY]["turns"] == 5


@pytest.mark.parametrize("through_checkpoint", [False, True])
@pytest.mark.parametrize("ran", [False, True], ids=["before_the_call_ran", "after_it_ran"])
def test_an_episode_stopped_during_any_tool_call_resumes_to_the_same_end(installed_plugin, ran, through_checkpoint):
    whole = uninterrupted()
    for call in range(1, 6):
        parked, s, r = resumed(stop_at_tool=call, ran=ran, through_checkpoint=through_checkpoint)
        assert parked is SampleStatus.PARTIAL, call
        assert s.metadata[STATE_KEY]["phase"] == "done", call
        assert (s.response_ids, s.loss_mask, s.reward) == (whole.response_ids, whole.loss_mask, 1.0), call
        assert r.counts["env_steps_rerun"] == (0 if through_checkpoint else 1)  # the parking runner's
        assert r.counts["episodes_restored"] == (1 if through_checkpoint else 0)
        assert r.counts["episodes_restarted"] == 0


@pytest.mark.parametrize("through_checkpoint", [False, True])
def test_an_episode_aborted_at_any_model_token_resumes_to_the_same_end(installed_plugin, through_checkpoint):
    whole = uninterrupted()
    for k in range(sum(whole.loss_mask)):
        parked, s, _ = resumed(abort_at=k, through_checkpoint=through_checkpoint)
        assert parked in (SampleStatus.PARTIAL, SampleStatus.PENDING), k
        assert (s.response_ids, s.loss_mask, s.reward) == (whole.response_ids, whole.loss_mask, 1.0), k


def test_an_abandoned_move_that_already_ran_is_applied_once(installed_plugin):
    """With the built-in `multi_turn` too: the move *9 that ran before the step ended is not
    made again on resume (which would give 18 * 9 = 162 and lose the episode): the episode layer
    restored the environment's snapshot from before the call."""
    from rlkit.plugins import resolve_plugin

    def plain():
        return EpisodeRunner(multi_turn, resolve_plugin("environment", "reach_target"), CharCodec(),
                             SamplingConfig(max_new_tokens=400, stop=[STOP]), env_kwargs={"max_turns": 8})

    for ran in (True, False):  # the call had run before the step ended, or had not
        _, s, _ = resumed(stop_at_tool=2, ran=ran, make=plain)
        text = CharCodec().decode(s.response_ids)
        assert "now 162" not in text and "now 18" in text and s.reward == 1.0, ran
