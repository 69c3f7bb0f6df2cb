"""Each data-parallel replica receives only its share of each group (rlkit/driver/handoff.py):
the rank trains exactly what it trained when every rank fetched every group and placed the
samples itself (samples, advantages, micro-batches, global-batch parts), and it receives about
1/DP of the bytes."""

import pickle

import pytest
import torch

from rlkit.driver.handoff import ReplicaHandOff
from rlkit.train.config import AlgorithmConfig
from rlkit.train.stream import RolloutBatchStep
from tests.train.helpers import random_groups


class Recorder:
    """A trainer rank that records what it is asked to train."""

    attention_weight = 0.001

    def __init__(self):
        self.trained, self.steps = [], 0

    def logprobs(self, batch, policy="current"):
        return [torch.zeros(len(s.loss_mask)) for s in batch.samples]

    def accumulate(self, batch):
        self.trained.append(([(s.group_id, s.index, s.length, round(s.advantage, 6))
                              for s in batch.samples], batch.micro_batch_plan))
        return {}

    def step(self):
        self.steps += 1
        return {"train/loss": 0.0}


def train(groups_per_rank, dp, global_batch):
    ranks = [Recorder() for _ in range(dp)]
    steps = [RolloutBatchStep(r, AlgorithmConfig(advantage="grpo", off_policy_correction="tis"),
                              policy_version=0, rollout_samples=24, global_batch_size=global_batch,
                              micro_batch_size=2, dp_rank=d, dp_size=dp,
                              max_tokens_per_micro_batch=40, attention_weight=Recorder.attention_weight)
             for d, r in enumerate(ranks)]
    metrics = []
    for d, step in enumerate(steps):
        for g in groups_per_rank[d]:
            step.add(g)
        metrics.append(step.finish())
    return [(r.trained, r.steps) for r in ranks], metrics


@pytest.mark.parametrize("global_batch", [0, 10])
def test_each_replica_trains_from_its_share_what_it_trained_from_every_group(global_batch):
    groups = random_groups(6, 4, seed=7)
    empty = groups[2].samples[1]  # a trainable sample without a response: its reward still counts
    for tokens in (empty.response_ids, empty.logprobs, empty.versions, empty.loss_mask):
        tokens.clear()
    whole, _ = train([groups, groups], 2, global_batch)
    hand = ReplicaHandOff(2, Recorder.attention_weight, global_batch, put=lambda x: x)
    handed = hand(groups)
    shared, _ = train([[refs[d] for refs in handed.refs] for d in range(2)], 2, global_batch)
    assert shared == whole and all(t for t, _ in whole)  # both replicas trained something
    hand.new_batch()  # the next rollout batch places from scratch, as the trainer does
    assert [r[0].lengths for r in hand(groups).refs] == [r[0].lengths for r in handed.refs]


def test_a_replica_receives_about_its_share_of_the_bytes():
    groups = random_groups(16, 8, seed=3, response_lengths=[200 + 37 * i % 900 for i in range(128)])
    whole = sum(len(pickle.dumps(g)) for g in groups)
    handed = ReplicaHandOff(2, 0.0, 0, put=lambda x: x)(groups)
    per_rank = [sum(len(pickle.dumps(refs[d])) for refs in handed.refs) for d in range(2)]
    assert all(b < 0.6 * whole for b in per_rank), (per_rank, whole)


def test_another_replicas_sample_travels_without_its_teacher_logprobs():
    """Distillation: a share keeps the teacher logprobs of its own samples only; the others'
    are emptied with their tokens (Sample.check holds on every share)."""
    groups = random_groups(4, 4, seed=5)
    for g in groups:
        for s in g.samples:
            s.teacher_logprobs = [-1.0] * len(s.response_ids)
    handed = ReplicaHandOff(2, 0.0, 0, put=lambda x: x)(groups)
    for refs in handed.refs:
        for share in refs:
            for s in share.group.samples:
                s.check()
                assert (s.teacher_logprobs is None) == (not s.response_ids)
