"""Run the real RolloutManager, policies and buffer on simulated engines, in virtual time.

    results = run_simulation(SimConfig(engines=4, profile=load_profile("h100-qwen3-4b-tp2-april")),
                             trace, SyncPolicy(), steps=6, batch_size=32)

builds, over one trace: a `ListPromptSource` of the trace's prompts (in the trace's order), a
`RolloutBuffer`, `SimEngines` wrapped in `TraceReplayEngines`, a reward that passes with
probability 1 - difficulty (deterministic per response), and a `RolloutManager` driving the
given policy; then runs a synchronous driver loop (rollout step, train, weight sync; the
trainer's time comes from a `TrainTimeModel`) for `steps` steps and measures each step.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from buffers.buffer import RolloutBuffer
from buffers.group import Group
from buffers.sample import Sample
from buffers.source import ListPromptSource
from rollout.config import SamplingConfig
from rollout.filters import GroupFilter
from rollout.manager import RolloutManager, RolloutPolicy, batch_target
from rollout.rankers import LengthRanker
from rollout.rewards import RewardScheduler
from rollout.sim.clock import run_virtual
from rollout.sim.engine import Segment, SimConfig, SimEngines, SimWorker, WorkerStats
from rollout.sim.replay import BufferPrompts, TraceReplayEngines
from rollout.timeline import Span, StepTimeline, append_step
from rollout.sim.trace import Trace
from rollout.sim.train_time import TrainTimeModel


@dataclass
class StepResult:
    """One simulated step. Times in (virtual) seconds, throughputs in tokens/s."""

    step: int
    policy: str
    round: str  # the policy's kind of step ('' for one-kind policies; tail batching: short | long)
    rollout_s: float
    tokens_generated: int  # by this step's requests (the manager's count)
    engine_tokens: int  # decoded by the engines in this step (must equal the above)
    tokens_in_batch: int  # response tokens of the groups completed this step (any step made them)
    throughput: float  # tokens_generated / rollout_s
    idle_share: float  # engine time with nothing running / (engines x rollout_s)
    mean_context: float  # KV tokens each decoded token attended to, on average
    bound_s: float  # engine_tokens / (engines x peak throughput at mean_context)
    bound_ratio: float  # rollout_s / bound_s (1.0 = bubble-free)
    train_tokens: int  # prompt + response tokens of the trained batch
    train_s: float
    sync_s: float
    step_s: float  # end to end: rollout + train + sync (synchronous driver)
    groups_completed: int
    groups_resumed: int
    groups_carried_over: int
    resumed_token_share: float
    max_versions_per_sample: int
    tokens_discarded: int
    speculative_tokens: int  # of those, surplus responses cut once their group had its first n
    deferred_tokens_discarded: int  # of those, short-round tokens of prompts restarted later
    prompts_deferred: int
    long_queue: int  # after the step
    filtered_groups: int
    max_response_length: int  # in the groups completed
    ranker_recall: dict[str, float]  # recall@20/10/5 of the groups completed (with a ranker)
    predictions: list[tuple[float, float]]  # (predicted, actual) mean length per group completed
    group_predictions: list[tuple[int, float]]  # (group id, predicted) of every group launched
    long_engines: int  # engines the dispatcher gave the long tail (ranked_dispatch)
    preemptions: int
    prefill_s: float  # summed over engines

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def trace_reward(trace: Trace, seed: int = 0):
    """Reward 1 with probability 1 - difficulty, else 0; deterministic per response."""

    async def score(sample: Sample, group: Group) -> float:
        p = group.prompt
        u = random.Random(f"{seed}:{p.source_index}:{p.epoch}:{sample.slot}").random()
        return 1.0 if u < 1.0 - trace.difficulty(p.source_index) else 0.0

    return score


async def simulate(
    cluster: SimConfig,
    trace: Trace,
    policy: RolloutPolicy,
    *,
    steps: int,
    batch_size: int | None = None,
    max_new_tokens: int | None = None,
    train: TrainTimeModel | None = None,
    max_staleness: int = 1000,
    timeline_path: str | Path | None = None,
    seed: int = 0,
    observer: Callable[[SimWorker, str], None] | None = None,
    on_batch: Callable[[int, list[Group]], None] | None = None,
    group_filter: GroupFilter | None = None,
    ranker: LengthRanker | None = None,
    buffer: RolloutBuffer | None = None,
    first_step: int = 0,
    final_step: bool = True,
) -> list[StepResult]:
    """The coroutine behind `run_simulation` (run it on a VirtualTimeLoop). `observer` sees
    every simulated worker at every event; `on_batch(step, groups)` each trained batch.
    `buffer` (with `first_step`, its version) continues a run from a restored buffer; by
    default a fresh one over the trace's prompts. The last of `steps` is the run's final step
    (tail batching drains its long queue there) unless `final_step` is False, as benchmarks of
    the steady state want."""
    batch = batch_size or trace.batch_size
    cap = max_new_tokens or trace.cap
    loop = asyncio.get_running_loop()
    if buffer is None:
        buffer = RolloutBuffer(trace_source(trace), n_samples_per_prompt=trace.group_size,
                               max_staleness=max_staleness)
    engines = SimEngines(cluster, observer=observer)
    replay = TraceReplayEngines(engines, trace, BufferPrompts(buffer))
    sampling = SamplingConfig(max_new_tokens=cap, temperature=1.0)
    manager = RolloutManager(buffer, replay, policy, sampling,
                             RewardScheduler(trace_reward(trace, seed)), group_filter=group_filter,
                             ranker=ranker)
    results: list[StepResult] = []
    try:
        for step in range(first_step, first_step + steps):
            before = engines.stats()
            t0 = loop.time()
            report = await manager.run_step(batch_target(buffer, batch), version=step,
                                            final=final_step and step == first_step + steps - 1)
            t1 = loop.time()
            after = engines.stats()
            trained = buffer.take_nowait(batch)
            if on_batch is not None:
                on_batch(step, trained)
            train_tokens = sum(len(s.prompt_ids) + len(s.response_ids)
                               for g in trained for s in g.samples)
            train_s = train.train_s(train_tokens) if train else 0.0
            sync_s = train.sync_s() if train else 0.0
            results.append(_measure(step, policy.name, cluster, report, before, after,
                                    train_tokens, train_s, sync_s))
            segments = engines.drain_segments()
            if timeline_path is not None:
                append_step(timeline_path, StepTimeline(
                    step, policy.name, t0, t1, engines.workers(), "sim",
                    [_span(s, min(cap, trace.cap)) for s in segments], round=report.round,
                ))
            if train_s + sync_s > 0:
                await asyncio.sleep(train_s + sync_s)  # engines idle while the trainer runs
            buffer.set_version(step + 1)
    finally:
        await engines.aclose()
    return results


def trace_source(trace: Trace) -> ListPromptSource:
    """The trace's prompts in the trace's order (what `simulate` builds its buffer over)."""
    return ListPromptSource(trace.prompt_records(), seed=trace.order_seed, shuffle=True,
                            name=f"trace:{trace.name}")


def run_simulation(cluster: SimConfig, trace: Trace, policy: RolloutPolicy, **kwargs: Any
                   ) -> list[StepResult]:
    """Simulate `steps` synchronous-driver steps in virtual time (see `simulate`)."""
    return run_virtual(simulate(cluster, trace, policy, **kwargs))


def _measure(step: int, policy: str, cluster: SimConfig, report: Any,
             before: dict[str, WorkerStats], after: dict[str, WorkerStats],
             train_tokens: int, train_s: float, sync_s: float) -> StepResult:
    def delta(field: str) -> float:
        return sum(getattr(after[w], field) - getattr(before[w], field) for w in after)

    engines = len(after)
    tokens = int(delta("tokens"))
    rollout_s = report.seconds
    mean_ctx = delta("context_token_sum") / tokens if tokens else 0.0
    peak, _ = cluster.profile.peak_throughput(mean_ctx, kv_capacity=cluster.capacity,
                                              batch_limit=cluster.batch_limit)
    bound_s = tokens / (engines * peak) if tokens else 0.0
    return StepResult(
        step=step, policy=policy, round=report.round, rollout_s=rollout_s,
        tokens_generated=report.tokens_generated, engine_tokens=tokens,
        tokens_in_batch=report.tokens_in_batch,
        throughput=report.tokens_generated / rollout_s if rollout_s > 0 else 0.0,
        idle_share=1.0 - delta("busy_s") / (engines * rollout_s) if rollout_s > 0 else 0.0,
        mean_context=mean_ctx, bound_s=bound_s,
        bound_ratio=rollout_s / bound_s if bound_s > 0 else float("nan"),
        train_tokens=train_tokens, train_s=train_s, sync_s=sync_s,
        step_s=rollout_s + train_s + sync_s,
        groups_completed=len(report.completed), groups_resumed=report.groups_resumed,
        groups_carried_over=report.groups_carried_over,
        resumed_token_share=report.resumed_token_share,
        max_versions_per_sample=report.max_versions_per_sample,
        tokens_discarded=report.tokens_discarded,
        speculative_tokens=report.speculative_tokens,
        deferred_tokens_discarded=report.deferred_tokens_discarded,
        prompts_deferred=report.prompts_deferred, long_queue=report.long_queue,
        filtered_groups=sum(report.filtered.values()),
        max_response_length=report.max_response_length,
        ranker_recall=report.ranker_recalls(), predictions=report.predictions,
        group_predictions=report.launched_predictions,
        long_engines=int(report.dispatch.get("long_engines", 0)),
        preemptions=int(delta("preemptions")),
        prefill_s=delta("prefill_s"),
    )


def _span(s: Segment, cap: int) -> Span:
    """`cap`: the shorter of the token budget and the trace's own cap, either of which
    truncates (a traced length at the trace's cap was itself truncated: TraceReplayEngines)."""
    outcome = s.outcome
    if outcome == "length" and s.response_before + s.tokens < cap:
        outcome = "stop"  # ended at its traced natural length (TraceReplayEngines)
    return Span(s.worker, s.group_id, s.sample_index, s.enqueued, s.end, s.tokens,
                outcome, s.admitted, s.response_before)
