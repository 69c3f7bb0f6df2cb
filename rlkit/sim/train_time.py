"""Training-time model: how long the trainer takes for a batch of tokens, and a weight sync.

    train_s(tokens) = overhead_s + tokens * flops_per_token / (gpus * peak_flops * mfu)
    flops_per_token = params * (6 (forward + backward)
                                + 2 if recompute (activation recomputation: one more forward)
                                + 2 (old-policy log-probs forward)
                                + 2 if reference model (KL))
    sync_s = sync_overhead_s + weight_bytes / sync_bandwidth

Tokens are prompt + response tokens of the trained samples. The 6P rule and the forward
passes are the standard dense-transformer accounting (Kaplan et al. 2020); the default MFU of
0.35 is in the range Megatron-LM reports for models of a few billion parameters (Narayanan et
al. 2021 report 0.44-0.52 at large scale; small models and RL's short micro-batches do
worse). The defaults are stated assumptions, not measurements: pass your own.

Driver modes use it as: sync step = rollout + train + sync; stream and async (later issues)
overlap rollout with training and pay `max` instead of the sum for the overlapped part.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainTimeModel:
    params: float  # trainable parameters
    gpus: int  # GPUs the trainer runs on
    peak_flops: float = 989e12  # per GPU (H100 SXM dense BF16)
    mfu: float = 0.35
    recompute: bool = True
    reference_model: bool = False
    overhead_s: float = 5.0  # per step: optimizer step, data movement, launch
    sync_overhead_s: float = 2.0  # pause, flush, continue on the engines
    sync_bandwidth: float = 10e9  # bytes/s achieved while broadcasting weights
    bytes_per_param: int = 2  # bf16 weights sent to the engines

    def __post_init__(self) -> None:
        if self.params <= 0 or self.gpus < 1 or self.peak_flops <= 0:
            raise ValueError("params, gpus and peak_flops must be positive")
        if not 0 < self.mfu <= 1:
            raise ValueError("mfu must be in (0, 1]")

    @property
    def flops_per_token(self) -> float:
        passes = 6 + 2 * self.recompute + 2 + 2 * self.reference_model
        return passes * self.params

    @property
    def tokens_per_s(self) -> float:
        """Training throughput (prompt + response tokens per second) of the whole trainer."""
        return self.gpus * self.peak_flops * self.mfu / self.flops_per_token

    def train_s(self, tokens: int) -> float:
        return self.overhead_s + tokens / self.tokens_per_s

    def sync_s(self) -> float:
        return self.sync_overhead_s + self.params * self.bytes_per_param / self.sync_bandwidth

    def sync_step_s(self, rollout_s: float, tokens: int) -> float:
        """End-to-end time of one synchronous step (rollout, then training, then sync)."""
        return rollout_s + self.train_s(tokens) + self.sync_s()
