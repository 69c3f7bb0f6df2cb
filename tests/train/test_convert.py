"""HF <-> Megatron names and TP shards, checked on real HF state dicts (pure torch)."""

import pytest
import torch

from tests.train.helpers import make_hf_model
from rlkit.train.convert import ConversionError, hf_param_names, hf_to_megatron, megatron_param_names, megatron_to_hf
from rlkit.train.hf_arch import ModelArch, UnsupportedModelError


@pytest.fixture(scope="module", params=[("qwen2", True), ("llama", False)], ids=["qwen2-tied", "llama-untied"])
def hf_model(request):
    kind, tie = request.param
    model = make_hf_model(kind, tie)
    return ModelArch.from_hf_config(model.config.to_dict()), model.state_dict()


@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_is_exact(hf_model, tp):
    arch, hf = hf_model
    shards = [hf_to_megatron(hf, arch, tp, r) for r in range(tp)]
    back = megatron_to_hf(shards, arch)
    assert sorted(back) == sorted(hf_param_names(arch))
    for name, t in back.items():
        assert torch.equal(t, hf[name]), name
    assert ("lm_head.weight" in back) == (not arch.tie_word_embeddings)


def test_qkv_shard_holds_whole_groups(hf_model):
    arch, hf = hf_model
    d, hpg = arch.head_dim, arch.heads_per_group  # 16, 2; two KV groups -> one per TP rank
    q, k, v = (hf[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    rank1 = hf_to_megatron(hf, arch, 2, 1)["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(rank1[: hpg * d], q[hpg * d : 2 * hpg * d])  # query heads 2, 3
    assert torch.equal(rank1[hpg * d : hpg * d + d], k[d:])  # key head 1
    assert torch.equal(rank1[hpg * d + d :], v[d:])  # value head 1


def test_fc1_shard_is_gate_slice_then_up_slice(hf_model):
    arch, hf = hf_model
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    rank0 = hf_to_megatron(hf, arch, 2, 0)["decoder.layers.1.mlp.linear_fc1.weight"]
    half = arch.intermediate_size // 2
    assert torch.equal(rank0, torch.cat([gate[:half], up[:half]]))


def test_row_parallel_and_vocab_shards(hf_model):
    arch, hf = hf_model
    r1 = hf_to_megatron(hf, arch, 2, 1)
    o = hf["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(r1["decoder.layers.0.self_attention.linear_proj.weight"], o[:, o.shape[1] // 2 :])
    emb = hf["model.embed_tokens.weight"]
    assert torch.equal(r1["embedding.word_embeddings.weight"], emb[emb.shape[0] // 2 :])
    assert torch.equal(r1["decoder.final_layernorm.weight"], hf["model.norm.weight"])


def test_missing_tensors_and_bad_tp_are_named(hf_model):
    arch, hf = hf_model
    broken = {k: v for k, v in hf.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ConversionError, match="model.layers.1.mlp.up_proj.weight"):
        hf_to_megatron(broken, arch)
    with pytest.raises(UnsupportedModelError, match="num_key_value_heads=2"):
        hf_to_megatron(hf, arch, 4, 0)
    with pytest.raises(ConversionError, match="TP rank"):
        megatron_to_hf([{}], arch)
    assert len(megatron_param_names(arch)) == 2 + arch.num_layers * (7 if arch.qkv_bias else 6) + (
        0 if arch.tie_word_embeddings else 1
    )


def test_unsupported_configs_are_refused():
    base = make_hf_model("llama", tie=False).config.to_dict()
    with pytest.raises(UnsupportedModelError, match="model_type"):
        ModelArch.from_hf_config({**base, "model_type": "mistral"})
    with pytest.raises(UnsupportedModelError, match="rope scaling"):
        ModelArch.from_hf_config({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}})
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        ModelArch.from_hf_config({**base, "hidden_act": "gelu"})
    arch = ModelArch.from_hf_config(base)
    assert (arch.rope_theta, arch.head_dim, arch.qkv_bias) == (100000.0, 16, False)


def test_an_hf_folder_is_written_only_where_no_other_weights_would_mix_in(tmp_path):
    from rlkit.train.hf_io import load_hf_state_dict, save_hf_folder

    w = {"a": torch.ones(2)}
    save_hf_folder(tmp_path / "m", w, {"model_type": "llama"})
    save_hf_folder(tmp_path / "m", {"a": torch.zeros(2)}, {"model_type": "llama"})  # rewrite: fine
    assert torch.equal(load_hf_state_dict(tmp_path / "m")["a"], torch.zeros(2))
    (tmp_path / "m" / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(FileExistsError, match="model-00001-of-00002.safetensors"):
        save_hf_folder(tmp_path / "m", w, {"model_type": "llama"})


def test_an_hf_folder_names_its_weights_dtype_and_refuses_one_hf_cannot_name(tmp_path):
    import json

    from rlkit.train.hf_io import save_hf_folder

    folder = save_hf_folder(tmp_path / "h", {"a": torch.ones(2), "steps": torch.zeros(1, dtype=torch.int64)},
                            {"model_type": "llama"}, dtype=None)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    folder = save_hf_folder(tmp_path / "b", {"a": torch.ones(2)}, {"model_type": "llama"},
                            dtype=torch.bfloat16)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="dtype torch.float64 cannot be written"):
        save_hf_folder(tmp_path / "d", {"a": torch.ones(2, dtype=torch.float64)}, {"model_type": "llama"})
    assert not (tmp_path / "d" / "model.safetensors").exists()
