"""`rlkit bench e2e`: a recipe's whole job in each driver mode, side by side, on this machine.

Each mode runs the same recipe (same seed, same data) from a fresh run folder through the real
stack (Ray, the router, the engines, megatron-core): wall time of the whole job (start-up
included), and steps per hour from the steps after the first (the first pays the engines' and
the trainer's warm-up). Modes run one after the other, alternating when `--repeats` > 1, so
load changes on a shared machine hit all alike.

On a machine where generation and training share the same cores (the 2-core CPU machine),
overlapping them (stream, async) cannot gain what it gains when each has its own GPUs: the
figures say what this machine allows, not what a cluster gets (for that: `rlkit bench suite
--modes`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from rlkit.bench.report import add_out_argument, out_folder, write_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default="recipes/grpo_tiny_ci.yaml", help="the recipe run")
    parser.add_argument("--mode", default="sync,stream,async", help="driver modes, comma-separated")
    parser.add_argument("--steps", type=int, default=4, help="run.num_steps of each run")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode (alternated)")
    parser.add_argument("--max-staleness", type=int, default=1,
                        help="rollout.max_staleness (async overlaps only with >= 1)")
    add_out_argument(parser, "e2e")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, key=value")


def run(args: argparse.Namespace) -> int:
    from rlkit.config import load_recipe
    from rlkit.config.modes import MODE_NAMES as MODES
    from rlkit.driver.run import train

    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        raise SystemExit(f"--mode: unknown {', '.join(bad)} (modes: {', '.join(MODES)})")
    out = out_folder(args.out)
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(args.repeats):
        for mode in modes:
            recipe = load_recipe(Path(args.recipe), [
                *args.overrides, f"mode={mode}", f"run.num_steps={args.steps}",
                f"run.output_dir={out}", f"run.name={mode}-{rep}", "run.resume=never",
                f"rollout.max_staleness={args.max_staleness}", "tracking.progress=false",
                "checkpoint.every_steps=0",
            ])
            t0 = time.perf_counter()
            train(recipe)
            wall = time.perf_counter() - t0
            rows = [json.loads(x) for x in
                    (out / recipe.run.name / "metrics.jsonl").read_text().splitlines()]
            steady = [r["step/seconds"] for r in rows[1:]] or [rows[0]["step/seconds"]]
            results[mode].append({"wall_s": wall, "step_s": statistics.mean(steady),
                                  "train_s": statistics.mean(r["train/seconds"] for r in rows),
                                  "rollout_s": statistics.mean(r["rollout/seconds"] for r in rows)})
    table = format_table(results, args)
    print(table)
    write_report(out, "e2e", results, table)
    return 0


def format_table(results: dict[str, list[dict]], args: argparse.Namespace) -> str:
    def mean(mode: str, key: str) -> float:
        return statistics.mean(r[key] for r in results[mode])

    base = next(iter(results))
    lines = [f"`{args.recipe}`, {args.steps} steps, max_staleness {args.max_staleness}, "
             f"{args.repeats} run(s) per mode; steady = steps after the first.", "",
             "| mode | job wall s | steady s/step | steps/hour | vs " + base + " | rollout s | train s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for m in results:
        step = mean(m, "step_s")
        lines.append(f"| {m} | {mean(m, 'wall_s'):.0f} | {step:.1f} | {3600 / step:,.0f} | "
                     f"{mean(base, 'step_s') / step:.2f}x | {mean(m, 'rollout_s'):.1f} | "
                     f"{mean(m, 'train_s'):.1f} |")
    return "\n".join(lines)
