"""`rlkit plot metrics RUN [--key K ...]`: curves of a run's per-step metrics as a PNG.

Steps that were long rounds (tail batching: `rollout/round` = long) are shaded, so e.g.
`--key rollout/long_queue --key rollout/seconds` shows the queue filling over short rounds and
emptying in each long one."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_KEYS = ["batch/reward_mean", "rollout/reward_mean"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", type=Path, help="run folder (with metrics.jsonl) or the file itself")
    parser.add_argument("--key", action="append", help=f"metric to plot (default: {DEFAULT_KEYS})")
    parser.add_argument("--out", type=Path, help="PNG to write (default: <run>/metrics.png)")
    parser.add_argument("--title", help="chart title")


def load_metrics(path: Path) -> list[dict]:
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise SystemExit(f"{path}: no metrics.jsonl")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{n}: not a JSON line ({e})") from None
    return rows


def plot_metrics(rows: list[dict], keys: list[str], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in keys:
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if not pts:
            raise SystemExit(f"no values for {key!r} (keys: {sorted(rows[0]) if rows else []})")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
    long_steps = [r["step"] for r in rows if r.get("rollout/round") == "long"]
    for i, step in enumerate(long_steps):
        ax.axvspan(step - 0.5, step + 0.5, color="#f3d9a4", alpha=0.6, linewidth=0,
                   label="long round" if i == 0 else None)
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def run(args: argparse.Namespace) -> int:
    rows = load_metrics(args.run)
    out = args.out or ((args.run if args.run.is_dir() else args.run.parent) / "metrics.png")
    title = args.title or f"{args.run.name}: per-step metrics"
    print(f"wrote {plot_metrics(rows, args.key or DEFAULT_KEYS, out, title)}")
    return 0
