"""`rlkit bench learn`: learning parity of the off-policy modes against sync, measured.

From one initial checkpoint (the recipe's model), on one task (the built-in arithmetic problems,
a held-out part of them never trained on), every configuration of `CONFIGS` trains the same
number of samples, for several seeds, each run from a fresh run folder through the real stack
(`rlkit.driver.run.train`, as `rlkit bench e2e` does). Held-out accuracy (the recipe's `eval`:
greedy pass@1) is read at the same steps of every run, so at the same trained samples, and set
against the run's training seconds: the sum of its steps' `step/seconds` (rollout, training and
weight sync, overlapped in async; start-up and the sync/stream evaluations excluded).

Runs go one after another, seeds in the outer loop and the configurations alternating in
direction from seed to seed, so a drift in machine load hits every configuration alike. The
initial policy is evaluated once, in the first run: every run starts from the same weights and
greedy decoding does not depend on the seed, so the others reuse it.

Per configuration the table gives the final held-out accuracy, its mean and spread over seeds
(the standard error: sample standard deviation / sqrt(seeds)), whether it is within noise of
sync's (|difference| <= 2 standard errors of the difference, sqrt(se^2 + se_sync^2)), the
accuracy at each evaluated number of trained samples, and the training seconds its mean curve
takes to reach sync's final mean accuracy (linear between evaluations; "not reached"). How large
a difference that can detect: docs/learning-parity.md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from rlkit.bench.report import add_out_argument, out_folder, write_report

CORRECTION = "train.algorithm.off_policy_correction"


def _lora(rank: int) -> list[str]:
    """LoRA of this rank at SCALE's learning rate x10 (see the lora configurations)."""
    return [f"train.lora.rank={rank}", "train.optimizer.lr=2.0e-4"]


def _teacher(reward_weight: float) -> list[str]:
    """Distillation from the `{teacher}` model (--teacher) on one engine of its own."""
    return ["rollout.engine.num_engines=1", "rollout.engine.cpu_threads=1",
            "rollout.frozen_engines={teacher: {role: teacher, model: '{teacher}', "
            "engine: {kind: hf, num_engines: 1, cpu_threads: 1}}}",
            "train.algorithm.distill_coef=1.0", f"train.algorithm.reward_weight={reward_weight}"]


# The configurations: name -> recipe overrides. `{corr}` is --correction's estimator (a name in
# the config's name as well): each off-policy configuration runs without a correction and with
# one. tail_restart and stream are on-policy (no stale token), like sync.
CONFIGS: dict[str, list[str]] = {
    "sync": ["mode=sync", "rollout.policy=sync", f"{CORRECTION}=none"],
    "partial": ["mode=sync", "rollout.policy=partial", f"{CORRECTION}=none"],
    "partial+{corr}": ["mode=sync", "rollout.policy=partial", f"{CORRECTION}={{corr}}"],
    # issue 31 item 4: the same, with resumed samples restarted past a measured mismatch (mean
    # |log pi_now/pi_rollout| of their parked tokens > 0.02, re-scored by the engine at resume)
    "partial+{corr}+bound": ["mode=sync", "rollout.policy=partial", f"{CORRECTION}={{corr}}",
                             "rollout.max_resume_log_ratio=0.02"],
    "tail_restart": ["mode=sync", "rollout.policy=tail_batching",
                     "rollout.tail_batching.deferred=restart", f"{CORRECTION}=none"],
    "tail_resume": ["mode=sync", "rollout.policy=tail_batching",
                    "rollout.tail_batching.deferred=resume", f"{CORRECTION}=none"],
    "tail_resume+{corr}": ["mode=sync", "rollout.policy=tail_batching",
                           "rollout.tail_batching.deferred=resume", f"{CORRECTION}={{corr}}"],
    "async_partial": ["mode=async", "rollout.policy=partial", "rollout.max_staleness=1",
                      f"{CORRECTION}=none"],
    "async_partial+{corr}": ["mode=async", "rollout.policy=partial", "rollout.max_staleness=1",
                             f"{CORRECTION}={{corr}}"],
    "stream": ["mode=stream", "rollout.policy=sync", f"{CORRECTION}=none"],
    # issue 35: LoRA against full training (sync, the same samples). The learning rate is ten
    # times full training's, the rule "LoRA Without Regret" (Thinking Machines, 2025) measured for
    # RL with alpha 32 and the 1/rank scale (train.lora's default alpha): LoRA's best rate is ~10x
    # full fine-tuning's, at any rank.
    "lora_r8": ["mode=sync", "rollout.policy=sync", f"{CORRECTION}=none", *_lora(8)],
    "lora_r32": ["mode=sync", "rollout.policy=sync", f"{CORRECTION}=none", *_lora(32)],
    # issue 35 item 3: partial rollouts with LoRA, a parked sample resuming under the newest
    # adapter (its response then spans versions) or under its own (train.lora.resume: own)
    "partial_lora_r8": ["mode=sync", "rollout.policy=partial", f"{CORRECTION}=none", *_lora(8)],
    "partial_lora_r8_own": ["mode=sync", "rollout.policy=partial", f"{CORRECTION}=none", *_lora(8),
                            "train.lora.resume=own"],
    # issue 36: on-policy distillation from a frozen teacher (--teacher: a stronger model of the
    # same tokenizer, e.g. the SFT recipe's export), alone (Thinking Machines' form) and added to
    # the reward's advantage (slime's); sync, the same samples as sync. The policy's engine and
    # the teacher's get a core each.
    "opd": ["mode=sync", "rollout.policy=sync", f"{CORRECTION}=none", *_teacher(0.0)],
    "opd_reward": ["mode=sync", "rollout.policy=sync", f"{CORRECTION}=none", *_teacher(1.0)],
    # where the teacher's scoring hides: partial rollouts (samples complete throughout the step)
    # and stream mode (training starts on the first complete groups)
    "opd_partial": ["mode=sync", "rollout.policy=partial", f"{CORRECTION}=none", *_teacher(0.0)],
    "opd_stream": ["mode=stream", "rollout.policy=sync", f"{CORRECTION}=none", *_teacher(0.0)],
}
# Configurations that need --teacher; 'all' leaves them out without one.
TEACHER_CONFIGS = ("opd", "opd_reward", "opd_partial", "opd_stream")

# The task, and a split of it with at least 200 held-out problems: with max_operand 20 (the
# default recipe's difficulty) there are ~670 distinct problems; holding out 35% leaves 232 of
# them for evaluation (the default 10% would leave 61).
TRAIN_DATA = "builtin:arithmetic?split=train&holdout=35"
HELD_OUT = "builtin:arithmetic?split=test&holdout=35&rows={rows}"
EVAL_NAME = "heldout"

# The scale of the default table (calibrated on the 2-core CPU machine, docs/learning-parity.md):
# 16 samples a step of at most 24 tokens and a learning rate twice the default recipe's, so that
# a few steps move held-out accuracy. At so short a cap the math reward pays a response that
# boxes its answer and then rambles into the cap, and the policy learned to ramble: at lr 3e-5
# every response ran to the cap by step 3 and held-out accuracy fell from 0.49 to 0.15. Training
# therefore scores a truncated response 0 (DAPO's overlong filter, in its simplest form); the
# evaluation keeps the plain math reward. Command-line overrides come after these.
SCALE = [
    "rollout.batch_size=4", "rollout.n_samples_per_prompt=4",
    "rollout.sampling.max_new_tokens=24", "train.micro_batch_size=8",
    "train.optimizer.lr=2.0e-5", "rollout.reward.name=rlkit.bench.learn:math_unless_truncated",
    "eval.reward.name=math",
]
DEFAULT_STEPS = 6

# Evaluation must not take the engines down: with the eval's 200 requests all in flight at once
# the health probe (a one-token /generate) queues behind them, and on a loaded 2-core machine two
# 10 s probe timeouts declared both engines hung mid-evaluation (every held-out answer then failed
# and scored 0). A bound on eval requests in flight leaves the probe a decode slot; a longer probe
# timeout keeps a machine shared with other work from restarting engines.
ROBUST = ["eval.max_concurrency=64", "rollout.health.probe_timeout_s=30"]

# Per-step figures kept per run (mean over its steps) to explain a gap.
TELEMETRY = ("batch/reward_mean", "batch/max_staleness", "rollout/resumed_token_share",
             "train/off_policy_samples", "train/rejected_samples", "step/seconds",
             "rollout/seconds", "train/seconds", "rollout/resume_rescored",
             "rollout/resume_abs_log_ratio", "rollout/mismatch_restarts",
             "rollout/mismatch_restart_tokens", "batch/mixed_version_share",
             "rollout/own_adapter_requests", "rollout/own_adapter_fallbacks",
             "mismatch/lag1/tokens", "mismatch/lag1/kl_k3", "mismatch/resumed/tokens",
             "mismatch/resumed/kl_k3", "mismatch/resumed/abs_log_ratio_mean",
             "frozen/teacher/seconds", "frozen/teacher/requests", "train/distill_reverse_kl")


def math_unless_truncated(sample: Any, **kwargs: Any) -> float:
    """The training reward of the bench's scale: the math reward, 0 for a response cut at the
    length cap (a recipe reward by dotted path: `rlkit.bench.learn:math_unless_truncated`)."""
    from rlkit.rewards.builtin import math_reward

    return 0.0 if sample.finish_reason == "length" else math_reward(sample, **kwargs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default="recipes/grpo_smollm2_cpu.yaml",
                        help="the recipe every configuration starts from (its model is the "
                        "initial checkpoint)")
    parser.add_argument("--configs", default="all",
                        help="comma-separated configurations, or 'all': " + ", ".join(CONFIGS)
                        + " ({corr}: --correction)")
    parser.add_argument("--correction", default="tis",
                        help="the off-policy correction of the '+{corr}' configurations: an "
                        "estimator name (tis, mis, icepop)")
    parser.add_argument("--teacher", default=None, metavar="MODEL",
                        help="the teacher of the distillation configurations (" +
                        ", ".join(TEACHER_CONFIGS) + "): an HF folder of the recipe model's "
                        "tokenizer (e.g. `rlkit export` of recipes/sft_smollm2_cpu.yaml's run)")
    parser.add_argument("--seeds", type=int, default=3, help="runs per configuration (run.seed 1..N)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="run.num_steps of each run")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="evaluate after every K steps (K must divide --steps); 0: after "
                        "the last step only (the initial policy is evaluated once, in the first run)")
    parser.add_argument("--eval-rows", type=int, default=200,
                        help="held-out problems evaluated (greedy pass@1); at most 232")
    parser.add_argument("--no-scale", action="store_true",
                        help="leave the recipe's batch, length and learning rate as they are "
                        "instead of the bench's scale (" + " ".join(SCALE) + ")")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="DIR",
                        help="run nothing: one table from the learn.json of earlier runs of "
                        "this bench (configurations run apart, or an interrupted table and its "
                        "rest), written to --out; their settings must agree but for the "
                        "configurations and seeds, and no configuration/seed may repeat")
    add_out_argument(parser, "learn")
    parser.add_argument("overrides", nargs="*",
                        help="recipe overrides, key=value, for every run (after the bench's "
                        "scale, before each configuration's own keys)")


def expand_configs(spec: str, correction: str, teacher: str | None = None) -> dict[str, list[str]]:
    """The chosen configurations with `{corr}` and `{teacher}` filled in, in CONFIGS' order;
    'all' has the teacher's only with a `teacher`."""
    table = {name.replace("{corr}", correction):
             [o.replace("{corr}", correction).replace("{teacher}", teacher or "") for o in ovs]
             for name, ovs in CONFIGS.items()}
    if spec.strip() == "all":
        return {k: v for k, v in table.items() if teacher or k not in TEACHER_CONFIGS}
    wanted = [c.strip() for c in spec.split(",") if c.strip()]
    if bad := [c for c in wanted if c not in table]:
        raise SystemExit(f"--configs: unknown {', '.join(bad)} (configurations: "
                         f"{', '.join(table)})")
    if not teacher and (need := [c for c in wanted if c in TEACHER_CONFIGS]):
        raise SystemExit(f"--configs {', '.join(need)} distil from a teacher: give --teacher "
                         "(an HF folder of the same tokenizer, e.g. the SFT recipe's export)")
    return {c: table[c] for c in wanted}


def eval_every(steps: int, every: int) -> int:
    """Steps between evaluations: `every`, or 0 for the last step only (an evaluation of 200
    problems costs about as much as two to three steps on the CPU machine)."""
    if every <= 0:
        return steps
    if steps % every:
        raise SystemExit(f"--eval-every {every} must divide --steps {steps} (the last step is "
                         "evaluated)")
    return every


def run_order(configs: Sequence[str], seeds: int) -> list[tuple[int, str]]:
    """(seed, config) in the order run: seed by seed, the configurations forwards for seeds 1,
    3, ... and backwards for 2, 4, ..., so a linear drift in load costs every one alike."""
    out = []
    for seed in range(1, seeds + 1):
        order = list(configs) if seed % 2 else list(reversed(configs))
        out.extend((seed, c) for c in order)
    return out


# ---- aggregation (pure: unit-tested with known numbers) -------------------------------------

def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (sample standard deviation / sqrt(n)); the error is NaN with
    fewer than two values."""
    vals = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return math.nan, math.nan
    if len(vals) < 2:
        return vals[0], math.nan
    return statistics.mean(vals), statistics.stdev(vals) / math.sqrt(len(vals))


def within_noise(mean: float, se: float, ref_mean: float, ref_se: float,
                 k: float = 2.0) -> bool | None:
    """|mean - ref_mean| <= k standard errors of the difference, sqrt(se^2 + ref_se^2); None
    when either error is unknown (one seed)."""
    if any(math.isnan(x) for x in (mean, se, ref_mean, ref_se)):
        return None
    return abs(mean - ref_mean) <= k * math.sqrt(se * se + ref_se * ref_se)


def time_to_reach(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """Seconds at which a curve of (seconds, accuracy) points first reaches `target`, linear
    between points; None if it never does."""
    if math.isnan(target):
        return None
    prev = None
    for s, acc in points:
        if math.isnan(acc):
            continue
        if acc >= target:
            if prev is None or prev[1] >= target:
                return s
            (s0, a0) = prev
            return s0 + (s - s0) * (target - a0) / (acc - a0)
        prev = (s, acc)
    return None


def mean_curve(runs: Sequence[dict]) -> list[dict]:
    """The runs' curves averaged point by point over the steps every run evaluated: step,
    samples, seconds (means) and accuracy (mean, standard error, seeds)."""
    ok = [r for r in runs if r.get("curve")]
    if not ok:
        return []
    steps = sorted(set.intersection(*(set(p["step"] for p in r["curve"]) for r in ok)))
    out = []
    for step in steps:
        pts = [next(p for p in r["curve"] if p["step"] == step) for r in ok]
        acc, se = mean_se([p["accuracy"] for p in pts])
        out.append({"step": step, "samples": statistics.mean(p["samples"] for p in pts),
                    "seconds": statistics.mean(p["seconds"] for p in pts),
                    "accuracy": acc, "se": se,
                    "seeds": sum(1 for p in pts if not math.isnan(p["accuracy"]))})
    return out


def summarize(results: dict[str, list[dict]], reference: str) -> dict[str, dict]:
    """Per configuration: its mean curve, final accuracy (mean, se), difference to the
    reference's final mean and whether within noise, and seconds to reach the reference's
    final mean accuracy."""
    curves = {c: mean_curve(runs) for c, runs in results.items()}
    ref = curves.get(reference) or []
    ref_final = ref[-1] if ref else None
    ref_mean = ref_final["accuracy"] if ref_final else math.nan
    ref_se = ref_final["se"] if ref_final else math.nan
    out = {}
    for c, runs in results.items():
        curve = curves[c]
        ok = [r for r in runs if r.get("curve")]
        final = curve[-1] if curve else None
        mean, se = (final["accuracy"], final["se"]) if final else (math.nan, math.nan)
        reach = time_to_reach([(p["seconds"], p["accuracy"]) for p in curve], ref_mean)
        out[c] = {
            "runs": len(runs), "failed": len(runs) - len(ok), "curve": curve,
            "failed_evals": sum(1 for r in ok for p in r["curve"] if math.isnan(p["accuracy"])),
            "final_accuracy": mean, "final_se": se,
            "final_samples": final["samples"] if final else math.nan,
            "final_seconds": final["seconds"] if final else math.nan,
            "diff_vs_reference": mean - ref_mean,
            "diff_se": math.sqrt(se * se + ref_se * ref_se),
            "within_noise": within_noise(mean, se, ref_mean, ref_se),
            "seconds_to_reference_final": reach,
            "step_seconds": mean_se([r["telemetry"].get("step/seconds", math.nan) for r in ok])[0]
            if ok else math.nan,
            "telemetry": {k: mean_se([r["telemetry"].get(k, math.nan) for r in ok])[0]
                          for k in sorted({k for r in ok for k in r["telemetry"]})},
        }
    return out


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_table(summary: dict[str, dict], reference: str, settings: dict) -> str:
    eval_steps = sorted({p["step"] for s in summary.values() for p in s["curve"] if p["step"] > 0})
    ref = summary.get(reference, {})
    lines = [
        f"`{settings['recipe']}`, {settings['steps']} steps of {settings['samples_per_step']} "
        f"samples, {settings['seeds']} seed(s), held-out greedy pass@1 on {settings['eval_rows']} "
        f"problems (initial: {_fmt(settings.get('initial_accuracy'))}); mean ± standard error "
        f"over seeds; 'within noise': |diff| <= 2 SE of the difference; seconds: training "
        f"seconds (sum of step/seconds). Reference: {reference} "
        f"(final {_fmt(ref.get('final_accuracy'))}).", "",
        "| config | runs | final acc | diff vs " + reference + " | within noise | "
        + " | ".join(f"acc @ {_sample_label(summary, st)} samples" for st in eval_steps)
        + " | s/step | train s | s to reach " + reference + " final | max lag | reward |",
        "|---|---:|---:|---:|---|" + "---:|" * len(eval_steps) + "---:|---:|---:|---:|---:|",
    ]
    for c, s in summary.items():
        by_step = {p["step"]: p for p in s["curve"]}
        accs = [f"{_fmt(by_step[st]['accuracy'])} ± {_fmt(by_step[st]['se'])}"
                if st in by_step else "-" for st in eval_steps]
        noise = {True: "yes", False: "**no**", None: "n/a"}[s["within_noise"]]
        reach = s["seconds_to_reference_final"]
        runs = f"{s['runs'] - s['failed']}" + (f" ({s['failed']} failed)" if s["failed"] else "")
        if s.get("failed_evals"):
            runs += f" ({s['failed_evals']} eval(s) failed)"
        tel = s["telemetry"]
        lines.append(
            f"| {c} | {runs} | {_fmt(s['final_accuracy'])} ± {_fmt(s['final_se'])} | "
            f"{_fmt(s['diff_vs_reference'], '+.3f')} ± {_fmt(s['diff_se'])} | {noise} | "
            + "".join(a + " | " for a in accs)
            + f"{_fmt(s['step_seconds'], '.1f')} | {_fmt(s['final_seconds'], '.0f')} | "
            f"{'not reached' if reach is None else format(reach, '.0f')} | "
            f"{_fmt(tel.get('batch/max_staleness'), '.2f')} | "
            f"{_fmt(tel.get('batch/reward_mean'), '.3f')} |")
    return "\n".join(lines)


def _sample_label(summary: dict[str, dict], step: int) -> str:
    for s in summary.values():
        for p in s["curve"]:
            if p["step"] == step:
                return f"{p['samples']:.0f}"
    return f"step {step}"


# ---- one run ---------------------------------------------------------------------------------

def read_run(run_dir: Path, acc_key: str, initial: dict | None) -> dict:
    """A finished run's curve (the initial point, then each evaluated step: cumulative trained
    samples and training seconds) and its per-step telemetry means."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    evals = {}
    eval_file = run_dir / "eval.jsonl"
    if eval_file.is_file():
        for x in eval_file.read_text().splitlines():
            if x.strip():
                e = json.loads(x)
                evals[int(e["step"])] = e
    samples = seconds = 0.0
    cum = {0: (0.0, 0.0)}
    for r in rows:
        samples += float(r.get("train/samples", 0.0))
        seconds += float(r.get("step/seconds", 0.0))
        cum[int(r["step"])] = (samples, seconds)
    prefix = acc_key.rsplit("/", 1)[0]

    def accuracy(e: dict) -> float:
        # an answer an engine failed to give scores 0 in the evaluation: such an evaluation
        # measures the engines, not the policy, and is left out (NaN, counted)
        if float(e.get(f"{prefix}/failures/engine") or 0) > 0:
            return math.nan
        value = e.get(acc_key)
        return math.nan if value is None else float(value)

    curve = []
    if 0 in evals:
        initial = {"accuracy": accuracy(evals[0]),
                   "seconds": evals[0].get(f"{prefix}/seconds", math.nan)}
    if initial is not None:
        curve.append({"step": 0, "samples": 0.0, "seconds": 0.0, "accuracy": initial["accuracy"]})
    for step in sorted(s for s in evals if s > 0 and s in cum):
        e = evals[step]
        curve.append({"step": step, "samples": cum[step][0], "seconds": cum[step][1],
                      "accuracy": accuracy(e), "eval_seconds": e.get(f"{prefix}/seconds"),
                      "eval_engine_failures": e.get(f"{prefix}/failures/engine", 0)})
    telemetry = {}
    for k in TELEMETRY:
        vals = [float(r[k]) for r in rows if isinstance(r.get(k), (int, float))]
        if vals:
            telemetry[k] = statistics.mean(vals)
    # tokens per version lag (mismatch telemetry): the share of trained tokens at lag >= 1
    lag = {b: sum(float(v) for r in rows for k, v in r.items()
                  if k.endswith(f"/{b}/tokens") and "mismatch" in k and isinstance(v, (int, float)))
           for b in ("lag0", "lag1", "lag2", "lag3plus")}
    if sum(lag.values()) > 0:
        telemetry["lag>=1 token share"] = 1.0 - lag["lag0"] / sum(lag.values())
    return {"curve": curve, "telemetry": telemetry, "steps": len(rows), "initial": initial}


def plot(summary: dict[str, dict], path: Path, title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for c, s in summary.items():
        if not s["curve"]:
            continue
        acc = [p["accuracy"] for p in s["curve"]]
        err = [0.0 if math.isnan(p["se"]) else p["se"] for p in s["curve"]]
        style = "-" if "+" not in c else "--"
        for ax, x in zip(axes, ("samples", "seconds")):
            ax.errorbar([p[x] for p in s["curve"]], acc, yerr=err, label=c, linestyle=style,
                        marker="o", markersize=3, capsize=2)
    axes[0].set_xlabel("trained samples")
    axes[1].set_xlabel("training seconds (sum of step/seconds)")
    axes[0].set_ylabel("held-out greedy pass@1 (mean ± SE over seeds)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> int:
    from rlkit.config import load_recipe
    from rlkit.driver.run import train

    out = out_folder(args.out)
    if args.merge:
        results, settings = merge_reports(args.merge)
        reference = "sync" if "sync" in results else next(iter(results))
        print(_report(out, results, reference, settings, final=True))
        return 0
    if args.seeds < 1 or args.steps < 1 or args.eval_rows < 1:
        raise SystemExit("--seeds, --steps and --eval-rows must be >= 1")
    configs = expand_configs(args.configs, args.correction, args.teacher)
    every = eval_every(args.steps, args.eval_every)
    base = [
        *([] if args.no_scale else SCALE),
        f"data.path={TRAIN_DATA}",
        f"eval.datasets=[{{name: {EVAL_NAME}, path: '{HELD_OUT.format(rows=args.eval_rows)}'}}]",
        "eval.greedy=true", "eval.n_samples=0", f"eval.every_steps={every}", *ROBUST,
        "tracking.progress=false", "tracking.wandb=disabled",
        *args.overrides,
    ]

    def recipe_of(config: str, seed: int, first: bool):
        return load_recipe(Path(args.recipe), [
            *base, *configs[config], f"run.num_steps={args.steps}", f"run.seed={seed}",
            f"run.output_dir={out / 'runs'}", f"run.name={_run_name(config, seed)}",
            "run.resume=never", "checkpoint.every_steps=0",
            f"eval.before_first_step={'true' if first else 'false'}",
        ])

    # every configuration is checked before the first run starts
    for c in configs:
        recipe_of(c, 1, True)
    order = run_order(list(configs), args.seeds)
    probe = recipe_of(order[0][1], 1, True)
    acc_key = f"eval/{probe.eval.datasets[0].name}/greedy/pass@1"
    reference = "sync" if "sync" in configs else next(iter(configs))
    settings = {"recipe": args.recipe, "steps": args.steps, "seeds": args.seeds,
                "eval_every": every, "eval_rows": args.eval_rows,
                "samples_per_step": probe.rollout.samples_per_step,
                "max_new_tokens": probe.rollout.sampling.max_new_tokens,
                "lr": probe.train.optimizer.lr, "model": probe.model.path,
                "correction": args.correction, "teacher": args.teacher, "overrides": base,
                "reference": reference,
                "accuracy_key": acc_key, "order": [f"{c}/seed{s}" for s, c in order]}
    results: dict[str, list[dict]] = {c: [] for c in configs}
    initial: dict | None = None
    t_all = time.perf_counter()
    for i, (seed, config) in enumerate(order):
        recipe = recipe_of(config, seed, i == 0)
        run_dir = out / "runs" / recipe.run.name
        print(f"[learn] run {i + 1}/{len(order)}: {config}, seed {seed}", flush=True)
        t0 = time.perf_counter()
        try:
            train(recipe)
            entry = read_run(run_dir, acc_key, initial)
            if i == 0:
                initial = entry["initial"]
                settings["initial_accuracy"] = initial["accuracy"] if initial else math.nan
                settings["initial_eval_seconds"] = initial["seconds"] if initial else math.nan
        except Exception as e:  # one failed run is reported, the table goes on
            if i == 0:
                raise
            entry = {"curve": [], "telemetry": {}, "error": f"{type(e).__name__}: {e}"[:500]}
        entry.update(seed=seed, wall_s=time.perf_counter() - t0, run_dir=str(run_dir))
        results[config].append(entry)
        settings["wall_s"] = time.perf_counter() - t_all
        _report(out, results, reference, settings, final=False)
    table = _report(out, results, reference, settings, final=True)
    print(table)
    return 0


# settings two learn.json must share to be one table (configurations and seeds may differ)
MERGE_KEYS = ("steps", "eval_every", "eval_rows", "samples_per_step", "max_new_tokens", "lr",
              "model", "correction", "accuracy_key", "overrides")


def merge_reports(dirs: Sequence[Path]) -> tuple[dict[str, list[dict]], dict]:
    """The runs of several learn.json as one table's (results, settings): the first's settings,
    its initial accuracy (else the next one's), every order and the summed wall time."""
    reports = []
    for d in dirs:
        path = d / "learn.json" if d.is_dir() else d
        if not path.is_file():
            raise SystemExit(f"--merge: no learn.json at {path}")
        reports.append((path, json.loads(path.read_text())))
    first_path, first = reports[0]
    settings = dict(first["settings"])
    results: dict[str, list[dict]] = {}
    for path, rep in reports:
        for key in MERGE_KEYS:
            if rep["settings"].get(key) != settings.get(key):
                raise SystemExit(f"--merge: settings.{key} differs: {rep['settings'].get(key)!r} in "
                                 f"{path}, {settings.get(key)!r} in {first_path}")
        for config, runs in rep["runs"].items():
            have = {r["seed"] for r in results.get(config, [])}
            for r in runs:
                if r["seed"] in have:
                    raise SystemExit(f"--merge: {config} seed {r['seed']} is in more than one "
                                     f"report ({path})")
                results.setdefault(config, []).append(_nan_for_none(r))
        if settings.get("initial_accuracy") is None:
            settings["initial_accuracy"] = rep["settings"].get("initial_accuracy")
    settings["order"] = [o for _, rep in reports for o in rep["settings"]["order"]]
    settings["seeds"] = max(len(runs) for runs in results.values())
    settings["wall_s"] = sum(rep["settings"].get("wall_s") or 0.0 for _, rep in reports)
    settings["merged_from"] = [str(p) for p, _ in reports]
    return results, settings


def _nan_for_none(x: Any) -> Any:
    """learn.json stores NaN as null (_json_safe): back to NaN for the summary's arithmetic."""
    if x is None:
        return math.nan
    if isinstance(x, dict):
        return {k: v if k == "error" else _nan_for_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_nan_for_none(v) for v in x]
    return x


def _run_name(config: str, seed: int) -> str:
    return f"{config.replace('+', '-')}-s{seed}"


def _report(out: Path, results: dict[str, list[dict]], reference: str, settings: dict,
            final: bool) -> str:
    """The table and JSON (rewritten after every run, so an interrupted table keeps its runs)."""
    summary = summarize({c: r for c, r in results.items() if r}, reference)
    table = format_table(summary, reference, settings)
    report = {"settings": settings, "summary": summary, "runs": results}
    if final:
        write_report(out, "learn", _json_safe(report), table)
        if plot(summary, out / "learn.png", f"learning parity: {settings['recipe']}, "
                f"{settings['seeds']} seed(s)"):
            print(f"wrote {out / 'learn.png'}", flush=True)
    else:
        (out / "learn.json").write_text(json.dumps(_json_safe(report), indent=1) + "\n")
        (out / "learn.md").write_text(table + "\n")
    return table


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x
