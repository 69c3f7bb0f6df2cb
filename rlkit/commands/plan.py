"""`rlkit plan`: how many GPUs should generate and how many train (StreamRL's Algorithm 1).

    rlkit plan --gpus 64 --profile h100-qwen2.5-7b-tp1 --cap 16384 --batch-size 128 \\
        --params 7.6e9 --train-unit 2 --mode async

P_gen(x): the real rollout policy on x / (GPUs per engine) simulated engines over a long-tail
trace (as `rlkit bench suite` builds it), rollout seconds per step averaged over `--steps`
steps after `--warmup`. P_train(y): a TrainTimeModel on y GPUs for the batches those steps
train (each sample n + w n^2 token-equivalents with the profile's attention weight w, split
over the data-parallel replicas as the trainer balances them, the slowest one timed), plus
the weight sync. Generation sizes are measured on a grid (powers of two of an
engine, or every `--gen-step` GPUs, plus the even split and the largest), then bisected around
the best, at most `--max-sim` simulations (`--cache FILE` keeps them across calls). The split
with the least step time of `--mode` wins (rlkit/gpu_plan.py); with `--gen-budget` and
`--train-budget`, the cross-datacenter rule. Prints the candidates, the choice and why, its
ratio to the even split, and StreamRL's dynamic-adjustment test (delta vs delta').

`--placement colocated|both`: engines and trainer on all --gpus, taking turns (sync mode only):
step = P_gen(all GPUs) + P_train(all GPUs) + the turns of a ColocationModel (trainer onload
and offload over the host link, engines' sleep and wake, the in-memory weight update); `both`
prints it beside the best split and which is faster, by what ratio. `--sweep KEY=V1,...`
compares them at each value and says where the winner flips. One more simulation per budget
(generation on all of it); `--cache` keeps it with the rest.

Frozen engine groups (rollout.frozen_engines: a teacher or a judge): `--frozen-gpus F` takes
their GPUs out of --gpus (or --gen-budget) before the split is searched, in every placement.
`--teacher-params P` prices a teacher scoring each step's samples (prompt + response tokens,
one prefill each) on those F GPUs at `--peak-flops` x `--teacher-mfu`, overlapped with
generation: each measured step's rollout stage becomes max(G_k, T_k) + T_k / samples
(rlkit/gpu_plan.py's docstring). The simulation (and --verify's loop) has no teacher; the
cache keeps the teacher-free P_gen.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rlkit.config.modes import MODE_NAMES


SWEEP_KEYS = {"gpus": int, "cap": int, "batch_size": int, "params": float}


def _sweep(text: str) -> tuple[str, list[Any]]:
    key, _, values = text.partition("=")
    key = key.strip().replace("-", "_")
    if key not in SWEEP_KEYS or not values:
        raise argparse.ArgumentTypeError(f"{text!r}: give KEY=V1,V2,... with KEY one of "
                                         f"{', '.join(SWEEP_KEYS)}")
    try:
        return key, [SWEEP_KEYS[key](v.strip()) for v in values.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: values must be numbers") from None


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
    b.add_argument("--placement", choices=["disaggregated", "colocated", "both"],
                   default="disaggregated",
                   help="disaggregated: split --gpus between generation and training; "
                        "colocated: engines and trainer take turns on all --gpus (sync mode "
                        "only; one more simulation); both: each, and which is faster")
    b.add_argument("--sweep", type=_sweep, metavar="KEY=V1,V2,...",
                   help="compare the placements (as --placement both) at each value of "
                        f"{', '.join(SWEEP_KEYS)} (e.g. gpus=8,16,32,64) and say where the "
                        "winner flips; params changes the trainer only (the engines keep "
                        "--profile's speed)")
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
    t.add_argument("--peak-flops", type=float, default=989e12,
                   help="per GPU: the trainer's, and the frozen GPUs' with --teacher-params")
    t.add_argument("--attention-weight", type=float, default=None,
                   help="attention FLOPs per token pair over matmul FLOPs per token, which "
                   "prices the long tail's attention in training (TrainTimeModel); default: "
                   "the engine profile's own (its prefill's quadratic over linear cost); 0: "
                   "tokens alone")
    t.add_argument("--lora-params", type=float, default=0.0, metavar="N",
                   help="LoRA (train.lora): the adapters' parameters (`rlkit bench lora` gives "
                   "them for a model: trained params bytes / 4); the base's weight gradients "
                   "are skipped, the optimizer holds N alone (colocated turns) and, with "
                   "--lora-sync adapter, each sync sends N and pauses nothing. 0: full training")
    t.add_argument("--lora-sync", choices=["adapter", "merged"], default="adapter",
                   help="train.lora.sync (colocated placement is merged whatever this says: its "
                   "engines release their base weights while asleep)")
    t.add_argument("--host-bandwidth", type=float, default=25.0, metavar="GB/S",
                   help="colocated: pinned host <-> device GB/s per GPU while the trainer "
                        "onloads and offloads its state (ColocationModel.host_bandwidth)")
    t.add_argument("--update-bandwidth", type=float, default=200.0, metavar="GB/S",
                   help="colocated: GB/s of the in-memory weight update (CUDA IPC)")
    f = parser.add_argument_group("frozen engines")
    f.add_argument("--frozen-gpus", type=int, default=0, metavar="N",
                   help="GPUs the frozen engine groups hold (rollout.frozen_engines: teacher, "
                   "judge; their engine.num_engines x engine.gpus_per_engine, summed): taken out "
                   "of --gpus (or --gen-budget) before the split is searched, in every placement")
    f.add_argument("--teacher-params", type=float, default=0.0, metavar="P",
                   help="a teacher's parameters: it scores every sample's prompt + response "
                   "tokens in one prefill (2 P FLOPs a token) on the --frozen-gpus GPUs while "
                   "the step generates; each step's rollout becomes max(P_gen, teacher) + "
                   "teacher / samples. 0: no teacher")
    f.add_argument("--teacher-mfu", type=float, default=0.4,
                   help="the teacher's prefill MFU (compute-bound), of --peak-flops")
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
                        "even split and report both step times (two more simulations; with "
                        "--placement colocated|both, the colocated sync loop too)")
    s.add_argument("--json", action="store_true", help="print the plan as JSON")


def _frozen_text(e: dict[str, Any]) -> str:
    """The frozen groups' GPUs and the teacher's share, or nothing without them."""
    if not e.get("frozen_gpus"):
        return ""
    before = e["budget_with_frozen"]
    where = "--gpus" if "gpus" in before else "--gen-budget"
    total = before.get("gpus", before.get("gen_gpus"))
    f = e["frozen_gpus"]
    out = (f"Frozen engine groups: {f} GPU{'s' * (f != 1)} of their own, out of {where} {total}; "
           f"{'generation is' if where == '--gen-budget' else 'the engines and the trainer are'}"
           f" planned on the {total - f} left.")
    if e.get("teacher_s") is not None:
        share = e.get("teacher_share_of_step")
        out += (f" Teacher: {e['teacher_params'] / 1e9:.2f}B params scoring "
                f"{e['teacher_tokens_per_step']:,.0f} prompt + response tokens/step "
                f"({e['teacher_samples_per_step']:g} samples) at MFU {e['teacher_mfu']:g}: "
                f"{e['teacher_s']:.1f} s/step of scoring"
                + (f", {share:.0%} of the chosen step" if share is not None else "")
                + "; the rollout stage (P_gen below) is max(generation, teacher) + teacher / "
                "samples"
                + (f", {e['teacher_added_s']:+.2f} s at the chosen split"
                   if e.get("teacher_added_s") is not None else "") + "."
                + (" The teacher is slower than generation there: it bounds the rollout, and "
                   "more frozen GPUs (not engines) would shorten it." if e.get("teacher_bound")
                   else ""))
    return out


def _lora_text(e: dict[str, Any]) -> str:
    if not e.get("lora_params"):
        return ""
    return f" (LoRA: {e['lora_params'] / 1e6:.1f}M adapter params, {e['lora_sync']} sync)"


def run(args: argparse.Namespace) -> int:
    from rlkit.gpu_plan import PlanError

    try:
        return _run(args)
    except PlanError as e:
        raise SystemExit(f"rlkit plan: {e}") from None


@dataclass
class Point:
    """What one budget and workload gave: the disaggregated plan (None: --placement
    colocated), the placement comparison (None: --placement disaggregated)."""

    plan: Any
    choice: Any
    profile: Any
    extra: dict[str, Any]


def _run(args: argparse.Namespace) -> int:
    cross = args.gen_budget is not None or args.train_budget is not None
    if cross and (args.gen_budget is None or args.train_budget is None):
        raise SystemExit("rlkit plan: --gen-budget and --train-budget go together")
    if cross == (args.gpus is not None) and not (args.sweep and args.sweep[0] == "gpus"):
        raise SystemExit("rlkit plan: give --gpus N, or --gen-budget M with --train-budget N")
    if args.steps < 1 or args.warmup < 0 or args.max_sim < 1:
        raise SystemExit("rlkit plan: --steps and --max-sim must be >= 1, --warmup >= 0")
    if args.frozen_gpus < 0 or args.teacher_params < 0 or not 0 < args.teacher_mfu <= 1:
        raise SystemExit("rlkit plan: --frozen-gpus and --teacher-params must be >= 0, "
                         "--teacher-mfu in (0, 1]")
    if args.teacher_params and not args.frozen_gpus:
        raise SystemExit("rlkit plan: --teacher-params needs --frozen-gpus >= 1: the teacher "
                         "runs on GPUs of its own")
    if args.sweep:
        args.placement = "both"  # a sweep compares the placements at each point
    if cross and args.placement != "disaggregated":
        raise SystemExit(f"rlkit plan: --placement {args.placement} needs --gpus: a colocated "
                         "cluster is one pool of GPUs, not two budgets")
    memo: dict[str, dict[int, list[float]]] = {}  # P_gen per cache key, across sweep points
    if not args.sweep:
        point = _point(args, cross, memo)
        if args.json:
            print(json.dumps(_point_json(point), indent=1))
        else:
            print(format_point(point))
        return 0
    key, values = args.sweep
    points = [(v, _point(argparse.Namespace(**{**vars(args), key: v}), False, memo))
              for v in values]
    if args.json:
        print(json.dumps({"sweep": key, "mode": args.mode,
                          "points": [{key: v, **_point_json(p)} for v, p in points],
                          "flips": _flips_json(key, points)}, indent=1))
    else:
        print(format_sweep(key, points, args.mode))
    return 0


def _point(args: argparse.Namespace, cross: bool, memo: dict[str, dict[int, list[float]]]
           ) -> Point:
    from rlkit.bench.suite import make_policy
    from rlkit import gpu_plan as P
    from rlkit.rollout.engines.profile import ProfileError, load_profile
    from rlkit.sim.train_time import ColocationModel, TrainTimeModel, attention_weight_of_profile

    try:
        profile = load_profile(args.profile)
    except ProfileError as e:
        raise SystemExit(f"rlkit plan: --profile: {e}") from None
    gpe = args.gpus_per_engine or P.gpus_per_engine(profile)
    try:
        units = P.Units(gen=gpe, train=args.train_unit)
    except P.PlanError as e:
        raise SystemExit(f"rlkit plan: --gpus-per-engine / --train-unit: {e}") from None
    split = args.placement != "colocated"  # search the disaggregated split
    colocate = args.placement != "disaggregated"
    where = f"(profile {profile.name!r}, --train-unit {args.train_unit})"
    frozen = args.frozen_gpus
    gpus = label = None  # what the frozen groups leave of --gpus
    if not cross:
        label = f"--gpus {args.gpus} less --frozen-gpus {frozen}, a budget" if frozen else "--gpus"
        try:
            gpus = P.after_frozen(args.gpus, frozen, "--gpus")
        except P.PlanError as e:
            raise SystemExit(f"rlkit plan: --frozen-gpus {frozen}: {e}") from None
    split_blocker = None
    if not cross and split:
        try:
            P.check_budget(gpus, units, label)
        except P.PlanError as e:
            if not colocate:
                raise SystemExit(f"rlkit plan: {e} {where}") from None
            split, split_blocker = False, str(e)  # both: colocated may still fit
    blocker = P.colocated_blocker(gpus, units) if colocate else None
    if blocker is not None and not split:
        raise SystemExit(f"rlkit plan: --placement colocated: {blocker} {where}")
    try:
        make_policy(args.policy)
    except ValueError as e:
        raise SystemExit(f"rlkit plan: --policy: {e}") from None
    try:
        TrainTimeModel(params=args.params, gpus=1, mfu=args.train_mfu, peak_flops=args.peak_flops,
                       lora_params=args.lora_params, lora_sync=args.lora_sync)
    except ValueError as e:
        raise SystemExit(f"rlkit plan: trainer: {e}") from None

    if cross:
        try:
            m = P.after_frozen(args.gen_budget, frozen, "--gen-budget")
        except P.PlanError as e:
            raise SystemExit(f"rlkit plan: --frozen-gpus {frozen}: {e}") from None
        n = args.train_budget
        mx, ny = m // gpe * gpe, n // units.train * units.train
        if mx < gpe:
            what = (f"--gen-budget {args.gen_budget} less --frozen-gpus {frozen} ({m} GPUs)"
                    if frozen else f"--gen-budget {m}")
            raise SystemExit(f"rlkit plan: {what} is too small for one engine "
                             f"({gpe} GPUs, profile {profile.name!r})")
        if ny < units.train:
            raise SystemExit(f"rlkit plan: --train-budget {n} is too small for one trainer "
                             f"replica (--train-unit {units.train})")
        limit, extra = mx, []
    elif split:
        limit, extra = P.gen_limit(gpus, units), [P.even_split(gpus, units)[0]]
    if split:
        try:
            start = P.grid(limit, gpe, args.gen_step, extra=extra)
        except P.PlanError as e:
            raise SystemExit(f"rlkit plan: --gen-step: {e}") from None
        if len(start) > args.max_sim:
            raise SystemExit(f"rlkit plan: --max-sim {args.max_sim} is less than the first "
                             f"grid's {len(start)} generation sizes ({', '.join(map(str, start))})"
                             ": raise it or coarsen --gen-step")

    trace = _trace(args)
    per_step = P.trained_lengths_per_step(trace, args.batch_size, args.warmup, args.steps)
    tokens = sum(map(sum, per_step)) / args.steps
    # a teacher scores what each measured step trains: its samples' prompt + response tokens
    teacher = (P.Teacher.of(per_step, args.teacher_params, frozen, args.peak_flops,
                            args.teacher_mfu) if args.teacher_params else None)
    weight = (attention_weight_of_profile(profile) if args.attention_weight is None
              else args.attention_weight)

    def trainer(y: int) -> TrainTimeModel:
        return TrainTimeModel(params=args.params, gpus=y, mfu=args.train_mfu,
                              peak_flops=args.peak_flops, attention_weight=weight,
                              model_parallel=units.train, lora_params=args.lora_params,
                              lora_sync=args.lora_sync)

    def batch_s(model: TrainTimeModel) -> float:
        """Mean training seconds of the measured steps' batches (attention, DP balance)."""
        return statistics.mean(model.batch_s(lengths) for lengths in per_step)

    def p_train(y: int) -> P.TrainCost:
        model = trainer(y)
        train_s = batch_s(model)
        compute = train_s - model.overhead_s
        # stream mode trains each group as it completes: all but the last group's compute
        return P.TrainCost(train_s, model.sync_s(), compute * (1 - 1 / args.batch_size))

    cache_key = json.dumps({
        "profile": profile.to_json(), "gpus_per_engine": gpe, "policy": args.policy,
        "router": args.router, "abort_latency": args.abort_latency, "trace": trace.header(),
        "trace_file": args.trace, "batch_size": args.batch_size, "warmup": args.warmup,
        "steps": args.steps, "max_staleness": args.max_staleness, "seed": args.seed,
    }, sort_keys=True)
    if cache_key not in memo:
        memo[cache_key] = _load_cache(args.cache, cache_key)
    cache = memo[cache_key]
    simulated: list[int] = []

    def raw_gen(x: int) -> list[float]:
        """Simulated rollout seconds per measured step (cached; no teacher)."""
        if x not in cache:
            cache[x] = _simulate(x // gpe, profile, args, trace)
            simulated.append(x)
            _save_cache(args.cache, cache_key, cache)
        return cache[x]

    def scored(gen: list[float]) -> list[float]:
        """The rollout stage with the teacher's scoring (gpu_plan's model), step by step."""
        return list(teacher.rollout(gen)) if teacher is not None else gen

    def p_gen(x: int) -> list[float]:
        return scored(raw_gen(x))

    def best_step(limit_y: Callable[[int], int]) -> Callable[[int, list[float]], float]:
        def score(x: int, gen: list[float]) -> float:
            return min(P.expected_step(args.mode, gen, p_train(y))
                       for y in units.train_sizes(limit_y(x)))
        return score

    t0 = time.perf_counter()
    plan = None
    verified: dict[str, Any] = {}
    if split and not cross:
        n = gpus
        got = P.search_gen(start, p_gen, best_step(lambda x: n - x), gpe, args.max_sim,
                           measured={x: scored(g) for x, g in cache.items() if x <= limit})
        plan = P.plan_single(n, got, p_train, units, args.mode, xs=sorted(got))
    elif split:
        got = P.search_gen(start, p_gen, best_step(lambda x: ny), gpe, args.max_sim,
                           measured={x: scored(g) for x, g in cache.items() if x <= mx})
        plan = P.plan_cross(m, n, got, p_train, units, args.mode, xs=sorted(got))
    if plan is not None:
        c = plan.chosen
        plan.adjust = P.adjustment(c.x, c.gen_s, c.train_s, c.x + gpe,
                                   statistics.mean(p_gen(c.x + gpe)))
    if plan is not None and args.verify:
        splits = {"chosen": c, **({"even": plan.even} if plan.even is not None else {})}
        for name, sp in splits.items():
            verified[name] = statistics.mean(_simulate(sp.x // gpe, profile, args, trace,
                                                       trainer(sp.y), args.mode, "step_s"))
        if "even" in verified:
            verified["speedup_vs_even"] = verified["even"] / verified["chosen"]

    choice = turns = None
    if colocate:
        colocated = None
        if blocker is None:
            g = gpus
            turns = ColocationModel(params=args.params, gpus=g, model_parallel=units.train,
                                    lora_params=args.lora_params,
                                    host_bandwidth=args.host_bandwidth * 1e9,
                                    update_bandwidth=args.update_bandwidth * 1e9)
            colocated = P.ColocatedCost(g, g // gpe, tuple(p_gen(g)),
                                        batch_s(trainer(g)), turns.sleep_s(),
                                        turns.wake_s(), {**turns.sleep(), **turns.wake()})
            if args.verify:
                verified["colocated"] = statistics.mean(_simulate(
                    g // gpe, profile, args, trace, trainer(g), "sync", "step_s",
                    placement="colocated", colocation=turns))
        if blocker is not None and split_blocker is not None:
            raise SystemExit(f"rlkit plan: neither placement fits: {split_blocker}; and "
                             f"{blocker} {where}")
        choice = P.PlacementChoice(args.mode, plan.chosen if plan is not None else None,
                                   colocated, blocker, split_blocker)
    step = (plan.chosen.step(args.mode) if plan is not None
            else choice.colocated.step_s if choice is not None and choice.colocated else None)
    added = bound = None  # what the teacher adds to the chosen rollout; whether it bounds it
    at = (plan.chosen.x if plan is not None else choice.colocated.gpus
          if choice is not None and choice.colocated is not None else None)
    if teacher is not None and at is not None:
        raw = statistics.mean(raw_gen(at))
        added = statistics.mean(p_gen(at)) - raw
        bound = teacher.mean_s > raw
    extra = {
        "profile": profile.name, "gpus_per_engine": gpe, "train_unit": units.train,
        "policy": args.policy, "trace": trace.name, "cap": trace.cap,
        "batch_size": args.batch_size, "group_size": trace.group_size,
        "trained_tokens_per_step": tokens, "attention_weight": weight,
        "params": args.params, "train_mfu": args.train_mfu,
        "lora_params": args.lora_params, "lora_sync": args.lora_sync,
        "frozen_gpus": frozen,
        "budget_with_frozen": ({"gen_gpus": args.gen_budget, "train_gpus": args.train_budget}
                               if cross else {"gpus": args.gpus}),
        "teacher_params": args.teacher_params, "teacher_mfu": args.teacher_mfu,
        "teacher_s": teacher.mean_s if teacher else None,
        "teacher_steps_s": list(teacher.steps_s) if teacher else None,
        "teacher_tokens_per_step": statistics.mean(teacher.tokens) if teacher else None,
        "teacher_samples_per_step": statistics.mean(teacher.samples) if teacher else None,
        "teacher_share_of_step": teacher.mean_s / step if teacher and step else None,
        "teacher_added_s": added, "teacher_bound": bound,
        "warmup": args.warmup, "steps": args.steps, "simulations": len(simulated),
        "verified": verified or None, "placement": args.placement,
        "host_bandwidth_gbps": args.host_bandwidth, "update_bandwidth_gbps": args.update_bandwidth,
        "colocated_state_gb_per_gpu": turns.state_bytes_per_gpu / 1e9 if turns else None,
        "wall_s": time.perf_counter() - t0,
    }
    if plan is not None:
        plan.extra = extra
    return Point(plan, choice, profile, extra)


def _point_json(point: Point) -> dict[str, Any]:
    out = point.plan.to_json() if point.plan is not None else dict(point.extra)
    if point.choice is not None:
        out["placement_choice"] = point.choice.to_json()
    return out


def _flips_json(key: str, points: list[tuple[Any, Any]]) -> list[dict[str, Any]]:
    from rlkit.gpu_plan import flips

    return [{"between": [a, b], "from": wa, "to": wb}
            for a, b, wa, wb in flips([(v, p.choice) for v, p in points])]


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
              train: Any = None, mode: str = "sync", field: str = "rollout_s",
              **placement: Any) -> list[float]:
    """`field` of each measured step on `engines` simulated engines (the cluster, policy and
    ranker built as `rlkit bench suite` builds them), under `mode`'s loop with `train`'s
    trainer (None: training takes no time); `placement`: simulate's placement and colocation."""
    from rlkit.bench.suite import make_policy, make_ranker, rollout_base
    from rlkit.sim.engine import SimConfig
    from rlkit.sim.simulate import run_simulation

    cluster = SimConfig(engines, profile, router=args.router, abort_latency_s=args.abort_latency)
    base = rollout_base(args.profile, cluster)
    results = run_simulation(
        cluster, trace, make_policy(args.policy, base), steps=args.warmup + args.steps,
        batch_size=args.batch_size, max_staleness=args.max_staleness, seed=args.seed,
        final_step=False, ranker=make_ranker(args.policy, trace, base), train=train, mode=mode,
        **placement,
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
    held = (f" (after the frozen engine groups' {e['frozen_gpus']})"
            if e.get("frozen_gpus") else "")
    budget = (f"{plan.budgets['gpus']} GPUs{held}" if plan.kind == "single" else
              f"{plan.budgets['gen_gpus']} GPUs for generation{held}, "
              f"{plan.budgets['train_gpus']} for training (cross-datacenter)")
    lines = [
        f"Budget: {budget}; mode {mode}. Engines: profile `{profile.name}` ({profile.model}), "
        f"{e['gpus_per_engine']} GPU(s) each; policy {e['policy']}.",
        f"Workload: trace `{e['trace']}` (cap {e['cap']}), {e['batch_size']} groups x "
        f"{e['group_size']} per step, {e['trained_tokens_per_step']:,.0f} trained tokens/step. "
        f"Trainer: {e['params'] / 1e9:.2f}B params{_lora_text(e)}, MFU {e['train_mfu']:g}, GPUs "
        f"in multiples of {e['train_unit']}.",
        *filter(None, [_frozen_text(e)]),
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
            + (f", even split {v['even']:.1f} s/step: {v['speedup_vs_even']:.2f}x"
               if "even" in v else "")
            + (" (the simulated loop has no teacher)." if e.get("teacher_s") is not None
               else "."))
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


def _header(e: dict[str, Any], profile: Any, gpus: Any, mode: str) -> list[str]:
    return [
        f"Budget: {gpus} GPUs; mode {mode}. Engines: profile `{profile.name}` ({profile.model}), "
        f"{e['gpus_per_engine']} GPU(s) each; policy {e['policy']}.",
        f"Workload: trace `{e['trace']}` (cap {e['cap']}), {e['batch_size']} groups x "
        f"{e['group_size']} per step, {e['trained_tokens_per_step']:,.0f} trained tokens/step. "
        f"Trainer: {e['params'] / 1e9:.2f}B params{_lora_text(e)}, MFU {e['train_mfu']:g}, GPUs "
        f"in multiples of {e['train_unit']}.",
        *filter(None, [_frozen_text(e)]),
    ]


def format_point(point: Point) -> str:
    """The plan (when searched), then the placement comparison (when asked for)."""
    if point.plan is not None:
        lines = [format_plan(point.plan, point.profile)]
    else:
        e = point.extra
        lines = _header(e, point.profile, point.choice.colocated.gpus, "sync") + [
            f"P_gen: simulated, mean of {e['steps']} steps after {e['warmup']} warm-up; "
            f"{e['simulations']} simulated now (else cached), {e['wall_s']:.0f} s of wall time."]
    if point.choice is not None:
        lines += ["", format_choice(point.choice, point.extra)]
    return "\n".join(lines)


def format_choice(choice: Any, e: dict[str, Any]) -> str:
    """Colocated against the best disaggregated split of the same GPUs."""
    from rlkit.gpu_plan import mode_blocker

    d, c, mode = choice.disaggregated, choice.colocated, choice.mode
    win = choice.winner
    lines = ["Placement, same GPUs (colocated: engines and trainer take turns on every GPU, "
             "sync mode only):", "",
             "| placement | gen GPUs | train GPUs | mode | P_gen s | train s | sync or turns s | "
             "step s | |", "|---|---:|---:|---|---:|---:|---:|---:|---|"]
    def row(name: str, cells: tuple[Any, ...], tag: str, blocked: str | None) -> None:
        if cells:
            nums = " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in cells)
            lines.append(f"| {name} | {nums} | {'**faster**' if win == tag else ''} |")
        elif blocked:
            lines.append(f"| {name} | | | | | | | | not possible: {blocked} |")

    both = d is not None and c is not None  # "faster" only beside the other
    row("disaggregated (best split)", (d.x, d.y, mode, d.gen_s, d.cost.train_s, d.cost.sync_s,
                                       d.step(mode)) if d else (),
        "disaggregated" if both else "", choice.split_blocker)
    engines = f"{c.engines} engine{'s' * (c.engines != 1)}" if c else ""
    row("colocated", (f"{c.gpus} ({engines})", c.gpus, "sync", c.gen_s, c.train_s, c.turn_s,
                      c.step_s) if c else (), "colocated" if both else "", choice.blocker)
    lines.append("")
    if c is not None:
        parts = ", ".join(f"{k.removeprefix('colocate/').removesuffix('_seconds')} {v:.2f}"
                          for k, v in c.parts.items())
        lines.append(f"Turns (ColocationModel; {e['colocated_state_gb_per_gpu']:.1f} GB of "
                     f"trainer state per GPU at {e['host_bandwidth_gbps']:g} GB/s, update at "
                     f"{e['update_bandwidth_gbps']:g} GB/s): sleep {c.sleep_s:.2f} s + wake "
                     f"{c.wake_s:.2f} s ({parts}).")
    why = mode_blocker(mode)
    if why and c is not None:
        what = f"compared with the split's {mode} step" if d is not None else "shown"
        lines.append(f"{why[0].upper()}{why[1:]}: its sync step is {what}.")
    if choice.ratio is not None:
        lines.append(f"Faster: {win}, by {choice.ratio:.2f}x ({min(c.step_s, d.step(mode)):.1f} "
                     f"vs {max(c.step_s, d.step(mode)):.1f} s/step).")
    elif win is not None:
        lines.append(f"Faster: {win} (the only placement possible).")
    v = e.get("verified") or {}
    if "colocated" in v:
        lines.append(f"Simulated colocated sync loop (turns included): {v['colocated']:.1f} "
                     "s/step" + (" (no teacher)." if e.get("teacher_s") is not None else "."))
    return "\n".join(lines)


def format_sweep(key: str, points: list[tuple[Any, Point]], mode: str) -> str:
    """One row per swept value: the best split's step, the colocated one's, the winner; then
    where the winner flips."""
    from rlkit.gpu_plan import flips

    first = points[0][1]
    e = first.extra
    lines = [f"Sweep of {key}, mode {mode} (colocated: sync). Engines: profile "
             f"`{first.profile.name}`, {e['gpus_per_engine']} GPU(s) each; policy {e['policy']}; "
             f"trainer GPUs in multiples of {e['train_unit']}; P_gen: mean of {e['steps']} steps "
             f"after {e['warmup']} warm-up"
             + (f"; {e['frozen_gpus']} GPUs of each budget held by frozen engine groups, "
                "the rest planned" if e.get("frozen_gpus") else "")
             + (f"; teacher {e['teacher_params'] / 1e9:.2f}B, {e['teacher_s']:.1f} s/step of "
                "scoring" if e.get("teacher_s") is not None else "") + ".", "",
             f"| {key} | best split (gen + train) | disaggregated s/step | colocated s/step | "
             "of which turns s | faster | ratio |", "|---:|---|---:|---:|---:|---|---:|"]
    for v, p in points:
        ch = p.choice
        d, c = ch.disaggregated, ch.colocated
        lines.append(
            f"| {v:g} | {f'{d.x} + {d.y}' if d else 'not possible'} | "
            f"{f'{ch.disaggregated_s:.1f}' if d else '-'} | {f'{c.step_s:.1f}' if c else '-'} | "
            f"{f'{c.turn_s:.1f}' if c else '-'} | {ch.winner or '-'} | "
            f"{f'{ch.ratio:.2f}x' if ch.ratio else '-'} |")
    lines.append("")
    changes = flips([(v, p.choice) for v, p in points])
    if changes:
        lines += [f"Flips between {key}={a:g} and {key}={b:g}: {wa} -> {wb}."
                  for a, b, wa, wb in changes]
    else:
        winners = {p.choice.winner for _, p in points}
        lines.append(f"No flip over these points: {', '.join(sorted(w or '-' for w in winners))} "
                     "at each.")
    return "\n".join(lines)
