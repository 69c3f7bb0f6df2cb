"""Multi-turn (agentic) workloads for the simulator: traced episodes replayed through the real
episode layer (rlkit/rollout/episodes.py) in virtual time.

A multi-turn trace (`generate_episode_trace`) gives every (prompt, epoch, slot) an episode: a
list of turns, each (model tokens, tool seconds, observation tokens). The shape follows what
agentic RL reports (1 to 10 turns, the tool's latency log-normal with a heavy tail):

- `tool_share` of the prompts are solved with tools: each has a mean number of turns drawn
  uniformly in [2, max_turns] and its episodes spread around it; the rest answer in one turn
  (a fifth of their episodes take a second);
- a model turn's tokens are log-normal around the prompt's own median (prompts differ in how
  much the model reasons per turn), the last turn being the answer;
- observations (tool results) are log-normal in tokens; tool calls are log-normal in seconds
  (median `tool_median_s`, sigma `tool_sigma`: a heavy tail), capped at `tool_max_s`.

Replayed (`episode_runner`), nothing of the episode machinery is simulated: the manager runs
the built-in `multi_turn` generator over `TraceEpisode` environments. The replay engines
(rlkit.sim.replay) end each model turn where the trace says (as a stop string would), the
environment's step waits the traced tool latency (virtual seconds) and answers with an
observation of the traced length, and after the answer turn it says done. Aborts park episodes
mid-turn or on a tool call exactly as on real engines; the environment snapshots its turn
counter, so parked episodes survive.

Not modelled: a prefix cache. Every turn re-prefills the whole context (SGLang's radix cache
would hit the earlier turns' tokens), a cost every policy pays alike.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Sequence

import numpy as np

from rlkit.rollout.config import SamplingConfig
from rlkit.rollout.environments.protocol import EpisodePrompt, Observation
from rlkit.rollout.environments.tools import ToolRunner
from rlkit.rollout.episodes import EpisodeRunner, multi_turn
from rlkit.sim.engine import TOKEN_ID
from rlkit.sim.trace import Trace, TraceRecord, draw_steps, prompt_lengths


@dataclass(frozen=True)
class EpisodeTraceSpec:
    """Parameters of the multi-turn generator (token counts at the default 16k cap)."""

    rows: int = 512
    epochs: int = 2
    group_size: int = 8
    slots: int | None = None  # episodes per prompt in the trace; None: 2 x group_size
    cap: int = 16384  # the episode's budget: model and observation tokens
    seed: int = 0
    order_seed: int | None = None
    batch_size: int = 32
    tool_share: float = 0.6  # prompts solved with tools (several turns); the rest in one
    max_turns: int = 10
    within_turns_sigma: float = 0.35  # log-normal spread of an episode's turns around its prompt's
    turn_median_tokens: int = 400  # the median prompt's median model turn
    prompt_turn_sigma: float = 0.5  # prompts differ in tokens per turn
    turn_sigma: float = 0.5  # turns differ around their prompt's median
    observation_median_tokens: int = 120
    observation_sigma: float = 0.7
    tool_median_s: float = 0.8
    tool_sigma: float = 1.0  # the heavy tail: p99 about 10x the median
    tool_max_s: float = 60.0
    prompt_median: int = 300  # tool descriptions make agentic prompts long
    prompt_sigma: float = 0.4
    prompt_min: int = 16
    prompt_max: int = 2048
    prompt_signal: float = 0.0
    vocab_size: int = 32000

    def __post_init__(self) -> None:
        if min(self.rows, self.epochs, self.group_size, self.cap, self.max_turns) < 1:
            raise ValueError("rows, epochs, group_size, cap and max_turns must be >= 1")
        if not 0 <= self.tool_share <= 1:
            raise ValueError("tool_share must be in [0, 1]")
        if self.slots is not None and self.slots < self.group_size:
            raise ValueError("slots must be >= group_size")
        if min(self.turn_median_tokens, self.observation_median_tokens) < 1 or self.tool_median_s < 0:
            raise ValueError("median turn and observation tokens must be >= 1, tool seconds >= 0")


def generate_episode_trace(spec: EpisodeTraceSpec, name: str | None = None) -> Trace:
    """A multi-turn trace (see the module docstring). Deterministic for a spec."""
    slots = spec.slots or 2 * spec.group_size
    order_seed = spec.seed if spec.order_seed is None else spec.order_seed
    rng = np.random.default_rng([spec.seed, 0])
    tools = rng.random(spec.rows) < spec.tool_share
    mean_turns = np.where(tools, rng.uniform(2.0, max(2.0, spec.max_turns), spec.rows), 1.0)
    turn_median = spec.turn_median_tokens * np.exp(spec.prompt_turn_sigma * rng.standard_normal(spec.rows))
    # A prompt's difficulty is its rank by expected episode length (what rankers predict).
    expected = mean_turns * (turn_median + spec.observation_median_tokens)
    ranks = np.argsort(np.argsort(expected, kind="stable"), kind="stable")
    difficulty = (ranks + 0.5) / spec.rows
    prompt_len = prompt_lengths(rng, spec, difficulty)

    records: dict[tuple[int, int], TraceRecord] = {}
    for (row, epoch), step in draw_steps(spec.rows, spec.epochs, order_seed, spec.batch_size).items():
        r = np.random.default_rng([spec.seed, row, epoch, 2])
        episodes = [_episode(r, spec, bool(tools[row]), float(mean_turns[row]), float(turn_median[row]))
                    for _ in range(slots)]
        lengths = tuple(min(spec.cap, sum(m + o for m, _, o in ep)) for ep in episodes)
        records[(row, epoch)] = TraceRecord(row, epoch, int(prompt_len[row]), float(difficulty[row]),
                                            step, lengths, tuple(episodes))
    return Trace(
        name=name or f"episodes{spec.tool_share:g}-cap{spec.cap}-seed{spec.seed}", cap=spec.cap,
        group_size=spec.group_size, rows=spec.rows, epochs=spec.epochs, order_seed=order_seed,
        batch_size=spec.batch_size, vocab_size=spec.vocab_size, records=records,
        spec={"kind": "episodes", **asdict(spec)},
    )


def _episode(r: np.random.Generator, spec: EpisodeTraceSpec, tools: bool, mean_turns: float,
             turn_median: float) -> tuple[tuple[int, float, int], ...]:
    if tools:
        n = int(np.clip(round(mean_turns * math.exp(spec.within_turns_sigma * r.standard_normal())),
                        1, spec.max_turns))
    else:
        n = 2 if r.random() < 0.2 else 1
    turns = []
    for k in range(n):
        model = max(1, round(turn_median * math.exp(spec.turn_sigma * r.standard_normal())))
        if k == n - 1:  # the answer: no tool call after it
            turns.append((model, 0.0, 0))
            break
        seconds = min(spec.tool_max_s, spec.tool_median_s * math.exp(spec.tool_sigma * r.standard_normal()))
        obs = max(1, round(spec.observation_median_tokens
                           * math.exp(spec.observation_sigma * r.standard_normal())))
        turns.append((model, round(seconds, 4), obs))
    return tuple(turns)


def episode_stats(trace: Trace) -> dict[str, float]:
    """Turns, tokens and tool seconds per episode over the first group_size slots."""
    eps = [ep for rec in trace.records.values() if rec.turns for ep in rec.turns[:trace.group_size]]
    turns = np.array([len(ep) for ep in eps], dtype=float)
    tool = np.array([sum(t for _, t, _ in ep) for ep in eps])
    calls = np.array([t for ep in eps for _, t, _ in ep[:-1]])
    lengths = np.array([min(trace.cap, sum(m + o for m, _, o in ep)) for ep in eps], dtype=float)
    return {"episodes": float(len(eps)), "turns_mean": float(turns.mean()),
            "turns_p90": float(np.percentile(turns, 90)), "turns_max": float(turns.max()),
            "tokens_mean": float(lengths.mean()), "tokens_p99": float(np.percentile(lengths, 99)),
            "cap_fraction": float(np.mean(lengths >= trace.cap)),
            "tool_call_s_median": float(np.median(calls)) if calls.size else 0.0,
            "tool_call_s_p99": float(np.percentile(calls, 99)) if calls.size else 0.0,
            "tool_s_per_episode_mean": float(tool.mean())}


# -- replay ---------------------------------------------------------------------------------
OBSERVATION_CHAR = "o"  # a traced observation of n tokens is n of these (SimCodec: one token each)


class SimCodec:
    """Simulated engines produce no text: turns decode to nothing, an observation's text is
    one token per character."""

    def decode(self, ids: Sequence[int]) -> str:
        return ""

    def encode_observation(self, text: str) -> list[int]:
        return [TOKEN_ID] * len(text)


class TraceEpisode:
    """The environment of one traced episode: its k-th step waits the k-th turn's tool seconds
    and answers with an observation of the traced tokens; after the answer turn it is done
    (the recipe's reward scores the episode). A step cancelled by a park did not happen: it is
    re-run on resume, as rlkit re-runs tool calls."""

    def __init__(self, prompt: EpisodePrompt, *, trace: Trace) -> None:
        self.turns = trace.episode(prompt.index, prompt.epoch, prompt.slot)
        self.k = 0

    async def reset(self) -> None:
        return None

    async def step(self, action: str) -> Observation:
        _, seconds, tokens = self.turns[min(self.k, len(self.turns) - 1)]
        if self.k >= len(self.turns) - 1:
            return Observation("", done=True)
        await asyncio.sleep(seconds)
        self.k += 1
        return Observation(OBSERVATION_CHAR * tokens)

    def snapshot(self) -> dict[str, Any]:
        return {"k": self.k}

    def restore(self, state: dict[str, Any]) -> None:
        self.k = int(state["k"])


def episode_runner(trace: Trace, sampling: SamplingConfig) -> EpisodeRunner:
    """The episode layer a multi-turn trace replays through: the built-in generator over
    `TraceEpisode`s. Tool calls are not bounded in number (agentic tools are services) and
    time out only past the trace's longest."""
    longest = max((t for rec in trace.records.values() for ep in rec.turns or () for _, t, _ in ep),
                  default=0.0)
    return EpisodeRunner(multi_turn, partial(TraceEpisode, trace=trace), SimCodec(), sampling,
                         tools=ToolRunner(max_concurrency=1 << 30, timeout_s=2 * longest + 1))


__all__ = ["EpisodeTraceSpec", "SimCodec", "TraceEpisode", "episode_runner",
           "episode_stats", "generate_episode_trace"]
