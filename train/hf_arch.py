"""The architecture of an HF Llama/Qwen2 checkpoint, read from its config.json (no transformers).

Everything downstream (the Megatron model, the weight converter, the HF exporter) reads the shape
of the model from `ModelArch`, so the set of supported features is stated once, here: RoPE
(default type, no scaling), RMSNorm, SwiGLU, GQA, tied or untied embeddings, and the q/k/v bias
of Qwen2. Anything else is refused with an error naming the config key.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

from rlkit.common.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


class UnsupportedModelError(UserError, ValueError):
    """The HF config describes a model the Megatron backend cannot represent exactly."""


@dataclass(frozen=True)
class ModelArch:
    model_type: str  # llama | qwen2
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise if `tp` does not divide what Megatron shards (heads, groups, ffn, vocab)."""
        for what, n in (
            ("num_attention_heads", self.num_heads),
            ("num_key_value_heads", self.num_kv_heads),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
        ):
            if n % tp:
                raise UnsupportedModelError(
                    f"tensor parallel size {tp} does not divide {what}={n} of this model"
                )

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "ModelArch":
        """Build from a config.json dict (or `PretrainedConfig.to_dict()`)."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r}: only 'silu' (SwiGLU) is supported")
        rope_params = config.get("rope_parameters") or {}
        rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
        if rope_type != "default" or config.get("rope_scaling"):
            raise UnsupportedModelError(
                f"rope scaling ({rope_type!r} / rope_scaling={config.get('rope_scaling')!r}) is not "
                "supported; only default RoPE"
            )
        rope_theta = rope_params.get("rope_theta", config.get("rope_theta", 10000.0))
        if model_type == "llama":
            if config.get("attention_bias") or config.get("mlp_bias"):
                raise UnsupportedModelError("llama attention_bias/mlp_bias=true is not supported")
            qkv_bias = False
        else:
            if config.get("use_sliding_window"):
                raise UnsupportedModelError("qwen2 use_sliding_window=true is not supported")
            qkv_bias = True
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = config.get("head_dim") or hidden // heads
        return cls(
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
