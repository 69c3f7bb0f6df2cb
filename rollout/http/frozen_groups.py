"""Frozen engine groups (rollout.frozen_engines): engines serving a frozen model beside the
policy's, a teacher that scores samples or a judge that reward plugins call (docs/frozen-engines.md).

A `FrozenGroup` is one group as its callers see it: its router's URL (through its EngineClient,
which follows a restarted router), its health monitor (the policy's EngineMonitor, with no
weights to wait for: a restarted frozen engine serves at once), and the limits every request to
it passes: `max_concurrency` in flight, `requests_per_minute`, `timeout_s` per try, `retries`.
Each request is counted (requests, seconds, retries, failures by kind); a request that fails
every try raises `FrozenCallFailed`. No weight update ever reaches a group: the rollout side's
EngineUpdates is given the policy's engines only, and nothing here sends one.

Reward plugins find a group by name with `engine_group(name)` (re-exported by rlkit.rewards):
the groups of the run register themselves in the rollout actor's process when they start.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from typing import Any, Awaitable, Callable, Sequence, TypeVar

import aiohttp

from rlkit.rollout.config import FrozenEnginesConfig
from rlkit.rollout.engine_api import EngineError
from rlkit.rollout.health import EngineMonitor
from rlkit.rollout.http.client import EngineClient, read_body
from rlkit.rollout.http.protocol import (
    GenerateRequest,
    ProtocolError,
    SamplingParams,
    error_message,
    parse_output,
)
from rlkit.rollout.timeline import Span

T = TypeVar("T")
# FrozenGroup.failures' kinds; metrics frozen/<name>/failures/<kind>
FROZEN_FAILURE_KINDS = ("error", "timeout", "bad_output")


class FrozenCallFailed(RuntimeError):
    """A request to a frozen group failed every try (`kind`: the last failure's)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class BadOutput(ValueError):
    """A frozen engine answered, but not what the caller can use (a parser's verdict)."""


class RateLimit:
    """A token bucket: `per_minute` requests a minute, at most a second's worth at once."""

    def __init__(self, per_minute: float, clock: Callable[[], float] | None = None) -> None:
        self.rate = per_minute / 60.0
        self.capacity = max(1.0, self.rate)
        self.tokens = self.capacity
        self._clock = clock
        self._last: float | None = None
        self._lock = asyncio.Lock()

    def _now(self) -> float:
        return self._clock() if self._clock else asyncio.get_running_loop().time()

    async def take(self) -> None:
        if self.rate <= 0:
            return
        async with self._lock:  # first come, first served
            while True:
                now = self._now()
                if self._last is not None:
                    self.tokens = min(self.capacity, self.tokens + (now - self._last) * self.rate)
                self._last = now
                if self.tokens >= 1:
                    self.tokens -= 1
                    return
                await asyncio.sleep((1 - self.tokens) / self.rate)


class FrozenGroup:
    def __init__(self, name: str, cfg: FrozenEnginesConfig, client: EngineClient,
                 monitor: EngineMonitor | None = None) -> None:
        self.name = name
        self.cfg = cfg
        self.client = client
        self.monitor = monitor
        self._slots = asyncio.Semaphore(cfg.max_concurrency)
        self._rate = RateLimit(cfg.requests_per_minute)
        self.requests = 0  # answered
        self.seconds = 0.0  # summed over answered requests, waiting for a turn excluded
        self.retries = 0
        self.failures: Counter[str] = Counter()  # every failed try, by kind
        self.failed_calls = 0  # calls that failed every try
        self.waiting = 0  # calls waiting for a turn now
        # weight versions the group's answers carried: one, ever (frozen), unless something sent
        # its engines a weight update, which nothing in rlkit does (the e2e tests check it)
        self.weight_versions: set[str] = set()
        self.spans: list[Span] = []  # every try, for the step's timeline (take_spans)

    # -- the one request path ---------------------------------------------------------------
    async def call(self, what: str, fn: Callable[[str], Awaitable[T]],
                   sample: tuple[int, int] | None = None, tokens: int = 0) -> T:
        """`fn(router_url)` under the group's limits and retries; `what` names it in errors.
        Before each try the group must route and serve (its monitor waits for a restart; a
        group that cannot come back raises EnginesDown); after a failed try its engines and
        router are probed at once, so a lost one is found before the retry. Each try is a
        span of the step's timeline (`spans`) on the lane frozen:<name>, for `sample`
        ((group_id, sample index)) when given, with `tokens`."""
        loop = asyncio.get_running_loop()
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        try:
            why, kind = "", "error"
            for attempt in range(self.cfg.retries + 1):
                await self._rate.take()
                if self.monitor is not None:
                    await self.monitor.wait_routing()
                    await self.monitor.wait_serving()
                if attempt:
                    self.retries += 1
                url = self.client.router_url or self.client.workers()[0]
                t0 = loop.time()
                try:
                    out = await asyncio.wait_for(fn(url), self.cfg.timeout_s)
                except asyncio.CancelledError:
                    self._span(sample, t0, loop.time(), tokens, "cancelled")
                    raise
                except asyncio.TimeoutError:
                    kind, why = "timeout", f"no answer within {self.cfg.timeout_s:g} s"
                except BadOutput as e:
                    kind, why = "bad_output", str(e)
                except (EngineError, ProtocolError, aiohttp.ClientError, OSError) as e:
                    kind, why = "error", f"{type(e).__name__}: {e}"
                else:
                    self.requests += 1
                    self.seconds += loop.time() - t0
                    self._span(sample, t0, loop.time(), tokens, "scored")
                    return out
                self.failures[kind] += 1
                self._span(sample, t0, loop.time(), tokens, kind)
                if self.monitor is not None and kind != "bad_output":
                    await asyncio.gather(self.monitor.check(), self.monitor.check_router(),
                                         return_exceptions=True)
            self.failed_calls += 1
            raise FrozenCallFailed(f"frozen engine group {self.name!r}: {what} failed "
                                   f"{self.cfg.retries + 1} times (last: {kind}: {why})", kind)
        finally:
            self._slots.release()

    def _span(self, sample: tuple[int, int] | None, start: float, end: float, tokens: int,
              outcome: str) -> None:
        group_id, index = sample if sample is not None else (-1, -1)
        self.spans.append(Span(f"frozen:{self.name}", group_id, index, start, end, tokens, outcome))

    def take_spans(self) -> list[Span]:
        """The tries since the last call (the rollout service puts them in its step's timeline)."""
        spans, self.spans = self.spans, []
        return spans

    async def _post(self, url: str, body: dict[str, Any]) -> Any:
        async with self.client.session.post(f"{url}/generate", json=body) as resp:
            payload = await read_body(resp)
            if resp.status != 200:
                raise EngineError(f"HTTP {resp.status}: {error_message(payload) or payload}")
        return payload

    # -- what callers ask ---------------------------------------------------------------------
    async def score(self, input_ids: Sequence[int], start: int, *, temperature: float,
                    sample: tuple[int, int] | None = None) -> list[float]:
        """The group's logprob of each of `input_ids[start:]` given the tokens before it, at
        `temperature` (logits / temperature, as the rollout logprobs): one prefill request
        (SGLang's logprob_start_len = start - 1; SGLang serves it with max_new_tokens 0, the
        built-in engine asks one decoded token more)."""
        if not 1 <= start < len(input_ids):
            raise ValueError(f"score: start {start} outside [1, {len(input_ids)})")
        body = GenerateRequest(
            input_ids=[int(t) for t in input_ids], stream=False, return_logprob=True,
            logprob_start_len=start - 1, rid=f"{self.name}-{uuid.uuid4().hex}",
            sampling_params=SamplingParams(max_new_tokens=0 if self.cfg.engine.kind == "sglang" else 1,
                                           temperature=float(temperature)),
        ).payload()
        want = len(input_ids) - start

        async def once(url: str) -> list[float]:
            chunk = parse_output(await self._post(url, body))
            if chunk.weight_version is not None:
                self.weight_versions.add(chunk.weight_version)
            values = [lp for lp, _ in (chunk.input_logprobs or ()) if lp is not None]
            if len(values) != want:
                raise BadOutput(f"scored {len(values)} of {want} tokens")
            return values

        return await self.call("scoring", once, sample, len(input_ids))

    async def generate_text(self, prompt: str, *, max_new_tokens: int = 64,
                            temperature: float = 0.0, stop: Sequence[str] = (),
                            parse: Callable[[str], Any] | None = None,
                            sample: tuple[int, int] | None = None) -> Any:
        """The group's completion of `prompt` (text in, text out; a judge's verdict), or what
        `parse` makes of it: a ValueError from `parse` is a bad output, retried and counted."""
        body = GenerateRequest(
            text=prompt, stream=False, rid=f"{self.name}-{uuid.uuid4().hex}",
            sampling_params=SamplingParams(max_new_tokens=max_new_tokens,
                                           temperature=float(temperature), stop=list(stop) or None),
        ).payload()

        async def once(url: str) -> str:
            payload = await self._post(url, body)
            if not isinstance(payload, dict) or not isinstance(payload.get("text"), str):
                raise BadOutput(f"no text in the answer: {str(payload)[:200]}")
            version = (payload.get("meta_info") or {}).get("weight_version")
            if version is not None:
                self.weight_versions.add(str(version))
            if parse is None:
                return payload["text"]
            try:
                return parse(payload["text"])
            except ValueError as e:
                raise BadOutput(str(e)) from None

        return await self.call("generation", once, sample, max_new_tokens)

    # -- reporting -----------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """Totals since the run started, under frozen/<name>/ (the service reports per-step
        differences of requests, seconds and retries); the monitor's engine and router counts."""
        p = f"frozen/{self.name}"
        out = {f"{p}/requests": float(self.requests), f"{p}/seconds": self.seconds,
               f"{p}/retries": float(self.retries), f"{p}/failed_calls": float(self.failed_calls),
               f"{p}/weight_versions_seen": float(len(self.weight_versions)),
               **{f"{p}/failures/{k}": float(self.failures[k]) for k in FROZEN_FAILURE_KINDS}}
        if self.monitor is not None:
            out.update({f"{p}/{k}": v for k, v in self.monitor.metrics().items()})
        return out


# The run's groups in this process (the rollout actor's), for reward plugins: engine_group(name)
_GROUPS: dict[str, FrozenGroup] = {}


def register(group: FrozenGroup) -> None:
    _GROUPS[group.name] = group


def unregister(name: str) -> None:
    _GROUPS.pop(name, None)


def engine_group(name: str) -> FrozenGroup:
    """The run's frozen engine group `name` (rollout.frozen_engines), for a reward plugin
    running in the rollout actor (async rewards run there; a sync one in a worker process
    cannot reach it)."""
    try:
        return _GROUPS[name]
    except KeyError:
        known = sorted(_GROUPS) or "none"
        raise KeyError(f"no frozen engine group {name!r} in this run (groups: {known}); declare "
                       "it under rollout.frozen_engines") from None
