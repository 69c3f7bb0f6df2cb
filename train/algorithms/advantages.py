"""Group advantages: one scalar per sample, computed from the rewards of its group.

- grpo: (r_i - mean(r)) / (std(r) + eps), std with Bessel's correction (torch's default, as in
  slime, verl and TRL). A group whose rewards are all equal gets advantage 0.
- dr_grpo: r_i - mean(r) (Dr.GRPO drops the std division, which biases towards easy/hard groups).
- rloo: r_i - mean_{j != i} r_j = n/(n-1) * (r_i - mean(r)) (leave-one-out baseline).

A group of one sample has no baseline: every estimator returns 0 for it.
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo"]
GRPO_STD_EPS = 1e-6


def group_advantages(
    rewards: Sequence[float] | torch.Tensor, estimator: AdvantageEstimator
) -> torch.Tensor:
    if estimator not in ("grpo", "dr_grpo", "rloo"):
        raise ValueError(f"unknown advantage estimator {estimator!r}; expected grpo, dr_grpo or rloo")
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    n = r.numel()
    if n == 0:
        raise ValueError("group_advantages: a group needs at least one reward")
    if n == 1 or bool((r == r[0]).all()):
        return torch.zeros(n, dtype=torch.float32)  # no baseline, or nothing to prefer
    centred = r - r.mean()
    if estimator == "grpo":
        adv = centred / (r.std(unbiased=True) + GRPO_STD_EPS)
    elif estimator == "dr_grpo":
        adv = centred
    else:  # rloo
        adv = centred * (n / (n - 1))
    return adv.to(torch.float32)
