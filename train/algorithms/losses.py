"""The policy loss: PPO-clip (asymmetric, DAPO clip-higher) or GSPO's sequence ratio, truncated
importance sampling against the rollout logprobs, KL to a reference, entropy bonus, and token-,
sequence-mean or constant-normalised (Dr.GRPO) aggregation. (`loss_terms` picks the recipe's
loss: this one, or `sft_loss`, the responses' mean negative log-likelihood.)

Normalisation is split in two so that any partition of a global batch into micro-batches, in any
order, gives the same gradient: `policy_loss` returns a *numerator* (a sum over the micro-batch's
tokens, each weighted by its aggregation weight) and the micro-batch's share of the
*denominator*. The trainer backpropagates numerators as they come, sums denominators, and divides
the summed gradient by the global denominator once, at the optimizer step.

Per token t of sample i (mask m_t, n_i = trainable tokens of sample i, B = LOG_RATIO_BOUND):
  ratio       token:    r_t = exp(clamp(lp_t - old_t, +-B))
              sequence: r_t = sg(s_i) * exp(lp_t - sg(lp_t)),
                        s_i = exp(clamp(sum_t m_t (lp_t - old_t) / n_i, +-B))
  A_t         reward_weight * A_i - distill_coef * sg(old_t - teacher_t)   (distill_coef 0: A_i)
  pg_t        max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))
  is_t        the off-policy correction's weight of rho_t = exp(old_t - rollout_t): tis, mis or
              icepop at token, sequence or geometric level, 0 for a rejected sample, no gradient
              (corrections.py; 1 with off_policy_correction none)
  kl_t        k1: lp - ref;  k3: exp(ref - lp) - (ref - lp) - 1;
              low_var: k3 of clamp(lp - ref, +-B), then clamped to +-10 (as verl)
  loss_t      is_t * pg_t + kl_coef * kl_t - entropy_coef * H_t
  weight w_t  token_mean: m_t (denominator: sum of m);  sequence_mean: m_t / n_i (denominator:
              samples with n_i > 0);  sequence_mean_token_sum_norm: m_t / C, C = loss_norm_length
              (denominator: samples with n_i > 0), i.e. Dr.GRPO's mean over sequences of the
              token sum / C. GSPO is sequence ratio + sequence_mean; AlgorithmConfig refuses a
              sequence ratio with any other aggregation (it would weight sequences by length).
  numerator   sum_t w_t loss_t

The token ratio's clamp changes no value with |lp - old| <= B (a clamp inside its range returns
its input, and passes the gradient unchanged); beyond it the token keeps the clamped value and gets
no gradient (as verl's clamp of the log-ratio before exp), where exp alone would overflow.

Masking is by selection, never by multiplication: every per-token input (lp, pi_old, rollout,
reference and teacher logprobs, advantage, entropy) is replaced by 0 at mask-0 positions with
`torch.where` before any arithmetic, and the sums select again. A NaN or inf at a mask-0 position
(an environment observation's placeholder logprob, say) therefore reaches neither the loss, its
gradient nor a metric; `0 * inf` would be NaN, and an inf forward gives a NaN gradient even where
`torch.where` later drops its value. Values at mask-1 positions are used exactly as before.

Metrics (`metric_sums`, divided by the global denominator by the trainer) are weighted like the
loss, except under sequence_mean_token_sum_norm, where only `loss` and `pg_loss` are (so
train/loss is the objective) and the diagnostics (ratio, clip_frac, KL, entropy, the correction's,
distill_reverse_kl = old_t - teacher_t and distill_advantage = -distill_coef * that) are
per-sequence means (weight m_t / n_i): weighted by m_t / C they would read as their mean times
the mean length / C.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from rlkit.train.algorithms.corrections import LOG_RATIO_BOUND, correction_weights, per_sample_sum
from rlkit.train.algorithms.mismatch import telemetry_sums
from rlkit.train.config import AlgorithmConfig

KLEstimator = Literal["k1", "k3", "low_var"]
LOW_VAR_KL_BOUND = 10.0
# Log-ratios (the token ratio's lp - old, GSPO's sequence mean, low_var KL's lp - ref, the
# correction's rho) are clamped to LOG_RATIO_BOUND = 20 before exp (verl's bound): exp(20) ~ 4.9e8
# is finite in bf16/fp32 where exp(89) is not, and an inf forward gives a NaN gradient even when a
# later clamp hides the value. For low_var the clamp changes no value: k3 passes 10 already at
# log-ratio -2.6 and +11.
# Metrics that are loss values: always weighted like the loss (see the module's docstring).
_LOSS_METRICS = frozenset({"loss", "pg_loss"})


@dataclass
class PolicyLossInput:
    """Flat per-token tensors of one micro-batch's response tokens ([T] each)."""

    logprobs: torch.Tensor  # current policy; carries the gradient
    advantages: torch.Tensor
    loss_mask: torch.Tensor  # float 0/1
    sample_ids: torch.Tensor  # long, which sample of the micro-batch a token belongs to
    num_samples: int
    old_logprobs: torch.Tensor | None = None  # pi_old; None: the current logprobs, detached
    rollout_logprobs: torch.Tensor | None = None  # needed by an off_policy_correction
    ref_logprobs: torch.Tensor | None = None  # needed when kl_coef > 0
    entropy: torch.Tensor | None = None  # needed when entropy_coef > 0
    teacher_logprobs: torch.Tensor | None = None  # needed when distill_coef > 0
    # for the mismatch telemetry (mismatch.py): the trainer's version minus each token's, and
    # whether the token's sample was resumed after a park (bool)
    token_lag: torch.Tensor | None = None
    resumed: torch.Tensor | None = None


@dataclass
class LossTerms:
    numerator: torch.Tensor  # scalar; backpropagate this
    denominator: float  # this micro-batch's share of the global normaliser
    metric_sums: dict[str, float] = field(default_factory=dict)  # weighted like the loss
    telemetry: torch.Tensor | None = None  # mismatch.SIZE sums, added over micro-batches
    rejected_samples: int = 0  # samples the correction's rejection test set to weight 0


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


def loss_terms(inp: PolicyLossInput, cfg: AlgorithmConfig) -> LossTerms:
    """The recipe's loss (train.algorithm.loss) of one micro-batch."""
    return sft_loss(inp) if cfg.loss == "sft" else policy_loss(inp, cfg)


def sft_loss(inp: PolicyLossInput) -> LossTerms:
    """Supervised fine-tuning: numerator -sum_t m_t lp_t, denominator sum_t m_t, so the step's
    loss is the mean negative log-likelihood per trainable token of the global batch (TRL
    SFTTrainer, slime's sft_loss). Masked by selection, as policy_loss."""
    keep = inp.loss_mask > 0
    nll = -torch.where(keep, inp.logprobs, 0.0).sum()
    return LossTerms(numerator=nll, denominator=float(keep.sum()),
                     metric_sums={"loss": float(nll.detach())})


def policy_loss(inp: PolicyLossInput, cfg: AlgorithmConfig) -> LossTerms:
    keep = inp.loss_mask > 0  # the trainable tokens; everything below selects with it
    dtype = inp.logprobs.dtype

    def masked(x: torch.Tensor) -> torch.Tensor:
        """x at mask-1 positions, 0 elsewhere: by selection, so NaN/inf there cannot leak."""
        return torch.where(keep, x.to(dtype), 0.0)

    lp = masked(inp.logprobs)
    mask = inp.loss_mask.to(dtype)
    old = lp.detach() if inp.old_logprobs is None else masked(inp.old_logprobs)

    tokens_per_sample = per_sample_sum(mask, inp.sample_ids, inp.num_samples)
    per_sequence = mask / tokens_per_sample.clamp(min=1)[inp.sample_ids]
    metric_weight = None  # None: the metrics are weighted like the loss
    if cfg.loss_aggregation == "token_mean":
        weight = mask
        denominator = float(mask.sum())
    elif cfg.loss_aggregation == "sequence_mean":
        weight = per_sequence
        denominator = float((tokens_per_sample > 0).sum())
    elif cfg.loss_aggregation == "sequence_mean_token_sum_norm":
        if cfg.loss_norm_length < 1:
            raise ValueError(
                "loss_aggregation 'sequence_mean_token_sum_norm' divides each sequence's token sum "
                "by train.algorithm.loss_norm_length, which is 0: a recipe sets it to "
                "rollout.sampling.max_new_tokens; set it where a TrainConfig is built alone")
        weight = mask / float(cfg.loss_norm_length)
        denominator = float((tokens_per_sample > 0).sum())
        metric_weight = per_sequence
    else:
        raise ValueError(f"unknown loss_aggregation {cfg.loss_aggregation!r}")

    if cfg.ratio_level == "token":
        log_ratio = (lp - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    elif cfg.ratio_level == "sequence":
        # lp and old are 0 at mask-0 positions: they add nothing to a sequence's sum
        seq_log_ratio = per_sample_sum(lp.detach() - old, inp.sample_ids, inp.num_samples)
        seq_log_ratio = seq_log_ratio / tokens_per_sample.clamp(min=1)
        # detached, so the clamp bounds the ratio's value without cutting the gradient path
        seq_log_ratio = seq_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        log_ratio = seq_log_ratio[inp.sample_ids] + lp - lp.detach()
    else:
        raise ValueError(f"unknown ratio_level {cfg.ratio_level!r}")
    ratio = torch.exp(log_ratio)
    adv = masked(inp.advantages)
    distill = None
    if cfg.distill_coef > 0:
        if inp.teacher_logprobs is None:
            raise ValueError(
                "distill_coef > 0 needs the teacher's logprob of every response token "
                "(TrainSample.teacher_logprobs, from Sample.teacher_logprobs: a frozen engine group "
                "with role 'teacher' in rollout.frozen_engines); or set distill_coef 0")
        # sampled-token reverse KL to the teacher; old is pi_old (or lp, detached): no gradient
        reverse_kl = (old - masked(inp.teacher_logprobs)).detach()
        distill = -cfg.distill_coef * reverse_kl
        adv = cfg.reward_weight * adv + distill
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = torch.maximum(unclipped, clipped)

    sums: dict[str, torch.Tensor] = {}
    rollout = None if inp.rollout_logprobs is None else masked(inp.rollout_logprobs)
    correction = cfg.off_policy_correction
    weights = None
    if rollout is not None:
        weights = correction_weights(old, rollout, keep, inp.sample_ids, inp.num_samples, correction)
    if correction.estimator not in ("none", "unset"):
        if weights is None:
            raise ValueError(f"off_policy_correction={correction.estimator} needs the rollout "
                             "logprobs of every token")
        w = weights.weight.to(dtype)
        sums["is_weight"] = w
        sums["is_truncated_frac"] = weights.truncated.to(dtype)
        sums["is_masked_frac"] = weights.masked.to(dtype)
        pg = pg * w
    if weights is not None and correction.reject != "none":
        sums["is_rejected_frac"] = weights.rejected.to(dtype)
        pg = torch.where(weights.rejected, 0.0, pg)  # also under estimator 'none'
    loss = pg
    sums["pg_loss"] = pg.detach()
    sums["clip_frac"] = (clipped > unclipped).to(dtype)
    sums["ratio"] = ratio.detach()
    sums["approx_kl_old"] = (old - lp.detach())
    if distill is not None:
        sums["distill_reverse_kl"] = reverse_kl
        sums["distill_advantage"] = distill

    if cfg.kl_coef > 0:
        if inp.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference logprobs (Trainer.logprobs(policy='reference'))")
        kl = kl_estimate(lp, masked(inp.ref_logprobs), cfg.kl_estimator)
        loss = loss + cfg.kl_coef * kl
        sums["kl"] = kl.detach()
    entropy = None if inp.entropy is None else masked(inp.entropy)
    if cfg.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the per-token entropy")
        loss = loss - cfg.entropy_coef * entropy
    if entropy is not None:
        sums["entropy"] = entropy.detach()
    if rollout is not None:
        # a diagnostic: a token without a rollout logprob (NaN, refused under a correction by
        # train/batch.py) adds 0 instead of poisoning the step's metric
        diff = (old - rollout).abs()
        sums["train_rollout_logprob_abs_diff"] = torch.where(diff.isfinite(), diff, 0.0)

    sums["loss"] = loss.detach()
    numerator = torch.where(keep, weight * loss, 0.0).sum()
    w = weight.detach()
    mw = w if metric_weight is None else metric_weight.detach()
    metric_sums = {
        k: float(torch.where(keep, (w if k in _LOSS_METRICS else mw) * v, 0.0).sum()) for k, v in sums.items()
    }
    terms = LossTerms(numerator=numerator, denominator=denominator, metric_sums=metric_sums)
    if weights is not None:
        terms.rejected_samples = weights.rejected_samples
        if inp.token_lag is not None:
            resumed = (inp.resumed if inp.resumed is not None
                       else torch.zeros_like(keep))
            terms.telemetry = telemetry_sums(weights.log_ratio, inp.token_lag, resumed, keep,
                                             weights.truncated, weights.masked, weights.rejected)
    return terms
