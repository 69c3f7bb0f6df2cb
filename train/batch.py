"""Turn complete Groups into a TrainBatch: token tensors, masks, rollout logprobs, advantages.

One `TrainSample` per trainable sample (terminal, rewarded, with at least one response token).
Failed samples are left out of both the batch and their group's advantage statistics; samples
with an empty response take part in the group statistics but carry no token to train on.

Off-policy check: a token whose policy version differs from the trainer's `policy_version` was
produced by other weights (a stale group, or a partial rollout resumed across a weight update).
Such a batch needs an explicit `off_policy_correction` (an estimator or 'none'); with 'unset' building it
raises `OffPolicyCorrectionRequired`, a configuration error.

On-policy distillation (`distill_coef` > 0): each TrainSample carries its sample's teacher
logprobs (`Sample.teacher_logprobs`, one per response token); a trained sample without them, or
with a non-finite one at a trainable position, is an error naming group, sample and position.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

import torch

from rlkit.buffers.group import Group
from rlkit.buffers.sample import TRACE_KEY, SampleStatus
from rlkit.train.algorithms.advantages import group_advantages


class OffPolicyCorrectionRequired(ValueError):
    """The batch holds off-policy tokens but train.algorithm.off_policy_correction is 'unset'."""


@dataclass
class TrainSample:
    index: int  # Sample.index
    group_id: int
    tokens: torch.Tensor  # int64 [prompt + response]
    prompt_length: int
    loss_mask: torch.Tensor  # float32 [response]
    rollout_logprobs: torch.Tensor  # float32 [response]
    advantage: float
    reward: float
    min_version: int
    max_version: int
    # int32 [response]: the policy version of each token (telemetry's lag); None: max_version
    versions: torch.Tensor | None = None
    resumed: bool = False  # resumed after a park (Sample.resumes): a partial rollout's tokens
    old_logprobs: torch.Tensor | None = None  # pi_old, set from Trainer.logprobs
    ref_logprobs: torch.Tensor | None = None  # reference policy, set from Trainer.logprobs
    # float32 [response]: the teacher's logprob of each response token (Sample.teacher_logprobs,
    # on-policy distillation); None without a teacher. Mask-0 positions may hold anything.
    teacher_logprobs: torch.Tensor | None = None
    # picked for the run viewer (rollout/sample_rows.py): the trainer reports its own logprobs
    # of these tokens (RolloutBatchStep.traced), beside the rollout's
    traced: bool = False

    @property
    def response_length(self) -> int:
        return int(self.tokens.numel()) - self.prompt_length

    @property
    def length(self) -> int:
        return int(self.tokens.numel())

    @property
    def trainable_tokens(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class TrainBatch:
    samples: list[TrainSample]
    policy_version: int = 0
    metadata: dict = field(default_factory=dict)
    # Micro-batches already planned for this batch (train/microbatch_plan.py): positions in
    # `samples`, () for empty work that keeps DP replicas' micro-batch counts equal. None: the
    # trainer plans them itself from its config. Not carried by subset/concat (positions change).
    micro_batch_plan: list[tuple[int, ...]] | None = None

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.samples)

    @property
    def trainable_tokens(self) -> int:
        return sum(s.trainable_tokens for s in self.samples)

    def off_policy_samples(self) -> int:
        v = self.policy_version
        return sum(1 for s in self.samples if s.min_version != v or s.max_version != v)

    def subset(self, indices: Sequence[int]) -> "TrainBatch":
        return TrainBatch([self.samples[i] for i in indices], self.policy_version, dict(self.metadata))

    def micro_batches(self, size: int) -> list["TrainBatch"]:
        return [self.subset(range(i, min(i + size, len(self)))) for i in range(0, len(self), size)]

    def with_logprobs(
        self,
        *,
        old: Sequence[torch.Tensor] | None = None,
        ref: Sequence[torch.Tensor] | None = None,
    ) -> "TrainBatch":
        """A copy with pi_old and/or reference logprobs attached (one tensor per sample)."""
        for what, values in (("old", old), ("ref", ref)):
            if values is not None and len(values) != len(self.samples):
                raise ValueError(f"with_logprobs: {len(values)} {what} tensors for {len(self)} samples")
        samples = []
        for i, s in enumerate(self.samples):
            changes = {}
            if old is not None:
                changes["old_logprobs"] = old[i]
            if ref is not None:
                changes["ref_logprobs"] = ref[i]
            samples.append(replace(s, **changes))
        return TrainBatch(samples, self.policy_version, dict(self.metadata), self.micro_batch_plan)

    @staticmethod
    def concat(batches: Iterable["TrainBatch"]) -> "TrainBatch":
        batches = list(batches)
        versions = {b.policy_version for b in batches}
        if len(versions) > 1:
            raise ValueError(f"concat: batches built at different policy versions {sorted(versions)}")
        return TrainBatch(
            [s for b in batches for s in b.samples], versions.pop() if versions else 0, {}
        )


_TRAINABLE = (SampleStatus.DONE, SampleStatus.TRUNCATED)


def trained_samples(group: Group) -> list:
    """The samples of `group` that `build_batch` makes into TrainSamples, in its order: those
    with a trainable status and a response (the data-parallel hand-off plans with these)."""
    return [s for s in group.samples if s.status in _TRAINABLE and s.response_ids]


def build_batch(
    groups: Iterable[Group],
    *,
    advantage: str,
    off_policy_correction: str,
    policy_version: int,
    distill_coef: float = 0.0,
) -> TrainBatch:
    """A TrainBatch from complete groups (see the module docstring for what is kept).

    `distill_coef` > 0 (on-policy distillation) needs the teacher's logprob of every trainable
    token: a trained sample without `teacher_logprobs`, or with a non-finite one at a mask-1
    position, is an error naming it."""
    samples: list[TrainSample] = []
    for group in groups:
        rewarded = [s for s in group.samples if s.status in _TRAINABLE]
        for s in rewarded:
            if s.reward is None:
                raise ValueError(
                    f"group {group.group_id} sample {s.index}: status {s.status.value} but no "
                    "reward; only complete groups can be trained on"
                )
            s.check()
        if not rewarded:
            continue
        advantages = group_advantages([s.reward for s in rewarded], advantage)  # type: ignore[arg-type]
        for s, adv in zip(rewarded, advantages.tolist()):
            if not s.response_ids:
                continue
            if max(s.versions) > policy_version:
                raise ValueError(
                    f"group {group.group_id} sample {s.index}: token version {max(s.versions)} is "
                    f"newer than the trainer's policy version {policy_version}"
                )
            mask = torch.tensor(s.loss_mask, dtype=torch.float32)
            rollout = torch.tensor(s.logprobs, dtype=torch.float32)
            if off_policy_correction not in ("none", "unset"):
                _check_rollout_logprobs(group.group_id, s.index, rollout, mask,
                                        off_policy_correction)
            teacher = (None if s.teacher_logprobs is None
                       else torch.tensor(s.teacher_logprobs, dtype=torch.float32))
            if distill_coef > 0:
                _check_teacher_logprobs(group.group_id, s.index, teacher, mask, distill_coef)
            samples.append(
                TrainSample(
                    index=s.index,
                    group_id=group.group_id,
                    tokens=torch.tensor([*s.prompt_ids, *s.response_ids], dtype=torch.long),
                    prompt_length=len(s.prompt_ids),
                    loss_mask=mask,
                    rollout_logprobs=rollout,
                    advantage=float(adv),
                    reward=float(s.reward),  # type: ignore[arg-type]
                    min_version=min(s.versions),
                    max_version=max(s.versions),
                    versions=torch.tensor(s.versions, dtype=torch.int32),
                    resumed=s.resumes > 0,
                    teacher_logprobs=teacher,
                    traced=bool(s.metadata.get(TRACE_KEY)),
                )
            )
    batch = TrainBatch(samples, policy_version)
    off = batch.off_policy_samples()
    if off and off_policy_correction == "unset":
        raise OffPolicyCorrectionRequired(
            f"{off} of {len(batch)} samples hold tokens from a policy version other than "
            f"{policy_version} (stale or resumed partial rollouts): set "
            "train.algorithm.off_policy_correction to 'tis', 'mis', 'icepop' or 'none'"
        )
    batch.metadata["off_policy_samples"] = off
    return batch


def _check_rollout_logprobs(group_id: int, index: int, rollout: torch.Tensor,
                            mask: torch.Tensor, estimator: str) -> None:
    """A correction weighs each trainable token by exp(pi_old - rollout logprob): a token the engine
    returned without a logprob (SGLang's entry [None, id, ...], parsed as NaN) would make the
    loss NaN, and the optimizer would skip the whole step with nothing but
    train/step_applied 0 to show for it. Name it instead. (Mask-0 tokens never reach the loss.)"""
    bad = (~torch.isfinite(rollout) & (mask > 0)).nonzero().flatten()
    if len(bad):
        raise ValueError(
            f"group {group_id} sample {index}: the engine returned no logprob for "
            f"{len(bad)} of its {int(mask.sum())} trainable tokens (first at response position "
            f"{int(bad[0])}), and off_policy_correction '{estimator}' weighs every trainable token by "
            "its rollout logprob. Make the engine return output_token_logprobs for every token "
            "(return_logprob), or set train.algorithm.off_policy_correction 'none'")


def _check_teacher_logprobs(group_id: int, index: int, teacher: torch.Tensor | None,
                            mask: torch.Tensor, distill_coef: float) -> None:
    """Distillation subtracts distill_coef x (pi_old - teacher logprob) from every trainable
    token's advantage: a sample the teacher did not score, or a trainable token it returned no
    finite logprob for, would make the loss NaN (or train on a wrong advantage). Name it.
    Mask-0 positions (an episode's observations) never reach the loss and may hold anything."""
    if teacher is None:
        raise ValueError(
            f"group {group_id} sample {index}: no teacher logprobs, and train.algorithm."
            f"distill_coef {distill_coef} subtracts the reverse KL to the teacher from every "
            "trainable token's advantage. The rollout side scores each complete response with "
            "the frozen engine group of role 'teacher' (rollout.frozen_engines); set one, or "
            "set distill_coef 0")
    if teacher.numel() != mask.numel():
        raise ValueError(f"group {group_id} sample {index}: {teacher.numel()} teacher logprobs "
                         f"for a {mask.numel()}-token response")
    bad = (~torch.isfinite(teacher) & (mask > 0)).nonzero().flatten()
    if len(bad):
        raise ValueError(
            f"group {group_id} sample {index}: the teacher's logprob is not finite at "
            f"{len(bad)} of its {int(mask.sum())} trainable tokens (first at response position "
            f"{int(bad[0])}: {float(teacher[bad[0]])}), and train.algorithm.distill_coef "
            f"{distill_coef} subtracts it from each trainable token's advantage. The teacher "
            "engine must return a logprob for every response token")


def build_batch_from_config(groups: Iterable[Group], algorithm, policy_version: int) -> TrainBatch:
    """`build_batch` with the knobs of a `train.config.AlgorithmConfig`."""
    return build_batch(
        groups,
        advantage=algorithm.advantage,
        off_policy_correction=algorithm.off_policy_correction.estimator,
        policy_version=policy_version,
        distill_coef=algorithm.distill_coef,
    )
