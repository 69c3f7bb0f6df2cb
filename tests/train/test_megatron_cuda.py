"""The megatron backend on CUDA (one GPU, NCCL world of one, megatron's own optimizer), and the
optimizer choice on both devices. The CUDA tests skip without a GPU; docs/gpu.md records the
runs made on one (H100)."""

from __future__ import annotations

import pytest
import torch

from tests.train.helpers import hf_response_logprobs, random_batch
from rlkit.train.config import OptimizerConfig, TrainConfig

cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU (megatron's optimizer and NCCL); run on one, see docs/gpu.md")


def test_optimizer_choice_follows_the_device(monkeypatch):
    """Megatron's optimizer on CUDA, torch AdamW on CPU (get_megatron_optimizer hard-codes CUDA)."""
    from rlkit.train.megatron import optimizer as opt

    made = []
    monkeypatch.setattr(opt.MegatronOptimizer, "__init__", lambda self, *a: made.append("megatron"))
    monkeypatch.setattr(opt.TorchAdamW, "__init__", lambda self, *a: made.append("torch"))
    monkeypatch.setattr("megatron.core.parallel_state.get_tensor_model_parallel_group", lambda: None)
    model = torch.nn.Linear(2, 2)
    assert isinstance(opt.build_optimizer(model, OptimizerConfig(), torch.device("cuda"), torch.bfloat16),
                      opt.MegatronOptimizer)
    assert isinstance(opt.build_optimizer(model, OptimizerConfig(), torch.device("cpu"), torch.float32),
                      opt.TorchAdamW)
    assert made == ["megatron", "torch"]


def make_trainer(model_dir, **overrides):
    from rlkit.train.megatron.trainer import MegatronTrainer

    cfg = TrainConfig.model_validate({"device": "cuda", "micro_batch_size": 4, **overrides})
    return MegatronTrainer.single_process(model_dir, cfg)


def parity(trainer, model_dir, dtype, batch):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()
    ours = trainer.logprobs(batch)
    return max(float((hf_response_logprobs(hf, s.tokens.cuda(), s.prompt_length).cpu() - lp).abs().max())
               for s, lp in zip(batch.samples, ours))


@cuda
@pytest.mark.integration
def test_cuda_parity_and_megatron_optimizer(tiny_qwen2_dir):
    from rlkit.train.megatron.optimizer import MegatronOptimizer

    fp32 = make_trainer(tiny_qwen2_dir, dtype="float32")
    assert isinstance(fp32.optimizer, MegatronOptimizer)
    assert parity(fp32, tiny_qwen2_dir, torch.float32, random_batch(9, seed=1)) < 1e-4
    bf16 = make_trainer(tiny_qwen2_dir)  # auto: bfloat16 on CUDA
    assert next(bf16.module.parameters()).dtype == torch.bfloat16
    assert isinstance(bf16.optimizer, MegatronOptimizer)
    assert parity(bf16, tiny_qwen2_dir, torch.bfloat16, random_batch(9, seed=1)) < 0.1


@cuda
@pytest.mark.integration
def test_cuda_steps_raise_the_logprob_of_advantaged_samples_and_resume(tiny_qwen2_dir, tmp_path):
    trainer = make_trainer(tiny_qwen2_dir, optimizer={"lr": 3e-3, "grad_clip": 1.0})
    batch = random_batch(4, seed=5, advantages=[1.0, -1.0, 1.0, -1.0])
    before = trainer.logprobs(batch)
    for _ in range(3):
        trainer.accumulate(batch)
        metrics = trainer.step()
    assert metrics["train/step_applied"] == 1.0 and trainer.step_count == 3
    after = trainer.logprobs(batch)
    delta = [float((a - b).mean()) for a, b in zip(after, before)]
    assert delta[0] > 0 and delta[2] > 0 and delta[1] < 0 and delta[3] < 0
    # checkpoint round trip with megatron's optimizer state (fp32 master weights) and CUDA RNG
    trainer.save(tmp_path / "ckpt")
    trainer.accumulate(batch)
    trainer.step()
    w_a = {n: p.clone() for n, p in trainer.megatron_state().items()}
    trainer.load(tmp_path / "ckpt")
    assert trainer.step_count == 3
    trainer.accumulate(batch)
    trainer.step()
    for name, w in trainer.megatron_state().items():
        assert torch.equal(w, w_a[name]), name
