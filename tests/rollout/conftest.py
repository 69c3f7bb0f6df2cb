"""Fixtures of the engine-layer tests: the tiny demo model, an in-process decoder, a fleet of
real engine servers behind the real router, and a scriptable fake SGLang worker."""

from __future__ import annotations

import pytest

from rlkit.rollout.demo_models import build_tiny


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The `tiny` demo model (random 2-layer Qwen2 + local tokenizer), built into a temp folder
    so tests neither read nor write the user's model cache."""
    path = tmp_path_factory.mktemp("tiny-model")
    build_tiny(path, arch="qwen2")
    return path


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
async def worker():
    """A scriptable fake SGLang worker on loopback (tests/rollout/fake_worker.py)."""
    from tests.rollout.fake_worker import FakeWorker

    w = await FakeWorker().start()
    yield w
    await w.stop()
