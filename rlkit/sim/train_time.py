"""Training-time model: how long the trainer takes for a batch of tokens, and a weight sync.

    train_s(tokens) = overhead_s + tokens * flops_per_token / (gpus * peak_flops * mfu)
    flops_per_token = params * (6 (forward + backward)
                                + 2 if recompute (activation recomputation: one more forward)
                                + 2 (old-policy log-probs forward)
                                + 2 if reference model (KL))
    sync_s = sync_overhead_s + weight_bytes / sync_bandwidth

LoRA (`lora_params` > 0, train.lora): the base is frozen, so its backward computes the
activations' gradients alone, not the weights' (4 FLOPs per base parameter and token instead of
6); the adapters add 6 per theirs. The KL reference is the base with the adapters off: one more
forward, as a reference model. With adapter sync the engines receive the adapters alone and
nothing pauses: sync_s = adapter_overhead_s + lora_params x weight bytes / sync_bandwidth (the
PEFT form sends fused layers' A once per module: ~20% more than the trained count for
SmolLM2's qkv and fc1; not priced). Merged sync sends the full weights, as without LoRA.

Tokens are prompt + response tokens of the trained samples. With the batch's sample lengths
(`batch_s`) the model also counts what a long tail costs beyond its tokens, as the trainer plans
it (train/microbatch_plan.py):

    a sample of n tokens costs n + w n^2 token-equivalents (causal attention over its own
    tokens: packed rows attend block-diagonally; w = attention_weight, the model's attention
    FLOPs per token pair over its matmul FLOPs per token)
    samples go to the dp = gpus / model_parallel replicas by cost (LPT, as the trainer does),
    and the step waits for the slowest replica: train_s = overhead_s + slowest x dp / tokens/s

so a 32k response costs 1 + 32k w times its tokens (Qwen3-4B: w = 3.7e-5, 2.2x) and a batch
whose long tail lands on one replica pays for it there. w = 0 and dp = 1 give train_s(tokens).
The 6P rule and the forward
passes are the standard dense-transformer accounting (Kaplan et al. 2020); the default MFU of
0.35 is in the range Megatron-LM reports for models of a few billion parameters (Narayanan et
al. 2021 report 0.44-0.52 at large scale; small models and RL's short micro-batches do
worse). The defaults are stated assumptions, not measurements: pass your own.

Driver modes use it as: sync step = rollout + train + sync; stream and async (later issues)
overlap rollout with training and pay `max` instead of the sum for the overlapped part.

`ColocationModel`: what a colocated step (engines and trainer taking turns on the same GPUs,
sync mode only) pays instead of the sync: the engines' sleep and the trainer's onload before
training, the trainer's offload, the engines' wake and the in-memory weight update after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from rlkit.train.microbatch_plan import balance_replicas, sample_cost


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
    # Attention FLOPs per token pair over matmul FLOPs per token (`attention_weight_of_profile`
    # reads it from an engine profile of the same model); 0: tokens alone.
    attention_weight: float = 0.0
    model_parallel: int = 1  # GPUs per data-parallel replica (TP x PP)
    lora_params: float = 0.0  # LoRA adapters' parameters (train.lora); 0: full training
    lora_sync: str = "adapter"  # train.lora.sync: adapter (the adapters alone) or merged
    # an adapter sync loads one small adapter per engine and pauses nothing (assumed; 0.03-0.05 s
    # measured on the CPU machine for SmolLM2 at rank 8-32, docs/bench/lora.md)
    adapter_overhead_s: float = 0.2

    def __post_init__(self) -> None:
        if self.params <= 0 or self.gpus < 1 or self.peak_flops <= 0:
            raise ValueError("params, gpus and peak_flops must be positive")
        if self.lora_params < 0 or self.lora_sync not in ("adapter", "merged"):
            raise ValueError("lora_params must be >= 0 and lora_sync 'adapter' or 'merged'")
        if not 0 < self.mfu <= 1:
            raise ValueError("mfu must be in (0, 1]")
        if self.attention_weight < 0 or self.model_parallel < 1 or self.gpus % self.model_parallel:
            raise ValueError(f"attention_weight must be >= 0 and the {self.gpus} GPUs whole "
                             f"replicas of model_parallel {self.model_parallel}")

    @property
    def dp(self) -> int:
        return self.gpus // self.model_parallel

    def slowest_replica(self, lengths: Sequence[int]) -> float:
        """Token-equivalents of the busiest replica when `lengths` are balanced over dp
        replicas by cost, times dp: what the step's compute takes at the whole trainer's
        tokens/s."""
        costs = [sample_cost(n, self.attention_weight) for n in lengths]
        if self.dp == 1:
            return sum(costs)
        return self.dp * max(sum(costs[i] for i in r) for r in balance_replicas(costs, self.dp))

    def batch_s(self, lengths: Sequence[int]) -> float:
        """Training time of a batch of samples of these (prompt + response) lengths."""
        return self.overhead_s + self.slowest_replica(lengths) / self.tokens_per_s

    @property
    def flops_per_token(self) -> float:
        backward = 2 if self.lora_params else 4  # a frozen base: no weight gradients
        passes = 2 + backward + 2 * self.recompute + 2 + 2 * self.reference_model
        return passes * self.params + 6 * self.lora_params

    @property
    def tokens_per_s(self) -> float:
        """Training throughput (prompt + response tokens per second) of the whole trainer."""
        return self.gpus * self.peak_flops * self.mfu / self.flops_per_token

    def train_s(self, tokens: int) -> float:
        return self.overhead_s + tokens / self.tokens_per_s

    @property
    def adapter_sync(self) -> bool:
        """A sync sends the LoRA adapters alone (no pause) rather than the full weights."""
        return bool(self.lora_params) and self.lora_sync == "adapter"

    def sync_s(self) -> float:
        overhead = self.adapter_overhead_s if self.adapter_sync else self.sync_overhead_s
        return overhead + self.sync_bytes / self.sync_bandwidth

    @property
    def sync_bytes(self) -> float:
        """What one weight sync sends to each engine."""
        return (self.lora_params if self.adapter_sync else self.params) * self.bytes_per_param

    def sync_step_s(self, rollout_s: float, tokens: int) -> float:
        """End-to-end time of one synchronous step (rollout, then training, then sync)."""
        return rollout_s + self.train_s(tokens) + self.sync_s()


def attention_weight_of_profile(profile: Any) -> float:
    """The attention weight of an engine profile's model: its prefill's quadratic over linear
    cost per token (rollout/engines/profile.py), the same FLOPs ratio a trainer pays; 0 when
    the profile has no quadratic term."""
    linear = float(getattr(profile, "prefill_s_per_token", 0.0) or 0.0)
    square = float(getattr(profile, "prefill_s_per_token_sq", 0.0) or 0.0)
    return square / linear if linear > 0 else 0.0


@dataclass(frozen=True)
class ColocationModel:
    """The turn costs of a colocated step (cluster.placement colocated, sync mode only): the
    engines and the trainer share every GPU and take turns, so a step pays

        rollout + sleep + train + wake
        sleep = release_s + onload (params, grads, optimizer: host -> device)
        wake  = offload (grads and optimizer, then params once sent) + weights_resume_s
                + update + kv_resume_s
        update = update_overhead_s + params * weight_bytes / update_bandwidth

    as rlkit's Megatron trainer does it (sleep_engines, then sync_weights(colocated=True)).
    Each GPU moves its own share of the trainer's state over its own host link, all at once, so
    a transfer takes per-GPU bytes / host_bandwidth. Per-GPU bytes: the state of one model-
    parallel shard (params / model_parallel); data-parallel replicas each hold a copy, unless
    the optimizer is distributed (master weights and Adam sharded over every GPU). The defaults
    are stated assumptions, not measurements: pass your own."""

    params: float  # trainable parameters
    gpus: int  # the trainer's GPUs (colocated: the whole cluster)
    model_parallel: int = 1  # trainer TP x PP: each GPU holds 1/model_parallel of the state
    # rlkit's Megatron optimizer runs with use_distributed_optimizer=False (train/megatron/
    # optimizer.py): every data-parallel replica keeps the full fp32 state of its shard.
    distributed_optimizer: bool = False
    # LoRA (train.lora, merged sync: colocated runs refuse adapter sync): gradients and the
    # optimizer hold the adapters alone; 0: full training
    lora_params: float = 0.0
    # Megatron mixed precision: bf16 params 2, fp32 main grads 4, fp32 master 4, Adam m + v 8
    # = 18 bytes per parameter.
    param_bytes: float = 2.0
    grad_bytes: float = 4.0
    optimizer_bytes: float = 12.0  # fp32 master weights + Adam's two moments
    # Pinned host <-> device, per GPU, every GPU of a node at once. PCIe Gen5 x16 is 64 GB/s
    # per direction raw (H100 SXM datasheet: 128 GB/s bidirectional), pinned cudaMemcpy gets
    # about 50 of it alone; an offload of many tensors while the node's GPUs share the host's
    # links and memory gets about half that (assumed).
    host_bandwidth: float = 25e9
    release_s: float = 0.5  # engines unmap KV cache, weights, CUDA graphs (one HTTP call each)
    weights_resume_s: float = 0.1  # re-map the weights' memory: allocation only, no copy
    kv_resume_s: float = 1.0  # re-map the KV pool and CUDA graphs, the last wake stage
    # In-memory update (CUDA IPC): bf16 weights gathered and copied into each engine on the
    # same node; NVLink 4 moves 450 GB/s per direction (H100 datasheet), and on one GPU it is
    # a device copy (HBM3: 3.35 TB/s); bucketing and load_weights leave a few hundred GB/s.
    update_bandwidth: float = 200e9
    update_overhead_s: float = 0.5  # per-bucket handle round trips, flush, version set
    weight_bytes: float = 2.0  # bf16 weights sent to the engines

    def __post_init__(self) -> None:
        if self.params <= 0 or self.gpus < 1 or self.model_parallel < 1:
            raise ValueError("params, gpus and model_parallel must be positive")
        if self.gpus % self.model_parallel:
            raise ValueError(f"{self.gpus} trainer GPUs are not a multiple of the model-parallel "
                             f"size {self.model_parallel}")
        if self.host_bandwidth <= 0 or self.update_bandwidth <= 0:
            raise ValueError("bandwidths must be positive")

    def _per_gpu(self, params: float, bytes_per_param: float, sharded: bool = False) -> float:
        over = self.gpus if sharded and self.distributed_optimizer else self.model_parallel
        return params * bytes_per_param / over

    @property
    def state_bytes_per_gpu(self) -> float:
        """Params, grads and optimizer state one GPU holds while it trains."""
        trained = self.lora_params or self.params
        return (self._per_gpu(self.params + self.lora_params, self.param_bytes)
                + self._per_gpu(trained, self.grad_bytes)
                + self._per_gpu(trained, self.optimizer_bytes, sharded=True))

    def move_s(self) -> float:
        """Seconds to move one GPU's trainer state over its host link (either way)."""
        return self.state_bytes_per_gpu / self.host_bandwidth

    def sleep(self) -> dict[str, float]:
        """The turn to training, by part (seconds, as metrics of the step's row)."""
        return {"colocate/release_seconds": self.release_s,
                "colocate/onload_seconds": self.move_s()}

    def wake(self) -> dict[str, float]:
        """The turn to generation, by part (offload: grads and optimizer before the update,
        params after it)."""
        return {"colocate/offload_seconds": self.move_s(),
                "colocate/weights_resume_seconds": self.weights_resume_s,
                "colocate/update_seconds": self.update_s(),
                "colocate/kv_resume_seconds": self.kv_resume_s}

    def update_s(self) -> float:
        return self.update_overhead_s + self.params * self.weight_bytes / self.update_bandwidth

    def sleep_s(self) -> float:
        return sum(self.sleep().values())

    def wake_s(self) -> float:
        return sum(self.wake().values())

    def turn_s(self) -> float:
        """Both turns of one step: what colocation adds to rollout + train."""
        return self.sleep_s() + self.wake_s()
