"""`rlkit bench suite` runs end to end on a tiny set-up and writes its table and chart."""

from __future__ import annotations

import json

import pytest

from rlkit.bench.suite import make_policy
from rlkit.cli import main


def test_tiny_suite_writes_table_chart_and_steps(tmp_path, capsys):
    code = main([
        "bench", "suite", "--caps", "1024,2048", "--policies", "sync,partial@1.5,tail_batching",
        "--batch-size", "4", "--group-size", "4", "--prompts", "128", "--engines", "2",
        "--profile", "h100-qwen3-4b-tp1", "--warmup", "1", "--steps", "2", "--out", str(tmp_path),
    ])
    assert code == 0
    table = (tmp_path / "suite.md").read_text()
    for cap in ("1k", "2k"):
        for policy in ("sync", "partial@1.5", "tail_batching"):
            assert f"| {cap} | sync | {policy} |" in table
    assert "long rounds" in table  # the rounds table, for tail batching
    rows = json.loads((tmp_path / "suite.json").read_text())
    assert len(rows) == 6 and all(len(r["steps"]) == 2 for r in rows)
    tail = [r for r in rows if r["policy"] == "tail_batching"]
    assert all(s["round"] in ("short", "long") for r in tail for s in r["steps"])
    assert (tmp_path / "suite.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "traces" / "trace-cap1024.jsonl").exists()
    assert (tmp_path / "timelines" / "cap2048-partial-1.5" / "timeline.jsonl").exists()
    assert "rollout tok/s" in capsys.readouterr().out


def test_the_suite_runs_every_policy_in_every_mode_with_each_mode_s_limit(tmp_path):
    """The simulator drives the real mode loops: stream hides training behind generation,
    async overlaps it (its step close to max(rollout, train + sync)), and neither beats its
    mode's physical limit."""
    code = main([
        "bench", "suite", "--caps", "2048", "--policies", "sync,partial@1.5",
        "--modes", "sync,stream,async", "--batch-size", "8", "--group-size", "4",
        "--prompts", "256", "--engines", "2", "--profile", "h100-qwen3-4b-tp1", "--warmup", "1",
        "--steps", "3", "--train-gpus", "1", "--no-timelines", "--out", str(tmp_path),
    ])
    assert code == 0
    rows = {(r["mode"], r["policy"]): r for r in json.loads((tmp_path / "suite.json").read_text())}
    assert len(rows) == 6
    sync = rows[("sync", "sync")]
    for policy in ("sync", "partial@1.5"):
        stream, asyn = rows[("stream", policy)], rows[("async", policy)]
        assert stream["train_hidden"] > 0.0 and asyn["train_hidden"] > stream["train_hidden"]
        assert asyn["step_s"] < stream["step_s"] <= rows[("sync", policy)]["step_s"] + 1e-6
        assert asyn["overlap_ratio"] < 1.3
        overhead = sum(s["train_s"] + s["sync_s"] for s in sync["steps"]) / len(sync["steps"])
        limit = sync["step_s"] / max(sync["bound_s"], overhead)
        # (the limit is of the means: a step at max(its own bound, its own train + sync) each
        # time can beat max(mean bound, mean train + sync) by a little)
        assert sync["step_s"] / asyn["step_s"] <= limit * 1.05
    assert "| 2k | async | partial@1.5 |" in (tmp_path / "suite.md").read_text()


def test_policy_specs_come_from_the_registry():
    assert make_policy("partial@1.25").over_provision == 1.25
    assert make_policy("sync").name == "sync"
    tail = make_policy("tail_batching@1.5+resume")
    assert (tail.eta_prompts, tail.eta_responses, tail.deferred) == (1.5, 1.5, "resume")
    with pytest.raises(ValueError, match="unknown policy 'magic'"):
        make_policy("magic")
    with pytest.raises(ValueError, match="sync takes no @value"):
        make_policy("sync@2")
    with pytest.raises(ValueError, match=r"no option \+fast \(\+resume, \+proactive"):
        make_policy("tail_batching+fast")
    with pytest.raises(ValueError, match="over_provision"):
        make_policy("partial@0.5")  # the schema's own range check


def test_the_suite_runs_multi_turn_episodes_with_the_ranker_s_turns(tmp_path):
    """`--episodes`: every sample an agentic episode (turns, tool calls), replayed through the
    real episode layer; the table says what the episodes were and the rankers' turn recall."""
    code = main([
        "bench", "suite", "--episodes", "--caps", "4096", "--policies", "sync,partial+history",
        "--modes", "sync,async", "--batch-size", "4", "--group-size", "2", "--prompts", "16",
        "--epochs", "12", "--engines", "2", "--profile", "h100-qwen3-4b-tp1", "--warmup", "4",
        "--steps", "2", "--train-gpus", "1", "--no-timelines", "--out", str(tmp_path),
    ])
    assert code == 0
    table = (tmp_path / "suite.md").read_text()
    assert "model turns on average" in table and "prefix cache" in table
    assert "| 4k | async | partial+history |" in table and " turns |" in table
    rows = json.loads((tmp_path / "suite.json").read_text())
    assert len(rows) == 4 and all(s["tokens_in_batch"] > 0 for r in rows for s in r["steps"])
    partial = next(r for r in rows if r["policy"] == "partial+history")
    assert 0.0 <= partial["turns_recall20"] <= 1.0


def test_the_frontier_table_puts_speed_beside_the_lag_of_the_trained_tokens(tmp_path):
    """One frontier table per cap (every mode and policy: speed-ups, share of the mode limit,
    lag shares, max lag), the same figures in the JSON; --max-token-lag bounds the max lag."""
    args = ["bench", "suite", "--caps", "2048", "--policies", "sync,partial@2.0", "--modes",
            "sync,async", "--batch-size", "8", "--group-size", "4", "--prompts", "256",
            "--engines", "2", "--profile", "h100-qwen3-4b-tp1", "--warmup", "2", "--steps", "6",
            "--train-gpus", "1", "--no-timelines"]
    rows = {}
    for bound in (None, 1):
        out = tmp_path / str(bound)
        extra = [] if bound is None else ["--max-token-lag", str(bound)]
        assert main([*args, *extra, "--out", str(out)]) == 0
        table = (out / "suite.md").read_text()
        assert "Cap 2k:" in table and "| lag 0 | lag 1 | lag 2 | lag 3+ | max lag |" in table
        assert "- async: best " in table and f"max token lag {bound or 'none'}" in table
        rows[bound] = {(r["mode"], r["policy"]): r
                       for r in json.loads((out / "suite.json").read_text())}
    for r in rows[None].values():
        assert sum(r["trained_lag_shares"].values()) == pytest.approx(1.0)
        assert 0 < r["of_mode_limit"] == pytest.approx(r["speedup"] / r["mode_limit"])
    free, bounded = rows[None], rows[1]
    assert free[("sync", "sync")]["trained_lag_shares"]["lag0"] == 1.0  # on-policy: lag 0 only
    assert free[("async", "sync")]["trained_max_lag"] == 1  # one version ahead, no more
    assert free[("sync", "partial@2.0")]["trained_max_lag"] > 1
    assert free[("async", "partial@2.0")]["trained_max_lag"] > 1
    for key in (("sync", "partial@2.0"), ("async", "partial@2.0")):
        assert bounded[key]["trained_max_lag"] <= 1 and bounded[key]["lag_restarts_per_step"] >= 0
        assert free[key]["lag_restarts_per_step"] == 0 and free[key]["lag_restart_share"] == 0
