"""What each page of `rlkit view` shows, read from a run folder (pure: files in, JSON out).

A run folder from `rlkit train` holds recipe.yaml, metrics.jsonl, eval.jsonl, timeline.jsonl,
groups.jsonl, dropped.jsonl and samples/ (rlkit/tracking.py); one from the simulator (`rlkit
bench suite`'s timelines) only timeline.jsonl. Every reader takes what is there: a run still
writing may end a file in a half line, which is skipped, and a missing file is an empty page.

    overview()    the run's name, source, recipe, files, steps
    steps()       per-step rows (metrics + eval + what the timeline and groups give), and the
                  panels the Steps page draws (STEP_PANELS)
    timeline()    every request span of the run, column-wise, with its lane on its engine, the
                  trainer's phases and the step windows (Engines page); `compare`: another run's
                  timeline (the simulator's prediction) aligned step by step
    groups(step)  the step's groups, trained and dropped, and its saved samples
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

from rlkit.rollout.timeline import (OUTCOMES, TIMELINE_FILE, StepTimeline, TimelineError,
                                    assign_lanes, parse_timeline, read_timeline)
from rlkit.run_files import (DROPPED_FILE, EVAL_FILE, GROUPS_FILE, METRICS_FILE, RECIPE_FILE,
                             SAMPLES_DIR, sample_file)

RUN_FILES = (METRICS_FILE, TIMELINE_FILE, GROUPS_FILE)  # any one makes a folder a run

PHASE_COLOURS = {"train": "#f4a261", "sync": "#e76f51", "sleep": "#8d99ae", "eval": "#9bc53d",
                 "eval_wait": "#bdb2ff"}

# The Steps page's panels: a title and its series (metric keys; `eval/*/pass@1` stands for
# every eval pass's pass@1; `mismatch/lag*/kl_k3` every version lag's). A panel whose keys the run lacks is left out.
STEP_PANELS: list[tuple[str, list[str]]] = [
    ("reward", ["rollout/reward_mean", "batch/reward_mean"]),
    ("held-out accuracy (pass@1)", ["eval/*/pass@1"]),
    ("response length (tokens)", ["batch/response_length_mean", "batch/response_length_max"]),
    ("seconds per step", ["rollout/seconds", "train/seconds", "sync/seconds", "step/seconds"]),
    ("rollout tokens/s", ["rollout/throughput_tok_s"]),
    ("engines idle (share of the rollout's engine-seconds)", ["timeline/engine_idle_share"]),
    ("zero-variance and mixed-version shares", ["batch/zero_variance_share",
                                                "batch/mixed_version_share",
                                                "rollout/resumed_token_share"]),
    ("train-inference mismatch by version lag (KL k3)", ["mismatch/lag*/kl_k3"]),
    ("loss", ["train/loss"]),
    ("groups filtered or dropped", ["rollout/filtered_groups", "rollout/groups_carried_over"]),
]


class ViewError(ValueError):
    """A folder that is not a run (said with what it lacks)."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file; a line that does not parse (the half line of a run
    writing it now) is skipped. No file: no rows."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _finite(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


class RunData:
    """One run folder, read afresh on each call (the run may be writing it)."""

    def __init__(self, folder: str | Path, compare: str | Path | None = None) -> None:
        self.folder = Path(folder).resolve()
        if not self.folder.is_dir():
            raise ViewError(f"{folder}: not a folder")
        if not any((self.folder / f).is_file() for f in RUN_FILES):
            raise ViewError(f"{folder}: not a run folder (none of {', '.join(RUN_FILES)})")
        self.compare = RunData(compare) if compare is not None else None

    # -- overview ---------------------------------------------------------------------
    def recipe(self) -> dict[str, Any]:
        path = self.folder / RECIPE_FILE
        if not path.is_file():
            return {}
        import yaml

        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            return {}
        return loaded if isinstance(loaded, dict) else {}

    def overview(self) -> dict[str, Any]:
        recipe = self.recipe()
        metrics = read_jsonl(self.folder / METRICS_FILE)
        steps = [r["step"] for r in metrics if isinstance(r.get("step"), int)]
        timeline = self._timeline()
        source = "sim" if timeline and all(t.source == "sim" for t in timeline) else "real"
        recipe_text = (self.folder / RECIPE_FILE).read_text() if (self.folder / RECIPE_FILE).is_file() else ""
        files = sorted(p.name for p in self.folder.iterdir() if p.is_file() and not p.name.startswith("."))
        newest = max((p.stat().st_mtime for p in self.folder.iterdir() if p.is_file()), default=0.0)
        return {
            "folder": str(self.folder), "name": (recipe.get("run") or {}).get("name") or self.folder.name,
            "source": source, "recipe": recipe_text, "files": files,
            "steps": max(steps, default=max((t.step for t in timeline), default=0)),
            "num_steps": (recipe.get("run") or {}).get("num_steps"),
            "mode": (recipe.get("run") or {}).get("mode"),
            "policy": (recipe.get("rollout") or {}).get("policy") or next((t.policy for t in timeline if t.policy), None),
            "modified": newest, "compare": str(self.compare.folder) if self.compare else None,
        }

    # -- steps ------------------------------------------------------------------------
    def steps(self) -> dict[str, Any]:
        """One row per step: the metrics row, the held-out evaluation of the weights after it
        (eval.jsonl, keyed by the version evaluated; step 0 is the initial policy), and what a
        folder without metrics (the simulator's) can say from its timeline."""
        rows: dict[int, dict[str, float]] = {}
        for r in read_jsonl(self.folder / METRICS_FILE):
            if isinstance(r.get("step"), int):
                rows[r["step"]] = {k: f for k, v in r.items() if (f := _finite(v)) is not None}
        for r in read_jsonl(self.folder / EVAL_FILE):
            if isinstance(r.get("step"), int):
                row = rows.setdefault(r["step"], {"step": r["step"]})
                row.update({k: f for k, v in r.items() if k.startswith("eval/") and (f := _finite(v)) is not None})
        for tl in self._timeline():
            row = rows.setdefault(tl.step, {"step": tl.step})
            tokens = sum(s.tokens for s in tl.spans if not _frozen(s.worker))
            row.setdefault("rollout/seconds", tl.end - tl.start)
            if tl.end > tl.start:
                row.setdefault("rollout/throughput_tok_s", tokens / (tl.end - tl.start))
            row["timeline/requests"] = float(len(tl.spans))
            row["timeline/engine_idle_share"] = idle_share(tl)
        by_step: dict[int, list[dict[str, Any]]] = {}
        for g in read_jsonl(self.folder / GROUPS_FILE):
            by_step.setdefault(g.get("step"), []).append(g)
        for step, groups in by_step.items():
            if isinstance(step, int) and step in rows:
                rows[step].setdefault("batch/zero_variance_share", zero_variance_share(groups))
        ordered = [rows[k] for k in sorted(rows)]
        keys = sorted({k for r in ordered for k in r if k != "step"})
        return {"rows": ordered, "keys": keys, "panels": panels(keys)}

    # -- engines ----------------------------------------------------------------------
    def _timeline(self) -> list[StepTimeline]:
        try:
            return read_timeline(self.folder)
        except TimelineError:
            # a run writing it now may end in a half line: read what parses
            return _read_timeline_lenient(self.folder / TIMELINE_FILE)

    def timeline(self) -> dict[str, Any]:
        """Every span of the run column-wise (compact for 10,000s of requests): lanes are
        engines in the order the run named them, then frozen groups' lanes; within a lane each
        request gets the lowest free row (its `row`), so a lane's height is its running batch."""
        out = timeline_columns(self._timeline())
        if self.compare is not None:
            out["compare"] = aligned_compare(self._timeline(), self.compare._timeline())
        out["outcomes"] = {k: {"colour": c, "label": lab} for k, (c, lab) in OUTCOMES.items()}
        out["phase_colours"] = PHASE_COLOURS
        return out

    # -- advice -----------------------------------------------------------------------
    def advice(self) -> list[dict[str, Any]]:
        from rlkit.view.advice import RunFacts, advise

        return advise(RunFacts(self.steps()["rows"], self.recipe(), self.overview()["source"]))

    # -- groups and samples -----------------------------------------------------------
    def groups(self, step: int | None = None) -> dict[str, Any]:
        trained = read_jsonl(self.folder / GROUPS_FILE)
        steps = sorted({g["step"] for g in trained if isinstance(g.get("step"), int)})
        if step is None:
            step = steps[-1] if steps else 0
        samples = self.samples(step)
        saved = {(s["group_id"]) for s in samples}
        rows = []
        for g in trained:
            if g.get("step") == step:
                rows.append({**g, "kept": True, "saved": g.get("group_id") in saved,
                             "zero_variance": zero_variance_share([g]) == 1.0})
        for g in read_jsonl(self.folder / DROPPED_FILE):
            if g.get("step") == step:
                rows.append({**g, "kept": False, "saved": False,
                             "zero_variance": zero_variance_share([g]) == 1.0})
        return {"step": step, "steps": steps, "groups": rows, "samples": samples}

    def samples(self, step: int) -> list[dict[str, Any]]:
        path = sample_file(self.folder, step)
        if not path.is_file():
            return []
        try:
            return list(json.loads(path.read_text()).get("samples") or [])
        except ValueError:
            return []

    def sample_steps(self) -> list[int]:
        folder = self.folder / SAMPLES_DIR
        return sorted(int(p.stem[5:]) for p in folder.glob("step_*.json") if p.stem[5:].isdecimal())


# -- pieces, tested on their own -------------------------------------------------------
def _frozen(worker: str | None) -> bool:
    return bool(worker) and worker.startswith("frozen:")


def zero_variance_share(groups: Iterable[dict[str, Any]]) -> float:
    """The share of groups whose rewards are all equal (no advantage to learn from)."""
    groups = list(groups)
    if not groups:
        return math.nan
    same = 0
    for g in groups:
        rewards = [r for r in g.get("rewards") or [] if r is not None]
        same += len(set(rewards)) <= 1
    return same / len(groups)


def idle_share(tl: StepTimeline) -> float:
    """The share of engine-seconds of a step's window in which an engine ran no request."""
    workers = [w for w in tl.workers if not _frozen(w)] or sorted(
        {s.worker for s in tl.spans if s.worker and not _frozen(s.worker)})
    window = tl.end - tl.start
    if not workers or window <= 0:
        return math.nan
    busy = 0.0
    for w in workers:
        busy += union_length([(max(s.start, tl.start), min(s.end, tl.end)) for s in tl.spans if s.worker == w])
    return max(0.0, 1.0 - busy / (window * len(workers)))


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def timeline_columns(steps: list[StepTimeline]) -> dict[str, Any]:
    workers: list[str] = []
    for tl in steps:
        for w in [*tl.workers, *(s.worker for s in tl.spans)]:
            if w is not None and w not in workers:
                workers.append(w)
    workers.sort(key=_frozen)  # engines first, in the run's order; frozen groups below
    index = {w: i for i, w in enumerate(workers)}
    cols: dict[str, list[Any]] = {k: [] for k in ("lane", "start", "end", "admitted", "outcome",
                                                  "resumed", "group", "sample", "tokens", "step")}
    outcomes: list[str] = []
    for tl in steps:
        for s in tl.spans:
            if s.worker is None:
                continue
            if s.outcome not in outcomes:
                outcomes.append(s.outcome)
            cols["lane"].append(index[s.worker])
            cols["start"].append(s.start)
            cols["end"].append(max(s.end, s.start))
            cols["admitted"].append(s.admitted)
            cols["outcome"].append(outcomes.index(s.outcome))
            cols["resumed"].append(s.response_before)
            cols["group"].append(s.group_id)
            cols["sample"].append(s.sample_index)
            cols["tokens"].append(s.tokens)
            cols["step"].append(tl.step)
    row = [0] * len(cols["lane"])
    rows_per_lane = [0] * len(workers)
    for lane in range(len(workers)):
        mine = [i for i, x in enumerate(cols["lane"]) if x == lane]
        packed = assign_lanes([(cols["start"][i], cols["end"][i]) for i in mine])
        for i, r in zip(mine, packed):
            row[i] = r
        rows_per_lane[lane] = max(packed, default=-1) + 1
    cols["row"] = row
    times = [t for tl in steps for t in (tl.start, tl.end)] + cols["start"] + cols["end"]
    phases = [{"step": tl.step, "name": p.name, "start": p.start, "end": p.end}
              for tl in steps for p in tl.phases]
    times += [t for p in phases for t in (p["start"], p["end"])]
    return {
        "workers": workers, "rows_per_lane": rows_per_lane, "outcome_names": outcomes,
        "spans": cols, "phases": phases,
        "steps": [{"step": tl.step, "start": tl.start, "end": tl.end, "policy": tl.policy,
                   "round": tl.round, "source": tl.source} for tl in steps],
        "t0": min(times, default=0.0), "t1": max(times, default=0.0),
    }


def aligned_compare(real: list[StepTimeline], other: list[StepTimeline]) -> dict[str, Any]:
    """Another run's timeline (the simulator's prediction for the same recipe) drawn over this
    one: its step k moved to start where this run's step k started, and per engine (matched
    by position) the number of requests it ran over time, as a step curve per lane."""
    starts = {tl.step: tl.start for tl in real}
    lanes: dict[int, list[tuple[float, int]]] = {}
    for tl in other:
        if tl.step not in starts:
            continue
        shift = starts[tl.step] - tl.start
        workers = [w for w in tl.workers if not _frozen(w)] or sorted(
            {s.worker for s in tl.spans if s.worker and not _frozen(s.worker)})
        for lane, w in enumerate(workers):
            events = lanes.setdefault(lane, [])
            for s in tl.spans:
                if s.worker == w:
                    events += [(s.start + shift, 1), (max(s.end, s.start) + shift, -1)]
    curves = {}
    for lane, events in lanes.items():
        running, curve = 0, []
        for t, d in sorted(events):
            running += d
            curve.append([t, running])
        curves[str(lane)] = curve
    return {"lanes": curves, "steps": [tl.step for tl in other if tl.step in starts]}


def panels(keys: list[str]) -> list[dict[str, Any]]:
    """STEP_PANELS with the run's keys: `eval/*/pass@1` expands to every eval pass's."""
    out = []
    for title, wanted in STEP_PANELS:
        series = []
        for k in wanted:
            if "*" in k:
                head, tail = k.split("*")
                series += [x for x in keys if x.startswith(head) and x.endswith(tail)]
            elif k in keys:
                series.append(k)
        if series:
            out.append({"title": title, "series": series})
    return out


def _read_timeline_lenient(path: Path) -> list[StepTimeline]:
    """The timeline's lines that parse (a run writing the file ends it in a half line)."""
    if not path.is_file():
        return []
    good = []
    for line in path.read_text().splitlines():
        try:
            json.loads(line)
        except ValueError:
            continue
        good.append(line)
    try:
        return parse_timeline(good, str(path))
    except TimelineError:
        return []
