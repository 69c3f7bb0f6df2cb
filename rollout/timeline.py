"""The on-disk timeline of engine activity: `RUN/timeline.jsonl`, one JSON object per line.

One record, `Span`, serves real runs and the simulator. The real driver writes it through
`rlkit.tracking.Tracker.log_timeline` (one line per `Span` of the RolloutManager's
StepReport, with its step); the simulator writes the same lines from the simulated engines'
request segments, with `admitted` known, and a step line before each step's spans.
`rlkit plot timeline RUN` reads both.

Span line (one stay of one request on one worker):

    {"step": int, "worker": str | null, "group_id": int, "sample_index": int,
     "start": float, "end": float, "tokens": int, "outcome": str,
     "admitted": float | null,      optional: when the engine started running it (the
                                    simulator knows; HTTP engines do not report it)
     "response_before": int}        optional: response length it resumed from (0: fresh)

Step line (optional; the simulator and the real driver write one per step, before its spans):

    {"kind": "step", "step": int, "policy": str, "start": float, "end": float,
     "workers": [str, ...], "source": "sim" | "real",
     "round": str}                  optional: the policy's kind of step (tail batching: short
                                    | long)

Phase line (optional; one per trainer phase of the step: what the driver waited for after the
step's rollout; in async mode it overlaps the next step's requests):

    {"step": int, "kind": "phase", "name": "train" | "sync" | "sleep" | "eval" | "eval_wait",
     "start": float, "end": float}

Times are seconds on the run's clock (`loop.time()`; virtual in the simulator). `start` is
when the request was sent (or queued at the engine), `end` when it returned with `tokens`
generated. `outcome` is stop | length | abort | cancelled | preempt | error. Without
a step line, a step spans its requests and its workers are those that served one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TIMELINE_FILE = "timeline.jsonl"
_OLD_SPELLINGS = {"cancel": "cancelled"}  # the simulator's, in files written before 2026-11-22


class TimelineError(ValueError):
    """A timeline file that does not follow the format."""


@dataclass
class Span:
    """One stay of one request on one worker (its step is its StepTimeline's, or the line's)."""

    worker: str | None
    group_id: int
    sample_index: int
    start: float
    end: float
    tokens: int
    outcome: str
    admitted: float | None = None
    response_before: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"worker": self.worker, "group_id": self.group_id,
                "sample_index": self.sample_index, "start": self.start, "end": self.end,
                "tokens": self.tokens, "outcome": self.outcome, "admitted": self.admitted,
                "response_before": self.response_before}


# How a request span ended: its colour and label in `rlkit plot timeline` and `rlkit view`.
OUTCOMES: dict[str, tuple[str, str]] = {
    "stop": ("#4c9a2a", "finished (stop)"),
    "length": ("#e08e0b", "truncated at the cap"),
    "abort": ("#5b7db8", "aborted, parked with its tokens"),
    "cancelled": ("#b0b0b0", "cancelled (surplus)"),
    "preempt": ("#9b59b6", "preempted (KV full)"),
    "error": ("#c0392b", "failed"),
    "lost": ("#555555", "engine or router lost (relaunched with its tokens)"),
    "scored": ("#16a085", "frozen engine: answered"),
    "timeout": ("#e74c3c", "frozen engine: timed out"),
    "bad_output": ("#d35400", "frozen engine: bad output"),
}
PHASES = ("train", "sync", "sleep", "eval", "eval_wait")  # trainer phases (Run.end_step, Run.to_training)


@dataclass
class Phase:
    """One trainer phase the driver waited for: train (what training was left once the batch
    was in, and the optimizer step), sync (the weight push; colocated, the engines' wake),
    sleep (colocated: the engines release the GPUs), eval (sync and stream modes: the held-out
    evaluation between two steps, on the engines; with the next step's phases), eval_wait (a
    sync waiting for an evaluation in flight, async mode)."""

    name: str
    start: float
    end: float

    def to_json(self) -> dict[str, Any]:
        return {"kind": "phase", "name": self.name, "start": self.start, "end": self.end}


@dataclass
class StepTimeline:
    step: int
    policy: str
    start: float
    end: float
    workers: list[str]
    source: str = "sim"
    spans: list[Span] = field(default_factory=list)
    round: str = ""
    phases: list[Phase] = field(default_factory=list)

    def header(self) -> dict[str, Any]:
        return {"kind": "step", "step": self.step, "policy": self.policy, "start": self.start,
                "end": self.end, "workers": self.workers, "source": self.source,
                "round": self.round}


def append_step(path: str | Path, timeline: StepTimeline) -> None:
    """Append one step (its header line, then its spans) to a timeline file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(timeline.header()) + "\n")
        for s in timeline.spans:
            f.write(json.dumps({"step": timeline.step, **s.to_json()}) + "\n")
        for p in timeline.phases:
            f.write(json.dumps({"step": timeline.step, **p.to_json()}) + "\n")


def read_timeline(path: str | Path) -> list[StepTimeline]:
    """All steps of a timeline file (or of RUN/timeline.jsonl when given a directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / TIMELINE_FILE
    if not path.exists():
        raise TimelineError(f"no timeline at {path}")
    return parse_timeline(path.read_text().splitlines(), str(path))


def parse_timeline(lines: list[str], where: str = "timeline") -> list[StepTimeline]:
    """The steps of a timeline's lines (`where` names the file in errors)."""
    steps: dict[int, StepTimeline] = {}
    declared: set[int] = set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            if d.get("kind") == "step":
                step = int(d["step"])
                tl = steps.setdefault(step, StepTimeline(step, "", 0.0, 0.0, []))
                tl.policy, tl.start, tl.end = str(d["policy"]), float(d["start"]), float(d["end"])
                tl.workers = [str(w) for w in d["workers"]]
                tl.source = str(d.get("source", "real"))
                tl.round = str(d.get("round") or "")
                declared.add(step)
                continue
            if d.get("kind") == "phase":
                step = int(d["step"])
                phase = Phase(str(d["name"]), float(d["start"]), float(d["end"]))
                steps.setdefault(step, StepTimeline(step, "", phase.start, phase.end, [])).phases.append(phase)
                continue
            step = int(d["step"])
            span = Span(
                d["worker"], int(d["group_id"]), int(d["sample_index"]),
                float(d["start"]), float(d["end"]), int(d["tokens"]),
                _OLD_SPELLINGS.get(str(d["outcome"]), str(d["outcome"])),
                None if d.get("admitted") is None else float(d["admitted"]),
                int(d.get("response_before") or 0),
            )
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
            raise TimelineError(f"{where}:{n}: bad line ({type(e).__name__}: {e})") from None
        steps.setdefault(step, StepTimeline(step, "", span.start, span.end, [])).spans.append(span)
    for step, tl in steps.items():
        if step not in declared and tl.spans:  # real driver: infer the window and workers
            tl.start = min(s.start for s in tl.spans)
            tl.end = max(s.end for s in tl.spans)
            tl.workers = sorted({s.worker for s in tl.spans if s.worker is not None})
            tl.source = "real"
    return [steps[k] for k in sorted(steps)]


def assign_lanes(intervals: list[tuple[float, float]]) -> list[int]:
    """Greedy interval packing: the lowest free lane for each interval (sorted by start)."""
    import heapq

    order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], intervals[i][1]))
    lanes = [0] * len(intervals)
    busy: list[tuple[float, int]] = []  # (end, lane)
    free: list[int] = []
    n_lanes = 0
    for i in order:
        start, end = intervals[i]
        while busy and busy[0][0] <= start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            lane = heapq.heappop(free)
        else:
            lane, n_lanes = n_lanes, n_lanes + 1
        lanes[i] = lane
        heapq.heappush(busy, (end, lane))
    return lanes
