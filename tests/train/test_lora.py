"""LoRA in the megatron trainer (train.lora) on the tiny models, in this process: B = 0 is the base
model exactly; a step changes the adapters only, through an optimizer that holds nothing else; the
adapters-off reference is the base; the merged weights (what the engines and `rlkit export` get)
give the adapter model's logprobs. TP=2 against TP=1 is in tests/train/test_ray_group.py."""

from __future__ import annotations

import pytest
import torch

from rlkit.train.config import TrainConfig
from tests.train.helpers import hf_response_logprobs, random_batch

pytestmark = pytest.mark.integration

LORA = {"rank": 4, "alpha": 8.0}


def make_trainer(model_dir, lora=None, **overrides):
    from rlkit.train.megatron.trainer import MegatronTrainer

    cfg = TrainConfig.model_validate({
        "device": "cpu", "micro_batch_size": 4, "optimizer": {"lr": 1e-2},
        **({"lora": lora} if lora else {}), **overrides})
    return MegatronTrainer.single_process(model_dir, cfg)


def diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_lora_config_is_typed():
    from pydantic import ValidationError

    assert TrainConfig().lora.rank == 0  # off by default
    with pytest.raises(ValidationError, match="targets"):
        TrainConfig.model_validate({"lora": {"rank": 8, "targets": ["qkv", "attn"]}})
    with pytest.raises(ValidationError, match="named twice"):
        TrainConfig.model_validate({"lora": {"rank": 8, "targets": ["qkv", "qkv"]}})
    assert TrainConfig().lora.resume == "latest"  # a parked sample resumes under the newest
    with pytest.raises(ValidationError, match="sync 'adapter'"):  # merged keeps no old versions
        TrainConfig.model_validate({"lora": {"rank": 8, "sync": "merged", "resume": "own"}})


def test_a_zero_b_is_the_base_model_and_the_optimizer_holds_the_adapters_only(tiny_qwen2_dir):
    batch = random_batch(6, seed=3)
    base = make_trainer(tiny_qwen2_dir).logprobs(batch)
    lora = make_trainer(tiny_qwen2_dir, LORA)
    assert diff(lora.logprobs(batch), base) == 0.0
    layers = lora.arch.num_layers
    assert len(lora.lora) == 4 * layers
    trainable = [n for n, p in lora.module.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 4 * layers and all("_lora." in n for n in trainable)
    held = [p for g in lora.optimizer._opt.param_groups for p in g["params"]]
    assert len(held) == len(trainable)
    adapter_numel = sum(p.numel() for p in held)
    assert adapter_numel < 0.2 * sum(p.numel() for p in lora.module.parameters())


def test_a_step_trains_the_adapters_only_and_the_reference_is_the_base(tiny_qwen2_dir):
    batch = random_batch(8, seed=4)
    base_lp = make_trainer(tiny_qwen2_dir).logprobs(batch)
    trainer = make_trainer(tiny_qwen2_dir, LORA, algorithm={"kl_coef": 0.1})
    assert trainer._reference is None  # no copy of the weights: the adapters off are the base
    before = {n: t.clone() for n, t in trainer.megatron_state().items()}
    ref = trainer.logprobs(batch, policy="reference")
    assert diff(ref, base_lp) == 0.0
    trainer.accumulate(batch.with_logprobs(ref=ref))
    metrics = trainer.step()
    assert metrics["train/grad_norm"] > 0
    after = trainer.megatron_state()
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    # B moves off zero; A moves once B is not zero (its gradient is B^T ...): after one step,
    # every B has changed and no base weight has
    assert changed and all("_lora." in n for n in changed)
    assert {n for n in changed if n.endswith("_lora.b")} == {
        n for n in before if n.endswith("_lora.b")}
    assert diff(trainer.logprobs(batch, policy="reference"), base_lp) == 0.0
    assert diff(trainer.logprobs(batch), base_lp) > 1e-4  # the adapted model is another one


def test_the_merged_weights_are_the_adapter_model(tiny_qwen2_dir, tmp_path):
    """What the engines and `rlkit export` receive: W + (alpha / r) B A, loaded by transformers,
    gives the trainer's logprobs (fp32)."""
    from transformers import AutoModelForCausalLM

    batch = random_batch(6, seed=5)
    trainer = make_trainer(tiny_qwen2_dir, LORA)
    for _ in range(2):  # two steps: A has moved too
        trainer.accumulate(batch)
        trainer.step()
    ours = trainer.logprobs(batch)
    hf = AutoModelForCausalLM.from_pretrained(
        trainer.export_hf(tmp_path / "merged"), dtype=torch.float32).eval()
    theirs = [hf_response_logprobs(hf, s.tokens, s.prompt_length) for s in batch.samples]
    assert diff(ours, theirs) < 1e-4
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    assert diff(ours, [hf_response_logprobs(base, s.tokens, s.prompt_length)
                       for s in batch.samples]) > 1e-3


def test_a_lora_checkpoint_resumes_identically_and_exports_merged(tiny_qwen2_dir, tmp_path):
    """The adapters and their Adam moments are in the checkpoint (dist_checkpointing, cut like
    the layer's weight); `rlkit export` writes the merged model, as the engines receive it."""
    from rlkit.cli import main
    from rlkit.train.hf_io import load_hf_state_dict

    first, second = random_batch(6, seed=7), random_batch(6, seed=8)
    a = make_trainer(tiny_qwen2_dir, LORA)
    a.accumulate(first)
    a.step()
    a.save(tmp_path / "checkpoints" / "step_000001" / "trainer")
    merged = dict(a.iter_hf_weights())
    a.accumulate(second)
    a.step()

    b = make_trainer(tiny_qwen2_dir, LORA)
    b.load(tmp_path / "checkpoints" / "step_000001" / "trainer")
    b.accumulate(second)
    b.step()
    wa, wb = a.megatron_state(), b.megatron_state()
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    assert main(["export", str(tmp_path / "checkpoints" / "step_000001"), str(tmp_path / "out")]) == 0
    exported = load_hf_state_dict(tmp_path / "out")
    assert sorted(exported) == sorted(merged)
    assert max(float((exported[k] - v).abs().max()) for k, v in merged.items()) < 1e-6
    # --adapter: the PEFT folder, equal to what the trainer exports at that step
    from safetensors.torch import load_file

    assert main(["export", "--adapter", str(tmp_path / "checkpoints" / "step_000001"),
                 str(tmp_path / "peft")]) == 0
    b2 = make_trainer(tiny_qwen2_dir, LORA)
    b2.load(tmp_path / "checkpoints" / "step_000001" / "trainer")
    mine = load_file(str(b2.export_adapter(tmp_path / "peft-trainer") / "adapter_model.safetensors"))
    theirs = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert sorted(mine) == sorted(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    with pytest.raises(Exception, match="does not fit"):  # a full-model run cannot take it
        make_trainer(tiny_qwen2_dir).load(tmp_path / "checkpoints" / "step_000001" / "trainer")


@pytest.mark.slow
def test_tp2_lora_trains_as_tp1(ray_cluster, tiny_qwen2_dir, tmp_path):
    """Column layers: A replicated, B cut on the output; row layers: A cut on the input, B
    replicated (train/megatron/lora.py). The same adapters at any TP size, the same step."""
    from transformers import AutoModelForCausalLM

    from rlkit.train.ray_group import TrainerGroup

    batch = random_batch(8, seed=6)
    local = make_trainer(tiny_qwen2_dir, LORA)
    local.accumulate(batch)
    m1 = local.step()
    group = TrainerGroup(tiny_qwen2_dir, TrainConfig.model_validate({
        "device": "cpu", "micro_batch_size": 4, "optimizer": {"lr": 1e-2}, "lora": LORA,
        "parallelism": {"tensor": 2}}), num_cpus_per_worker=1)
    try:
        group.accumulate(batch)
        m2 = group.step()
        for key in ("train/loss", "train/grad_norm"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5), key
        assert diff(group.logprobs(batch), local.logprobs(batch)) < 1e-4
        merged = AutoModelForCausalLM.from_pretrained(
            group.export_hf(tmp_path / "tp2"), dtype=torch.float32).state_dict()
        for name, t in dict(local.iter_hf_weights()).items():
            assert float((merged[name] - t).abs().max()) < 1e-4, name
        # a TP=2 checkpoint resumes at TP=1: the adapters cut back together (SwiGLU's fc1 too)
        group.save(str(tmp_path / "ckpt"))
        resumed = make_trainer(tiny_qwen2_dir, LORA)
        resumed.load(tmp_path / "ckpt")
        assert diff(resumed.logprobs(batch), group.logprobs(batch)) < 1e-5
    finally:
        group.shutdown()


def test_the_peft_export_loads_with_peft_and_gives_the_trainer_s_logprobs(tiny_qwen2_dir, tmp_path):
    """adapter_config.json + adapter_model.safetensors: q/k/v share the fused layer's A (B cut as
    the converter cuts the weight), gate/up likewise; PEFT loads it onto the HF base model."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batch = random_batch(6, seed=9)
    trainer = make_trainer(tiny_qwen2_dir, LORA)
    for _ in range(2):
        trainer.accumulate(batch)
        trainer.step()
    folder = trainer.export_adapter(tmp_path / "adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(folder)).eval()
    theirs = [hf_response_logprobs(model, s.tokens, s.prompt_length) for s in batch.samples]
    assert diff(trainer.logprobs(batch), theirs) < 1e-4
