"""The `rollout` recipe section: sampling, group sizes, the scheduling policy and its knobs."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from buffers.staleness import StalenessPolicy
from rollout.engines.config import EngineConfig, RouterConfig

# Scheduling policies that exist (rollout/policies); the schema names the planned ones too.
AVAILABLE_POLICIES = ("sync", "partial")


class SamplingConfig(BaseModel):
    """Sampling parameters sent with every /generate request."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature (> 0).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling; -1 disables it.")
    max_new_tokens: int = Field(
        512, ge=1, description="Response length cap in tokens (a resumed partial counts what it has)."
    )
    min_new_tokens: int = Field(0, ge=0, description="Tokens generated before EOS is allowed.")
    stop: list[str] = Field(default_factory=list, description="Stop strings.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop token ids.")
    ignore_eos: bool = Field(
        False, description="Keep generating past EOS (benchmarks replaying a length trace)."
    )

    @model_validator(mode="after")
    def _check(self) -> "SamplingConfig":
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"sampling.min_new_tokens ({self.min_new_tokens}) exceeds "
                f"sampling.max_new_tokens ({self.max_new_tokens})"
            )
        return self


class TailBatchingConfig(BaseModel):
    """Flexes-style tail batching (policy `tail_batching`)."""

    model_config = ConfigDict(extra="forbid")

    eta_prompts: float = Field(
        1.25, ge=1.0, le=4.0, description="Short rounds launch eta_prompts x batch_size prompts."
    )
    eta_responses: float = Field(
        1.25,
        ge=1.0,
        le=4.0,
        description="Short rounds launch eta_responses x n_samples_per_prompt responses per prompt "
        "and keep the first n.",
    )
    long_round_size: int = Field(
        0,
        ge=0,
        description="Deferred prompts that trigger a long round; 0 means batch_size.",
    )


class RankerConfig(BaseModel):
    """Output-length ranker used by ranked dispatch, tail batching and ordering."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        "prompt_length",
        description="Built-in ranker name, or a dotted path 'pkg.module:Factory' resolving to a "
        "LengthRanker.",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Arguments for the ranker.")


class RewardConfig(BaseModel):
    """How each finished sample is scored."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        "math",
        description="Reward function: a built-in name (math, exact_match, format), an entry point "
        "in the 'rlkit.rewards' group, or a dotted path 'pkg.module:function'.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments passed to the reward function."
    )
    timeout_s: float = Field(30.0, gt=0, description="Seconds one reward call may take.")
    on_error: Literal["drop_group", "fail_step"] = Field(
        "drop_group",
        description="A reward that raises or times out: drop the sample's group (recorded with the "
        "error) or fail the step.",
    )


class RolloutConfig(BaseModel):
    """Generation side: engines, router, sampling and the scheduling policy over the buffer."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig, description="Engine servers.")
    router: RouterConfig = Field(default_factory=RouterConfig, description="The sglang-router.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling.")
    batch_size: int = Field(
        8, ge=1, description="Prompt groups per training step (slime's rollout_batch_size)."
    )
    n_samples_per_prompt: int = Field(
        4, ge=1, le=1024, description="Responses per prompt: the GRPO group size."
    )
    policy: Literal["sync", "partial", "tail_batching", "ranked_dispatch"] = Field(
        "sync",
        description="Scheduling policy: 'sync' launches exactly batch_size groups and waits for "
        "all; 'partial' (APRIL) over-provisions, aborts once batch_size groups are complete and "
        "resumes the unfinished ones first next step (requires an explicit "
        "train.algorithm.off_policy_correction); 'tail_batching' (Flexes) defers long prompts "
        "to long rounds; 'ranked_dispatch' (StreamRL) orders and places work by predicted length.",
    )
    over_provision: float = Field(
        2.0,
        ge=1.0,
        le=16.0,
        description="Policy 'partial': groups in flight = over_provision x batch_size "
        "(2.0 mirrors APRIL).",
    )
    tail_batching: TailBatchingConfig = Field(
        default_factory=TailBatchingConfig, description="Tail batching knobs."
    )
    ranker: RankerConfig = Field(default_factory=RankerConfig, description="Output-length ranker.")
    max_staleness: int = Field(
        4,
        ge=0,
        le=1000,
        description="Most policy versions a group's oldest token may lag behind the trainer.",
    )
    staleness_policy: StalenessPolicy = Field(
        StalenessPolicy.DROP,
        description="What happens to a group past max_staleness: 'drop' it (counted), "
        "'regenerate' it from the prompt, or 'correct' (keep it; the trainer's off-policy "
        "correction must be on).",
    )
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Reward function.")

    @model_validator(mode="after")
    def _check(self) -> "RolloutConfig":
        if self.policy not in AVAILABLE_POLICIES:
            raise ValueError(
                f"rollout.policy={self.policy!r} is planned but not available yet "
                f"(available: {', '.join(AVAILABLE_POLICIES)})"
            )
        return self
