"""The CPU validation's simulated side: `rlkit bench rollout --simulate` runs the measured hf
engine profile with its serving model (docs/simulation.md, "Validation")."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rlkit.sim.engine import SimConfig
from rlkit.rollout.engines.profile import load_profile

PROFILE = Path(__file__).resolve().parents[2] / "docs" / "profiles" / "cpu-tiny-t1.json"


def test_the_cpu_profile_carries_the_measured_prefill_and_serving_model():
    """`rlkit bench engine` rewrites this file without these keys; `python -m
    rlkit.sim.measure_hf` puts them back (the CPU validation depends on them)."""
    prof = load_profile(PROFILE)
    assert prof.extra.get("kv_layout") == "padded"
    assert prof.prefill_s_per_token_sq > 0 and prof.max_prefill_tokens == 8192
    assert prof.kv_s_per_token_by_batch is not None
    cfg = SimConfig.from_profile(2, prof)
    assert cfg.cpu_cores and cfg.chunk_cpu_s > 0 and cfg.stream_interval == 8
    assert cfg.abort_poll_s is not None and cfg.request_latency_s > 0
    assert cfg.layout == "padded"


def test_simulate_same_runs_the_bench_workload_on_the_measured_profile():
    from rlkit.bench.rollout import simulate_same

    args = argparse.Namespace(model="tiny", simulate=str(PROFILE), engines=2, batch_size=8, n=4,
                              policy="sync,partial", trace=None,
                              cap=256, over_provision=2.0, steps=2, warmup_steps=1,
                              p_hard=0.15, easy_frac=0.08, seed=0)
    real = {"policies": {"sync": {"ratio_to_first": 1.0, "speedup_vs_first": 1.0},
                         "partial": {"ratio_to_first": 1.5, "speedup_vs_first": 1.4}}}
    out = simulate_same(args, real)
    assert out["ratio"] > 0 and out["measured_ratio"] == 1.5
    partial = out["ratios"]["partial"]
    assert partial["tok_s_simulated"] == pytest.approx(out["ratio"])
    assert partial["speedup_measured"] == 1.4 and partial["speedup_simulated"] > 0
    assert set(out["policies"]) == {"sync", "partial"}
