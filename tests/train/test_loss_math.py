"""Numerical hardening of the policy loss: overflow-safe KL, GSPO against an independent
reference, and normalisation by the global denominator (loss functions and the real trainer)."""

import math

import pytest
import torch

from rlkit.train.algorithms.losses import LOW_VAR_KL_BOUND, PolicyLossInput, kl_estimate, policy_loss
from rlkit.train.config import AlgorithmConfig


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


# -- GSPO: sequence ratio, per-sequence clip, sequences averaged --------------------------------
def gspo_reference_loss(lp, old, adv, lengths, clip_low, clip_high):
    """-J_GSPO (arXiv 2507.18071): J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - lo, 1 + hi) A_i),
    s_i = exp(mean over sequence i of (lp - old)); written out, independent of policy_loss."""
    terms, start = [], 0
    for n, a in zip(lengths, adv):
        s = torch.exp((lp[start : start + n] - old[start : start + n]).mean())
        terms.append(torch.minimum(s * a, s.clamp(1 - clip_low, 1 + clip_high) * a))
        start += n
    return -torch.stack(terms).mean()


@pytest.mark.parametrize(
    "old_b, adv",
    [
        (-0.9, [1.0, -0.5]),  # both sequences inside the clip range
        (-1.1, [-1.0, 0.5]),  # sequence b: s = exp(0.4) > 1.28 with A > 0, clipped (no gradient)
    ],
)
def test_gspo_matches_the_reference_gradient(old_b, adv):
    # sequence a: 4 tokens, mean log-ratio 0.075 (s = 1.078); sequence b: 1 token
    lp_values = [-1.0, -0.5, -2.0, -0.3, -0.7]
    old = torch.tensor([-1.1, -0.45, -2.2, -0.35, old_b], dtype=torch.float64)
    lengths = [4, 1]
    cfg = AlgorithmConfig(ratio_level="sequence", clip_low=0.2, clip_high=0.28)

    lp = torch.tensor(lp_values, dtype=torch.float64, requires_grad=True)
    sample_ids = torch.tensor([0, 0, 0, 0, 1])
    terms = policy_loss(
        PolicyLossInput(
            logprobs=lp,
            advantages=torch.tensor(adv, dtype=torch.float64)[sample_ids],
            loss_mask=torch.ones(5, dtype=torch.float64),
            sample_ids=sample_ids,
            num_samples=2,
            old_logprobs=old,
        ),
        cfg,
    )
    ours = terms.numerator / terms.denominator
    ours.backward()

    ref_lp = torch.tensor(lp_values, dtype=torch.float64, requires_grad=True)
    expected = gspo_reference_loss(ref_lp, old, adv, lengths, 0.2, 0.28)
    expected.backward()

    assert terms.denominator == 2  # sequences, not tokens
    assert ours.item() == pytest.approx(expected.item(), rel=1e-12)
    assert torch.allclose(lp.grad, ref_lp.grad, rtol=1e-12, atol=0)
    assert ref_lp.grad.abs().sum() > 0
    if adv[1] > 0:
        assert ref_lp.grad[4] == 0.0  # the clipped sequence


def test_sequence_ratio_defaults_to_sequence_mean_and_refuses_token_mean():
    assert AlgorithmConfig().loss_aggregation == "token_mean"
    assert AlgorithmConfig(ratio_level="sequence").loss_aggregation == "sequence_mean"
    explicit = AlgorithmConfig(ratio_level="sequence", loss_aggregation="sequence_mean")
    assert AlgorithmConfig.model_validate(explicit.model_dump()) == explicit
    with pytest.raises(ValueError, match="ratio_level 'sequence' .*needs loss_aggregation 'sequence_mean'"):
        AlgorithmConfig(ratio_level="sequence", loss_aggregation="token_mean")


@pytest.mark.parametrize("adv", [-1.0, 1.0])
def test_gspo_sequence_log_ratio_is_clamped_before_exp(adv):
    # mean log-ratio 94: exp(94) overflows fp32; clamped to 20, s = exp(20) for both tokens
    lp = torch.tensor([-1.0, -1.0], dtype=torch.float32, requires_grad=True)
    inp = PolicyLossInput(
        logprobs=lp,
        advantages=torch.tensor([adv, adv]),
        loss_mask=torch.ones(2),
        sample_ids=torch.tensor([0, 0]),
        num_samples=1,
        old_logprobs=torch.tensor([-95.0, -95.0]),
    )
    terms = policy_loss(inp, AlgorithmConfig(ratio_level="sequence", clip_high=0.28))
    terms.numerator.backward()
    assert math.isfinite(terms.numerator.item()) and torch.isfinite(lp.grad).all()
    if adv < 0:  # unclipped: loss -A s, gradient -A s / n per token
        assert terms.numerator.item() == pytest.approx(math.exp(20), rel=1e-6)
        assert torch.allclose(lp.grad, torch.full((2,), math.exp(20) / 2), rtol=1e-6)
    else:  # clipped at 1 + clip_high: no gradient
        assert terms.numerator.item() == pytest.approx(-1.28, rel=1e-6)
        assert torch.equal(lp.grad, torch.zeros(2))


# -- normalisation by the global denominator ---------------------------------------------------
def ppo_token_terms(lp, old, adv, clip_low=0.2, clip_high=0.28):
    """Per-token PPO-clip loss, written out: -min(A r, A clip(r))."""
    r = torch.exp(lp - old)
    return -torch.minimum(adv * r, adv * r.clamp(1 - clip_low, 1 + clip_high))


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_micro_batches_are_normalised_by_the_global_denominator(aggregation):
    # micro-batch 1: one sample of 2 tokens; micro-batch 2: two samples of 5 and 3 tokens, one
    # token masked. A mean of micro-batch means would weight micro-batch 1 as much as 2.
    g = torch.Generator().manual_seed(0)
    lengths = [2, 5, 3]
    n = sum(lengths)
    lp0 = -torch.rand(n, generator=g, dtype=torch.float64) - 0.5
    old = lp0 + 0.2 * torch.randn(n, generator=g, dtype=torch.float64)
    mask = torch.ones(n, dtype=torch.float64)
    mask[4] = 0.0
    adv_per_sample = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    sid = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    adv = adv_per_sample[sid]
    cfg = AlgorithmConfig(loss_aggregation=aggregation)

    lp = lp0.clone().requires_grad_(True)
    num, den = 0.0, 0.0
    for idx, local in ((torch.arange(0, 2), torch.tensor([0, 0])), (torch.arange(2, n), sid[2:] - 1)):
        t = policy_loss(
            PolicyLossInput(logprobs=lp[idx], advantages=adv[idx], loss_mask=mask[idx], sample_ids=local,
                            num_samples=int(local.max()) + 1, old_logprobs=old[idx]),
            cfg,
        )
        t.numerator.backward()  # as the trainer does: backprop numerators, divide grads once
        num, den = num + t.numerator.item(), den + t.denominator
    grad = lp.grad / den

    ref_lp = lp0.clone().requires_grad_(True)
    terms = ppo_token_terms(ref_lp, old, adv) * mask
    if aggregation == "token_mean":
        expected_den = float(mask.sum())  # 9 trainable tokens
        expected = terms.sum() / expected_den
    else:
        n_i = torch.zeros(3, dtype=torch.float64).index_add(0, sid, mask)
        expected_den = 3.0
        expected = (torch.zeros(3, dtype=torch.float64).index_add(0, sid, terms) / n_i).sum() / expected_den
    expected.backward()
    assert den == expected_den
    assert num / den == pytest.approx(expected.item(), rel=1e-12)
    assert torch.allclose(grad, ref_lp.grad, rtol=1e-12, atol=1e-15)


@pytest.mark.integration
def test_trainer_divides_two_accumulates_by_the_global_token_count(tiny_qwen2_dir):
    from tests.train.helpers import random_batch
    from rlkit.train.config import TrainConfig
    from rlkit.train.megatron.trainer import MegatronTrainer

    cfg = TrainConfig.model_validate({"device": "cpu", "micro_batch_size": 4, "optimizer": {"lr": 1e-6}})
    trainer = MegatronTrainer.single_process(tiny_qwen2_dir, cfg)
    first, second = random_batch(2, seed=11), random_batch(7, seed=12)
    n1 = sum(float(s.loss_mask.sum()) for s in first.samples)
    n2 = sum(float(s.loss_mask.sum()) for s in second.samples)
    assert n1 != n2  # else a mean of per-call means would pass too

    def normalised_grads(*batches):
        for b in batches:
            trainer.accumulate(b)
        grads = trainer.finalize_grads_for_test()
        trainer.discard_gradients()
        return grads

    g1, g2, both = normalised_grads(first), normalised_grads(second), normalised_grads(first, second)
    scale = max(float(g.abs().max()) for g in both.values())
    for name, g in both.items():
        expected = (n1 * g1[name] + n2 * g2[name]) / (n1 + n2)
        assert torch.allclose(g, expected, rtol=1e-5, atol=1e-6 * scale), name

    # on-policy (no pi_old, no KL/entropy): every token's loss is -A of its sample
    trainer.accumulate(first)
    trainer.accumulate(second)
    metrics = trainer.step()
    token_loss_sum = sum(-s.advantage * float(s.loss_mask.sum()) for s in first.samples + second.samples)
    assert metrics["train/loss_denominator"] == n1 + n2
    assert metrics["train/loss"] == pytest.approx(token_loss_sum / (n1 + n2), rel=1e-5)
