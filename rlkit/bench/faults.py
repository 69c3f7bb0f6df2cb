"""`rlkit bench faults`: engine faults injected vs survived vs data lost, in the simulator.

On the cluster `rlkit bench suite` simulates (4 engines x 2 H100 running Qwen3-4B, profile
`h100-qwen3-4b-tp2-april`; 32 prompts x 8 responses per step; the suite's generated trace),
each policy runs the driver's sync loop (rlkit/driver/modes.py) through the real manager,
buffer and EngineMonitor (rollout.health) on simulated engines in virtual time, once per
scenario, all over the same trace:

    baseline   no fault (the monitor watches; nothing happens)
    kill       1 engine killed (its process dies: streams break, connections refused)
    hang       1 engine hung (SIGSTOP: requests never return, probes time out)
    mixed      3 faults, kill or hang
    all-down   every engine killed at once, restarts disabled: the run must stop with
               EnginesDown, every group parked with its tokens

Fault times are drawn (`--seed`) uniformly over the first 80% of the policy's baseline run, so
they land in steps, between them, during training. A lost engine is restarted `--restart-s`
(default 60 s: process start and loading a 4B model onto a GPU) after the monitor's backoff.

Per run: faults injected; engines the monitor lost (detected) and restarted; steps completed;
groups dropped; groups lost (created - accounted: in flight + partial + long + ready +
trained + dropped); tokens lost: engine-decoded tokens (SimEngines counters, every engine ever
started) - tokens accounted (responses of trained groups + of groups still in the buffer +
the buffer's discarded tokens); tokens lost in flight: what a hung engine had decoded in its
run of decode steps and never streamed (rlkit.sim.faults; no counter holds them, so they
are regenerated, not missing from "tokens lost"); requests relaunched and the tokens they kept;
time to detect (injection -> the monitor's 'lost') and to serve again (injection -> 'back' of
the restarted engine), mean and max; total virtual time / the baseline's.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from rlkit.bench.report import add_out_argument, out_folder, write_report

SCENARIOS = ("baseline", "kill", "hang", "mixed", "all-down")
DEFAULT_POLICIES = ("sync", "partial@1.5")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from rlkit.bench.suite import add_cluster_arguments
    from rlkit.sim.simulate import DEFAULT_RESTART_S
    from rlkit.rollout.config import HealthConfig

    h = HealthConfig()
    w = parser.add_argument_group("workload (as `rlkit bench suite`)")
    w.add_argument("--cap", type=int, default=8192, help="response length cap of the trace")
    w.add_argument("--trace", help="replay this trace file instead of generating one")
    w.add_argument("--batch-size", type=int, default=32, help="groups trained per step")
    w.add_argument("--group-size", type=int, default=8, help="responses per prompt")
    w.add_argument("--prompts", type=int, default=4096, help="prompts in the generated trace")
    add_cluster_arguments(parser)
    r = parser.add_argument_group("faults")
    r.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help="policy specs")
    r.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help="comma-separated, of: " + ", ".join(SCENARIOS))
    r.add_argument("--steps", type=int, default=12, help="steps per run")
    r.add_argument("--mixed", type=int, default=3, help="faults in the mixed scenario")
    r.add_argument("--seed", type=int, default=0, help="seeds the trace and the fault schedule")
    r.add_argument("--restart-s", type=float, default=DEFAULT_RESTART_S,
                   help="seconds a restarted engine takes to serve (process + model load)")
    r.add_argument("--interval", type=float, default=h.interval_s, help="probe interval, s")
    r.add_argument("--probe-timeout", type=float, default=h.probe_timeout_s)
    r.add_argument("--hung-after", type=int, default=h.hung_after_timeouts,
                   help="timed-out probes in a row that declare an engine hung")
    r.add_argument("--json", action="store_true", help="print JSON instead of the table")
    add_out_argument(r, "faults")


@dataclass
class FaultRow:
    """One run: a policy under one scenario."""

    policy: str
    scenario: str
    steps: int  # asked
    faults: list[dict[str, Any]]
    injected: int = 0
    engines_lost: int = 0
    restarted: int = 0
    steps_completed: int = 0
    outcome: str = "completed"  # or the error the run stopped with
    groups_created: int = 0
    groups_dropped: int = 0
    groups_lost: int = 0
    groups_parked: int = 0  # partial + long + ready at the end (in flight: 0 after a step)
    groups_in_flight: int = 0
    engine_tokens: int = 0
    tokens_accounted: int = 0
    tokens_lost: int = 0
    tokens_lost_in_flight: int = 0
    tokens_discarded: int = 0
    requests_relaunched: int = 0
    relaunched_tokens: int = 0
    detect_s: list[float] = field(default_factory=list)
    back_s: list[float] = field(default_factory=list)
    virtual_s: float = 0.0
    slowdown: float = float("nan")
    problems: list[str] = field(default_factory=list)  # broken invariants

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def run(args: argparse.Namespace) -> int:
    from rlkit.bench.suite import cluster_of, rollout_base
    from rlkit.rollout.config import HealthConfig
    from rlkit.sim.trace import Trace, TraceSpec, generate_trace

    out = out_folder(args.out)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if bad := [s for s in scenarios if s not in SCENARIOS]:
        raise SystemExit(f"--scenarios: unknown {', '.join(bad)} (of: {', '.join(SCENARIOS)})")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    cluster, train = cluster_of(args)
    if args.trace:
        trace = Trace.load(args.trace)
    else:
        trace = generate_trace(TraceSpec(rows=args.prompts, epochs=2, group_size=args.group_size,
                                         cap=args.cap, seed=args.seed, batch_size=args.batch_size))
    health = HealthConfig(interval_s=args.interval, probe_timeout_s=args.probe_timeout,
                          hung_after_timeouts=args.hung_after)
    bench = FaultBench(cluster, trace, train, health, args.batch_size, args.steps, args.restart_s,
                       args.seed, args.mixed, rollout_base(args.profile, cluster))
    t0 = time.perf_counter()
    rows = bench.run(policies, scenarios)
    wall = time.perf_counter() - t0
    result = {"setup": bench.describe(), "wall_s": wall, "rows": [r.to_json() for r in rows]}
    table = format_table(rows, bench.describe() + f" Simulated in {wall:.0f} s of wall time.")
    print(json.dumps(result, indent=1) if args.json else table)
    write_report(out, "faults", result, table)
    return 0


@dataclass
class FaultBench:
    cluster: Any  # SimConfig
    trace: Any  # Trace
    train: Any  # TrainTimeModel
    health: Any  # HealthConfig
    batch_size: int
    steps: int
    restart_s: float
    seed: int = 0
    mixed: int = 3
    base: Any = None  # RolloutConfig the policy specs start from

    def run(self, policies: list[str], scenarios: list[str]) -> list[FaultRow]:
        """Every scenario for every policy; the baseline first (fault times come from it)."""
        rows = []
        for policy in policies:
            base = self.run_one(policy, "baseline", [])
            horizon = 0.8 * base.virtual_s
            for scenario in scenarios:
                row = base if scenario == "baseline" else self.run_one(
                    policy, scenario, self.schedule(scenario, horizon))
                row.slowdown = row.virtual_s / base.virtual_s if base.virtual_s else float("nan")
                rows.append(row)
        return rows

    def schedule(self, scenario: str, horizon_s: float) -> list[Any]:
        from rlkit.sim.faults import Fault, random_faults

        n = self.cluster.engines
        # one seed per scenario, so adding one does not move the others' faults
        seed = self.seed * 1000 + SCENARIOS.index(scenario)
        if scenario == "kill":
            return random_faults(seed, 1, horizon_s, n, kinds=("kill",))
        if scenario == "hang":
            return random_faults(seed, 1, horizon_s, n, kinds=("hang",))
        if scenario == "mixed":
            return random_faults(seed, self.mixed, horizon_s, n)
        if scenario == "all-down":
            at = random_faults(seed, 1, horizon_s, n)[0].at_s
            return [Fault(at, "kill", 0) for _ in range(n)]  # index 0 of those not yet hit
        return []

    def run_one(self, spec: str, scenario: str, faults: list[Any]) -> FaultRow:
        from rlkit.buffers.buffer import Place, RolloutBuffer
        from rlkit.bench.suite import make_policy, make_ranker
        from rlkit.sim.simulate import run_simulation
        from rlkit.rollout.health import EnginesDown
        from rlkit.sim.harness import trace_source

        buffer = RolloutBuffer(trace_source(self.trace), n_samples_per_prompt=self.trace.group_size,
                               max_staleness=1000)
        trained = [0]
        got: dict[str, Any] = {}
        row = FaultRow(spec, scenario, self.steps, [asdict(f) for f in faults])
        # the monitor logs every loss as a warning: the table says it all
        quiet = logging.getLogger("rlkit.rollout.health")
        level, quiet.level = quiet.level, logging.ERROR
        try:
            run_simulation(
                self.cluster, self.trace, make_policy(spec, self.base), steps=self.steps,
                batch_size=self.batch_size, train=self.train, buffer=buffer, final_step=False,
                ranker=make_ranker(spec, self.trace, self.base), seed=self.seed,
                health=self.health, faults=faults,
                restart_s=None if scenario == "all-down" else self.restart_s,
                on_faults=lambda r: got.setdefault("run", r),
                on_batch=lambda _v, groups: trained.__setitem__(
                    0, trained[0] + sum(g.tokens for g in groups)),
            )
        except EnginesDown as e:
            row.outcome = f"EnginesDown: {e}"
        except Exception as e:  # noqa: BLE001 - a bench reports what broke, then goes on
            row.outcome = f"{type(e).__name__}: {e}"
        finally:
            quiet.setLevel(level)
        fr = got["run"]
        st = buffer.stats()
        held = sum(g.tokens for p in Place for g in buffer.queued(p))
        events = fr.monitor.events
        row.injected = sum(1 for i in fr.injected if i.worker is not None)
        row.engines_lost = fr.monitor.counts["lost"]
        row.restarted = fr.monitor.counts["restarted"]
        row.steps_completed = len(fr.results)
        row.groups_created = st["created"]
        row.groups_dropped = st["dropped"]
        row.groups_lost = st["created"] - (st["in_flight"] + st["partial"] + st["long"]
                                           + st["ready"] + st["trained"] + st["dropped"])
        row.groups_parked = st["partial"] + st["long"] + st["ready"]
        row.groups_in_flight = st["in_flight"]
        row.engine_tokens = sum(s.tokens for s in fr.engines.stats().values())
        row.tokens_discarded = st["discarded_tokens"]
        row.tokens_accounted = trained[0] + held + st["discarded_tokens"]
        row.tokens_lost = row.engine_tokens - row.tokens_accounted
        row.tokens_lost_in_flight = sum(i.tokens_in_flight for i in fr.injected)
        row.requests_relaunched = sum(r.requests_relaunched for r in fr.reports)
        row.relaunched_tokens = sum(r.relaunched_tokens for r in fr.reports)
        for inj in fr.injected:
            if inj.worker is None:
                continue
            lost = next((e for e in events if e["event"] == "lost" and e["worker"] == inj.worker
                         and e["t"] >= inj.t), None)
            if lost is not None:
                row.detect_s.append(lost["t"] - inj.t)
            new = next((e["worker"] for e in events if e["event"] == "restarted"
                        and e["detail"] == f"was {inj.worker}"), None)
            back = next((e for e in events if e["event"] == "back" and e["worker"] == new), None)
            if back is not None:
                row.back_s.append(back["t"] - inj.t)
        row.virtual_s = fr.ended - fr.started
        row.problems = invariants(row)
        return row

    def describe(self) -> str:
        c, p, h = self.cluster, self.cluster.profile, self.health
        return (
            f"Cluster: {c.engines} engines x {p.device}, profile `{p.name}` ({p.model}); "
            f"{self.batch_size} groups x {self.trace.group_size} responses per step, trace "
            f"`{self.trace.name}` (cap {self.trace.cap}); {self.steps} steps per run, sync mode; "
            f"trainer {self.train.params / 1e9:.2f}B params on {self.train.gpus} GPUs. "
            f"Health: probe every {h.interval_s:g} s, timeout {h.probe_timeout_s:g} s, hung after "
            f"{h.hung_after_timeouts} timeouts, restart backoff {h.restart_backoff_s:g} s, "
            f"max {h.max_restarts} restarts per engine; a restart takes {self.restart_s:g} s. "
            f"Fault times: seed {self.seed}, uniform over the first 80% of the baseline run."
        )


def invariants(row: FaultRow) -> list[str]:
    """What a run must show: nothing lost (groups, tokens), nothing dropped; every step done
    while an engine can come back; with every engine down, EnginesDown and every group parked."""
    out = []
    if row.groups_lost:
        out.append(f"{row.groups_lost} groups unaccounted")
    if row.groups_dropped:
        out.append(f"{row.groups_dropped} groups dropped")
    if row.tokens_lost:
        out.append(f"{row.tokens_lost} tokens unaccounted")
    if row.groups_in_flight:
        out.append(f"{row.groups_in_flight} groups left in flight")
    if row.scenario == "all-down":
        if not row.outcome.startswith("EnginesDown"):
            out.append(f"ended with {row.outcome.split(':')[0]}, not EnginesDown")
    elif row.steps_completed != row.steps:
        out.append(f"{row.steps_completed} of {row.steps} steps ({row.outcome.split(':')[0]})")
    return out


def _times(xs: list[float]) -> str:
    if not xs:
        return "-"
    mean = sum(xs) / len(xs)
    return f"{mean:.0f}" if len(xs) == 1 else f"{mean:.0f} ({max(xs):.0f})"


def format_table(rows: list[FaultRow], header: str = "") -> str:
    out = [header, ""] if header else []
    out += [
        "| policy | scenario | faults (kind @ s) | injected | engines lost | restarted | "
        "steps done | outcome | groups dropped | groups lost | groups parked | tokens lost | "
        "tokens lost in flight | requests relaunched | relaunched tokens (kept) | "
        "detect s | serve again s | virtual s | slowdown | invariants |",
        "|---|---|---|" + "---:|" * 16 + "---|",
    ]
    for r in rows:
        faults = ", ".join(f"{f['kind']} @ {f['at_s']:.0f}" for f in r.faults) or "-"
        # a run that stopped early has no slowdown to speak of
        slowdown = f"{r.slowdown:.2f}x" if r.steps_completed == r.steps else "-"
        if r.scenario == "all-down" and r.faults:
            faults = f"kill x{len(r.faults)} @ {r.faults[0]['at_s']:.0f}, no restart"
        out.append(
            f"| {r.policy} | {r.scenario} | {faults} | {r.injected} | {r.engines_lost} | "
            f"{r.restarted} | {r.steps_completed}/{r.steps} | {r.outcome.split(':')[0]} | "
            f"{r.groups_dropped} | {r.groups_lost} | {r.groups_parked} | {r.tokens_lost:,} | "
            f"{r.tokens_lost_in_flight:,} | {r.requests_relaunched} | {r.relaunched_tokens:,} | "
            f"{_times(r.detect_s)} | {_times(r.back_s)} | {r.virtual_s:.0f} | "
            f"{slowdown} | {'; '.join(r.problems) or 'ok'} |"
        )
    return "\n".join(out)
