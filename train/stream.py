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
least-loaded replica by tokens, the same choice on every rank since every rank sees the same
arrival order); TP ranks of a replica make the same calls, as their collectives need.
"""

from __future__ import annotations

from typing import Iterable

from rlkit.buffers.group import Group
from rlkit.train.batch import TrainBatch, build_batch_from_config
from rlkit.train.protocol import Trainer


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
    ) -> None:
        """`algorithm` is a train.config.AlgorithmConfig; `rollout_samples` the planned
        batch (rollout.batch_size x n_samples_per_prompt: failed samples may make it smaller,
        the plan of logprobs does not change with them)."""
        if micro_batch_size < 1 or rollout_samples < 1:
            raise ValueError("micro_batch_size and rollout_samples must be >= 1")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} outside a data-parallel size of {dp_size}")
        self.trainer = trainer
        self.algorithm = algorithm
        self.policy_version = policy_version
        self.micro_batch_size = micro_batch_size
        self.steps_planned = optimizer_steps_for(rollout_samples, global_batch_size)
        self.part_size = global_batch_size if self.steps_planned > 1 else 0  # 0: one part
        self.need_old, self.need_ref = logprobs_needed(algorithm, self.steps_planned)
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._loads = [0] * dp_size
        self._seen = 0  # samples of the whole batch (every replica) so far, in arrival order
        self._parts: list[TrainBatch] = []  # this replica's samples, per global batch
        self._accumulated = 0  # of this replica's first part
        self.groups = 0
        self.off_policy_samples = 0
        self.finished = False

    @classmethod
    def for_config(cls, trainer: Trainer, cfg, *, policy_version: int, rollout_samples: int,
                   dp_rank: int = 0, dp_size: int = 1) -> "RolloutBatchStep":
        """With the knobs of a train.config.TrainConfig (algorithm, global and micro batch)."""
        return cls(trainer, cfg.algorithm, policy_version=policy_version,
                   rollout_samples=rollout_samples, global_batch_size=cfg.global_batch_size,
                   micro_batch_size=cfg.micro_batch_size, dp_rank=dp_rank, dp_size=dp_size)

    def add(self, group: Group) -> None:
        """One complete group: its samples, their logprobs, and the micro-batches now full."""
        if self.finished:
            raise RuntimeError("add after finish(): this rollout batch was trained")
        batch = build_batch_from_config([group], self.algorithm, self.policy_version)
        self.groups += 1
        self.off_policy_samples += int(batch.metadata.get("off_policy_samples", 0))
        mine = []
        for s in batch.samples:
            part = self._seen // self.part_size if self.part_size else 0
            self._seen += 1
            replica = min(range(self.dp_size), key=lambda r: (self._loads[r], r))
            self._loads[replica] += s.length
            if replica == self.dp_rank:
                mine.append((part, s))
        if not mine:
            return
        own = TrainBatch([s for _, s in mine], self.policy_version)
        if self.need_old:
            own = own.with_logprobs(old=self.trainer.logprobs(own))
        if self.need_ref:
            own = own.with_logprobs(ref=self.trainer.logprobs(own, policy="reference"))
        for (part, _), s in zip(mine, own.samples):
            while len(self._parts) <= part:
                self._parts.append(TrainBatch([], self.policy_version))
            self._parts[part].samples.append(s)
        self._accumulate_first_part(full_only=True)

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
        steps = max(1, -(-self._seen // self.part_size)) if self.part_size else 1
        for i in range(steps):
            if 0 < i < len(self._parts) and len(self._parts[i]):
                self.trainer.accumulate(self._parts[i])
            metrics = self.trainer.step()
        metrics["train/optimizer_steps"] = float(steps)
        metrics["train/off_policy_samples"] = float(self.off_policy_samples)
        return metrics

    def _accumulate_first_part(self, *, full_only: bool) -> None:
        """The first global batch trains as it arrives (full micro-batches until it is
        complete); later parts wait for the first optimizer step."""
        if not self._parts:
            return
        first = self._parts[0]
        n = len(first) - self._accumulated
        take = (n // self.micro_batch_size) * self.micro_batch_size if full_only else n
        if take > 0:
            self.trainer.accumulate(first.subset(range(self._accumulated, self._accumulated + take)))
            self._accumulated += take
