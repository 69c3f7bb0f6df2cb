"""Numerical hardening of the policy loss: overflow-safe KL, GSPO against an independent
reference, and normalisation by the global denominator (loss functions and the real trainer)."""

import math

import pytest
import torch

from train.algorithms.losses import LOW_VAR_KL_BOUND, PolicyLossInput, kl_estimate, policy_loss
from train.config import AlgorithmConfig


# -- low_var KL: clamp the log-ratio before exp -------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lp_value, ref_value", [(-95.0, -1.0), (-1.0, -95.0)])
def test_low_var_kl_is_finite_far_from_the_reference(dtype, lp_value, ref_value):
    # lp - ref = -94: exp(94) overflows fp32/bf16; an exp before the clamp gave a NaN gradient
    lp = torch.tensor([lp_value], dtype=dtype, requires_grad=True)
    ref = torch.tensor([ref_value], dtype=dtype)
    kl = kl_estimate(lp, ref, "low_var")
    kl.sum().backward()
    assert kl.item() == LOW_VAR_KL_BOUND  # both are past the value clamp
    assert torch.isfinite(lp.grad).all() and lp.grad.item() == 0.0  # clamped: no gradient


@pytest.mark.parametrize("lp_value, ref_value", [(-95.0, -1.0), (-1.0, -95.0)])
def test_low_var_kl_penalty_keeps_the_loss_and_gradient_finite(lp_value, ref_value):
    lp = torch.tensor([lp_value, -1.0], dtype=torch.float32, requires_grad=True)
    inp = PolicyLossInput(
        logprobs=lp,
        advantages=torch.tensor([1.0, 1.0]),
        loss_mask=torch.ones(2),
        sample_ids=torch.tensor([0, 0]),
        num_samples=1,
        ref_logprobs=torch.tensor([ref_value, -1.5]),
    )
    terms = policy_loss(inp, AlgorithmConfig(kl_coef=0.1, kl_estimator="low_var"))
    terms.numerator.backward()
    assert math.isfinite(terms.numerator.item()) and torch.isfinite(lp.grad).all()
    # token 0: -A * r = -1 plus 0.1 * 10 (clamped KL); token 1: -1 plus 0.1 * k3(0.5)
    k3 = math.exp(-0.5) - 1 + 0.5
    assert terms.numerator.item() == pytest.approx(-2.0 + 0.1 * (LOW_VAR_KL_BOUND + k3), rel=1e-6)
    expected = [-1.0, -1.0 + 0.1 * (1 - math.exp(-0.5))]  # d k3 / d lp = 1 - exp(ref - lp)
    assert torch.allclose(lp.grad, torch.tensor(expected), rtol=1e-6)


def test_low_var_kl_values_inside_the_bound_are_unchanged():
    # the log-ratio clamp (+-20) never changes a low_var value: |k3| > 10 well before it
    x = torch.linspace(-30, 30, 601, dtype=torch.float64)
    lp, ref = x, torch.zeros_like(x)
    raw_k3 = kl_estimate(lp, ref, "k3")
    assert torch.equal(kl_estimate(lp, ref, "low_var"), raw_k3.clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND))
