"""The policy loss: PPO-clip (asymmetric, DAPO clip-higher) or GSPO's sequence ratio, truncated
importance sampling against the rollout logprobs, KL to a reference, entropy bonus, and token- or
sequence-mean aggregation.

Normalisation is split in two so that any partition of a global batch into micro-batches, in any
order, gives the same gradient: `policy_loss` returns a *numerator* (a sum over the micro-batch's
tokens, each weighted by its aggregation weight) and the micro-batch's share of the
*denominator*. The trainer backpropagates numerators as they come, sums denominators, and divides
the summed gradient by the global denominator once, at the optimizer step.

Per token t of sample i (mask m_t, n_i = trainable tokens of sample i):
  ratio       token:    r_t = exp(lp_t - old_t)
              sequence: r_t = sg(s_i) * exp(lp_t - sg(lp_t)),
                        s_i = exp(clamp(sum_t m_t (lp_t - old_t) / n_i, +-LOG_RATIO_BOUND))
  pg_t        max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))
  tis_t       min(exp(old_t - rollout_t), tis_cap), no gradient        (off_policy_correction=tis)
  kl_t        k1: lp - ref;  k3: exp(ref - lp) - (ref - lp) - 1;
              low_var: k3 of clamp(lp - ref, +-LOG_RATIO_BOUND), then clamped to +-10 (as verl)
  loss_t      tis_t * pg_t + kl_coef * kl_t - entropy_coef * H_t
  weight w_t  token_mean: m_t (denominator: sum of m);  sequence_mean: m_t / n_i (denominator:
              samples with n_i > 0). GSPO is sequence ratio + sequence_mean; AlgorithmConfig
              refuses sequence ratio + token_mean (it would weight sequences by their length).
  numerator   sum_t w_t loss_t
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from rlkit.train.config import AlgorithmConfig

KLEstimator = Literal["k1", "k3", "low_var"]
LOW_VAR_KL_BOUND = 10.0
# Log-ratios are clamped to +-20 before exp (verl's bound): exp(20) ~ 4.9e8 is finite in bf16/fp32
# where exp(89) is not, and an inf forward gives a NaN gradient even when a later clamp hides the
# value. For low_var the clamp changes no value: k3 passes 10 already at log-ratio -2.6 and +11.
LOG_RATIO_BOUND = 20.0


@dataclass
class PolicyLossInput:
    """Flat per-token tensors of one micro-batch's response tokens ([T] each)."""

    logprobs: torch.Tensor  # current policy; carries the gradient
    advantages: torch.Tensor
    loss_mask: torch.Tensor  # float 0/1
    sample_ids: torch.Tensor  # long, which sample of the micro-batch a token belongs to
    num_samples: int
    old_logprobs: torch.Tensor | None = None  # pi_old; None: the current logprobs, detached
    rollout_logprobs: torch.Tensor | None = None  # needed by off_policy_correction=tis
    ref_logprobs: torch.Tensor | None = None  # needed when kl_coef > 0
    entropy: torch.Tensor | None = None  # needed when entropy_coef > 0


@dataclass
class LossTerms:
    numerator: torch.Tensor  # scalar; backpropagate this
    denominator: float  # this micro-batch's share of the global normaliser
    metric_sums: dict[str, float] = field(default_factory=dict)  # weighted like the loss


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return torch.exp(-log_ratio) - 1 + log_ratio
    if estimator == "low_var":
        safe = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return (torch.exp(-safe) - 1 + safe).clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k3 or low_var")


def _per_sample_sum(values: torch.Tensor, sample_ids: torch.Tensor, num_samples: int) -> torch.Tensor:
    return torch.zeros(num_samples, dtype=values.dtype, device=values.device).index_add(
        0, sample_ids, values
    )


def policy_loss(inp: PolicyLossInput, cfg: AlgorithmConfig) -> LossTerms:
    lp = inp.logprobs
    mask = inp.loss_mask.to(lp.dtype)
    old = lp.detach() if inp.old_logprobs is None else inp.old_logprobs.to(lp.dtype)

    tokens_per_sample = _per_sample_sum(mask, inp.sample_ids, inp.num_samples)
    if cfg.loss_aggregation == "token_mean":
        weight = mask
        denominator = float(mask.sum())
    elif cfg.loss_aggregation == "sequence_mean":
        weight = mask / tokens_per_sample.clamp(min=1)[inp.sample_ids]
        denominator = float((tokens_per_sample > 0).sum())
    else:
        raise ValueError(f"unknown loss_aggregation {cfg.loss_aggregation!r}")

    if cfg.ratio_level == "token":
        log_ratio = lp - old
    elif cfg.ratio_level == "sequence":
        seq_log_ratio = _per_sample_sum((lp.detach() - old) * mask, inp.sample_ids, inp.num_samples)
        seq_log_ratio = seq_log_ratio / tokens_per_sample.clamp(min=1)
        # detached, so the clamp bounds the ratio's value without cutting the gradient path
        seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        log_ratio = seq_log_ratio[inp.sample_ids] + lp - lp.detach()
    else:
        raise ValueError(f"unknown ratio_level {cfg.ratio_level!r}")
    ratio = torch.exp(log_ratio)
    adv = inp.advantages.to(lp.dtype)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.maximum(unclipped, clipped)

    sums: dict[str, torch.Tensor] = {}
    if cfg.off_policy_correction == "tis":
        if inp.rollout_logprobs is None:
            raise ValueError("off_policy_correction=tis needs the rollout logprobs of every token")
        tis_raw = torch.exp(old - inp.rollout_logprobs.to(lp.dtype))
        tis = tis_raw.clamp(max=cfg.tis_cap).detach()
        sums["tis_weight"] = tis
        sums["tis_truncated_frac"] = (tis_raw > cfg.tis_cap).to(lp.dtype)
        pg = pg * tis
    loss = pg
    sums["pg_loss"] = pg.detach()
    sums["clip_frac"] = (clipped > unclipped).to(lp.dtype)
    sums["ratio"] = ratio.detach()
    sums["approx_kl_old"] = (old - lp.detach())

    if cfg.kl_coef > 0:
        if inp.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference logprobs (Trainer.logprobs(policy='reference'))")
        kl = kl_estimate(lp, inp.ref_logprobs.to(lp.dtype), cfg.kl_estimator)
        loss = loss + cfg.kl_coef * kl
        sums["kl"] = kl.detach()
    if cfg.entropy_coef > 0:
        if inp.entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        loss = loss - cfg.entropy_coef * inp.entropy
    if inp.entropy is not None:
        sums["entropy"] = inp.entropy.detach()
    if inp.rollout_logprobs is not None:
        sums["train_rollout_logprob_abs_diff"] = (old - inp.rollout_logprobs.to(lp.dtype)).abs()

    sums["loss"] = loss.detach()
    numerator = (weight * loss).sum()
    w = weight.detach()
    metric_sums = {k: float((w * v).sum()) for k, v in sums.items()}
    return LossTerms(numerator=numerator, denominator=denominator, metric_sums=metric_sums)
