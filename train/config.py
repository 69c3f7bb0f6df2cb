"""The `train` recipe section: backend, parallelism, optimizer, algorithm, batches, weight sync."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ParallelismConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tensor: int = Field(1, ge=1, le=64, description="Tensor-parallel size.")
    data: int = Field(
        1,
        ge=1,
        le=4096,
        description="Data-parallel size. Samples go to replicas by compute cost (tokens plus "
        "attention's square term), most expensive first to the least-loaded replica (in arrival "
        "order in stream mode); every replica runs as many micro-batches as the busiest one, the "
        "others padded with empty ones.",
    )


class OptimizerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Literal["adam"] = Field(
        "adam", description="Optimizer (AdamW: Megatron's on GPU, torch's on CPU)."
    )
    lr: float = Field(1e-6, gt=0, le=1.0, description="Learning rate.")
    betas: tuple[float, float] = Field((0.9, 0.98), description="Adam betas.")
    eps: float = Field(1e-8, gt=0, description="Adam epsilon.")
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    grad_clip: float = Field(1.0, ge=0, description="Gradient-norm clip; 0 disables it.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up steps.")


CorrectionEstimator = Literal["unset", "none", "tis", "mis", "icepop"]


class OffPolicyCorrection(BaseModel):
    """How each trained token's loss is weighted by rho = pi_old / pi_rollout."""

    model_config = ConfigDict(extra="forbid")

    estimator: CorrectionEstimator = Field(
        "unset",
        description="'tis': w = clamp(rho, low, high), truncated IS (verl rollout_is, slime "
        "--use-tis, TRL *_truncate); 'mis': w = rho inside [low, high], 0 outside, masked IS "
        "(TRL *_mask, slime mis.py); 'icepop': mis at token level with Ring-1T's bounds [0.5, 5] "
        "(slime icepop_function, OpenRLHF icepop); 'none': w = 1. A token at weight 0 stays in "
        "the loss normaliser. 'unset': not chosen; runs that produce off-policy tokens refuse it.",
    )
    level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="Which rho the estimator weighs: each token's own; 'sequence', the sample's "
        "product of token ratios (exp of the summed log-ratios, clamped to +-20) on all its "
        "tokens; 'geometric', exp of the mean token log-ratio on all its tokens. 'icepop' is "
        "token level only.",
    )
    low: float | None = Field(
        None,
        ge=0,
        description="Lower bound on rho. None: 0 for 'tis' (no lower truncation), 1/high for "
        "'mis' (symmetric in log space), 0.5 for 'icepop'.",
    )
    high: float | None = Field(
        None,
        gt=0,
        description="Upper bound on rho (TIS's cap; the masks' upper edge). None: 2 for 'tis' "
        "and 'mis', 5 for 'icepop'.",
    )
    reject: Literal["none", "sequence", "geometric"] = Field(
        "none",
        description="Reject whole samples whose sequence ratio (product) or geometric ratio "
        "(per-token mean, in log space) falls outside [reject_low, reject_high]: every token "
        "of a rejected sample gets weight 0 and stays in the normaliser; counted in "
        "train/rejected_samples and the mismatch telemetry. Works with every estimator, "
        "'none' included (pure rejection).",
    )
    reject_low: float | None = Field(
        None, ge=0, description="Lower bound of the rejection test (a ratio, not a log). None: "
        "0.999 for 'geometric' (verl's decoupled_geo_rs), 0.5 for 'sequence'.",
    )
    reject_high: float | None = Field(
        None, gt=0, description="Upper bound of the rejection test. None: 1.001 for "
        "'geometric', 2 for 'sequence'.",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, data):
        return {"estimator": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _defaults_and_bounds(self) -> "OffPolicyCorrection":
        icepop = self.estimator == "icepop"
        if icepop and self.level != "token":
            raise ValueError("off_policy_correction: 'icepop' is token level; for a masked "
                             f"{self.level} ratio use estimator 'mis' with level {self.level!r}")
        if self.high is None:
            self.high = 5.0 if icepop else 2.0
        if self.low is None:
            self.low = 0.5 if icepop else 1.0 / self.high if self.estimator == "mis" else 0.0
        if self.low >= self.high:
            raise ValueError(f"off_policy_correction: low ({self.low}) must be below high "
                             f"({self.high})")
        geometric = self.reject == "geometric"
        if self.reject_low is None:
            self.reject_low = 0.999 if geometric else 0.5
        if self.reject_high is None:
            self.reject_high = 1.001 if geometric else 2.0
        if self.reject != "none" and self.reject_low >= self.reject_high:
            raise ValueError(f"off_policy_correction: reject_low ({self.reject_low}) must be "
                             f"below reject_high ({self.reject_high})")
        return self

    @property
    def chosen(self) -> bool:
        return self.estimator != "unset"


class AlgorithmConfig(BaseModel):
    """Advantages, policy loss and regularisers."""

    model_config = ConfigDict(extra="forbid")

    loss: Literal["policy_gradient", "sft"] = Field(
        "policy_gradient",
        description="'policy_gradient': RL from the engines' samples (the rest of this section). "
        "'sft': supervised fine-tuning on the data set's responses (data.response_key) with no "
        "engine started: the mean negative log-likelihood of the response tokens over the "
        "step's trainable tokens (TRL SFTTrainer's, slime's sft_loss), through the same trainer, "
        "checkpoints and `rlkit export`; each step trains rollout.batch_size rows. The policy "
        "gradient's settings (advantage, clips, corrections) are not read; kl_coef and "
        "entropy_coef must be 0.",
    )
    advantage: Literal["grpo", "dr_grpo", "rloo"] = Field(
        "grpo",
        description="Group advantage: 'grpo' (reward minus group mean, divided by group std), "
        "'dr_grpo' (mean-centred, no std division), 'rloo' (leave-one-out baseline).",
    )
    clip_low: float = Field(0.2, ge=0, le=1, description="PPO clip below: ratio >= 1 - clip_low.")
    clip_high: float = Field(
        0.28, ge=0, le=10, description="PPO clip above: ratio <= 1 + clip_high (DAPO clip-higher)."
    )
    ratio_level: Literal["token", "sequence"] = Field(
        "token",
        description="Importance ratio per token (PPO/GRPO) or per sequence (GSPO: exp of the "
        "sequence's mean token log-ratio, clipped per sequence). Both log-ratios are clamped to "
        "+-20 before exp. 'sequence' makes loss_aggregation default to 'sequence_mean' and "
        "refuses the other aggregations.",
    )
    loss_aggregation: Literal["token_mean", "sequence_mean", "sequence_mean_token_sum_norm"] = Field(
        "token_mean",
        description="How token losses become the batch loss (sums over trainable tokens, over the "
        "whole global batch). 'token_mean': sum / trainable tokens (TRL loss_type 'dapo', verl "
        "'token-mean', slime --calculate-per-token-loss). 'sequence_mean': each sequence's token "
        "mean, averaged over sequences with a trainable token (TRL 'grpo', verl "
        "'seq-mean-token-mean', slime's default). 'sequence_mean_token_sum_norm' (Dr.GRPO): each "
        "sequence's token sum divided by the constant loss_norm_length, averaged over sequences "
        "with a trainable token, i.e. sum / (sequences x loss_norm_length) (TRL 'dr_grpo' with "
        "max_completion_length = loss_norm_length, verl 'seq-mean-token-sum-norm' with "
        "loss_scale_factor = loss_norm_length). With ratio_level 'sequence' the default is "
        "'sequence_mean' (GSPO's objective) and the others are an error.",
    )
    loss_norm_length: int = Field(
        0,
        ge=0,
        description="The constant C of loss_aggregation 'sequence_mean_token_sum_norm' (Dr.GRPO's "
        "MAX_TOKENS): each sequence's token-loss sum is divided by C, whatever the sequence's "
        "length. 0 (the default): rollout.sampling.max_new_tokens, as TRL's "
        "max_completion_length and verl's response length; keep it fixed for a run (it scales "
        "the gradient, like the learning rate). The other aggregations ignore it.",
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL penalty to the reference model.")
    kl_estimator: Literal["k1", "k3", "low_var"] = Field(
        "low_var", description="KL estimator (k3 and its clamped low-variance form)."
    )
    distill_coef: float = Field(
        0.0,
        ge=0,
        description="On-policy distillation's lambda: weight of the sampled-token reverse KL to "
        "the teacher, log pi_old - log pi_teacher of each response token, subtracted from that "
        "token's advantage: A_t = reward_weight x A - distill_coef x (old_t - teacher_t), A the "
        "advantage estimator's, no gradient through it (slime's --opd-kl-coef; Thinking "
        "Machines' on-policy distillation). "
        "Needs a frozen engine group with role 'teacher' in rollout.frozen_engines to score "
        "every response (Sample.teacher_logprobs, at the rollout temperature); a trained sample "
        "without them is an error. Unlike kl_coef (a penalty to the reference with its own "
        "gradient), it acts through the policy gradient's clipped ratio and the off-policy "
        "correction like the reward's advantage (docs/training.md, 'On-policy distillation'). "
        "0: off. loss 'sft' refuses it.",
    )
    reward_weight: float = Field(
        1.0,
        ge=0,
        description="Weight of the reward-based advantage (the `advantage` estimator's) in each "
        "token's advantage when distill_coef > 0. 0 with distill_coef > 0 is distillation alone "
        "(Thinking Machines' setting): rewards are still computed and logged but do not train; "
        "1 (slime's) adds the distillation term to the reward's advantage. With distill_coef 0 "
        "it must stay 1 (it would only rescale the advantage: change optimizer.lr instead).",
    )
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus.")
    off_policy_correction: OffPolicyCorrection = Field(
        default_factory=lambda: OffPolicyCorrection(),
        description="Correction for tokens generated by other weights than pi_old (stale groups, "
        "resumed partials, and at lag 0 the engine's own kernels): the estimator, its level, "
        "bounds and optional rejection of whole samples (docs/training.md, 'Off-policy "
        "correction'). A bare name is the estimator with its defaults: 'tis', 'mis', 'icepop', "
        "'none'. Policies that produce off-policy samples refuse 'unset'.",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed_tis_cap(cls, data):
        if isinstance(data, dict) and "tis_cap" in data:
            raise ValueError("train.algorithm.tis_cap is now train.algorithm.off_policy_correction"
                             ".high (with estimator 'tis': w = min(rho, high))")
        return data

    @model_validator(mode="after")
    def _sft_terms(self) -> "AlgorithmConfig":
        if self.loss == "sft" and (self.kl_coef or self.entropy_coef):
            raise ValueError("loss 'sft' trains the responses' log-likelihood alone: kl_coef and "
                             "entropy_coef must be 0")
        if self.loss == "sft" and self.distill_coef:
            raise ValueError("loss 'sft' trains the responses' log-likelihood alone: distill_coef "
                             "(on-policy distillation, a term of the policy gradient's advantage) "
                             "must be 0; distillation needs loss 'policy_gradient'")
        return self

    @model_validator(mode="after")
    def _distillation(self) -> "AlgorithmConfig":
        if self.distill_coef == 0 and self.reward_weight != 1:
            raise ValueError(
                f"reward_weight {self.reward_weight} with distill_coef 0: reward_weight weighs "
                "the reward's advantage against the distillation term, and without one it would "
                "only rescale the advantage (the gradient): leave reward_weight at 1 and change "
                "train.optimizer.lr instead, or set distill_coef > 0")
        return self

    @model_validator(mode="after")
    def _gspo_aggregation(self) -> "AlgorithmConfig":
        # GSPO weights each sequence's token terms by 1/|y_i| and averages over sequences; a
        # sequence ratio with token_mean weights sequences by their length, which is neither GSPO
        # nor PPO. Unset: take GSPO's aggregation; set to token_mean: refuse rather than guess.
        if self.ratio_level == "sequence":
            if "loss_aggregation" not in self.model_fields_set:
                self.loss_aggregation = "sequence_mean"
            elif self.loss_aggregation != "sequence_mean":
                raise ValueError(
                    "ratio_level 'sequence' (GSPO) needs loss_aggregation 'sequence_mean' "
                    f"(got {self.loss_aggregation!r}, which weights each sequence by its length); "
                    "set it to 'sequence_mean' or leave it unset"
                )
        return self


class WeightSyncConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: Literal["auto", "distributed", "disk", "tensor"] = Field(
        "auto",
        description="'auto': 'distributed' under cluster.placement disaggregated; colocated, "
        "'tensor' on CPU and on one GPU, 'disk' on several GPUs. Push weights by a torch.distributed broadcast (gloo on CPU, NCCL on GPU), "
        "through an HF safetensors folder on disk, or in memory ('tensor': SGLang's "
        "update_weights_from_tensor with CUDA IPC handles, or shared memory on CPU; only for "
        "engines on the sending trainer rank's own GPU or node's CPU, which refuse it otherwise). "
        "NCCL never puts two ranks on one GPU: engines sharing the trainer's GPU need 'tensor' "
        "or 'disk'.",
    )
    bucket_mb: int = Field(256, ge=1, description="Bucket size of one broadcast round, in MiB.")
    pause_mode: Literal["auto", "abort", "retract", "in_place"] = Field(
        "auto",
        description="Mode sent with /pause_generation before an update. 'abort' returns in-flight "
        "requests with their partial tokens (parked, resumed later); 'retract' (KV freed, "
        "recomputed) and 'in_place' (KV kept) let them continue under the new weights, each "
        "span stamped with the version that produced it. 'auto': 'retract' in mode=async (a "
        "sync happens while the next step generates), 'abort' otherwise (nothing is in flight).",
    )
    disk_dir: str = Field(
        "",
        description="Folder for the HF safetensors written by method=disk (one subfolder per "
        "version, the previous one deleted); empty means <run dir>/weights.",
    )
    timeout_s: float = Field(
        600.0, gt=0, description="Seconds one engine control call or one broadcast may take."
    )
    verify: bool = Field(
        True,
        description="After every sync, each engine scores a fixed probe sequence (the input "
        "logprobs of 32 seeded token ids, under the adapter requests will name) and the trainer "
        "scores it too: the run stops, with the numbers, when an engine's mean |difference| "
        "exceeds verify_tolerance, or when the engine is closer to the previous sync's trainer "
        "than to this one (a sync that did not arrive: a dropped update, an adapter not applied). "
        "Costs one forward of 32 tokens on the trainer and on each engine.",
    )
    verify_tolerance: float = Field(
        0.1, gt=0,
        description="Most mean |logprob difference| per probe token between an engine and the "
        "trainer after a sync. fp32 engines and trainer agree to about 1e-6; bf16 ones to about "
        "0.01-0.05.",
    )


# The HF modules each LoRA target (megatron's fused layer) stands for, in the order the converter
# splits the fused weight: PEFT's target_modules, SGLang's --lora-target-modules.
LORA_HF_MODULES: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "proj": ("o_proj",),
    "fc1": ("gate_proj", "up_proj"), "fc2": ("down_proj",),
}


def lora_hf_modules(targets: list[str]) -> list[str]:
    """The HF modules of these LoRA targets, in order."""
    return [m for t in targets for m in LORA_HF_MODULES[t]]


class LoraConfig(BaseModel):
    """LoRA (train/megatron/lora.py): low-rank adapters on the linear layers, the base frozen."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(
        0, ge=0, le=1024,
        description="Adapter rank r; 0: off (every parameter trained). The optimizer then holds "
        "the adapters alone, and the KL reference (algorithm.kl_coef) is the base model with the "
        "adapters off, with no copy of the weights kept.",
    )
    alpha: float = Field(
        32.0, gt=0,
        description="Scale numerator: the adapter adds (alpha / rank) B A x to the layer's output "
        "(PEFT's lora_alpha).",
    )
    dropout: float = Field(
        0.0, ge=0, lt=1,
        description="Dropout on the adapters' input while training (PEFT's lora_dropout). Above 0 "
        "the trainer's logprobs of a sample differ from the engine's by the dropout's noise.",
    )
    targets: list[Literal["qkv", "proj", "fc1", "fc2"]] = Field(
        default_factory=lambda: ["qkv", "proj", "fc1", "fc2"],
        min_length=1,
        description="Layers adapted, megatron's names: qkv (q/k/v projections, one fused "
        "column-parallel layer: one A shared by q, k and v), proj (attention output), fc1 (gate "
        "and up projections, fused), fc2 (down projection).",
    )
    sync: Literal["adapter", "merged"] = Field(
        "adapter",
        description="What the engines receive after each step. 'adapter': the adapter alone, "
        "loaded beside the base as `policy@v<version>` (in memory under weight_sync.method "
        "tensor, else as a PEFT folder on disk; SGLang's /load_lora_adapter endpoints, which the "
        "built-in engine serves too); new requests name it, and an adapter no request names "
        "any more is unloaded. Nothing pauses: requests in flight finish under the adapter they "
        "began with. 'merged': the full weights with W + (alpha / rank) B A, as without LoRA (an "
        "engine that serves no adapters; colocated runs, whose engines release their base "
        "weights while asleep). The metrics row's sync/adapter says which one ran.",
    )

    resume: Literal["latest", "own"] = Field(
        "latest",
        description="The adapter a parked sample resumes under (sync 'adapter' only). 'latest': "
        "the newest, as without LoRA; its tokens then span versions (recorded per token, "
        "corrected per token by algorithm.off_policy_correction). 'own': the adapter its first "
        "token came from, kept loaded while an unfinished sample names it (up to "
        "keep_versions), so each response is one policy's: stale, never mixed. A sample whose "
        "adapter is gone (past keep_versions; engines restarted) resumes under the newest, "
        "counted as rollout/own_adapter_fallbacks. Multi-turn episodes keep theirs for every "
        "turn.",
    )
    keep_versions: int = Field(
        3, ge=1, le=64,
        description="resume 'own': the adapters each engine keeps at most, the newest "
        "included; of older ones, those named by the most recent unfinished samples stay. "
        "SGLang's --max-loaded-loras must hold them and the ones requests still run under: its "
        "default here is keep_versions + 1 (at least 4).",
    )

    @model_validator(mode="after")
    def _check(self) -> "LoraConfig":
        if self.resume == "own" and self.sync != "adapter":
            raise ValueError("resume: 'own' keeps old adapters loaded on the engines, which only "
                             "sync 'adapter' has (merged sync replaces the weights); set sync: "
                             "adapter or resume: latest")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"targets: a layer named twice in {self.targets}")
        return self


class TrainConfig(BaseModel):
    """Training side (Megatron-core)."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["megatron"] = Field("megatron", description="Training backend.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Device; auto picks cuda when available."
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Parameter dtype; auto is float32 on CPU, bfloat16 on CUDA."
    )
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig, description="Tensor and data parallelism of the trainer.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer and learning-rate schedule.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantage estimator, policy loss, regularisers, off-policy correction.")
    micro_batch_size: int = Field(
        4,
        ge=1,
        description="Samples per forward/backward pass; not used when max_tokens_per_micro_batch "
        "is set (the token budget replaces it).",
    )
    max_tokens_per_micro_batch: int = Field(
        0,
        ge=0,
        description="Token budget of one forward/backward pass; 0 keeps micro-batches by sample "
        "count (micro_batch_size). When set it replaces micro_batch_size: samples are placed "
        "first-fit-decreasing into micro-batches whose dense layout holds at most this many "
        "slots, padding included (packed: rows x row width, rows as wide as pack_row_tokens or "
        "the micro-batch's longest sample; packing false: samples x longest sample), in arrival "
        "order in stream mode; a sample longer than the budget gets a micro-batch of its own and "
        "a warning with its length. A micro-batch then costs at most one row of this many tokens "
        "(budget slots, budget^2 attention-mask entries) whatever the length mix (by count: "
        "micro_batch_size x the longest sample^2); raising pack_row_tokens toward the budget "
        "packs short samples more densely. Data-parallel replicas are balanced by compute "
        "(docs/training.md). global_batch_size need not be a multiple of micro_batch_size then. "
        "Loss and gradient do not depend on it (global normalisation).",
    )
    global_batch_size: int = Field(
        0,
        ge=0,
        description="Samples per optimizer step; 0 means the whole rollout batch "
        "(batch_size x n_samples_per_prompt), i.e. one step per rollout.",
    )
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig, description="How new weights reach the engines after each step.")
    packing: bool = Field(
        True,
        description="Pack several samples of a micro-batch into one row (block-diagonal causal "
        "attention, no padding between them); false gives one padded row per sample.",
    )
    share_prompts: bool = Field(
        True,
        description="With packing: the samples of a micro-batch that start with the same prompt "
        "(a GRPO group's) hold it once in their row, each response attending to it and to its "
        "own tokens only. The same logprobs and gradients up to float rounding, with the prompt's "
        "forward and backward done once per group instead of once per sample (train/packing.py).",
    )
    pack_row_tokens: int = Field(
        0,
        ge=0,
        description="Row capacity when packing; 0 means the longest sample of the micro-batch "
        "(never more work than padding). Larger rows mean fewer of them, but attention cost grows "
        "with the square of the row length.",
    )
    seed: int = Field(1234, description="Seed of the trainer's torch/python RNGs (and of the "
                      "LoRA adapters' initialisation).")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters (off by default).")

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if (self.global_batch_size and not self.max_tokens_per_micro_batch
                and self.global_batch_size % self.micro_batch_size):
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        return self
