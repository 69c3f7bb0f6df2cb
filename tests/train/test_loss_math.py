"""Numerical hardening of the policy loss: overflow-safe KL, GSPO against an independent
reference, and normalisation by the global denominator (loss functions and the real trainer)."""

import math

import pytest
import torch

from rlkit.train.algorithms.losses import (
    LOG_RATIO_BOUND, LOW_VAR_KL_BOUND, LossTerms, PolicyLossInput, kl_estimate, policy_loss,
)
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


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "sequence_mean_token_sum_norm"])
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
    cfg = AlgorithmConfig(loss_aggregation=aggregation, loss_norm_length=6)

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
    elif aggregation == "sequence_mean":
        n_i = torch.zeros(3, dtype=torch.float64).index_add(0, sid, mask)
        expected_den = 3.0
        expected = (torch.zeros(3, dtype=torch.float64).index_add(0, sid, terms) / n_i).sum() / expected_den
    else:  # Dr.GRPO: token sums / the constant 6, averaged over the 3 samples
        expected_den = 3.0
        expected = terms.sum() / (expected_den * 6)
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


# -- token ratio: the log-ratio is clamped before exp (issue 23, item 6) ------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("log_ratio", [100.0, -100.0, 1000.0, -1000.0])
@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_token_log_ratio_is_clamped_before_exp(dtype, log_ratio, adv):
    # token 0: lp - old = log_ratio, far past exp's fp32/bf16 range (~88.7); token 1 is ordinary
    lp = torch.tensor([-1.0, -1.0], dtype=dtype, requires_grad=True)
    old = torch.tensor([-1.0 - log_ratio, -1.1], dtype=dtype)
    inp = PolicyLossInput(logprobs=lp, advantages=torch.tensor([adv, adv]), loss_mask=torch.ones(2),
                          sample_ids=torch.tensor([0, 0]), num_samples=1, old_logprobs=old)
    terms = policy_loss(inp, AlgorithmConfig(clip_low=0.2, clip_high=0.28))
    terms.numerator.backward()
    assert math.isfinite(terms.numerator.item()) and torch.isfinite(lp.grad).all()
    r0 = math.exp(math.copysign(LOG_RATIO_BOUND, log_ratio))  # clamped to +-20
    r1 = float(torch.exp(lp.detach()[1].double() - old[1].double()))
    pg0 = max(-adv * r0, -adv * min(max(r0, 0.8), 1.28))
    pg1 = max(-adv * r1, -adv * min(max(r1, 0.8), 1.28))
    rel = 1e-6 if dtype == torch.float32 else 1e-2
    assert terms.numerator.item() == pytest.approx(pg0 + pg1, rel=rel)
    assert lp.grad[0].item() == 0.0  # past the clamp: the value is bounded, no gradient
    assert lp.grad[1].item() == pytest.approx(-adv * r1, rel=rel)  # inside [0.8, 1.28]


# -- mask 0 by selection: nothing at a mask-0 position reaches the loss --------------------------
MASK_CONFIGS = {
    "ppo-token_mean-tis-k3-entropy": dict(off_policy_correction="tis", kl_coef=0.1, kl_estimator="k3",
                                          entropy_coef=0.01),
    "ppo-token_mean-low_var": dict(kl_coef=0.1, kl_estimator="low_var"),
    "ppo-sequence_mean-tis-k1": dict(loss_aggregation="sequence_mean", off_policy_correction="tis",
                                     kl_coef=0.05, kl_estimator="k1"),
    "gspo-tis-low_var": dict(ratio_level="sequence", off_policy_correction="tis", kl_coef=0.1),
    "dr_grpo-tis-k3-entropy": dict(loss_aggregation="sequence_mean_token_sum_norm", loss_norm_length=8,
                                   off_policy_correction="tis", kl_coef=0.1, kl_estimator="k3",
                                   entropy_coef=0.01),
}
INF, NAN = float("inf"), float("nan")
# (lp, pi_old, rollout, ref, entropy) at mask-0 positions, alternating between the two given
POISON = {
    "100": ((-100.0, -100.0), (100.0, -100.0), (-100.0, 100.0), (100.0, -100.0), (100.0, 100.0)),
    "1000": ((-1000.0, -1000.0), (1000.0, -1000.0), (-1000.0, 1000.0), (1000.0, -1000.0), (1e4, 1e4)),
    "nan": ((NAN, NAN), (NAN, NAN), (NAN, NAN), (NAN, NAN), (NAN, NAN)),
    "inf": ((-INF, -INF), (-INF, INF), (INF, -INF), (-INF, INF), (INF, INF)),
}


def masked_batch(dtype=torch.float64, seed=0):
    """Four samples (the last fully masked), mask-0 spans inside and at the end of responses,
    negative advantages on the samples with mask-0 tokens; normal-range values everywhere."""
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 3, 6, 2]
    sid = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    mask = torch.tensor([1, 0, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0], dtype=torch.float32)
    n = sum(lengths)

    def t(x):
        return x.to(dtype)

    lp = t(-0.5 - 2.5 * torch.rand(n, generator=g))
    return dict(
        lp=lp, sid=sid, mask=mask, adv=t(torch.tensor([-1.0, 0.7, -0.4, -2.0])[sid]),
        old=t(lp + 0.3 * torch.randn(n, generator=g)), rollout=t(lp + 0.4 * torch.randn(n, generator=g)),
        ref=t(lp + 0.5 * torch.randn(n, generator=g)), entropy=t(2.0 * torch.rand(n, generator=g)),
    )


def run_loss(fn, b, cfg, **override):
    b = {**b, **override}
    lp = b["lp"].clone().requires_grad_(True)
    entropy = b["entropy"].clone().requires_grad_(True)
    terms = fn(PolicyLossInput(logprobs=lp, advantages=b["adv"], loss_mask=b["mask"], sample_ids=b["sid"],
                               num_samples=int(b["sid"].max()) + 1, old_logprobs=b["old"],
                               rollout_logprobs=b["rollout"], ref_logprobs=b["ref"], entropy=entropy), cfg)
    terms.numerator.backward()
    return terms, lp.grad, torch.zeros_like(entropy) if entropy.grad is None else entropy.grad


@pytest.mark.parametrize("poison", list(POISON))
@pytest.mark.parametrize("algo", list(MASK_CONFIGS.values()), ids=list(MASK_CONFIGS))
def test_mask0_values_reach_neither_the_loss_nor_its_gradient(algo, poison):
    cfg = AlgorithmConfig(**algo)
    b = masked_batch()
    base, g_lp, g_ent = run_loss(policy_loss, b, cfg)
    off = b["mask"] == 0
    alt = torch.arange(off.numel()) % 2 == 0
    wild = {}
    for name, (x, y) in zip(("lp", "old", "rollout", "ref", "entropy"), POISON[poison]):
        wild[name] = torch.where(off & alt, x, torch.where(off, y, b[name]))
    terms, w_lp, w_ent = run_loss(policy_loss, b, cfg, **wild)
    assert math.isfinite(terms.numerator.item()) and torch.isfinite(w_lp).all() and torch.isfinite(w_ent).all()
    assert torch.equal(terms.numerator, base.numerator)  # bit for bit
    assert terms.denominator == base.denominator
    assert torch.equal(w_lp, g_lp) and torch.equal(w_ent, g_ent)
    assert bool((w_lp[off] == 0).all()) and bool((w_ent[off] == 0).all())
    assert terms.metric_sums == base.metric_sums


def policy_loss_before_issue_23(inp: PolicyLossInput, cfg: AlgorithmConfig):
    """train/algorithms/losses.py's policy_loss as of d17a64b (unclamped token ratio, masks
    multiplied), kept to show that values at mask-1 positions are bitwise unchanged."""
    def per_sample_sum(values):
        return torch.zeros(inp.num_samples, dtype=values.dtype).index_add(0, inp.sample_ids, values)

    lp = inp.logprobs
    mask = inp.loss_mask.to(lp.dtype)
    old = lp.detach() if inp.old_logprobs is None else inp.old_logprobs.to(lp.dtype)
    tokens_per_sample = per_sample_sum(mask)
    if cfg.loss_aggregation == "token_mean":
        weight, denominator = mask, float(mask.sum())
    else:
        weight = mask / tokens_per_sample.clamp(min=1)[inp.sample_ids]
        denominator = float((tokens_per_sample > 0).sum())
    if cfg.ratio_level == "token":
        log_ratio = lp - old
    else:
        seq_log_ratio = per_sample_sum((lp.detach() - old) * mask) / tokens_per_sample.clamp(min=1)
        seq_log_ratio = seq_log_ratio.clamp(-20.0, 20.0)
        log_ratio = seq_log_ratio[inp.sample_ids] + lp - lp.detach()
    ratio = torch.exp(log_ratio)
    adv = inp.advantages.to(lp.dtype)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.maximum(unclipped, clipped)
    sums = {}
    if cfg.off_policy_correction.estimator == "tis":
        cap = cfg.off_policy_correction.high
        tis_raw = torch.exp(old - inp.rollout_logprobs.to(lp.dtype))
        tis = tis_raw.clamp(max=cap).detach()
        sums["is_weight"] = tis
        sums["is_truncated_frac"] = (tis_raw > cap).to(lp.dtype)
        sums["is_masked_frac"] = torch.zeros_like(tis)
        pg = pg * tis
    loss = pg
    sums["pg_loss"] = pg.detach()
    sums["clip_frac"] = (clipped > unclipped).to(lp.dtype)
    sums["ratio"] = ratio.detach()
    sums["approx_kl_old"] = (old - lp.detach())
    if cfg.kl_coef > 0:
        kl = kl_estimate(lp, inp.ref_logprobs.to(lp.dtype), cfg.kl_estimator)
        loss = loss + cfg.kl_coef * kl
        sums["kl"] = kl.detach()
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * inp.entropy
    if inp.entropy is not None:
        sums["entropy"] = inp.entropy.detach()
    if inp.rollout_logprobs is not None:
        sums["train_rollout_logprob_abs_diff"] = (old - inp.rollout_logprobs.to(lp.dtype)).abs()
    sums["loss"] = loss.detach()
    numerator = (weight * loss).sum()
    w = weight.detach()
    return LossTerms(numerator, denominator, {k: float((w * v).sum()) for k, v in sums.items()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "algo", [v for k, v in MASK_CONFIGS.items() if not k.startswith("dr_grpo")],
    ids=[k for k in MASK_CONFIGS if not k.startswith("dr_grpo")],
)
def test_values_at_mask1_positions_are_bitwise_unchanged(algo, dtype):
    # log-ratios within +-2 (the clamp at +-20 is not reached): every number the same, bit for bit
    cfg = AlgorithmConfig(**algo)
    for seed in range(3):
        b = masked_batch(dtype, seed)
        new, g_new, e_new = run_loss(policy_loss, b, cfg)
        old, g_old, e_old = run_loss(policy_loss_before_issue_23, b, cfg)
        assert torch.equal(new.numerator, old.numerator) and new.denominator == old.denominator
        assert torch.equal(g_new, g_old) and torch.equal(e_new, e_old)
        assert new.metric_sums == old.metric_sums


# -- Dr.GRPO's constant normaliser: loss_aggregation sequence_mean_token_sum_norm ---------------
def test_sequence_mean_token_sum_norm_needs_its_constant():
    from rlkit.config.schema import Recipe

    # a recipe defaults it to the generation limit, as TRL and verl do; an explicit one stays
    dr = {"train": {"algorithm": {"loss_aggregation": "sequence_mean_token_sum_norm"}},
          "rollout": {"sampling": {"max_new_tokens": 96}}}
    assert Recipe.model_validate(dr).train.algorithm.loss_norm_length == 96
    dr["train"]["algorithm"]["loss_norm_length"] = 50
    assert Recipe.model_validate(dr).train.algorithm.loss_norm_length == 50
    assert Recipe.model_validate({}).train.algorithm.loss_norm_length == 0  # others ignore it
    # a TrainConfig built alone has no generation limit: the loss names the field
    lone = AlgorithmConfig(loss_aggregation="sequence_mean_token_sum_norm")
    three = torch.zeros(3)
    with pytest.raises(ValueError, match="loss_norm_length, which is 0"):
        policy_loss(PolicyLossInput(logprobs=three, advantages=three + 1, loss_mask=three + 1,
                                    sample_ids=torch.zeros(3, dtype=torch.long), num_samples=1), lone)
    with pytest.raises(ValueError, match="ratio_level 'sequence' .*needs loss_aggregation 'sequence_mean'"):
        AlgorithmConfig(ratio_level="sequence", loss_aggregation="sequence_mean_token_sum_norm",
                        loss_norm_length=16)
    cfg = AlgorithmConfig(loss_aggregation="sequence_mean_token_sum_norm", loss_norm_length=16)
    assert AlgorithmConfig.model_validate(cfg.model_dump()) == cfg


def trl_dr_grpo_loss(per_token_loss, mask, max_completion_length):
    """TRL GRPOTrainer loss_type='dr_grpo' (one process, no accumulation), written out:
    sum of masked token losses / (rows x max_completion_length); rows padded to the longest."""
    return (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)


def verl_seq_mean_token_sum_norm(loss_mat, mask, loss_scale_factor):
    """verl agg_loss 'seq-mean-token-sum-norm' (one DP rank, the whole mini-batch), written out:
    mean over sequences of each sequence's token sum, / loss_scale_factor."""
    return (loss_mat * mask).sum(-1).mean() / loss_scale_factor


@pytest.mark.parametrize("constant", [7, 16])  # equal to / wider than the padded width (7)
def test_sequence_mean_token_sum_norm_matches_trl_dr_grpo_and_verl(constant):
    g = torch.Generator().manual_seed(3)
    lengths = [7, 2, 5, 4]
    width = max(lengths)
    lp0 = -0.3 - 2 * torch.rand(len(lengths), width, generator=g, dtype=torch.float64)
    old = lp0 + 0.2 * torch.randn(lp0.shape, generator=g, dtype=torch.float64)
    ref = lp0 + 0.3 * torch.randn(lp0.shape, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0], dtype=torch.float64)  # dr_grpo advantages: r - mean
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).double()
    mask[0, 3] = 0.0  # an observation inside a response
    beta = 0.04

    def per_token(lp):  # TRL's per-token loss: PPO-clip (DAPO clip-higher here) + beta * k3
        return ppo_token_terms(lp, old, adv[:, None]) + beta * (torch.exp(ref - lp) - (ref - lp) - 1)

    flat = mask.bool()
    cfg = AlgorithmConfig(advantage="dr_grpo", loss_aggregation="sequence_mean_token_sum_norm",
                          loss_norm_length=constant, kl_coef=beta, kl_estimator="k3")
    lp = lp0[flat].clone().requires_grad_(True)
    sid = torch.arange(len(lengths))[:, None].expand_as(mask)[flat]
    terms = policy_loss(PolicyLossInput(logprobs=lp, advantages=adv[sid], loss_mask=torch.ones_like(lp),
                                        sample_ids=sid, num_samples=len(lengths), old_logprobs=old[flat],
                                        ref_logprobs=ref[flat]), cfg)
    ours = terms.numerator / terms.denominator
    ours.backward()
    assert terms.denominator == len(lengths)

    for peer in (lambda x: trl_dr_grpo_loss(per_token(x), mask, constant),
                 lambda x: verl_seq_mean_token_sum_norm(per_token(x), mask, constant)):
        x = lp0.clone().requires_grad_(True)
        expected = peer(x)
        expected.backward()
        assert ours.item() == pytest.approx(expected.item(), rel=1e-12)
        assert torch.allclose(lp.grad, x.grad[flat], rtol=1e-12, atol=0)
        assert bool((x.grad[~flat] == 0).all())


def test_sequence_mean_token_sum_norm_metrics_are_means_and_the_loss_is_the_objective():
    # on-policy: ratio 1, loss -A per token; C = 10 > every length
    cfg = AlgorithmConfig(loss_aggregation="sequence_mean_token_sum_norm", loss_norm_length=10)
    sid = torch.tensor([0, 0, 0, 1, 1])
    terms = policy_loss(PolicyLossInput(logprobs=torch.full((5,), -1.0), advantages=torch.tensor([1.0] * 3 + [-2.0] * 2),
                                        loss_mask=torch.ones(5), sample_ids=sid, num_samples=2), cfg)
    assert terms.denominator == 2
    assert terms.metric_sums["ratio"] / terms.denominator == pytest.approx(1.0)  # a mean, not 5/10
    assert terms.metric_sums["loss"] == pytest.approx(terms.numerator.item())
    assert terms.numerator.item() == pytest.approx((-3.0 + 4.0) / 10)
