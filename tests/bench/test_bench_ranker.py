"""`rlkit bench ranker`: recall per ranker on a trace's first and later passes, and on the
groups a run recorded (RUN/groups.jsonl)."""

from __future__ import annotations

import json

from rlkit.bench.ranker import bench_rankers, format_table, run_steps, trace_steps
from rlkit.cli import main
from rlkit.sim.trace import TraceSpec, generate_trace


def test_history_remembers_what_it_saw_and_the_oracle_is_exact():
    trace = generate_trace(TraceSpec(rows=96, epochs=2, cap=2048, group_size=4, batch_size=16))
    steps = trace_steps(trace, 16)
    assert len(steps) == 12 and [s.first_pass for s in steps] == [True] * 6 + [False] * 6
    r = bench_rankers(steps, ["history", "prompt_length", "oracle"], trace=trace, warmup=1)
    hist, oracle = r["rankers"]["history"], r["rankers"]["oracle"]
    assert oracle["seen"]["recall@20"] == oracle["unseen"]["recall@20"] == 1.0
    assert hist["seen"]["recall@20"] > 0.8 > hist["unseen"]["recall@20"]
    assert hist["steps"] == {"unseen": 5, "seen": 6}
    r["source"] = "test"
    assert "| history |" in format_table(r)


def test_a_runs_recorded_groups_are_scored_step_by_step(tmp_path, capsys):
    rows = []
    for step in range(1, 7):  # 3 prompts, each met twice: steps 4-6 repeat steps 1-3
        src = (step - 1) % 3
        for k in range(4):
            rows.append({"step": step, "group_id": step * 10 + k, "source_index": src * 4 + k,
                         "epoch": (step - 1) // 3, "prompt_len": 5,
                         "predicted": None, "lengths": [10 + 100 * k] * 2, "rewards": [0, 1]})
    (tmp_path / "groups.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps = run_steps(tmp_path)
    assert [s.first_pass for s in steps] == [True] * 3 + [False] * 3
    assert main(["bench", "ranker", "--run", str(tmp_path), "--rankers", "history",
                 "--warmup", "0", "--out", str(tmp_path / "report")]) == 0
    out = capsys.readouterr().out
    assert "| history | " in out and "| 1.00 |" in out  # seen before: the longest is known
    assert "| history | " in (tmp_path / "report" / "ranker.md").read_text()
