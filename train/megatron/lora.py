"""LoRA adapters on megatron-core's linear layers (recipe `train.lora`).

Each targeted linear layer W gets y = W x + (alpha / r) B A x: A [r, in] and B [out, r], B zero
at the start (the model is the base model exactly), the base frozen, the optimizer holding A and
B only. The adapters are children of the layer's owner (`self_attention`, `mlp`), named
`<layer>_lora` (`linear_qkv_lora.a`), and act through a forward hook on the layer, so the base
parameters keep their names (the converter, weight sync and checkpoints see the same model).

Tensor parallelism (megatron's own layout, no extra communication in the base layers):
- column-parallel layers (qkv, fc1: output split over TP): A is replicated, B split on its output
  dimension like W. A x is computed whole on every rank; its gradient sums every rank's B shard
  (copy_to_tensor_model_parallel_region: identity forward, all-reduce backward), so A's gradient
  and update are equal on every rank.
- row-parallel layers (proj, fc2: input split over TP): A split on its input dimension like W, B
  replicated. Each rank's A x_local is summed over TP (reduce_from_tensor_model_parallel_region)
  before B, which every rank then applies to the same input.
A is drawn whole from a generator seeded by the recipe's seed and the layer, then cut, so any TP
size starts from the same adapters and trains like TP=1.

The reference model (KL) is this model with the adapters off (`disabled`): no copy is kept.
`delta(name)` is this rank's shard of (alpha / r) B A in W's layout: merged weights for the
engines and for export are W + delta.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch

from rlkit.train.config import lora_hf_modules

# recipe name -> (owner attribute in a transformer layer, layer attribute, parallel kind)
TARGETS: dict[str, tuple[str, str, str]] = {
    "qkv": ("self_attention", "linear_qkv", "column"),
    "proj": ("self_attention", "linear_proj", "row"),
    "fc1": ("mlp", "linear_fc1", "column"),
    "fc2": ("mlp", "linear_fc2", "row"),
}


class LoraAdapter(torch.nn.Module):
    """A and B of one linear layer, this rank's shards (see the module docstring)."""

    def __init__(self, kind: str, in_features: int, out_features: int, rank: int, alpha: float,
                 dropout: float, tp_rank: int, tp_size: int, generator: torch.Generator,
                 dtype: torch.dtype, device: torch.device, *, gated: bool = False) -> None:
        super().__init__()
        if kind not in ("column", "row"):
            raise ValueError(f"LoRA on a {kind!r} layer: column or row only")
        self.kind, self.rank, self.scale = kind, rank, alpha / rank
        # SwiGLU's fc1: each rank's rows are [its gate rows; its up rows], as the weight's
        self.gated = gated
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else None
        self.enabled = True
        # PEFT's initialisation: A ~ kaiming-uniform(a=sqrt(5)) over the whole input, B = 0
        bound = 1.0 / math.sqrt(in_features)
        a = (torch.rand(rank, in_features, generator=generator, dtype=torch.float64) * 2 - 1) * bound
        if kind == "row":  # A is cut on the input dimension, like W
            a = a.chunk(tp_size, dim=1)[tp_rank]
            b = torch.zeros(out_features, rank)
        else:  # B is cut on the output dimension, like W
            b = torch.zeros(out_features // tp_size, rank)
        self.a = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
        self.b = torch.nn.Parameter(b.to(device=device, dtype=dtype))
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        # the split one: the optimizer's gradient norm sums it over TP ranks (the replicated one
        # counts once), and checkpoints cut it like W
        set_tensor_model_parallel_attributes(
            self.a if kind == "row" else self.b, is_parallel=True, dim=1 if kind == "row" else 0,
            stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
        )

        if self.dropout is not None:
            x = self.dropout(x)
        h = torch.nn.functional.linear(x, self.a)
        if self.kind == "column":
            h = copy_to_tensor_model_parallel_region(h) if self.tp_size > 1 else h
        else:
            h = reduce_from_tensor_model_parallel_region(h) if self.tp_size > 1 else h
        return torch.nn.functional.linear(h, self.b) * self.scale

    def delta(self) -> torch.Tensor:
        """(alpha / r) B A: this rank's shard, in the layout of its layer's weight."""
        return (self.b @ self.a) * self.scale

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """A and B as megatron-core dist_checkpointing tensors, cut like the layer's weight (so a
        checkpoint reshards across TP like the base model)."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axis = {"a": 1} if self.kind == "row" else {"b": 0}
        out = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, axis, sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=(metadata or {}).get("dp_cp_group"),
        )
        if self.gated:  # stored as the weight is: [all gate rows; all up rows], any TP size
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            out[f"{prefix}b"] = apply_swiglu_sharded_factory(out[f"{prefix}b"], sharded_offsets)
        return out


def _output(adapter: LoraAdapter):
    def hook(_module, inputs, output):
        if not adapter.enabled:
            return output
        out, bias = output
        return out + adapter(inputs[0]), bias
    return hook


def apply_lora(module: torch.nn.Module, *, rank: int, alpha: float, dropout: float,
               targets: list[str], seed: int, tp_rank: int, tp_size: int) -> dict[str, LoraAdapter]:
    """Add adapters to every layer of `module` (a GPTModel) named in `targets` and freeze every
    other parameter. Returns the adapters by the megatron name of the weight they adapt."""
    adapters: dict[str, LoraAdapter] = {}
    for p in module.parameters():
        p.requires_grad_(False)
    for index, layer in enumerate(module.decoder.layers):
        for target in targets:
            owner_name, attr, kind = TARGETS[target]
            owner = getattr(layer, owner_name)
            linear = getattr(owner, attr)
            out_local, in_local = linear.weight.shape
            in_full = in_local * tp_size if kind == "row" else in_local
            out_full = out_local * tp_size if kind == "column" else out_local
            generator = torch.Generator().manual_seed(seed * 1_000_003 + index * 8 + list(TARGETS).index(target))
            adapter = LoraAdapter(kind, in_full, out_full, rank, alpha, dropout, tp_rank, tp_size,
                                  generator, linear.weight.dtype, linear.weight.device,
                                  gated=target == "fc1" and layer.config.gated_linear_unit)
            owner.add_module(f"{attr}_lora", adapter)
            linear.register_forward_hook(_output(adapter))
            # the layer's global index is megatron's layer_number - 1 (no pipeline stages here)
            adapters[f"decoder.layers.{layer.layer_number - 1}.{owner_name}.{attr}.weight"] = adapter
    return adapters


def is_adapter_parameter(name: str) -> bool:
    """Whether a megatron parameter name is an adapter's (the others are the frozen base)."""
    return "_lora." in name


@contextlib.contextmanager
def disabled(adapters: dict[str, LoraAdapter]) -> Iterator[None]:
    """The base model: every adapter off (the KL reference), back on afterwards."""
    for a in adapters.values():
        a.enabled = False
    try:
        yield
    finally:
        for a in adapters.values():
            a.enabled = True


# -- PEFT layout (engines that load adapters, `rlkit export --adapter`) --------------------------
def target_of(weight_name: str) -> str:
    """The recipe target of an adapted megatron weight name."""
    for target, (_, attr, _) in TARGETS.items():
        if f".{attr}.weight" in weight_name:
            return target
    raise ValueError(f"{weight_name!r} is no LoRA target")


def adapter_to_hf(weight_name: str, a_shards, b_shards, arch) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(HF module name, A, B) for one adapted megatron weight from every TP rank's shards (in rank
    order). A fused layer's adapter becomes one per HF module sharing A (qkv: q, k, v; fc1: gate,
    up), its B cut as the converter cuts the weight; a row layer's A is put back together."""
    from rlkit.train.convert import megatron_param_to_hf

    if TARGETS[target_of(weight_name)][2] == "column":
        a = a_shards[0]
        return [(n.removesuffix(".weight"), a, b)
                for n, b in megatron_param_to_hf(weight_name, list(b_shards), arch)]
    b = b_shards[0]
    return [(n.removesuffix(".weight"), a, b)
            for n, a in megatron_param_to_hf(weight_name, list(a_shards), arch)]


def peft_tensor_names(module: str) -> tuple[str, str]:
    """PEFT's names of an HF module's A and B (as adapter_model.safetensors holds them)."""
    return (f"base_model.model.{module}.lora_A.weight", f"base_model.model.{module}.lora_B.weight")


def peft_config(*, rank: int, alpha: float, dropout: float, targets: list[str],
                base_model: str) -> dict:
    """PEFT's adapter_config.json for these adapters (also SGLang's config_dict)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "lora_dropout": dropout, "bias": "none", "fan_in_fan_out": False,
        "target_modules": lora_hf_modules(targets),
        "base_model_name_or_path": base_model, "inference_mode": True,
    }


def write_peft_folder(path, tensors: dict[str, torch.Tensor], config: dict):
    """adapter_config.json + adapter_model.safetensors: what `peft.PeftModel.from_pretrained`
    loads onto the base model."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().cpu().clone() for n, t in tensors.items()},  # shared A: one copy each
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder
