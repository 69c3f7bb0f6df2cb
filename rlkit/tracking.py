"""Run tracking: per-step metrics to JSONL and wandb (offline by default), a live console line
per step, the rollout timeline (one JSON line per request span) for `rlkit plot timeline`, and
the groups each step trained (RUN/groups.jsonl: prompt row, epoch, response lengths, the
ranker's prediction, rewards), which `rlkit bench ranker --run RUN` scores rankers on; those it
dropped (RUN/dropped.jsonl: filtered, failed, stale, and why); and a few trained samples whole
per step (RUN/samples/, a wandb Table) for `rlkit view`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from rlkit.config.schema import TrackingConfig
from rlkit.run_files import (DROPPED_FILE, EVAL_FILE, GROUPS_FILE, METRICS_FILE, SAMPLES_DIR,
                             sample_file, sample_file_step)
from rlkit.rollout.timeline import TIMELINE_FILE
from rlkit.train.algorithms.mismatch import LAG_BUCKETS

# Into a log that is not a terminal, a progress line at most this often (the live line is
# redrawn on every poll, about every 0.5 s: one line each would flood the log).
PLAIN_PROGRESS_EVERY_S = 10.0


def rewind(run_dir: Path, step: int) -> None:
    """Drop the rows of steps after `step` from the run's per-step files (metrics, timeline,
    trained groups): a run resumed from the checkpoint of `step` does those steps again, and
    each step must be recorded once (a crash can come after a step's rows, before its
    checkpoint). A line cut short by a crash goes too. Each file is rewritten atomically."""
    for name in (METRICS_FILE, TIMELINE_FILE, GROUPS_FILE, DROPPED_FILE, EVAL_FILE):
        path = run_dir / name
        if not path.is_file():
            continue
        lines = path.read_text().splitlines()
        keep = [line for line in lines if (s := _step_of(line)) is not None and s <= step]
        if len(keep) == len(lines):
            continue
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)
    for path in (run_dir / SAMPLES_DIR).glob("step_*.json"):
        if (n := sample_file_step(path)) is not None and n > step:
            path.unlink()


def _step_of(line: str) -> int | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) else None


class Tracker:
    def __init__(self, cfg: TrackingConfig, run_dir: Path, run_name: str, config: dict[str, Any]):
        self.cfg = cfg
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(run_dir / METRICS_FILE, "a") if cfg.jsonl else None
        self._timeline = open(run_dir / TIMELINE_FILE, "a")
        self._groups = open(run_dir / GROUPS_FILE, "a") if cfg.jsonl else None
        self._dropped = open(run_dir / DROPPED_FILE, "a") if cfg.jsonl else None
        self._eval = open(run_dir / EVAL_FILE, "a") if cfg.jsonl else None
        self._wandb = None
        self._wandb_step = 0
        if cfg.wandb != "disabled":
            self._wandb = _start_wandb(cfg, run_dir, run_name, config)
        self._console = None
        if cfg.progress:
            from rich.console import Console

            self._console = Console(stderr=True)
        self._clock = time.monotonic
        self._t0 = self._clock()
        self.viewer = None
        if cfg.viewer:  # `rlkit view` on this run while it trains (loopback, a token)
            from rlkit.view.run_data import RunData
            from rlkit.view.server import ViewServer

            self.viewer = ViewServer(RunData(run_dir)).start()
            print(f"rlkit view: {self.viewer.url}  (this run, live; loopback only)", file=sys.stderr,
                  flush=True)
        self._progress_last: tuple[int, int, float] | None = None  # step, done, when (plain log)

    # -- per step ---------------------------------------------------------------------
    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = self._row(step, metrics)
        if self._metrics is not None:
            self._metrics.write(json.dumps(row) + "\n")
            self._metrics.flush()
        if self._wandb is not None:
            self._wandb_step = max(self._wandb_step, step)
            self._wandb.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=step)
        if self._console is not None:
            self._console.print(_summary_line(step, metrics), soft_wrap=True)  # a log's lines whole

    def log_eval(self, step: int, metrics: dict[str, Any]) -> None:
        """One evaluation of the weights after `step` steps (RUN/eval.jsonl). In async mode it
        ends during a later step: wandb gets it at its own `eval/step` (its x axis for eval/*),
        since wandb's step only moves forward."""
        row = self._row(step, metrics)
        if self._eval is not None:
            self._eval.write(json.dumps(row) + "\n")
            self._eval.flush()
        if self._wandb is not None:
            values = {k: v for k, v in row.items() if k.startswith("eval/") and isinstance(v, (int, float))}
            self._wandb.log({**values, "eval/step": step}, step=max(self._wandb_step, step))
        if self._console is not None:
            for line in _eval_lines(step, metrics):
                self._console.print(line, highlight=False, soft_wrap=True)

    def _row(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        return {"step": step, "time_s": round(self._clock() - self._t0, 3), **json_safe(metrics)}

    def log_timeline(self, step: int, spans: Iterable[dict[str, Any]],
                     header: dict[str, Any] | None = None,
                     phases: Iterable[dict[str, Any]] = ()) -> None:
        """One step's request spans, after its step line (policy, round, window, workers),
        then the trainer phases the driver waited for (rollout/timeline.py)."""
        if header:
            self._timeline.write(json.dumps({"kind": "step", "step": step, **header}) + "\n")
        for span in [*spans, *phases]:
            self._timeline.write(json.dumps({"step": step, **span}) + "\n")
        self._timeline.flush()

    def log_groups(self, step: int, records: Iterable[dict[str, Any]],
                   dropped: Iterable[dict[str, Any]] = ()) -> None:
        """One line per trained group (RUN/groups.jsonl), from `group_record`s, and one per
        group the step dropped (RUN/dropped.jsonl, "dropped": why)."""
        for f, rows in ((self._groups, records), (self._dropped, dropped)):
            if f is not None:
                for r in rows:
                    f.write(json.dumps({"step": step, **json_safe(r)}) + "\n")
                f.flush()

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """The step's picked samples (rollout/sample_rows.py): RUN/samples/step_<N>.json,
        written whole (a temporary file renamed), and a wandb Table `samples`."""
        if not rows:
            return
        path = sample_file(self.run_dir, step)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"step": step, "samples": json_safe(rows)}))
        os.replace(tmp, path)
        if self._wandb is not None:
            import wandb

            table = wandb.Table(columns=list(SAMPLE_COLUMNS))
            for r in rows:
                table.add_data(*sample_table_row(step, r))
            self._wandb.log({"samples": table}, step=max(self._wandb_step, step))

    def progress(self, step: int, done: int, target: int, tokens: int, elapsed: float) -> None:
        """A progress line while a rollout step runs: on a terminal one live line redrawn on
        every call; into a log (stderr not a TTY) a line at most every PLAIN_PROGRESS_EVERY_S
        seconds, plus the step's first and its final one (all groups done)."""
        if self._console is None:
            return
        rate = tokens / elapsed if elapsed > 0 else 0.0
        line = f"  step {step}: {done}/{target} groups, {tokens} tokens, {rate:,.0f} tok/s"
        if self._console.is_terminal:
            self._console.print(line, end="\r", highlight=False)
            return
        now = self._clock()
        last = self._progress_last
        if (last is None or last[0] != step or now - last[2] >= PLAIN_PROGRESS_EVERY_S
                or (done >= target and last[1] < target)):
            self._console.print(line, highlight=False, soft_wrap=True)
            self._progress_last = (step, done, now)

    def close(self) -> None:
        for f in (self._metrics, self._timeline, self._groups, self._dropped, self._eval):
            if f is not None:
                f.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self.viewer is not None:
            self.viewer.stop()
            self.viewer = None


def _start_wandb(cfg: TrackingConfig, run_dir: Path, run_name: str, config: dict[str, Any]) -> Any:
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    # Offline needs no network and no key; `wandb sync <run_dir>/wandb/offline-run-*` uploads.
    run = wandb.init(
        project=cfg.project, name=run_name, dir=str(run_dir), mode=cfg.wandb, config=config,
        resume="allow", id=_wandb_id(run_dir),
    )
    run.define_metric("eval/step")
    run.define_metric("eval/*", step_metric="eval/step")  # eval curves over the version evaluated
    return run


def _wandb_id(run_dir: Path) -> str:
    """One wandb run per rlkit run folder, so a resumed run continues the same curves."""
    path = run_dir / "wandb_id"
    if path.exists():
        return path.read_text().strip()
    import uuid

    rid = uuid.uuid4().hex[:12]
    path.write_text(rid)
    return rid


# The wandb Table's columns: what a reader scans for "sneaky" engine issues (NeMo-RL #938).
SAMPLE_COLUMNS = ("step", "group_id", "sample", "reward", "group_rewards", "finish_reason",
                  "length", "versions", "resumes", "max_abs_logprob_diff", "prompt", "response")


def sample_table_row(step: int, r: dict[str, Any]) -> list[Any]:
    versions = sorted(set(r["versions"]))
    trainer = r.get("trainer_logprobs")  # the largest |rollout - trainer| over its tokens
    diff = max((abs(a - b) for a, b in zip(r["logprobs"], trainer)), default=0.0) if trainer else None
    return [step, r["group_id"], r["sample_index"], r["reward"],
            ", ".join("-" if x is None else f"{x:g}" for x in r["group_rewards"]),
            r["finish_reason"], len(r["ids"]), ", ".join(map(str, versions)), r["resumes"],
            diff, r["prompt"], r["response"]]


def json_safe(x: Any) -> Any:
    """NaN and infinities (in dicts and lists too) as None: JSON has no NaN."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [json_safe(v) for v in x]
    return x


def _fmt(m: dict[str, Any], key: str, fmt: str) -> str:
    """m[key] formatted, or '-' when missing or not finite."""
    v = m.get(key)
    return format(v, fmt) if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def _summary_line(step: int, m: dict[str, Any]) -> str:
    def f(key: str, fmt: str) -> str:
        return _fmt(m, key, fmt)

    round_ = ""
    if m.get("rollout/round"):  # tail batching: which round, and what waits for a long one
        round_ = f" {m['rollout/round']:<5} (queue {f('rollout/long_queue', 'd')})"
    return (
        f"step {step:>4}{round_} | reward {f('rollout/reward_mean', '.3f')} | "
        f"rollout {f('rollout/seconds', '.1f')} s, {f('rollout/throughput_tok_s', ',.0f')} tok/s, "
        f"resumed {f('rollout/resumed_token_share', '.0%')} | "
        f"train {f('train/seconds', '.1f')} s, loss {f('train/loss', '.4f')}{_mismatch_part(m)}"
    )


def _mismatch_part(m: dict[str, Any]) -> str:
    """Per lag bucket with tokens: its share of the trained tokens and KL(rollout || old) by k3
    (train/algorithms/mismatch.py); rejected samples when the correction rejects."""
    lags = [b for b in LAG_BUCKETS if f"mismatch/{b}/tokens" in m]
    total = sum(m[f"mismatch/{b}/tokens"] for b in lags)
    if not total:
        return ""
    parts = [f"{b} {_fmt(m, f'mismatch/{b}/kl_k3', '.1e')} ({m[f'mismatch/{b}/tokens'] / total:.0%})"
             for b in lags]
    rejected = m.get("train/rejected_samples")
    tail = f", rejected {rejected:.0f}" if rejected else ""
    return f" | mismatch k3 {', '.join(parts)}{tail}"


def eval_passes(metrics: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """eval/<dataset>/<mode>/<metric> keys grouped by pass ('<dataset>/<mode>')."""
    out: dict[str, dict[str, Any]] = {}
    for key, v in metrics.items():
        parts = key.split("/")
        if len(parts) >= 4 and parts[0] == "eval":
            out.setdefault("/".join(parts[1:3]), {})["/".join(parts[3:])] = v
    return out


def _eval_lines(step: int, metrics: dict[str, Any]) -> list[str]:
    lines = []
    for name, m in eval_passes(metrics).items():
        def f(key: str, fmt: str, m: dict[str, Any] = m) -> str:
            return _fmt(m, key, fmt)

        ks = sorted(k for k in m if k.startswith("pass@") and k != "pass@1")
        at_k = f" | {ks[0]} {f(ks[0], '.3f')}" if ks else ""
        lines.append(
            f"eval after step {step:>4} | {name}: pass@1 {f('pass@1', '.3f')}{at_k} | reward "
            f"{f('mean_reward', '.3f')} | length {f('mean_response_length', '.1f')} (max "
            f"{f('max_response_length', '.0f')}, truncated {f('truncation_rate', '.0%')}) | "
            f"{f('prompts', '.0f')} prompts, {f('seconds', '.1f')} s"
        )
    return lines
