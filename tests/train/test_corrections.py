"""The off-policy correction suite (train/algorithms/corrections.py) and its place in the loss:
every estimator at every level against a hand-written reference and against the peers' own
formulas, at extreme log-ratios, on all-masked and one-token samples, in bf16; rejection."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlkit.train.algorithms.corrections import correction_weights
from rlkit.train.algorithms.losses import PolicyLossInput, policy_loss
from rlkit.train.config import AlgorithmConfig, OffPolicyCorrection

B = 20.0
ESTIMATORS = ("tis", "mis", "icepop", "none")
LEVELS = ("token", "sequence", "geometric")


def reference_weights(old, rollout, mask, sample_ids, n, cfg):
    """Plain Python, float64, token by token: what the docstring of corrections.py says."""
    lo = math.log(cfg.low) if cfg.low > 0 else -math.inf
    hi = math.log(cfg.high)
    raw = [float(o - r) if m else 0.0 for o, r, m in zip(old, rollout, mask)]

    def level(name):
        if name == "token":
            return raw
        sums = [0.0] * n
        counts = [0] * n
        for x, m, i in zip(raw, mask, sample_ids):
            if m:
                sums[i] += x
                counts[i] += 1
        if name == "geometric":
            sums = [s / max(c, 1) for s, c in zip(sums, counts)]
        return [sums[i] if m else 0.0 for m, i in zip(mask, sample_ids)]

    def exp(x):
        return math.exp(min(max(x, -B), B))

    out = []
    lr = level(cfg.level)
    for x, m in zip(lr, mask):
        if not m:
            out.append(0.0)
        elif cfg.estimator == "tis":
            out.append(exp(min(max(x, lo), hi)))
        elif cfg.estimator in ("mis", "icepop"):
            out.append(exp(x) if lo <= x <= hi else 0.0)
        else:
            out.append(1.0)
    if cfg.reject != "none":
        rl = level(cfg.reject)
        rlo, rhi = math.log(cfg.reject_low) if cfg.reject_low > 0 else -math.inf, math.log(cfg.reject_high)
        out = [0.0 if m and not (rlo <= x <= rhi) else w for w, x, m in zip(out, rl, mask)]
    return out


def _case(data):
    n = data.draw(st.integers(1, 4))
    lengths = [data.draw(st.integers(1, 5)) for _ in range(n)]
    ids = [i for i, k in enumerate(lengths) for _ in range(k)]
    t = len(ids)
    log_ratio = st.one_of(st.floats(-3, 3), st.sampled_from([-1000.0, 1000.0, 0.0, 25.0, -25.0]))
    old = [data.draw(st.floats(-8, 0)) for _ in range(t)]
    rollout = [o - data.draw(log_ratio) for o in old]
    mask = [data.draw(st.booleans()) for _ in range(t)]
    return n, ids, old, rollout, mask


@settings(max_examples=60, deadline=None)
@given(data=st.data(), estimator=st.sampled_from(ESTIMATORS), level=st.sampled_from(LEVELS),
       reject=st.sampled_from(["none", "sequence", "geometric"]))
def test_weights_match_the_reference_at_any_log_ratio(data, estimator, level, reject):
    if estimator == "icepop" and level != "token":
        level = "token"
    cfg = OffPolicyCorrection(estimator=estimator, level=level, reject=reject,
                              reject_low=0.3, reject_high=3.0)
    n, ids, old, rollout, mask = _case(data)
    w = correction_weights(torch.tensor(old, dtype=torch.float64), torch.tensor(rollout, dtype=torch.float64),
                           torch.tensor(mask), torch.tensor(ids), n, cfg)
    expected = reference_weights(old, rollout, mask, ids, n, cfg)
    assert torch.isfinite(w.weight).all()
    assert torch.allclose(w.weight, torch.tensor(expected, dtype=torch.float64), rtol=1e-9, atol=0)
    assert not w.weight[~torch.tensor(mask)].any()  # mask-0 tokens weigh nothing
    rejected_samples = {i for i, r in zip(ids, w.rejected.tolist()) if r}
    assert w.rejected_samples == len(rejected_samples)


def test_known_values_for_one_sample_of_three_tokens():
    # log rho = 0.5, -0.8, 1.2 (sum 0.9, mean 0.3)
    old = torch.tensor([-1.0, -1.0, -1.0])
    rollout = torch.tensor([-1.5, -0.2, -2.2])
    keep, ids = torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.long)

    def w(**kw):
        return correction_weights(old, rollout, keep, ids, 1, OffPolicyCorrection(**kw))

    e = math.exp
    assert w(estimator="tis").weight.tolist() == pytest.approx([e(0.5), e(-0.8), 2.0])
    assert w(estimator="tis").truncated.tolist() == [False, False, True]
    # exp(-0.8) = 0.45 is below both masks' lower edge, exp(1.2) = 3.3 inside IcePop's only
    assert w(estimator="mis").weight.tolist() == pytest.approx([e(0.5), 0.0, 0.0])  # [0.5, 2]
    assert w(estimator="mis").masked.tolist() == [False, True, True]
    assert w(estimator="mis", low=0.4).weight.tolist() == pytest.approx([e(0.5), e(-0.8), 0.0])
    assert w(estimator="icepop").weight.tolist() == pytest.approx([e(0.5), 0.0, e(1.2)])  # [0.5, 5]
    assert w(estimator="tis", level="sequence").weight.tolist() == [2.0] * 3  # exp(0.9) = 2.46, cut
    assert w(estimator="tis", level="sequence", high=3).weight.tolist() == pytest.approx([e(0.9)] * 3, rel=1e-6)
    assert w(estimator="tis", level="geometric").weight.tolist() == pytest.approx([e(0.3)] * 3, rel=1e-6)
    assert w(estimator="mis", level="sequence", high=2.0).weight.tolist() == [0.0] * 3  # 2.46 > 2
    assert w(estimator="mis", level="sequence", high=2.5).weight.tolist() == pytest.approx([e(0.9)] * 3, rel=1e-6)
    rejected = w(estimator="tis", reject="sequence")  # exp(0.9) = 2.46 > 2
    assert rejected.weight.tolist() == [0.0] * 3 and rejected.rejected_samples == 1
    kept = w(estimator="tis", reject="geometric", reject_low=0.5, reject_high=2.0)  # exp(0.3) = 1.35
    assert kept.rejected_samples == 0 and kept.weight.tolist() == pytest.approx([e(0.5), e(-0.8), 2.0])


# -- the peers' formulas, transcribed from their code (docs/training.md cites each) -------
def trl_mask(old, rollout, mask, lo, hi, sequence):
    """TRL grpo_trainer.py, vllm_importance_sampling_mode token_mask / sequence_mask: the ratio
    (exp of the token's, or of the masked sum of, log-differences) masked_fill'ed to 0 outside."""
    diff = (old - rollout) * mask
    ratio = torch.exp(diff.sum(-1, keepdim=True)) if sequence else torch.exp(diff)
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0).expand_as(old)


def verl_tis(old, rollout, mask, cap, sequence):
    """verl rollout_corr_helper.py compute_rollout_correction_weights: min(exp(clamp(log_ratio,
    -20, 20)), threshold), token or sequence (masked sum) level."""
    lr = (old - rollout) * mask
    if sequence:
        lr = lr.sum(-1, keepdim=True)
    return torch.exp(lr.clamp(-20, 20)).clamp(max=cap).expand_as(old)


def slime_geometric_mask(old, rollout, mask, lo, hi):
    """slime examples/train_infer_mismatch_helper/mis.py, level geometric: exp(clamp(masked
    mean log-ratio, +-20)), kept inside [lo, hi] (the weight rho, the token masked outside)."""
    lr = ((old - rollout) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
    w = torch.exp(lr.clamp(-20, 20))
    return torch.where((w >= lo) & (w <= hi), w, 0.0).expand_as(old)


def slime_icepop(old, rollout, lo, hi):
    """slime backends/megatron_utils/loss.py icepop_function; OpenRLHF loss.py PolicyLoss,
    is_correction_type icepop: rho where lo <= rho <= hi, else 0."""
    rho = torch.exp(old - rollout)
    return torch.where((rho >= lo) & (rho <= hi), rho, 0.0)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_weights_equal_the_peers_formulas(seed):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(1, 6, generator=g, dtype=torch.float64) * 4
    rollout = old - torch.randn(1, 6, generator=g, dtype=torch.float64) * 0.6
    mask = torch.ones(1, 6, dtype=torch.float64)
    keep, ids = torch.ones(6, dtype=torch.bool), torch.zeros(6, dtype=torch.long)

    def ours(**kw):
        return correction_weights(old[0], rollout[0], keep, ids, 1, OffPolicyCorrection(**kw)).weight

    for sequence, level in ((False, "token"), (True, "sequence")):
        assert torch.allclose(ours(estimator="mis", level=level, low=0.5, high=2.0),
                              trl_mask(old, rollout, mask, 0.5, 2.0, sequence)[0])
        assert torch.allclose(ours(estimator="tis", level=level, high=2.0),
                              verl_tis(old, rollout, mask, 2.0, sequence)[0])
    assert torch.allclose(ours(estimator="mis", level="geometric", low=0.8, high=1.25),
                          slime_geometric_mask(old, rollout, mask, 0.8, 1.25)[0])
    assert torch.allclose(ours(estimator="icepop"), slime_icepop(old, rollout, 0.5, 5.0)[0])


# -- in the loss: gradients, masks, dtypes, rejection --------------------------------------
def _inp(lp, adv, rollout, mask=None, ids=None, n=1):
    lp = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    t = lp.numel()
    return PolicyLossInput(
        logprobs=lp, advantages=torch.tensor(adv, dtype=torch.float64),
        loss_mask=torch.ones(t) if mask is None else torch.tensor(mask, dtype=torch.float32),
        sample_ids=torch.zeros(t, dtype=torch.long) if ids is None else torch.tensor(ids),
        num_samples=n, rollout_logprobs=torch.tensor(rollout, dtype=torch.float64),
        token_lag=torch.zeros(t, dtype=torch.long), resumed=torch.zeros(t, dtype=torch.bool))


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("level", LEVELS)
def test_the_gradient_is_the_weighted_policy_gradient(estimator, level):
    # pi_old = the current logprobs (one step per batch): ratio 1, d loss / d lp_t = -A_t w_t / T
    if estimator == "icepop" and level != "token":
        pytest.skip("icepop is token level")
    lp, adv = [-1.0, -2.0, -0.5, -1.5], [1.0, 1.0, -1.0, -1.0]
    rollout = [-1.4, -2.1, -0.5, -0.2]
    ids = [0, 0, 1, 1]
    corr = OffPolicyCorrection(estimator=estimator, level=level)
    cfg = AlgorithmConfig(off_policy_correction=corr)
    inp = _inp(lp, adv, rollout, ids=ids, n=2)
    terms = policy_loss(inp, cfg)
    terms.numerator.backward()
    w = reference_weights(lp, rollout, [1] * 4, ids, 2, corr)
    assert torch.allclose(inp.logprobs.grad, torch.tensor([-a * x for a, x in zip(adv, w)], dtype=torch.float64))
    assert terms.denominator == 4  # no correction changes the normaliser


def test_extreme_log_ratios_stay_finite_in_the_loss_and_gradient():
    for corr in ({"estimator": "tis", "level": "sequence"}, {"estimator": "icepop"},
                 {"estimator": "mis", "level": "geometric"}, {"estimator": "none", "reject": "sequence"}):
        inp = _inp([-1.0, -1.0, -1.0], [1.0, -1.0, 1.0], [999.0, -1001.0, -1.0])
        terms = policy_loss(inp, AlgorithmConfig(off_policy_correction=corr))
        terms.numerator.backward()
        assert math.isfinite(terms.numerator.item()) and torch.isfinite(inp.logprobs.grad).all(), corr
        assert all(math.isfinite(v) for v in terms.metric_sums.values()), corr
        assert torch.isfinite(terms.telemetry).all()


def test_all_masked_and_one_token_samples():
    # sample 0 has no trainable token, sample 1 one: the geometric mean of sample 1 is its token's
    corr = OffPolicyCorrection(estimator="tis", level="geometric", reject="sequence")
    inp = _inp([-1.0, -1.0, -2.0], [1.0, 1.0, 1.0], [float("nan"), -1.0, -2.3],
               mask=[0, 0, 1], ids=[0, 0, 1], n=2)
    terms = policy_loss(inp, AlgorithmConfig(off_policy_correction=corr))
    terms.numerator.backward()
    assert inp.logprobs.grad.tolist() == pytest.approx([0.0, 0.0, -math.exp(0.3)])
    assert terms.rejected_samples == 0 and terms.denominator == 1


def test_bf16_weights_follow_fp32():
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(64, generator=g) * 3
    rollout = old - torch.randn(64, generator=g) * 0.3
    ids = torch.arange(64) // 16
    keep = torch.ones(64, dtype=torch.bool)
    for level in LEVELS:
        cfg = OffPolicyCorrection(estimator="tis", level=level, high=10.0)
        w32 = correction_weights(old, rollout, keep, ids, 4, cfg).weight
        w16 = correction_weights(old.bfloat16(), rollout.bfloat16(), keep, ids, 4, cfg).weight
        # the inputs' own bf16 rounding (~0.4% of |logprob| <= 3) bounds the difference
        assert torch.allclose(w16.float(), w32, rtol=0.1), level
        assert w16.dtype == torch.float32  # computed in float32 whatever the input


def test_a_rejected_sample_changes_no_gradient_and_is_counted():
    # two samples; sample 1's sequence ratio is exp(3) > 2: rejected
    lp, adv = [-1.0, -1.0, -1.0, -1.0], [1.0, 1.0, -1.0, -1.0]
    ids = [0, 0, 1, 1]
    rollout = [-1.1, -0.95, -2.5, -2.5]
    corr = {"estimator": "tis", "reject": "sequence"}
    with_reject = _inp(lp, adv, rollout, ids=ids, n=2)
    terms = policy_loss(with_reject, AlgorithmConfig(off_policy_correction=corr))
    terms.numerator.backward()
    assert terms.rejected_samples == 1
    assert with_reject.logprobs.grad[2:].tolist() == [0.0, 0.0]
    # sample 0's gradient is what it is without sample 1 at all, over the same denominator
    alone = _inp(lp[:2], adv[:2], rollout[:2])
    alone_terms = policy_loss(alone, AlgorithmConfig(off_policy_correction="tis"))
    alone_terms.numerator.backward()
    assert torch.allclose(with_reject.logprobs.grad[:2], alone.logprobs.grad)
    assert terms.denominator == 4  # the rejected sample's tokens stay in the normaliser
    assert terms.metric_sums["is_rejected_frac"] == pytest.approx(2.0)  # tokens, weighted like the loss
    # the telemetry's rejected share: 2 of 4 tokens, all at lag 0 and fresh
    from rlkit.train.algorithms.mismatch import metrics
    m = metrics(terms.telemetry)
    assert m["mismatch/lag0/rejected"] == 0.5 and m["mismatch/fresh/tokens"] == 4


def test_config_defaults_and_refusals():
    assert OffPolicyCorrection(estimator="tis").low == 0 and OffPolicyCorrection(estimator="tis").high == 2
    assert OffPolicyCorrection(estimator="mis", high=4).low == 0.25
    ice = OffPolicyCorrection.model_validate("icepop")
    assert (ice.estimator, ice.low, ice.high) == ("icepop", 0.5, 5.0)
    geo = OffPolicyCorrection(estimator="none", reject="geometric")
    assert (geo.reject_low, geo.reject_high) == (0.999, 1.001)
    with pytest.raises(ValueError, match="icepop' is token level"):
        OffPolicyCorrection(estimator="icepop", level="sequence")
    with pytest.raises(ValueError, match="low .* must be below high"):
        OffPolicyCorrection(estimator="mis", low=3, high=2)
    with pytest.raises(ValueError, match="tis_cap is now train.algorithm.off_policy_correction.high"):
        AlgorithmConfig(tis_cap=1.5)
