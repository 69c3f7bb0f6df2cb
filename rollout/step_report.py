"""What one rollout step did, as the RolloutManager reports it: groups, tokens (generated,
resumed, discarded), aborts and relaunches, filtering, the ranker's recall, and the per-request
timeline; `metrics()` is its row of the run's metrics.jsonl (the `rollout/` keys)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from rlkit.rollout.rankers.recall import recalls
from rlkit.rollout.timeline import Span


DROPPED_KEPT = 256


@dataclass
class StepReport:
    version: int
    target: int
    policy: str
    round: str = ""  # the policy's kind of step, when it has several (tail batching: short | long)
    started: float = 0.0  # loop time at the start (the clock of the timeline's spans)
    seconds: float = 0.0
    completed: list[int] = field(default_factory=list)  # group ids completed in this step
    groups_launched: int = 0
    groups_resumed: int = 0  # launched with tokens from earlier steps
    groups_carried_over: int = 0  # parked at the end of the step, with their tokens
    tokens_generated: int = 0  # by requests of this step
    tokens_in_batch: int = 0  # in the groups completed this step
    tokens_from_earlier: int = 0  # of those, generated in earlier steps (resumed partials)
    max_versions_per_sample: int = 0
    tokens_discarded: int = 0  # generated but never to be trained on (buffer's count)
    max_response_length: int = 0  # longest response in the groups completed this step
    prompts_deferred: int = 0  # parked in the long queue at the end of the step
    deferred_tokens_discarded: int = 0  # of those, tokens forgotten to restart from the prompt
    speculative_aborted: int = 0  # surplus responses cut once their group had its first n
    speculative_tokens: int = 0  # tokens of those (also counted in tokens_discarded)
    long_queue: int = 0  # groups in the long queue after the step
    filtered: dict[str, int] = field(default_factory=dict)  # groups filtered out, by reason
    filtered_tokens: int = 0
    filter_exhausted: int = 0  # complete groups kept unfiltered: the step's filter limit was hit
    surplus_restarted: int = 0  # complete past an exact target: restarted (see Step.exact_target)
    # rollout.max_token_lag: samples restarted from the prompt since the last step's report
    # (parked ones about to be resumed, ready ones when the version moved) and their tokens
    lag_restarts: int = 0
    lag_restart_tokens: int = 0
    # rollout.max_resume_log_ratio: resumed samples whose parked tokens the engine re-scored,
    # the sum of |mean log-ratio| over them, and those restarted past the bound (their tokens)
    resume_rescored: int = 0
    resume_abs_log_ratio_sum: float = 0.0
    mismatch_restarts: int = 0
    mismatch_restart_tokens: int = 0
    # (predicted, actual) mean response length of each group completed, when a ranker predicted
    predictions: list[tuple[float, float]] = field(default_factory=list)
    launched_predictions: list[tuple[int, float]] = field(default_factory=list)  # (group, predicted)
    # multi-turn rollouts: (predicted, actual) mean model turns of the groups completed
    turn_predictions: list[tuple[float, float]] = field(default_factory=list)
    dispatch: dict[str, Any] = field(default_factory=dict)  # the dispatcher's plan, if any
    dropped: dict[str, int] = field(default_factory=dict)
    # the groups dropped (filtered, failed, stale) one by one, at most DROPPED_KEPT: what the
    # run viewer shows beside the trained ones (RUN/groups.jsonl, "dropped": reason)
    dropped_groups: list[dict[str, Any]] = field(default_factory=list)
    reward_mean: float = math.nan
    reward_failures: int = 0
    engine_failures: int = 0
    requests_relaunched: int = 0  # sent again after their engine was lost (tokens kept)
    relaunched_tokens: int = 0  # tokens those requests had when their engine was lost
    engines: dict[str, float] = field(default_factory=dict)  # the health monitor's counts
    timeline: list[Span] = field(default_factory=list)

    def record_dropped(self, group: Any, reason: str) -> None:
        """One dropped group's line (its rewards and lengths as they were)."""
        if len(self.dropped_groups) < DROPPED_KEPT:
            self.dropped_groups.append({
                "group_id": group.group_id, "source_index": group.prompt.source_index,
                "dropped": reason, "lengths": [len(s.response_ids) for s in group.samples],
                "rewards": [s.reward for s in group.samples]})

    @property
    def throughput(self) -> float:
        """Generated tokens per second of rollout wall time."""
        return self.tokens_generated / self.seconds if self.seconds > 0 else 0.0

    @property
    def resumed_token_share(self) -> float:
        return self.tokens_from_earlier / self.tokens_in_batch if self.tokens_in_batch else 0.0

    def ranker_recalls(self) -> dict[str, float]:
        """Recall of the truly longest 20 / 10 / 5% of the step's groups among the predicted
        longest (rollout.rankers.recall); empty without predictions."""
        if not self.predictions:
            return {}
        return recalls([a for _, a in self.predictions], [p for p, _ in self.predictions])

    def ranker_turn_recalls(self) -> dict[str, float]:
        """The same for episodes' model turns (multi-turn rollouts, a ranker of turns)."""
        if not self.turn_predictions:
            return {}
        return recalls([a for _, a in self.turn_predictions], [p for p, _ in self.turn_predictions])

    def metrics(self) -> dict[str, Any]:
        """Flat numbers for the metrics log."""
        rounds = {"rollout/round": self.round, "rollout/long_round": float(self.round == "long")}
        return {
            **(rounds if self.round else {}),
            "rollout/seconds": self.seconds,
            "rollout/groups_completed": len(self.completed),
            "rollout/groups_launched": self.groups_launched,
            "rollout/groups_resumed": self.groups_resumed,
            "rollout/groups_carried_over": self.groups_carried_over,
            "rollout/tokens_generated": self.tokens_generated,
            "rollout/throughput_tok_s": self.throughput,
            "rollout/resumed_token_share": self.resumed_token_share,
            "rollout/max_versions_per_sample": self.max_versions_per_sample,
            "rollout/tokens_discarded": self.tokens_discarded,
            "rollout/reward_mean": self.reward_mean,
            "rollout/reward_failures": self.reward_failures,
            "rollout/engine_failures": self.engine_failures,
            "rollout/requests_relaunched": self.requests_relaunched,
            "rollout/relaunched_tokens": self.relaunched_tokens,
            **self.engines,
            "rollout/max_response_length": self.max_response_length,
            "rollout/prompts_deferred": self.prompts_deferred,
            "rollout/deferred_tokens_discarded": self.deferred_tokens_discarded,
            "rollout/speculative_aborted": self.speculative_aborted,
            "rollout/speculative_tokens": self.speculative_tokens,
            "rollout/long_queue": self.long_queue,
            "rollout/filtered_groups": sum(self.filtered.values()),
            "rollout/filtered_tokens": self.filtered_tokens,
            "rollout/filter_exhausted": self.filter_exhausted,
            "rollout/surplus_restarted": self.surplus_restarted,
            "rollout/lag_restarts": self.lag_restarts,
            "rollout/lag_restart_tokens": self.lag_restart_tokens,
            "rollout/resume_rescored": self.resume_rescored,
            "rollout/resume_abs_log_ratio": (self.resume_abs_log_ratio_sum / self.resume_rescored
                                             if self.resume_rescored else 0.0),
            "rollout/mismatch_restarts": self.mismatch_restarts,
            "rollout/mismatch_restart_tokens": self.mismatch_restart_tokens,
            **{f"rollout/ranker_{k}": v for k, v in self.ranker_recalls().items()},
            **{f"rollout/ranker_turns_{k}": v for k, v in self.ranker_turn_recalls().items()},
            **{f"rollout/dispatch/{k}": v for k, v in self.dispatch.items()},
            **{f"rollout/filtered/{k}": v for k, v in self.filtered.items()},
            **{f"rollout/dropped/{k}": v for k, v in self.dropped.items()},
        }


# The lag of the tokens a training step trains (its trainer's version - the version that generated
# each token), in the buckets of buffers.staleness.lag_counts: 0, 1, 2, 3+.
LAG_KEYS = ("lag0", "lag1", "lag2", "lag3plus")


def trained_lag_metrics(counts: Sequence[int], max_lag: int) -> dict[str, float]:
    """`rollout/trained_lag{0,1,2,3plus}_share` (shares of the trained tokens) and
    `rollout/trained_max_lag` from a batch's lag counts; {} for a batch without tokens."""
    total = sum(counts)
    if not total:
        return {}
    return {**{f"rollout/trained_{k}_share": n / total for k, n in zip(LAG_KEYS, counts)},
            "rollout/trained_max_lag": float(max_lag)}
