"""The Chrome trace export: well formed by the trace event format's rules, every request and
trainer phase in it once, and the validator itself catches what it should."""

from __future__ import annotations

import json

from rlkit.cli import main
from rlkit.view.run_data import RunData
from rlkit.view.trace_export import ENGINES_PID, TRAINER_PID, chrome_trace, validate_trace


def test_the_export_of_a_simulator_run_is_valid_and_complete(sim_run, tmp_path):
    folder, _ = sim_run
    out = tmp_path / "trace.json"
    assert main(["view", "--export-trace", str(folder), str(out)]) == 0
    trace = json.loads(out.read_text())
    assert validate_trace(trace) == []
    tl = RunData(folder).timeline()
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    requests = [e for e in events if e["pid"] == ENGINES_PID]
    assert len(requests) == len(tl["spans"]["lane"])
    assert sum(e["args"]["tokens"] for e in requests) == sum(tl["spans"]["tokens"])
    assert [e["name"] for e in events if e["pid"] == TRAINER_PID] == ["train", "sync"] * 3
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {f"sim-{k} #0" for k in (0, 1)} <= threads
    assert min(e["ts"] for e in events) == 0


def test_the_validator_catches_what_the_format_forbids():
    ok = {"ph": "X", "name": "a", "ts": 0, "dur": 5, "pid": 1, "tid": 1}
    assert validate_trace({"traceEvents": [ok, {**ok, "ts": 5}, {**ok, "ts": 6, "dur": 1}]}) == []
    assert validate_trace({"traceEvents": [ok, {**ok, "ts": 1, "dur": 1}]}) == []  # nested
    assert "before the thread's last" in validate_trace({"traceEvents": [{**ok, "ts": 9}, ok]})[0]
    assert "overlaps" in validate_trace({"traceEvents": [ok, {**ok, "ts": 3, "dur": 5}]})[0]
    assert "without dur" in validate_trace({"traceEvents": [{k: v for k, v in ok.items() if k != "dur"}]})[0]
    assert "negative" in validate_trace({"traceEvents": [{**ok, "dur": -1}]})[0]
    assert "unknown phase" in validate_trace({"traceEvents": [{**ok, "ph": "Q"}]})[0]
    assert validate_trace([]) == ["not an object with a traceEvents list"]
    assert validate_trace({"traceEvents": [{**ok, "tid": 2}, ok]}) == []  # threads apart


def test_export_needs_its_file(sim_run, capsys):
    folder, _ = sim_run
    assert main(["view", "--export-trace", str(folder)]) == 1
    assert "needs the file" in capsys.readouterr().out


def test_chrome_trace_of_frozen_lanes(tmp_path):
    lines = [{"kind": "step", "step": 1, "policy": "sync", "start": 0.0, "end": 2.0,
              "workers": ["http://e0"], "source": "real"},
             {"step": 1, "worker": "http://e0", "group_id": 0, "sample_index": 0, "start": 0.0,
              "end": 1.0, "tokens": 3, "outcome": "stop"},
             {"step": 1, "worker": "frozen:teacher", "group_id": 0, "sample_index": 0,
              "start": 1.0, "end": 1.5, "tokens": 0, "outcome": "scored"}]
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    trace = chrome_trace(RunData(tmp_path))
    assert validate_trace(trace) == []
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert "frozen engines" in names
