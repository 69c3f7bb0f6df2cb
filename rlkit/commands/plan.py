"""`rlkit plan`: how many GPUs should generate and how many train (StreamRL's Algorithm 1).

    rlkit plan --gpus 64 --profile h100-qwen2.5-7b-tp1 --cap 16384 --batch-size 128 \\
        --params 7.6e9 --train-unit 2 --mode async

P_gen(x): the real rollout policy on x / (GPUs per engine) simulated engines over a long-tail
trace (as `rlkit bench suite` builds it), rollout seconds per step averaged over `--steps`
steps after `--warmup`. P_train(y): a TrainTimeModel on y GPUs for the trace's trained tokens
per step, plus the weight sync. Generation sizes are measured on a grid (powers of two of an
engine, or every `--gen-step` GPUs, plus the even split and the largest), then bisected around
the best, at most `--max-sim` simulations (`--cache FILE` keeps them across calls). The split
with the least step time of `--mode` wins (rlkit/sim/plan.py); with `--gen-budget` and
`--train-budget`, the cross-datacenter rule. Prints the candidates, the choice and why, its
ratio to the even split, and StreamRL's dynamic-adjustment test (delta vs delta').
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from rlkit.config.modes import MODE_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    b = parser.add_argument_group("budget")
    b.add_argument("--gpus", type=int, help="GPUs to split between generation and training")
    b.add_argument("--gen-budget", type=int, metavar="M",
                   help="cross-datacenter: GPUs available to generation (with --train-budget)")
    b.add_argument("--train-budget", type=int, metavar="N",
                   help="cross-datacenter: GPUs available to the trainer (with --gen-budget)")
    b.add_argument("--mode", choices=MODE_NAMES, default="sync",
                   help="driver mode whose step time is minimised: sync (gen + train + sync), "
                        "stream (training overlaps generation), async (max of the two stages)")
    c = parser.add_argument_group("generation")
    c.add_argument("--profile", default="h100-qwen3-4b-tp2-april",
                   help="engine profile: a packaged name or a JSON file")
    c.add_argument("--gpus-per-engine", type=int,
                   help="GPUs one engine occupies (default: the profile's tensor parallelism)")
    c.add_argument("--policy", default="sync",
                   help="rollout policy spec (as `rlkit bench suite --policies`), e.g. partial@2.0")
    c.add_argument("--router", default="round_robin", choices=["round_robin", "least_load"])
    c.add_argument("--abort-latency", type=float, default=0.2,
                   help="seconds abort_all takes once engines are idle")
    t = parser.add_argument_group("trainer")
    t.add_argument("--params", type=float, default=4.02e9, help="trained parameters")
    t.add_argument("--train-unit", type=int, default=1,
                   help="trainer GPUs per data-parallel replica (tensor x pipeline parallel); "
                        "the trainer's GPU count is a multiple of it")
    t.add_argument("--train-mfu", type=float, default=0.35)
    t.add_argument("--peak-flops", type=float, default=989e12, help="per trainer GPU")
    w = parser.add_argument_group("workload")
    w.add_argument("--cap", type=int, default=16384, help="response length cap")
    w.add_argument("--trace", help="replay this trace file instead of generating one")
    w.add_argument("--batch-size", type=int, default=32, help="groups trained per step")
    w.add_argument("--group-size", type=int, default=8, help="responses per prompt")
    w.add_argument("--prompts", type=int, default=4096, help="prompts in a generated trace")
    w.add_argument("--epochs", type=int, default=2, help="epochs in a generated trace")
    w.add_argument("--prompt-signal", type=float, default=0.0)
    w.add_argument("--growth", type=float, default=0.0,
                   help="length growth per training step (generated traces)")
    w.add_argument("--seed", type=int, default=0)
    s = parser.add_argument_group("search")
    s.add_argument("--warmup", type=int, default=1, help="simulated steps before measuring")
    s.add_argument("--steps", type=int, default=4, help="simulated steps measured per candidate")
    s.add_argument("--max-sim", type=int, default=12,
                   help="simulations (generation sizes) the search may run")
    s.add_argument("--gen-step", type=int,
                   help="first grid: every this many generation GPUs (default: powers of two "
                        "of one engine)")
    s.add_argument("--max-staleness", type=int, default=1000)
    s.add_argument("--cache", type=Path, help="JSON file keeping simulated P_gen across calls")
    s.add_argument("--verify", action="store_true",
                   help="simulate --mode's driver loop, trainer included, at the chosen and the "
                        "even split and report both step times (two more simulations)")
    s.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    from rlkit.sim.plan import PlanError

    try:
        return _run(args)
    except PlanError as e:
        raise SystemExit(f"rlkit plan: {e}") from None


def _run(args: argparse.Namespace) -> int:
    from rlkit.bench.suite import make_policy
    from rlkit.sim import plan as P
    from rlkit.rollout.engines.profile import ProfileError, load_profile
    from rlkit.sim.train_time import TrainTimeModel

    cross = args.gen_budget is not None or args.train_budget is not None
    if cross and (args.gen_budget is None or args.train_budget is None):
        raise SystemExit("rlkit plan: --gen-budget and --train-budget go together")
    if cross == (args.gpus is not None):
        raise SystemExit("rlkit plan: give --gpus N, or --gen-budget M with --train-budget N")
    if args.steps < 1 or args.warmup < 0 or args.max_sim < 1:
        raise SystemExit("rlkit plan: --steps and --max-sim must be >= 1, --warmup >= 0")
    try:
        profile = load_profile(args.profile)
    except ProfileError as e:
        raise SystemExit(f"rlkit plan: --profile: {e}") from None
    gpe = args.gpus_per_engine or P.gpus_per_engine(profile)
    try:
        units = P.Units(gen=gpe, train=args.train_unit)
    except P.PlanError as e:
        raise SystemExit(f"rlkit plan: --gpus-per-engine / --train-unit: {e}") from None
    if not cross:
        try:
            P.check_budget(args.gpus, units, "--gpus")
        except P.PlanError as e:
            raise SystemExit(f"rlkit plan: {e} (profile {profile.name!r}, --train-unit "
                             f"{args.train_unit})") from None
    try:
        make_policy(args.policy)
    except ValueError as e:
        raise SystemExit(f"rlkit plan: --policy: {e}") from None
    try:
        TrainTimeModel(params=args.params, gpus=1, mfu=args.train_mfu, peak_flops=args.peak_flops)
    except ValueError as e:
        raise SystemExit(f"rlkit plan: trainer: {e}") from None

    if cross:
        m, n = args.gen_budget, args.train_budget
        mx, ny = m // gpe * gpe, n // units.train * units.train
        if mx < gpe:
            raise SystemExit(f"rlkit plan: --gen-budget {m} is too small for one engine "
                             f"({gpe} GPUs, profile {profile.name!r})")
        if ny < units.train:
            raise SystemExit(f"rlkit plan: --train-budget {n} is too small for one trainer "
                             f"replica (--train-unit {units.train})")
        limit, extra = mx, []
    else:
        limit, extra = P.gen_limit(args.gpus, units), [P.even_split(args.gpus, units)[0]]
    try:
        start = P.grid(limit, gpe, args.gen_step, extra=extra)
    except P.PlanError as e:
        raise SystemExit(f"rlkit plan: --gen-step: {e}") from None
    if len(start) > args.max_sim:
        raise SystemExit(f"rlkit plan: --max-sim {args.max_sim} is less than the first grid's "
                         f"{len(start)} generation sizes ({', '.join(map(str, start))}): raise "
                         "it or coarsen --gen-step")

    trace = _trace(args)
    tokens = P.trained_tokens_per_step(trace, args.batch_size, args.warmup, args.steps)

    def p_train(y: int) -> P.TrainCost:
        model = TrainTimeModel(params=args.params, gpus=y, mfu=args.train_mfu,
                               peak_flops=args.peak_flops)
        train_s = model.train_s(int(tokens))
        compute = train_s - model.overhead_s
        # stream mode trains each group as it completes: all but the last group's compute
        return P.TrainCost(train_s, model.sync_s(), compute * (1 - 1 / args.batch_size))

    cache_key = json.dumps({
        "profile": profile.to_json(), "gpus_per_engine": gpe, "policy": args.policy,
        "router": args.router, "abort_latency": args.abort_latency, "trace": trace.header(),
        "trace_file": args.trace, "batch_size": args.batch_size, "warmup": args.warmup,
        "steps": args.steps, "max_staleness": args.max_staleness, "seed": args.seed,
    }, sort_keys=True)
    cache = _load_cache(args.cache, cache_key)
    simulated: list[int] = []

    def p_gen(x: int) -> list[float]:
        if x not in cache:
            cache[x] = _simulate(x // gpe, profile, args, trace)
            simulated.append(x)
            _save_cache(args.cache, cache_key, cache)
        return cache[x]

    def best_step(limit_y: Callable[[int], int]) -> Callable[[int, list[float]], float]:
        def score(x: int, gen: list[float]) -> float:
            return min(P.expected_step(args.mode, gen, p_train(y))
                       for y in units.train_sizes(limit_y(x)))
        return score

    t0 = time.perf_counter()
    if not cross:
        n = args.gpus
        got = P.search_gen(start, p_gen, best_step(lambda x: n - x), gpe, args.max_sim,
                           measured={x: g for x, g in cache.items() if x <= limit})
        plan = P.plan_single(n, got, p_train, units, args.mode, xs=sorted(got))
    else:
        got = P.search_gen(start, p_gen, best_step(lambda x: ny), gpe, args.max_sim,
                           measured={x: g for x, g in cache.items() if x <= mx})
        plan = P.plan_cross(m, n, got, p_train, units, args.mode, xs=sorted(got))
    c = plan.chosen
    plan.adjust = P.adjustment(c.x, c.gen_s, c.train_s, c.x + gpe,
                               statistics.mean(p_gen(c.x + gpe)))
    verified: dict[str, Any] = {}
    if args.verify:
        splits = {"chosen": c, **({"even": plan.even} if plan.even is not None else {})}
        for name, split in splits.items():
            model = TrainTimeModel(params=args.params, gpus=split.y, mfu=args.train_mfu,
                                   peak_flops=args.peak_flops)
            verified[name] = statistics.mean(_simulate(split.x // gpe, profile, args, trace,
                                                       model, args.mode, "step_s"))
        if "even" in verified:
            verified["speedup_vs_even"] = verified["even"] / verified["chosen"]
    wall = time.perf_counter() - t0
    plan.extra = {
        "profile": profile.name, "gpus_per_engine": gpe, "train_unit": units.train,
        "policy": args.policy, "trace": trace.name, "cap": trace.cap,
        "batch_size": args.batch_size, "group_size": trace.group_size,
        "trained_tokens_per_step": tokens, "params": args.params, "train_mfu": args.train_mfu,
        "warmup": args.warmup, "steps": args.steps, "simulations": len(simulated),
        "verified": verified or None,
        "wall_s": wall,
    }
    if args.json:
        print(json.dumps(plan.to_json(), indent=1))
    else:
        print(format_plan(plan, profile))
    return 0


def _trace(args: argparse.Namespace) -> Any:
    from rlkit.sim.trace import Trace, TraceError, TraceSpec, generate_trace

    if args.trace:
        try:
            return Trace.load(args.trace)
        except TraceError as e:
            raise SystemExit(f"rlkit plan: --trace: {e}") from None
    try:
        spec = TraceSpec(rows=args.prompts, epochs=args.epochs, group_size=args.group_size,
                         cap=args.cap, seed=args.seed, batch_size=args.batch_size,
                         growth_per_step=args.growth, prompt_signal=args.prompt_signal)
    except ValueError as e:
        raise SystemExit(f"rlkit plan: workload: {e}") from None
    return generate_trace(spec)


def _simulate(engines: int, profile: Any, args: argparse.Namespace, trace: Any,
              train: Any = None, mode: str = "sync", field: str = "rollout_s") -> list[float]:
    """`field` of each measured step on `engines` simulated engines (the cluster, policy and
    ranker built as `rlkit bench suite` builds them), under `mode`'s loop with `train`'s
    trainer (None: training takes no time)."""
    from rlkit.bench.suite import make_policy, make_ranker, rollout_base
    from rlkit.sim.engine import SimConfig
    from rlkit.sim.simulate import run_simulation

    cluster = SimConfig(engines, profile, router=args.router, abort_latency_s=args.abort_latency)
    base = rollout_base(args.profile, cluster)
    results = run_simulation(
        cluster, trace, make_policy(args.policy, base), steps=args.warmup + args.steps,
        batch_size=args.batch_size, max_staleness=args.max_staleness, seed=args.seed,
        final_step=False, ranker=make_ranker(args.policy, trace, base), train=train, mode=mode,
    )
    return [float(getattr(r, field)) for r in results[args.warmup:]]


def _load_cache(path: Path | None, key: str) -> dict[int, list[float]]:
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SystemExit(f"rlkit plan: --cache {path}: not JSON ({e})") from None
    entry = data.get(key, {}) if isinstance(data, dict) else {}
    return {int(x): [float(v) for v in s] for x, s in entry.items() if isinstance(s, list)}


def _save_cache(path: Path | None, key: str, cache: dict[int, list[float]]) -> None:
    if path is None:
        return
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = {str(x): s for x, s in sorted(cache.items())}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data) + "\n")


def format_plan(plan: Any, profile: Any) -> str:
    e = plan.extra
    mode = plan.mode
    budget = (f"{plan.budgets['gpus']} GPUs" if plan.kind == "single" else
              f"{plan.budgets['gen_gpus']} GPUs for generation, {plan.budgets['train_gpus']} "
              "for training (cross-datacenter)")
    lines = [
        f"Budget: {budget}; mode {mode}. Engines: profile `{profile.name}` ({profile.model}), "
        f"{e['gpus_per_engine']} GPU(s) each; policy {e['policy']}.",
        f"Workload: trace `{e['trace']}` (cap {e['cap']}), {e['batch_size']} groups x "
        f"{e['group_size']} per step, {e['trained_tokens_per_step']:,.0f} trained tokens/step. "
        f"Trainer: {e['params'] / 1e9:.2f}B params, MFU {e['train_mfu']:g}, GPUs in multiples "
        f"of {e['train_unit']}.",
        f"P_gen: simulated, mean of {e['steps']} steps after {e['warmup']} warm-up (step "
        "times: means over those steps, so async pays each step's max(generation, P_train)); "
        f"{e['simulations']} sizes simulated now (others cached), {e['wall_s']:.0f} s of wall "
        "time.",
        "",
        "| gen GPUs | engines | train GPUs | P_gen s | P_train s | gen - train s | "
        "sync step s | stream step s | async step s | |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in plan.candidates:
        tags = []
        if (c.x, c.y) == (plan.chosen.x, plan.chosen.y):
            tags.append("**chosen**")
        if plan.even is not None and (c.x, c.y) == (plan.even.x, plan.even.y):
            tags.append("even split")
        if plan.rule is not None and c.x == plan.rule.x and c.y == plan.rule.y:
            tags.append("reference rule")
        lines.append(
            f"| {c.x} | {c.engines} | {c.y} | {c.gen_s:.1f} | {c.train_s:.1f} | "
            f"{c.imbalance_s:+.1f} | {c.step('sync'):.1f} | {c.step('stream'):.1f} | "
            f"{c.step('async'):.1f} | {', '.join(tags)} |")
    c = plan.chosen
    lines += ["", f"Chosen: {c.x} GPUs generate ({c.engines} engines), {c.y} train: "
              f"{c.step(mode):.1f} s/step ({mode})."]
    if plan.kind == "cross" and plan.rule is not None and plan.rule is not c:
        lines.append(f"Reference rule: {plan.rule.x} + {plan.rule.y}.")
    lines.append(f"Why: {plan.reason}.")
    if plan.even is not None:
        lines.append(f"vs the even split ({plan.even.x} + {plan.even.y}): "
                     f"{plan.speedup_vs_even:.2f}x.")
    v = e.get("verified")
    if v:
        lines.append(
            f"Simulated {mode} loop (trainer included): chosen {v['chosen']:.1f} s/step"
            + (f", even split {v['even']:.1f} s/step: {v['speedup_vs_even']:.2f}x."
               if "even" in v else "."))
    a = plan.adjust
    if a is not None:
        verdict = "add one engine" if a.add else "keep the split"
        b = plan.budgets
        beyond = (a.x_more + c.y > b["gpus"]) if "gpus" in b else a.x_more > b["gen_gpus"]
        if a.add and beyond:
            verdict += f", from outside the budget ({a.x_more} + {c.y} GPUs)"
        lines.append(
            f"Dynamic adjustment: delta = P_gen - P_train = {a.delta_s:+.1f} s, delta' = "
            f"P_gen({a.x}) - P_gen({a.x_more}) = {a.delta_prime_s:+.1f} s: {verdict} "
            "(StreamRL adds an engine when delta >= delta').")
    return "\n".join(lines)
