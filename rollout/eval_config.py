"""The recipe's `eval` section: which held-out datasets to evaluate, when, and how to sample
them (rollout.evaluator.Evaluator runs one evaluation; docs/evaluation.md).

A dataset's loader options are those of the recipe's `data` section (both derive from
rollout.config.PromptDataConfig). Greedy decoding: rlkit's SamplingConfig requires temperature > 0, so
greedy is expressed as top_k=1 (SGLang decodes a request with top_k=1 by argmax, whatever its
temperature).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlkit.rollout.config import PromptDataConfig, RewardConfig, SamplingConfig


class EvalDatasetConfig(PromptDataConfig):
    """One held-out dataset: a name for its metrics and the `data` section's loader options."""

    path: str = Field(
        ...,
        min_length=1,
        description="Prompts: a .jsonl or .parquet file, a folder saved by datasets' "
        "save_to_disk, or a data set the project generates ('builtin:arithmetic').",
    )
    name: str = Field(
        ...,
        min_length=1,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="Name in the metrics (eval/<name>/pass@1); letters, digits, '_', '.', '-'.",
    )
    limit: int | None = Field(
        None, ge=1,
        description="Evaluate only the first `limit` rows (in file order; eval never shuffles). "
        "None: all of them.",
    )


@dataclass(frozen=True)
class EvalPass:
    """One evaluate() call the config asks for: a dataset under one sampling mode."""

    dataset: EvalDatasetConfig
    mode: Literal["greedy", "sampled"]
    sampling: SamplingConfig
    n: int
    k: int

    @property
    def name(self) -> str:
        """Metrics name: eval/<dataset>/<mode>/pass@..."""
        return f"{self.dataset.name}/{self.mode}"


class EvalConfig(BaseModel):
    """Periodic evaluation on held-out datasets (rollout.evaluator). Each evaluation runs, for
    every dataset, a greedy pass (when `greedy`) and a sampled pass (when `n_samples` > 0), both
    at the policy version current when it starts; metrics eval/<dataset>/<greedy|sampled>/...
    Eval samples never enter the training buffer."""

    model_config = ConfigDict(extra="forbid")

    datasets: list[EvalDatasetConfig] = Field(
        default_factory=list,
        description="Held-out datasets, each with a unique name. Empty: evaluation is off, and "
        "every_steps / before_first_step must be left at their defaults.",
    )
    every_steps: int = Field(
        0, ge=0,
        description="Evaluate after every K training steps (after the weights of step K are on "
        "the engines); 0: never periodically (before_first_step may still evaluate once).",
    )
    before_first_step: bool = Field(
        False,
        description="Evaluate the initial policy (version 0) before the first step: the "
        "baseline the later evaluations compare to.",
    )
    greedy: bool = Field(
        True,
        description="Run a greedy pass: one response per prompt with top_k=1 (greedy; rlkit's "
        "sampling requires temperature > 0, and top_k=1 decodes by argmax whatever the "
        "temperature); its pass@1 is the fraction of prompts solved.",
    )
    n_samples: int = Field(
        0, ge=0,
        description="Responses per prompt in the sampled pass (at `temperature`, `top_p`), from "
        "which pass@1 and pass@k are estimated without bias; 0: no sampled pass. Must be >= k.",
    )
    k: int = Field(
        1, ge=1,
        description="The k of the sampled pass's pass@k (pass@1 is always reported too); needs "
        "n_samples >= k, and the estimate is less noisy the larger n_samples is over k.",
    )
    temperature: float = Field(
        1.0, gt=0, le=10, description="Sampled pass: temperature (> 0). The greedy pass ignores it."
    )
    top_p: float = Field(
        1.0, gt=0, le=1, description="Sampled pass: nucleus mass. The greedy pass ignores it."
    )
    max_new_tokens: int | None = Field(
        None, ge=1,
        description="Response length cap for both passes; None: rollout.sampling.max_new_tokens. "
        "A response that hits it counts in eval/.../truncation_rate.",
    )
    success_threshold: float = Field(
        1.0,
        description="A response is correct (for pass@k) when its reward is >= this. With a 0/1 "
        "reward the default means 'reward 1'; lower it for graded rewards.",
    )
    reward: RewardConfig | None = Field(
        None,
        description="Reward for evaluation; None: the training reward (rollout.reward). A "
        "reward failure scores the response incorrect and is counted in eval/.../failures/reward.",
    )
    max_concurrency: int = Field(
        0, ge=0,
        description="Eval requests in flight at once; 0: no bound (the router and engines "
        "queue them). Bound it when evaluation runs beside training rollouts.",
    )

    @model_validator(mode="after")
    def _check(self) -> "EvalConfig":
        names = [d.name for d in self.datasets]
        dupes = sorted({x for x in names if names.count(x) > 1})
        if dupes:
            raise ValueError(f"eval.datasets: names must be unique, repeated: {dupes}")
        if not self.datasets and (self.every_steps or self.before_first_step):
            raise ValueError(
                "eval.every_steps / eval.before_first_step are set but eval.datasets is empty"
            )
        if self.n_samples and self.k > self.n_samples:
            raise ValueError(
                f"eval.k ({self.k}) exceeds eval.n_samples ({self.n_samples}): pass@k needs at "
                "least k responses per prompt"
            )
        if self.datasets and not self.greedy and not self.n_samples:
            raise ValueError("eval: greedy is off and n_samples is 0, so there is nothing to run")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.datasets) and (self.every_steps > 0 or self.before_first_step)

    def due(self, step: int) -> bool:
        """Evaluate after training step `step` (1-based count of steps done)? Step 0 means
        before the first step."""
        if not self.datasets:
            return False
        if step == 0:
            return self.before_first_step
        return self.every_steps > 0 and step % self.every_steps == 0

    def passes(self, base: SamplingConfig) -> list[EvalPass]:
        """The evaluate() calls of one evaluation, given the training sampling (stop strings,
        stop ids and the length cap come from it unless max_new_tokens is set here)."""
        cap = self.max_new_tokens or base.max_new_tokens
        common = dict(
            max_new_tokens=cap,
            min_new_tokens=min(base.min_new_tokens, cap),
            stop=list(base.stop),
            stop_token_ids=list(base.stop_token_ids),
            ignore_eos=False,
        )
        greedy = SamplingConfig(temperature=1.0, top_p=1.0, top_k=1, **common)
        sampled = SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=-1, **common)
        out = []
        for d in self.datasets:
            if self.greedy:
                out.append(EvalPass(d, "greedy", greedy, 1, 1))
            if self.n_samples:
                out.append(EvalPass(d, "sampled", sampled, self.n_samples, self.k))
        return out
