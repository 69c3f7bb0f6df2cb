"""`rlkit view --export-trace RUN OUT.json`: a run's timeline in the Chrome trace event format
(the JSON that Perfetto's UI, ui.perfetto.dev, and chrome://tracing open).

Processes and threads of the trace:
    pid 1 "steps"          one complete event per rollout step (its window, policy, round)
    pid 2 "engines"        one thread per engine row: each request a complete event ("X")
                           named by its outcome, args group/sample/tokens/resumed-from; the
                           rows are the viewer's (lowest free row), so events of a thread never
                           overlap, as the format wants of complete events on one thread
    pid 3 "trainer"        the phases the driver waited for (train, sync, sleep, eval_wait)
    pid 4 "frozen engines" a teacher's or judge's tries, one thread per row as the engines
Timestamps are microseconds from the run's first event; a thread's events are written in time
order. `validate_trace` checks what the format requires (tests/view/test_trace_export.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlkit.view.run_data import RunData

STEPS_PID, ENGINES_PID, TRAINER_PID, FROZEN_PID = 1, 2, 3, 4
US = 1e6


def chrome_trace(run: RunData) -> dict[str, Any]:
    tl = run.timeline()
    t0 = tl["t0"]

    def us(t: float) -> float:
        return round((t - t0) * US, 3)

    events: list[dict[str, Any]] = []
    meta: list[dict[str, Any]] = []

    def name_process(pid: int, name: str) -> None:
        meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "ts": 0,
                     "args": {"name": name}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "ts": 0,
                     "args": {"sort_index": pid}})

    def name_thread(pid: int, tid: int, name: str) -> None:
        meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0,
                     "args": {"name": name}})
        meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "ts": 0,
                     "args": {"sort_index": tid}})

    name_process(STEPS_PID, "steps")
    name_thread(STEPS_PID, 1, "rollout steps")
    for s in tl["steps"]:
        events.append({"ph": "X", "name": f"step {s['step']}" + (f" ({s['round']})" if s["round"] else ""),
                       "cat": "step", "pid": STEPS_PID, "tid": 1, "ts": us(s["start"]),
                       "dur": us(s["end"]) - us(s["start"]),
                       "args": {"policy": s["policy"], "source": s["source"]}})
    name_process(ENGINES_PID, "engines")
    name_process(TRAINER_PID, "trainer")
    name_thread(TRAINER_PID, 1, "driver waits")
    sp = tl["spans"]
    threads: dict[tuple[int, int], int] = {}  # (lane, row) -> tid
    for i in range(len(sp["lane"])):
        lane, row = sp["lane"][i], sp["row"][i]
        worker = tl["workers"][lane]
        frozen = worker.startswith("frozen:")
        pid = FROZEN_PID if frozen else ENGINES_PID
        key = (lane, row)
        if key not in threads:
            threads[key] = tid = lane * 10_000 + row + 1
            name_thread(pid, tid, f"{worker} #{row}")
        outcome = tl["outcome_names"][sp["outcome"][i]]
        resumed = sp["resumed"][i]
        args = {"step": sp["step"][i], "group": sp["group"][i], "sample": sp["sample"][i],
                "tokens": sp["tokens"][i], "outcome": outcome}
        if resumed:
            args["resumed_from_tokens"] = resumed
        if sp["admitted"][i] is not None:
            args["queued_s"] = round(sp["admitted"][i] - sp["start"][i], 6)
        events.append({"ph": "X", "name": outcome + (" (resumed)" if resumed else ""),
                       "cat": "frozen" if frozen else "request", "pid": pid, "tid": threads[key],
                       "ts": us(sp["start"][i]), "dur": us(sp["end"][i]) - us(sp["start"][i]),
                       "args": args})
    if any(tl["workers"][lane].startswith("frozen:") for lane, _ in threads):
        name_process(FROZEN_PID, "frozen engines")
    for p in tl["phases"]:
        events.append({"ph": "X", "name": p["name"], "cat": "trainer", "pid": TRAINER_PID,
                       "tid": 1, "ts": us(p["start"]), "dur": us(p["end"]) - us(p["start"]),
                       "args": {"step": p["step"]}})
    events.sort(key=lambda e: (e["pid"], e["tid"], e["ts"]))
    overview = run.overview()
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"run": overview["name"], "folder": overview["folder"],
                          "source": overview["source"]}}


def write_trace(run: RunData, out: str | Path) -> int:
    """Write the trace; the number of events."""
    trace = chrome_trace(run)
    problems = validate_trace(trace)
    if problems:  # a bug here, not the user's: say what
        raise AssertionError("trace export broke the format: " + "; ".join(problems[:5]))
    Path(out).write_text(json.dumps(trace))
    return len(trace["traceEvents"])


REQUIRED = {"X": ("name", "ph", "ts", "dur", "pid", "tid"), "M": ("name", "ph", "pid", "args"),
            "B": ("name", "ph", "ts", "pid", "tid"), "E": ("ph", "ts", "pid", "tid"),
            "i": ("name", "ph", "ts", "pid", "tid")}


def validate_trace(trace: Any) -> list[str]:
    """What a trace breaks of the Chrome trace event format (JSON object form): the fields each
    event kind requires, numbers where numbers go, non-negative durations, timestamps in
    order within each thread, and complete events of one thread nested or apart, never
    overlapping. [] when it is well formed."""
    problems: list[str] = []
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["not an object with a traceEvents list"]
    last: dict[tuple[Any, Any], tuple[float, float]] = {}  # thread -> last X's (ts, end)
    for n, e in enumerate(trace["traceEvents"]):
        ph = e.get("ph") if isinstance(e, dict) else None
        if ph not in REQUIRED:
            problems.append(f"event {n}: unknown phase {ph!r}")
            continue
        missing = [k for k in REQUIRED[ph] if k not in e]
        if missing:
            problems.append(f"event {n}: {ph} without {', '.join(missing)}")
            continue
        if ph == "M":
            if not isinstance(e["args"], dict) or "name" not in e["args"] and "sort_index" not in e["args"]:
                problems.append(f"event {n}: metadata without args.name")
            continue
        if not all(isinstance(e.get(k), (int, float)) for k in ("ts", "pid", "tid")):
            problems.append(f"event {n}: ts, pid and tid must be numbers")
            continue
        if ph == "X":
            if not isinstance(e["dur"], (int, float)) or e["dur"] < 0:
                problems.append(f"event {n}: negative or missing duration")
                continue
            thread = (e["pid"], e["tid"])
            ts, end = e["ts"], e["ts"] + e["dur"]
            if thread in last:
                prev_ts, prev_end = last[thread]
                if ts < prev_ts:
                    problems.append(f"event {n}: timestamp {ts} before the thread's last {prev_ts}")
                elif ts < prev_end and end > prev_end + 1e-3:
                    problems.append(f"event {n}: overlaps the thread's previous event without nesting")
            last[thread] = (ts, max(end, last.get(thread, (0, 0))[1]))
    return problems
