"""`rlkit plot timeline RUN`: per-engine Gantt chart of the requests of a rollout step.

Reads RUN/timeline.jsonl (format: rollout/timeline.py), written by a real run's tracker
or by the simulator, and draws, for each engine, one bar per request stay from when it was
sent (or queued) to when it returned: running requests stacked in lanes, so the height of an
engine's band is its running batch, and the long tail shows as the thin end of each band.
Colour says how the request ended (stopped, truncated at the cap, aborted and parked for the
next step, cancelled, preempted); a hatched bar resumed a partial response; a pale bar before
it is time spent queued at the engine (when the engine reports admission). Steps of a policy
with rounds (tail batching) are titled with their round, long rounds on a tinted background;
`--step all` also draws timeline_rounds.png: each step's rollout time, coloured by round.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rlkit.rollout.timeline import OUTCOMES, assign_lanes  # noqa: F401 (assign_lanes: re-exported)

# how a request ended: colour and label (rollout/timeline.py OUTCOMES, shared with rlkit view)
COLOURS = {k: colour for k, (colour, _) in OUTCOMES.items()}
LABELS = {k: label for k, (_, label) in OUTCOMES.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run folder (holding timeline.jsonl) or a timeline file")
    parser.add_argument("--step", default="last",
                        help="step to draw: a number, 'last' or 'all' (one PNG per step)")
    parser.add_argument("--out", help="output PNG (default: RUN/timeline_step<N>.png)")
    parser.add_argument("--max-engines", type=int, default=16,
                        help="draw at most this many engines (the first ones)")


def run(args: argparse.Namespace) -> int:
    from rlkit.rollout.timeline import TimelineError, read_timeline

    if args.step not in ("all", "last") and not args.step.isdecimal():
        print(f"rlkit: --step {args.step!r}: expected a step number, 'last' or 'all'")
        return 1
    try:
        steps = read_timeline(args.run)
    except TimelineError as e:
        print(f"rlkit: {e}")
        return 1
    fill_policy(steps, Path(args.run))
    if not steps:
        print(f"rlkit: {args.run}: the timeline has no steps")
        return 1
    if args.step == "all":
        chosen = steps
    elif args.step == "last":
        chosen = [steps[-1]]
    else:
        chosen = [s for s in steps if s.step == int(args.step)]
        if not chosen:
            print(f"rlkit: step {args.step} is not in the timeline "
                  f"(steps {steps[0].step}..{steps[-1].step})")
            return 1
    base = Path(args.run)
    folder = base if base.is_dir() else base.parent
    for tl in chosen:
        if args.out and len(chosen) == 1:
            out = Path(args.out)
        else:
            out = folder / f"timeline_step{tl.step}.png"
        plot_step(tl, out, max_engines=args.max_engines)
        print(f"wrote {out}")
    if args.step == "all" and any(tl.round for tl in steps):
        out = folder / "timeline_rounds.png"
        plot_rounds(steps, out)
        print(f"wrote {out}")
    return 0


# "sync": adaptive tail batching's fallback round
ROUND_COLOURS = {"short": "#5b7db8", "long": "#e08e0b", "sync": "#6a9955"}


def fill_policy(steps, run: Path) -> None:
    """Name the policy of steps whose timeline has no step line (a real run's timeline before
    the driver wrote one, or a line lost): the spans alone give the window and the workers, not
    the policy, which the run folder's recipe.yaml (rollout.policy) does."""
    missing = [tl for tl in steps if not tl.policy]
    recipe = (run if run.is_dir() else run.parent) / "recipe.yaml"
    if not missing or not recipe.is_file():
        return
    import yaml

    try:
        policy = (yaml.safe_load(recipe.read_text()) or {}).get("rollout", {}).get("policy")
    except (yaml.YAMLError, AttributeError):
        return
    if isinstance(policy, str) and policy:
        for tl in missing:
            tl.policy = policy


def plot_rounds(steps, out: Path) -> None:
    """One bar per step: its rollout seconds, coloured by round kind (short and long apart)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * len(steps) + 2), 3.5))
    ax.bar([tl.step for tl in steps], [tl.end - tl.start for tl in steps],
           color=[ROUND_COLOURS.get(tl.round, "#888888") for tl in steps])
    kinds = [k for k in ROUND_COLOURS if any(tl.round == k for tl in steps)]
    ax.legend(handles=[Patch(color=ROUND_COLOURS[k], label=f"{k} round") for k in kinds], fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("rollout seconds")
    policy = next((tl.policy for tl in steps if tl.policy), "?")
    ax.set_title(f"{policy}: rollout time per step by round", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_step(tl, out: Path, *, max_engines: int = 16) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    workers = list(tl.workers) or sorted({s.worker for s in tl.spans if s.worker})
    workers = workers[:max_engines]
    t0 = tl.start
    lanes_of: dict[str, int] = {}
    bars: dict[str, list] = {w: [] for w in workers}
    for w in workers:
        spans = [s for s in tl.spans if s.worker == w]
        lanes = assign_lanes([(s.start, s.end) for s in spans])
        lanes_of[w] = max(lanes, default=-1) + 1
        bars[w] = list(zip(spans, lanes))
    total_lanes = sum(max(1, n) for n in lanes_of.values())
    height = min(14.0, 1.6 + 0.02 * total_lanes + 0.25 * len(workers))
    fig, ax = plt.subplots(figsize=(12, height))
    y0 = 0.0
    ticks, labels = [], []
    for w in workers:
        n = max(1, lanes_of[w])
        scale = 1.0 / n  # each engine gets a band of height 1; lanes divide it
        for s, lane in bars[w]:
            y = y0 + lane * scale
            run_from = s.admitted if s.admitted is not None else s.start
            if s.admitted is not None and s.admitted > s.start:
                ax.barh(y, s.admitted - s.start, left=s.start - t0, height=scale * 0.9,
                        align="edge", color="#dddddd", linewidth=0)
            ax.barh(y, max(s.end - run_from, 1e-9), left=run_from - t0, height=scale * 0.9,
                    align="edge", color=COLOURS.get(s.outcome, "#777777"), linewidth=0,
                    hatch="///" if s.response_before > 0 else None, edgecolor="white")
        ticks.append(y0 + 0.5)
        labels.append(f"{w} (max {lanes_of[w]})")
        ax.axhline(y0, color="black", linewidth=0.4)
        y0 += 1.0 + 0.15
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.set_ylim(-0.1, y0)
    ax.invert_yaxis()
    ax.set_xlim(0, max(tl.end - t0, 1e-9))
    ax.set_xlabel("seconds since the step started")
    tokens = sum(s.tokens for s in tl.spans)
    shown = "" if len(tl.workers) <= len(workers) else f" (first {len(workers)} of " \
        f"{len(tl.workers)} engines)"
    round_ = f", {tl.round} round" if tl.round else ""
    if tl.round == "long":
        ax.set_facecolor("#fdf3e1")
    ax.set_title(f"step {tl.step}, policy {tl.policy or '?'}{round_} ({tl.source}): "
                 f"{tl.end - t0:.1f} s, {len(tl.spans)} requests, {tokens:,} tokens{shown}",
                 fontsize=10)
    present = [o for o in LABELS if any(s.outcome == o for s in tl.spans)]
    handles = [Patch(color=COLOURS[o], label=LABELS[o]) for o in present]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="///",
                         label="resumed a partial"))
    if any(s.admitted is not None and s.admitted > s.start for s in tl.spans):
        handles.append(Patch(color="#dddddd", label="queued at the engine"))
    ax.legend(handles=handles, fontsize=7, loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
