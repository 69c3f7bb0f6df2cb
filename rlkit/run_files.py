"""The files of a run folder, by name (written by rlkit/tracking.py and the driver, read by
`rlkit view`, `rlkit plot` and the benchmarks). Names only: no import reaches torch."""

from __future__ import annotations

from pathlib import Path

RECIPE_FILE = "recipe.yaml"  # the resolved recipe the run started with
METRICS_FILE = "metrics.jsonl"  # one row per step
EVAL_FILE = "eval.jsonl"  # one row per evaluation (recipe `eval`): step = the version evaluated
GROUPS_FILE = "groups.jsonl"  # the groups each step trained
DROPPED_FILE = "dropped.jsonl"  # the groups a step dropped (filtered, failed, stale), and why
SAMPLES_DIR = "samples"  # step_<N>.json: tracking.samples_per_step samples whole (sample_rows)


def sample_file(run_dir: Path, step: int) -> Path:
    return run_dir / SAMPLES_DIR / f"step_{step:06d}.json"


def sample_file_step(path: Path) -> int | None:
    digits = path.stem.removeprefix("step_")
    return int(digits) if digits.isdecimal() else None
