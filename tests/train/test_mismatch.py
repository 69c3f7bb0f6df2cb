"""Mismatch telemetry per version lag (train/algorithms/mismatch.py): the figures on known
inputs, and the lag buckets of a sample resumed across versions, through the buffer's Sample and
Group, build_batch and the real megatron trainer."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rlkit.buffers.group import Group, PromptRecord
from rlkit.train.algorithms import mismatch
from rlkit.train.batch import build_batch


def _sums(log_ratio, lag, resumed=None, keep=None, truncated=None, masked=None, rejected=None):
    t = len(log_ratio)
    false = torch.zeros(t, dtype=torch.bool)
    return mismatch.telemetry_sums(
        torch.tensor(log_ratio, dtype=torch.float64), torch.tensor(lag),
        false if resumed is None else torch.tensor(resumed),
        torch.ones(t, dtype=torch.bool) if keep is None else torch.tensor(keep),
        false if truncated is None else torch.tensor(truncated),
        false if masked is None else torch.tensor(masked),
        false if rejected is None else torch.tensor(rejected))


def test_figures_on_known_log_ratios():
    lr = [0.1, -0.2, 0.5, 1.0, -1.0]
    m = mismatch.metrics(_sums(lr, [0, 0, 1, 2, 7], resumed=[False, False, True, True, True],
                               keep=[True, True, True, True, True], truncated=[False, False, True, False, False]))
    assert m["mismatch/lag0/tokens"] == 2 and m["mismatch/lag3plus/tokens"] == 1
    assert m["mismatch/lag0/abs_log_ratio_mean"] == pytest.approx(0.15)
    assert m["mismatch/lag0/kl_k1"] == pytest.approx(0.05)  # mean(-l)
    k3 = [math.exp(x) - 1 - x for x in (0.1, -0.2)]
    assert m["mismatch/lag0/kl_k3"] == pytest.approx(sum(k3) / 2)
    rho = [math.exp(0.1), math.exp(-0.2)]
    assert m["mismatch/lag0/ess"] == pytest.approx(sum(rho) ** 2 / (2 * sum(r * r for r in rho)))
    assert m["mismatch/lag0/chi2"] == pytest.approx(sum(r * r for r in rho) / 2 - 1)
    assert m["mismatch/lag1/truncated"] == 1.0 and m["mismatch/lag0/truncated"] == 0.0
    assert m["mismatch/resumed/tokens"] == 3 and m["mismatch/fresh/tokens"] == 2
    assert "mismatch/lag2/tokens" in m
    # p99 is the upper edge of the histogram bin holding the 99th percentile: within 22% above
    assert 1.0 <= m["mismatch/lag2/abs_log_ratio_p99"] <= 1.22


def test_empty_buckets_are_absent_and_mask_0_tokens_count_nowhere():
    m = mismatch.metrics(_sums([0.3, 50.0], [1, 0], keep=[True, False]))
    assert set(k.split("/")[1] for k in m) == {"lag1", "fresh"}
    assert m["mismatch/lag1/tokens"] == 1


def test_p99_of_many_tokens_and_the_vector_adds_across_micro_batches():
    g = torch.Generator().manual_seed(0)
    lr = (torch.randn(5000, generator=g, dtype=torch.float64) * 0.05).tolist()
    half = len(lr) // 2
    whole = _sums(lr, [0] * len(lr))
    split = _sums(lr[:half], [0] * half) + _sums(lr[half:], [0] * (len(lr) - half))
    assert torch.allclose(whole, split)
    p99 = mismatch.metrics(whole)["mismatch/lag0/abs_log_ratio_p99"]
    true = float(torch.tensor(lr).abs().quantile(0.99))
    assert true <= p99 <= true * 1.23
    with pytest.raises(ValueError, match="expected"):
        mismatch.metrics([0.0] * 3)


def _resumed_group(tokens_per_span=3):
    """Sample 0 generated over versions 3, 4, 5 (aborted twice, resumed); sample 1 fresh at 5;
    sample 2 stale, all at version 1."""
    g = Group.new(1, PromptRecord(ids=(5, 6, 7), text="p"), 3, 100, version=3)
    spans = {0: [3, 4, 5], 1: [5], 2: [1]}
    for i, s in enumerate(g.samples):
        for k, v in enumerate(spans[i]):
            last = k == len(spans[i]) - 1
            toks = [10 + i + 3 * k + j for j in range(tokens_per_span)]
            s.append(toks, [-1.0] * len(toks), v, finish_reason="stop" if last else "abort")
            if not last:
                s.start_request()
        s.set_reward(float(i))
    return g


@pytest.mark.integration
def test_a_sample_spanning_three_versions_lands_in_three_lag_buckets(tiny_qwen2_dir):
    from tests.train.test_megatron_local import make_trainer

    group = _resumed_group()
    assert [s.resumes for s in group.samples] == [2, 0, 0]
    batch = build_batch([group], advantage="grpo", off_policy_correction="tis", policy_version=5)
    s0 = batch.samples[0]
    assert s0.versions.tolist() == [3, 3, 3, 4, 4, 4, 5, 5, 5] and s0.resumed
    trainer = make_trainer(tiny_qwen2_dir, algorithm={"off_policy_correction": "none"})
    trainer.version = 5
    # rollout logprobs = the trainer's own minus a known log-ratio per token: 0.1 x lag + 0.01
    current = trainer.logprobs(batch)
    samples = []
    for s, lp in zip(batch.samples, current):
        lag = 5 - s.versions.float()
        samples.append(dataclasses.replace(s, rollout_logprobs=lp - (0.1 * lag + 0.01)))
    trainer.accumulate(dataclasses.replace(batch, samples=samples))
    m = trainer.step()
    assert m["mismatch/lag0/tokens"] == 6  # sample 0's version-5 span and sample 1
    assert m["mismatch/lag1/tokens"] == 3 and m["mismatch/lag2/tokens"] == 3
    assert m["mismatch/lag3plus/tokens"] == 3  # sample 2, 4 versions behind
    assert m["mismatch/resumed/tokens"] == 9 and m["mismatch/fresh/tokens"] == 6
    for bucket, lag in (("lag0", 0), ("lag1", 1), ("lag2", 2), ("lag3plus", 4)):
        assert m[f"mismatch/{bucket}/abs_log_ratio_mean"] == pytest.approx(0.1 * lag + 0.01, abs=1e-4)
        assert m[f"mismatch/{bucket}/kl_k1"] == pytest.approx(-(0.1 * lag + 0.01), abs=1e-4)
    assert m["mismatch/resumed/abs_log_ratio_mean"] == pytest.approx((0.01 + 0.11 + 0.21) / 3, abs=1e-4)
    assert m["train/rejected_samples"] == 0
