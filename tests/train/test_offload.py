"""TrainerOffload on CPU: the same storage-level path colocated CUDA runs (resize to 0, copy back)."""

from __future__ import annotations

import pytest
import torch

from tests.train.helpers import random_batch
from rlkit.train.config import TrainConfig

pytestmark = pytest.mark.integration


def make_trainer(model_dir):
    from rlkit.train.megatron.trainer import MegatronTrainer

    cfg = TrainConfig.model_validate(
        {"device": "cpu", "micro_batch_size": 4, "algorithm": {"kl_coef": 0.05}}
    )
    return MegatronTrainer.single_process(model_dir, cfg)


def train_step(trainer, seed):
    batch = random_batch(6, seed=seed)
    batch = batch.with_logprobs(ref=trainer.logprobs(batch, policy="reference"))
    trainer.accumulate(batch)
    return trainer.step()


def kind_tensors(trainer) -> dict[str, list[torch.Tensor]]:
    """What each kind holds, reached independently of the module under test."""
    opt = trainer.optimizer._opt
    return {
        "params": [*trainer.module.parameters(), *trainer._reference.values()],
        "grads": [b.grad_data for b in trainer.model.buffers],
        "optimizer": [t for s in opt.state.values() for t in s.values()],
    }


def nbytes(tensors) -> list[int]:
    """Storage sizes, as ints: an assert must never repr a released tensor (reading one on CPU
    can crash the process, which is what the released state means)."""
    return [t.untyped_storage().nbytes() for t in tensors]


def distinct_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def snapshot(trainer) -> dict[str, list[torch.Tensor]]:
    return {k: [t.detach().clone() for t in ts] for k, ts in kind_tensors(trainer).items()}


def assert_equal(trainer, snap, kinds=("params", "grads", "optimizer")):
    now = kind_tensors(trainer)
    for k in kinds:
        assert len(now[k]) == len(snap[k])
        assert all(torch.equal(a, b) for a, b in zip(now[k], snap[k])), k


def test_offload_all_then_onload_trains_exactly_like_a_twin(tiny_qwen2_dir):
    from rlkit.train.megatron.offload import TrainerOffload

    trainer, twin = make_trainer(tiny_qwen2_dir), make_trainer(tiny_qwen2_dir)
    for t in (trainer, twin):
        train_step(t, seed=1)
    before = snapshot(trainer)
    tensors = kind_tensors(trainer)
    expected = {k: distinct_bytes(ts) for k, ts in tensors.items()}
    assert expected["optimizer"] > 0  # AdamW state exists after a step

    off = TrainerOffload(trainer)
    report = off.offload()
    assert off.offloaded == ("params", "grads", "optimizer")
    for k in expected:
        assert report[f"bytes/{k}"] == expected[k]
        sizes = nbytes(tensors[k])
        assert set(sizes) == {0}, k
    sizes = nbytes(p.main_grad for p in trainer.module.parameters())
    assert set(sizes) == {0}
    assert report["bytes"] == sum(expected.values())
    # the params are model params in AdamW's param_groups: moved once, as params
    assert report["copied_bytes"] == expected["params"] + expected["optimizer"]  # grads dropped
    with pytest.raises(RuntimeError):
        trainer.logprobs(random_batch(2, seed=9))
    assert off.offload()["bytes"] == 0  # idempotent

    report = off.onload()
    assert off.offloaded == ()
    assert {k: report[f"bytes/{k}"] for k in expected} == expected
    assert_equal(trainer, before)
    assert off.onload()["bytes"] == 0

    for seed in (2, 3):
        m, m_twin = train_step(trainer, seed), train_step(twin, seed)
        assert m["train/loss"] == m_twin["train/loss"] and m["train/grad_norm"] == m_twin["train/grad_norm"]
        assert_equal(trainer, snapshot(twin))
        off.offload()  # host buffers are reused from here on
        off.onload()
    assert_equal(trainer, snapshot(twin))


def test_partial_kinds_and_pending_grads(tiny_qwen2_dir):
    from rlkit.train.megatron.offload import TrainerOffload

    trainer = make_trainer(tiny_qwen2_dir)
    train_step(trainer, seed=1)
    before = snapshot(trainer)
    tensors = kind_tensors(trainer)
    off = TrainerOffload(trainer, keep_host_buffers=False)

    report = off.offload(["optimizer", "grads"])
    assert "bytes/params" not in report and report["bytes/grads"] > 0 and report["bytes/optimizer"] > 0
    sizes, released = nbytes(tensors["params"]), nbytes(tensors["grads"] + tensors["optimizer"])
    assert min(sizes) > 0 and set(released) == {0}
    assert off.offload("grads")["bytes/grads"] == 0
    report = off.offload()  # only params are left to move
    assert report["bytes/grads"] == report["bytes/optimizer"] == 0
    assert report["bytes"] == report["bytes/params"] == distinct_bytes(before["params"])
    assert off.onload("params")["bytes/params"] > 0
    assert off.offloaded == ("grads", "optimizer")
    off.onload()
    assert_equal(trainer, before)

    # accumulated but not stepped: the grads are copied, not dropped
    batch = random_batch(4, seed=5)
    trainer.accumulate(batch.with_logprobs(ref=trainer.logprobs(batch, policy="reference")))
    grads = trainer.main_grads()
    assert any(g.abs().sum() > 0 for g in grads.values())
    report = off.offload("grads")
    assert report["copied_bytes"] == report["bytes/grads"] > 0
    off.onload("grads")
    assert all(torch.equal(grads[n], g) for n, g in trainer.main_grads().items())

    with pytest.raises(ValueError, match="unknown offload kinds"):
        off.offload("activations")


def test_megatron_mixed_precision_optimizer_layout():
    """The CUDA optimizer's shape (ChainedOptimizer -> Float16OptimizerWithFloat16Params -> torch
    Adam over fp32 master copies), built on CPU around the real megatron classes' attributes."""
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    from rlkit.train.megatron.offload import TrainerOffload

    module = torch.nn.Linear(4, 3).to(torch.bfloat16)
    params = list(module.parameters())
    masters = [p.detach().clone().float() for p in params]
    f16 = Float16OptimizerWithFloat16Params.__new__(Float16OptimizerWithFloat16Params)
    f16.optimizer = torch.optim.AdamW(masters, lr=0.1)
    f16.float16_groups, f16.fp32_from_float16_groups, f16.config = [params], [masters], None
    f16.is_stub_optimizer = False
    for m in masters:
        m.grad = torch.ones_like(m)
    f16.optimizer.step()
    state = [t for s in f16.optimizer.state.values() for t in s.values()]
    before = [t.clone() for t in masters + state + params]

    expected = distinct_bytes(masters + state)
    off = TrainerOffload.from_parts(module, optimizer=ChainedOptimizer([f16]))
    report = off.offload("optimizer")
    sizes, released = nbytes(params), nbytes(masters + state)
    assert report["bytes/optimizer"] == expected and min(sizes) > 0 and set(released) == {0}
    off.onload()
    assert all(torch.equal(a, b) for a, b in zip(masters + state + params, before))
