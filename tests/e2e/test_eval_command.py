"""`rlkit eval` end to end on the tiny model: one real engine behind the router, the built-in
arithmetic test split, a greedy and a sampled pass; the JSON report and no process left."""

import json
import os
from pathlib import Path

import pytest

from rlkit.cli import main
from tests.e2e.test_train_tiny import processes_with

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_eval_command_on_tiny(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path / "cache"))  # a model path unique to this test
    out = tmp_path / "eval.json"
    rc = main([
        "eval", "tiny", "builtin:arithmetic?split=test&rows=6", "--engines", "1",
        "--set", "eval.n_samples=4", "--set", "eval.k=2",
        "--set", "rollout.sampling.max_new_tokens=16", "--out", str(out),
    ])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "arithmetic/greedy" in printed and "arithmetic/sampled" in printed

    report = json.loads(out.read_text())
    assert (report["model"], report["version"]) == ("tiny", 0)
    greedy, sampled = report["results"]
    assert (greedy["name"], sampled["name"]) == ("arithmetic/greedy", "arithmetic/sampled")
    for r in (greedy, sampled):
        assert r["prompts"] == 6 and r["version"] == 0
        assert r["failures"] == 0 and r["errors"] == []
        assert 0 < r["max_response_length"] <= 16
        assert 0 <= r["mean_response_length"] <= 16
        assert 0 <= r["pass@1"] <= 1
    assert (greedy["n"], greedy["samples"]) == (1, 6)
    assert (sampled["n"], sampled["k"], sampled["samples"]) == (4, 2, 24)
    assert 0 <= sampled["pass@1"] <= sampled["pass@2"] <= 1
    assert sampled["pass@k"] == sampled["pass@2"]
    assert report["metrics"]["eval/arithmetic/sampled/pass@2"] == sampled["pass@2"]
    assert report["metrics"]["eval/arithmetic/greedy/samples"] == 6

    model_dir = Path(os.environ["RLKIT_CACHE"]) / "models" / "tiny"
    assert model_dir.is_dir()
    assert processes_with(str(model_dir)) == []
