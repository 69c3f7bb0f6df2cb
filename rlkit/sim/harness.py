"""What a simulated run is measured by, and the pieces it is built from: a step's `SimulatedStep`
(from the manager's report and the simulated engines' counters), the trace's prompt source and
its reward. The run itself (the real driver loops over the real manager, policies and buffer
on simulated engines, in virtual time) is `rlkit.sim.simulate.run_simulation`.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

from rlkit.buffers.group import Group
from rlkit.buffers.staleness import LAG_BUCKETS
from rlkit.buffers.sample import Sample
from rlkit.buffers.source import ListPromptSource
from rlkit.sim.engine import Segment, SimConfig, WorkerStats
from rlkit.rollout.timeline import Span
from rlkit.sim.trace import Trace


_ZERO = WorkerStats()


@dataclass
class SimulatedStep:
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
    step_s: float  # end to end, between this step's end and the previous one's (the mode's loop)
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
    mode: str = "sync"  # the driver mode whose loop ran it
    waited_train_s: float = 0.0  # of step_s, the loop's wait for training and weight sync
    placement: str = "disaggregated"  # colocated: engines and trainer took turns on every GPU
    # colocated: the step row's colocate/* metrics (Run's sleep and wake seconds, the parts)
    turn: dict[str, float] = field(default_factory=dict)
    # multi-turn: recall@20/10/5 of the episodes' model turns (a ranker of turns)
    ranker_turns_recall: dict[str, float] = field(default_factory=dict)
    # the trained batch's tokens at lag 0, 1, 2, 3+ behind the version it was trained at, and
    # the largest lag (the run's rollout/trained_lag*_share and rollout/trained_max_lag)
    trained_lag_tokens: list[int] = field(default_factory=lambda: [0] * LAG_BUCKETS)
    trained_max_lag: int = 0
    lag_restarts: int = 0  # rollout.max_token_lag: samples restarted from the prompt
    lag_restart_tokens: int = 0  # their tokens (also in tokens_discarded when in the step)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def trace_reward(trace: Trace, seed: int = 0):
    """Reward 1 with probability 1 - difficulty, else 0; deterministic per response."""

    async def score(sample: Sample, group: Group) -> float:
        p = group.prompt
        u = random.Random(f"{seed}:{p.source_index}:{p.epoch}:{sample.slot}").random()
        return 1.0 if u < 1.0 - trace.difficulty(p.source_index) else 0.0

    return score


def trace_source(trace: Trace) -> ListPromptSource:
    """The trace's prompts in the trace's order (what `simulate` builds its buffer over)."""
    return ListPromptSource(trace.prompt_records(), seed=trace.order_seed, shuffle=True,
                            name=f"trace:{trace.name}")


def measure(step: int, policy: str, cluster: SimConfig, report: Any,
            before: dict[str, WorkerStats], after: dict[str, WorkerStats],
            train_tokens: int, train_s: float, sync_s: float) -> SimulatedStep:
    """A step's result from the manager's report and the engines' counters around it
    (step_s: rollout + train + sync, as a synchronous loop pays them; the caller sets what its
    loop measured)."""
    def delta(field: str) -> float:  # an engine restarted during the step started from zero
        return sum(getattr(after[w], field) - getattr(before.get(w, _ZERO), field) for w in after)

    engines = len(after)
    tokens = int(delta("tokens"))
    rollout_s = report.seconds
    mean_ctx = delta("context_token_sum") / tokens if tokens else 0.0
    peak, _ = cluster.profile.peak_throughput(mean_ctx, kv_capacity=cluster.capacity,
                                              batch_limit=cluster.batch_limit)
    bound_s = tokens / (engines * peak) if tokens else 0.0
    return SimulatedStep(
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
        ranker_turns_recall=report.ranker_turn_recalls(),
        group_predictions=report.launched_predictions,
        long_engines=int(report.dispatch.get("long_engines", 0)),
        preemptions=int(delta("preemptions")),
        prefill_s=delta("prefill_s"),
        lag_restarts=report.lag_restarts, lag_restart_tokens=report.lag_restart_tokens,
    )


def span(s: Segment, cap: int) -> Span:
    """`cap`: the shorter of the token budget and the trace's own cap, either of which
    truncates (a traced length at the trace's cap was itself truncated: TraceReplayEngines)."""
    outcome = s.outcome
    if outcome == "length" and s.response_before + s.tokens < cap:
        outcome = "stop"  # ended at its traced natural length (TraceReplayEngines)
    return Span(s.worker, s.group_id, s.sample_index, s.enqueued, s.end, s.tokens,
                outcome, s.admitted, s.response_before)
