"""The rollout box: the one protocol the driver's loops call on the rollout side.

    in process   `RolloutService` itself (tests, `run_local`, the simulator)
    in a run     the same `RolloutService` inside `RolloutActor` (rlkit/driver/actors.py),
                 reached through `RemoteRolloutBox` (rlkit/driver/proxies.py): one generic
                 call for every method (`RolloutActor.call(name, ...)`), and one stream per
                 rollout step on which the actor pushes its progress to the driver.

So a new call is written once, on RolloutService, and named in `RolloutBox` below.

Groups travel from the box to the trainer as `Handed`: opaque references (the groups
themselves in process; Ray object references in a run, so the data goes from the rollout actor
to the trainer actors directly) and small records the driver keeps for metrics.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from rlkit.buffers.staleness import LAG_BUCKETS, lag_counts
from rlkit.rollout.step_report import trained_lag_metrics

if TYPE_CHECKING:
    from rlkit.buffers import Group
    from rlkit.common.weight_update import WeightPublisher
    from rlkit.rollout.step_report import StepReport


@dataclass
class Handed:
    """Ready groups on their way to the trainer: references, and the driver's records of them."""

    refs: list[Any] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    # a few of their samples whole, for the run viewer and wandb (tracking.samples_per_step;
    # rlkit/rollout/sample_rows.py)
    samples: list[dict[str, Any]] = field(default_factory=list)

    def extend(self, other: "Handed") -> None:
        self.refs += other.refs
        self.records += other.records
        self.samples += other.samples


@dataclass
class RolloutResult:
    """What a rollout step gives back to the driver (plain data: it crosses Ray)."""

    metrics: dict[str, Any]
    timeline: list[dict[str, Any]]
    completed: list[int]
    buffer: dict[str, Any] = field(default_factory=dict)
    header: dict[str, Any] = field(default_factory=dict)  # the timeline's step line
    report: "StepReport | None" = field(default=None, repr=False)  # in process only
    handed: Handed | None = None  # the groups taken at the step's end (start_step's `take`)
    # the groups the step dropped (filtered, failed, stale), as RUN/groups.jsonl lines
    dropped: list[dict[str, Any]] = field(default_factory=list)


class RolloutBox(Protocol):
    def start_step(self, version: int, *, for_version: int, final: bool,
                   take: int = 0) -> asyncio.Future[RolloutResult]:
        """Start a rollout step (engines at `version`, groups to be trained at consumer version
        `for_version`); returns its handle at once. `take`: that many ready groups come with
        its result (`RolloutResult.handed`), as `take(n)` would give them."""
        ...

    async def next_ready(self) -> Handed: ...  # one group, as soon as one is ready

    async def take(self, n: int) -> Handed: ...  # n ready groups now (all or none)

    async def admits(self, for_version: int) -> bool: ...  # the buffer's admission bound

    async def evaluate(self, version: int) -> dict[str, float]:
        """The recipe's held-out evaluation at `version` (its metrics row; {} without one)."""
        ...

    async def update_weights(self, version: int, publisher: "WeightPublisher", *,
                             colocated: bool = False, restarted_only: bool = False) -> dict[str, float]:
        """The weight update: the box opens it on its engines, `publisher` (the trainer)
        publishes `version` into it, the box closes it and generates with `version` from then
        on (RolloutService.update_weights). Metrics."""
        ...

    async def sleep_engines(self) -> dict[str, float]: ...  # colocated: the turn to training

    async def give_back_untrained(self) -> int: ...  # handed since the last sync: back to ready

    def save(self, path: str) -> None: ...  # the buffer (between steps: it blocks)

    def load(self, path: str) -> None: ...


# The box's calls, beside start_step: what RemoteRolloutBox forwards to the actor (one list, read
# from the protocol, so a new call needs no forwarding code).
BOX_CALLS: frozenset[str] = frozenset(
    n for n in vars(RolloutBox) if not n.startswith("_") and n != "start_step")


def group_record(g: "Group") -> dict[str, Any]:
    """What the driver keeps of a trained group (metrics, RUN/groups.jsonl): the groups
    themselves travel from the rollout box to the trainer without passing through it."""
    return {
        "group_id": g.group_id, "source_index": g.prompt.source_index, "epoch": g.prompt.epoch,
        "prompt_len": len(g.prompt.ids), "predicted": g.predicted_length,
        "lengths": [len(s.response_ids) for s in g.samples],
        "rewards": [s.reward for s in g.samples],
        "oldest_version": g.oldest_version(),
        # responses generated by more than one policy version (resumed after a sync)
        "mixed": sum(1 for s in g.samples if s.versions and s.versions[0] != s.versions[-1]),
    }


def handed_of(groups: Sequence["Group"]) -> Handed:
    """In process the groups themselves are the references."""
    return Handed(list(groups), [group_record(g) for g in groups])


def lag_record(g: "Group", trained_at: int) -> dict[str, Any]:
    """What a group's record says of its tokens' lag when trained at `trained_at`: the trained
    tokens at lag 0, 1, 2, 3+ (buffers.staleness.lag_counts) and the largest lag."""
    counts, most = lag_counts(g.samples, trained_at)
    return {"trained_at": trained_at, "lag_tokens": counts, "max_lag": most}


def batch_lags(records: Sequence[dict[str, Any]]) -> tuple[list[int], int]:
    """A batch's trained tokens by lag bucket, and its largest lag (from `lag_record`s)."""
    counts, most = [0] * LAG_BUCKETS, 0
    for r in records:
        if "lag_tokens" in r:
            counts = [a + b for a, b in zip(counts, r["lag_tokens"])]
            most = max(most, r["max_lag"])
    return counts, most


def batch_metrics(records: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Reward statistics of the groups a training step uses (from `group_record`s), and the
    lag of their trained tokens (rollout/trained_lag*_share, rollout/trained_max_lag)."""
    rewards = [r for g in records for r in g["rewards"] if r is not None]
    lengths = [n for g in records for n in g["lengths"]]
    lags = trained_lag_metrics(*batch_lags(records))
    if not rewards:
        return lags
    mean = sum(rewards) / len(rewards)
    scored = [[r for r in g["rewards"] if r is not None] for g in records]
    return {
        **lags,
        # groups whose rewards are all equal: no GRPO advantage, nothing learnt from them
        "batch/zero_variance_share": sum(1 for g in scored if len(set(g)) <= 1) / len(records),
        "batch/mixed_version_share": sum(g.get("mixed", 0) for g in records) / len(lengths),
        "batch/reward_mean": mean,
        "batch/reward_max": max(rewards),
        "batch/response_length_mean": sum(lengths) / len(lengths),
        "batch/response_length_max": max(lengths),
        "batch/groups": len(records),
    }
