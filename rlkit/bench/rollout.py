"""`rlkit bench rollout --policy sync,partial,tail_batching`: rollout speed of scheduling
policies on the real engines (router + built-in engine servers), side by side in one run.

Every policy gets its own RolloutBuffer over the same prompts, and the same long-tail length
trace (generated, or `--trace FILE` in the format `rlkit bench suite --trace` reads) is
replayed through `ignore_eos` (rlkit.sim.replay), so each response is exactly as long under
every policy: the policies differ only in how they schedule the same work. Steps of the
policies alternate (sync step 1, partial step 1, sync step 2, ...) so a change in machine load
hits them alike. Policies are registry specs (`partial@1.5`, `tail_batching+resume`, ...).

Reported per policy: mean rollout seconds per step (each step trains batch_size groups, so
this is the time for the same useful work) and its ratio to the first policy; rollout
tokens/s (tokens generated / rollout wall time, APRIL's measure; it counts waste such as
tail batching's restarted and speculative tokens); trained tokens/s (response tokens of the
completed groups / rollout time); and, for policies with rounds, short- and long-round times.
Measure tail batching over whole cycles of short and long rounds (`--steps` a multiple of
the cycle: 5 at eta 1.25).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

from rlkit.bench.report import add_out_argument, out_folder, write_report
from rlkit.rollout.policy_names import describe_specs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", default="sync,partial",
                        help="comma-separated policy specs; the first is the baseline. "
                        + describe_specs())
    parser.add_argument("--model", default="tiny", help="demo model name or HF folder")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="groups per step")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--cap", type=int, default=1024,
                        help="max_new_tokens (trace cap); short caps make steps so brief that "
                        "fixed costs (abort round trips) dominate")
    parser.add_argument("--over-provision", type=float, default=2.0,
                        help="partial's over-provision when a spec gives none")
    parser.add_argument("--tail-fixed", action="store_true",
                        help="tail batching specs run the paper's fixed eta_prompts "
                        "(rollout.tail_batching.adaptive=false; results recorded without this "
                        "option in their config predate adaptive sizing and ran so)")
    parser.add_argument("--steps", type=int, default=6, help="steps per policy")
    parser.add_argument("--rows", type=int, default=0,
                        help="prompts in the generated trace; 0: enough that none repeats. A "
                        "ranker that learns per prompt (history) needs repeats: rows small and "
                        "--warmup-steps one epoch (rows / batch size)")
    parser.add_argument("--warmup-steps", type=int, default=1, help="steps per policy not counted")
    parser.add_argument("--p-hard", type=float, default=0.15, help="share of long-tail prompts")
    parser.add_argument("--easy-frac", type=float, default=0.08,
                        help="median length of ordinary prompts, as a fraction of the cap")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", help="replay this trace (jsonl, as `rlkit bench suite "
                        "--trace` reads) instead of generating one; its cap and group size "
                        "replace --cap and --n")
    parser.add_argument("--trace-out", help="also write the trace (jsonl) here")
    parser.add_argument(
        "--simulate", nargs="?", const="auto", metavar="PROFILE",
        help="also run the same trace on simulated engines with this engine profile (a file or "
        "a packaged name; default: the measured docs/profiles/<device>-<model>-t1.json, device "
        "cpu or the GPU's model, e.g. h100) and report both partial/sync ratios (the "
        "simulator's validation)",
    )
    add_out_argument(parser, "rollout")


def run(args: argparse.Namespace) -> int:
    out = out_folder(args.out)  # a bad folder, spec or trace fails before any engine starts
    specs = policy_specs(args)
    if args.trace:
        from rlkit.sim.trace import Trace

        trace = Trace.load(args.trace)
        args.cap, args.n = trace.cap, trace.group_size
        check_trace_slots(trace, specs)
    result = asyncio.run(bench_rollout(args))
    if args.simulate:
        result["simulated"] = simulate_same(args, result)
    table = format_table(result)
    print(table)
    write_report(out, "rollout", result, table)
    return 0


def policy_specs(args: argparse.Namespace) -> dict[str, Any]:
    """spec -> RolloutConfig for each --policy entry (partial's default from --over-provision)."""
    from rlkit.rollout.config import (
        EngineModelConfig, PartialConfig, RolloutConfig, TailBatchingConfig,
    )
    from rlkit.rollout.policies import PolicySpecError
    from rlkit.rollout.policies.specs import policy_config

    profile = _profile_path(args.model)
    base = RolloutConfig(partial=PartialConfig(over_provision=args.over_provision),
                         batch_size=args.batch_size, n_samples_per_prompt=args.n,
                         engine_model=EngineModelConfig(
                             profile=str(profile) if profile.is_file() else None,
                             slots_per_engine=ENGINE_SLOTS),
                         tail_batching=TailBatchingConfig(
                             adaptive=not getattr(args, "tail_fixed", False)))
    specs = [p.strip() for p in args.policy.split(",") if p.strip()]
    try:
        return {spec: policy_config(spec, base) for spec in specs}
    except PolicySpecError as e:
        raise SystemExit(f"--policy: {e}") from None


def check_trace_slots(trace: Any, specs: dict[str, Any]) -> None:
    """Speculative responses need response slots in the trace: say so before engines start."""
    for spec, cfg in specs.items():
        responses = trace.group_size
        if cfg.policy == "tail_batching":
            responses = math.ceil(cfg.tail_batching.eta_responses * trace.group_size)
        if responses > trace.slots:
            raise SystemExit(f"--trace: {spec} launches {responses} responses per prompt but the "
                             f"trace has {trace.slots} slots per prompt")


def make_trace(args: argparse.Namespace) -> Any:
    """The bench's trace (`--trace`, or generated with prompts to spare for every policy's
    steps); the real and the simulated runs replay the same one."""
    from rlkit.sim.trace import Trace, TraceSpec, generate_trace

    if getattr(args, "trace", None):
        return Trace.load(args.trace)

    rows = getattr(args, "rows", 0) or max(64, args.batch_size * (args.steps + args.warmup_steps) * 3)
    epochs = max(4, 3 * args.batch_size * (args.steps + args.warmup_steps) // rows + 2)
    spec = TraceSpec(
        rows=rows, epochs=epochs,
        group_size=args.n, cap=args.cap, seed=args.seed, batch_size=args.batch_size,
        p_hard=args.p_hard, easy_median_frac=args.easy_frac,
        prompt_median=24, prompt_min=8, prompt_max=64,
    )
    return generate_trace(spec)


async def bench_rollout(args: argparse.Namespace) -> dict[str, Any]:
    from rlkit.buffers import ListPromptSource, PromptRecord, RolloutBuffer
    from rlkit.bench.ranker import ranker_for_trace
    from rlkit.rollout.demo_models import resolve_model_path
    from rlkit.rollout.config import SamplingConfig
    from rlkit.rollout.engines.config import EngineConfig, RouterConfig
    from rlkit.rollout.engines.fleet import EngineFleet
    from rlkit.rollout.manager import RolloutManager, batch_target
    from rlkit.rollout.policies import make_policy
    from rlkit.rollout.reward_scheduler import RewardScheduler
    from rlkit.sim.replay import BufferPrompts, TraceReplayEngines

    specs = policy_specs(args)
    model_path = resolve_model_path(args.model)
    vocab = _vocab_size(model_path)
    trace = make_trace(args)
    if args.trace_out:
        trace.save(args.trace_out)
    rng = random.Random(args.seed)
    records = [
        PromptRecord(ids=tuple(rng.randrange(3, vocab) for _ in range(trace.records[(i, 0)].prompt_len)),
                     text="", source_index=i)
        for i in range(trace.rows)
    ]
    sampling = SamplingConfig(max_new_tokens=args.cap, temperature=1.0)

    async def score(sample, group) -> float:
        return 0.0

    engine_cfg = EngineConfig(num_engines=args.engines, max_running_requests=ENGINE_SLOTS)
    with EngineFleet(model_path, engine_cfg, RouterConfig()) as fleet:
        async with fleet.client() as client:
            runs = {}
            for name, cfg in specs.items():
                buf = RolloutBuffer(ListPromptSource(records, seed=args.seed),
                                    n_samples_per_prompt=args.n, max_staleness=1000)
                engines = TraceReplayEngines(client, trace, BufferPrompts(buf))
                ranker = ranker_for_trace(cfg.ranker, trace)
                runs[name] = (buf, RolloutManager(buf, engines, make_policy(cfg), sampling,
                                                  RewardScheduler(score), ranker=ranker))
            steps: dict[str, list[dict[str, Any]]] = {p: [] for p in specs}
            for step in range(args.warmup_steps + args.steps):
                for name, (buf, manager) in runs.items():
                    # no training: the version is the step, as if each step's weights were new
                    report = await manager.run_step(batch_target(buf, args.batch_size),
                                                    version=step)
                    buf.take_nowait(args.batch_size)
                    buf.set_version(step + 1)
                    if step >= args.warmup_steps:
                        steps[name].append(step_row(report))
    return summarise(steps, vars(args), trace)


def step_row(report: Any) -> dict[str, Any]:
    """What the bench keeps of one StepReport."""
    return {
        "seconds": report.seconds, "tokens": report.tokens_generated,
        "trained_tokens": report.tokens_in_batch, "completed": len(report.completed),
        "round": report.round, "max_response_length": report.max_response_length,
        "resumed_token_share": report.resumed_token_share,
        "carried_over": report.groups_carried_over, "discarded": report.tokens_discarded,
    }


def simulate_same(args: argparse.Namespace, real: dict[str, Any]) -> dict[str, Any]:
    """The same trace, policies and step counts on simulated engines (virtual time)."""
    from rlkit.bench.ranker import ranker_for_trace
    from rlkit.rollout.policies import make_policy
    from rlkit.sim.engine import SimConfig
    from rlkit.sim.simulate import run_simulation
    from rlkit.rollout.engines.profile import load_profile

    profile_path = args.simulate
    if profile_path == "auto":
        profile_path = str(_profile_path(args.model))
    trace = make_trace(args)
    # The hf engine keeps a left-padded KV cache (every row reads the longest row's context)
    # and pads its prefill forwards; the profile's "serving" object adds what
    # `python -m rlkit.sim.measure_hf` measured around the engines: the cores they share
    # with the HTTP processes, router and client, CPU per streamed chunk, request and control
    # round trips, the client's abort poll (docs/simulation.md, "Validation").
    cluster = SimConfig.from_profile(args.engines, load_profile(profile_path), kv_layout="padded",
                                     max_running_requests=256)
    out: dict[str, Any] = {"profile": profile_path, "policies": {}}
    specs = policy_specs(args)
    for name in real["policies"]:
        steps = run_simulation(cluster, trace, make_policy(specs[name]),
                               steps=args.warmup_steps + args.steps, batch_size=args.batch_size,
                               max_new_tokens=args.cap, final_step=False,
                               ranker=ranker_for_trace(specs[name].ranker, trace))[args.warmup_steps:]
        seconds = sum(s.rollout_s for s in steps)
        tokens = sum(s.tokens_generated for s in steps)
        out["policies"][name] = {"throughput_tok_s": tokens / seconds if seconds else 0.0,
                                 "rollout_s_per_step": seconds / len(steps) if steps else 0.0}
    names = list(out["policies"])
    if len(names) >= 2:
        sim = out["policies"][names[1]]["throughput_tok_s"] / out["policies"][names[0]]["throughput_tok_s"]
        meas = real["policies"][names[1]]["ratio_to_first"]
        out["ratio"], out["measured_ratio"] = sim, meas
        out["deviation"] = sim / meas - 1.0
        # every later policy against the first: tokens/s ratio and rollout s/step speed-up
        first_sim = out["policies"][names[0]]
        out["ratios"] = {}
        for name in names[1:]:
            ps, pr = out["policies"][name], real["policies"][name]
            tok = ps["throughput_tok_s"] / first_sim["throughput_tok_s"]
            spd = first_sim["rollout_s_per_step"] / ps["rollout_s_per_step"] if ps["rollout_s_per_step"] else 0.0
            out["ratios"][name] = {
                "tok_s_simulated": tok, "tok_s_measured": pr["ratio_to_first"],
                "tok_s_deviation": tok / pr["ratio_to_first"] - 1.0 if pr["ratio_to_first"] else 0.0,
                "speedup_simulated": spd, "speedup_measured": pr["speedup_vs_first"],
                "speedup_deviation": spd / pr["speedup_vs_first"] - 1.0 if pr["speedup_vs_first"] else 0.0,
            }
    return out


def summarise(steps: dict[str, list[dict[str, Any]]], args: dict[str, Any], trace: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"config": {k: v for k, v in args.items() if not callable(v)},
                           "trace": trace.name, "policies": {}}
    base_tput = base_step = None
    for name, rows in steps.items():
        seconds = sum(r["seconds"] for r in rows)
        tokens = sum(r["tokens"] for r in rows)
        tput = tokens / seconds if seconds else 0.0
        step_s = seconds / len(rows) if rows else 0.0
        base_tput = base_tput if base_tput is not None else tput
        base_step = base_step if base_step is not None else step_s
        rounds = {kind: [r for r in rows if r.get("round") == kind]
                  for kind in ("short", "long", "sync")}  # sync: adaptive tail batching's fallback
        out["policies"][name] = {
            "steps": len(rows),
            "groups": sum(r["completed"] for r in rows),
            "rollout_s": seconds,
            "rollout_s_per_step": step_s,
            "speedup_vs_first": base_step / step_s if step_s else 0.0,
            "tokens": tokens,
            "throughput_tok_s": tput,
            "trained_tok_s": sum(r["trained_tokens"] for r in rows) / seconds if seconds else 0.0,
            "ratio_to_first": tput / base_tput if base_tput else 0.0,
            "step_s_median": statistics.median(r["seconds"] for r in rows) if rows else 0.0,
            "resumed_token_share": statistics.mean(r["resumed_token_share"] for r in rows) if rows else 0.0,
            "tokens_discarded": sum(r["discarded"] for r in rows),
            "per_step": rows,
            "rounds": {
                kind: {"steps": len(rs),
                       "seconds_mean": statistics.mean(r["seconds"] for r in rs) if rs else 0.0,
                       "max_response_length": max((r["max_response_length"] for r in rs), default=0)}
                for kind, rs in rounds.items() if rs
            },
        }
    return out


def format_table(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = [
        f"rollout bench: model {c['model']}, {c['engines']} engines, {c['batch_size']} groups x "
        f"{c['n']} per step, cap {c['cap']}, {c['steps']} steps per policy "
        f"(+{c['warmup_steps']} warm-up), trace {r['trace']}; speed-up = first policy's rollout "
        "s/step / this one's (same trained work per step)",
        "",
        "| policy | steps | rollout s/step | speed-up | tokens | tok/s | vs first | trained tok/s "
        "| resumed share | discarded | short rounds | long rounds |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, p in r["policies"].items():
        rounds = {k: f"{v['steps']} x {v['seconds_mean']:.2f} s (max len {v['max_response_length']})"
                  for k, v in p.get("rounds", {}).items()}
        lines.append(
            f"| {name} | {p['steps']} | {p['rollout_s_per_step']:.2f} | "
            f"{p['speedup_vs_first']:.2f}x | {p['tokens']:,} | {p['throughput_tok_s']:,.0f} | "
            f"{p['ratio_to_first']:.2f}x | {p['trained_tok_s']:,.0f} | "
            f"{p['resumed_token_share']:.0%} | {p['tokens_discarded']:,} | "
            f"{rounds.get('short', '-')} | {rounds.get('long', '-')} |"
        )
    sim = r.get("simulated")
    if sim and "ratio" in sim:
        names = list(sim["policies"])
        lines += [
            "",
            f"simulated on the same trace ({sim['profile']}): {names[1]}/{names[0]} = "
            f"{sim['ratio']:.2f}x vs measured {sim['measured_ratio']:.2f}x "
            f"({sim['deviation']:+.0%}; the simulator's validation criterion is within 10%)",
        ]
        for name, v in sim.get("ratios", {}).items():
            lines.append(
                f"  {name} vs {names[0]}: tok/s {v['tok_s_simulated']:.2f}x simulated / "
                f"{v['tok_s_measured']:.2f}x measured ({v['tok_s_deviation']:+.1%}); s/step speed-up "
                f"{v['speedup_simulated']:.2f}x / {v['speedup_measured']:.2f}x "
                f"({v['speedup_deviation']:+.1%})")
    return "\n".join(lines)


ENGINE_SLOTS = 256  # max_running_requests of the bench's engines (and the dispatcher's slots)


def _profile_path(model: str) -> Path:
    """The measured profile of a demo model on this machine's device (docs/profiles:
    cpu-<model>-t1.json, or h100-<model>-t1.json etc. where the engines run on a GPU), used by
    the dispatcher's cost model and the simulated side."""
    from rlkit.bench.engine import device_tag

    return Path(__file__).resolve().parents[2] / "docs" / "profiles" / f"{device_tag()}-{model}-t1.json"


def _vocab_size(model_path: str) -> int:
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return int(cfg["vocab_size"])
