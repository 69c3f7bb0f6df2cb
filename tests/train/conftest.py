"""Fixtures of the training tests: tiny HF model folders, a local Ray."""

from __future__ import annotations

import os

import pytest

from tests.train.helpers import make_hf_model


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """Qwen2 (q/k/v bias, GQA) with tied embeddings."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    make_hf_model("qwen2", tie=True).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """Llama (no bias, rope_theta 1e5) with an untied lm_head."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_hf_model("llama", tie=False, seed=1).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray with 2 CPUs for this module, as a run starts it (token auth); stopped
    afterwards (no orphan processes)."""
    import ray

    from rlkit.driver.local_ray import local_ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    with local_ray(2):
        yield ray
