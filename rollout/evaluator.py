"""Evaluation: generate n responses per held-out prompt, score them, and report pass@k.

Pure scheduling logic, like the manager: nothing here imports torch, Ray or an HTTP library.
It acts only through the `Engines` interface (real or simulated) and an async score function
(`rollout.reward_scheduler.ScoreFn`, scored under `RewardScheduler`'s timeout and value checks).

Eval samples are built here and belong to no RolloutBuffer: an evaluation never touches the
training buffer, its queues or its accounting (the buffer's stats are the same before and
after). Every failure (an engine error, a reward that raises, times out or returns a bad value)
is counted in the result and scores the sample as incorrect; nothing is silently dropped.

With a multi-turn recipe (rollout.episode), every eval sample is an episode, played through
an EpisodeRunner of its own per pass (its environments and counts apart from training's), with
the pass's sampling and the recipe's turn stops: the held-out score of a tool-using policy is
the score with its tools.

The driver wiring (when to evaluate, datasets, passes) is `rollout.eval_config.EvalConfig`.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rlkit.buffers.group import Group, PromptRecord
from rlkit.buffers.sample import Sample, SampleStatus
from rlkit.rollout.config import SamplingConfig
from rlkit.rollout.engine_api import EngineError, Engines, WorkerLost
from rlkit.rollout.episodes import EpisodeRunner, EpisodeStep
from rlkit.rollout.eval_config import EvalConfig
from rlkit.rollout.reward_scheduler import RewardScheduler, ScoreFn


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimator (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), the probability
    that at least one of k responses drawn without replacement from n (of which c are correct)
    is correct. Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), stable for any n."""
    for label, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"pass_at_k: {label} must be an int, got {value!r}")
    if n < 1:
        raise ValueError(f"pass_at_k: n (samples per prompt) must be >= 1, got {n}")
    if k < 1:
        raise ValueError(f"pass_at_k: k must be >= 1, got {k}")
    if c < 0:
        raise ValueError(f"pass_at_k: c (correct samples) must be >= 0, got {c}")
    if c > n:
        raise ValueError(f"pass_at_k: c ({c} correct) exceeds n ({n} samples)")
    if k > n:
        raise ValueError(f"pass_at_k: k ({k}) exceeds n ({n} samples); sample at least k per prompt")
    if n - c < k:  # every draw of k contains a correct one
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


@dataclass
class EvalResult:
    """One evaluation pass over one dataset.

    Rates are over all `samples` (prompts x n): a failed sample (engine or reward) counts as
    incorrect for pass@k. `mean_reward` is over the samples that got a reward (`scored`);
    lengths and the truncation rate are over the samples whose generation finished
    (`generated`, reward failures included)."""

    name: str
    version: int  # the policy version the requests were generated with
    prompts: int
    n: int  # responses per prompt
    k: int
    samples: int
    scored: int
    generated: int
    mean_reward: float
    pass_at_1: float
    pass_at_k: float
    mean_response_length: float
    max_response_length: int
    truncation_rate: float
    engine_failures: int
    reward_failures: int
    reward_failures_by_kind: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    # multi-turn: the episode runner's counts (turns, observations, tool failures); else empty
    episodes: dict[str, float] = field(default_factory=dict)
    correct: list[int] = field(default_factory=list, repr=False)  # per prompt, out of n
    errors: list[str] = field(default_factory=list, repr=False)  # first few, for the log

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        """Flat metrics: `<prefix>/<name>/pass@1`, `.../pass@<k>`, `.../mean_reward`, ..."""
        base = f"{prefix}/{self.name}" if prefix else self.name
        out: dict[str, float] = {
            f"{base}/pass@1": self.pass_at_1,
            f"{base}/pass@{self.k}": self.pass_at_k,
            f"{base}/mean_reward": self.mean_reward,
            f"{base}/mean_response_length": self.mean_response_length,
            f"{base}/max_response_length": float(self.max_response_length),
            f"{base}/truncation_rate": self.truncation_rate,
            f"{base}/samples": float(self.samples),
            f"{base}/prompts": float(self.prompts),
            f"{base}/failures/engine": float(self.engine_failures),
            f"{base}/failures/reward": float(self.reward_failures),
            f"{base}/seconds": self.seconds,
            f"{base}/version": float(self.version),
        }
        out.update({f"{base}/{key}": value for key, value in self.episodes.items()})
        return out


def _record(i: int, prompt: Sequence[int] | PromptRecord) -> PromptRecord:
    if isinstance(prompt, PromptRecord):
        return prompt
    return PromptRecord(tuple(prompt), text="", source_index=i)


async def evaluate(
    name: str,
    prompts: Sequence[Sequence[int] | PromptRecord],
    engines: Engines,
    sampling: SamplingConfig,
    n: int,
    k: int,
    score: ScoreFn,
    version: int,
    success_threshold: float = 1.0,
    *,
    max_new_tokens: int | None = None,
    max_concurrency: int = 0,
    reward_timeout_s: float = 30.0,
    max_attempts: int = 5,
    episodes: EpisodeRunner | None = None,
) -> EvalResult:
    """Generate `n` responses per prompt through `engines.generate`, score each with `score`
    as soon as it finishes, and compute the metrics.

    `prompts`: token-id lists, or `PromptRecord`s when the reward needs a label or metadata
    (the score function sees each sample with a throwaway `Group` holding its record).
    A sample is correct when its reward >= `success_threshold`. `max_new_tokens` defaults to
    `sampling.max_new_tokens`; `max_concurrency` bounds requests in flight (0: no bound).
    A request interrupted without an answer (an engine lost, or the abort that ends a partial
    rollout step running beside it in async mode) is regenerated from scratch, so every
    response comes from one policy version, at most `max_attempts` times;
    an EngineError fails the sample (counted in `engine_failures`).
    `episodes`: play each sample as a multi-turn episode through this runner (its turn
    sampling sets the budget and the stops; `max_new_tokens` and `sampling` are then unused);
    an interrupted episode is replayed from a fresh environment, as a response is redone."""
    if not prompts:
        raise ValueError(f"evaluate {name!r}: no prompts")
    if n < 1:
        raise ValueError(f"evaluate {name!r}: n must be >= 1, got {n}")
    if not 1 <= k <= n:
        raise ValueError(f"evaluate {name!r}: k must be in [1, n={n}], got {k}")
    if max_concurrency < 0 or max_attempts < 1:
        raise ValueError("evaluate: max_concurrency must be >= 0 and max_attempts >= 1")
    budget = sampling.max_new_tokens if max_new_tokens is None else max_new_tokens
    if budget < 1:
        raise ValueError(f"evaluate {name!r}: max_new_tokens must be >= 1, got {budget}")

    loop = asyncio.get_running_loop()
    started = loop.time()
    rewards = RewardScheduler(score, timeout_s=reward_timeout_s, on_error="drop_group")
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    groups = [Group.new(i, _record(i, p), n, i * n, version) for i, p in enumerate(prompts)]
    engine_failures = 0
    never_stopped = asyncio.Event()  # an evaluation is never aborted as a step is

    async def turn(sample: Sample, turn_sampling: SamplingConfig) -> None:
        remaining = sample.remaining_tokens(turn_sampling.max_new_tokens)
        if remaining <= 0:  # an observation filled the budget
            sample.append([], [], version, finish_reason="length")
            return
        await engines.generate(sample, turn_sampling, max_new_tokens=remaining, version=version)

    async def respond(sample: Sample, group: Group) -> None:
        if episodes is None:
            await engines.generate(sample, sampling, max_new_tokens=budget, version=version)
        else:
            await episodes.run(sample, group, EpisodeStep(
                lambda turn_sampling: turn(sample, turn_sampling), never_stopped, lambda: version))

    async def generate(sample: Sample, group: Group) -> None:
        nonlocal engine_failures
        for _ in range(max_attempts):
            if sample.status is not SampleStatus.PENDING:
                sample.reset()  # an interrupted response is redone whole, at this version
            try:
                await respond(sample, group)
            except WorkerLost:
                continue  # its engine was lost: redo it on another
            except EngineError as e:
                if not sample.status.terminal:
                    sample.fail(f"engine: {e}")
            if sample.status.terminal:
                break
        if not sample.status.terminal:
            sample.fail(f"engine: no finished response after {max_attempts} attempts")
        if sample.status is SampleStatus.FAILED:
            engine_failures += 1

    async def one(sample: Sample, group: Group) -> None:
        if gate is None:
            await generate(sample, group)
        else:
            async with gate:
                await generate(sample, group)
        # an environment that ended its episode with a reward has scored it (as in training)
        if sample.status is not SampleStatus.FAILED and sample.reward is None:
            await rewards.score(sample, group)

    async with asyncio.TaskGroup() as tg:
        for g in groups:
            for s in g.samples:
                tg.create_task(one(s, g))

    samples = [s for g in groups for s in g.samples]
    rewarded = [s.reward for s in samples if s.reward is not None]
    finished = [s for s in samples if s.finish_reason in ("stop", "length")]
    lengths = [len(s.response_ids) for s in finished]
    correct = [
        sum(1 for s in g.samples if s.reward is not None and s.reward >= success_threshold)
        for g in groups
    ]
    reward_failures = sum(rewards.failures.values())
    nan = float("nan")
    return EvalResult(
        name=name,
        version=version,
        prompts=len(groups),
        n=n,
        k=k,
        samples=len(samples),
        scored=len(rewarded),
        generated=len(finished),
        mean_reward=sum(rewarded) / len(rewarded) if rewarded else nan,
        pass_at_1=_mean(pass_at_k(n, c, 1) for c in correct),
        pass_at_k=_mean(pass_at_k(n, c, k) for c in correct),
        mean_response_length=sum(lengths) / len(lengths) if lengths else nan,
        max_response_length=max(lengths, default=0),
        truncation_rate=(
            sum(1 for s in finished if s.finish_reason == "length") / len(finished)
            if finished else nan
        ),
        engine_failures=engine_failures,
        reward_failures=reward_failures,
        reward_failures_by_kind=dict(Counter(rewards.failures)),
        seconds=loop.time() - started,
        episodes=_episode_counts(episodes),
        correct=correct,
        errors=[s.error for s in samples if s.error][:10],
    )


def _episode_counts(episodes: EpisodeRunner | None) -> dict[str, float]:
    """The runner's counts as eval metric names (episodes/turns, tool_failures/timeout, ...)."""
    if episodes is None:
        return {}
    return {key.removeprefix("rollout/"): value for key, value in episodes.metrics().items()}


def _mean(values: Any) -> float:
    values = list(values)
    return math.fsum(values) / len(values)


class Evaluator:
    """One evaluation as the recipe's `eval` section asks for it: every dataset under each of
    its passes (greedy, sampled), at one policy version, over the engines given. The datasets
    are loaded before the run starts (a bad row fails it there), so an evaluation only
    generates and scores."""

    def __init__(self, cfg: EvalConfig, datasets: dict[str, Sequence[PromptRecord]], score: ScoreFn,
                 base: SamplingConfig, reward_timeout_s: float = 30.0,
                 episodes: Callable[[SamplingConfig], EpisodeRunner] | None = None) -> None:
        """`episodes(sampling)`: a fresh episode runner for a pass's sampling (the recipe's
        multi-turn set-up; rlkit.plugins.episode_runners), or None: one request each."""
        missing = [d.name for d in cfg.datasets if not datasets.get(d.name)]
        if missing:
            raise ValueError(f"Evaluator: no prompts loaded for eval dataset(s) {missing}")
        self.cfg = cfg
        self.datasets = datasets
        self.score = score
        self.passes = cfg.passes(base)
        self.reward_timeout_s = reward_timeout_s
        self.episodes = episodes

    async def run(self, engines: Engines, version: int) -> list[EvalResult]:
        """The passes one after another (each already fills the engines), at `version`."""
        results = []
        for p in self.passes:
            results.append(await evaluate(
                p.name, self.datasets[p.dataset.name], engines, p.sampling, p.n, p.k, self.score,
                version, self.cfg.success_threshold, max_concurrency=self.cfg.max_concurrency,
                reward_timeout_s=self.reward_timeout_s,
                episodes=self.episodes(p.sampling) if self.episodes else None))
        return results


def eval_metrics(results: Sequence[EvalResult]) -> dict[str, float]:
    """One evaluation's results as one flat metrics row (eval/<dataset>/<mode>/...)."""
    out: dict[str, float] = {}
    for r in results:
        out.update(r.metrics())
    return out
