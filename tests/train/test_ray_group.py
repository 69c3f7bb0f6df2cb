"""TP x DP trainer ranks as Ray actors (gloo on CPU): parity at TP=2, TP=2 and DP=2 train like
TP=1, checkpoints and export from sharded ranks."""

from __future__ import annotations

import pytest
import torch

from tests.train.helpers import hf_response_logprobs, random_batch
from rlkit.train.config import TrainConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PARITY_ATOL = 1e-4
LR = 1e-3


def config(tp=1, dp=1, **kw):
    return TrainConfig.model_validate(
        {"device": "cpu", "parallelism": {"tensor": tp, "data": dp}, "micro_batch_size": 3,
         "optimizer": {"lr": LR}, **kw}
    )


@pytest.fixture(scope="module")
def tp2_group(ray_cluster, tiny_qwen2_dir):
    from rlkit.train.ray_group import TrainerGroup

    group = TrainerGroup(tiny_qwen2_dir, config(tp=2), num_cpus_per_worker=1)
    yield group
    group.shutdown()


def test_tp2_ranks(tp2_group):
    assert [(r["tp_rank"], r["dp_rank"]) for r in tp2_group.ranks] == [(0, 0), (1, 0)]


def test_tp2_parity_with_transformers(tp2_group, tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    batch = random_batch(7, seed=11)
    ours = tp2_group.logprobs(batch)
    diff = max(
        float((hf_response_logprobs(hf, s.tokens, s.prompt_length) - lp).abs().max())
        for s, lp in zip(batch.samples, ours)
    )
    assert diff < PARITY_ATOL


def test_tp2_step_matches_tp1_and_exports(tp2_group, tiny_qwen2_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlkit.train.megatron.trainer import MegatronTrainer

    batch = random_batch(8, seed=12)
    local = MegatronTrainer.single_process(tiny_qwen2_dir, config())
    local.accumulate(batch)
    m1 = local.step()
    tp2_group.accumulate(batch)
    m2 = tp2_group.step()
    for key in ("train/loss", "train/grad_norm", "train/loss_denominator"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5), key
    # weights after the step: equal up to Adam's sign-like first step on float-noise gradients
    exported = tp2_group.export_hf(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).state_dict()
    for name, t in dict(local.iter_hf_weights()).items():
        assert float((hf[name] - t).abs().max()) <= 1e-2 * LR, name


def test_tp2_groups_streamed_as_object_refs_train_as_the_synchronous_step(tp2_group, tmp_path):
    """The driver's path: group references go to every rank as they arrive (any order); each
    rank builds its samples; the step equals one process's synchronous step on the batch (from
    the group's current weights: loss and gradient norm are taken before the update)."""
    import ray

    from tests.train.helpers import random_groups
    from rlkit.train.batch import build_batch_from_config
    from rlkit.train.megatron.trainer import MegatronTrainer

    groups = random_groups(4, 3, seed=31)
    local = MegatronTrainer.single_process(tp2_group.export_hf(tmp_path / "now"), config())
    local.accumulate(build_batch_from_config(groups, local.config.algorithm, policy_version=0))
    m1 = local.step()
    refs = [ray.put(g) for g in groups]
    calls = tp2_group.begin_batch(0, 12)
    for i in (2, 0, 3, 1):
        calls += tp2_group.add_groups([refs[i]])
    ray.get(calls)
    m2 = ray.get(tp2_group.finish_batch())[0]
    for key in ("train/loss", "train/grad_norm", "train/loss_denominator", "train/samples"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5), key


def test_tp2_checkpoint_round_trip(tp2_group, ray_cluster, tiny_qwen2_dir, tmp_path):
    from rlkit.train.ray_group import TrainerGroup

    tp2_group.save(tmp_path / "ckpt")
    batch = random_batch(5, seed=13)
    before = tp2_group.logprobs(batch)
    step = tp2_group.step_count
    tp2_group.shutdown()  # free the two CPUs for the resumed group
    resumed = TrainerGroup(tiny_qwen2_dir, config(tp=2), num_cpus_per_worker=1)
    try:
        resumed.load(tmp_path / "ckpt")
        assert resumed.step_count == step
        after = resumed.logprobs(batch)
        assert all(torch.equal(a, b) for a, b in zip(after, before))
    finally:
        resumed.shutdown()


def test_dp2_gradients_equal_one_process(ray_cluster, tiny_qwen2_dir):
    """DP=2 by count and by token budget (replicas by cost, equal micro-batch counts, empty ones
    padding the lighter replica) against one process by count: the same gradients on both
    replicas; then a step by tokens: the same loss and gradient norm."""
    import ray

    from rlkit.train.megatron.trainer import MegatronTrainer
    from rlkit.train.microbatch_plan import plan_micro_batches
    from rlkit.train.ray_group import TrainerGroup, plan_for_data_parallel

    algo = {"loss_aggregation": "sequence_mean"}
    batch = random_batch(9, seed=14, response_lengths=[2, 70, 3, 9, 1, 25, 4, 40, 6])
    local = MegatronTrainer.single_process(tiny_qwen2_dir, config(algorithm=algo))
    local.accumulate(batch)
    expected = local.finalize_grads_for_test()
    local.discard_gradients()
    local.accumulate(batch)
    local_metrics = local.step()
    group = TrainerGroup(tiny_qwen2_dir, config(dp=2, algorithm=algo), num_cpus_per_worker=1)
    try:
        scale = max(float(g.abs().max()) for g in expected.values())
        for budget in (0, 32, 4096):  # 0: by count (micro_batch_size 3)
            # the driver plans every replica's micro-batches; the ranks run the plan they get
            group.config.max_tokens_per_micro_batch = budget
            plan = plan_for_data_parallel(batch, group.config, group.attention_weight)
            assert plan == plan_micro_batches([s.length for s in batch.samples], dp_size=2,
                                              max_tokens=budget, micro_batch_size=3,
                                              attention_weight=group.attention_weight)
            assert (() in plan.replicas[0]) == (budget == 32)  # 32: replica 0 pads with empty work
            stats = group.accumulate(batch)
            assert stats["samples"] == 9
            assert stats["micro_batches"] == 2 * len(plan.replicas[0])  # as many on each replica
            grads = ray.get([w.finalize_grads_for_test.remote() for w in group.workers])
            for name, g in expected.items():
                for rank_grads in grads:  # both replicas hold the all-reduced, normalised gradient
                    assert torch.allclose(rank_grads[name], g, rtol=1e-5, atol=1e-6 * scale), (budget, name)
            ray.get([w.discard_gradients.remote() for w in group.workers])
        group.accumulate(batch)
        m = group.step()
        for key in ("train/loss", "train/grad_norm", "train/loss_denominator", "train/samples"):
            assert m[key] == pytest.approx(local_metrics[key], rel=1e-5), key
    finally:
        group.shutdown()
