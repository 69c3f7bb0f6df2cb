"""Off-policy correction: the weight each trained token's policy-gradient term gets from
rho = pi_old / pi_rollout, the ratio between the weights the loss takes as "old" and the engine's
logprob of the token when it was generated (for a resumed partial sample, tokens of several
versions; at lag 0 the same weights through other kernels).

Per trainable token t of sample i (log-ratio l_t = pi_old_t - rollout_t, B = LOG_RATIO_BOUND):
  level     token:     L_t = clamp(l_t, +-B)
            sequence:  L_t = clamp(sum_s l_s, +-B)          (the product of the sample's ratios)
            geometric: L_t = clamp(sum_s l_s / n_i, +-B)    (their geometric mean)
  estimator tis:    w_t = exp(clamp(L_t, log low, log high))     truncated
            mis:    w_t = exp(L_t) 1[log low <= L_t <= log high]   masked
            icepop: the same at token level with Ring-1T's bounds [0.5, 5] (a preset of mis)
            none:   w_t = 1
  rejection (optional, per sample): R_i at level sequence or geometric as above; outside
            [log reject_low, log reject_high] every token of the sample gets w_t = 0.

Everything is in log space, so a log-ratio of +-1000 gives a finite weight (the clamp bounds
the exp; the comparisons take the unclamped value). The weights carry no gradient (as every
peer's). A token at weight 0 (masked, or of a rejected sample) stays in the loss normaliser:
the denominator is fixed by the batch before any correction, so a step with many rejected
samples takes a smaller step instead of scaling up the few samples left (docs/training.md,
'Off-policy correction', compares this with the peers).

Masking is by selection (as losses.py): inputs at mask-0 positions are never read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# as losses.py: exp(20) ~ 4.9e8 is finite in bf16 and fp32
LOG_RATIO_BOUND = 20.0


@dataclass
class CorrectionWeights:
    """Per-token tensors ([T]) of one micro-batch; all detached, 0 / False at mask-0 tokens."""

    weight: torch.Tensor  # w_t, multiplies the policy-gradient term
    log_ratio: torch.Tensor  # the token's own l_t, clamped to +-B (telemetry)
    truncated: torch.Tensor  # bool: tis moved the weight to a bound
    masked: torch.Tensor  # bool: mis / icepop set the weight to 0
    rejected: torch.Tensor  # bool: the token's sample was rejected
    rejected_samples: int


def per_sample_sum(values: torch.Tensor, sample_ids: torch.Tensor, num_samples: int) -> torch.Tensor:
    return torch.zeros(num_samples, dtype=values.dtype, device=values.device).index_add(
        0, sample_ids, values)


def _log_bound(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def level_log_ratio(log_ratio: torch.Tensor, keep: torch.Tensor, sample_ids: torch.Tensor,
                    num_samples: int, level: str) -> torch.Tensor:
    """Per token, the unclamped log of the level's ratio (0 at mask-0 tokens). `log_ratio` must
    be 0 at mask-0 tokens; it may hold any finite value elsewhere."""
    if level == "token":
        return log_ratio
    total = per_sample_sum(log_ratio, sample_ids, num_samples)
    if level == "geometric":
        total = total / per_sample_sum(keep.to(log_ratio.dtype), sample_ids, num_samples).clamp(min=1)
    elif level != "sequence":
        raise ValueError(f"unknown correction level {level!r}; expected token, sequence or geometric")
    return torch.where(keep, total[sample_ids], 0.0)


def correction_weights(old: torch.Tensor, rollout: torch.Tensor, keep: torch.Tensor,
                       sample_ids: torch.Tensor, num_samples: int, cfg) -> CorrectionWeights:
    """The weights of `cfg` (a train.config.OffPolicyCorrection) for one micro-batch. `old` and
    `rollout` are pi_old and the rollout logprobs, [T], read only where `keep`; a non-finite
    rollout logprob there counts as log-ratio 0 (train/batch.py refuses one unless the
    estimator is 'none')."""
    with torch.no_grad():
        # float32 at least: a bf16 sum of many log-ratios loses the small ones
        dtype = torch.promote_types(old.dtype, torch.float32)
        raw = old.to(dtype) - rollout.to(dtype)
        raw = torch.where(keep & raw.isfinite(), raw, 0.0)
        token_lr = raw.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        false = torch.zeros_like(keep)
        estimator = cfg.estimator
        if estimator in ("none", "unset"):
            weight = torch.ones_like(raw)
            truncated = masked = false
        else:
            lo, hi = _log_bound(cfg.low), _log_bound(cfg.high)
            lr = level_log_ratio(raw, keep, sample_ids, num_samples, cfg.level)
            inside = (lr >= lo) & (lr <= hi)
            if estimator == "tis":
                weight = torch.exp(lr.clamp(lo, hi).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
                truncated, masked = keep & ~inside, false
            elif estimator in ("mis", "icepop"):
                weight = torch.where(inside, torch.exp(lr.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)), 0.0)
                truncated, masked = false, keep & ~inside
            else:
                raise ValueError(f"unknown off-policy estimator {estimator!r}")
        rejected = false
        rejected_samples = 0
        if cfg.reject != "none":
            lr = level_log_ratio(raw, keep, sample_ids, num_samples, cfg.reject)
            out = (lr < _log_bound(cfg.reject_low)) | (lr > _log_bound(cfg.reject_high))
            rejected = keep & out
            per_sample = per_sample_sum(rejected.to(dtype), sample_ids, num_samples)
            rejected_samples = int((per_sample > 0).sum())
            weight = torch.where(rejected, 0.0, weight)
        weight = torch.where(keep, weight, 0.0)
        return CorrectionWeights(weight=weight, log_ratio=token_lr, truncated=truncated,
                                 masked=masked, rejected=rejected, rejected_samples=rejected_samples)
