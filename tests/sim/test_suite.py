"""`rlkit bench suite` runs end to end on a tiny set-up and writes its table and chart."""

from __future__ import annotations

import json

import pytest

from rlkit.bench.suite import make_policy
from rlkit.cli import main


def test_tiny_suite_writes_table_chart_and_steps(tmp_path, capsys):
    code = main([
        "bench", "suite", "--caps", "1024,2048", "--policies", "sync,partial@1.5",
        "--batch-size", "4", "--group-size", "4", "--prompts", "128", "--engines", "2",
        "--profile", "h100-qwen3-4b-tp1", "--warmup", "1", "--steps", "2", "--out", str(tmp_path),
    ])
    assert code == 0
    table = (tmp_path / "suite.md").read_text()
    for row in ("| 1k | sync |", "| 1k | partial@1.5 |", "| 2k | sync |", "| 2k | partial@1.5 |"):
        assert row in table
    rows = json.loads((tmp_path / "suite.json").read_text())
    assert len(rows) == 4 and all(len(r["steps"]) == 2 for r in rows)
    assert (tmp_path / "suite.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "traces" / "trace-cap1024.jsonl").exists()
    assert (tmp_path / "timelines" / "cap2048-partial-1.5" / "timeline.jsonl").exists()
    assert "rollout tok/s" in capsys.readouterr().out


def test_policy_specs():
    assert make_policy("partial@1.25").over_provision == 1.25
    assert make_policy("sync").name == "sync"
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("magic")
