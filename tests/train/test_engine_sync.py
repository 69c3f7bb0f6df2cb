"""Weight sync to the built-in engine server (rollout/engines/builtin/hf_server.py), both methods, from a
TP=1 trainer in this process and from a TP=2 Ray group: after a sync the engine's logprobs for a
fixed prompt equal the trainer's, and the engine stamps the new weight version."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch

from rlkit.rollout.engine_updates import EngineUpdates

from tests.train.helpers import random_batch
from rlkit.train.batch import TrainBatch, TrainSample
from rlkit.train.config import TrainConfig

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = [5, 9, 13, 17, 21]
SYNC_ATOL = 1e-4  # engine (KV-cache decode, fp32) vs trainer (packed forward, fp32)


@pytest.fixture(scope="module")
def tiny_demo_dir(tmp_path_factory):
    from rlkit.rollout.demo_models import build_tiny

    path = tmp_path_factory.mktemp("tiny-demo")
    build_tiny(path, arch="qwen2")
    return path


@pytest.fixture(scope="module")
def engine(tiny_demo_dir):
    from rlkit.rollout.engines.config import EngineConfig
    from rlkit.rollout.engines.process import start_hf_server

    proc = start_hf_server(
        str(tiny_demo_dir), EngineConfig(num_engines=1, cpu_threads=1, startup_timeout_s=120), seed=0
    )
    try:
        yield proc.url
    finally:
        proc.stop()


def engine_generate(url: str, new_tokens: int = 12) -> tuple[list[int], torch.Tensor, str]:
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True,
                            "sampling_seed": 7},
        "return_logprob": True,
    }
    req = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        meta = json.loads(r.read())["meta_info"]
    pairs = meta["output_token_logprobs"]
    return [int(t) for _, t, _ in pairs], torch.tensor([lp for lp, _, _ in pairs]), meta["weight_version"]


def trainer_logprobs(trainer, response: list[int]) -> torch.Tensor:
    n = len(response)
    sample = TrainSample(0, 0, torch.tensor(PROMPT + response), len(PROMPT), torch.ones(n), torch.zeros(n),
                         0.0, 0.0, 0, 0)
    return trainer.logprobs(TrainBatch([sample]))[0]


def train_a_little(trainer, seed: int) -> None:
    for k in range(2):
        trainer.accumulate(random_batch(6, seed=seed + k))
        trainer.step()


def test_sync_from_a_tp1_trainer_by_broadcast_by_disk_and_in_memory(engine, tiny_demo_dir, tmp_path):
    from rlkit.train.megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer.single_process(
        tiny_demo_dir, TrainConfig(device="cpu", optimizer={"lr": 3e-2, "grad_clip": 0.0})
    )
    try:
        tokens, lp, version = engine_generate(engine)
        assert version == "0"
        assert float((trainer_logprobs(trainer, tokens) - lp).abs().max()) < SYNC_ATOL  # same start

        for method, expected_version in (("distributed", "1"), ("disk", "2"), ("tensor", "3")):
            train_a_little(trainer, seed={"distributed": 30, "disk": 40, "tensor": 60}[method])
            tokens, lp, _ = engine_generate(engine)
            stale = float((trainer_logprobs(trainer, tokens) - lp).abs().max())
            assert stale > 1e-2, "training should have moved the weights away from the engine's"
            updates = EngineUpdates(method=method, folder=str(tmp_path / "weights"))
            metrics = updates.run([engine], int(expected_version), trainer.publish_weights)
            assert metrics["sync/bytes"] > 0 and int(expected_version) == trainer.version
            tokens, lp, version = engine_generate(engine)
            assert version == expected_version
            assert float((trainer_logprobs(trainer, tokens) - lp).abs().max()) < SYNC_ATOL, method
    finally:
        trainer.close()


def test_sync_from_a_tp2_ray_group(engine, tiny_demo_dir, ray_cluster):
    from rlkit.train.ray_group import TrainerGroup

    group = TrainerGroup(
        tiny_demo_dir,
        TrainConfig(device="cpu", parallelism={"tensor": 2}, optimizer={"lr": 3e-2, "grad_clip": 0.0}),
        num_cpus_per_worker=1,
    )
    try:
        train_a_little(group, seed=50)
        metrics = EngineUpdates(method="distributed").run([engine], 10, group.publish_weights)
        assert metrics["sync/bytes"] > 0 and group.version == 10
        tokens, lp, version = engine_generate(engine)
        assert version == "10"
        assert float((trainer_logprobs(group, tokens) - lp).abs().max()) < SYNC_ATOL
    finally:
        group.shutdown()
