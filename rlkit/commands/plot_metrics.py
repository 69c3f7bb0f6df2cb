"""`rlkit plot metrics RUN [--key K ...]`: curves of a run's per-step metrics as a PNG.

Steps that were long rounds (tail batching: `rollout/round` = long) are shaded, so e.g.
`--key rollout/long_queue --key rollout/seconds` shows the queue filling over short rounds and
emptying in each long one.

Held-out evaluation (recipe `eval`, see docs/evaluation.md): when RUN is a folder with a
non-empty `eval.jsonl` and no `--key` is given, the chart has two panels sharing the step axis:
the training reward on top (DEFAULT_KEYS, from metrics.jsonl) and, below, each eval pass's
`pass@1` (and `pass@k`, k > 1, when recorded) against the eval rows' `step` (0: the initial
policy), y in [0, 1], labelled e.g. `held-out arith-heldout (greedy) pass@1`. A key starting
with `eval/` is looked up in eval.jsonl (the rest in metrics.jsonl), so
`--key eval/<dataset>/<pass>/mean_response_length` plots that eval metric; asked for together
with training keys, the eval keys get their own panel below. Null values (NaN) are skipped.
A run without eval.jsonl is plotted as before."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from rlkit.tracking import EVAL_FILE, eval_passes
from rlkit.train.algorithms.mismatch import BUCKETS, FIGURES, LAG_BUCKETS

DEFAULT_KEYS = ["batch/reward_mean", "rollout/reward_mean"]
METRICS_FILE = "metrics.jsonl"

Series = dict[str, tuple[list, list]]  # label -> (steps, values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", type=Path, help="run folder (with metrics.jsonl) or the file itself")
    parser.add_argument("--key", action="append",
                        help=f"metric to plot (default: {DEFAULT_KEYS}, plus the held-out pass@k "
                             f"curves of {EVAL_FILE} when the run has one); eval/... keys are "
                             f"read from {EVAL_FILE}")
    parser.add_argument("--mismatch", metavar="FIGURE", choices=FIGURES,
                        help="one curve per version lag (0, 1, 2, 3+) of the train-inference "
                             "mismatch figure mismatch/<lag>/FIGURE, e.g. kl_k3, "
                             f"abs_log_ratio_p99, ess (choices: {', '.join(FIGURES)}); adds to "
                             "--key")
    parser.add_argument("--mismatch-table", action="store_true",
                        help="print the run's mismatch per version lag (and resumed / fresh) as "
                             "a markdown table, token-weighted over its steps, instead of "
                             "drawing")
    parser.add_argument("--out", type=Path, help="PNG to write (default: <run>/metrics.png)")
    parser.add_argument("--title", help="chart title")


def _load_jsonl(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{n}: not a JSON line ({e})") from None
    return rows


def load_metrics(path: Path) -> list[dict]:
    path = path / METRICS_FILE if path.is_dir() else path
    if not path.is_file():
        raise SystemExit(f"{path}: no metrics.jsonl")
    return _load_jsonl(path)


def load_eval(path: Path) -> list[dict]:
    """The rows of the run's eval.jsonl ([] when it has none): RUN/eval.jsonl for a folder, the
    eval.jsonl beside the metrics file otherwise."""
    path = (path if path.is_dir() else path.parent) / EVAL_FILE
    return _load_jsonl(path) if path.is_file() else []


@dataclass
class Panel:
    series: Series = field(default_factory=dict)
    ylabel: str | None = None
    ylim: tuple[float, float] | None = None
    eval: bool = False  # drawn with the eval style (square markers, dashed)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def mismatch_keys(rows: list[dict], figure: str) -> list[str]:
    """mismatch/<lag bucket>/<figure> for each lag bucket some step has (a run whose steps all
    trained fresh tokens has lag 0 only)."""
    keys = [f"mismatch/{b}/{figure}" for b in LAG_BUCKETS]
    present = [k for k in keys if any(_number(r.get(k)) for r in rows)]
    if not present:
        raise SystemExit(f"no mismatch telemetry in {METRICS_FILE} (none of {', '.join(keys)}): "
                         "it needs the rollout logprobs of the trained tokens")
    return present


def _points(rows: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in rows if _number(r.get(key)) and _number(r.get("step"))]
    return [p[0] for p in pts], [p[1] for p in pts]


def eval_label(key: str) -> str:
    """eval/<dataset>/<pass>/<metric> -> 'held-out <dataset> (<pass>) <metric>'."""
    parts = key.split("/")
    if len(parts) >= 4 and parts[0] == "eval":
        return f"held-out {parts[1]} ({parts[2]}) {'/'.join(parts[3:])}"
    return key


def _pass_k(metric: str) -> int | None:
    if metric.startswith("pass@") and metric[5:].isdigit():
        return int(metric[5:])
    return None


def _keys_brief(rows: list[dict], limit: int = 12) -> str:
    keys = sorted({k for r in rows for k in r if k not in ("step", "time_s")})
    if not keys:
        return "none"
    more = f", ... ({len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _missing(key: str, rows: list[dict], eval_rows: list[dict]) -> SystemExit:
    eval_keys = _keys_brief(eval_rows) if eval_rows else "no eval.jsonl or empty"
    return SystemExit(
        f"no values for {key!r} in {METRICS_FILE} or {EVAL_FILE} "
        f"({METRICS_FILE} keys: {_keys_brief(rows)}; {EVAL_FILE} keys: {eval_keys})")


def default_eval_keys(eval_rows: list[dict]) -> list[str]:
    """Per eval pass (eval_passes), its pass@1 then pass@k for k > 1 in k order."""
    all_keys = {k: None for r in eval_rows for k in r}
    keys = []
    for name, metrics in eval_passes(all_keys).items():
        ks = sorted((k, m) for m in metrics if (k := _pass_k(m)) is not None)
        keys += [f"eval/{name}/{m}" for _, m in ks]
    return keys


def collect_panels(rows: list[dict], keys: list[str] | None,
                   eval_rows: list[dict] | None = None) -> list[Panel]:
    """What the chart draws. `keys` None: DEFAULT_KEYS, and under them a held-out pass@k panel
    when eval_rows has any values. Otherwise each key is read from its file (eval/... from
    eval.jsonl, the rest from metrics.jsonl, either falling back to the other); eval keys go to
    a panel of their own below the training ones."""
    eval_rows = eval_rows or []
    train = Panel()
    held_out = Panel(eval=True)
    if keys is None:
        for key in DEFAULT_KEYS:
            xs, ys = _points(rows, key)
            if not xs:
                raise _missing(key, rows, eval_rows)
            train.series[key] = (xs, ys)
        for key in default_eval_keys(eval_rows):
            xs, ys = _points(eval_rows, key)
            if xs:
                held_out.series[eval_label(key)] = (xs, ys)
        train.ylabel = "reward"
        held_out.ylabel, held_out.ylim = "held-out pass@k", (-0.02, 1.02)
    else:
        for key in keys:
            sources = [(eval_rows, True), (rows, False)]
            if not key.startswith("eval/"):
                sources.reverse()
            for source, is_eval in sources:
                xs, ys = _points(source, key)
                if xs:
                    if is_eval:
                        held_out.series[eval_label(key)] = (xs, ys)
                    else:
                        train.series[key] = (xs, ys)
                    break
            else:
                raise _missing(key, rows, eval_rows)
        eval_metrics = {k.split("/")[-1] for k in keys if k.startswith("eval/")}
        if eval_metrics and all(_pass_k(m) is not None for m in eval_metrics):
            held_out.ylim = (-0.02, 1.02)
    return [p for p in (train, held_out) if p.series]


def plot_metrics(rows: list[dict], keys: list[str] | None, out: Path, title: str,
                 eval_rows: list[dict] | None = None) -> Series:
    """Write the PNG; returns the series drawn (label -> (steps, values)), panel by panel."""
    return draw(collect_panels(rows, keys, eval_rows), rows, out, title)


def draw(panels: list[Panel], rows: list[dict], out: Path, title: str) -> Series:
    """The panels stacked, sharing the step axis; long rounds of `rows` shaded in each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False,
                             figsize=(7, 4 if len(panels) == 1 else 6.5))
    axes = [a[0] for a in axes]
    long_steps = [r["step"] for r in rows if r.get("rollout/round") == "long"]
    drawn: Series = {}
    for i, (ax, panel) in enumerate(zip(axes, panels)):
        for label, (xs, ys) in panel.series.items():
            if panel.eval:
                ax.plot(xs, ys, marker="s", linestyle="--", label=label)
            else:
                ax.plot(xs, ys, marker="o", label=label)
            drawn[label] = (xs, ys)
        for j, step in enumerate(long_steps):
            ax.axvspan(step - 0.5, step + 0.5, color="#f3d9a4", alpha=0.6, linewidth=0,
                       label="long round" if i == 0 and j == 0 else None)
        if panel.ylim:
            ax.set_ylim(*panel.ylim)
        if panel.ylabel and len(panels) > 1:
            ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small" if len(panels) > 1 else None)
    axes[-1].set_xlabel("step")
    axes[0].set_title(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return drawn


# per bucket: figure -> how steps combine (token-weighted mean, or the largest step's)
_TABLE = (("abs_log_ratio_mean", "mean"), ("abs_log_ratio_p99", "max"), ("kl_k1", "mean"),
          ("kl_k3", "mean"), ("ess", "mean"), ("chi2", "mean"), ("truncated", "mean"),
          ("masked", "mean"), ("rejected", "mean"))


def mismatch_summary(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per bucket with tokens: its tokens summed over the steps, each figure of _TABLE
    token-weighted over the steps (p99: the largest step's), and `steps` that had it."""
    out: dict[str, dict[str, float]] = {}
    for b in BUCKETS:
        steps = [r for r in rows if (r.get(f"mismatch/{b}/tokens") or 0) > 0]
        n = sum(r[f"mismatch/{b}/tokens"] for r in steps)
        if not n:
            continue
        fig: dict[str, float] = {"tokens": n, "steps": len(steps)}
        for name, how in _TABLE:
            vals = [(r[f"mismatch/{b}/tokens"], r.get(f"mismatch/{b}/{name}")) for r in steps]
            vals = [(w, v) for w, v in vals if v is not None and math.isfinite(v)]
            if vals:
                fig[name] = (max(v for _, v in vals) if how == "max"
                             else sum(w * v for w, v in vals) / sum(w for w, _ in vals))
        out[b] = fig
    return out


def mismatch_table(rows: list[dict]) -> str:
    """`mismatch_summary` as a markdown table (lag buckets, then resumed and fresh tokens)."""
    summary = mismatch_summary(rows)
    if not summary:
        raise SystemExit(f"no mismatch telemetry in {METRICS_FILE}: the trainer reports it from "
                         "the loss (rollout logprobs needed)")
    lag_tokens = sum(summary[b]["tokens"] for b in LAG_BUCKETS if b in summary)
    lines = ["| bucket | steps | tokens (share) | mean abs(log rho) | p99 (max step) | k1 | k3 | "
             "ESS/n | chi2 | truncated | masked | rejected |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for b, f in summary.items():
        cells = [f"{f.get(k, math.nan):.3g}" for k, _ in _TABLE]
        lines.append(f"| {b} | {f['steps']} | {f['tokens']:.0f} "
                     f"({100 * f['tokens'] / lag_tokens:.0f}%) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    rows = load_metrics(args.run)
    if args.mismatch_table:
        print(mismatch_table(rows))
        return 0
    eval_rows = load_eval(args.run)
    if args.key is None and not args.run.is_dir():
        eval_rows = []  # the held-out overlay is for a run folder; a metrics file plots as before
    out = args.out or ((args.run if args.run.is_dir() else args.run.parent) / "metrics.png")
    keys = args.key
    if args.mismatch:
        keys = [*(keys or []), *mismatch_keys(rows, args.mismatch)]
    panels = collect_panels(rows, keys, eval_rows)
    if args.title:
        title = args.title
    elif args.mismatch and not args.key:
        title = f"{args.run.name}: mismatch {args.mismatch} per version lag"
    elif args.key is None and any(p.eval for p in panels):
        title = f"{args.run.name}: training reward and held-out eval (pass@k)"
    else:
        title = f"{args.run.name}: per-step metrics"
    draw(panels, rows, out, title)
    print(f"wrote {out}")
    return 0
