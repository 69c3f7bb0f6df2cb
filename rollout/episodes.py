"""Multi-turn rollouts: a sample is an episode, run by a generator over an environment.

A generator (plugin kind "generator": a built-in name, an entry point in `rlkit.generators`, or
a dotted path) is an async function of an `EpisodeContext`. It alternates model turns, which go
through the manager's own request path (`EpisodeStep.generate`: dispatch, aborts, health,
relaunches and accounting apply to every turn), with environment steps run by the
`ToolRunner` (bounded, timed, failures counted). Everything lands on the one `Sample`:

    model tokens        appended by the engine as generated (loss mask 1, their version)
    observation tokens  tokenized once from the environment's text by the `Codec` (with the
                        chat template's turn markers) and appended with loss mask 0

Nothing earlier is ever re-tokenized: the next turn is sent as prompt + response ids.

Parking (an abort ends the step, or the run stops): the episode stays exactly where it is.
    mid-turn      the turn's tokens so far are kept (the sample is PARTIAL); the next step
                  continues that turn from them
    on a tool     the tool call is abandoned and RE-RUN when the episode resumes; an
                  environment with snapshot/restore is first put back as it was before the
                  call, one without must tolerate being called twice

Resuming is rlkit's bookkeeping, not the generator's: every call a generator makes through its
context is recorded in the episode's state (`log`: each model turn's token span, each answered
tool call with its observation, each observation appended). A parked episode re-enters its
generator from the start and the context REPLAYS it against that record: a recorded model turn
returns its text at once (no engine call), a recorded tool call returns its recorded
observation (the environment is not stepped again), a recorded observation is not appended
again, until the generator reaches the call the episode was parked in; from there it runs live
(a turn parked mid-way goes on from its tokens, an abandoned tool call is run). So a plain loop
resumes correctly, and the generator's local variables and `ctx.state` are rebuilt by the
replay itself. A generator that makes other calls on replay than the record holds (unseeded
randomness, outside state) is an `EpisodeReplayError` naming the episode and the call.

The environment is never replayed: it is the live object (`EpisodeRunner.envs`), or restored
from the snapshot taken at the park (an environment with snapshot/restore, resumed from a
checkpoint), so it already stands where the record ends. The episode's state (the record, the
turns ended, where the current turn began, the environment's snapshot) lives in
`sample.metadata["episode"]`, so it is saved with the buffer; the record is dropped when the
episode ends. Resumed from a checkpoint, an episode whose environment cannot be restored (or
saved by an rlkit without the record) starts again from its prompt (`episodes_restarted`).

A sample with no tokens is always a fresh episode (a reset by the staleness rule or by tail
batching's restart forgets the episode with its tokens).

Pure asyncio: no HTTP, Ray or torch, so episodes run in the simulator and in tests unchanged.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Literal, Protocol, Sequence

from rlkit.buffers.sample import Sample, SampleStatus
from rlkit.rollout.environments.protocol import Environment, EnvironmentFactory, EpisodePrompt, Observation, can_snapshot
from rlkit.rollout.environments.tools import ToolRunner

if TYPE_CHECKING:
    from rlkit.buffers.group import Group
    from rlkit.rollout.config import SamplingConfig

STATE_KEY = "episode"  # in sample.metadata
# What EpisodeRunner counts (run totals, in every step's metrics as rollout/episodes/<name>).
# env_steps_rerun: environment steps abandoned by a park and run again on resume (a tool call,
# or the step that ends an episode, such as the calculator's reading of a final answer).
EPISODE_COUNTS = ("episodes_started", "episodes_ended", "episodes_restored", "episodes_restarted",
                  "turns", "observations", "env_steps_rerun")


def episode_turns(s: Sample) -> int:
    """Model turns of an episode that ended at their stop (kept in its state by the runner);
    0 for a sample that is not an episode."""
    return int((s.metadata.get(STATE_KEY) or {}).get("turns", 0))


@dataclass(frozen=True)
class EpisodeStep:
    """What the manager's step lends an episode: `generate(sampling)` runs one model turn of
    the sample through the step's request path (to its budget or its next stop), `stopped` is
    set when the step ends, `version()` the weights' version now."""

    generate: Callable[["SamplingConfig"], Awaitable[None]]
    stopped: asyncio.Event
    version: Callable[[], int]


class Codec(Protocol):
    """Text <-> tokens for episodes (the rollout actor's tokenizer)."""

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_observation(self, text: str) -> list[int]:
        """An observation's tokens with the turn markers around it: what follows the model's
        turn up to where the model's next turn begins."""
        ...


class TokenizerCodec:
    """A Codec over a Hugging Face tokenizer; observations through `template` (the recipe's
    rollout.episode.observation_template), never with special tokens added."""

    def __init__(self, tokenizer: Any, template: str) -> None:
        self.tokenizer, self.template = tokenizer, template

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode_observation(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(self.template.format(observation=text), add_special_tokens=False))


@dataclass(frozen=True)
class TurnResult:
    text: str  # the model's turn, decoded (all of it, also when it was resumed mid-way)
    ended: Literal["stop", "length", "parked"]  # at a stop, at the episode's budget, aborted


class EpisodeReplayError(RuntimeError):
    """A resumed episode's generator did not make the calls recorded before its park."""


# rlkit's keys in an episode's state, kept when a parked episode re-enters its generator (the
# record, the environment's snapshot, where the current turn began). Every other key is the
# generator's (ctx.state) and starts afresh, rebuilt by the replay; so does "turns" (the turns
# ended at their stop, counted again as they are replayed) and "phase" ("done" once finished).
RUNNER_KEYS = ("log", "env", "turn_start")


class EpisodeContext:
    """What a generator works with for one episode (one sample). Each entry into the generator
    (the first, and each resume after a park) runs it from its start: calls the record already
    holds are answered from it, the rest run live and are recorded (module docstring)."""

    def __init__(self, runner: "EpisodeRunner", sample: Sample, prompt: EpisodePrompt,
                 env: Environment, step: EpisodeStep) -> None:
        self.runner, self.sample, self.prompt, self.env, self._step = runner, sample, prompt, env, step
        # The episode's state: plain data, saved with the buffer. What the generator keeps here
        # starts as at the episode's start on every entry; the replay rebuilds it.
        self.state: dict[str, Any] = sample.metadata.setdefault(STATE_KEY, {})
        for key in [k for k in self.state if k not in RUNNER_KEYS]:
            del self.state[key]
        self.state["turns"] = 0
        self._log: list[dict[str, Any]] = self.state.setdefault("log", [])
        self._at = 0  # the recorded call the generator's next call replays

    @property
    def stopping(self) -> bool:
        return self._step.stopped.is_set()

    @property
    def replaying(self) -> bool:
        """True while the generator's calls are answered from the record (a resumed episode
        before the call it was parked in): work it does outside the context runs again."""
        return self._at < len(self._log)

    async def model_turn(self) -> TurnResult:
        """Generate the model's turn; a recorded one is returned as it was, and the turn the
        episode was parked in goes on from its tokens. A step that has ended starts no turn."""
        s = self.sample
        entry = self._replay("model_turn")
        if entry is not None and entry["end"] is not None:  # ended before the park
            self.state["turns"] += 1
            return TurnResult(self.runner.codec.decode(s.response_ids[entry["start"]:entry["end"]]), "stop")
        if entry is None:  # a new turn
            entry = self._record({"call": "model_turn", "start": len(s.response_ids), "end": None})
        start = self.state["turn_start"] = entry["start"]
        if self.stopping:  # the step has ended: the turn waits for the next one
            return TurnResult(self.runner.codec.decode(s.response_ids[start:]), "parked")
        await self._step.generate(self.runner.turn_sampling)
        text = self.runner.codec.decode(s.response_ids[start:])
        if s.status is SampleStatus.DONE:  # the turn's stop, not (yet) the episode's end
            s.reopen()
            entry["end"] = len(s.response_ids)
            self.runner.counts["turns"] += 1
            self.state["turns"] += 1  # what rankers learn (rankers/lengths.py)
            return TurnResult(text, "stop")
        if s.status is SampleStatus.TRUNCATED:
            return TurnResult(text, "length")
        return TurnResult(text, "parked")  # PARTIAL / PENDING (aborted), or FAILED

    async def tool_step(self, action: str) -> Observation | None:
        """The environment's answer to `action` (failures become error observations, counted);
        a recorded call returns its recorded observation without stepping the environment.
        None when the step ends first: the episode parks, and the call is run on resume. An
        environment with snapshot/restore is put back as it was before the abandoned call
        (which may have run to its end before the cancellation reached it), so the re-run is
        exact; one without must tolerate being called twice."""
        entry = self._replay("tool_step", action=action)
        if entry is not None:
            o = entry["observation"]
            return Observation(o["text"], o["done"], o["reward"], o["info"])
        if self.stopping:  # the step has ended: not started, run on resume
            return None
        before = self.env.snapshot() if can_snapshot(self.env) else None  # type: ignore[attr-defined]
        call = asyncio.ensure_future(self.runner.tools.step(self.env, action))
        stop = asyncio.ensure_future(self._step.stopped.wait())
        abandoned = False
        try:
            await asyncio.wait({call, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this task is cancelled: the call never outlives the episode's run
            stop.cancel()
            if not call.done():
                abandoned = True
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)
                if before is not None:
                    self.env.restore(before)  # type: ignore[attr-defined]
                self.runner.counts["env_steps_rerun"] += 1
        if abandoned:
            return None
        obs: Observation = call.result()
        self._record({"call": "tool_step", "action": action, "observation": _plain(obs)})
        return obs

    def append_observation(self, text: str) -> None:
        """The observation's tokens, once, with loss mask 0; the next turn begins after them."""
        if self._replay("append_observation", text=text) is not None:
            return  # appended before the park
        self.runner.observe(self.sample, text, self._step.version())
        self._record({"call": "append_observation", "text": text})

    def finish(self, reward: float | None = None) -> None:
        """The episode ends here (the environment said done); its reward if the environment
        gives one (else the recipe's reward scores the sample)."""
        self._replay("finish")  # never recorded: an ended episode does not resume
        s = self.sample
        s.append([], [], s.versions[-1] if s.versions else self._step.version(), finish_reason="stop")
        self.state["phase"] = "done"
        if reward is not None:
            s.set_reward(reward)

    def _record(self, entry: dict[str, Any]) -> dict[str, Any]:
        self._log.append(entry)
        self._at += 1
        return entry

    def _replay(self, call: str, **args: str) -> dict[str, Any] | None:
        """The recorded entry this call replays, or None past the record (live)."""
        if not self.replaying:
            return None
        entry = self._log[self._at]
        if entry["call"] != call:
            raise self.diverged(f"called {call}({', '.join(_quote(v) for v in args.values())})")
        for key, value in args.items():
            if entry[key] != value:  # where they part: a quote of 60 characters may not show it
                at = next((i for i, (a, b) in enumerate(zip(value, entry[key])) if a != b),
                          min(len(value), len(entry[key])))
                raise self.diverged(f"called {call}({_quote(value)})", f" (they part at character {at})")
        self._at += 1
        return entry

    def diverged(self, what: str, detail: str = "") -> EpisodeReplayError:
        """The error for a resumed generator that did `what` ("called ...", "returned") where
        the record has another call."""
        s, e = self.sample, self._log[self._at]
        args = {"tool_step": e.get("action"), "append_observation": e.get("text")}.get(e["call"])
        recorded = f"{e['call']}({'' if args is None else _quote(args)})"
        return EpisodeReplayError(
            f"episode of sample {s.index} (group {s.group_id}, prompt {self.prompt.index}, "
            f"slot {self.prompt.slot}), resumed: its generator {what} at call {self._at + 1}, "
            f"where the record made before the park has {recorded}{detail}. A generator runs again from "
            "its start on resume and must make the same calls given the same turns and "
            "observations (no unseeded randomness or outside state in what it calls)")


def _quote(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _plain(obs: Observation) -> dict[str, Any]:
    """An observation as recorded: JSON (it is saved with the buffer; info values that are not
    JSON are kept as their repr)."""
    return {"text": obs.text, "done": bool(obs.done),
            "reward": None if obs.reward is None else float(obs.reward),
            "info": json.loads(json.dumps(obs.info, default=repr))}


Generator = Callable[[EpisodeContext], Awaitable[None]]


async def multi_turn(ctx: EpisodeContext) -> None:
    """The built-in generator: model turn, environment step, observation, until the
    environment says done or the budget ends. A plain loop: a parked episode re-enters it and
    the context replays it to where it stood."""
    while True:
        turn = await ctx.model_turn()
        if turn.ended != "stop":
            return  # parked mid-turn (resumed from its tokens), or out of budget
        obs = await ctx.tool_step(turn.text)
        if obs is None:
            return  # the step ended during the tool call: run on resume
        if obs.done:
            ctx.finish(obs.reward)
            return
        ctx.append_observation(obs.text)
        if ctx.sample.status.terminal:
            return  # the observation filled the budget


GENERATOR_BUILTINS: dict[str, Generator] = {"multi_turn": multi_turn}


class EpisodeRunner:
    """Runs each sample of a multi-turn recipe as an episode (the manager calls `run` where it
    would send a single request)."""

    def __init__(self, generator: Generator, make_env: EnvironmentFactory, codec: Codec,
                 sampling: "SamplingConfig", *, env_kwargs: dict[str, Any] | None = None,
                 tools: ToolRunner | None = None) -> None:
        self.generator = generator
        self.make_env = make_env
        self.env_kwargs = dict(env_kwargs or {})
        self.codec = codec
        self.turn_sampling = sampling  # the recipe's sampling with the turn's stop strings
        self.tools = tools or ToolRunner()
        self.envs: dict[int, Environment] = {}  # sample index -> its live environment
        self.counts: Counter[str] = Counter({k: 0 for k in EPISODE_COUNTS})

    async def run(self, s: Sample, group: "Group", step: EpisodeStep) -> None:
        prompt = _prompt(group, s)
        env = await self._environment(s, prompt, step)
        try:
            if not s.status.terminal:  # (a first observation may already fill the budget)
                ctx = EpisodeContext(self, s, prompt, env, step)
                await self.generator(ctx)
                if ctx.replaying:
                    raise ctx.diverged("returned")
        finally:
            if s.status.terminal:
                self.envs.pop(s.index, None)
                self.counts["episodes_ended"] += 1
                s.metadata.get(STATE_KEY, {}).pop("log", None)  # only a resume reads it
            else:  # parked: keep the environment, and its state for a checkpoint
                s.interrupt()
                if can_snapshot(env):
                    s.metadata[STATE_KEY]["env"] = env.snapshot()  # type: ignore[attr-defined]

    async def _environment(self, s: Sample, prompt: EpisodePrompt, step: EpisodeStep) -> Environment:
        """The episode's environment: the live one, one restored from its snapshot (resumed
        from a checkpoint), or a fresh one (a fresh episode, or one whose environment could not
        be restored: then its tokens are dropped and it starts from the prompt, counted)."""
        if s.response_ids and s.index in self.envs:
            return self.envs[s.index]
        env = self.make_env(prompt, **self.env_kwargs)
        if s.response_ids:  # resumed from a checkpoint: no live environment
            state = s.metadata.get(STATE_KEY) or {}
            if "env" in state and "log" in state and can_snapshot(env):
                env.restore(state["env"])  # type: ignore[attr-defined]
                self.counts["episodes_restored"] += 1
            else:  # tokens but no environment to go on with
                s.reset()
                self.counts["episodes_restarted"] += 1
        if not s.response_ids:  # a fresh episode (also after a reset): no state from before
            s.metadata[STATE_KEY] = {"log": []}
            self.counts["episodes_started"] += 1
            first = await env.reset()
            if first:  # the environment speaks first: its words open the response, mask 0
                self.observe(s, first, step.version())
        self.envs[s.index] = env
        return env

    def observe(self, s: Sample, text: str, version_now: int) -> None:
        """Append an observation's tokens (loss mask 0) within the episode's budget; the next
        model turn begins after them. One that does not fit ends the episode (truncated)."""
        ids = self.codec.encode_observation(text)
        self.counts["observations"] += 1
        room = max(0, self.turn_sampling.max_new_tokens - len(s.response_ids))
        # No model produced them: they take the version of the tokens they follow.
        version = s.versions[-1] if s.versions else version_now
        s.append(ids[:room], [0.0] * min(len(ids), room), version, trainable=False)
        s.metadata.setdefault(STATE_KEY, {})["turn_start"] = len(s.response_ids)
        if len(ids) > room:
            s.append([], [], version, finish_reason="length")

    def retain(self, live: set[int]) -> None:
        """Forget the environments of samples that left the buffer while parked (a dropped or
        filtered group, a speculative response cut off): the manager calls it at every step's
        end with the indices of the samples still in the buffer."""
        for index in self.envs.keys() - live:
            del self.envs[index]

    def metrics(self) -> dict[str, float]:
        out = {f"rollout/episodes/{k}": float(v) for k, v in sorted(self.counts.items())}
        out.update({f"rollout/tool_failures/{k}": float(v) for k, v in self.tools.failures.items()})
        return out


def _prompt(group: "Group", s: Sample) -> EpisodePrompt:
    p = group.prompt
    return EpisodePrompt(p.text, p.label, dict(p.metadata), p.source_index, p.epoch, s.slot)
