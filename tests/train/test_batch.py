"""Groups -> TrainBatch: which samples train, their advantages, and the off-policy rule."""

import pytest
import torch

from rlkit.buffers.group import Group, PromptRecord
from rlkit.train.batch import OffPolicyCorrectionRequired, TrainBatch, build_batch


def make_group(gid, rewards, *, versions=None, prompt=(1, 2, 3), fail=(), empty=()):
    g = Group.new(gid, PromptRecord(ids=tuple(prompt), text="p"), len(rewards), gid * 100, version=0)
    for i, (s, r) in enumerate(zip(g.samples, rewards)):
        if i in fail:
            s.fail("engine error")
            continue
        spans = versions[i] if versions else [0]
        for k, v in enumerate(spans):
            last = k == len(spans) - 1
            toks = [] if i in empty else [10 + i, 20 + k]
            s.append(toks, [-0.5] * len(toks), v, finish_reason="stop" if last else "abort")
            if not last:
                s.start_request()
        s.set_reward(r)
    return g


def test_samples_advantages_and_tensors():
    batch = build_batch([make_group(1, [1.0, 0.0])], advantage="dr_grpo", off_policy_correction="unset", policy_version=0)
    assert len(batch) == 2
    s0, s1 = batch.samples
    assert (s0.advantage, s1.advantage) == (0.5, -0.5)
    assert torch.equal(s0.tokens, torch.tensor([1, 2, 3, 10, 20]))
    assert s0.prompt_length == 3 and s0.response_length == 2
    assert torch.equal(s0.rollout_logprobs, torch.tensor([-0.5, -0.5]))
    assert torch.equal(s0.loss_mask, torch.ones(2))
    assert batch.tokens == 10 and batch.trainable_tokens == 4
    assert batch.off_policy_samples() == 0


def test_failed_samples_are_left_out_of_batch_and_statistics():
    # rewards of the three kept samples: 1, 0, 0.5 -> mean 0.5
    g = make_group(2, [1.0, 9.0, 0.0, 0.5], fail=(1,))
    batch = build_batch([g], advantage="dr_grpo", off_policy_correction="unset", policy_version=0)
    assert [s.index for s in batch.samples] == [200, 202, 203]
    assert [s.advantage for s in batch.samples] == [0.5, -0.5, 0.0]


def test_empty_responses_count_for_the_group_but_carry_no_tokens():
    g = make_group(3, [1.0, 0.0, 0.0], empty=(2,))
    batch = build_batch([g], advantage="rloo", off_policy_correction="unset", policy_version=0)
    assert [s.index for s in batch.samples] == [300, 301]
    assert batch.samples[0].advantage == pytest.approx(1.0)  # 1 - mean(0, 0)


def test_off_policy_tokens_need_an_explicit_correction():
    resumed = make_group(4, [1.0, 0.0], versions=[[0, 1], [1]])  # sample 0 resumed across an update
    with pytest.raises(OffPolicyCorrectionRequired, match="off_policy_correction"):
        build_batch([resumed], advantage="grpo", off_policy_correction="unset", policy_version=1)
    for choice in ("tis", "none"):
        b = build_batch([resumed], advantage="grpo", off_policy_correction=choice, policy_version=1)
        assert b.off_policy_samples() == 1 and b.metadata["off_policy_samples"] == 1
    stale = make_group(5, [1.0, 0.0])  # all tokens at version 0, trainer at 2
    with pytest.raises(OffPolicyCorrectionRequired):
        build_batch([stale], advantage="grpo", off_policy_correction="unset", policy_version=2)


def test_tokens_newer_than_the_trainer_are_an_error():
    with pytest.raises(ValueError, match="newer than the trainer"):
        build_batch([make_group(6, [1.0, 0.0], versions=[[3], [3]])], advantage="grpo",
                    off_policy_correction="tis", policy_version=2)


def test_a_trainable_token_without_a_rollout_logprob_is_named_under_tis():
    g = make_group(8, [1.0, 0.0])
    s = g.samples[1]
    s.logprobs[1] = float("nan")  # the engine's [None, id] entry (rollout/http/protocol.py)
    with pytest.raises(ValueError, match=r"group 8 sample 801: the engine returned no logprob "
                       r"for 1 of its 2 trainable tokens \(first at response position 1\)"):
        build_batch([g], advantage="grpo", off_policy_correction="tis", policy_version=0)
    # without TIS the rollout logprobs are a diagnostic only: the batch builds
    b = build_batch([g], advantage="grpo", off_policy_correction="none", policy_version=0)
    assert torch.isnan(b.samples[1].rollout_logprobs[1])
    s.loss_mask[1] = 0  # a masked token (an observation) needs none
    build_batch([g], advantage="grpo", off_policy_correction="tis", policy_version=0)


def test_subsets_micro_batches_and_attached_logprobs():
    batch = build_batch([make_group(7, [1.0, 0.0, 0.5])], advantage="grpo", off_policy_correction="unset", policy_version=0)
    assert [len(m) for m in batch.micro_batches(2)] == [2, 1]
    with_old = batch.with_logprobs(old=[torch.zeros(2)] * 3)
    assert all(s.old_logprobs is not None for s in with_old.samples)
    assert all(s.old_logprobs is None for s in batch.samples)  # the original is untouched
    with pytest.raises(ValueError, match="2 old tensors for 3 samples"):
        batch.with_logprobs(old=[torch.zeros(2)] * 2)
    assert len(TrainBatch.concat([batch.subset([0]), batch.subset([1, 2])])) == 3


# -- on-policy distillation: the teacher's logprobs (Sample.teacher_logprobs) -------------------
def with_teacher(g, skip=()):
    for s in g.samples:
        if s.index % 100 not in skip and s.response_ids:
            s.teacher_logprobs = [-1.0 - 0.25 * k - s.index % 100 for k in range(len(s.response_ids))]
    return g


def test_teacher_logprobs_are_carried_into_the_train_samples():
    from rlkit.train.batch import build_batch_from_config
    from rlkit.train.config import AlgorithmConfig

    g = with_teacher(make_group(9, [1.0, 0.0]))
    for b in (build_batch([g], advantage="grpo", off_policy_correction="unset", policy_version=0),
              build_batch([g], advantage="grpo", off_policy_correction="unset", policy_version=0,
                          distill_coef=0.5),
              build_batch_from_config([g], AlgorithmConfig(distill_coef=0.5), 0)):
        s0, s1 = b.samples
        assert s0.teacher_logprobs.dtype == torch.float32
        assert torch.equal(s0.teacher_logprobs, torch.tensor([-1.0, -1.25]))
        assert torch.equal(s1.teacher_logprobs, torch.tensor([-2.0, -2.25]))
        assert b.subset([1]).samples[0].teacher_logprobs is s1.teacher_logprobs
        assert b.with_logprobs(old=[torch.zeros(2)] * 2).samples[0].teacher_logprobs is s0.teacher_logprobs
    # no teacher, no distillation: None, as before
    plain = build_batch([make_group(9, [1.0, 0.0])], advantage="grpo", off_policy_correction="unset",
                        policy_version=0)
    assert all(s.teacher_logprobs is None for s in plain.samples)


def test_distillation_refuses_a_trained_sample_without_teacher_logprobs():
    from rlkit.train.batch import build_batch_from_config
    from rlkit.train.config import AlgorithmConfig

    g = with_teacher(make_group(10, [1.0, 0.0, 0.5], empty=(2,)), skip=(1,))
    with pytest.raises(ValueError, match=r"group 10 sample 1001: no teacher logprobs.*distill_coef 0.5"
                                         r".*role 'teacher'.*frozen_engines"):
        build_batch([g], advantage="grpo", off_policy_correction="unset", policy_version=0, distill_coef=0.5)
    with pytest.raises(ValueError, match="group 10 sample 1001: no teacher logprobs"):
        build_batch_from_config([g], AlgorithmConfig(distill_coef=0.5), 0)
    # off, the batch builds (the missing one is None); an empty response trains nothing, needs none
    b = build_batch([g], advantage="grpo", off_policy_correction="unset", policy_version=0)
    assert [s.teacher_logprobs is None for s in b.samples] == [False, True]
    g.samples[1].teacher_logprobs = [-0.5, -0.5]
    assert len(build_batch([g], advantage="grpo", off_policy_correction="unset", policy_version=0,
                           distill_coef=0.5)) == 2


@pytest.mark.parametrize("wild", [float("nan"), float("inf"), float("-inf")])
def test_distillation_refuses_a_non_finite_teacher_logprob_at_a_trainable_position(wild):
    g = with_teacher(make_group(11, [1.0, 0.0]))
    s = g.samples[1]
    s.teacher_logprobs[1] = wild
    kw = dict(advantage="grpo", off_policy_correction="unset", policy_version=0)
    with pytest.raises(ValueError, match=r"group 11 sample 1101: the teacher's logprob is not finite at 1 "
                                         r"of its 2 trainable tokens \(first at response position 1"):
        build_batch([g], **kw, distill_coef=0.1)
    build_batch([g], **kw)  # without distillation it is not read
    s.loss_mask[1] = 0  # a masked token (an observation) may hold anything: it never reaches the loss
    b = build_batch([g], **kw, distill_coef=0.1)
    assert b.samples[1].teacher_logprobs[0] == -2.0


def test_the_trainers_loss_input_carries_the_teacher_logprobs():
    """MegatronTrainer._loss_input (no model needed): teacher logprobs concatenated like the others,
    all samples of a micro-batch or none."""
    from dataclasses import replace

    from rlkit.train.megatron.trainer import MegatronTrainer
    from rlkit.train.packing import pack_samples

    samples = build_batch([with_teacher(make_group(12, [1.0, 0.0]))], advantage="grpo",
                          off_policy_correction="unset", policy_version=0, distill_coef=1.0).samples
    packed = pack_samples([s.tokens for s in samples], [s.prompt_length for s in samples])
    lp = torch.zeros(sum(s.response_length for s in samples))

    def loss_input(samples):
        return MegatronTrainer._loss_input(None, samples, packed, lp, None, False, 0)  # self unused

    assert torch.equal(loss_input(samples).teacher_logprobs, torch.tensor([-1.0, -1.25, -2.0, -2.25]))
    assert loss_input([replace(s, teacher_logprobs=None) for s in samples]).teacher_logprobs is None
    with pytest.raises(ValueError, match="teacher_logprobs: set for some samples of a micro-batch and not others"):
        loss_input([samples[0], replace(samples[1], teacher_logprobs=None)])
