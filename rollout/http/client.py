"""EngineClient: the async HTTP client of generation, one instance per RolloutManager.

It implements `rollout.engine_api.Engines` (generate / abort_all / loads / workers, and the
fault calls probe / progress / abort_worker / remove_worker / add_worker; for the router's faults
probe_router / abort_routed / follow_router, through rollout.http.router.RouterProcessHandle).
Generation goes through the router, or straight to a worker when a dispatch policy picks one;
aborts fan out to each worker itself, because the router forwards no control call
(docs/engines.md). The calls around a weight update (pause, flush, weight updates, continue,
sleep and wake) have one client of their own, rlkit.common.engine_http, used by the rollout
side's EngineUpdates and the trainer's sender.

Retries are per endpoint (`RetryPolicy`, `DEFAULT_RETRY_POLICIES`):
- idempotent reads (the router's worker list, loads) and aborts retry on connection errors and
  5xx;
- `/generate` is retried only when the request never got an answer (connection refused, or a
  502/503 from the router before any token) and never once this client has aborted it; after
  the first token, a broken stream leaves the sample PARTIAL and raises EngineError, and the
  manager decides whether to resume it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import aiohttp

from rlkit.buffers.sample import Sample, SampleError, SampleStatus
from rlkit.common.weight_update import adapter_name, adapter_version
from rlkit.rollout.http.auth import auth_headers, control_token_from_env
from rlkit.rollout.config import SamplingConfig
from rlkit.rollout.engine_api import EngineError, RouterLost, WorkerLost
from rlkit.rollout.http.protocol import (
    ENGINE_URL_HEADER,
    LOADS_PATHS,
    MODEL_INFO_PATHS,
    GenerateRequest,
    ProtocolError,
    SamplingParams,
    error_message,
    is_abort_failure,
    new_output_entries,
    parse_output,
    progress_mark,
    SSEDecoder,
    total_requests,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """How one endpoint is retried. `attempts` counts the first try."""

    attempts: int = 1
    backoff_s: float = 0.2
    max_backoff_s: float = 2.0
    retry_statuses: frozenset[int] = frozenset()
    timeout_s: float | None = 30.0  # per attempt; None: no total timeout (long generations)

    def delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * (2 ** attempt))


_SERVER_ERRORS = frozenset({500, 502, 503, 504})
DEFAULT_RETRY_POLICIES: dict[str, RetryPolicy] = {
    "info": RetryPolicy(attempts=3, retry_statuses=_SERVER_ERRORS),
    "loads": RetryPolicy(attempts=3, retry_statuses=_SERVER_ERRORS, timeout_s=10.0),
    "abort": RetryPolicy(attempts=3, retry_statuses=_SERVER_ERRORS, timeout_s=10.0),
    "generate": RetryPolicy(attempts=3, backoff_s=0.5, retry_statuses=frozenset({502, 503}),
                            timeout_s=None),
}


class _NotFound(Exception):
    """A 404: the endpoint spelling does not exist on this server version."""


@dataclass
class _Inflight:
    """One /generate attempt in flight."""

    rid: str
    url: str
    routed: bool = False  # sent to the router (whose URL changes when it is restarted)
    aborted: bool = False  # this client aborted it: never re-submit
    tokens: int = 0  # tokens appended to the sample by this attempt
    served_by: str | None = None  # the worker, when the answer says (X-Engine-Url)
    task: asyncio.Task | None = None  # the task awaiting it (abort_worker cancels it)
    lost: str | None = None  # abort_worker ended it: the worker declared lost
    router_lost: bool = False  # abort_routed ended it: the router declared lost
    rescore: int = 0  # parked tokens the engine re-scores (max_resume_log_ratio); 0: none
    adapter: str | None = None  # the LoRA adapter it runs under (its tokens carry its version)


# An abort lands within a decode step: the first load check comes this soon after it, then the
# wait doubles up to EngineClient.abort_poll_interval_s.
ABORT_POLL_FIRST_S = 0.01


@dataclass
class EngineClient:
    """Async client of the router and its workers. Use as `async with EngineClient(...)`, or
    call `connect()` and `close()`. Not shared between event loops."""

    router_url: str | None
    worker_urls: Sequence[str] | None = None  # None: ask the router (GET /workers) on connect
    retry_policies: dict[str, RetryPolicy] = field(default_factory=lambda: dict(DEFAULT_RETRY_POLICIES))
    stream: bool = True  # stream /generate (partial tokens land on the sample as they arrive)
    abort_poll_interval_s: float = 0.2
    abort_timeout_s: float = 120.0
    sock_read_timeout_s: float = 3600.0  # longest silence tolerated inside one generation
    max_connections: int = 0  # 0: unlimited (the router is the throttle, not this client)
    # Registers and unregisters workers at the router (rollout.http.router.Router: add_worker /
    # remove_worker, blocking); None: remove/add_worker change only this client's list.
    router_admin: Any = None
    # The run's control token (rollout.http.auth), sent as `Authorization: Bearer` on every request:
    # engines and the router guard their control endpoints with it. Default: $RLKIT_CONTROL_TOKEN.
    control_token: str | None = field(default_factory=control_token_from_env)
    # rollout.max_resume_log_ratio: a resumed request asks the engine to re-score the parked
    # tokens (input logprobs from the prefill the resume does anyway) and records their mean
    # log-ratio on the sample; past the bound, the stream is cut at its first chunk (the
    # manager restarts the sample). None: no re-scoring.
    max_resume_log_ratio: float | None = None
    # Called after each applied chunk of a request through the router with the tokens streamed
    # through the router by this client so far (a test's fault switch kills the router then).
    on_routed_tokens: Callable[[int], None] | None = None
    # LoRA adapter sync (train.lora.sync: adapter): the adapter new requests name (lora_path),
    # set by the rollout side after each update; None: the engines' base weights (or merged).
    adapter: str | None = None
    # train.lora.resume 'own': a request for a sample that has tokens names the adapter of its
    # first token's version (version 0: the base, always there) when it is in `kept_adapters`
    # (set by the rollout side, which keeps it loaded), else `adapter` (a fallback, counted).
    resume_own_adapter: bool = False
    kept_adapters: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.router_url is None and not self.worker_urls:
            raise ValueError("EngineClient needs a router_url or worker_urls")
        self._session: aiohttp.ClientSession | None = None
        self._workers: list[str] = [u.rstrip("/") for u in (self.worker_urls or [])]
        self._inflight: dict[str, _Inflight] = {}
        self._abort_alls = 0  # abort_all calls so far: a request waiting to retry checks it
        self._prefix = [0, 0]  # (cached, prompt) tokens of the requests ended since the last read
        self._own = [0, 0]  # resume 'own': requests under an older own adapter, fallbacks
        self.routed_tokens = 0  # tokens streamed through the router (on_routed_tokens)
        # The router was declared lost (abort_routed) and not restarted yet (follow_router):
        # requests for it fail at once and its worker list is not touched.
        self._router_down = False
        self._router_losses = 0  # abort_routed calls so far: a request waiting to retry checks it
        if self.router_url:
            self.router_url = self.router_url.rstrip("/")

    # -- lifecycle ----------------------------------------------------------------------------
    async def connect(self) -> "EngineClient":
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, force_close=False),
                timeout=aiohttp.ClientTimeout(total=None),
                headers=auth_headers(self.control_token),
            )
        if not self._workers:
            await self.refresh_workers()
        return self

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "EngineClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise EngineError("EngineClient is not connected (use `async with` or connect())")
        return self._session

    # -- workers --------------------------------------------------------------------------------
    def workers(self) -> list[str]:
        return list(self._workers)

    async def refresh_workers(self) -> list[str]:
        """Re-read the worker list from the router (GET /workers)."""
        if self.router_url is None:
            return self.workers()
        body = await self._call("GET", self.router_url, "/workers", policy="info")
        self._workers = [w["url"].rstrip("/") for w in body.get("workers", [])]
        return self.workers()

    # -- plumbing -------------------------------------------------------------------------------
    async def _call(self, method: str, base: str, path: str, body: dict[str, Any] | None = None,
                    *, policy: str, params: dict[str, str] | None = None) -> Any:
        """One request with the endpoint's retry policy; returns the parsed JSON (or text).
        Raises _NotFound on 404 and EngineError on other failures."""
        p = self.retry_policies[policy]
        url = f"{base}{path}"
        last = ""
        for attempt in range(p.attempts):
            if attempt:
                await asyncio.sleep(p.delay(attempt - 1))
            try:
                timeout = aiohttp.ClientTimeout(total=p.timeout_s)
                async with self.session.request(method, url, json=body, params=params,
                                                timeout=timeout) as resp:
                    payload = await read_body(resp)
                    if resp.status == 404:
                        raise _NotFound(url)
                    if resp.status < 300:
                        return payload
                    last = f"HTTP {resp.status}: {error_message(payload) or payload}"
                    if resp.status not in p.retry_statuses:
                        break
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
        raise EngineError(f"{method} {url} failed after {attempt + 1} attempt(s): {last}")

    async def _call_first(self, method: str, base: str, paths: Iterable[str], *, policy: str,
                          body: dict[str, Any] | None = None) -> Any:
        """Try each spelling of an endpoint until one exists (version quirks, protocol.py)."""
        tried = []
        for path in paths:
            try:
                return await self._call(method, base, path, body, policy=policy)
            except _NotFound:
                tried.append(path)
        raise EngineError(f"{base} has none of the endpoints {tried}")

    async def _fanout(self, method: str, path: str, body: dict[str, Any] | None, *, policy: str,
                      workers: Sequence[str] | None = None) -> dict[str, Any]:
        """The same call to every worker at once; EngineError names every worker that failed."""
        targets = list(workers if workers is not None else self._workers)
        if not targets:
            raise EngineError(f"no workers to send {path} to")
        results = await asyncio.gather(
            *(self._call(method, w, path, body, policy=policy) for w in targets),
            return_exceptions=True,
        )
        failures = {w: r for w, r in zip(targets, results) if isinstance(r, BaseException)}
        if failures:
            detail = "; ".join(f"{w}: {r}" for w, r in failures.items())
            raise EngineError(f"{path} failed on {len(failures)}/{len(targets)} workers: {detail}")
        return dict(zip(targets, results))

    # -- Engines: generate -------------------------------------------------------------------
    def build_request(self, sample: Sample, sampling: SamplingConfig, max_new_tokens: int,
                      rid: str, *, stream: bool, rescore: bool = False,
                      adapter: str | None = None) -> dict[str, Any]:
        """The /generate body for `sample`: prompt + response so far as input_ids, the rest of
        the token budget, min_new_tokens reduced by what was already generated. `rescore`: the
        engine also scores the response so far (input_token_logprobs of every response token:
        SGLang scores the tokens after position logprob_start_len)."""
        have = len(sample.response_ids)
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            min_new_tokens=min(max(0, sampling.min_new_tokens - have), max_new_tokens),
            temperature=float(sampling.temperature),
            top_p=float(sampling.top_p),
            top_k=int(sampling.top_k),
            stop=list(sampling.stop) or None,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            ignore_eos=bool(sampling.ignore_eos),
        )
        req = GenerateRequest(input_ids=[int(t) for t in sample.input_ids()], sampling_params=params,
                              rid=rid, stream=stream, return_logprob=True,
                              logprob_start_len=len(sample.prompt_ids) - 1 if rescore else -1,
                              lora_path=adapter)
        return req.payload()

    def adapter_for(self, sample: Sample) -> str | None:
        """The LoRA adapter a request for `sample` names: `adapter`, or under resume 'own' the
        one its response began under while that one is kept."""
        version = sample.oldest_version()
        if not self.resume_own_adapter or version is None:
            return self.adapter
        own = adapter_name(version) if version > 0 else None  # v0: the base, B = 0
        if own == self.adapter:
            return own
        if own is None or own in self.kept_adapters:
            self._own[0] += 1
            return own
        self._own[1] += 1
        return self.adapter

    def own_adapter_metrics(self) -> dict[str, float]:
        """resume 'own': requests since the last call that ran under an older adapter (the one
        their sample began under) and those whose adapter was gone (under the newest)."""
        if not self.resume_own_adapter:
            return {}
        (own, fallback), self._own = self._own, [0, 0]
        return {"rollout/own_adapter_requests": float(own),
                "rollout/own_adapter_fallbacks": float(fallback)}

    def adapters_in_use(self) -> dict[str, int]:
        """Requests in flight by the LoRA adapter they name (an adapter still named must stay
        loaded: rollout side's unloads wait for it)."""
        counts: dict[str, int] = {}
        for f in self._inflight.values():
            if f.adapter is not None:
                counts[f.adapter] = counts.get(f.adapter, 0) + 1
        return counts

    async def generate(self, sample: Sample, sampling: SamplingConfig, *, max_new_tokens: int,
                       version: int, worker: str | None = None) -> str | None:
        """See `Engines.generate`. Returns the serving worker's URL: `worker` when given, else
        what the answer's X-Engine-Url header says (rlkit's hf engine sends it; real SGLang does
        not: None). Records the request id in `sample.metadata["rid"]`. On EngineError or task
        cancellation the sample is left interrupted (PARTIAL with what arrived, or PENDING),
        never FAILED: the caller decides."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 (the caller settles a sample whose "
                             f"budget is spent), got {max_new_tokens}")
        if worker is None and self.router_url is None:
            raise EngineError("generate without a router needs a worker URL")
        policy = self.retry_policies["generate"]
        # a parked response resumes: re-score its tokens under the weights it resumes with
        rescore = (len(sample.response_ids) if self.max_resume_log_ratio is not None
                   and sample.status is SampleStatus.PARTIAL else 0)
        sample.start_request()
        adapter = self.adapter_for(sample)
        abort_alls, router_losses = self._abort_alls, self._router_losses
        last = ""
        for attempt in range(policy.attempts):
            if attempt:
                await asyncio.sleep(policy.delay(attempt - 1))
                if self._abort_alls != abort_alls:  # aborted while waiting: never re-submit
                    sample.interrupt()
                    return worker
            if worker is None and (self._router_down or self._router_losses != router_losses):
                sample.interrupt()  # lost while waiting (or before): sent again once it is back
                raise RouterLost()
            # the router's URL is read at each attempt: a restarted router has a new one
            base = (worker or self.router_url or "").rstrip("/")
            rid = uuid.uuid4().hex
            sample.metadata["rid"] = rid
            flight = _Inflight(rid=rid, url=base, routed=worker is None,
                               task=asyncio.current_task(), rescore=rescore, adapter=adapter)
            self._inflight[rid] = flight
            try:
                outcome = await self._generate_once(sample, sampling, max_new_tokens, version,
                                                    flight)
            except asyncio.CancelledError:
                # Closing the connection makes the router (or the engine) drop the request.
                flight.aborted = True
                sample.interrupt()
                task = asyncio.current_task()
                if ((flight.lost is not None or flight.router_lost) and task is not None
                        and task.uncancel() == 0):  # our cancel (abort_worker/_routed) alone
                    raise (RouterLost() if flight.router_lost else WorkerLost(flight.lost)) from None
                raise
            finally:
                self._inflight.pop(rid, None)
            if outcome is None:
                return worker or flight.served_by
            last = outcome  # a failure before any token: retryable unless aborted
            if flight.aborted:
                sample.interrupt()
                return worker or flight.served_by
        sample.interrupt()
        raise EngineError(f"/generate at {base} failed after {policy.attempts} attempt(s): {last}",
                          worker)

    async def _generate_once(self, sample: Sample, sampling: SamplingConfig, max_new_tokens: int,
                             version: int, flight: _Inflight) -> str | None:
        """One attempt. Returns None when the sample got its outcome (finished, aborted), or a
        message when the request failed before anything was generated (may be retried).
        Raises EngineError for failures that must not be retried."""
        body = self.build_request(sample, sampling, max_new_tokens, flight.rid, stream=self.stream,
                                  rescore=flight.rescore > 0, adapter=flight.adapter)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=self.sock_read_timeout_s)
        try:
            async with self.session.post(f"{flight.url}/generate", json=body, timeout=timeout) as resp:
                flight.served_by = resp.headers.get(ENGINE_URL_HEADER)
                if resp.status != 200:
                    payload = await read_body(resp)
                    if flight.aborted or is_abort_failure(resp.status, payload):
                        sample.interrupt()
                        return None
                    msg = f"HTTP {resp.status}: {error_message(payload) or payload}"
                    if resp.status in self.retry_policies["generate"].retry_statuses:
                        return msg
                    sample.interrupt()
                    raise EngineError(f"/generate at {flight.url} (rid {flight.rid}) refused: {msg}")
                if self.stream:
                    return await self._consume_stream(resp, sample, version, flight)
                payload = await read_body(resp)
                self._apply_chunk(sample, payload, 0, version, flight)
                if sample.status is SampleStatus.RUNNING:
                    sample.interrupt()
                    raise EngineError(f"/generate at {flight.url} answered without a finish reason")
                return None
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            if flight.aborted:
                sample.interrupt()
                return None
            if flight.tokens == 0:
                return f"{type(e).__name__}: {e}"
            sample.interrupt()
            raise EngineError(f"/generate at {flight.url} (rid {flight.rid}) broke after tokens "
                              f"arrived: {type(e).__name__}: {e}",
                              flight.served_by or _worker_of(flight)) from None

    async def _consume_stream(self, resp: aiohttp.ClientResponse, sample: Sample, version: int,
                              flight: _Inflight) -> str | None:
        received = 0
        decoder = SSEDecoder()
        async for block in resp.content.iter_any():
            try:
                payloads = decoder.feed(block)
            except ProtocolError as e:
                sample.interrupt()
                raise EngineError(f"/generate stream from {flight.url}: {e}") from None
            for payload in payloads:
                received = self._apply_chunk(sample, payload, received, version, flight)
                if sample.status is not SampleStatus.RUNNING:
                    return None  # finished or aborted
        # The stream closed without a finish reason: the worker died or the router gave up.
        sample.interrupt()
        if flight.aborted:
            return None
        if flight.tokens == 0:
            return "stream closed before any token"
        raise EngineError(f"/generate stream from {flight.url} (rid {flight.rid}) ended without a "
                          f"finish reason after {received} tokens",
                          flight.served_by or _worker_of(flight))

    def _apply_chunk(self, sample: Sample, payload: Any, received: int, version: int,
                     flight: _Inflight) -> int:
        """Append the new tokens of one answer/chunk to the sample; apply its finish reason.
        Returns the number of tokens received so far in this request."""
        if not isinstance(payload, dict):
            raise EngineError(f"/generate at {flight.url} answered {str(payload)[:200]!r}")
        err = error_message(payload)
        if err is not None and "meta_info" not in payload:
            sample.interrupt()
            if flight.aborted or "abort" in err.lower():
                return received
            raise EngineError(f"/generate at {flight.url} (rid {flight.rid}) failed: {err}")
        try:
            chunk = parse_output(payload)
            ids, lps = new_output_entries(chunk, received)
        except ProtocolError as e:
            sample.interrupt()
            raise EngineError(f"/generate at {flight.url}: {e}") from None
        if flight.rescore and chunk.input_logprobs:
            self._rescore(sample, chunk.input_logprobs, flight)
            if sample.status is not SampleStatus.RUNNING:
                return received  # past the bound: cut here, nothing of this chunk is kept
        # an adapter's request is generated by that adapter's policy version alone, whatever the
        # engine's own (base) weight version says
        lora_version = adapter_version(flight.adapter) if flight.adapter is not None else None
        stamped = lora_version if lora_version is not None else chunk.weight_version_int(version)
        if ids:
            if len(lps) != len(ids):
                sample.interrupt()
                raise EngineError(f"/generate at {flight.url} returned tokens without logprobs "
                                  "(return_logprob is required)")
            try:
                sample.append(ids, lps, stamped)
            except SampleError as e:
                sample.interrupt()
                raise EngineError(f"/generate at {flight.url}: {e}") from None
            received += len(ids)
            flight.tokens += len(ids)
            if flight.routed:
                self.routed_tokens += len(ids)
                if self.on_routed_tokens is not None:
                    self.on_routed_tokens(self.routed_tokens)
        try:
            exact = None if lora_version is not None else chunk.versions_by_token(version, received)
            if exact is not None:  # the final chunk: its spans replace the chunks' own stamps
                sample.restamp(len(sample.response_ids) - received, exact)
        except (ProtocolError, SampleError) as e:
            sample.interrupt()
            raise EngineError(f"/generate at {flight.url}: {e}") from None
        finish = chunk.finish
        if finish is not None:
            self._count_prefix(payload["meta_info"])
            if finish.type == "abort":
                if finish.status_code and finish.status_code >= 500 and not flight.aborted:
                    sample.interrupt()
                    raise EngineError(f"engine at {flight.url} aborted rid {flight.rid}: "
                                      f"{finish.message}")
                sample.interrupt()
            elif finish.type in ("stop", "length"):
                sample.append([], [], stamped, finish_reason=finish.type)
            else:
                sample.interrupt()
                raise EngineError(f"unknown finish reason {finish.type!r} from {flight.url}")
        return received

    def _count_prefix(self, meta: dict[str, Any]) -> None:
        """A request's prompt tokens and, of those, the ones its engine found in its prefix
        cache (SGLang's meta_info cached_tokens; rlkit's built-in engine has no prefix cache
        and reports 0), read from its last answer or chunk."""
        cached, prompt = meta.get("cached_tokens"), meta.get("prompt_tokens")
        if isinstance(cached, int) and isinstance(prompt, int) and prompt > 0:
            self._prefix[0] += min(cached, prompt)
            self._prefix[1] += prompt

    def prefix_cache_metrics(self) -> dict[str, float]:
        """`rollout/prefix_hit_rate` (cached prompt tokens / prompt tokens) and its two counts
        over the requests ended since the last call, which starts the next count; {} when none
        reported them. Multi-turn episodes and resumed partials resend a prefix an engine has
        seen: cache-aware routing (rollout.router.policy) is what lets them hit it."""
        (cached, prompt), self._prefix = self._prefix, [0, 0]
        if not prompt:
            return {}
        return {"rollout/prefix_hit_rate": cached / prompt, "rollout/prefix_cached_tokens": float(cached),
                "rollout/prefix_prompt_tokens": float(prompt)}

    def _rescore(self, sample: Sample, scored: tuple[tuple[float | None, int], ...],
                 flight: _Inflight) -> None:
        """The engine's input_token_logprobs for a resumed request: its last `flight.rescore`
        entries score the parked tokens (a one-token prompt adds a None entry before them). Past
        max_resume_log_ratio the request is cut now, before it decodes further: the sample is
        left interrupted (its parked tokens kept) for the manager to restart."""
        n, flight.rescore = flight.rescore, 0  # once per request: later chunks repeat it
        entries = scored[-n:]
        if len(entries) != n or [t for _, t in entries] != sample.response_ids[:n]:
            sample.interrupt()
            raise EngineError(f"/generate at {flight.url} (rid {flight.rid}): input_token_logprobs "
                              f"do not score the {n} resumed tokens (got {len(scored)} entries)")
        sample.rescore([lp for lp, _ in entries])
        if sample.rescored_past(self.max_resume_log_ratio):
            flight.aborted = True  # leaving the stream closes it: the engine drops the request
            sample.interrupt()

    # -- Engines: abort and loads ---------------------------------------------------------------
    async def abort(self, rid: str) -> None:
        """Abort one request (by the rid in `sample.metadata["rid"]`) on every worker: with the
        router in front, this client does not know which worker holds it."""
        flight = self._inflight.get(rid)
        if flight is not None:
            flight.aborted = True
        await self._fanout("POST", "/abort_request", {"rid": rid}, policy="abort")

    async def abort_all(self) -> None:
        """Abort everything on every worker, repeating until each reports itself idle."""
        self._abort_alls += 1
        for flight in self._inflight.values():
            flight.aborted = True
        await asyncio.gather(*(self._abort_until_idle(w) for w in self._workers))

    async def _abort_until_idle(self, worker: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.abort_timeout_s
        delay = ABORT_POLL_FIRST_S
        while True:
            try:
                await self._call("POST", worker, "/abort_request", {"rid": "", "abort_all": True},
                                 policy="abort")
                left = await self.worker_load(worker)
            except EngineError as e:
                if worker not in self._workers:
                    return  # lost meanwhile (rollout.health): abort_worker ended our requests
                e.worker = worker
                raise
            if left == 0:
                return
            if loop.time() > deadline:
                raise EngineError(f"{worker} still has {left} requests {self.abort_timeout_s:.0f} s "
                                  "after abort_all")
            # An abort lands within a decode step: check again soon, then back off, so a short
            # step does not pay a whole poll interval (it did: 0.2 s on 0.3 s CPU steps).
            await asyncio.sleep(delay)
            delay = min(2 * delay, self.abort_poll_interval_s)

    async def worker_load(self, worker: str) -> int:
        body = await self._call_first("GET", worker, LOADS_PATHS, policy="loads")
        try:
            return total_requests(body)
        except ProtocolError as e:
            raise EngineError(f"{worker}: {e}") from None

    async def loads(self) -> dict[str, int]:
        counts = await asyncio.gather(*(self.worker_load(w) for w in self._workers))
        return dict(zip(self._workers, counts))

    # -- Engines: faults (rollout.health) ---------------------------------------------------------
    async def probe(self, worker: str, timeout_s: float, *, generate: bool = True) -> str | None:
        """A one-token /generate sent straight to `worker` (an engine can answer /health with
        a stuck scheduler). None when it answered in time. `generate=False`: GET /model_info,
        which SGLang's HTTP process answers without its scheduler (a paused or sleeping engine
        queues generations)."""
        body = GenerateRequest(input_ids=[0], sampling_params=SamplingParams(max_new_tokens=1),
                               rid=f"probe-{uuid.uuid4().hex}", stream=False).payload()
        method, path = ("POST", "/generate") if generate else ("GET", MODEL_INFO_PATHS[0])
        try:
            async with self.session.request(method, f"{worker}{path}", json=body if generate else None,
                                            timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                payload = await read_body(resp)
                if resp.status != 200:
                    return f"HTTP {resp.status}: {error_message(payload) or payload}"
                return None
        except asyncio.TimeoutError:
            return f"timeout: no answer from {worker} in {timeout_s:g} s"
        except aiohttp.ClientError as e:
            return f"{type(e).__name__}: {e}"

    async def score(self, worker: str, input_ids: Sequence[int], *, temperature: float,
                    adapter: str | None = None, timeout_s: float = 120.0) -> list[float]:
        """The logprob of each input token after the first, as `worker` scores it (straight,
        not through the router; under LoRA adapter `adapter`; at `temperature`): the weight-sync
        check's probe (train.weight_sync.verify). Raises EngineError when it cannot. An answer
        aborted before its prefill (a rollout step ending meanwhile aborts every request on the
        engines, in async mode) is asked again."""
        for _ in range(5):
            body = GenerateRequest(
                input_ids=[int(t) for t in input_ids], stream=False, return_logprob=True,
                logprob_start_len=0, rid=f"verify-{uuid.uuid4().hex}", lora_path=adapter,
                sampling_params=SamplingParams(max_new_tokens=1, temperature=float(temperature)),
            ).payload()
            try:
                async with self.session.post(f"{worker}/generate", json=body,
                                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                    payload = await read_body(resp)
                    if resp.status != 200 and not is_abort_failure(resp.status, payload):
                        raise EngineError(f"{worker}: scoring the probe: HTTP {resp.status}: "
                                          f"{error_message(payload) or payload}", worker)
            except (asyncio.TimeoutError, aiohttp.ClientError) as e:
                raise EngineError(f"{worker}: scoring the probe: {type(e).__name__}: {e}", worker) from None
            try:
                chunk = parse_output(payload) if resp.status == 200 else None
            except ProtocolError as e:
                raise EngineError(f"{worker}: scoring the probe: {e}", worker) from None
            if chunk is not None and (chunk.finish is None or chunk.finish.type != "abort"
                                      or chunk.input_logprobs):
                break
            why = chunk.finish.message if chunk is not None and chunk.finish else error_message(payload)
        else:
            raise EngineError(f"{worker}: scoring the probe: aborted 5 times (last: {why})", worker)
        values = [lp for lp, _ in (chunk.input_logprobs or ()) if lp is not None]
        if len(values) != len(input_ids) - 1:
            raise EngineError(f"{worker}: scored {len(values)} of the probe's {len(input_ids) - 1} "
                              "tokens", worker)
        return values

    async def progress(self, worker: str, timeout_s: float) -> int | None:
        """GET /v1/loads (or /get_load) straight from `worker`, one attempt within `timeout_s`:
        its progress mark (`protocol.progress_mark`: the schedulers' last report times). Both
        engines answer it without waiting for their scheduler: SGLang's HTTP process reads the
        snapshot its scheduler last wrote to shared memory, the built-in server asks its core's
        command thread. None when it did not answer in time (a stopped process), failed, or
        reports no mark."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for path in LOADS_PATHS:
            left = deadline - loop.time()
            if left <= 0:
                return None
            try:
                async with self.session.get(f"{worker}{path}",
                                            timeout=aiohttp.ClientTimeout(total=left)) as resp:
                    if resp.status == 404:
                        continue  # the other spelling
                    body = await read_body(resp)
                    return progress_mark(body) if resp.status == 200 else None
            except (asyncio.TimeoutError, aiohttp.ClientError):
                return None
        return None

    async def abort_worker(self, worker: str) -> int:
        """End (client side) every request that is or may be on `worker`: those it serves, and
        those the router has not answered yet (a hung engine never does). The router closes
        the upstream request when the connection closes."""
        ended = 0
        for flight in list(self._inflight.values()):
            if flight.aborted or flight.task is None or flight.task.done():
                continue
            if flight.router_lost or flight.lost is not None:
                continue  # ended already: a second cancel would cancel the sample's task
            if _worker_of(flight) in (worker, None):
                flight.lost = worker
                flight.task.cancel()
                ended += 1
        return ended

    async def remove_worker(self, worker: str) -> None:
        worker = worker.rstrip("/")
        if worker in self._workers:
            self._workers.remove(worker)
        if self.router_admin is not None and not self._router_down:
            await asyncio.to_thread(self.router_admin.remove_worker, worker)

    async def add_worker(self, worker: str) -> None:
        """Listed here first, then at the router: a router that is down fails the second, and
        its restart registers every worker this client lists (rollout.health)."""
        worker = worker.rstrip("/")
        if worker not in self._workers:
            self._workers.append(worker)
        if self.router_admin is not None and not self._router_down:
            await asyncio.to_thread(self.router_admin.add_worker, worker)

    # -- the router's faults (rollout.health, RouterHandle) ------------------------------------
    async def probe_router(self, timeout_s: float) -> str | None:
        """GET the router's /health: None when it answered in time, whatever its status (the
        engines behind it are probed on their own); else why not ('timeout: ...' when it did
        not answer in time: a stopped router accepts connections and says nothing)."""
        if self.router_url is None:
            return "no router"
        url = f"{self.router_url}/health"
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                await resp.read()
                return None
        except asyncio.TimeoutError:
            return f"timeout: no answer from {url} in {timeout_s:g} s"
        except aiohttp.ClientError as e:
            return f"{type(e).__name__}: {e}"

    async def abort_routed(self) -> int:
        """The router was lost: end (client side) every request that went through it, each
        raising RouterLost with its sample interrupted (tokens kept); until `follow_router`,
        a request for the router raises RouterLost at once. Returns how many were ended."""
        self._router_down = True
        self._router_losses += 1
        ended = 0
        for flight in list(self._inflight.values()):
            if (not flight.routed or flight.aborted or flight.lost is not None or flight.router_lost
                    or flight.task is None or flight.task.done()):
                continue
            flight.router_lost = True
            flight.task.cancel()
            ended += 1
        return ended

    def follow_router(self, url: str) -> None:
        """The router was restarted at `url`: requests through it go there from now on."""
        self.router_url = url.rstrip("/")
        self._router_down = False


def _worker_of(flight: _Inflight) -> str | None:
    """The worker a request is on: the one it was sent to, or the one the answer named; None
    while the router has not answered."""
    if not flight.routed:
        return flight.url
    return flight.served_by.rstrip("/") if flight.served_by else None


async def read_body(resp: aiohttp.ClientResponse) -> Any:
    raw = await resp.read()
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
