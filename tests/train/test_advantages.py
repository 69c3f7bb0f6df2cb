"""Known answers for the group advantage estimators."""

import math

import pytest
import torch

from rlkit.train.algorithms.advantages import GRPO_STD_EPS, group_advantages


def test_grpo_divides_by_unbiased_std():
    # rewards 1, 0, 0, 1: mean 0.5, unbiased std sqrt(1/3)
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], "grpo")
    expected = 0.5 / (math.sqrt(1 / 3) + GRPO_STD_EPS)
    assert torch.allclose(adv, torch.tensor([expected, -expected, -expected, expected]), atol=1e-6)


def test_dr_grpo_is_mean_centred_only():
    adv = group_advantages([3.0, 1.0, 2.0], "dr_grpo")
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0]))


def test_rloo_uses_leave_one_out_baseline():
    # r_i - mean of the others: 3 - 1.5, 1 - 2.5, 2 - 2
    adv = group_advantages([3.0, 1.0, 2.0], "rloo")
    assert torch.allclose(adv, torch.tensor([1.5, -1.5, 0.0]))


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_equal_rewards_and_single_samples_give_zero(estimator):
    assert torch.equal(group_advantages([0.7, 0.7, 0.7], estimator), torch.zeros(3))
    assert torch.equal(group_advantages([5.0], estimator), torch.zeros(1))


def test_unknown_estimator_and_empty_group_are_errors():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages([1.0, 0.0], "ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one reward"):
        group_advantages([], "grpo")
