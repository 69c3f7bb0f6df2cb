"""A plain-loop generator is correct under parking and resume (rollout/episodes.py: a parked
episode re-enters its generator from the start and the context replays the recorded calls).

Known answers: a model as an engine serves it (its tokens a function of the episode so far;
asked to go on after its own stop, it writes on past it, as a real one would) plays the
guessing game by bisection. The episode is parked (a) mid first turn, (b) right as a turn ended
in a call (before the tool ran), (b') while the tool runs, (c) after the tool's observation was
appended, (d) mid second turn; resumed in memory or from a JSON checkpoint, it ends with the
unparked episode's tokens, loss mask, reward and turns, every tool call made exactly once with
the same action, and no engine call for a recorded turn. The generator of the issue (a plain
loop) and one keeping its phase in ctx.state (as generators had to before) both pass. A
generator that calls otherwise on resume is a clear error, not a corrupt episode."""

from __future__ import annotations

import asyncio
import json

import pytest

from rlkit.buffers import SampleStatus
from rlkit.buffers.sample import Sample
from rlkit.rollout.config import SamplingConfig
from rlkit.rollout.environments.guess_number import guess_number
from rlkit.rollout.episodes import STATE_KEY, EpisodeReplayError, EpisodeRunner, EpisodeStep, episode_turns
from tests.manager.test_episodes import STOP, CharCodec, group, next_turn

RAMBLE = " or 99" + STOP  # what the model writes when asked to go on after its own stop


class Engine:
    """`generate` for EpisodeStep, as an engine serves the model: it sees prompt + response ids
    only (never rlkit's bookkeeping). A turn in progress is continued to the bisection's guess;
    after a turn that ended at its stop with no observation since, it writes RAMBLE. `park`:
    ("token", k) aborts before the k-th model token and ends the step; ("turn_end", n) ends the
    step as the n-th turn stops."""

    def __init__(self, sample: Sample, park: tuple[str, int] | None = None) -> None:
        self.sample, self.park = sample, park
        self.stopped = asyncio.Event()
        self.requests = self.made = self.ended = 0

    async def generate(self, sampling: SamplingConfig) -> None:
        s = self.sample
        self.requests += 1
        s.start_request()
        text = CharCodec().decode(s.response_ids)
        start = text.rfind("]") + 1  # after the last observation
        turn = text[start:]
        more = RAMBLE if turn.endswith(STOP) else next_turn(text[:start])[len(turn):]
        for ch in more:
            if self.park == ("token", self.made):
                self.stopped.set()  # the step ends and aborts the request: it keeps its tokens
                s.interrupt()
                return
            s.append([ord(ch)], [-0.1], 0)
            self.made += 1
        s.append([], [], 0, finish_reason="stop")
        self.ended += 1
        if self.park == ("turn_end", self.ended):
            self.stopped.set()


def plain_loop(seen: list[int]):
    """What a user writes first: no phase kept anywhere; a local count of turns."""

    async def gen(ctx):
        turns = 0
        while True:
            turn = await ctx.model_turn()
            if turn.ended != "stop":
                return
            turns += 1
            obs = await ctx.tool_step(turn.text)
            if obs is None:
                return
            if obs.done:
                seen.append(turns)
                ctx.finish(obs.reward)
                return
            ctx.append_observation(obs.text)
            if ctx.sample.status.terminal:
                return

    return gen


def phase_loop(seen: list[int]):
    """A generator written for the old contract: its phase in ctx.state (the built-in
    multi_turn before replay, the example plugin's hinted_turns)."""

    async def gen(ctx):
        st = ctx.state
        while True:
            if st.get("phase", "model") == "model":
                turn = await ctx.model_turn()
                if turn.ended != "stop":
                    return
                st.update(phase="tool", action=turn.text)
            obs = await ctx.tool_step(st["action"])
            if obs is None:
                return
            if obs.done:
                seen.append(st["turns"])
                st["phase"] = "done"
                ctx.finish(obs.reward)
                return
            st["phase"] = "model"
            ctx.append_observation(obs.text)
            if ctx.sample.status.terminal:
                return

    return gen


def runner(gen, actions: list[str]) -> EpisodeRunner:
    def make(prompt, **kw):  # the game, every step it takes recorded
        env = guess_number(prompt, **kw)
        step = env.step

        async def counted(action):
            actions.append(action)
            return await step(action)

        env.step = counted
        return env

    return EpisodeRunner(gen, make, CharCodec(), SamplingConfig(max_new_tokens=400, stop=[STOP]),
                         env_kwargs={"max_turns": 12})


def play(r: EpisodeRunner, g, engine: Engine) -> None:
    """One step of the episode. The engine's park, or ("tool", n): the step ends while the n-th
    tool call waits on a slow tool (it has not stepped the environment); ("answered", n): the
    step ends as the n-th tool call answers (its observation is appended, no turn follows)."""
    step_tool, park, answered = r.tools.step, engine.park, 0

    async def tool(env, action):
        nonlocal answered
        if park == ("tool", answered + 1):
            engine.stopped.set()
            await asyncio.Event().wait()  # never answers: abandoned by the step's end
        obs = await step_tool(env, action)
        answered += 1
        if park == ("answered", answered):
            engine.stopped.set()
        return obs

    r.tools.step = tool
    try:
        asyncio.run(r.run(g.samples[0], g, EpisodeStep(engine.generate, engine.stopped, lambda: 0)))
    finally:
        r.tools.step = step_tool


def episode(make_gen, park=None, through_checkpoint=False):
    """Play the episode, parked at `park` and resumed (through a JSON checkpoint: a new runner,
    the environment from its snapshot). -> the sample, the environment's actions, the engine's
    requests, the runners' counts summed, the generator's local turn counts, the parked status."""
    actions: list[str] = []
    seen: list[int] = []
    g, r = group(), runner(make_gen(seen), actions)
    engine = Engine(g.samples[0], park)
    play(r, g, engine)
    parked, requests, counts = g.samples[0].status, engine.requests, dict(r.counts)
    if park is not None:
        s = g.samples[0]
        if through_checkpoint:
            g.samples[0] = Sample.from_state(json.loads(json.dumps(s.to_state())), g.prompt.ids)
            r = runner(make_gen(seen), actions)
        engine = Engine(g.samples[0])
        play(r, g, engine)
        requests += engine.requests
        counts = {k: counts[k] * through_checkpoint + r.counts[k] for k in counts}  # run totals
    return g.samples[0], actions, requests, counts, seen, parked


PARKS = {
    "a_mid_first_turn": ("token", 4),
    "b_turn_ended_in_a_call": ("turn_end", 1),
    "b_during_the_call": ("tool", 1),
    "c_observation_appended": ("answered", 1),
    "d_mid_second_turn": ("token", 12),  # the first turn, "guess 50.", is 9 tokens
}


@pytest.mark.parametrize("make_gen", [plain_loop, phase_loop], ids=["plain_loop", "phase_in_state"])
def test_the_unparked_episode_is_the_known_game(make_gen):
    s, actions, requests, counts, seen, _ = episode(make_gen)
    assert CharCodec().decode(s.response_ids) == (
        "[I am thinking of a number from 1 to 100. Guess it.]guess 50.[lower]guess 25.[higher]guess 37.")
    assert s.status is SampleStatus.DONE and s.reward == 1.0
    assert actions == ["guess 50.", "guess 25.", "guess 37."] and requests == 3 and seen == [3]
    assert episode_turns(s) == 3 and counts["turns"] == 3 and counts["observations"] == 3
    assert "log" not in s.metadata[STATE_KEY]  # only a resume reads the record


@pytest.mark.parametrize("through_checkpoint", [False, True], ids=["in_memory", "checkpoint"])
@pytest.mark.parametrize("make_gen", [plain_loop, phase_loop], ids=["plain_loop", "phase_in_state"])
@pytest.mark.parametrize("where", list(PARKS))
def test_parked_anywhere_and_resumed_it_ends_as_the_unparked_episode(where, make_gen, through_checkpoint):
    whole, whole_actions, whole_requests, _, _, _ = episode(make_gen)
    s, actions, requests, counts, seen, parked = episode(make_gen, PARKS[where], through_checkpoint)
    assert parked is SampleStatus.PARTIAL
    assert CharCodec().decode(s.response_ids) == CharCodec().decode(whole.response_ids)
    assert (s.response_ids, s.loss_mask, s.reward, s.status) == (
        whole.response_ids, whole.loss_mask, 1.0, SampleStatus.DONE)
    assert actions == whole_actions  # every call stepped the environment once, as generated
    assert episode_turns(s) == 3 and seen[-1] == 3  # also the generator's own local count
    assert counts["turns"] == 3 and counts["observations"] == 3  # nothing live twice
    # a recorded turn costs no request; only a turn parked mid-way takes a second one
    assert requests == whole_requests + (where in ("a_mid_first_turn", "d_mid_second_turn"))
    assert counts["env_steps_rerun"] == (where == "b_during_the_call")
    assert counts["episodes_restored"] == through_checkpoint and counts["episodes_restarted"] == 0


def test_the_engine_double_writes_past_its_stop_as_a_real_engine_would():
    """What makes the test above bite: asked to go on after a turn that ended in a call, the
    engine writes past its stop, so a resume that sent a new turn there (instead of running the
    call) would send "guess 50. or 99." to the tool and end in another game."""
    g = group()
    s = g.samples[0]
    engine = Engine(s)
    s.metadata[STATE_KEY] = {"log": []}
    s.append([ord(c) for c in "guess 50."], [-0.1] * 9, 0)
    asyncio.run(engine.generate(SamplingConfig(max_new_tokens=400, stop=[STOP])))
    assert CharCodec().decode(s.response_ids) == "guess 50." + RAMBLE


def test_a_generator_that_calls_otherwise_on_resume_is_an_error_naming_the_episode():
    entries: list[int] = []

    def fickle(seen):
        async def gen(ctx):
            entries.append(1)
            while True:
                turn = await ctx.model_turn()
                if turn.ended != "stop":
                    return
                # e.g. a random or outside-state decision: another action on the second entry
                obs = await ctx.tool_step(turn.text + (" please" if len(entries) > 1 else ""))
                if obs is None:
                    return
                if obs.done:
                    ctx.finish(obs.reward)
                    return
                ctx.append_observation(obs.text)

        return gen

    actions: list[str] = []
    g, r = group(), runner(fickle([]), actions)
    play(r, g, Engine(g.samples[0], ("turn_end", 2)))
    s = g.samples[0]
    parked_ids = list(s.response_ids)
    with pytest.raises(EpisodeReplayError) as e:
        play(r, g, Engine(s))
    msg = str(e.value)
    assert "sample 0 (group 0, prompt 0, slot 0)" in msg
    assert "called tool_step('guess 50. please') at call 2" in msg
    assert "has tool_step('guess 50.') (they part at character 9)" in msg
    # nothing was corrupted: the episode is still parked where it stood
    assert s.response_ids == parked_ids and s.status is SampleStatus.PARTIAL and actions == ["guess 50."]


def test_a_generator_that_returns_before_its_park_is_an_error():
    entries: list[int] = []

    def quitter(seen):
        inner = plain_loop(seen)

        async def gen(ctx):
            entries.append(1)
            if len(entries) == 1:
                await inner(ctx)

        return gen

    g, r = group(), runner(quitter([]), [])
    play(r, g, Engine(g.samples[0], ("answered", 1)))
    with pytest.raises(EpisodeReplayError, match=r"returned at call 1, where the record .* has model_turn\(\)"):
        play(r, g, Engine(g.samples[0]))


def test_an_episode_saved_without_a_record_restarts_from_its_prompt():
    """State from an rlkit before the replay (no `log`): it cannot be replayed, so it starts
    again (counted), and still ends as the unparked game."""
    whole = episode(plain_loop)[0]
    g, r = group(), runner(plain_loop([]), [])
    play(r, g, Engine(g.samples[0], ("turn_end", 1)))
    state = g.samples[0].to_state()
    old = state["metadata"][STATE_KEY]
    state["metadata"][STATE_KEY] = {"phase": "tool", "action": "guess 50.", "turns": 1,
                                    "turn_start": old["turn_start"], "env": old["env"]}
    g.samples[0] = Sample.from_state(json.loads(json.dumps(state)), g.prompt.ids)
    r = runner(plain_loop([]), [])
    play(r, g, Engine(g.samples[0]))
    assert r.counts["episodes_restarted"] == 1
    assert (g.samples[0].response_ids, g.samples[0].reward) == (whole.response_ids, 1.0)


def test_an_episode_cancelled_during_a_tool_call_cancels_the_call_and_resumes_to_the_same_end():
    """The manager cancels an episode's task that outlives the abort's grace: the call in
    flight is cancelled with it (not left running), the environment is put back as before the
    call, and the resume runs the call again."""
    whole = episode(plain_loop)[0]
    actions: list[str] = []
    g, r = group(), runner(plain_loop([]), actions)
    s, engine, step_tool = g.samples[0], Engine(g.samples[0]), r.tools.step
    made, cancelled = asyncio.Event(), []

    async def hangs_after_the_move(env, action):
        await step_tool(env, action)  # the move is made; its answer never comes back
        made.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(action)
            raise

    async def main():
        task = asyncio.create_task(r.run(s, g, EpisodeStep(engine.generate, engine.stopped, lambda: 0)))
        await made.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert cancelled == ["guess 50."]  # before this loop ends: the call did not outlive the task

    r.tools.step = hangs_after_the_move
    asyncio.run(main())
    r.tools.step = step_tool
    assert s.status is SampleStatus.PARTIAL and r.envs[s.index].turns == 0  # put back
    assert r.counts["env_steps_rerun"] == 1
    play(r, g, Engine(s))
    assert (s.response_ids, s.loss_mask, s.reward) == (whole.response_ids, whole.loss_mask, 1.0)
    assert actions == ["guess 50.", "guess 50.", "guess 25.", "guess 37."]  # made, abandoned, made once
