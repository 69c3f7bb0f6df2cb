"""`rlkit bench engine` runs end to end on the tiny model and writes a profile the simulator
loads."""

from __future__ import annotations

import argparse
import json

import pytest

from rlkit.bench import engine as bench

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


def test_bench_engine_smoke(tiny_model_dir, tmp_path, capsys):
    from rlkit.rollout.engines.profile import load_profile

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([
        "--models", str(tiny_model_dir), "--concurrency", "1,4", "--new-tokens", "12",
        "--rounds", "1", "--profile-batch-sizes", "1,2,4", "--profile-dir", str(tmp_path / "p"),
        "--out", str(tmp_path / "r"),
    ])
    assert bench.run(args) == 0
    report = json.loads((tmp_path / "r" / "engine.json").read_text())
    assert [r["concurrency"] for r in report["results"]] == [1, 4]
    assert all(r["generate_tok_s"][0] > 0 and r["engine_tok_s"][0] > 0 for r in report["results"])
    assert report["conditions"]["stream_interval"] == 8
    profile = load_profile(report["profiles"][0])
    assert profile.batch_sizes == (1, 2, 4) and all(p > 0 for p in profile.ptl_s)
    assert profile.prefill_s_per_token > 0
    assert "| engine / generate |" in capsys.readouterr().out
