"""The GPU session's tools and results (docs/gpu.md), checked without a GPU: profile names by
device, the committed H100 profile is what its raw measurements give and the simulator loads it,
and the simulated side of the GPU rollout runs is reproducible here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "docs" / "gpu-runs"
PROFILE = ROOT / "docs" / "profiles" / "h100-smollm2-t1.json"


@pytest.mark.parametrize("name, tag", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                       ("NVIDIA A100-SXM4-80GB", "a100"), ("Tesla V100-SXM2-16GB", "v100"),
                                       ("Some Accelerator", "cuda")])
def test_device_tag_names_the_gpu(monkeypatch, name, tag):
    import torch

    from rlkit.bench import engine

    engine.device_tag.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
    try:
        assert engine.device_tag() == tag
        assert engine.device_tag("cpu") == "cpu"
    finally:
        engine.device_tag.cache_clear()


def test_bench_rollout_picks_the_profile_of_the_device(monkeypatch):
    from rlkit.bench import engine, rollout

    monkeypatch.setattr(engine, "device_tag", lambda device="auto": "h100")
    assert rollout._profile_path("smollm2") == PROFILE
    monkeypatch.setattr(engine, "device_tag", lambda device="auto": "cpu")
    assert rollout._profile_path("tiny").name == "cpu-tiny-t1.json"


def test_h100_profile_is_what_its_measurements_give(tmp_path):
    from rlkit.sim.engine import SimConfig
    from rlkit.rollout.engines.profile import load_profile
    from tools.gpu.profile_from_logs import main

    assert main(["--runs", str(RUNS), "--out", str(tmp_path / PROFILE.name)]) == 0
    assert json.loads((tmp_path / PROFILE.name).read_text()) == json.loads(PROFILE.read_text())
    cluster = SimConfig.from_profile(2, load_profile(str(PROFILE)))
    assert cluster.cpu_cores is None and cluster.layout == "padded"  # independent GPU engines
    assert cluster.request_latency_s > 0 and cluster.abort_poll_s == (0.01, 0.2)


def test_simulated_side_of_the_gpu_rollout_is_reproducible(tmp_path):
    from tools.gpu.simulate_rollout import main

    out = tmp_path / "sim.json"
    assert main([str(RUNS / "rollout-s1.json"), "--trace", str(RUNS / "trace-s1.jsonl"),
                 "--profile", str(PROFILE), "--out", str(out)]) == 0
    committed = json.loads((RUNS / "rollout-s1-simulated.json").read_text())["simulated"]["ratios"]
    ratios = json.loads(out.read_text())["simulated"]["ratios"]
    assert ratios.keys() == committed.keys()
    for name, values in committed.items():
        assert ratios[name] == pytest.approx(values), name
