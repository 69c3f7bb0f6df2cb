"""Build a megatron-core GPTModel that computes exactly what an HF Llama/Qwen2 computes.

The mapping from `ModelArch` to `TransformerConfig` is the whole of the architecture contract:
RMSNorm (torch's, via the local layer spec), SwiGLU (gated linear unit with SiLU, no biases),
GQA (`num_query_groups`), RoPE with the HF base and non-interleaved halves, q/k/v bias for Qwen2,
tied or untied output layer. Dropout is 0: RL training on its own samples does not use it, and the
trainer's logprobs must equal the engine's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlkit.train.hf_arch import ModelArch


def transformer_config(arch: ModelArch, *, params_dtype: torch.dtype, on_cpu: bool):
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    bf16 = params_dtype == torch.bfloat16
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        params_dtype=params_dtype,
        bf16=bf16,
        pipeline_dtype=params_dtype,
        # Per-token normalisation is ours: gradients are summed over DP ranks and divided by the
        # global-batch denominator in finalize_model_grads (see train/megatron/trainer.py).
        calculate_per_token_loss=True,
        # Fusions need CUDA kernels (TE/apex); off everywhere keeps CPU and GPU numerics alike.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=on_cpu,
        # Weights are always loaded from an HF checkpoint right after construction.
        perform_initialization=False,
    )


def build_gpt_model(arch: ModelArch, *, params_dtype: torch.dtype, device: torch.device):
    """A GPTModel for this rank's tensor-parallel shard (torch.distributed must be initialised)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    on_cpu = device.type == "cpu"
    config = transformer_config(arch, params_dtype=params_dtype, on_cpu=on_cpu)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=True,  # logits stay vocab-sharded; train/megatron/logprobs.py reduces them
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(arch.rope_theta),
    )
    model = model.to(device=device, dtype=params_dtype)
    mark_tensor_parallel_params(model)
    return model


def mark_tensor_parallel_params(model) -> None:
    """Set megatron's `tensor_model_parallel` attributes on sharded parameters.

    megatron sets them inside its weight initialisers, which `perform_initialization=False` skips;
    without them every parameter looks replicated and the TP-aware gradient norm (ours on CPU,
    megatron's optimizer on GPU) counts only TP rank 0's shards.
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    from rlkit.train.convert import tp_split_dim

    for name, param in model.named_parameters():
        dim = tp_split_dim(name)
        if dim is not None and not getattr(param, "tensor_model_parallel", False):
            for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                if hasattr(param, attr):
                    delattr(param, attr)
            set_tensor_model_parallel_attributes(param, True, dim, 1)
