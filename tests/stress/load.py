"""Stress tests of the data plane and the engines under load, with their invariants checked.

Run from the repository root: `python -m tests.stress.load --part all` (it was `rlkit bench
load`; it measures no technique against a baseline, so it lives with the tests, not the benches).
tests/stress/test_load.py runs both parts at small scale in CI.

Two parts, run side by side (`--part buffer|router|all`):

buffer: `--groups` groups (default 10,000) of `--samples` samples go through the rollout box as
a real run holds it: the real RolloutActor (rlkit/driver/cluster.py) in its own Ray actor,
holding the real RolloutService (RolloutBuffer + RolloutManager + reward scoring); the driver
reaches it through the real RemoteRolloutBox; ready groups leave the actor as object references
(`_refs`: ray.put in the actor) and a consumer actor ray.get's them, as the trainer ranks do.
Only the engines are replaced, by `InstantEngines`, which append a whole response at once
(lengths long-tailed, 64..4096 tokens, mean about 900), so the figure is the data plane's cost
(source -> acquire -> produce -> reward -> complete -> ready -> take -> consumer), not
generation. Two driver loops: `sync` (run a step, then take the batch) and `stream` (one
next_ready call per group while the step runs); `in-process` runs the same service with no
Ray, for scale. Reported: groups/s, the peak RSS of the driver, the rollout actor and the
consumer, and the accounting: every group the buffer created reached the consumer exactly
once and the buffer's balance holds.

router: `--concurrency` (default 256) concurrent streamed /generate requests through the real
sglang-router to `--engines` built-in hf engines on a demo model, each on its own Sample, via
rollout.http.client.EngineClient.generate. As the tokens stream, `--cancel-fraction` of the request
tasks are cancelled (one each, at spread-out points of progress) and `--abort-alls` abort_all()
calls land mid-flight; samples an abort_all stopped are resumed by tokens (a new generate call,
as the RolloutManager does), individually cancelled ones are not. Checked and reported:
- no hang: every task ends within `--hang-timeout-s` (a task still pending is reported, then
  cancelled);
- loads: every engine's /v1/loads returns to zero afterwards (polled for `--settle-s`);
- no re-submission: the bench counts its own generate calls per sample; the client subclass
  counts each /generate POST (EngineClient._generate_once is the only place that sends one);
  the two must be equal for every sample, and the router's own counter of POST /generate
  (Prometheus smg_http_requests_total) must equal the total, with one worker selection each
  (no router-side retry either);
- tokens: for every request the engine's own count (meta_info.completion_tokens of the last
  chunk it streamed) against the tokens the sample received in that request, and each
  request's prompt_tokens against what the sample held when it was sent (resume by tokens);
- p50/p99 latency of the requests that finished (first byte sent to finish reason), and
  tokens/s (tokens on the samples / wall time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROMPT_ROWS = 1024  # distinct prompts; a 10,000-group run goes through them about 10 times
VOCAB = 151_936  # token ids drawn below a real vocabulary's size (Qwen2's): realistic pickles


class LoadBenchError(RuntimeError):
    """The bench could not run as configured (not an invariant failure: those are reported)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--part", default="all", choices=["all", "buffer", "router"])
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--out", default=None, help="also write the JSON report here")
    parser.add_argument("--seed", type=int, default=0)
    b = parser.add_argument_group("buffer part")
    b.add_argument("--groups", type=int, default=10_000, help="groups per driver loop")
    b.add_argument("--samples", type=int, default=8, help="samples per group")
    b.add_argument("--batch-size", type=int, default=64, help="groups per rollout step")
    b.add_argument("--loops", default="in-process,sync,stream",
                   help="comma-separated driver loops: in-process, sync, stream")
    r = parser.add_argument_group("router part")
    r.add_argument("--concurrency", type=int, default=256, help="concurrent requests")
    r.add_argument("--model", default="tiny", help="demo model name or HF folder")
    r.add_argument("--engines", type=int, default=2)
    r.add_argument("--max-new-tokens", type=int, default=256,
                   help="largest token budget of a request (budgets spread over 1/4..1 of it)")
    r.add_argument("--cancel-fraction", type=float, default=0.1,
                   help="share of the request tasks cancelled mid-flight")
    r.add_argument("--abort-alls", type=int, default=3, help="abort_all() calls mid-flight")
    r.add_argument("--max-resumes", type=int, default=8,
                   help="resumptions of a sample stopped by abort_all before the bench gives up")
    r.add_argument("--hang-timeout-s", type=float, default=600.0,
                   help="a request task not finished this long after the start is a hang")
    r.add_argument("--settle-s", type=float, default=30.0,
                   help="how long the engines' loads may take to return to zero")


def run(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {"command": "python -m tests.stress.load " + " ".join(_argv_of(args)),
                              "conditions": _conditions()}
    if args.part in ("all", "buffer"):
        loops = [x for x in args.loops.split(",") if x]
        report["buffer"] = bench_buffer_actor(args.groups, args.samples, args.batch_size,
                                              loops, seed=args.seed)
        if not args.json:
            print(format_buffer(report["buffer"]), flush=True)
    if args.part in ("all", "router"):
        from rlkit.demo_models import resolve_model_path

        report["router"] = asdict(bench_router(
            resolve_model_path(args.model), concurrency=args.concurrency, engines=args.engines,
            max_new_tokens=args.max_new_tokens, cancel_fraction=args.cancel_fraction,
            abort_alls=args.abort_alls, max_resumes=args.max_resumes,
            hang_timeout_s=args.hang_timeout_s, settle_s=args.settle_s, seed=args.seed))
        if not args.json:
            print(format_router(report["router"]), flush=True)
    report["conditions"]["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    report["ok"] = all(part["ok"] for k, part in report.items() if k in ("buffer", "router"))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"\nload average before {report['conditions']['load_avg_1m_5m_15m']}, after "
              f"{report['conditions']['load_avg_after']}; invariants: "
              f"{'all hold' if report['ok'] else 'VIOLATED (see above)'}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1


def _argv_of(args: argparse.Namespace) -> list[str]:
    out = [f"--part {args.part}"]
    if args.part in ("all", "buffer"):
        out += [f"--groups {args.groups}", f"--samples {args.samples}",
                f"--batch-size {args.batch_size}", f"--loops {args.loops}"]
    if args.part in ("all", "router"):
        out += [f"--concurrency {args.concurrency}", f"--model {args.model}",
                f"--engines {args.engines}", f"--max-new-tokens {args.max_new_tokens}",
                f"--cancel-fraction {args.cancel_fraction}", f"--abort-alls {args.abort_alls}"]
    return out + [f"--seed {args.seed}"]


def _conditions() -> dict[str, Any]:
    import platform

    return {"cpu_count": os.cpu_count(), "machine": platform.machine(),
            "python": platform.python_version(),
            "load_avg_1m_5m_15m": [round(x, 2) for x in os.getloadavg()]}


# -- memory --------------------------------------------------------------------------------
def rss_bytes() -> int:
    """This process's resident set size now."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:  # Linux without psutil
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Samples this process's RSS on a thread (every `every_s`) and keeps the peak: per-phase
    peaks, which getrusage's lifetime ru_maxrss cannot give."""

    def __init__(self, every_s: float = 0.02) -> None:
        self.every_s = every_s
        self.start_bytes = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="peak-rss")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, rss_bytes())

    def report(self) -> dict[str, float]:
        self.peak = max(self.peak, rss_bytes())
        return {"start_mb": self.start_bytes / 2**20, "peak_mb": self.peak / 2**20}

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return self.report()


# -- buffer part: engines that answer at once -------------------------------------------------
def response_length(rng: random.Random) -> int:
    """Long-tailed response lengths: median about 700 tokens, mean about 900, 64..4096."""
    return max(64, min(4096, int(rng.lognormvariate(6.55, 0.7))))


class InstantEngines:
    """An `Engines` (rollout.engine_api) that makes each response at once, in one span: the
    bench measures what the data plane costs, with responses as big as real ones. Deterministic
    per sample index. Token ids and logprobs are fresh lists per response (slices of a pool),
    so pickling costs what it costs with real responses."""

    def __init__(self, workers: int = 2, seed: int = 0) -> None:
        rng = random.Random(seed)
        self._workers = [f"instant-{i}" for i in range(workers)]
        self._ids = [rng.randrange(VOCAB) for _ in range(8192)]
        self._lps = [-rng.expovariate(1.0) for _ in range(8192)]
        self._seed = seed
        self.requests = 0

    def workers(self) -> list[str]:
        return list(self._workers)

    async def generate(self, sample: Any, sampling: Any, *, max_new_tokens: int, version: int,
                       worker: str | None = None) -> str | None:
        sample.start_request()
        self.requests += 1
        rng = random.Random(self._seed * 1_000_003 + sample.index)
        natural = response_length(rng)
        n = min(max_new_tokens, natural)
        at = rng.randrange(len(self._ids) - n)
        sample.append(self._ids[at:at + n], self._lps[at:at + n], version,
                      finish_reason="stop" if n == natural else "length")
        await asyncio.sleep(0)  # let the manager's other tasks run, as a real answer would
        return worker or self._workers[sample.index % len(self._workers)]

    async def abort_all(self) -> None:
        return None  # nothing is ever in flight between two event-loop turns

    async def loads(self) -> dict[str, int]:
        return {w: 0 for w in self._workers}


async def _score(sample: Any, group: Any) -> float:
    return float(len(sample.response_ids) % 2)  # any reward: the bench does not learn


def build_service(samples: int, batch_size: int, seed: int) -> Any:
    """The real RolloutService over InstantEngines: sync policy, prompts of 64..512 tokens."""
    from rlkit.buffers import ListPromptSource
    from rlkit.buffers.source import records_from_token_lists
    from rlkit.driver.rollout_service import RolloutService
    from rlkit.rollout.config import RolloutConfig, SamplingConfig

    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(64, 512))]
               for _ in range(PROMPT_ROWS)]
    cfg = RolloutConfig(batch_size=batch_size, n_samples_per_prompt=samples,
                        sampling=SamplingConfig(max_new_tokens=4096))
    source = ListPromptSource(records_from_token_lists(prompts), seed=seed)
    return RolloutService.from_config(cfg, source, InstantEngines(seed=seed), _score)


class Consumer:
    """Stands for the trainer ranks: fetches the groups behind the references it is handed
    (train.ray_group.TrainWorker.add_groups does ray.get(refs)) and keeps only their ids."""

    def __init__(self) -> None:
        self.seen: Counter[int] = Counter()
        self.samples = 0
        self.tokens = 0
        self._rss = PeakRss()

    def add_groups(self, refs: list[Any]) -> int:
        import ray

        for g in ray.get(refs):
            self.seen[g.group_id] += 1
            self.samples += len(g.samples)
            self.tokens += sum(len(s.response_ids) for s in g.samples)
        return len(refs)

    def summary(self) -> dict[str, Any]:
        return {"ids": dict(self.seen), "samples": self.samples, "tokens": self.tokens,
                "memory": self._rss.report()}


class NoWeights:
    """The trainer as the rollout box's publisher, with no weights to send (the engines here
    keep no state): the update only moves the box's version, as a run's sync does."""

    async def publish(self, update: Any) -> dict[str, float]:
        return {}


async def _drive_sync(box: Any, consumer: Any, steps: int, batch_size: int) -> None:
    """The sync mode's loop: a rollout step, then its batch to the trainer, then the next."""
    for v in range(steps):
        await box.start_step(v, for_version=v, final=v == steps - 1)
        handed = await box.take(batch_size)
        await consumer.add_groups.remote(handed.refs)
        await box.update_weights(v + 1, NoWeights())


async def _drive_stream(box: Any, consumer: Any, steps: int, batch_size: int) -> None:
    """The stream mode's loop: each group goes to the trainer as it becomes ready (one actor
    call per group), while the step runs."""
    for v in range(steps):
        step = box.start_step(v, for_version=v, final=v == steps - 1)
        calls = []
        for _ in range(batch_size):
            handed = await box.next_ready()
            calls.append(consumer.add_groups.remote(handed.refs))
        await step
        await asyncio.gather(*calls)
        await box.update_weights(v + 1, NoWeights())


def _check_accounting(stats: dict[str, Any], ids: dict[int, int], expected: int) -> dict[str, Any]:
    """Every group the buffer created was taken exactly once, none dropped or left behind."""
    created = stats["created"]
    missing = [g for g in range(created) if g not in ids]
    twice = [g for g, n in ids.items() if n != 1]
    unknown = [g for g in ids if not 0 <= g < created]
    ok = (stats["balanced"] and created == expected == stats["trained"] == len(ids)
          and not missing and not twice and not unknown and stats["dropped"] == 0)
    return {"ok": ok, "created": created, "trained": stats["trained"], "consumed": len(ids),
            "missing": missing[:10], "taken_twice": twice[:10], "unknown": unknown[:10],
            "dropped": stats["dropped"], "balanced": stats["balanced"]}


def bench_buffer_actor(groups: int, samples: int, batch_size: int, loops: list[str],
                       seed: int = 0) -> dict[str, Any]:
    """Run `groups` (rounded up to whole steps) through each driver loop; see the module doc."""
    unknown = set(loops) - {"in-process", "sync", "stream"}
    if unknown:
        raise LoadBenchError(f"unknown driver loop(s) {sorted(unknown)}; "
                             "choose from in-process, sync, stream")
    steps = -(-groups // batch_size)
    out: dict[str, Any] = {"groups": steps * batch_size, "samples_per_group": samples,
                           "batch_size": batch_size, "steps": steps,
                           "response_tokens": "lognormal, median ~700, mean ~900, 64..4096",
                           "loops": {}}
    ray_loops = [x for x in loops if x != "in-process"]
    if ray_loops:
        import ray

        from rlkit.driver.local_ray import LocalRay

        own = None if ray.is_initialized() else LocalRay()  # as a run starts it (token auth)
        if own is not None:
            own.start(max(2, os.cpu_count() or 1))
        try:
            for loop in ray_loops:
                out["loops"][loop] = _one_ray_loop(loop, steps, samples, batch_size, seed)
        finally:
            if own is not None:
                own.stop()
    if "in-process" in loops:  # last: it holds nothing afterwards, but runs in this process
        out["loops"]["in-process"] = _in_process_loop(steps, samples, batch_size, seed)
    out["ok"] = all(r["accounting"]["ok"] for r in out["loops"].values())
    return out


def _one_ray_loop(loop: str, steps: int, samples: int, batch_size: int, seed: int) -> dict[str, Any]:
    import ray

    from tests.stress.load_actor import LoadRolloutActor
    from rlkit.driver.proxies import RemoteRolloutBox

    actor = ray.remote(num_cpus=0)(LoadRolloutActor).remote(samples, batch_size, seed)
    consumer = ray.remote(num_cpus=0)(Consumer).remote()
    try:
        ray.get([actor.stats.remote(), consumer.summary.remote()])  # both up before the clock
        box = RemoteRolloutBox(actor)  # no on_progress: the driver only waits
        driver_rss = PeakRss()
        t0 = time.perf_counter()
        drive = _drive_sync if loop == "sync" else _drive_stream
        asyncio.run(drive(box, consumer, steps, batch_size))
        seconds = time.perf_counter() - t0
        stats, summary, actor_mem = ray.get([actor.stats.remote(), consumer.summary.remote(),
                                             actor.memory.remote()])
        groups = steps * batch_size
        return {
            "seconds": seconds, "groups_per_s": groups / seconds,
            "tokens": summary["tokens"], "samples": summary["samples"],
            "memory_mb": {"driver": driver_rss.stop(), "rollout_actor": actor_mem,
                          "consumer": summary["memory"]},
            "accounting": _check_accounting(stats, summary["ids"], groups),
        }
    finally:
        ray.kill(actor)
        ray.kill(consumer)


def _in_process_loop(steps: int, samples: int, batch_size: int, seed: int) -> dict[str, Any]:
    """The same service and steps in this process, no Ray: what the boundary adds."""
    service = build_service(samples, batch_size, seed)
    seen: Counter[int] = Counter()
    tokens = n_samples = 0
    rss = PeakRss()

    async def drive() -> None:
        nonlocal tokens, n_samples
        for v in range(steps):
            await service.run_step(v, for_version=v, final=v == steps - 1)
            for g in (await service.take(batch_size)).refs:
                seen[g.group_id] += 1
                n_samples += len(g.samples)
                tokens += sum(len(s.response_ids) for s in g.samples)
            await service.set_version(v + 1)

    t0 = time.perf_counter()
    asyncio.run(drive())
    seconds = time.perf_counter() - t0
    groups = steps * batch_size
    return {"seconds": seconds, "groups_per_s": groups / seconds, "tokens": tokens,
            "samples": n_samples, "memory_mb": {"driver": rss.stop()},
            "accounting": _check_accounting(service.stats(), dict(seen), groups)}


def format_buffer(r: dict[str, Any]) -> str:
    lines = [f"Rollout box under load: {r['groups']:,} groups x {r['samples_per_group']} samples "
             f"({r['steps']} steps of {r['batch_size']}), responses {r['response_tokens']}", "",
             "| driver loop | groups/s | seconds | response tokens | peak RSS driver MB | "
             "peak RSS rollout actor MB | peak RSS consumer MB | accounting |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, x in r["loops"].items():
        m = x["memory_mb"]

        def peak(k: str) -> str:
            return f"{m[k]['peak_mb']:,.0f}" if k in m else "-"

        a = x["accounting"]
        lines.append(f"| {name} | {x['groups_per_s']:,.0f} | {x['seconds']:.1f} | "
                     f"{x['tokens']:,} | {peak('driver')} | {peak('rollout_actor')} | "
                     f"{peak('consumer')} | {'ok' if a['ok'] else 'FAILED ' + json.dumps(a)} "
                     f"({a['consumed']:,} taken once each) |")
    return "\n".join(lines)


# -- router part -----------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    """One /generate POST, as the client subclass saw it."""

    sample: int
    input_tokens: int  # prompt + response held when it was sent (resume by tokens)
    before: int  # response tokens the sample held when it was sent
    engine_prompt_tokens: int | None = None  # meta_info.prompt_tokens of its chunks
    engine_completion_tokens: int | None = None  # meta_info.completion_tokens of its last chunk
    finish: str | None = None  # the engine's finish reason type, if one arrived
    received: int = 0  # tokens the sample got from this request


def counting_client_class(base: type | None = None) -> type:
    """An EngineClient subclass (of `base`, itself one, or of EngineClient) that records every
    /generate POST it sends in `posts` (the only place that sends one is `_generate_once`) and
    what the engine said about each request."""
    from rlkit.rollout.http.client import EngineClient

    class CountingClient(base or EngineClient):  # type: ignore[misc,valid-type]
        def __post_init__(self) -> None:
            super().__post_init__()
            self.posts: list[RequestRecord] = []
            self._current: dict[int, RequestRecord] = {}

        async def _generate_once(self, sample: Any, *args: Any, **kwargs: Any) -> Any:
            rec = RequestRecord(sample.index, len(sample.input_ids()), len(sample.response_ids))
            self.posts.append(rec)
            self._current[id(sample)] = rec
            try:
                return await super()._generate_once(sample, *args, **kwargs)
            finally:
                rec.received = len(sample.response_ids) - rec.before
                self._current.pop(id(sample), None)

        def _apply_chunk(self, sample: Any, payload: Any, *args: Any, **kwargs: Any) -> Any:
            rec = self._current.get(id(sample))
            meta = payload.get("meta_info") if isinstance(payload, dict) else None
            if rec is not None and isinstance(meta, dict):
                rec.engine_prompt_tokens = meta.get("prompt_tokens", rec.engine_prompt_tokens)
                rec.engine_completion_tokens = meta.get("completion_tokens",
                                                        rec.engine_completion_tokens)
                fin = meta.get("finish_reason")
                if isinstance(fin, dict):
                    rec.finish = fin.get("type")
            return super()._apply_chunk(sample, payload, *args, **kwargs)

    return CountingClient


@dataclass
class RouterLoad:
    concurrency: int
    engines: int
    model: str
    max_new_tokens: int
    seconds: float = 0.0
    tokens: int = 0
    tokens_per_s: float = 0.0
    finished: int = 0  # samples that reached stop/length
    cancelled: int = 0  # tasks cancelled individually (their samples stay partial)
    aborted_partial: int = 0  # samples left partial after --max-resumes abort_all stops
    abort_alls: int = 0
    abort_all_seconds: list[float] = field(default_factory=list)
    generate_calls: int = 0  # by the bench (first requests + resumptions)
    resumptions: int = 0
    posts: int = 0  # /generate POSTs the client sent
    router_generate_requests: int | None = None  # what the router counted
    router_worker_selections: int | None = None
    resubmitted_samples: list[int] = field(default_factory=list)
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    latency_max_s: float | None = None
    hung: int = 0
    errors: list[str] = field(default_factory=list)
    loads_after: dict[str, int] = field(default_factory=dict)
    loads_zero_after_s: float | None = None
    token_mismatches: list[dict[str, Any]] = field(default_factory=list)
    prompt_mismatches: list[dict[str, Any]] = field(default_factory=list)
    engine_reported_tokens: int = 0
    checks: dict[str, bool] = field(default_factory=dict)
    ok: bool = False


def bench_router(model_path: str, *, concurrency: int = 256, engines: int = 2,
                 max_new_tokens: int = 256, cancel_fraction: float = 0.1, abort_alls: int = 3,
                 max_resumes: int = 8, hang_timeout_s: float = 600.0, settle_s: float = 30.0,
                 seed: int = 0, log_dir: Path | None = None) -> RouterLoad:
    """Start the fleet, run the load (see the module doc), stop the fleet."""
    from rlkit.rollout.engines.config import EngineConfig, RouterConfig
    from rlkit.rollout.engines.fleet import EngineFleet

    engine = EngineConfig(num_engines=engines, cpu_threads=1,
                          max_running_requests=max(16, -(-concurrency // engines)),
                          startup_timeout_s=600)
    with EngineFleet(model_path, engine, RouterConfig(), log_dir=log_dir) as fleet:
        return asyncio.run(router_load(
            fleet, concurrency=concurrency, max_new_tokens=max_new_tokens,
            cancel_fraction=cancel_fraction, abort_alls=abort_alls, max_resumes=max_resumes,
            hang_timeout_s=hang_timeout_s, settle_s=settle_s, seed=seed))


def _router_counters(prometheus_port: int | None) -> tuple[int | None, int | None]:
    """The router's count of POST /generate received and of worker selections made."""
    if prometheus_port is None:
        return None, None
    with urllib.request.urlopen(f"http://127.0.0.1:{prometheus_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    received = selections = 0
    for line in text.splitlines():
        if line.startswith('smg_http_requests_total{method="POST",path="/generate"}'):
            received += int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("smg_worker_selection_total{"):
            selections += int(float(line.rsplit(" ", 1)[1]))
    return received, selections


async def router_load(fleet: Any, *, concurrency: int = 256, max_new_tokens: int = 256,
                      cancel_fraction: float = 0.1, abort_alls: int = 3, max_resumes: int = 8,
                      hang_timeout_s: float = 600.0, settle_s: float = 30.0, seed: int = 0,
                      client_class: type | None = None) -> RouterLoad:
    """The load on a running EngineFleet (see the module doc). `client_class`: the client,
    a `counting_client_class()` (tests pass a faulty one to see the checks catch it)."""
    from rlkit.buffers.sample import Sample, SampleStatus
    from rlkit.rollout.config import SamplingConfig

    if not 0 <= cancel_fraction < 1:
        raise LoadBenchError(f"cancel_fraction must be in [0, 1), got {cancel_fraction}")
    out = RouterLoad(concurrency, len(fleet.worker_urls), fleet.model_path, max_new_tokens)
    n_abort_alls = abort_alls

    rng = random.Random(seed)
    c = out.concurrency
    budgets = [rng.randint(max(1, out.max_new_tokens // 4), out.max_new_tokens) for _ in range(c)]
    # Unique prompts (the sample index in the first two ids): a request is traceable by content.
    samples = [Sample(index=i, group_id=i, prompt_ids=[10 + i // 400, 10 + i % 400]
                      + [rng.randrange(10, 500) for _ in range(rng.randint(4, 28))])
               for i in range(c)]
    sampling = SamplingConfig(max_new_tokens=out.max_new_tokens, ignore_eos=True)
    calls: Counter[int] = Counter()
    latencies: list[float] = []
    total_budget = sum(budgets)
    before_router = _router_counters(fleet.router.prometheus_port)

    client = (client_class or counting_client_class())(fleet.router.url,
                                                       worker_urls=fleet.worker_urls)
    await client.connect()
    try:
        calm = asyncio.Event()  # cleared while an abort_all runs
        calm.set()

        async def drive(s: Any, budget: int) -> None:
            for attempt in range(1 + max_resumes):
                left = s.remaining_tokens(budget)
                if left < 1:
                    return
                # Resume only once the abort_all is over, as the manager does: abort_all
                # aborts whatever reaches a worker until the worker is idle, so resuming
                # during it would be aborted again, round after round.
                await calm.wait()
                calls[s.index] += 1
                t0 = time.perf_counter()
                await client.generate(s, sampling, max_new_tokens=left, version=0)
                if s.status.terminal:
                    latencies.append(time.perf_counter() - t0)
                    return
                # stopped by an abort_all: resume by tokens, as the manager does

        t_start = time.perf_counter()
        tasks = [asyncio.ensure_future(drive(s, b)) for s, b in zip(samples, budgets)]

        # Progress points (share of all budgeted tokens streamed) at which to act.
        n_cancel = int(cancel_fraction * c)
        victims = rng.sample(range(c), n_cancel)
        events = sorted([(rng.uniform(0.05, 0.9), "cancel", v) for v in victims]
                        + [((k + 1) / (n_abort_alls + 1), "abort_all", -1)
                           for k in range(n_abort_alls)])

        async def conductor() -> None:
            i = 0
            while i < len(events) and not all(t.done() for t in tasks):
                progress = sum(len(s.response_ids) for s in samples) / total_budget
                while i < len(events) and events[i][0] <= progress:
                    _, what, v = events[i]
                    i += 1
                    if what == "cancel":
                        if tasks[v].cancel():
                            out.cancelled += 1
                    else:
                        t0 = time.perf_counter()
                        calm.clear()
                        try:
                            await client.abort_all()
                        finally:
                            calm.set()
                        out.abort_all_seconds.append(time.perf_counter() - t0)
                        out.abort_alls += 1
                await asyncio.sleep(0.02)

        conduct = asyncio.ensure_future(conductor())
        done, pending = await asyncio.wait(tasks, timeout=hang_timeout_s)
        out.seconds = time.perf_counter() - t_start
        out.hung = len(pending)
        for t in pending:  # a hang is reported, not waited on forever
            t.cancel()
        conduct.cancel()
        await asyncio.gather(conduct, *pending, return_exceptions=True)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                out.errors.append(f"{type(t.exception()).__name__}: {t.exception()}")

        # Loads back to zero (cancelled requests are dropped when their connection closes).
        t0 = time.perf_counter()
        while True:
            out.loads_after = await client.loads()
            if not any(out.loads_after.values()):
                out.loads_zero_after_s = time.perf_counter() - t0
                break
            if time.perf_counter() - t0 > settle_s:
                break
            await asyncio.sleep(0.1)
    finally:
        await client.close()

    after_router = _router_counters(fleet.router.prometheus_port)
    if before_router[0] is not None and after_router[0] is not None:
        out.router_generate_requests = after_router[0] - before_router[0]
        out.router_worker_selections = after_router[1] - before_router[1]
    posts_per_sample = Counter(r.sample for r in client.posts)
    out.posts = len(client.posts)
    out.generate_calls = sum(calls.values())
    out.resumptions = out.generate_calls - len(calls)
    out.resubmitted_samples = sorted(i for i in range(c) if posts_per_sample[i] != calls[i])
    out.tokens = sum(len(s.response_ids) for s in samples)
    out.tokens_per_s = out.tokens / out.seconds
    out.finished = sum(s.status in (SampleStatus.DONE, SampleStatus.TRUNCATED) for s in samples)
    out.aborted_partial = c - out.finished - out.cancelled - out.hung
    if latencies:
        q = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 \
            else [latencies[0]] * 99
        out.latency_p50_s, out.latency_p99_s, out.latency_max_s = q[49], q[98], max(latencies)
    for r in client.posts:
        engine_tokens = r.engine_completion_tokens or 0  # no chunk read: nothing reported
        out.engine_reported_tokens += engine_tokens
        # The engine's count in the last chunk the client read must be what the sample got
        # from that request (a cancelled request's unread chunks count on neither side).
        if engine_tokens != r.received:
            out.token_mismatches.append(asdict(r))
        if r.engine_prompt_tokens is not None and r.engine_prompt_tokens != r.input_tokens:
            out.prompt_mismatches.append(asdict(r))
    out.token_mismatches = out.token_mismatches[:10]
    out.prompt_mismatches = out.prompt_mismatches[:10]
    out.checks = {
        "no_hang": out.hung == 0,
        "no_errors": not out.errors,
        "loads_back_to_zero": out.loads_zero_after_s is not None,
        "no_resubmission": not out.resubmitted_samples and out.posts == out.generate_calls,
        "router_saw_each_post_once": out.router_generate_requests in (None, out.posts)
        and out.router_worker_selections in (None, out.posts),
        "engine_tokens_match": not out.token_mismatches
        and out.engine_reported_tokens == out.tokens,
        "resumed_by_tokens": not out.prompt_mismatches,
        "within_budget": all(len(s.response_ids) <= b for s, b in zip(samples, budgets)),
        "samples_consistent": _all_consistent(samples),
    }
    out.ok = all(out.checks.values())
    return out


def _all_consistent(samples: list[Any]) -> bool:
    for s in samples:
        try:
            s.check()
        except Exception:
            return False
    return True


def format_router(r: dict[str, Any]) -> str:
    def sec(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [
        f"{r['concurrency']} concurrent streamed requests, {r['engines']} hf engines "
        f"({Path(r['model']).name}) behind sglang-router, budgets up to {r['max_new_tokens']} "
        f"tokens, {r['cancelled']} cancelled, {r['abort_alls']} abort_all calls", "",
        "| figure | value |", "|---|---:|",
        f"| wall time s | {r['seconds']:.1f} |",
        f"| tokens on samples | {r['tokens']:,} |",
        f"| tokens/s | {r['tokens_per_s']:,.0f} |",
        f"| latency p50 / p99 / max s (finished requests) | {sec(r['latency_p50_s'])} / "
        f"{sec(r['latency_p99_s'])} / {sec(r['latency_max_s'])} |",
        f"| finished / cancelled / left partial | {r['finished']} / {r['cancelled']} / "
        f"{r['aborted_partial']} |",
        f"| generate calls (incl. resumptions) / client POSTs / router POSTs / router "
        f"selections | {r['generate_calls']} ({r['resumptions']}) / {r['posts']} / "
        f"{r['router_generate_requests']} / {r['router_worker_selections']} |",
        f"| abort_all seconds | {', '.join(f'{x:.2f}' for x in r['abort_all_seconds']) or '-'} |",
        f"| engine-reported tokens (last chunk of each request) | "
        f"{r['engine_reported_tokens']:,} |",
        f"| loads after (zero after s) | {r['loads_after']} ({sec(r['loads_zero_after_s'])}) |",
        f"| hung tasks | {r['hung']} |", "",
        "| invariant | holds |", "|---|---|",
    ]
    lines += [f"| {k} | {'yes' if v else 'NO'} |" for k, v in r["checks"].items()]
    if r["errors"]:
        lines.append(f"\nerrors: {r['errors'][:5]}")
    return "\n".join(lines)


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m tests.stress.load",
                                      description=__doc__.splitlines()[0])
    add_arguments(_parser)
    raise SystemExit(run(_parser.parse_args()))
