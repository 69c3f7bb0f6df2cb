"""MegatronTrainer: the Trainer protocol for one rank of a megatron-core TP x DP world.

Every rank of the world runs one MegatronTrainer; the TP ranks of one DP replica receive the
same samples, different DP replicas different samples (`train.ray_group.TrainerGroup` splits
batches and calls every rank). A world of one (`MegatronTrainer.single_process`) serves tests,
benchmarks and the export command.

Gradient normalisation (why streaming equals sync): `accumulate` backpropagates loss
*numerators* (sums over tokens) and adds up the matching denominators. `step` all-reduces
gradients and denominators over DP and divides by the global denominator
(megatron's `finalize_model_grads(num_tokens=...)`, with `calculate_per_token_loss=True` so the DP
reduction is a sum), then clips and steps. Any split of a global batch into micro-batches, in any
order, therefore yields the same gradient up to float summation order.

Micro-batches (train/microbatch_plan.py): by sample count (`train.micro_batch_size`) or by token
budget (`train.max_tokens_per_micro_batch`), planned here for a batch that comes without a plan,
or taken from `TrainBatch.micro_batch_plan` (the driver's or the stream's plan for every DP
replica); an empty micro-batch there is a zero-weight forward and backward, so every replica
runs as many passes, and makes the same collective calls, as the busiest.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from rlkit.common.weight_update import WeightUpdate
from rlkit.train.algorithms.losses import PolicyLossInput, loss_terms
from rlkit.train.algorithms.mismatch import empty as mismatch_empty, metrics as mismatch_metrics
from rlkit.train.batch import TrainBatch, TrainSample
from rlkit.train.config import TrainConfig
from rlkit.train.convert import hf_to_megatron, megatron_param_names, megatron_param_to_hf
from rlkit.train.hf_arch import ModelArch
from rlkit.train.hf_io import load_hf_state_dict, read_config, save_hf_folder
from rlkit.train.megatron.colocation import Colocation
from rlkit.train.megatron.logprobs import vocab_parallel_logprobs
from rlkit.train.megatron.optimizer import build_optimizer, learning_rate
from rlkit.train.megatron.parallel import (
    RankInfo, current_rank_info, init_single_process, resolve_device, seed_everything,
)
from rlkit.train.microbatch_plan import attention_weight_of, plan_micro_batches, warn_over_budget
from rlkit.train.packing import PackedRows, pack_samples
from rlkit.train.protocol import Policy


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


class MegatronTrainer:
    """One rank. torch.distributed and megatron's parallel state must already be initialised."""

    def __init__(self, model_path: str | Path, config: TrainConfig, *, temperature: float = 1.0) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from rlkit.train.megatron.model import build_gpt_model

        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.config = config
        self.temperature = float(temperature)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.rank: RankInfo = current_rank_info()
        if self.rank.tp_size != config.parallelism.tensor:
            raise ValueError(
                f"train.parallelism.tensor={config.parallelism.tensor} but megatron was initialised "
                f"with TP={self.rank.tp_size}"
            )
        self.model_path = Path(model_path)
        self.hf_config = read_config(self.model_path)
        self.arch = ModelArch.from_hf_config(self.hf_config)
        self.arch.check_tensor_parallel(self.rank.tp_size)
        self._tp_group = (
            parallel_state.get_tensor_model_parallel_group() if self.rank.tp_size > 1 else None
        )
        self._vocab_start = self.rank.tp_rank * (self.arch.vocab_size // self.rank.tp_size)

        seed_everything(config.seed + self.rank.rank)
        module = build_gpt_model(self.arch, params_dtype=self.dtype, device=self.device)
        self._load_megatron_state(
            hf_to_megatron(
                load_hf_state_dict(self.model_path), self.arch, self.rank.tp_size, self.rank.tp_rank
            ),
            module,
        )
        # LoRA (train.lora): adapters added, the base frozen, before DDP sizes its gradient
        # buffers and the optimizer takes the trainable parameters (the adapters only)
        self.lora: dict[str, Any] = {}
        if config.lora.rank > 0:
            from rlkit.train.megatron.lora import apply_lora

            lc = config.lora
            self.lora = apply_lora(module, rank=lc.rank, alpha=lc.alpha, dropout=lc.dropout,
                                   targets=list(lc.targets), seed=config.seed,
                                   tp_rank=self.rank.tp_rank, tp_size=self.rank.tp_size)
        self.model = DistributedDataParallel(
            config=module.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
            ),
            module=module,
        )
        self.optimizer = build_optimizer(self.model, config.optimizer, self.device, self.dtype)
        self._reference: dict[str, torch.Tensor] | None = None
        if config.algorithm.kl_coef > 0 and not self.lora:  # with LoRA: the adapters off
            self._reference = {n: p.detach().clone() for n, p in self.module.named_parameters()}

        self._sender = None  # WeightSender, on the rank that talks to engines
        self.colocation = Colocation(self)  # colocated placement's turns on the GPU (offload on first use)
        self._warned_nccl = False
        # 'dense': rows with a block-diagonal mask (megatron's local attention). 'thd' is the seam
        # for TransformerEngine's varlen attention (train/packing.py): it needs the TE layer spec,
        # which model.py does not build (no TE here: CPU machines), so it is never chosen today.
        self.attention_layout = "dense"
        self._nccl_check: dict[tuple[str, ...], Any] = {}  # engines -> sender's NcclCheck
        self._nccl_unchecked: set[str] = set()  # engines said to be unchecked (once each)
        self.step_count = 0  # optimizer steps taken
        self.version = 0  # policy version of these weights, as engines were told (see sync)
        self._reset_accumulation()

    @classmethod
    def single_process(
        cls, model_path: str | Path, config: TrainConfig, *, temperature: float = 1.0
    ) -> "MegatronTrainer":
        if config.parallelism.tensor != 1 or config.parallelism.data != 1:
            raise ValueError("single_process runs TP=1, DP=1; use train.ray_group.TrainerGroup")
        init_single_process(resolve_device(config.device), config.seed)
        return cls(model_path, config, temperature=temperature)

    # -- model access ------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        """The bare GPTModel (inside megatron's DDP wrapper)."""
        return self.model.module

    def megatron_state(self) -> dict[str, torch.Tensor]:
        """This rank's parameters, Megatron names (no DDP prefix, no _extra_state)."""
        return {n: p.detach() for n, p in self.module.named_parameters()}

    def _load_megatron_state(self, state: dict[str, torch.Tensor], module: torch.nn.Module | None = None) -> None:
        from rlkit.train.megatron.lora import is_adapter_parameter

        module = module if module is not None else self.module
        params = dict(module.named_parameters())
        adapters = {n for n in params if is_adapter_parameter(n)}
        if adapters and adapters & set(state):  # a checkpoint of this LoRA run: adapters too
            expected = set(megatron_param_names(self.arch)) | adapters
        else:  # the base model (HF weights; adapters are added after it, or B = 0 already)
            params = {n: p for n, p in params.items() if n not in adapters}
            expected = set(megatron_param_names(self.arch))
        if set(params) != expected:
            raise RuntimeError(
                "GPTModel parameters do not match the converter's names: "
                f"model-only {sorted(set(params) - expected)}, converter-only "
                f"{sorted(expected - set(params))}"
            )
        with torch.no_grad():
            for name, p in params.items():
                src = state[name]
                if tuple(src.shape) != tuple(p.shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model {tuple(p.shape)}")
                p.copy_(src.to(device=p.device, dtype=p.dtype))

    def lora_merge_plan(self) -> dict[str, list]:
        """For checkpoints and export: each adapted weight's [A name, B name, scale]."""
        prefix = {a: n for n, a in self.lora.items()}
        plan: dict[str, list] = {}
        for name, adapter in self.module.named_modules():
            if adapter in prefix:
                plan[prefix[adapter]] = [f"{name}.a", f"{name}.b", adapter.scale]
        return plan

    @property
    def attention_weight(self) -> float:
        """w of the planner's sample cost n + w n^2 for this model (train/microbatch_plan.py)."""
        return attention_weight_of(self.arch)

    # -- forward -----------------------------------------------------------------------------
    def _micro_batches(self, batch: TrainBatch, *, warn: bool) -> list[tuple[int, ...]]:
        """Positions in `batch` per micro-batch: the batch's own plan (() = empty work), or one
        planned here for this batch alone (by token budget or by count)."""
        if batch.micro_batch_plan is not None:
            return list(batch.micro_batch_plan)
        cfg = self.config
        lengths = [s.length for s in batch.samples]
        if warn:
            warn_over_budget(lengths, cfg.max_tokens_per_micro_batch)
        return list(plan_micro_batches(
            lengths, max_tokens=cfg.max_tokens_per_micro_batch, micro_batch_size=cfg.micro_batch_size,
            padded=not cfg.packing, row_tokens=cfg.pack_row_tokens,
        ).replicas[0])

    def _pack(self, samples: Sequence[TrainSample]) -> PackedRows:
        return pack_samples(
            [s.tokens for s in samples],
            [s.prompt_length for s in samples],
            self.config.pack_row_tokens,
            pack=self.config.packing,
            layout=self.attention_layout,
            share_prompts=self.config.share_prompts,
        )

    def _forward(self, packed: PackedRows, *, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.device
        if packed.cu_seqlens is not None:  # THD (TransformerEngine only; see attention_layout)
            from megatron.core.packed_seq_params import PackedSeqParams

            cu = packed.cu_seqlens.to(dev)
            logits = self.model(
                input_ids=packed.input_ids.to(dev), position_ids=packed.position_ids.to(dev),
                attention_mask=None, packed_seq_params=PackedSeqParams(
                    qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                    max_seqlen_q=packed.max_seqlen, max_seqlen_kv=packed.max_seqlen),
            )  # [R, S, V / TP]
            rows = logits.reshape(-1, logits.shape[-1]).index_select(0, packed.logit_index.to(dev))
        else:
            rows = self._response_logits(packed)
        if self.temperature != 1.0:
            rows = rows.float() / self.temperature
        return vocab_parallel_logprobs(
            rows,
            packed.target_ids.to(dev),
            vocab_start=self._vocab_start,
            group=self._tp_group,
            with_entropy=with_entropy,
        )

    def _response_logits(self, packed: PackedRows) -> torch.Tensor:
        """[T, V / TP]: the logits that predict the T response tokens, and no others.

        GPTModel's forward (embedding, decoder, output layer) with two changes. RoPE comes from
        each token's `position_ids`, where GPTModel takes its slot in the row: a shared prompt's
        responses continue its positions (train/packing.py). And the output layer runs on the T
        positions that predict a response token, not on every slot: the prompts' logits are
        never used (on the default recipe they are 60% of the slots, and the output layer a
        fifth of a 135M model's work per token)."""
        m, dev = self.module, self.device
        ids, pos = packed.input_ids.to(dev), packed.position_ids.to(dev)
        hidden = m.embedding(input_ids=ids, position_ids=pos)  # [S, R, H]
        # megatron's own frequencies [P, 1, 1, D], as long as the CPU positions say (no device sync)
        table = m.rotary_pos_emb(int(packed.position_ids.max()) + 1)
        rope = table[:, 0, 0, :][pos].transpose(0, 1).unsqueeze(2)  # [S, R, 1, D]
        hidden = m.decoder(hidden_states=hidden, attention_mask=packed.attention_mask.to(dev),
                           rotary_pos_emb=rope)  # [S, R, H]
        rows = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1]).index_select(
            0, packed.logit_index.to(dev))
        weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else None
        logits, _ = m.output_layer(rows.unsqueeze(1), weight=weight)  # [T, 1, V / TP]
        return logits.squeeze(1)

    @contextlib.contextmanager
    def _weights(self, policy: Policy) -> Iterator[None]:
        if policy == "current":
            yield
            return
        if self.lora:  # the reference is the base model: the adapters off
            from rlkit.train.megatron.lora import disabled

            with disabled(self.lora):
                yield
            return
        if self._reference is None:
            raise ValueError("reference logprobs need train.algorithm.kl_coef > 0 (no reference kept)")
        params = dict(self.module.named_parameters())
        saved = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(self._reference[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(saved[n])

    # -- Trainer protocol --------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, *, policy: Policy = "current") -> list[torch.Tensor]:
        """Per-sample logprobs of the response tokens (fp32, CPU), micro-batch by micro-batch."""
        out: list[torch.Tensor | None] = [None] * len(batch)
        with self._weights(policy):
            for mb in self._micro_batches(batch, warn=False):
                if not mb:  # empty work only matters to the backward's collectives
                    continue
                packed = self._pack([batch.samples[i] for i in mb])
                lp, _ = self._forward(packed, with_entropy=False)
                # clone: a view would pickle (Ray) the whole micro-batch's storage with each sample
                for i, t in zip(mb, lp.float().cpu().split(packed.response_lengths)):
                    out[i] = t.clone()
        return out  # type: ignore[return-value]

    def accumulate(self, batch: TrainBatch) -> dict[str, float]:
        """Forward + backward of every micro-batch of `batch`; no optimizer step."""
        with_entropy = self.config.algorithm.entropy_coef > 0
        stats = {"samples": 0.0, "tokens": 0.0, "denominator": 0.0, "micro_batches": 0.0}
        self.model.train()
        for mb in self._micro_batches(batch, warn=True):
            self._micro_batch_count += 1
            stats["micro_batches"] += 1
            if not mb:
                self._empty_work()
                continue
            samples = [batch.samples[i] for i in mb]
            packed = self._pack(samples)
            lp, entropy = self._forward(packed, with_entropy=with_entropy)
            inp = self._loss_input(samples, packed, lp, entropy, with_entropy, batch.policy_version)
            terms = loss_terms(inp, self.config.algorithm)
            terms.numerator.backward()
            self._denominator += terms.denominator
            for k, v in terms.metric_sums.items():
                self._metric_sums[k] += v
            if terms.telemetry is not None:
                self._mismatch += terms.telemetry
            self._rejected_samples += terms.rejected_samples
            self._samples += len(mb)
            self._tokens += packed.tokens
            self._slots += packed.slots
            self._shared += packed.shared
            stats["samples"] += len(mb)
            stats["tokens"] += packed.tokens
            stats["denominator"] += terms.denominator
        return stats

    def _empty_work(self) -> None:
        """A micro-batch with no sample (padding, so DP replicas run equally many): a forward
        and backward of one 2-token dummy row through the same code, at zero weight. It adds
        exactly 0 to every gradient and nothing to the denominator, samples or tokens."""
        dummy = torch.zeros(2, dtype=torch.long)
        lp, _ = self._forward(pack_samples([dummy], [1], layout=self.attention_layout), with_entropy=False)
        (lp.sum() * 0.0).backward()
        self._empty_micro_batches += 1

    def _loss_input(
        self,
        samples: Sequence[TrainSample],
        packed: PackedRows,
        lp: torch.Tensor,
        entropy: torch.Tensor,
        with_entropy: bool,
        policy_version: int,
    ) -> PolicyLossInput:
        dev = lp.device

        def cat(attr: str) -> torch.Tensor | None:
            values = [getattr(s, attr) for s in samples]
            have = [v is not None for v in values]
            if not any(have):
                return None
            if not all(have):
                raise ValueError(f"{attr}: set for some samples of a micro-batch and not others")
            for s, v in zip(samples, values):
                if v.numel() != s.response_length:
                    raise ValueError(
                        f"sample {s.index}: {attr} has {v.numel()} values for "
                        f"{s.response_length} response tokens"
                    )
            return torch.cat(values).to(dev)

        sample_ids = packed.sample_ids.to(dev)
        versions = cat("versions")  # None: samples built without them, no telemetry
        advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32, device=dev)
        return PolicyLossInput(
            logprobs=lp,
            advantages=advantages[sample_ids],
            loss_mask=cat("loss_mask"),  # type: ignore[arg-type]
            sample_ids=sample_ids,
            num_samples=len(samples),
            old_logprobs=cat("old_logprobs"),
            rollout_logprobs=cat("rollout_logprobs"),
            ref_logprobs=cat("ref_logprobs"),
            teacher_logprobs=cat("teacher_logprobs"),  # on-policy distillation; None without
            entropy=entropy if with_entropy else None,
            token_lag=None if versions is None else policy_version - versions.long(),
            resumed=torch.cat([torch.full((s.response_length,), s.resumed) for s in samples]).to(dev),
        )

    def _finalize_grads(self) -> float:
        """All-reduce gradients and denominators over DP, divide by the global denominator;
        returns that denominator."""
        from megatron.core.distributed import finalize_model_grads

        denominator = torch.tensor([self._denominator], dtype=torch.float32, device=self.device)
        finalize_model_grads([self.model], num_tokens=denominator)  # DP sum, then / denominator
        return float(denominator)

    def step(self) -> dict[str, float]:
        """Normalise the accumulated gradients by the global denominator, clip, step, zero."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        global_denominator = self._finalize_grads()
        present = [1.0 if k in self._metric_sums else 0.0 for k in self._metric_keys]
        counters = torch.tensor(  # on the device: NCCL reduces CUDA tensors only
            [self._samples, self._tokens, self._slots, self._micro_batch_count,
             self._empty_micro_batches, self._rejected_samples, self._shared, *self._metric_sums_vector(),
             *present, *self._mismatch.tolist()],
            dtype=torch.float64,
            device=self.device,
        )
        if self.rank.dp_size > 1:
            dist.all_reduce(counters, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        lr = learning_rate(self.config.optimizer, self.step_count)
        self.optimizer.set_lr(lr)
        if global_denominator > 0:
            applied, grad_norm = self.optimizer.step()
        else:
            applied, grad_norm = False, 0.0
        self.model.zero_grad_buffer()
        if applied:
            self.step_count += 1
        counters = counters.cpu()
        samples, tokens, slots, micro_batches, empty, rejected, shared = (float(x) for x in counters[:7])
        n_keys = len(self._metric_keys)
        sums, seen = counters[7 : 7 + n_keys], counters[7 + n_keys : 7 + 2 * n_keys]
        mismatch = counters[7 + 2 * n_keys :]
        metrics = {
            f"train/{k}": float(v) / global_denominator if global_denominator > 0 else 0.0
            for k, v, flag in zip(self._metric_keys, sums, seen)
            if flag > 0
        }
        metrics.update(
            {
                "train/grad_norm": grad_norm,
                "train/lr": lr,
                "train/step_applied": float(applied),
                "train/samples": samples,
                "train/tokens": tokens,
                "train/padding_fraction": 1.0 - (tokens - shared) / slots if slots else 0.0,
                # prompt tokens not run again: the siblings of a group share one copy
                "train/shared_prompt_tokens": shared,
                "train/micro_batches": micro_batches,  # over every DP replica, empty ones too
                "train/empty_micro_batches": empty,
                "train/loss_denominator": global_denominator,
                "train/step": float(self.step_count),
                "train/rejected_samples": rejected,
                **mismatch_metrics(mismatch),
            }
        )
        self._reset_accumulation()
        return metrics

    # Metric names in a fixed order so DP ranks all-reduce matching vectors.
    _metric_keys = (
        "loss",
        "pg_loss",
        "clip_frac",
        "ratio",
        "approx_kl_old",
        "kl",
        "entropy",
        "is_weight",
        "is_truncated_frac",
        "is_masked_frac",
        "is_rejected_frac",
        "train_rollout_logprob_abs_diff",
        "distill_reverse_kl",
        "distill_advantage",
    )

    def _metric_sums_vector(self) -> list[float]:
        unknown = set(self._metric_sums) - set(self._metric_keys)
        if unknown:
            raise RuntimeError(f"loss produced metrics {sorted(unknown)} missing from _metric_keys")
        return [self._metric_sums.get(k, 0.0) for k in self._metric_keys]

    def _reset_accumulation(self) -> None:
        self._denominator = 0.0
        self._metric_sums: dict[str, float] = defaultdict(float)
        self._samples = 0
        self._tokens = 0
        self._slots = 0
        self._shared = 0
        self._micro_batch_count = 0
        self._empty_micro_batches = 0
        self._rejected_samples = 0
        self._mismatch = mismatch_empty()  # mismatch.SIZE sums, over this step's micro-batches

    def discard_gradients(self) -> None:
        """Drop everything accumulated since the last step (gradients, denominators, metrics)."""
        self.model.zero_grad_buffer()
        self._reset_accumulation()

    @property
    def pending_samples(self) -> int:
        """Samples accumulated since the last step."""
        return self._samples

    def main_grads(self) -> dict[str, torch.Tensor]:
        """Copies of the accumulated gradient buffers (tests)."""
        return {n: p.main_grad.detach().clone() for n, p in self.module.named_parameters()}

    def finalize_grads_for_test(self) -> dict[str, torch.Tensor]:
        """Run the step's normalisation only and return the normalised gradients (tests)."""
        self._finalize_grads()
        return self.main_grads()

    # -- weights for sync and export --------------------------------------------------------
    def _tp_shards(self, local: torch.Tensor) -> list[torch.Tensor]:
        """This tensor's shard from every rank of the TP group, in rank order (collective)."""
        if self.rank.tp_size == 1:
            return [local]
        import torch.distributed as dist

        shards = [torch.empty_like(local) for _ in range(self.rank.tp_size)]
        dist.all_gather(shards, local.contiguous(), group=self._tp_group)
        return shards

    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF tensors, in model order. Collective over the TP group: every TP rank of the
        replica must iterate; only TP rank 0 receives tensors (the others get an empty stream)."""
        params = dict(self.module.named_parameters())
        for name in megatron_param_names(self.arch):
            local = params[name].detach()
            if name in self.lora:  # merged: W + (alpha / r) B A, this rank's shard of it
                local = local + self.lora[name].delta().detach().to(local.dtype)
            shards = self._tp_shards(local)
            if self.rank.tp_rank == 0:
                yield from megatron_param_to_hf(name, shards, self.arch)

    def iter_adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The LoRA adapters in PEFT's names and HF's layout (one A and B per HF module). Collective
        over the TP group like iter_hf_weights: only TP rank 0 receives tensors."""
        from rlkit.train.megatron.lora import adapter_to_hf, peft_tensor_names

        for name, adapter in self.lora.items():
            a_shards, b_shards = self._tp_shards(adapter.a.detach()), self._tp_shards(adapter.b.detach())
            if self.rank.tp_rank == 0:
                for module, a, b in adapter_to_hf(name, a_shards, b_shards, self.arch):
                    name_a, name_b = peft_tensor_names(module)
                    yield name_a, a.contiguous()
                    yield name_b, b.contiguous()

    def peft_config(self) -> dict:
        from rlkit.train.megatron.lora import peft_config

        lc = self.config.lora
        if not self.lora:
            raise ValueError("no LoRA adapters: train.lora.rank is 0")
        return peft_config(rank=lc.rank, alpha=lc.alpha, dropout=lc.dropout,
                           targets=list(lc.targets), base_model=str(self.model_path))

    def export_adapter(self, path: str | Path) -> Path | None:
        """Write the adapters as a PEFT folder (collective over TP; TP rank 0 of DP replica 0
        writes it)."""
        from rlkit.train.megatron.lora import write_peft_folder

        config = self.peft_config()
        with self.colocation.on_device():
            tensors = dict(self.iter_adapter_tensors())
        if self.rank.dp_rank != 0 or self.rank.tp_rank != 0:
            return None
        return write_peft_folder(path, tensors, config)

    def _sender_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]] | None:
        """The HF weight stream on DP rank 0 / TP rank 0 (None elsewhere). The other TP ranks of
        DP replica 0 take part in its all-gathers here; consume the stream on TP rank 0."""
        if self.rank.dp_rank != 0:
            return None
        weights = self.iter_hf_weights()
        if self.rank.tp_rank == 0:
            return weights
        for _ in weights:
            pass
        return None

    def export_hf(self, path: str | Path) -> Path | None:
        """Write an HF model folder (collective over TP; DP rank 0 / TP rank 0 writes it)."""
        with self.colocation.on_device():
            weights = self._sender_hf_weights()
            if weights is None:
                return None
            return save_hf_folder(path, weights, self.hf_config, side_files_from=self.model_path)

    def publish_weights(self, update: WeightUpdate) -> dict[str, float] | None:
        """Publish the current weights into `update` (opened by the rollout side, which owns
        the engines: rollout/engine_updates.py) and take its version. With no engine (every one
        lost, see rollout.health) only the version moves: the weights are that version's all
        the same, and a checkpoint must say so. Collective: call it on every rank (the TP ranks
        of replica 0 take part in the all-gathers; global rank 0 sends).

        `update.colocated`: the turn to generation: the parameters leave the device once sent
        (gradients and optimizer state left it at the end of training, `free_device`), before
        the engines take their KV cache back. Metrics on rank 0 (the sync's figures and the
        memory moved), None elsewhere."""
        ws = self.config.weight_sync
        if update.version < self.version:
            raise ValueError(f"publish_weights: version {update.version} is older than {self.version}")
        moved: dict[str, float] = {}
        # the probe before sending: colocated, the parameters leave the device once sent
        probe = self.probe_logprobs() if update.probe else None
        after_send = self.colocation.publishing(moved) if update.colocated else None
        report = None
        weights = None
        if update.adapter is not None:  # LoRA adapter sync: the adapter alone
            report = self._publish_adapter(update, ws) if update.engines else None
        elif update.engines:
            weights = self._sender_hf_weights()
        if weights is not None:
            sender = self._weight_sender()
            method = update.method
            if method == "distributed" and self.device.type == "cuda" and (update.folder or ws.disk_dir):
                method = self._nccl_safe(sender, update.engines)
            if method == "disk" and update.folder is None and ws.disk_dir:
                update = dataclasses.replace(update, folder=str(ws.disk_dir))
            report = sender.publish(
                update, weights, method=method, after_send=after_send,
                write=lambda p, w: save_hf_folder(p, w, self.hf_config, side_files_from=self.model_path))
        elif after_send is not None:  # this rank's part (the TP all-gathers) is done, or no engine
            after_send()
        self.version = update.version
        if self.rank.rank != 0:
            return None
        out = dict(moved)
        if self.lora:  # which LoRA sync ran (train.lora.sync): the adapter alone, or merged
            out["sync/adapter"] = float(update.adapter is not None)
        if probe is not None:  # lists: the rollout side takes them out of the metrics
            out["sync/probe_ids"], out["sync/probe_logprobs"], base = probe  # type: ignore[assignment]
            if base is not None:
                out["sync/probe_base_logprobs"] = base  # type: ignore[assignment]
        if report is not None:
            out.update({"sync/bytes": float(report.bytes), "sync/buckets": float(report.buckets),
                        "sync/send_seconds": report.seconds_paused,
                        "sync/stage_seconds": report.seconds_stage})
        if update.colocated:
            self.colocation.generating(out)
        return out

    def _publish_adapter(self, update: WeightUpdate, ws):
        """The LoRA adapter into an adapter update (collective over TP: the gathers; DP rank 0 /
        TP rank 0 sends): in memory when the update's method is `tensor`, else a PEFT folder."""
        from rlkit.train.megatron.lora import write_peft_folder

        if not self.lora:
            raise ValueError(f"update {update.version} names adapter {update.adapter!r}, but this "
                             "trainer has no LoRA adapters (train.lora.rank is 0)")
        config = self.peft_config()
        tensors = list(self.iter_adapter_tensors()) if self.rank.dp_rank == 0 else []
        if self.rank.dp_rank != 0 or self.rank.tp_rank != 0:
            return None
        method = "tensor" if update.method == "tensor" else "disk"
        if method == "disk" and update.folder is None and ws.disk_dir:
            update = dataclasses.replace(update, folder=str(ws.disk_dir))
        return self._weight_sender().publish_adapter(
            update, tensors, config, method=method,
            write=lambda p: write_peft_folder(p, dict(tensors), config))

    PROBE_TOKENS = 32

    def probe_logprobs(self) -> tuple[list[int], list[float], list[float] | None]:
        """The weight-sync check's probe (train.weight_sync.verify): 32 token ids drawn from the
        vocabulary with a fixed seed, and this model's logprob of each after the first, at the
        sampling temperature (as an engine scores its input); with LoRA also the base model's
        (the adapters off): an engine serving the base instead is told apart. Collective like
        logprobs."""
        ids = torch.randint(0, self.arch.vocab_size, (self.PROBE_TOKENS,),
                            generator=torch.Generator().manual_seed(20261128))
        sample = TrainSample(index=0, group_id=0, tokens=ids, prompt_length=1,
                             loss_mask=torch.ones(len(ids) - 1), rollout_logprobs=torch.zeros(len(ids) - 1),
                             advantage=0.0, reward=0.0, min_version=self.version,
                             max_version=self.version)
        batch = TrainBatch([sample], self.version)
        with self.colocation.on_device():
            lp = self.logprobs(batch)[0]
            base = self.logprobs(batch, policy="reference")[0].tolist() if self.lora else None
        return ids.tolist(), lp.tolist(), base

    def free_device(self) -> dict[str, float]:
        """Colocated, the end of training: gradients and optimizer state leave the device."""
        return self.colocation.free_device()

    def take_device(self) -> dict[str, float]:
        """Colocated, the turn to training (the engines sleep): the state comes back. Metrics."""
        return self.colocation.take_device()

    def _nccl_safe(self, sender, engines: Sequence[str]) -> str:
        """'distributed', or 'disk' (said once) when an engine shares a GPU with this rank or
        with another engine: NCCL never takes two ranks on one GPU, whatever the placement.
        Engines that report no GPU (SGLang) cannot be checked: said once, by name."""
        import warnings

        from rlkit.train.weight_sync.in_memory import gpu_uuid

        key = tuple(engines)
        if key not in self._nccl_check:  # asked once per set of engines, as the group is formed
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            check = self._nccl_check[key] = sender.nccl_conflict(engines, gpu_uuid(index))
            unknown = [u for u in check.unchecked if u not in self._nccl_unchecked]
            if unknown and check.clash is None:
                self._nccl_unchecked.update(unknown)
                warnings.warn(
                    f"weight sync: cannot check that {', '.join(unknown)} share no GPU with this "
                    "trainer rank or with another engine (they report no GPU in /server_info, as "
                    "SGLang does not). Under the run's Ray each engine's GPUs are its bundle's "
                    "alone and colocated runs never use NCCL, so only engines started outside the "
                    "run can share one; if NCCL then fails with 'Duplicate GPU detected', set "
                    "train.weight_sync.method: disk", stacklevel=2)
        clash = self._nccl_check[key].clash
        if clash is None:
            return "distributed"
        if not self._warned_nccl:
            self._warned_nccl = True
            warnings.warn(f"weight sync by disk instead of the NCCL broadcast: {clash}", stacklevel=2)
        return "disk"

    def _weight_sender(self):
        from rlkit.train.weight_sync.sender import WeightSender

        if self._sender is None:
            ws = self.config.weight_sync
            self._sender = WeightSender(bucket_mb=ws.bucket_mb, timeout_s=ws.timeout_s)
        return self._sender

    @property
    def offload(self):
        """Moves this rank's parameters, gradients and optimizer state off the device and back
        (train/megatron/offload.py)."""
        return self.colocation.offload

    def attach_sender(self, sender) -> None:
        """Use this WeightSender (e.g. with loopback receivers) instead of the HTTP default."""
        if self._sender is not None:
            self._sender.close()
        self._sender = sender

    def close(self) -> None:
        """Leave the engines' weight-update group, if any."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None

    # -- checkpoints ------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        from rlkit.train.megatron.checkpoint import save_checkpoint

        with self.colocation.on_device():  # colocated: between steps the state is off the device
            save_checkpoint(self, Path(path))

    def load(self, path: str | Path) -> None:
        from rlkit.train.megatron.checkpoint import load_checkpoint

        with self.colocation.on_device():
            load_checkpoint(self, Path(path))

