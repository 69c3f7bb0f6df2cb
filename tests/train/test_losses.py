"""Known-answer tests for every term of the policy loss (hand-computed small tensors)."""

import math

import pytest
import torch

from rlkit.train.algorithms.losses import LOW_VAR_KL_BOUND, PolicyLossInput, kl_estimate, policy_loss
from rlkit.train.config import AlgorithmConfig


def _inp(lp, adv, *, mask=None, sample_ids=None, old=None, **kw):
    lp = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    n = lp.numel()
    sample_ids = torch.tensor(sample_ids if sample_ids is not None else [0] * n)
    return PolicyLossInput(
        logprobs=lp,
        advantages=torch.tensor(adv, dtype=torch.float64),
        loss_mask=torch.tensor(mask if mask is not None else [1.0] * n, dtype=torch.float64),
        sample_ids=sample_ids,
        num_samples=int(sample_ids.max()) + 1,
        old_logprobs=None if old is None else torch.tensor(old, dtype=torch.float64),
        **kw,
    )


def _grad(inp, cfg):
    terms = policy_loss(inp, cfg)
    terms.numerator.backward()
    return terms, inp.logprobs.grad


def test_ppo_clip_positive_advantage():
    # ratios 1.5 and 0.9, A = +1, clip range [0.8, 1.28]
    inp = _inp([math.log(1.5), math.log(0.9)], [1.0, 1.0], old=[0.0, 0.0])
    terms, grad = _grad(inp, AlgorithmConfig(clip_low=0.2, clip_high=0.28))
    assert terms.numerator.item() == pytest.approx(-1.28 - 0.9)
    assert terms.denominator == 2
    # the clipped token has no gradient; the other -A * r
    assert torch.allclose(grad, torch.tensor([0.0, -0.9], dtype=torch.float64))
    assert terms.metric_sums["clip_frac"] == pytest.approx(1.0)
    assert terms.metric_sums["ratio"] == pytest.approx(2.4)


def test_ppo_clip_negative_advantage():
    # A = -1: ratio 0.5 is clipped up to 0.8 (no gradient), ratio 1.5 is not clipped
    inp = _inp([math.log(0.5), math.log(1.5)], [-1.0, -1.0], old=[0.0, 0.0])
    terms, grad = _grad(inp, AlgorithmConfig(clip_low=0.2, clip_high=0.28))
    assert terms.numerator.item() == pytest.approx(0.8 + 1.5)
    assert torch.allclose(grad, torch.tensor([0.0, 1.5], dtype=torch.float64))


def test_clip_higher_is_asymmetric():
    # ratio 1.25 with A=+1 is inside DAPO's clip_high=0.28 but outside a symmetric 0.2
    dapo, g_dapo = _grad(_inp([math.log(1.25)], [1.0], old=[0.0]), AlgorithmConfig(clip_low=0.2, clip_high=0.28))
    sym, g_sym = _grad(_inp([math.log(1.25)], [1.0], old=[0.0]), AlgorithmConfig(clip_low=0.2, clip_high=0.2))
    assert dapo.numerator.item() == pytest.approx(-1.25) and g_dapo.item() == pytest.approx(-1.25)
    assert sym.numerator.item() == pytest.approx(-1.2) and g_sym.item() == 0.0


def test_without_old_logprobs_the_ratio_is_one_and_the_gradient_is_minus_advantage():
    terms, grad = _grad(_inp([-2.0, -0.5], [0.5, -1.0]), AlgorithmConfig())
    assert terms.numerator.item() == pytest.approx(-0.5 + 1.0)
    assert torch.allclose(grad, torch.tensor([-0.5, 1.0], dtype=torch.float64))


def test_token_mean_and_sequence_mean_aggregation():
    # sample 0: two tokens with A=+1; sample 1: one token with A=-2; on-policy (ratio 1)
    kw = dict(sample_ids=[0, 0, 1])
    tok, g_tok = _grad(_inp([-1.0, -1.0, -1.0], [1.0, 1.0, -2.0], **kw), AlgorithmConfig(loss_aggregation="token_mean"))
    seq, g_seq = _grad(_inp([-1.0, -1.0, -1.0], [1.0, 1.0, -2.0], **kw), AlgorithmConfig(loss_aggregation="sequence_mean"))
    assert (tok.numerator.item(), tok.denominator) == (pytest.approx(0.0), 3)
    assert torch.allclose(g_tok, torch.tensor([-1.0, -1.0, 2.0], dtype=torch.float64))
    assert (seq.numerator.item(), seq.denominator) == (pytest.approx(1.0), 2)
    assert torch.allclose(g_seq, torch.tensor([-0.5, -0.5, 2.0], dtype=torch.float64))


def test_sequence_mean_token_sum_norm_aggregation():
    # Dr.GRPO: each sample's token sum / C, averaged over samples. Sample 0: two tokens with A=+1;
    # sample 1: one token with A=-2; sample 2: masked out (not in the denominator); C = 4
    kw = dict(sample_ids=[0, 0, 1, 2], mask=[1.0, 1.0, 1.0, 0.0])
    cfg = AlgorithmConfig(loss_aggregation="sequence_mean_token_sum_norm", loss_norm_length=4)
    terms, grad = _grad(_inp([-1.0] * 4, [1.0, 1.0, -2.0, 5.0], **kw), cfg)
    assert (terms.numerator.item(), terms.denominator) == (pytest.approx((-2.0 + 2.0) / 4), 2)
    assert torch.allclose(grad, torch.tensor([-0.25, -0.25, 0.5, 0.0], dtype=torch.float64))
    # the normaliser is the constant, not the length: one more token adds 1/C of its loss
    longer, _ = _grad(_inp([-1.0] * 5, [1.0, 1.0, 1.0, -2.0, 5.0], sample_ids=[0, 0, 0, 1, 2],
                           mask=[1.0, 1.0, 1.0, 1.0, 0.0]), cfg)
    assert longer.numerator.item() == pytest.approx((-3.0 + 2.0) / 4) and longer.denominator == 2


def test_loss_mask_excludes_tokens_and_fully_masked_samples_from_denominators():
    kw = dict(sample_ids=[0, 0, 1, 2], mask=[1.0, 0.0, 1.0, 0.0])
    adv = [1.0, 1.0, -2.0, 5.0]
    tok, g_tok = _grad(_inp([-1.0] * 4, adv, **kw), AlgorithmConfig(loss_aggregation="token_mean"))
    seq, _ = _grad(_inp([-1.0] * 4, adv, **kw), AlgorithmConfig(loss_aggregation="sequence_mean"))
    assert (tok.numerator.item(), tok.denominator) == (pytest.approx(1.0), 2)
    assert torch.allclose(g_tok, torch.tensor([-1.0, 0.0, 2.0, 0.0], dtype=torch.float64))
    assert (seq.numerator.item(), seq.denominator) == (pytest.approx(1.0), 2)  # sample 2 has no token


def test_gspo_sequence_ratio():
    # log-ratios 0.2 and 0.4: s = exp(0.3) = 1.3499 for both tokens; sequence_mean weights 1/2 each
    s = math.exp(0.3)
    cfg = AlgorithmConfig(ratio_level="sequence", clip_low=0.2, clip_high=0.28)
    assert cfg.loss_aggregation == "sequence_mean"  # GSPO's aggregation, taken when unset
    pos, g_pos = _grad(_inp([0.2, 0.4], [1.0, 1.0], old=[0.0, 0.0]), cfg)
    assert pos.numerator.item() == pytest.approx(-1.28)  # clipped above
    assert pos.denominator == 1
    assert torch.equal(g_pos, torch.zeros(2, dtype=torch.float64))
    assert pos.metric_sums["ratio"] == pytest.approx(s)
    neg, g_neg = _grad(_inp([0.2, 0.4], [-1.0, -1.0], old=[0.0, 0.0]), cfg)
    assert neg.numerator.item() == pytest.approx(s)
    # d/d lp_t of -A * sg(s) * exp(lp_t - sg(lp_t)) / n = -A * s / n: GSPO's s * mean_t grad lp_t
    assert torch.allclose(g_neg, torch.full((2,), s / 2, dtype=torch.float64))


def test_gspo_equals_token_ratio_for_single_token_sequences():
    lp, adv, old = [0.1, -0.3, 0.5], [1.0, -1.0, 0.5], [0.0, 0.0, 0.0]
    a, ga = _grad(_inp(lp, adv, old=old, sample_ids=[0, 1, 2]), AlgorithmConfig(ratio_level="token"))
    b, gb = _grad(_inp(lp, adv, old=old, sample_ids=[0, 1, 2]), AlgorithmConfig(ratio_level="sequence"))
    assert a.numerator.item() == pytest.approx(b.numerator.item())
    assert torch.allclose(ga, gb)


def test_kl_estimators_known_values():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])  # log ratio 0.5
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(0.5)
    k3 = math.exp(-0.5) - 1 + 0.5
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(k3)
    assert kl_estimate(lp, ref, "low_var").item() == pytest.approx(k3)
    far = kl_estimate(torch.tensor([-21.0]), torch.tensor([-1.0]), "k3").item()
    assert far == pytest.approx(math.exp(20) - 21, rel=1e-6)
    assert kl_estimate(torch.tensor([-21.0]), torch.tensor([-1.0]), "low_var").item() == LOW_VAR_KL_BOUND


def test_kl_penalty_in_the_loss():
    cfg = AlgorithmConfig(kl_coef=0.1, kl_estimator="k3")
    terms, grad = _grad(_inp([-1.0], [0.0], ref_logprobs=torch.tensor([-1.5], dtype=torch.float64)), cfg)
    k3 = math.exp(-0.5) - 0.5
    assert terms.numerator.item() == pytest.approx(0.1 * k3)
    assert grad.item() == pytest.approx(0.1 * (1 - math.exp(-0.5)))  # d k3 / d lp = 1 - exp(ref - lp)
    assert terms.metric_sums["kl"] == pytest.approx(k3)
    with pytest.raises(ValueError, match="reference logprobs"):
        policy_loss(_inp([-1.0], [0.0]), cfg)


def test_entropy_bonus_lowers_the_loss_by_coef_times_entropy():
    entropy = torch.tensor([2.0, 1.0], dtype=torch.float64, requires_grad=True)
    cfg = AlgorithmConfig(entropy_coef=0.01)
    terms = policy_loss(_inp([-1.0, -1.0], [0.0, 0.0], entropy=entropy), cfg)
    terms.numerator.backward()
    assert terms.numerator.item() == pytest.approx(-0.01 * 3.0)
    assert torch.allclose(entropy.grad, torch.full((2,), -0.01, dtype=torch.float64))
    assert terms.metric_sums["entropy"] == pytest.approx(3.0)


def test_truncated_importance_sampling():
    # pi_old / pi_rollout = exp(0.5) = 1.6487 (truncated to 1.5) and exp(-0.8) = 0.4493
    cfg = AlgorithmConfig(off_policy_correction={"estimator": "tis", "high": 1.5})
    inp = _inp([-1.0, -1.0], [1.0, 1.0], old=[-1.0, -1.0], rollout_logprobs=torch.tensor([-1.5, -0.2], dtype=torch.float64))
    terms, grad = _grad(inp, cfg)
    w = [1.5, math.exp(-0.8)]
    assert terms.numerator.item() == pytest.approx(-(w[0] + w[1]))
    assert torch.allclose(grad, -torch.tensor(w, dtype=torch.float64))  # weights carry no gradient
    assert terms.metric_sums["is_weight"] == pytest.approx(sum(w))
    assert terms.metric_sums["is_truncated_frac"] == pytest.approx(1.0)
    assert terms.metric_sums["train_rollout_logprob_abs_diff"] == pytest.approx(0.5 + 0.8)
    # 'none' ignores the rollout logprobs
    plain, _ = _grad(_inp([-1.0, -1.0], [1.0, 1.0], old=[-1.0, -1.0]), AlgorithmConfig(off_policy_correction="none"))
    assert plain.numerator.item() == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="rollout logprobs"):
        policy_loss(_inp([-1.0], [1.0]), cfg)
    # without TIS a token the engine sent no logprob for (NaN) leaves the diagnostic finite
    nan = torch.tensor([-1.5, float("nan")], dtype=torch.float64)
    terms = policy_loss(_inp([-1.0, -1.0], [1.0, 1.0], old=[-1.0, -1.0], rollout_logprobs=nan),
                        AlgorithmConfig(off_policy_correction="none"))
    assert terms.metric_sums["train_rollout_logprob_abs_diff"] == pytest.approx(0.5)
    assert terms.numerator.item() == pytest.approx(-2.0)


@pytest.mark.parametrize(
    "ratio_level, aggregation",
    [("token", "token_mean"), ("token", "sequence_mean"), ("token", "sequence_mean_token_sum_norm"),
     ("sequence", "sequence_mean")],
)  # sequence + another aggregation is refused by AlgorithmConfig (tests/train/test_loss_math.py)
def test_any_partition_into_micro_batches_gives_the_same_normalised_gradient(aggregation, ratio_level):
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 4, 2, 5]
    n = sum(lengths)
    lp = -torch.rand(n, generator=g, dtype=torch.float64)
    old = lp + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    rollout = old + 0.05 * torch.randn(n, generator=g, dtype=torch.float64)
    ref = old - 0.2
    mask = (torch.rand(n, generator=g) > 0.2).double()
    adv_per_sample = torch.randn(len(lengths), generator=g, dtype=torch.float64)
    sid = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    cfg = AlgorithmConfig(
        ratio_level=ratio_level, loss_aggregation=aggregation, kl_coef=0.05, off_policy_correction="tis",
        loss_norm_length=8,  # used by sequence_mean_token_sum_norm only
    )
    offsets = [0]
    for L in lengths:
        offsets.append(offsets[-1] + L)

    def run(partition):
        x = lp.clone().requires_grad_(True)
        num, den = 0.0, 0.0
        for samples in partition:
            idx = torch.cat([torch.arange(offsets[s], offsets[s + 1]) for s in samples])
            local = torch.repeat_interleave(torch.arange(len(samples)), torch.tensor([lengths[s] for s in samples]))
            t = policy_loss(
                PolicyLossInput(
                    logprobs=x[idx], advantages=adv_per_sample[samples][local], loss_mask=mask[idx],
                    sample_ids=local, num_samples=len(samples), old_logprobs=old[idx],
                    rollout_logprobs=rollout[idx], ref_logprobs=ref[idx],
                ),
                cfg,
            )
            t.numerator.backward()
            num, den = num + t.numerator.item(), den + t.denominator
        return num / den, x.grad / den

    whole_loss, whole_grad = run([[0, 1, 2, 3, 4]])
    for partition in ([[4], [0, 2], [3, 1]], [[1], [2], [0], [4], [3]]):
        loss, grad = run(partition)
        assert loss == pytest.approx(whole_loss, rel=1e-12)
        assert torch.allclose(grad, whole_grad, rtol=1e-12, atol=1e-15)


def test_the_sft_loss_is_the_responses_mean_negative_log_likelihood():
    """train.algorithm.loss sft: numerator / denominator is the mean NLL of the trainable tokens
    (torch's cross-entropy with ignored positions), and so is its gradient; a NaN at a masked
    position reaches neither (selection, not multiplication)."""
    from rlkit.train.algorithms.losses import loss_terms

    torch.manual_seed(0)
    logits = torch.randn(7, 11, requires_grad=True)
    targets = torch.randint(0, 11, (7,))
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0], dtype=torch.float32)
    lp = logits.log_softmax(-1).gather(1, targets[:, None])[:, 0]
    lp = torch.where(mask > 0, lp, torch.full_like(lp, float("nan")))
    terms = loss_terms(PolicyLossInput(logprobs=lp, advantages=torch.zeros(7), loss_mask=mask,
                                       sample_ids=torch.tensor([0, 0, 0, 1, 1, 1, 1]), num_samples=2),
                       AlgorithmConfig(loss="sft"))
    (terms.numerator / terms.denominator).backward()
    ours = logits.grad.clone()
    logits.grad = None
    ref = torch.nn.functional.cross_entropy(logits, torch.where(mask > 0, targets, -100))
    ref.backward()
    assert terms.denominator == 5
    assert terms.metric_sums["loss"] / terms.denominator == pytest.approx(float(ref), rel=1e-6)
    assert torch.allclose(ours, logits.grad, atol=1e-7) and not ours.isnan().any()


# -- on-policy distillation: A_t = reward_weight x A - distill_coef x (old_t - teacher_t) ------
def _distill_batch(seed: int = 0):
    """Three samples (lengths 3, 1, 4), the last token of sample 0 and two of sample 2 masked;
    log-ratios up to +-0.6, so some tokens are clipped either way."""
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 1, 4]
    n = sum(lengths)
    lp = -0.5 - torch.rand(n, generator=g, dtype=torch.float64)
    old = lp + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    teacher = old + torch.randn(n, generator=g, dtype=torch.float64)
    sid = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    adv = torch.tensor([0.7, -1.2, 0.4], dtype=torch.float64)[sid]
    mask = torch.tensor([1, 1, 0, 1, 1, 0, 1, 0], dtype=torch.float64)
    return dict(lp=lp, old=old, teacher=teacher, sid=sid, adv=adv, mask=mask)


def _run_distill(b, cfg, *, old="given", teacher=None):
    lp = b["lp"].clone().requires_grad_(True)
    teacher = b["teacher"] if teacher is None else teacher
    terms = policy_loss(PolicyLossInput(
        logprobs=lp, advantages=b["adv"], loss_mask=b["mask"], sample_ids=b["sid"],
        num_samples=int(b["sid"].max()) + 1, old_logprobs=b["old"] if old == "given" else None,
        teacher_logprobs=teacher), cfg)
    terms.numerator.backward()
    return terms, lp.grad


def _slime_reference(b, *, distill_coef, reward_weight, aggregation, clip_low, clip_high, old=None):
    """slime's --opd-kl-coef, written out: A_t = w_r A - lambda (old_t - teacher_t), a constant;
    PPO-clip on the token ratio; the aggregation as a plain loop over samples."""
    lp = b["lp"].clone().requires_grad_(True)
    old = b["old"] if old is None else old
    keep = b["mask"] > 0
    total = torch.zeros((), dtype=torch.float64)
    samples = int(b["sid"].max()) + 1
    for i in range(samples):
        idx = [t for t in range(lp.numel()) if int(b["sid"][t]) == i and keep[t]]
        terms = []
        for t in idx:
            a_hat = reward_weight * float(b["adv"][t]) - distill_coef * (float(old[t]) - float(b["teacher"][t]))
            r = torch.exp(lp[t] - float(old[t]))
            terms.append(torch.maximum(-a_hat * r, -a_hat * r.clamp(1 - clip_low, 1 + clip_high)))
        if not terms:
            continue
        s = torch.stack(terms).sum()
        total = total + (s / len(terms) if aggregation == "sequence_mean" else s)
    denominator = float(keep.sum()) if aggregation == "token_mean" else float(
        sum(1 for i in range(samples) if any(int(b["sid"][t]) == i and keep[t] for t in range(lp.numel()))))
    total.backward()
    return total, denominator, lp.grad


def test_a_teacher_equal_to_pi_old_gives_exactly_the_reward_only_loss_and_gradient():
    b = _distill_batch()
    for old, teacher in (("given", b["old"]), (None, b["lp"])):  # pi_old attached, or the current lp
        for aggregation in ("token_mean", "sequence_mean"):
            plain, g_plain = _run_distill(b, AlgorithmConfig(loss_aggregation=aggregation), old=old)
            cfg = AlgorithmConfig(loss_aggregation=aggregation, distill_coef=0.7)
            ours, g_ours = _run_distill(b, cfg, old=old, teacher=teacher.clone())
            assert torch.equal(ours.numerator, plain.numerator) and ours.denominator == plain.denominator
            assert torch.equal(g_ours, g_plain)
            assert {k: v for k, v in ours.metric_sums.items() if not k.startswith("distill_")} == plain.metric_sums
            assert ours.metric_sums["distill_reverse_kl"] == 0.0
            assert ours.metric_sums["distill_advantage"] == 0.0


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
@pytest.mark.parametrize("reward_weight", [0.0, 0.5, 1.0])
def test_distillation_matches_slimes_formula(aggregation, reward_weight):
    clip = dict(clip_low=0.2, clip_high=0.28)
    cfg = AlgorithmConfig(loss_aggregation=aggregation, distill_coef=0.3, reward_weight=reward_weight, **clip)
    for seed in range(3):
        b = _distill_batch(seed)
        terms, grad = _run_distill(b, cfg)
        ref, denominator, ref_grad = _slime_reference(b, distill_coef=0.3, reward_weight=reward_weight,
                                                      aggregation=aggregation, **clip)
        assert terms.numerator.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-15)
        assert terms.denominator == denominator
        assert torch.allclose(grad, ref_grad, rtol=1e-12, atol=1e-15)
        assert bool((grad[b["mask"] == 0] == 0).all())
        # the diagnostics: the reverse KL and the distillation term, weighted like the loss
        keep = b["mask"] > 0
        w = b["mask"] if aggregation == "token_mean" else b["mask"] / torch.tensor(
            [float(keep[b["sid"] == int(i)].sum()) for i in b["sid"]], dtype=torch.float64)
        rkl = torch.where(keep, b["old"] - b["teacher"], 0.0)
        assert terms.metric_sums["distill_reverse_kl"] == pytest.approx(float((w * rkl).sum()), rel=1e-12)
        assert terms.metric_sums["distill_advantage"] == pytest.approx(float(-0.3 * (w * rkl).sum()), rel=1e-12)


def test_the_distillation_term_carries_no_gradient():
    # without pi_old the ratio is 1 and old is lp, detached: d/d lp of -A_t is -A_t, never the
    # distillation term's own derivative (+distill_coef); the teacher gets no gradient either
    b = _distill_batch()
    teacher = b["teacher"].clone().requires_grad_(True)
    cfg = AlgorithmConfig(distill_coef=0.5, reward_weight=0.0)
    terms, grad = _run_distill(b, cfg, old=None, teacher=teacher)
    a_hat = -0.5 * (b["lp"] - b["teacher"])
    assert torch.allclose(grad, torch.where(b["mask"] > 0, -a_hat, 0.0), rtol=1e-14, atol=0)
    assert teacher.grad is None
    ref, _, ref_grad = _slime_reference(b, distill_coef=0.5, reward_weight=0.0, aggregation="token_mean",
                                        clip_low=0.2, clip_high=0.28, old=b["lp"])
    assert terms.numerator.item() == pytest.approx(ref.item(), rel=1e-12)
    assert torch.allclose(grad, ref_grad, rtol=1e-12)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_mask0_teacher_logprobs_reach_neither_the_loss_its_gradient_nor_the_metrics(aggregation):
    b = _distill_batch()
    cfg = AlgorithmConfig(loss_aggregation=aggregation, distill_coef=0.3, reward_weight=0.5)
    base, g_base = _run_distill(b, cfg)
    off = b["mask"] == 0
    for wild in (float("nan"), float("inf"), float("-inf")):
        teacher = torch.where(off, wild, b["teacher"])
        terms, grad = _run_distill(b, cfg, teacher=teacher)
        assert math.isfinite(terms.numerator.item()) and torch.isfinite(grad).all()
        assert torch.equal(terms.numerator, base.numerator) and terms.denominator == base.denominator
        assert torch.equal(grad, g_base)
        assert terms.metric_sums == base.metric_sums


def test_distillation_needs_the_teacher_logprobs():
    b = _distill_batch()
    lp = b["lp"].clone().requires_grad_(True)
    inp = PolicyLossInput(logprobs=lp, advantages=b["adv"], loss_mask=b["mask"], sample_ids=b["sid"],
                          num_samples=3)
    with pytest.raises(ValueError, match="distill_coef > 0 needs the teacher's logprob.*frozen_engines"):
        policy_loss(inp, AlgorithmConfig(distill_coef=0.1))
    # off: teacher logprobs, if any, are not read and no distill_* metric appears
    terms = policy_loss(inp, AlgorithmConfig())
    assert not [k for k in terms.metric_sums if k.startswith("distill_")]


def test_distillation_config_is_validated():
    assert (AlgorithmConfig().distill_coef, AlgorithmConfig().reward_weight) == (0.0, 1.0)
    AlgorithmConfig(distill_coef=0.5, reward_weight=0.0)  # distillation alone
    AlgorithmConfig(distill_coef=1.0)  # slime's: the reward's advantage plus the distillation term
    with pytest.raises(ValueError, match="loss 'sft'.*distill_coef"):
        AlgorithmConfig(loss="sft", distill_coef=0.1)
    with pytest.raises(ValueError, match="reward_weight 0.5 with distill_coef 0.*rescale.*lr"):
        AlgorithmConfig(reward_weight=0.5)
    with pytest.raises(ValueError, match="reward_weight 0.0 with distill_coef 0"):
        AlgorithmConfig(reward_weight=0.0)
    for bad in ({"distill_coef": -0.1}, {"distill_coef": 1.0, "reward_weight": -1.0}):
        with pytest.raises(ValueError, match="greater than or equal to 0"):
            AlgorithmConfig(**bad)
