"""Simulated engines: continuous batching with a latency profile and a KV-cache limit.

`SimEngines` implements the manager's `Engines` interface (rollout.engine_api) over N simulated
workers. Run it on a `VirtualTimeLoop` (rlkit.sim.clock) and a 128-engine step with 32k-token
tails takes seconds of real time.

Model of one worker (an SGLang-like server):

- Continuous batching. Running requests all advance one token per decode step; a step with B
  running requests whose attention reads K KV tokens takes `profile.ptl(B, K)` seconds
  (K = sum of contexts with a paged KV cache, B x the longest context with a padded one). Requests join and
  leave the batch only between steps.
- Decode is simulated analytically between events, never token by token: from the running set
  the worker computes how many steps remain until the next event (a request reaches its
  budget, or the KV cache fills up), sleeps that long in one go, and appends each request's
  tokens as one span. An arrival, a cancellation or an abort wakes it early; it then finishes
  the step in progress (steps are atomic) and re-plans.
- Prefill. Admitted requests are prefilled (prompt + response so far, so a resumed partial
  pays to recompute its KV: a weight update flushes the prefix cache) in forwards of at most
  `max_prefill_tokens` (padded: rows x longest context), one decode step between two
  forwards, each forward costing `profile.prefill_forward_s` (fixed + linear + quadratic in
  the contexts); decode stalls meanwhile. A prefill forward yields each request's first token.
- KV capacity C (tokens). A request holds prompt + generated tokens. Admission is first come,
  first served, while the batch limit allows and `used + need + reserve <= C`, where the
  reserve (SGLang's new-token ratio) is `reserve_ratio x sum(min(remaining budget, clip))` over
  the running requests and the candidate. When running requests grow until the next step would
  not fit, the newest admitted are preempted (SGLang's retract): they go back to the front of
  the queue keeping their tokens and are re-prefilled on readmission. A request that could not
  fit even alone (prompt + budget > C) is refused with EngineError. Hence capacity is never
  exceeded, and a worker with queued work is never idle.
- Abort. `abort_all` ends every running and queued request at the next step boundary with its
  tokens kept (the sample is left PARTIAL or PENDING) and returns when every worker is idle.
  Cancelling the task awaiting `generate` does the same for one request, immediately.
- Overheads of the serving stack (both 0 by default, set for CPU validation): every request
  reaches its worker `request_latency_s` after it is sent (HTTP, router, tokenizer; the
  engine is not busy meanwhile; a request still on its way when `abort_all` is called is
  aborted on arrival, as the client's repeated abort does), and `abort_all` returns
  `abort_latency_s` after the workers are idle (the client polls /v1/loads until idle), or,
  with `abort_poll_s`, exactly as rlkit's client does it: per worker, POST /abort_request and
  GET /v1/loads (`control_rtt_s` each) until the worker is idle, sleeping between rounds
  from `abort_poll_s[0]`, doubling up to `abort_poll_s[1]`.
- Shared CPU (`cpu_cores`, for CPU engines; None: engines are independent, as GPUs are).
  The engines, the serving stack and other work share `cpu_cores` cores by processor
  sharing: a busy worker demands 1 core for its engine plus its serving stack's share
  (`chunk_cpu_s` CPU seconds in the HTTP process, router and client per streamed chunk of
  `stream_interval` tokens, per CPU second of its decode steps); `background_load` runnable
  threads of other work demand 1 each. When the demand D exceeds the cores every engine runs
  at `cpu_cores / D` of its profile's speed, and engines busy at the same time slow each
  other by `cpu_interference` each (shared caches and memory bandwidth: a step costs
  1 + cpu_interference x (busy engines - 1) times its profile's CPU); a worker going idle
  speeds up the others (they re-plan at their next step boundary).
- Faults (tests of rollout.health): `kill(worker)` ends its requests at once (each keeps the
  tokens it had; its caller sees an EngineError, as a broken stream) and refuses new ones;
  `hang(worker)` freezes it (requests never return, probes and progress reads time out).
  `abort_worker`, `remove_worker`, `add_worker` and `respawn` (a restart: a fresh worker under
  a new id) are the monitor's side; `SimRestarter` restarts after a delay. A live worker
  answers a probe at once, unless `probe_queues`: then a generation probe is a one-token
  request queued like any other (a real engine's), so it times out behind a busy worker's
  work. `progress` is the worker's steps so far (prefill forwards and decode steps, those of
  the plan under way included): it moves while the worker works, never once it is hung.
- Prefix cache (`prefix_cache`, off by default): a request goes to the worker that served
  its sample's last request and prefills only what that one did not leave cached, unless the
  weights changed since (an update flushes the cache). Multi-turn episodes need it: each turn
  resends the whole episode so far, which SGLang's radix cache mostly has.
- Sampling. Simulated engines know no text: a request generates exactly its budget
  (`max_new_tokens`) and finishes with 'length'. Natural lengths come from a trace through
  `TraceReplayEngines` (rlkit.sim.replay), exactly as on real engines.

Deterministic: no randomness, no wall clock; ties resolve by worker index and admission order.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Callable, Literal

from rlkit.buffers.sample import Sample
from rlkit.rollout.config import SamplingConfig
from rlkit.rollout.engine_api import EngineError, WorkerLost
from rlkit.rollout.engines.profile import EngineProfile

Router = Literal["round_robin", "least_load"]
HUNG_CONTROL_TIMEOUT_S = 10.0  # a control call to a hung worker fails after this (client timeout)
TOKEN_ID = 0  # simulated engines produce no text; every token is this id
LOGPROB = -1.0


@dataclass(frozen=True)
class SimConfig:
    """A simulated cluster: `engines` identical workers running `profile`."""

    engines: int
    profile: EngineProfile
    kv_capacity_tokens: int | None = None  # None: the profile's; None there too: unlimited
    max_running_requests: int | None = None  # None: the profile's batch limit
    router: Router = "round_robin"
    reserve_ratio: float = 0.3  # SGLang's new-token ratio decays from 0.7 to 0.1
    reserve_clip_tokens: int = 4096  # SGLang's clip_max_new_tokens_estimation
    stream_spans: bool = True  # append tokens at every event (False: only when a request ends)
    request_latency_s: float = 0.0  # send -> queued at the worker
    abort_latency_s: float = 0.0  # workers idle -> abort_all returns
    # How attention reads the KV cache: 'paged' (SGLang, vLLM: each request its own context,
    # K = sum of contexts) or 'padded' (rlkit's hf engine: rows left-padded to the longest, so
    # K = batch x longest context). None: the profile's "kv_layout" key, else 'paged'.
    kv_layout: Literal["paged", "padded"] | None = None
    max_prefill_tokens: int | None = None  # per prefill forward; None: the profile's (or no limit)
    # Shared CPU (CPU engines; see the module docstring). None: every engine has its own device.
    cpu_cores: float | None = None
    background_load: float = 0.0  # runnable threads of other work on those cores
    chunk_cpu_s: float = 0.0  # serving-stack CPU seconds per streamed chunk
    cpu_interference: float = 0.0  # step CPU grows by this per other busy engine
    stream_interval: int = 1  # tokens per streamed chunk
    control_rtt_s: float = 0.0  # one control call (abort, loads) to a worker, round trip
    abort_poll_s: tuple[float, float] | None = None  # the client's abort-until-idle back-off
    # A prefix cache (SGLang's radix cache; paged layout only): a sample's next request (an
    # episode's next turn) goes to the worker that served its last one if that worker is up
    # (cache-aware routing) and, if the weights are the same version (an update flushes the
    # cache), prefills only the tokens after what that request left cached. False: every
    # request prefills its whole context (single-turn figures were measured so).
    prefix_cache: bool = False
    # A generation probe (rollout.health) is a one-token request queued at the worker behind
    # the requests already there, as on a real engine; False: a live worker answers at once.
    probe_queues: bool = False

    @classmethod
    def from_profile(cls, engines: int, profile: EngineProfile, **overrides: Any) -> "SimConfig":
        """A cluster of `profile` engines with the serving stack and machine the profile
        measured (its "serving" object: any SimConfig field, e.g. cpu_cores, chunk_cpu_s,
        request_latency_s, abort_poll_s), then `overrides`."""
        names = {f.name for f in fields(cls)} - {"engines", "profile"}
        serving = profile.extra.get("serving") or {}
        kw: dict[str, Any] = {k: v for k, v in serving.items() if k in names}
        if kw.get("abort_poll_s") is not None:
            kw["abort_poll_s"] = tuple(kw["abort_poll_s"])
        kw.update(overrides)
        return cls(engines=engines, profile=profile, **kw)

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError("a simulated cluster needs at least one engine")
        if self.router not in ("round_robin", "least_load"):
            raise ValueError(f"unknown router policy {self.router!r}")
        if not 0 <= self.reserve_ratio <= 1:
            raise ValueError("reserve_ratio must be in [0, 1]")
        if self.request_latency_s < 0 or self.abort_latency_s < 0:
            raise ValueError("latencies must be >= 0")
        if self.layout not in ("paged", "padded"):
            raise ValueError(f"unknown kv_layout {self.layout!r}")
        if self.cpu_cores is not None and self.cpu_cores <= 0:
            raise ValueError("cpu_cores must be > 0")
        if min(self.background_load, self.chunk_cpu_s, self.control_rtt_s,
               self.cpu_interference) < 0:
            raise ValueError("background_load, chunk_cpu_s, control_rtt_s and "
                             "cpu_interference must be >= 0")
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be >= 1")
        if self.abort_poll_s is not None and not 0 < self.abort_poll_s[0] <= self.abort_poll_s[1]:
            raise ValueError("abort_poll_s must be (first, max) with 0 < first <= max")
        if self.prefill_limit is not None and self.prefill_limit < 1:
            raise ValueError("max_prefill_tokens must be >= 1")

    @property
    def capacity(self) -> int | None:
        return self.kv_capacity_tokens if self.kv_capacity_tokens is not None \
            else self.profile.kv_capacity_tokens

    @property
    def batch_limit(self) -> int:
        return self.max_running_requests or self.profile.batch_limit

    @property
    def layout(self) -> str:
        return self.kv_layout or str(self.profile.extra.get("kv_layout", "paged"))

    @property
    def prefill_limit(self) -> int | None:
        return self.max_prefill_tokens if self.max_prefill_tokens is not None \
            else self.profile.max_prefill_tokens


@dataclass
class Segment:
    """One stay of a request on a worker: queued, admitted (running), and how it ended.

    outcome: 'length' (reached its budget), 'abort', 'cancelled' (the caller's task was
    cancelled), 'preempt' (retracted for KV space; the request continues in a later segment).
    """

    worker: str
    sample_index: int
    group_id: int
    enqueued: float
    admitted: float | None
    end: float
    tokens: int  # generated during this segment
    response_before: int  # the sample's response length when the segment started
    outcome: str


@dataclass
class WorkerStats:
    """Cumulative counters of one worker (differences between snapshots give a step's)."""

    busy_s: float = 0.0  # prefill + decode
    decode_s: float = 0.0
    prefill_s: float = 0.0
    decode_steps: int = 0
    tokens: int = 0  # decoded tokens
    context_token_sum: float = 0.0  # sum over decoded tokens of the KV they attended to
    prefill_tokens: int = 0
    preemptions: int = 0
    requests: int = 0
    max_kv_used: int = 0
    max_running: int = 0

    def copy(self) -> "WorkerStats":
        return WorkerStats(**self.__dict__)


@dataclass(eq=False)
class _Request:
    rid: int
    sample: Sample
    budget: int  # tokens this request may generate
    context: int  # prompt + response tokens at submission
    version: int
    done: asyncio.Future
    enqueued: float
    lost: str | None = None  # why its worker ended it (kill, abort_worker)
    generated: int = 0  # by this request, as of the worker's last advance
    flushed: int = 0  # of those, appended to the sample
    admitted: float | None = None
    seg_start_tokens: int = 0  # `generated` when the current segment began
    cached: int = 0  # of `context`, tokens already in the worker's prefix cache
    probe: bool = False  # a health probe (probe_queues): in no segment, stats or timeline

    @property
    def kv(self) -> int:
        return self.context + self.generated

    @property
    def remaining(self) -> int:
        return self.budget - self.generated


@dataclass
class _Plan:
    """A run of decode steps with a fixed running set: B requests, K0 KV tokens at t0."""

    t0: float
    steps: int
    batch: int
    kv0: int
    base_s: float
    kv_s: float

    def duration(self, k: int) -> float:
        return k * self.base_s + self.kv_s * (k * self.kv0 + self.batch * k * (k - 1) / 2)

    def steps_done(self, elapsed: float) -> int:
        """Whole steps finished `elapsed` seconds after t0 (at most `steps`)."""
        a = self.kv_s * self.batch / 2
        b = self.base_s + self.kv_s * self.kv0 - a
        if elapsed <= 0:
            return 0
        k = int(elapsed / b) if a == 0 else int((-b + math.sqrt(b * b + 4 * a * elapsed)) / (2 * a))
        k = max(0, min(k, self.steps))
        eps = 1e-12 * max(1.0, elapsed)
        while k < self.steps and self.duration(k + 1) <= elapsed + eps:
            k += 1
        while k > 0 and self.duration(k) > elapsed + eps:
            k -= 1
        return k


class _CpuShare:
    """Processor sharing of `cores` between the busy workers (each demanding 1 + its serving
    stack's share) and `background` always-runnable threads of other work; busy workers also
    slow each other by `interference` (caches, memory bandwidth)."""

    TOLERANCE = 0.05  # demand changes smaller than this (relative) are not worth a re-plan

    def __init__(self, cores: float, background: float, interference: float = 0.0) -> None:
        self.cores = cores
        self.background = background
        self.interference = interference
        self.demand: dict[str, float] = {}
        self.workers: list["SimWorker"] = []

    def factor(self) -> float:
        d = self.background + sum(self.demand.values())
        busy = sum(1 for x in self.demand.values() if x > 0)
        share = 1.0 if d <= self.cores else self.cores / d
        return share / (1.0 + self.interference * max(0, busy - 1))

    def set(self, worker: "SimWorker", demand: float) -> float:
        """Record `worker`'s demand; the others re-plan if their speed changes. Returns the
        speed factor now."""
        old = self.demand.get(worker.id, 0.0)
        if demand != old and not (old > 0 and demand > 0
                                  and abs(demand - old) <= self.TOLERANCE * old):
            before = self.factor()
            self.demand[worker.id] = demand
            if abs(self.factor() - before) > 1e-12:
                for w in self.workers:
                    if w is not worker and w._plan is not None:
                        w._wake()  # finishes its step in progress, then re-plans
        return self.factor()


class SimWorker:
    """One simulated engine server (see the module docstring for the model)."""

    def __init__(
        self, wid: str, cfg: SimConfig, observer: Callable[["SimWorker", str], None] | None,
        cpu: _CpuShare | None = None,
    ) -> None:
        self.id = wid
        self.profile = cfg.profile
        self.prefill_limit = cfg.prefill_limit
        self._cpu = cpu
        self._chunk_cpu = cfg.chunk_cpu_s / cfg.stream_interval  # per token streamed
        self.capacity = cfg.capacity
        self.batch_limit = cfg.batch_limit
        self.reserve_ratio = cfg.reserve_ratio
        self.reserve_clip = cfg.reserve_clip_tokens
        self.stream_spans = cfg.stream_spans
        self.padded = cfg.layout == "padded"
        self.stats = WorkerStats()
        self.segments: list[Segment] = []
        self.running: dict[int, _Request] = {}  # admission order
        self.waiting: deque[_Request] = deque()
        self.kv_used = 0
        self._observer = observer
        self._plan: _Plan | None = None
        self._waiter: asyncio.Future | None = None
        self._abort = False
        self._prefilling: list[_Request] = []
        self._prefill_blocked = False  # requests wait only for the next prefill forward
        self._admit_skipped = False  # no admission before this step (a forward just ran)
        self.idle = asyncio.Event()
        self.idle.set()
        self._task: asyncio.Task | None = None
        self.state = "up"  # up | dead | hung
        self._new_version: int | None = None  # weights updated: restamp from the next boundary
        self.steps = 0  # prefill forwards and decode steps done (those of `_plan` not yet)

    # -- called by SimEngines -------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.id)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def submit(self, req: _Request) -> None:
        self.waiting.append(req)
        if not req.probe:
            self.stats.requests += 1
        self.idle.clear()
        self._wake()

    def set_weights_version(self, version: int) -> None:
        """New weights while requests run (async mode's mid-step sync): tokens decoded from the
        next step boundary on carry `version`, as SGLang stamps them after an update that
        keeps requests (retract or in place) and rlkit's client appends them."""
        self._new_version = version
        if self.running or self.waiting:
            self._wake()

    def request_abort(self) -> None:
        if self.running or self.waiting:
            self._abort = True
            self._wake()

    def cancel(self, req: _Request) -> None:
        """The caller stopped waiting: end the request now, keeping the tokens it has."""
        now = self._now()
        if req.rid in self.running:
            if self._plan is not None:  # steps finished since the last advance count
                k = min(self._plan.steps_done(now - self._plan.t0), req.remaining)
                self.stats.tokens += k
                self.stats.context_token_sum += k * req.kv + k * (k - 1) / 2
                req.generated += k
            del self.running[req.rid]
            self.kv_used = sum(r.kv for r in self.running.values())
            self._end_segment(req, now, "cancelled")
        elif req in self.waiting:
            self.waiting.remove(req)
            self._end_segment(req, now, "cancelled")
        self._flush(req, None)
        if not req.done.done():
            req.done.set_result("cancelled")
        self._update_idle()
        self._wake()

    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def progress_mark(self) -> int:
        """Steps done so far, the plan under way's included: moves while the worker works."""
        plan = self._plan
        return self.steps + (plan.steps_done(self._now() - plan.t0) if plan is not None else 0)

    def end_all(self, why: str) -> int:
        """End every request now (the caller sees `why`), each keeping the tokens it had."""
        reqs = [*self.running.values(), *self.waiting]
        for r in reqs:
            r.lost = why
            self.cancel(r)
        return len(reqs)

    def freeze(self) -> None:
        """Hang: the loop stops mid-plan; tokens of the step in progress are never streamed."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.steps = self.progress_mark()  # the steps done stay done: the mark never goes back
        self._plan = None
        self.state = "hung"

    def check_invariants(self, phase: str = "scheduled") -> None:
        """Raise AssertionError if the worker's state breaks the model (tests). `phase` is
        'advance' (after decode steps) or 'scheduled' (after aborts, finishes, preemption and
        admission: the state the worker then runs or sleeps in)."""
        assert self.kv_used == sum(r.kv for r in self.running.values()), "KV accounting drift"
        if self.capacity is not None:
            assert self.kv_used <= self.capacity, f"{self.id}: KV {self.kv_used} > {self.capacity}"
        assert len(self.running) <= self.batch_limit, f"{self.id}: batch over its limit"
        assert all(0 <= r.generated <= r.budget for r in self.running.values())
        if phase == "scheduled" and self.waiting and not self.running:
            raise AssertionError(f"{self.id}: idle while {len(self.waiting)} requests wait")

    # -- the worker loop ---------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        decoded_since_prefill = True
        while True:
            self._boundary()
            # Two prefill forwards are separated by one decode step of the running batch.
            self._admit_skipped = not decoded_since_prefill and bool(self.running)
            prefill_s = 0.0 if self._admit_skipped else self._admit()
            if self._observer is not None:
                self._observer(self, "scheduled")
            if self._prefilling:
                prefill_s /= self._share(1.0)
                await asyncio.sleep(prefill_s)
                self.stats.prefill_s += prefill_s
                self.stats.busy_s += prefill_s
                self._first_tokens()
                decoded_since_prefill = False
                continue  # aborts or cancellations may have arrived meanwhile
            self._update_idle()
            if not self.running:
                self._share(0.0)
                await self._sleep(None)
                continue
            plan = self._make_plan(loop.time())
            decoded_since_prefill = True
            self._plan = plan
            woken = await self._sleep(plan.duration(plan.steps))
            steps = plan.steps
            if woken:  # finish the step in progress (if one began), then re-plan with the news
                elapsed = loop.time() - plan.t0
                done = plan.steps_done(elapsed)
                in_progress = plan.duration(done) < elapsed - 1e-12 * max(1.0, elapsed)
                steps = min(plan.steps, done + in_progress)
                rest = plan.t0 + plan.duration(steps) - loop.time()
                if rest > 0:
                    await asyncio.sleep(rest)
            self._advance(plan, steps)
            self._plan = None

    async def _sleep(self, seconds: float | None) -> bool:
        """Sleep `seconds` (None: until woken). True if woken early by news."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiter = fut
        handle = None if seconds is None else loop.call_later(seconds, _resolve, fut, False)
        try:
            return await fut
        finally:
            self._waiter = None
            if handle is not None:
                handle.cancel()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(True)

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _make_plan(self, now: float) -> _Plan:
        batch = len(self.running)
        steps = min(r.remaining for r in self.running.values())
        if self.capacity is not None:
            steps = min(steps, (self.capacity - self.kv_used) // batch)
        if self.waiting and (self._prefill_blocked or self._admit_skipped):
            steps = 1  # the next prefill forward comes after one decode step
        assert steps >= 1, "boundary processing leaves room for one step"
        # Attention reads K KV cells per step; every row grows by one token per step, so K
        # grows by `batch` per step in both layouts.
        kv_read = batch * max(r.kv for r in self.running.values()) if self.padded \
            else self.kv_used
        base, kv_s = self.profile.step_base_s(batch), self.profile.kv_s(batch)
        if self._cpu is not None:
            step_cpu = base + kv_s * kv_read
            speed = self._share(1.0 + self._chunk_cpu * batch / step_cpu)
            base, kv_s = base / speed, kv_s / speed
        return _Plan(now, steps, batch, kv_read, base, kv_s)

    def _share(self, demand: float) -> float:
        """Register this worker's CPU demand; the speed factor it runs at (1: full speed)."""
        return 1.0 if self._cpu is None else self._cpu.set(self, demand)

    def _first_tokens(self) -> None:
        """A prefill forward samples the first token of each request it prefilled."""
        s = self.stats
        for r in self._prefilling:
            if r.rid in self.running and r.remaining > 0:
                s.tokens += 1
                s.context_token_sum += r.kv
                r.generated += 1
                self.kv_used += 1
        self._prefilling = []
        self.steps += 1
        s.max_kv_used = max(s.max_kv_used, self.kv_used)
        if self._observer is not None:
            self._observer(self, "advance")

    def _advance(self, plan: _Plan, steps: int) -> None:
        if steps <= 0:
            return
        batch = len(self.running)  # cancelled requests already left; their steps are paid
        for r in self.running.values():
            r.generated += steps
        self.kv_used += batch * steps
        s = self.stats
        dt = plan.duration(steps)
        s.decode_s += dt
        s.busy_s += dt
        s.decode_steps += steps
        self.steps += steps
        s.tokens += batch * steps
        s.context_token_sum += steps * self.kv_used - batch * steps * (steps + 1) / 2
        s.max_kv_used = max(s.max_kv_used, self.kv_used)
        if self._observer is not None:
            self._observer(self, "advance")

    def _boundary(self) -> None:
        """Between steps: new weights, aborts, finished requests, KV pressure, streaming."""
        now = self._now()
        if self._new_version is not None:
            for r in [*self.running.values(), *self.waiting]:
                if r.version < self._new_version:
                    self._flush(r, None)  # what it decoded so far, with the old weights
                    r.version = self._new_version
            self._new_version = None
        if self._abort:
            self._abort = False
            for r in [*self.running.values(), *self.waiting]:
                self._end_segment(r, now, "abort")
                self._flush(r, None)
                _resolve(r.done, "abort")
            self.running.clear()
            self.waiting.clear()
            self.kv_used = 0
        for r in [r for r in self.running.values() if r.remaining == 0]:
            del self.running[r.rid]
            self.kv_used -= r.kv
            self._end_segment(r, now, "length")
            self._flush(r, "length")
            _resolve(r.done, "length")
        if self.capacity is not None:
            while self.running and self.kv_used + len(self.running) > self.capacity:
                rid, victim = next(reversed(self.running.items()))  # newest admitted
                del self.running[rid]
                self.kv_used -= victim.kv
                self.stats.preemptions += 1
                self._end_segment(victim, now, "preempt")
                self._flush(victim, None)
                victim.admitted = None
                victim.cached = 0  # its KV is freed: re-prefilled whole
                victim.enqueued = now
                self.waiting.appendleft(victim)
        if self.stream_spans:
            for r in self.running.values():
                self._flush(r, None)

    def _admit(self) -> float:
        """Admit the queued requests that fit into one prefill forward (`self._prefilling`);
        returns its seconds at full speed."""
        now = self._now()
        admitted: list[_Request] = []
        width = tokens = 0
        limit = self.prefill_limit
        self._prefill_blocked = False
        reserved: int | None = None  # sum of min(remaining, clip) over the running requests
        while self.waiting and len(self.running) < self.batch_limit:
            r = self.waiting[0]
            r_reserved = min(r.remaining, self.reserve_clip)
            if self.running and self.capacity is not None:
                if reserved is None:
                    reserved = sum(min(x.remaining, self.reserve_clip)
                                   for x in self.running.values())
                reserve = self.reserve_ratio * (reserved + r_reserved)
                if self.kv_used + r.kv + len(self.running) + 1 + reserve > self.capacity:
                    break
            if limit is not None and admitted:
                cost = (len(admitted) + 1) * max(width, r.kv) if self.padded else tokens + r.kv
                if cost > limit:
                    self._prefill_blocked = True
                    break
            self.waiting.popleft()
            self.running[r.rid] = r
            self.kv_used += r.kv
            r.admitted = now
            admitted.append(r)
            width, tokens = max(width, r.kv), tokens + r.kv
            if reserved is not None:
                reserved += r_reserved
        self._prefilling = admitted
        if not admitted:
            return 0.0
        s = self.stats
        cached = [r.cached for r in admitted] if not self.padded else None
        s.prefill_tokens += tokens - sum(cached or ())
        s.max_running = max(s.max_running, len(self.running))
        s.max_kv_used = max(s.max_kv_used, self.kv_used)
        return self.profile.prefill_forward_s([r.kv for r in admitted], self.padded, cached)

    def _flush(self, r: _Request, finish_reason: str | None) -> None:
        k = r.generated - r.flushed
        if k or finish_reason is not None:
            r.sample.append([TOKEN_ID] * k, [LOGPROB] * k, r.version, finish_reason=finish_reason)
            r.flushed = r.generated

    def _end_segment(self, r: _Request, now: float, outcome: str) -> None:
        if r.probe:
            return
        self.segments.append(Segment(
            self.id, r.sample.index, r.sample.group_id, r.enqueued, r.admitted, now,
            r.generated - r.seg_start_tokens,
            r.context + r.seg_start_tokens - len(r.sample.prompt_ids), outcome,
        ))
        r.seg_start_tokens = r.generated

    def _update_idle(self) -> None:
        if self.running or self.waiting:
            self.idle.clear()
        else:
            self.idle.set()


def _resolve(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


class SimEngines:
    """N simulated workers behind a simulated router, implementing `Engines`."""

    def __init__(
        self, cfg: SimConfig, *, observer: Callable[[SimWorker, str], None] | None = None
    ) -> None:
        self.cfg = cfg
        width = len(str(cfg.engines - 1))
        cpu = None if cfg.cpu_cores is None else _CpuShare(cfg.cpu_cores, cfg.background_load,
                                                          cfg.cpu_interference)
        self._workers = {
            f"sim-{i:0{width}d}": SimWorker(f"sim-{i:0{width}d}", cfg, observer, cpu)
            for i in range(cfg.engines)
        }
        if cpu is not None:
            cpu.workers = list(self._workers.values())
        self._order = list(self._workers.values())  # serving, in routing order
        self._all = list(self._order)  # every worker ever started (stats, segments)
        self._respawns = 0
        self._next_rr = 0
        self._next_rid = 0
        self._aborts = 0  # abort_all calls so far: requests on their way see it on arrival
        self._prefix: dict[int, tuple[str, int, int]] = {}  # sample -> (worker, version, tokens)

    def set_weights_version(self, version: int) -> None:
        """New weights on every engine while requests run (SimWorker.set_weights_version)."""
        for w in self._all:
            w.set_weights_version(version)

    # -- Engines ----------------------------------------------------------------------------
    def workers(self) -> list[str]:
        return [w.id for w in self._order]

    async def generate(
        self,
        sample: Sample,
        sampling: SamplingConfig,
        *,
        max_new_tokens: int,
        version: int,
        worker: str | None = None,
    ) -> str | None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        context = len(sample.prompt_ids) + len(sample.response_ids)
        cached = 0
        last = self._prefix.get(sample.index) if self.cfg.prefix_cache else None
        if last is not None and worker in (None, last[0]) and any(
                w.id == last[0] and w.state == "up" for w in self._order):
            worker = last[0]  # cache-aware routing: where its prefix is
            cached = min(last[2], context) if last[1] == version else 0
        w = self._route(worker)
        if w.state == "dead":
            raise EngineError(f"{w.id}: connection refused", w.id)
        if w.capacity is not None and context + max_new_tokens > w.capacity:
            raise EngineError(
                f"{w.id}: request needs {context} + {max_new_tokens} KV tokens; the engine "
                f"holds {w.capacity}"
            )
        w.start()
        loop = asyncio.get_running_loop()
        sample.start_request()
        if self.cfg.request_latency_s > 0:
            aborts = self._aborts
            try:
                await asyncio.sleep(self.cfg.request_latency_s)
            except asyncio.CancelledError:
                sample.interrupt()
                raise
            if self._aborts != aborts:  # aborted while on its way: never reaches the engine
                sample.interrupt()
                return w.id
        req = _Request(self._next_rid, sample, max_new_tokens, context, version,
                       loop.create_future(), loop.time(), cached=cached)
        self._next_rid += 1
        w.submit(req)
        try:
            outcome = await req.done
        except asyncio.CancelledError:
            w.cancel(req)
            sample.interrupt()
            raise
        finally:
            if self.cfg.prefix_cache:  # what its KV leaves in the worker's cache
                self._prefix[sample.index] = (w.id, version, len(sample.prompt_ids) + len(sample.response_ids))
        if outcome != "length":
            sample.interrupt()
        if req.lost == "killed":
            raise EngineError(f"{w.id}: connection reset after {req.generated} tokens", w.id)
        if req.lost is not None:
            raise WorkerLost(w.id)
        return w.id

    async def abort_all(self) -> None:
        self._aborts += 1
        hung = [w.id for w in self._order if w.state != "up"]
        if hung:  # its /abort_request never answers (the client's control timeout)
            await asyncio.sleep(HUNG_CONTROL_TIMEOUT_S)
            raise EngineError(f"/abort_request timed out on {hung}")
        if self.cfg.abort_poll_s is not None:
            await asyncio.gather(*(self._abort_until_idle(w) for w in self._order))
            return
        for w in self._order:
            w.request_abort()
        for w in self._order:
            await w.idle.wait()
        if self.cfg.abort_latency_s > 0:
            await asyncio.sleep(self.cfg.abort_latency_s)

    async def _abort_until_idle(self, w: SimWorker) -> None:
        """rlkit's client (EngineClient._abort_until_idle): abort, ask the load, back off."""
        half = self.cfg.control_rtt_s / 2
        assert self.cfg.abort_poll_s is not None
        delay, longest = self.cfg.abort_poll_s
        while True:
            await asyncio.sleep(half)  # POST /abort_request reaches the worker
            w.request_abort()
            await asyncio.sleep(2 * half)  # its answer, then GET /v1/loads reaches it
            idle = w.load() == 0
            await asyncio.sleep(half)
            if idle:
                return
            await asyncio.sleep(delay)
            delay = min(2 * delay, longest)

    async def loads(self) -> dict[str, int]:
        return {w.id: w.load() for w in self._order}

    async def probe(self, worker: str, timeout_s: float, *, generate: bool = True) -> str | None:
        w = self._workers.get(worker)
        if w is None or w.state == "dead":
            return f"{worker}: connection refused"
        if w.state == "hung":
            await asyncio.sleep(timeout_s)
            return f"timeout: no answer from {worker} in {timeout_s} s"
        if generate and self.cfg.probe_queues:
            return await self._queued_probe(w, timeout_s)
        return None

    async def _queued_probe(self, w: SimWorker, timeout_s: float) -> str | None:
        """A one-token request at the back of `w`'s queue; dropped when not answered within
        `timeout_s` (the client closes the connection, the engine aborts it)."""
        loop = asyncio.get_running_loop()
        sample = Sample(index=-1, group_id=-1, prompt_ids=[TOKEN_ID])
        req = _Request(self._next_rid, sample, 1, 1, 0, loop.create_future(), loop.time(),
                       probe=True)
        self._next_rid += 1
        w.start()
        w.submit(req)
        try:
            await asyncio.wait_for(asyncio.shield(req.done), timeout_s)
        except asyncio.TimeoutError:
            w.cancel(req)
            return f"timeout: no answer from {w.id} in {timeout_s} s"
        except asyncio.CancelledError:
            w.cancel(req)
            raise
        if req.lost == "killed":
            return f"{w.id}: connection reset"
        return None

    async def progress(self, worker: str, timeout_s: float) -> int | None:
        """The worker's steps so far (`SimWorker.progress_mark`), read without queueing; a hung
        worker does not answer (None after `timeout_s`), a dead one refuses (None)."""
        w = self._workers.get(worker)
        if w is None or w.state == "dead":
            return None
        if w.state == "hung":
            await asyncio.sleep(timeout_s)
            return None
        return w.progress_mark()

    async def abort_worker(self, worker: str) -> int:
        w = self._workers.get(worker)
        return w.end_all("lost") if w is not None else 0

    async def remove_worker(self, worker: str) -> None:
        self._order = [w for w in self._order if w.id != worker]

    async def add_worker(self, worker: str) -> None:
        w = self._workers[worker]
        if w not in self._order:
            self._order.append(w)

    # -- faults (simulation-only) -------------------------------------------------------------
    def kill(self, worker: str) -> None:
        """The engine process dies: its streams break (tokens kept), connections are refused."""
        w = self._workers[worker]
        w.state = "dead"
        w.end_all("killed")
        w.freeze()
        w.state = "dead"

    def hang(self, worker: str) -> None:
        """The engine stops (SIGSTOP): requests never return, probes time out."""
        self._workers[worker].freeze()

    def respawn(self, worker: str) -> str:
        """A restart of `worker`'s engine: a fresh, idle worker under a new id (not serving
        until `add_worker`). What is left of the old one is ended."""
        old = self._workers[worker]
        old.end_all("lost")
        old.freeze()
        old.state = "dead"
        self._respawns += 1
        new = SimWorker(f"{worker.split('~')[0]}~{self._respawns}", self.cfg, old._observer, old._cpu)
        self._workers[new.id] = new
        self._all.append(new)
        return new.id

    # -- simulation-only ----------------------------------------------------------------------
    async def aclose(self) -> None:
        """Stop the worker loops (their requests must be finished or aborted first)."""
        for w in self._all:
            await w.stop()

    def stats(self) -> dict[str, WorkerStats]:
        return {w.id: w.stats.copy() for w in self._all}

    def drain_segments(self) -> list[Segment]:
        """Segments ended since the last call, in worker order (a step's timeline)."""
        out: list[Segment] = []
        for w in self._all:
            out += w.segments
            w.segments = []
        return out

    def _route(self, worker: str | None) -> SimWorker:
        if worker is not None:
            try:
                return self._workers[worker]
            except KeyError:
                raise EngineError(f"unknown worker {worker!r}") from None
        if not self._order:
            raise EngineError("no worker serves")
        if self.cfg.router == "least_load":
            return min(self._order, key=lambda w: w.load())  # first on ties
        w = self._order[self._next_rr % len(self._order)]
        self._next_rr += 1
        return w


class SimRestarter:
    """Restarts a simulated engine `delay_s` after it is asked (model loading)."""

    def __init__(self, engines: SimEngines, delay_s: float = 30.0) -> None:
        self.engines = engines
        self.delay_s = delay_s
        self.restarts: list[tuple[str, str]] = []  # (old, new)

    async def restart(self, worker: str) -> str:
        await asyncio.sleep(self.delay_s)
        new = self.engines.respawn(worker)
        self.restarts.append((worker, new))
        return new
