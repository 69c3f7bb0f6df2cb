"""Advantages and policy losses, in pure torch (no megatron import), so they test in milliseconds.

The first plan put algorithms under rlkit/; they live here because `train` must not import `rlkit`
(dependencies point rlkit -> train -> buffers) and the trainer is their only consumer.
"""

from rlkit.train.algorithms.advantages import group_advantages
from rlkit.train.algorithms.losses import LossTerms, PolicyLossInput, kl_estimate, policy_loss

__all__ = ["group_advantages", "policy_loss", "PolicyLossInput", "LossTerms", "kl_estimate"]
