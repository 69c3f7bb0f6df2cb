"""HF <-> Megatron weight conversion: parameter names and tensor-parallel shards (pure torch).

Megatron layout (GPTModel, local layer spec) against HF Llama/Qwen2:

| Megatron                                   | HF                                         | TP split        |
|--------------------------------------------|--------------------------------------------|-----------------|
| embedding.word_embeddings.weight           | model.embed_tokens.weight                  | rows (vocab)    |
| decoder.layers.i.input_layernorm.weight    | model.layers.i.input_layernorm.weight      | replicated      |
| decoder.layers.i.self_attention.linear_qkv | self_attn.{q,k,v}_proj (weight, bias)      | query groups    |
| decoder.layers.i.self_attention.linear_proj| self_attn.o_proj.weight                    | columns         |
| decoder.layers.i.pre_mlp_layernorm.weight  | model.layers.i.post_attention_layernorm    | replicated      |
| decoder.layers.i.mlp.linear_fc1.weight     | mlp.gate_proj + mlp.up_proj                | rows, per half  |
| decoder.layers.i.mlp.linear_fc2.weight     | mlp.down_proj.weight                       | columns         |
| decoder.final_layernorm.weight             | model.norm.weight                          | replicated      |
| output_layer.weight (untied only)          | lm_head.weight                             | rows (vocab)    |

linear_qkv stacks, for each key/value group g in order, the group's query heads, then its key
head, then its value head; a TP rank holds a contiguous run of groups. linear_fc1 holds, on each
TP rank, that rank's slice of gate_proj followed by its slice of up_proj.
"""

from __future__ import annotations

import re
from typing import Iterator, Mapping, Sequence

import torch

from rlkit.train.hf_arch import ModelArch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# Megatron per-layer suffix -> (HF per-layer suffix, TP split: None | 0 (rows) | 1 (columns))
_SIMPLE_LAYER = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "pre_mlp_layernorm.weight": ("post_attention_layernorm.weight", None),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", 1),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight", 1),
}
_SIMPLE_TOP = {
    "embedding.word_embeddings.weight": ("model.embed_tokens.weight", 0),
    "decoder.final_layernorm.weight": ("model.norm.weight", None),
    "output_layer.weight": ("lm_head.weight", 0),
}


class ConversionError(KeyError):
    """A weight is missing, unexpected or has the wrong shape."""


def megatron_param_names(arch: ModelArch) -> list[str]:
    """Every Megatron parameter of this architecture, in model order."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(arch.num_layers):
        p = f"decoder.layers.{i}."
        names += [
            p + "input_layernorm.weight",
            p + "self_attention.linear_qkv.weight",
            *([p + "self_attention.linear_qkv.bias"] if arch.qkv_bias else []),
            p + "self_attention.linear_proj.weight",
            p + "pre_mlp_layernorm.weight",
            p + "mlp.linear_fc1.weight",
            p + "mlp.linear_fc2.weight",
        ]
    names.append("decoder.final_layernorm.weight")
    if not arch.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def tp_split_dim(name: str) -> int | None:
    """The dimension a Megatron parameter is sharded along by tensor parallelism (None: replicated).

    linear_qkv and linear_fc1 are sharded along rows but not as plain chunks of the HF tensors;
    use `hf_to_megatron` / `megatron_to_hf` for them.
    """
    if name in _SIMPLE_TOP:
        return _SIMPLE_TOP[name][1]
    m = _LAYER.match(name)
    if not m:
        raise ConversionError(f"unknown Megatron parameter {name!r}")
    suffix = m.group(2)
    if suffix in _SIMPLE_LAYER:
        return _SIMPLE_LAYER[suffix][1]
    if suffix.startswith(("self_attention.linear_qkv.", "mlp.linear_fc1.")):
        return 0
    raise ConversionError(f"unknown Megatron parameter {name!r}")


# -- HF -> Megatron ---------------------------------------------------------------------------
def _get(hf: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in hf:
        raise ConversionError(f"HF checkpoint has no tensor {name!r}")
    return hf[name]


def _qkv_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArch) -> torch.Tensor:
    ng, d = arch.num_kv_heads, arch.head_dim
    rest = q.shape[1:]
    stacked = torch.cat(
        [
            q.reshape(ng, arch.heads_per_group * d, *rest),
            k.reshape(ng, d, *rest),
            v.reshape(ng, d, *rest),
        ],
        dim=1,
    )
    return stacked.reshape(ng * (arch.heads_per_group + 2) * d, *rest)


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], arch: ModelArch, tp_size: int = 1, tp_rank: int = 0
) -> dict[str, torch.Tensor]:
    """The Megatron state dict of TP rank `tp_rank` (parameters only) from an HF state dict."""
    arch.check_tensor_parallel(tp_size)

    def shard(t: torch.Tensor, dim: int | None) -> torch.Tensor:
        return t if dim is None else t.chunk(tp_size, dim=dim)[tp_rank].contiguous()

    out: dict[str, torch.Tensor] = {}
    for name in megatron_param_names(arch):
        if name in _SIMPLE_TOP:
            hf_name, dim = _SIMPLE_TOP[name]
            out[name] = shard(_get(hf, hf_name), dim)
            continue
        i, suffix = _LAYER.match(name).groups()  # type: ignore[union-attr]
        h = f"model.layers.{i}."
        if suffix in _SIMPLE_LAYER:
            hf_suffix, dim = _SIMPLE_LAYER[suffix]
            out[name] = shard(_get(hf, h + hf_suffix), dim)
        elif suffix.startswith("self_attention.linear_qkv."):
            kind = suffix.rsplit(".", 1)[1]  # weight | bias
            q, k, v = (_get(hf, f"{h}self_attn.{x}_proj.{kind}") for x in "qkv")
            out[name] = shard(_qkv_full(q, k, v, arch), 0)
        elif suffix == "mlp.linear_fc1.weight":
            gate = shard(_get(hf, h + "mlp.gate_proj.weight"), 0)
            up = shard(_get(hf, h + "mlp.up_proj.weight"), 0)
            out[name] = torch.cat([gate, up], dim=0)
        else:  # pragma: no cover - megatron_param_names and this switch are kept in step
            raise ConversionError(f"no HF source for {name!r}")
    return out


# -- Megatron -> HF ---------------------------------------------------------------------------
def megatron_param_to_hf(
    name: str, shards: Sequence[torch.Tensor], arch: ModelArch
) -> list[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs for one Megatron parameter given its shards from every TP rank."""
    if name in _SIMPLE_TOP:
        hf_name, dim = _SIMPLE_TOP[name]
        return [(hf_name, shards[0] if dim is None else torch.cat(list(shards), dim=dim))]
    m = _LAYER.match(name)
    if not m:
        raise ConversionError(f"unknown Megatron parameter {name!r}")
    i, suffix = m.groups()
    h = f"model.layers.{i}."
    if suffix in _SIMPLE_LAYER:
        hf_suffix, dim = _SIMPLE_LAYER[suffix]
        return [(h + hf_suffix, shards[0] if dim is None else torch.cat(list(shards), dim=dim))]
    if suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]
        full = torch.cat(list(shards), dim=0)
        ng, d, hpg = arch.num_kv_heads, arch.head_dim, arch.heads_per_group
        rest = full.shape[1:]
        grouped = full.reshape(ng, (hpg + 2) * d, *rest)
        q, k, v = grouped.split([hpg * d, d, d], dim=1)
        return [
            (f"{h}self_attn.q_proj.{kind}", q.reshape(ng * hpg * d, *rest).contiguous()),
            (f"{h}self_attn.k_proj.{kind}", k.reshape(ng * d, *rest).contiguous()),
            (f"{h}self_attn.v_proj.{kind}", v.reshape(ng * d, *rest).contiguous()),
        ]
    if suffix == "mlp.linear_fc1.weight":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [
            (h + "mlp.gate_proj.weight", torch.cat([g for g, _ in halves], dim=0)),
            (h + "mlp.up_proj.weight", torch.cat([u for _, u in halves], dim=0)),
        ]
    raise ConversionError(f"unknown Megatron parameter {name!r}")


def megatron_to_hf(
    shards: Sequence[Mapping[str, torch.Tensor]], arch: ModelArch
) -> dict[str, torch.Tensor]:
    """The HF state dict from the Megatron state dicts of all TP ranks (in rank order)."""
    out: dict[str, torch.Tensor] = {}
    for hf_name, tensor in iter_megatron_to_hf(shards, arch):
        out[hf_name] = tensor
    return out


def iter_megatron_to_hf(
    shards: Sequence[Mapping[str, torch.Tensor]], arch: ModelArch
) -> Iterator[tuple[str, torch.Tensor]]:
    for name in megatron_param_names(arch):
        missing = [r for r, s in enumerate(shards) if name not in s]
        if missing:
            raise ConversionError(f"Megatron state of TP rank(s) {missing} has no {name!r}")
        yield from megatron_param_to_hf(name, [s[name] for s in shards], arch)


def hf_param_names(arch: ModelArch) -> list[str]:
    """The HF tensor names this architecture exports (lm_head only when untied)."""
    names = ["model.embed_tokens.weight"]
    for i in range(arch.num_layers):
        h = f"model.layers.{i}."
        names += [h + "input_layernorm.weight"]
        names += [f"{h}self_attn.{x}_proj.weight" for x in "qkv"]
        if arch.qkv_bias:
            names += [f"{h}self_attn.{x}_proj.bias" for x in "qkv"]
        names += [
            h + "self_attn.o_proj.weight",
            h + "post_attention_layernorm.weight",
            h + "mlp.gate_proj.weight",
            h + "mlp.up_proj.weight",
            h + "mlp.down_proj.weight",
        ]
    names.append("model.norm.weight")
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    return names
