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
