"""The optimizer step, CPU and CUDA behind one interface.

CUDA: megatron's own optimizer (`get_megatron_optimizer`: fp32 master weights for bf16 params,
gradient clipping across TP ranks). Run on one H100 at TP=1 (docs/gpu.md;
tests/train/test_megatron_cuda.py, which skips without a GPU); CI runs the CPU path below.

CPU: `get_megatron_optimizer` hard-codes CUDA tensors (docs/facts.md), so a torch AdamW steps the
parameters after `param.grad = param.main_grad` (megatron's DDP accumulates into main_grad; without
that line a torch optimizer silently does nothing). The gradient norm is computed TP-aware:
tensor-parallel shards are summed across the TP group, replicated parameters (norms) counted once.
Like megatron, weight decay applies to matrices only, not to norms and biases.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from rlkit.train.config import OptimizerConfig


class StepOptimizer:
    """The interface of both wrappers; `_opt` is the wrapped optimizer (with param_groups)."""

    _opt: Any

    def step(self) -> tuple[bool, float]:
        """Clip and apply the (already normalised) gradients: (applied, grad_norm)."""
        raise NotImplementedError

    def set_lr(self, lr: float) -> None:
        for g in self._opt.param_groups:
            g["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        return self._opt.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._opt.load_state_dict(state)

    def sharded_state_dict(self, model_sharded: dict[str, Any], *, is_loading: bool) -> dict[str, Any]:
        """The state as megatron-core `dist_checkpointing` describes it: every per-parameter
        tensor (Adam's moments) a ShardedTensor cut exactly like its parameter in
        `model_sharded` (the model's sharded state dict), so a checkpoint written at one
        TP x DP layout loads at another; the step and hyper-parameters as common state.
        `is_loading`: the tensors to load into (the state is created first if no step ran)."""
        raise NotImplementedError

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Take the state `dist_checkpointing.load` filled in (see sharded_state_dict)."""
        raise NotImplementedError


class TorchAdamW(StepOptimizer):
    """CPU: torch AdamW over megatron DDP's main_grad buffers."""

    def __init__(self, model: torch.nn.Module, cfg: OptimizerConfig, tp_group) -> None:
        self._params = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in self._params if p.ndim >= 2]
        no_decay = [p for p in self._params if p.ndim < 2]
        self._opt = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            eps=cfg.eps,
        )
        self._clip = cfg.grad_clip
        self._tp_group = tp_group

    def _grad_norm(self) -> float:
        from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

        sq = torch.zeros(1, dtype=torch.float64)
        for p in self._params:
            if param_is_not_tensor_parallel_duplicate(p):
                sq += p.grad.detach().double().pow(2).sum()
        if self._tp_group is not None and dist.get_world_size(self._tp_group) > 1:
            dist.all_reduce(sq, group=self._tp_group)
        return float(sq.sqrt())

    def step(self) -> tuple[bool, float]:
        for p in self._params:
            p.grad = p.main_grad.to(p.dtype)
        norm = self._grad_norm()
        if not math.isfinite(norm):
            for p in self._params:
                p.grad = None
            return False, norm
        if self._clip > 0 and norm > self._clip:
            scale = self._clip / (norm + 1e-6)
            for p in self._params:
                p.grad.mul_(scale)
        self._opt.step()
        for p in self._params:
            p.grad = None
        return True, norm

    def _ordered_params(self) -> list[torch.nn.Parameter]:
        """Parameters in the order torch's state_dict numbers them (group by group)."""
        return [p for g in self._opt.param_groups for p in g["params"]]

    def sharded_state_dict(self, model_sharded: dict[str, Any], *, is_loading: bool) -> dict[str, Any]:
        # megatron's FP32Optimizer.sharded_state_dict, for torch's AdamW: the moments shard like
        # their parameters; the step, equal for every parameter, is kept once ("common_step").
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map, optim_state_to_sharding_state,
        )

        params = self._ordered_params()
        for p in params:  # before a first step: AdamW's own initial state (a step from it is a
            if p not in self._opt.state:  # first step), to save or to load into
                self._opt.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
        state = self._opt.state_dict()
        steps = {float(s["step"]) for s in state["state"].values()}
        if len(steps) != 1:
            raise ValueError(f"AdamW steps differ between parameters ({sorted(steps)})")
        id_map = get_param_id_to_sharded_param_map(model_sharded, params)
        if len(id_map) != len(params):
            raise ValueError(f"{len(params) - len(id_map)} optimizer parameters have no sharded model tensor")
        optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
        state["common_step"] = steps.pop()
        return state

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        step = float(state.pop("common_step"))
        groups = state["param_groups"]
        mine = self._opt.param_groups
        if len(groups) != len(mine) or any(len(g["params"]) != len(m["params"]) for g, m in zip(groups, mine)):
            raise ValueError("the saved optimizer has other parameter groups than this one")
        per_param = {
            i: {**s, "step": torch.tensor(step)} for i, s in state["state"].items()
        }
        self._opt.load_state_dict({"state": per_param, "param_groups": groups})


class MegatronOptimizer(StepOptimizer):
    """CUDA: megatron's optimizer (mixed precision with fp32 master weights when params are bf16)."""

    def __init__(self, model: torch.nn.Module, cfg: OptimizerConfig, params_dtype: torch.dtype) -> None:
        from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
        from megatron.core.optimizer import get_megatron_optimizer

        self._opt = get_megatron_optimizer(
            MegatronOptimizerConfig(
                optimizer="adam",
                lr=cfg.lr,
                weight_decay=cfg.weight_decay,
                adam_beta1=cfg.betas[0],
                adam_beta2=cfg.betas[1],
                adam_eps=cfg.eps,
                clip_grad=cfg.grad_clip,
                bf16=params_dtype == torch.bfloat16,
                params_dtype=params_dtype,
                use_distributed_optimizer=False,
            ),
            [model],
        )

    def step(self) -> tuple[bool, float]:
        applied, grad_norm, _ = self._opt.step()
        self._opt.zero_grad()
        return bool(applied), float(grad_norm) if grad_norm is not None else float("nan")

    # megatron's own sharded optimizer state (fp32 master weights and moments); not run here:
    # no GPU in the test set-up (docs/training.md, checkpoints).
    def sharded_state_dict(self, model_sharded: dict[str, Any], *, is_loading: bool) -> dict[str, Any]:
        return self._opt.sharded_state_dict(model_sharded, is_loading=is_loading)

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        self._opt.load_state_dict(state)


def build_optimizer(
    model: torch.nn.Module, cfg: OptimizerConfig, device: torch.device, params_dtype: torch.dtype
) -> StepOptimizer:
    if device.type == "cuda":
        return MegatronOptimizer(model, cfg, params_dtype)
    from megatron.core import parallel_state

    return TorchAdamW(model, cfg, parallel_state.get_tensor_model_parallel_group())


def learning_rate(cfg: OptimizerConfig, step: int) -> float:
    """Linear warm-up over `warmup_steps` optimizer steps, then constant."""
    if cfg.warmup_steps <= 0:
        return cfg.lr
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps)
