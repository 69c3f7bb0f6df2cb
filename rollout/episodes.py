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
    on a tool     the tool call is abandoned and RE-RUN when the episode resumes (its action
                  text is kept in the episode state); an environment with snapshot/restore is
                  first put back as it was before the call, one without must tolerate being
                  called twice
The environment object stays in memory across steps (`EpisodeRunner.envs`). The episode's own
state (phase, where the current turn began, the turns ended, the pending action) lives in
`sample.metadata["episode"]`, so it is saved with the buffer; an environment that implements
snapshot/restore is saved there too at every park. Resumed from a checkpoint, an episode whose
environment cannot be restored starts again from its prompt (`episodes_restarted`).

A sample with no tokens is always a fresh episode (a reset by the staleness rule or by tail
batching's restart forgets the episode with its tokens).

Pure asyncio: no HTTP, Ray or torch, so episodes run in the simulator and in tests unchanged.
"""

from __future__ import annotations

import asyncio
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


class EpisodeContext:
    """What a generator works with for one episode (one sample)."""

    def __init__(self, runner: "EpisodeRunner", sample: Sample, prompt: EpisodePrompt,
                 env: Environment, step: EpisodeStep) -> None:
        self.runner, self.sample, self.prompt, self.env, self._step = runner, sample, prompt, env, step
        # The episode's resumable state: plain data, saved with the buffer.
        self.state: dict[str, Any] = sample.metadata.setdefault(STATE_KEY, {})

    @property
    def stopping(self) -> bool:
        return self._step.stopped.is_set()

    async def model_turn(self) -> TurnResult:
        """Generate the model's turn, from where it stopped if it was parked mid-way."""
        s = self.sample
        start = int(self.state.setdefault("turn_start", len(s.response_ids)))
        await self._step.generate(self.runner.turn_sampling)
        text = self.runner.codec.decode(s.response_ids[start:])
        if s.status is SampleStatus.DONE:  # the turn's stop, not (yet) the episode's end
            s.reopen()
            self.runner.counts["turns"] += 1
            self.state["turns"] = episode_turns(s) + 1  # what rankers learn (rankers/lengths.py)
            return TurnResult(text, "stop")
        if s.status is SampleStatus.TRUNCATED:
            return TurnResult(text, "length")
        return TurnResult(text, "parked")  # PARTIAL / PENDING (aborted), or FAILED

    async def tool_step(self, action: str) -> Observation | None:
        """The environment's answer to `action` (failures become error observations, counted);
        None when the step ends first: the episode parks, and the call is run again on resume.
        An environment with snapshot/restore is put back as it was before the abandoned call
        (which may have run to its end before the cancellation reached it), so the re-run is
        exact; one without must tolerate being called twice."""
        before = self.env.snapshot() if can_snapshot(self.env) else None  # type: ignore[attr-defined]
        call = asyncio.ensure_future(self.runner.tools.step(self.env, action))
        stop = asyncio.ensure_future(self._step.stopped.wait())
        try:
            await asyncio.wait({call, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if call.done():
            return call.result()
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
        if before is not None:
            self.env.restore(before)  # type: ignore[attr-defined]
        self.runner.counts["env_steps_rerun"] += 1
        return None

    def append_observation(self, text: str) -> None:
        """The observation's tokens, once, with loss mask 0; the next turn begins after them."""
        self.runner.observe(self.sample, text, self._step.version())

    def finish(self, reward: float | None = None) -> None:
        """The episode ends here (the environment said done); its reward if the environment
        gives one (else the recipe's reward scores the sample)."""
        s = self.sample
        s.append([], [], s.versions[-1] if s.versions else self._step.version(), finish_reason="stop")
        if reward is not None:
            s.set_reward(reward)


Generator = Callable[[EpisodeContext], Awaitable[None]]


async def multi_turn(ctx: EpisodeContext) -> None:
    """The built-in generator: model turn, environment step, observation, until the
    environment says done or the budget ends. Each phase is recorded in `ctx.state`, so a
    parked episode resumes where it stood."""
    st = ctx.state
    while True:
        if st.get("phase", "model") == "model":
            turn = await ctx.model_turn()
            if turn.ended != "stop":
                return  # parked mid-turn (resumed from its tokens), or out of budget
            st.update(phase="tool", action=turn.text)
        obs = await ctx.tool_step(st["action"])
        if obs is None:
            return  # the step ended during the tool call: re-run on resume
        if obs.done:
            st["phase"] = "done"
            ctx.finish(obs.reward)
            return
        st["phase"] = "model"
        ctx.append_observation(obs.text)
        if ctx.sample.status.terminal:
            return


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
                await self.generator(EpisodeContext(self, s, prompt, env, step))
        finally:
            if s.status.terminal:
                self.envs.pop(s.index, None)
                self.counts["episodes_ended"] += 1
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
            if "env" in state and can_snapshot(env):
                env.restore(state["env"])  # type: ignore[attr-defined]
                self.counts["episodes_restored"] += 1
            else:  # tokens but no environment to go on with
                s.reset()
                self.counts["episodes_restarted"] += 1
        if not s.response_ids:  # a fresh episode (also after a reset): no state from before
            s.metadata.pop(STATE_KEY, None)
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
