"""StreamedStep: train on the groups of one global batch as they arrive (the stream driver mode).

Each complete group is turned into samples at once (its advantages need only its own rewards),
optionally with pi_old / reference logprobs computed right away, and accumulated in full
micro-batches as soon as enough samples are pending. The optimizer steps once, when the global
batch is complete. Because the trainer normalises by the total denominator at `step`
(see train/protocol.py), the update equals the synchronous one on the same groups, whatever their
arrival order and grouping (tests/train/test_megatron_local.py checks this).
"""

from __future__ import annotations

from typing import Iterable

from buffers.group import Group
from train.batch import TrainBatch, build_batch_from_config
from train.protocol import Trainer


class StreamedStep:
    def __init__(
        self,
        trainer: Trainer,
        algorithm,
        *,
        policy_version: int,
        global_batch_groups: int,
        micro_batch_size: int,
        recompute_old_logprobs: bool = False,
    ) -> None:
        """`algorithm` is a train.config.AlgorithmConfig. `recompute_old_logprobs` attaches
        pi_old from the current weights at arrival (needed for TIS against a recomputed pi_old;
        within one global batch the weights do not change, so it equals the synchronous
        computation). Reference logprobs are attached when algorithm.kl_coef > 0."""
        if global_batch_groups < 1 or micro_batch_size < 1:
            raise ValueError("global_batch_groups and micro_batch_size must be >= 1")
        self.trainer = trainer
        self.algorithm = algorithm
        self.policy_version = policy_version
        self.global_batch_groups = global_batch_groups
        self.micro_batch_size = micro_batch_size
        self.recompute_old = recompute_old_logprobs
        self.groups_seen = 0
        self._pending = TrainBatch([], policy_version)  # built samples not yet accumulated

    @property
    def complete(self) -> bool:
        return self.groups_seen >= self.global_batch_groups

    def add(self, group: Group) -> dict[str, float] | None:
        """Take one complete group; returns the step metrics when it completes the global batch."""
        if self.complete:
            raise RuntimeError(f"the global batch already has its {self.global_batch_groups} groups")
        batch = build_batch_from_config([group], self.algorithm, self.policy_version)
        if len(batch):
            if self.recompute_old:
                batch = batch.with_logprobs(old=self.trainer.logprobs(batch))
            if self.algorithm.kl_coef > 0:
                batch = batch.with_logprobs(ref=self.trainer.logprobs(batch, policy="reference"))
            self._pending.samples.extend(batch.samples)
        self.groups_seen += 1
        if len(self._pending) >= self.micro_batch_size:
            self._accumulate_pending(full_only=True)
        if self.complete:
            self._accumulate_pending(full_only=False)
            return self.trainer.step()
        return None

    def add_all(self, groups: Iterable[Group]) -> dict[str, float] | None:
        metrics = None
        for g in groups:
            metrics = self.add(g)
        return metrics

    def _accumulate_pending(self, *, full_only: bool) -> None:
        n = len(self._pending)
        take = (n // self.micro_batch_size) * self.micro_batch_size if full_only else n
        if take:
            self.trainer.accumulate(self._pending.subset(range(take)))
        self._pending = self._pending.subset(range(take, n))
