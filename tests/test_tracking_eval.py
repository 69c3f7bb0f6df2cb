"""Tracker.log_eval: one RUN/eval.jsonl row per evaluation (step = the weights' steps), one
console line per dataset and pass, and a resumed run's rewind drops evaluations it redoes."""

import io
import json
import math

from rich.console import Console

from rlkit.config.schema import TrackingConfig
from rlkit.tracking import EVAL_FILE, Tracker, eval_passes, rewind


def metrics(pass1, k=None):
    m = {"eval/held/greedy/pass@1": pass1, "eval/held/greedy/mean_reward": pass1,
         "eval/held/greedy/mean_response_length": 12.5, "eval/held/greedy/max_response_length": 30.0,
         "eval/held/greedy/truncation_rate": 0.0, "eval/held/greedy/prompts": 8.0,
         "eval/held/greedy/seconds": 1.5}
    if k:
        m.update({"eval/held/sampled/pass@1": 0.25, f"eval/held/sampled/pass@{k}": 0.5,
                  "eval/held/sampled/mean_reward": math.nan})
    return m


def test_evaluations_are_rows_of_their_own_and_console_lines(tmp_path):
    t = Tracker(TrackingConfig(wandb="disabled", progress=True), tmp_path, "r", {})
    out = io.StringIO()
    t._console = Console(file=out, force_terminal=False, width=80)
    t.log_eval(0, metrics(0.5))
    t.log(1, {"rollout/reward_mean": 0.1})
    t.log(2, {"rollout/reward_mean": 0.2})
    t.log_eval(2, metrics(0.75, k=4))
    t.close()
    rows = [json.loads(x) for x in (tmp_path / EVAL_FILE).read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 2]
    assert rows[1]["eval/held/sampled/pass@4"] == 0.5 and rows[1]["eval/held/sampled/mean_reward"] is None
    steps = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert not any(k.startswith("eval/") for r in steps for k in r)
    lines = [x for x in out.getvalue().splitlines() if x.startswith("eval")]
    assert len(lines) == 3  # greedy at 0; greedy and sampled at 2, each on one line (no wrap)
    assert lines[0].startswith("eval after step    0 | held/greedy: pass@1 0.500 | reward 0.500")
    assert "held/sampled: pass@1 0.250 | pass@4 0.500 | reward -" in lines[2]


def test_rewind_drops_the_evaluations_a_resumed_run_redoes(tmp_path):
    t = Tracker(TrackingConfig(wandb="disabled", progress=False), tmp_path, "r", {})
    for step in (0, 2, 4):
        t.log_eval(step, metrics(0.1 * step))
    t.close()
    rewind(tmp_path, 3)
    assert [json.loads(x)["step"] for x in (tmp_path / EVAL_FILE).read_text().splitlines()] == [0, 2]


def test_eval_passes_groups_keys_by_dataset_and_pass():
    got = eval_passes({**metrics(0.5, k=4), "rollout/reward_mean": 0.3, "eval/wait_seconds": 0.0})
    assert sorted(got) == ["held/greedy", "held/sampled"]
    assert got["held/sampled"]["pass@4"] == 0.5
