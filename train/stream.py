"""Training on one rollout batch, fed group by group: the one path of every driver mode.

`sync` feeds the step's groups all at once, `stream` each as it completes, `async` the step
generated one version earlier; they train the same way because they run the same code:

- each group becomes samples at once (its advantages need only its own rewards);
- `logprobs_needed` decides, for every mode, whether pi_old and reference logprobs are
  computed, and they are computed at arrival (before any optimizer step of this batch);
- samples accumulate in micro-batches as they arrive; the optimizer steps once per global
  batch (`train.global_batch_size` samples, by default the whole rollout batch).

With several optimizer steps per rollout batch, pi_old must be the weights that generated the
batch (before the first step): the first global batch accumulates as it arrives, later samples
get pi_old at arrival and wait, and the optimizer steps once the whole batch is in. The trainer
normalises by the global denominator at `step` (train/protocol.py), so the update equals the
synchronous one whatever the arrival order and grouping (tests/train/test_megatron_local.py).

Data parallel: each rank keeps the samples of its replica (each sample, as it arrives, to the
least-loaded replica of its global batch by compute cost, tokens plus attention's square term:
train/microbatch_plan.py's ReplicaAssigner in arrival order, the same choice on every rank since
every rank sees the same arrival order); TP ranks of a replica make the same calls, as their
collectives need. In a run each replica receives only its share of a group (`ReplicaShare`,
made at hand-off by rlkit/driver/handoff.py with the same rule): its own samples, the others'
rewards (a group's advantages need them all) and every trained sample's length. Micro-batches
of the first global batch close as samples arrive (by count, or by token budget: a micro-batch
closes when the next sample does not fit); later global batches are planned as a whole at
`finish`. Every rank knows every replica's lengths, so at `finish` each
pads its replica with empty micro-batches to the busiest one's count, as the synchronous plan
does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from rlkit.buffers.group import Group
from rlkit.buffers.sample import TRACED_LOGPROBS
from rlkit.train.batch import TrainBatch, build_batch_from_config
from rlkit.train.microbatch_plan import (
    ReplicaAssigner, micro_batches, pad_to_equal, stream_micro_batches, warn_over_budget,
)
from rlkit.train.protocol import Trainer


@dataclass
class ReplicaShare:
    """One data-parallel replica's share of a group: `group` holds the replica's own trained
    samples whole and the others' without tokens (status and reward kept: the group's
    advantages need every reward); `lengths`: every trained sample's length (prompt +
    response), in `train.batch.trained_samples` order, so the rank places them as the hand-off
    did and knows every replica's load."""

    group: Group
    lengths: list[int]


def logprobs_needed(algorithm, optimizer_steps: int) -> tuple[bool, bool]:
    """(pi_old, reference): which logprobs a rollout batch needs before training, for every mode.

    Reference logprobs when the loss has a KL term. pi_old is recomputed only when the batch
    spans several optimizer steps (after the first step the current weights are no longer the
    ones that generated it); with one step the loss uses the current logprobs, detached, which
    are the same weights, and the off-policy correction compares against the rollout logprobs.
    """
    return optimizer_steps > 1, algorithm.kl_coef > 0


def optimizer_steps_for(rollout_samples: int, global_batch_size: int) -> int:
    """Optimizer steps one rollout batch of `rollout_samples` takes (global_batch_size 0: one)."""
    if not global_batch_size or global_batch_size >= rollout_samples:
        return 1
    return -(-rollout_samples // global_batch_size)


def part_size_for(rollout_samples: int, global_batch_size: int) -> int:
    """Samples per global batch of one rollout batch, as replicas are balanced per global
    batch (0: the whole rollout batch is one)."""
    return global_batch_size if optimizer_steps_for(rollout_samples, global_batch_size) > 1 else 0


class RolloutBatchStep:
    """One rollout batch on one trainer (one process, or one rank of a TP x DP group)."""

    def __init__(
        self,
        trainer: Trainer,
        algorithm,
        *,
        policy_version: int,
        rollout_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        max_tokens_per_micro_batch: int = 0,
        padded: bool = False,
        attention_weight: float = 0.0,
        row_tokens: int = 0,
    ) -> None:
        """`algorithm` is a train.config.AlgorithmConfig; `rollout_samples` the planned
        batch (rollout.batch_size x n_samples_per_prompt: failed samples may make it smaller,
        the plan of logprobs does not change with them). `max_tokens_per_micro_batch` > 0
        replaces `micro_batch_size` (`padded`: the budget counts samples x longest, packing off);
        `attention_weight`: the sample cost's square term, `row_tokens` the packed rows'
        capacity (train/microbatch_plan.py)."""
        if micro_batch_size < 1 or rollout_samples < 1:
            raise ValueError("micro_batch_size and rollout_samples must be >= 1")
        if max_tokens_per_micro_batch < 0:
            raise ValueError("max_tokens_per_micro_batch must be >= 0 (0: by micro_batch_size)")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside a data-parallel size of {dp_size}")
        self.trainer = trainer
        self.algorithm = algorithm
        self.policy_version = policy_version
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens_per_micro_batch
        self.padded = padded
        self.row_tokens = row_tokens
        self.steps_planned = optimizer_steps_for(rollout_samples, global_batch_size)
        self.part_size = part_size_for(rollout_samples, global_batch_size)
        self.need_old, self.need_ref = logprobs_needed(algorithm, self.steps_planned)
        self.dp_rank = dp_rank
        # every sample of the batch (every replica) to its replica, in arrival order
        self._assigner = ReplicaAssigner(dp_size, attention_weight, self.part_size)
        self._lengths = self._assigner.lengths  # per global batch: each replica's lengths
        self._parts: list[TrainBatch] = []  # this replica's samples, per global batch
        self._accumulated = 0  # micro-batches of this replica's first part trained so far
        self.groups = 0
        self.off_policy_samples = 0
        self.finished = False
        # samples picked for the run viewer: "<group>/<index>" -> the trainer's logprob of each
        # response token, with the weights this batch trains from (before its optimizer step)
        self.traced: dict[str, list[float]] = {}

    @classmethod
    def for_config(cls, trainer: Trainer, cfg, *, policy_version: int, rollout_samples: int,
                   dp_rank: int = 0, dp_size: int = 1) -> "RolloutBatchStep":
        """With the knobs of a train.config.TrainConfig (algorithm, global and micro batch)."""
        return cls(trainer, cfg.algorithm, policy_version=policy_version,
                   rollout_samples=rollout_samples, global_batch_size=cfg.global_batch_size,
                   micro_batch_size=cfg.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                   max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
                   padded=not cfg.packing, row_tokens=cfg.pack_row_tokens,
                   attention_weight=getattr(trainer, "attention_weight", 0.0))

    def add(self, group: Group | ReplicaShare) -> None:
        """One complete group (or this replica's share of it): its samples, their logprobs,
        and the micro-batches now full."""
        if self.finished:
            raise RuntimeError("add after finish(): this rollout batch was trained")
        share = group if isinstance(group, ReplicaShare) else None
        batch = build_batch_from_config([share.group if share else group], self.algorithm,
                                        self.policy_version)
        self.groups += 1
        lengths = share.lengths if share else [s.length for s in batch.samples]
        own = iter(batch.samples)  # a share holds this replica's samples only
        mine = []
        for n, (part, replica) in zip(lengths, self._assigner.assign(lengths)):
            if replica == self.dp_rank or share is None:
                s = next(own, None)
                if s is None or s.length != n:
                    raise RuntimeError("a replica's share of a group disagrees with its placement "
                                       "(the hand-off and the trainer placed samples differently)")
                if replica == self.dp_rank:
                    mine.append((part, s))
        # a share counts this replica's off-policy samples only: RayTrainerBox adds them up
        self.off_policy_samples += int(batch.metadata.get("off_policy_samples", 0))
        if not mine:
            return
        own = TrainBatch([s for _, s in mine], self.policy_version)
        if self.need_old:
            own = own.with_logprobs(old=self.trainer.logprobs(own))
        if self.need_ref:
            own = own.with_logprobs(ref=self.trainer.logprobs(own, policy="reference"))
        self._trace(own)
        for (part, _), s in zip(mine, own.samples):
            while len(self._parts) <= part:
                self._parts.append(TrainBatch([], self.policy_version))
            self._parts[part].samples.append(s)
        self._accumulate_first_part(full_only=True)

    def _trace(self, own: TrainBatch) -> None:
        """The trainer's own logprobs of the samples picked for the viewer (a few a step): pi_old
        where it was computed anyway, else one forward over them. Every TP rank of a replica
        holds the same samples, so the forward's collectives line up as pi_old's do."""
        picked = [s for s in own.samples if s.traced]
        if not picked:
            return
        if self.need_old:
            values = [s.old_logprobs for s in picked]
        else:
            values = self.trainer.logprobs(TrainBatch(picked, self.policy_version))
        for s, lp in zip(picked, values):
            self.traced[f"{s.group_id}/{s.index}"] = [round(float(x), 5) for x in lp]

    def add_all(self, groups: Iterable[Group]) -> None:
        for g in groups:
            self.add(g)

    def finish(self) -> dict[str, float]:
        """Every group is in: accumulate what is left and step once per global batch."""
        if self.finished:
            raise RuntimeError("finish() twice")
        self.finished = True
        self._accumulate_first_part(full_only=False)
        metrics: dict[str, float] = {}
        # from the whole batch's count, so every rank steps as often (the step is collective)
        steps = max(1, -(-self._assigner.seen // self.part_size)) if self.part_size else 1
        for i in range(steps):
            if i > 0:
                self._accumulate_later_part(i)
            metrics = self.trainer.step()
        metrics["train/optimizer_steps"] = float(steps)
        metrics["train/off_policy_samples"] = float(self.off_policy_samples)
        if self.traced:  # not a number: the driver takes it out of the row (TRACED_LOGPROBS)
            metrics[TRACED_LOGPROBS] = self.traced  # type: ignore[assignment]
        return metrics

    def _own(self, part: int) -> list:
        """This replica's samples of one global batch, in arrival order."""
        return self._parts[part].samples if part < len(self._parts) else []

    def _accumulate(self, samples: list, plan: list[tuple[int, ...]]) -> None:
        """The micro-batches `plan` (indices into `samples`, () = empty work), in one call."""
        used = sorted(i for mb in plan for i in mb)
        pos = {i: k for k, i in enumerate(used)}
        batch = TrainBatch([samples[i] for i in used], self.policy_version,
                           micro_batch_plan=[tuple(pos[i] for i in mb) for mb in plan])
        warn_over_budget([s.length for s in batch.samples], self.max_tokens)
        self.trainer.accumulate(batch)

    def _accumulate_first_part(self, *, full_only: bool) -> None:
        """The first global batch trains as it arrives: each micro-batch (arrival order) once it
        is closed; at the end the rest, then empty ones up to the busiest replica's count. Later
        parts wait for the first optimizer step."""
        samples = self._own(0)
        mbs, last_closed = stream_micro_batches(
            [s.length for s in samples], max_tokens=self.max_tokens,
            micro_batch_size=self.micro_batch_size, padded=self.padded,
            row_tokens=self.row_tokens)
        ready = mbs if not full_only or last_closed else mbs[:-1]
        todo = ready[self._accumulated:]
        if not full_only and self._lengths:
            busiest = max(len(stream_micro_batches(
                lengths, max_tokens=self.max_tokens, micro_batch_size=self.micro_batch_size,
                padded=self.padded, row_tokens=self.row_tokens)[0]) for lengths in self._lengths[0])
            todo = [*todo, *[()] * (busiest - len(mbs))]
        if todo:
            self._accumulate(samples, todo)
        self._accumulated = len(ready)

    def _accumulate_later_part(self, part: int) -> None:
        """A later global batch, planned whole (train/microbatch_plan.py: by budget or count),
        every replica padded to the busiest one's count."""
        if part >= len(self._lengths):
            return
        plans = pad_to_equal([
            micro_batches(lengths, max_tokens=self.max_tokens, micro_batch_size=self.micro_batch_size,
                          padded=self.padded, row_tokens=self.row_tokens)
            for lengths in self._lengths[part]
        ])
        if plans[self.dp_rank]:
            self._accumulate(self._own(part), plans[self.dp_rank])
