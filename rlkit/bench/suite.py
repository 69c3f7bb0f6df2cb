"""`rlkit bench suite`: scheduling policies side by side on one simulated workload and cluster.

For each response-length cap, one long-tail trace (rlkit.sim.trace) is generated (a bimodal
one with `--long-share`, a multi-turn one with `--episodes`: rlkit.sim.episodes; or `--trace`
is replayed), and every policy runs the same trace through the real RolloutManager,
policies and RolloutBuffer on simulated engines in virtual time (rlkit.sim), under a
synchronous driver whose training and weight-sync times come from a TrainTimeModel. After
`--warmup` steps (so partial rollouts reach their steady state), `--steps` steps are measured:

- rollout s/step and rollout tokens/s (tokens generated / rollout time, APRIL's metric);
- trained tokens/s: response tokens of the groups completed in the step / rollout time (the
  useful work; equal to the above for sync, and on average for partial once it is steady);
- end-to-end s/step, as the driver mode's loop (rlkit/driver/modes.py, `--modes`) pays it:
  sync and stream wait for rollout, then what training is left, then the weight sync; async
  overlaps generation of the next step with training;
- idle share: engine time with no request running / (engines x rollout time);
- x bound: rollout time / the bubble-free bound of the tokens it decoded (decode tokens /
  (engines x peak tokens/s at the step's mean KV context));
- x sync bound: rollout time / sync's bound on the same trace: every policy trains the same
  batches' worth of prompts, so this is against the physical limit of the useful work (a
  policy that decodes waste, such as tail batching's restarts, pays for it here);
- % of perfect: the end-to-end speed-up over sync mode + sync policy as a share of the best a
  perfect rollout could give in sync mode, sync step / (sync bound + train + weight sync);
- mode limit: the physical limit of the row's mode, a perfect rollout at the bubble-free bound:
  sync step / (bound + train + sync) in sync and stream modes, sync step / max(bound, train +
  sync) in async mode; "% of mode limit" is the row's speed-up as a share of it;
- train hidden (stream, async): the share of training + sync time the step does not pay on
  top of its rollout, 1 - (step - rollout) / (train + sync);
  x max (async): step / max(rollout, train + sync), 1.0 when the overlap is perfect;
- resumed token share and the most policy versions in one trained sample;
- the frontier, one table per cap: every mode and policy's rollout and end-to-end speed-up and
  share of its mode limit against the lag of the tokens it trained (the share at lag 0, 1, 2,
  3+ behind the trainer's version, the largest lag) and what `--max-token-lag` restarted;
- for policies with rounds (tail batching): short- and long-round counts, mean seconds and the
  longest response trained in each, and the sync rounds adaptive tail batching fell back to.

Writes DIR/suite.md (the table), DIR/suite.png (the chart), DIR/suite.json (every step), the
traces under DIR/traces/ and a timeline per run under DIR/timelines/ (`rlkit plot timeline`).
Policies are specs of the policy list (rollout/policy_names.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkit.bench.report import add_out_argument, out_folder, write_report
from rlkit.config.modes import MODE_NAMES as MODES
from rlkit.rollout.policy_names import describe_specs

DEFAULT_POLICIES = ("sync", "partial@1.25", "partial@1.5", "partial@2.0", "tail_batching",
                    "tail_batching+resume")
DEFAULT_CAPS = (8192, 16384, 32768)


def make_policy(spec: str, base: Any = None) -> Any:
    """A registry spec ('sync', 'partial@1.5', 'tail_batching+resume', ...) -> a policy."""
    from rlkit.rollout.policies import make_policy as from_config
    from rlkit.rollout.policies.specs import policy_config

    return from_config(policy_config(spec, base))


def make_ranker(spec: str, trace: Any, base: Any = None) -> Any:
    """The length ranker a spec's recipe names (the oracle reads this trace's lengths)."""
    from rlkit.bench.ranker import ranker_for_trace
    from rlkit.rollout.policies.specs import policy_config

    return ranker_for_trace(policy_config(spec, base).ranker, trace)


def rollout_base(profile: str, cluster: Any) -> Any:
    """The rollout config every spec starts from: dispatch and adaptive sizing plan with the
    cluster's profile and batch limit (the engines' real batch)."""
    from rlkit.rollout.config import EngineModelConfig, RolloutConfig

    return RolloutConfig(engine_model=EngineModelConfig(profile=profile,
                                                        slots_per_engine=cluster.batch_limit))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workload")
    w.add_argument("--caps", default=",".join(map(str, DEFAULT_CAPS)),
                   help="response length caps, comma-separated (one trace each)")
    w.add_argument("--trace", help="replay this trace file instead of generating traces")
    w.add_argument("--batch-size", type=int, default=32, help="groups trained per step")
    w.add_argument("--group-size", type=int, default=8, help="responses per prompt")
    w.add_argument("--prompts", type=int, default=4096, help="prompts in a generated trace")
    w.add_argument("--epochs", type=int, default=2,
                   help="epochs in a generated trace (rankers that learn per prompt need the "
                   "measured steps in a second pass: --prompts small, --warmup one epoch)")
    w.add_argument("--prompt-signal", type=float, default=0.0,
                   help="how much prompt tokens say about difficulty (TraceSpec.prompt_signal; "
                   "the learned ranker needs some)")
    w.add_argument("--growth", type=float, default=0.0,
                   help="length growth per training step (generated traces)")
    w.add_argument("--long-share", type=float, default=None, metavar="SHARE",
                   help="generate bimodal traces instead (rlkit.sim.trace.bimodal_spec): this "
                   "share of the prompts long (near the cap), the rest short")
    w.add_argument("--episodes", action="store_true",
                   help="generate multi-turn (agentic) traces instead (rlkit.sim.episodes): every "
                   "sample an episode of 1-10 turns with tool calls; engines get a prefix cache")
    w.add_argument("--tool-share", type=float, default=0.6,
                   help="--episodes: share of prompts solved with tools (several turns)")
    w.add_argument("--tool-median", type=float, default=0.8,
                   help="--episodes: median seconds of a tool call (log-normal)")
    w.add_argument("--tool-sigma", type=float, default=1.0,
                   help="--episodes: log-normal sigma of tool seconds (the heavy tail)")
    w.add_argument("--seed", type=int, default=0)
    add_cluster_arguments(parser)
    r = parser.add_argument_group("run")
    r.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="policy specs, comma-separated; " + describe_specs())
    r.add_argument("--modes", default="sync",
                   help="driver modes, comma-separated (" + ", ".join(MODES) + "); every "
                   "policy runs in every mode")
    r.add_argument("--warmup", type=int, default=10, help="steps run before measuring")
    r.add_argument("--steps", type=int, default=30, help="steps measured")
    r.add_argument("--max-staleness", type=int, default=1000,
                   help="buffer staleness bound (default: unbounded, as APRIL)")
    r.add_argument("--max-token-lag", type=int, default=None, metavar="N",
                   help="rollout.max_token_lag: restart a parked sample whose oldest token would "
                   "lag more than N versions when trained (default: no bound)")
    add_out_argument(r, "suite")
    r.add_argument("--no-timelines", action="store_true", help="do not write timelines")


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """The simulated cluster and trainer (`cluster_of`), shared by the simulator benches."""
    c = parser.add_argument_group("cluster")
    c.add_argument("--profile", default="h100-qwen3-4b-tp2-april",
                   help="engine profile: a packaged name or a JSON file")
    c.add_argument("--engines", type=int, default=4, help="engines (each of the profile's GPUs)")
    c.add_argument("--router", default="round_robin", choices=["round_robin", "least_load"])
    c.add_argument("--abort-latency", type=float, default=0.2,
                   help="seconds abort_all takes once engines are idle (rlkit's client polls "
                        "/v1/loads every 0.2 s)")
    c.add_argument("--request-latency", type=float, default=0.0,
                   help="seconds from sending a request to its arrival at the engine")
    c.add_argument("--train-params", type=float, default=4.02e9, help="trained parameters")
    c.add_argument("--train-gpus", type=int, default=8, help="trainer GPUs")
    c.add_argument("--train-mfu", type=float, default=0.35)
    c.add_argument("--train-lora-params", type=float, default=0.0, metavar="N",
                   help="LoRA: the adapters' parameters (adapter sync: no base weight gradients, "
                   "N sent per sync, nothing paused; rlkit/sim/train_time.py); 0: full training")
    c.add_argument("--train-unit", type=int, default=1,
                   help="trainer GPUs per data-parallel replica (TP x PP): the step waits for "
                   "its slowest replica")
    c.add_argument("--attention-weight", type=float, default=None,
                   help="attention FLOPs per token pair over matmul FLOPs per token, pricing the "
                   "long tail's attention in training; default: the profile's own; 0: tokens alone")


def cluster_of(args: argparse.Namespace) -> tuple[Any, Any]:
    """The SimConfig and TrainTimeModel that `add_cluster_arguments`' options describe."""
    from rlkit.sim.engine import SimConfig
    from rlkit.rollout.engines.profile import load_profile
    from rlkit.sim.train_time import TrainTimeModel, attention_weight_of_profile

    cluster = SimConfig(args.engines, load_profile(args.profile), router=args.router,
                        abort_latency_s=args.abort_latency,
                        request_latency_s=args.request_latency)
    weight = (attention_weight_of_profile(cluster.profile) if args.attention_weight is None
              else args.attention_weight)
    return cluster, TrainTimeModel(params=args.train_params, gpus=args.train_gpus,
                                   mfu=args.train_mfu, attention_weight=weight,
                                   model_parallel=args.train_unit,
                                   lora_params=args.train_lora_params)


def run(args: argparse.Namespace) -> int:
    from rlkit.sim.episodes import EpisodeTraceSpec, generate_episode_trace
    from rlkit.sim.trace import Trace, TraceSpec, bimodal_spec, generate_trace

    out = out_folder(args.out)
    cluster, train = cluster_of(args)
    profile = cluster.profile
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if bad := [m for m in modes if m not in MODES]:
        raise SystemExit(f"--modes: unknown {', '.join(bad)} (modes: {', '.join(MODES)})")
    base = rollout_base(args.profile, cluster)
    for p in policies:
        try:
            make_policy(p, base)  # fail early on a bad spec
        except ValueError as e:
            raise SystemExit(f"--policies: {e}") from None
    if args.episodes and args.long_share is not None:
        raise SystemExit("--episodes and --long-share generate different traces: choose one")
    if args.trace:
        traces = [Trace.load(args.trace)]
    else:
        traces = []
        for cap in (int(c) for c in args.caps.split(",")):
            kw = dict(rows=args.prompts, epochs=args.epochs, group_size=args.group_size, cap=cap,
                      seed=args.seed, batch_size=args.batch_size, prompt_signal=args.prompt_signal)
            if args.episodes:
                trace = generate_episode_trace(EpisodeTraceSpec(
                    **kw, tool_share=args.tool_share, tool_median_s=args.tool_median,
                    tool_sigma=args.tool_sigma))
            else:
                kw["growth_per_step"] = args.growth
                trace = generate_trace(TraceSpec(**kw) if args.long_share is None
                                       else bimodal_spec(args.long_share, **kw))
            trace.save(out / "traces" / f"trace-cap{cap}.jsonl")
            traces.append(trace)
    if any(t.multi_turn for t in traces):  # each turn resends the episode: SGLang's radix cache
        cluster = dataclasses.replace(cluster, prefix_cache=True)
    suite = SuiteSpec(cluster, train, args.batch_size, args.warmup, args.steps,
                      args.max_staleness, args.seed, base, args.max_token_lag)
    t0 = time.perf_counter()
    rows = run_suite(suite, traces, policies,
                     timelines=None if args.no_timelines else out / "timelines", modes=modes)
    wall = time.perf_counter() - t0
    table = format_table(rows, describe(suite, traces, wall)) + "\n\n" + format_frontier(rows)
    plot_suite(rows, out / "suite.png", title=f"{profile.name} x {cluster.engines}, "
               f"{args.batch_size} groups x {traces[0].group_size}")
    print(table)
    sync = baselines(rows)
    write_report(out, "suite", [r.to_json(sync.get(r.cap)) for r in rows], table)
    return 0


@dataclass(frozen=True)
class SuiteSpec:
    cluster: Any  # SimConfig
    train: Any  # TrainTimeModel
    batch_size: int
    warmup: int
    steps: int
    max_staleness: int = 1000
    seed: int = 0
    base: Any = None  # RolloutConfig the specs start from (rollout_base)
    max_token_lag: int | None = None  # rollout.max_token_lag (None: no bound)


@dataclass
class SuiteRow:
    cap: int
    policy: str
    steps: list[Any]  # SimulatedStep of the measured steps
    mode: str = "sync"

    def _sum(self, field: str) -> float:
        return sum(getattr(s, field) for s in self.steps)

    @property
    def rollout_s(self) -> float:
        return self._sum("rollout_s") / len(self.steps)

    @property
    def throughput(self) -> float:
        return self._sum("tokens_generated") / self._sum("rollout_s")

    @property
    def trained_throughput(self) -> float:
        return self._sum("tokens_in_batch") / self._sum("rollout_s")

    @property
    def step_s(self) -> float:
        return self._sum("step_s") / len(self.steps)

    @property
    def idle_share(self) -> float:  # time-weighted over the measured steps
        return sum(s.idle_share * s.rollout_s for s in self.steps) / self._sum("rollout_s")

    @property
    def bound_ratio(self) -> float:
        return self._sum("rollout_s") / self._sum("bound_s")

    @property
    def bound_s(self) -> float:
        return self._sum("bound_s") / len(self.steps)

    @property
    def overhead_s(self) -> float:
        """Mean training + weight-sync seconds per step."""
        return (self._sum("train_s") + self._sum("sync_s")) / len(self.steps)

    def sync_bound_ratio(self, sync: "SuiteRow") -> float:
        return self.rollout_s / sync.bound_s

    def perfect_share(self, sync: "SuiteRow") -> float:
        """End-to-end speed-up over sync / the best a bubble-free rollout could give."""
        return (sync.bound_s + sync.overhead_s) / self.step_s

    def mode_limit(self, sync: "SuiteRow") -> float:
        """The most this row's mode allows over sync: a perfect rollout at the bubble-free
        bound, with training and sync after it (sync, stream) or overlapped (async)."""
        if self.mode == "async":
            return sync.step_s / max(sync.bound_s, sync.overhead_s)
        return sync.step_s / (sync.bound_s + sync.overhead_s)

    @property
    def train_hidden(self) -> float:
        """Share of training + sync time the step does not pay on top of its rollout: 0 in
        sync mode (step = rollout + train + sync), what streaming overlapped in stream mode,
        up to all of it in async mode (step = max(rollout, train + sync))."""
        overhead = self._sum("train_s") + self._sum("sync_s")
        exposed = self._sum("step_s") - self._sum("rollout_s")
        return min(1.0, max(0.0, 1.0 - exposed / max(1e-9, overhead)))

    @property
    def overlap_ratio(self) -> float:
        """Step / max(rollout, train + sync): 1.0 is a perfect overlap (async's target <= 1.1)."""
        return self.step_s / max(self.rollout_s, self.overhead_s)

    def rounds(self) -> dict[str, dict[str, float]]:
        """Per round kind (short, long): steps, mean rollout s, longest response trained."""
        out = {}
        for kind in sorted({s.round for s in self.steps if s.round}):
            steps = [s for s in self.steps if s.round == kind]
            out[kind] = {"steps": len(steps),
                         "rollout_s": statistics.mean(s.rollout_s for s in steps),
                         "max_response_length": max(s.max_response_length for s in steps)}
        return out

    @property
    def resumed_share(self) -> float:
        return sum(s.resumed_token_share * s.tokens_generated for s in self.steps) / max(
            1.0, self._sum("tokens_generated"))

    @property
    def max_versions(self) -> int:
        return max(s.max_versions_per_sample for s in self.steps)

    @property
    def recall20(self) -> float:
        got = [s.ranker_recall["recall@20"] for s in self.steps if s.ranker_recall]
        return sum(got) / len(got) if got else math.nan

    @property
    def turns_recall20(self) -> float:
        got = [s.ranker_turns_recall["recall@20"] for s in self.steps if s.ranker_turns_recall]
        return sum(got) / len(got) if got else math.nan

    @property
    def lag_tokens(self) -> list[int]:
        """Trained tokens at lag 0, 1, 2, 3+ over the measured steps."""
        return [sum(t) for t in zip(*(s.trained_lag_tokens for s in self.steps))]

    @property
    def lag_shares(self) -> list[float]:
        counts = self.lag_tokens
        total = sum(counts)
        return [n / total if total else 0.0 for n in counts]

    @property
    def max_lag(self) -> int:
        """The most versions any trained token lagged behind the trainer."""
        return max(s.trained_max_lag for s in self.steps)

    @property
    def lag_restarts(self) -> float:
        """Samples restarted by rollout.max_token_lag, per step."""
        return self._sum("lag_restarts") / len(self.steps)

    @property
    def lag_restart_share(self) -> float:
        """Their discarded tokens, as a share of the tokens generated."""
        return self._sum("lag_restart_tokens") / max(1.0, self._sum("tokens_generated"))

    def speedup(self, sync: "SuiteRow") -> float:
        """End-to-end speed-up over sync mode + sync policy."""
        return sync.step_s / self.step_s

    def of_mode_limit(self, sync: "SuiteRow") -> float:
        return self.speedup(sync) / self.mode_limit(sync)

    @property
    def parked_groups(self) -> float:
        """Groups carried over per step (partial rollouts' parked work)."""
        return self._sum("groups_carried_over") / len(self.steps)

    def to_json(self, sync: "SuiteRow | None" = None) -> dict[str, Any]:
        """Every figure; those against the baseline (sync mode + sync policy on the same
        trace) when it is given."""
        versus = {} if sync is None else {
            "rollout_speedup": sync.rollout_s / self.rollout_s, "speedup": self.speedup(sync),
            "mode_limit": self.mode_limit(sync), "of_mode_limit": self.of_mode_limit(sync)}
        return {**versus, "trained_lag_shares": dict(zip(LAG_LABELS, self.lag_shares)),
                "trained_max_lag": self.max_lag, "lag_restarts_per_step": self.lag_restarts,
                "lag_restart_share": self.lag_restart_share, "cap": self.cap, "mode": self.mode, "policy": self.policy, "rollout_s": self.rollout_s,
                "throughput": self.throughput, "trained_throughput": self.trained_throughput,
                "step_s": self.step_s,
                "idle_share": self.idle_share, "bound_ratio": self.bound_ratio,
                "resumed_share": self.resumed_share, "max_versions": self.max_versions,
                "bound_s": self.bound_s, "rounds": self.rounds(), "recall20": self.recall20,
                "turns_recall20": self.turns_recall20,
                "parked_groups": self.parked_groups, "train_hidden": self.train_hidden,
                "overlap_ratio": self.overlap_ratio,
                "steps": [s.to_json() for s in self.steps]}


def run_suite(suite: SuiteSpec, traces: list[Any], policies: list[str],
              timelines: Path | None = None, modes: list[str] = ("sync",)) -> list[SuiteRow]:
    """Every policy in every mode on every trace; rows in (trace, mode, policy) order."""
    from rlkit.sim.simulate import run_simulation

    rows = []
    for trace, mode, spec in ((t, m, p) for t in traces for m in modes for p in policies):
        tl = None
        if timelines is not None:
            name = f"cap{trace.cap}-{spec.replace('@', '-')}" + ("" if mode == "sync" else f"-{mode}")
            tl = timelines / name / "timeline.jsonl"
            tl.unlink(missing_ok=True)
        results = run_simulation(
            suite.cluster, trace, make_policy(spec, suite.base),
            steps=suite.warmup + suite.steps, batch_size=suite.batch_size, train=suite.train,
            max_staleness=suite.max_staleness, max_token_lag=suite.max_token_lag,
            timeline_path=tl, seed=suite.seed,
            final_step=False,  # the steady state: no drain of tail batching's queue
            ranker=make_ranker(spec, trace, suite.base), mode=mode,
        )
        rows.append(SuiteRow(trace.cap, spec, results[suite.warmup:], mode))
    return rows


def describe(suite: SuiteSpec, traces: list[Any], wall_s: float) -> str:
    c, p, t = suite.cluster, suite.cluster.profile, suite.train
    lines = [
        f"Cluster: {c.engines} engines x {p.device}, profile `{p.name}` ({p.model}); "
        f"KV capacity {c.capacity or 'unlimited'} tokens/engine, batch limit {c.batch_limit}, "
        f"router {c.router}; abort latency {c.abort_latency_s:g} s, request latency "
        f"{c.request_latency_s:g} s.",
        f"Workload: {suite.batch_size} groups x {traces[0].group_size} responses per step; "
        + "; ".join(f"trace `{tr.name}` (cap {tr.cap})" for tr in traces) + ".",
        *(_episodes_line(tr) for tr in traces if tr.multi_turn),
        f"Trainer: {t.params / 1e9:.2f}B params on {t.gpus} GPUs ({t.dp} data-parallel "
        f"replicas) at MFU {t.mfu:g} ({t.tokens_per_s:,.0f} tokens/s), attention weight "
        f"{t.attention_weight:.3g} per token, weight sync {t.sync_s():.1f} s.",
        f"Steps: {suite.warmup} warm-up, {suite.steps} measured (means over measured steps); "
        f"max staleness {suite.max_staleness}; max token lag "
        f"{'none' if suite.max_token_lag is None else suite.max_token_lag}; seed {suite.seed}. "
        f"Simulated in {wall_s:.0f} s of wall time.",
    ]
    return "\n".join(lines)


def _episodes_line(trace: Any) -> str:
    from rlkit.sim.episodes import episode_stats

    e = episode_stats(trace)
    return (f"Episodes (cap {trace.cap}): {e['turns_mean']:.1f} model turns on average (P90 "
            f"{e['turns_p90']:.0f}, max {e['turns_max']:.0f}), {e['tokens_mean']:,.0f} tokens (P99 "
            f"{e['tokens_p99']:,.0f}, {e['cap_fraction']:.1%} at the cap); a tool call takes "
            f"{e['tool_call_s_median']:.2f} s median, {e['tool_call_s_p99']:.1f} s P99, "
            f"{e['tool_s_per_episode_mean']:.1f} s per episode on average; engines with a prefix "
            "cache (cache-aware routing).")


def baselines(rows: list[SuiteRow]) -> dict[int, SuiteRow]:
    """The baseline of every row, by cap: sync mode with the sync policy, on the same trace."""
    return {r.cap: r for r in rows if r.policy == "sync" and r.mode == "sync"}


def format_table(rows: list[SuiteRow], header: str = "") -> str:
    sync = baselines(rows)
    out = [header, ""] if header else []
    out += [
        "| cap | mode | policy | rollout s/step | rollout speed-up | rollout tok/s | vs sync | "
        "trained tok/s | end-to-end s/step | e2e speed-up | % of perfect | mode limit | "
        "% of mode limit | train hidden | x max | idle share | "
        "x bound | x sync bound | resumed tokens | max versions | parked groups | ranker recall@20 |",
        "|---:|---|---|" + "---:|" * 19,
    ]
    for r in rows:
        base = sync.get(r.cap)
        gain = f"{r.throughput / base.throughput - 1:+.0%}" if base else "-"
        rollout = f"{base.rollout_s / r.rollout_s:.2f}x" if base else "-"
        speed = f"{base.step_s / r.step_s:.2f}x" if base else "-"
        perfect = f"{r.perfect_share(base):.0%}" if base else "-"
        limit = f"{r.mode_limit(base):.2f}x" if base else "-"
        of_limit = f"{base.step_s / r.step_s / r.mode_limit(base):.0%}" if base else "-"
        hidden = "-" if r.mode == "sync" else f"{r.train_hidden:.0%}"
        x_max = f"{r.overlap_ratio:.2f}" if r.mode == "async" else "-"
        vs_bound = f"{r.sync_bound_ratio(base):.2f}" if base else "-"
        out.append(
            f"| {r.cap // 1024}k | {r.mode} | {r.policy} | {r.rollout_s:.1f} | {rollout} | "
            f"{r.throughput:,.0f} | {gain} | {r.trained_throughput:,.0f} | {r.step_s:.1f} | "
            f"{speed} | {perfect} | {limit} | {of_limit} | {hidden} | {x_max} | {r.idle_share:.1%} | {r.bound_ratio:.2f} | {vs_bound} | "
            f"{r.resumed_share:.0%} | {r.max_versions} | {r.parked_groups:.1f} | "
            f"{_recall(r)} |"
        )
    rounded = [r for r in rows if r.rounds()]
    if rounded:
        out += [
            "",
            "Rounds (policies that have them), over the measured steps:",
            "",
            "| cap | policy | short rounds | short s (mean) | longest short-round response | "
            "long rounds | long s (mean) | longest long-round response | long share | "
            "sync rounds (adaptive fallback) | sync s/step | longest sync response |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rounded:
            rd, base = r.rounds(), sync.get(r.cap)
            sh, lo = rd.get("short", {}), rd.get("long", {})
            n = sum(v["steps"] for v in rd.values())
            longest_sync = max(s.max_response_length for s in base.steps) if base else 0
            out.append(
                f"| {r.cap // 1024}k | {r.mode} {r.policy} | {sh.get('steps', 0)} | "
                f"{sh.get('rollout_s', 0):.1f} | {sh.get('max_response_length', 0):,} | "
                f"{lo.get('steps', 0)} | {lo.get('rollout_s', 0):.1f} | "
                f"{lo.get('max_response_length', 0):,} | {lo.get('steps', 0) / n:.0%} | "
                f"{rd.get('sync', {}).get('steps', 0)} | "
                f"{base.rollout_s if base else 0:.1f} | {longest_sync:,} |"
            )
    return "\n".join(out)


def _recall(r: SuiteRow) -> str:
    """Recall@20 of lengths, and of turns after a slash in multi-turn runs."""
    out = "-" if math.isnan(r.recall20) else f"{r.recall20:.2f}"
    return out if math.isnan(r.turns_recall20) else f"{out} / {r.turns_recall20:.2f} turns"


def plot_suite(rows: list[SuiteRow], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    caps = sorted({r.cap for r in rows})
    label = (lambda r: r.policy) if {r.mode for r in rows} == {"sync"} else (
        lambda r: f"{r.mode} {r.policy}")
    policies = list(dict.fromkeys(label(r) for r in rows))
    by = {(r.cap, label(r)): r for r in rows}
    metrics = [
        ("rollout tokens/s", lambda r: r.throughput),
        ("end-to-end s/step", lambda r: r.step_s),
        ("idle share of engine time", lambda r: r.idle_share),
        ("rollout time / bubble-free bound", lambda r: r.bound_ratio),
    ]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.8))
    x = np.arange(len(caps))
    width = 0.8 / max(1, len(policies))
    for ax, (label, fn) in zip(axes, metrics):
        for i, pol in enumerate(policies):
            vals = [fn(by[(c, pol)]) if (c, pol) in by else math.nan for c in caps]
            ax.bar(x + (i - (len(policies) - 1) / 2) * width, vals, width, label=pol)
        ax.set_xticks(x, [f"{c // 1024}k cap" for c in caps])
        ax.set_title(label, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


LAG_LABELS = ("lag0", "lag1", "lag2", "lag3plus")
FRONTIER_LAG = 2  # the target's bound: no trained token more than 2 versions behind


def format_frontier(rows: list[SuiteRow]) -> str:
    """Speed against staleness, one table per cap: every mode and policy's speed-ups and share
    of its mode limit beside the lag of the tokens it trained; under each table, each mode's
    best share of its limit overall and with no trained token over FRONTIER_LAG versions."""
    sync = baselines(rows)
    out = ["Frontier: speed against the lag of the trained tokens (trainer version - token "
           "version), over the measured steps."]
    for cap in sorted({r.cap for r in rows}):
        base = sync.get(cap)
        if base is None:
            continue
        at = [r for r in rows if r.cap == cap]
        out += [
            "", f"Cap {cap // 1024}k:", "",
            "| mode | policy | rollout speed-up | e2e speed-up | % of mode limit | lag 0 | lag 1 | "
            "lag 2 | lag 3+ | max lag | lag restarts/step | restarted tokens |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in at:
            shares = " | ".join(f"{x:.0%}" for x in r.lag_shares)
            out.append(
                f"| {r.mode} | {r.policy} | {base.rollout_s / r.rollout_s:.2f}x | "
                f"{r.speedup(base):.2f}x | {r.of_mode_limit(base):.0%} | {shares} | {r.max_lag} | "
                f"{r.lag_restarts:.1f} | {r.lag_restart_share:.1%} |")
        out.append("")
        for mode in dict.fromkeys(r.mode for r in at):
            mine = [r for r in at if r.mode == mode]
            best = max(mine, key=lambda r: r.of_mode_limit(base))
            bounded = [r for r in mine if r.max_lag <= FRONTIER_LAG]
            line = (f"- {mode}: best {best.policy} at {best.of_mode_limit(base):.0%} of its mode "
                    f"limit (max lag {best.max_lag})")
            if bounded:
                b = max(bounded, key=lambda r: r.of_mode_limit(base))
                line += (f"; with no trained token over {FRONTIER_LAG} versions behind: "
                         f"{b.policy} at {b.of_mode_limit(base):.0%}")
            else:
                line += f"; none keeps every trained token within {FRONTIER_LAG} versions"
            out.append(line)
    return "\n".join(out)
