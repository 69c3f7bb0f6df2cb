"""Lifecycle of the real `sglang-router` process (sglang-router 0.3.2, see docs/facts.md).

    with Router(RouterConfig()) as router:
        router.start([engine.url for engine in engines])
        router.add_worker(url); router.remove_worker(url); router.list_workers()

The router runs as `python -m sglang_router.launch_router` in its own process group, with an
explicit port and metrics port (its default metrics port 29000 collides between jobs). It only
forwards `/generate` (and the OpenAI routes); control calls go to each worker (EngineClient).
Registration is asynchronous on the router side (POST /workers answers 202), so `add_worker`
waits until the worker is listed. These calls are rare and short, so they are synchronous.

A lost router is restarted (`restart`) by rollout.health through `RouterProcessHandle`, which
also moves the EngineClient to its new URL. Under the run's control token the router runs inside
token_exec with `--parent-pid`: if the process that started it dies (the rollout actor), the
router's process group is killed, so no router outlives its run.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from rlkit.common.errors import UserError
from rlkit.rollout.http.auth import ControlTokenMissing, auth_headers, check_bind, control_token_from_env
from rlkit.rollout.engines.config import RouterConfig
from rlkit.rollout.engines.process import (
    ManagedProcess,
    ProcessStartError,
    free_port,
    http_ok,
    log_tail,
    port_is_free,
    spawn,
)
from rlkit.rollout.http.token_exec import TOKEN_PLACEHOLDER

if TYPE_CHECKING:
    from rlkit.rollout.http.client import EngineClient


class RouterError(UserError, RuntimeError):
    """The router cannot be started, reached, or asked to change its workers."""


@dataclass(frozen=True)
class RouterWorker:
    id: str
    url: str
    is_healthy: bool
    load: int
    model_id: str | None = None


def _request(method: str, url: str, body: dict[str, Any] | None = None,
             timeout: float = 10.0, token: str | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json",
                                          **auth_headers(token)})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        raise RouterError(f"{method} {url} failed: {e}") from None
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode(errors="replace")


class Router:
    """One sglang-router process. Not thread-safe; one owner."""

    def __init__(self, config: RouterConfig | None = None, *, log_path: Path | None = None) -> None:
        self.config = config or RouterConfig()
        self.log_path = log_path
        self.process: ManagedProcess | None = None
        self.port: int | None = None
        self.prometheus_port: int | None = None
        # With the run's control token, the router's control plane (/workers, /flush_cache)
        # answers 401 without it (--control-plane-api-keys), and so does /generate (--api-key),
        # which it also sends to the engines on every request and probe (they need it: see
        # sglang_launcher.sglang_auth_flags); /health and Prometheus' /metrics stay open.
        self.control_token = control_token_from_env()
        # start, stop and restart, one at a time: a restart (rollout.health, in a thread) never
        # starts a router after `stop` (the actor's shutdown)
        self._lock = threading.RLock()
        self._stopped = False

    # -- lifecycle ----------------------------------------------------------------------------
    @property
    def url(self) -> str:
        if self.port is None:
            raise RouterError("the router is not started")
        return f"http://{self.config.host}:{self.port}"

    def argv(self, port: int, prometheus_port: int, worker_urls: Sequence[str]) -> list[str]:
        c = self.config
        argv = [
            sys.executable, "-m", "sglang_router.launch_router",
            "--host", c.host, "--port", str(port),
            "--policy", c.policy,
            "--prometheus-port", str(prometheus_port), "--prometheus-host", c.host,
            "--request-timeout-secs", str(int(c.request_timeout_s)),
            "--health-check-interval-secs", str(c.health_check_interval_s),
            "--health-failure-threshold", str(c.health_failure_threshold),
            "--worker-startup-timeout-secs", str(c.worker_startup_timeout_s),
            "--log-level", "warn",
        ]
        argv += ["--disable-retries"] if c.max_retries == 0 else ["--retry-max-retries", str(c.max_retries)]
        if not c.circuit_breaker:
            argv.append("--disable-circuit-breaker")
        if worker_urls:
            argv += ["--worker-urls", *worker_urls]
        argv += list(c.extra_args)
        if self.control_token is not None:  # the keys join the arguments inside the process
            # --api-key=VALUE: a token may begin with '-', which argparse takes for a flag
            argv += [f"--api-key={TOKEN_PLACEHOLDER}",
                     "--control-plane-api-keys", f"rlkit:rlkit:admin:{TOKEN_PLACEHOLDER}"]
            # killed with its group if this process dies (the process model of hf_server's
            # --parent-pid). Without a token (loopback tests, tools) it is launched directly
            # and has no such watchdog: a run always sets a token.
            argv[1:3] = ["-m", "rlkit.rollout.http.token_exec", "--parent-pid", str(os.getpid()),
                         "sglang_router.launch_router"]
        return argv

    def start(self, worker_urls: Sequence[str] = (), *, wait_for_workers: bool = True) -> str:
        """Start the router in front of `worker_urls`; return its URL once /health answers
        (and, if `wait_for_workers`, once every worker is listed)."""
        with self._lock:
            self._stopped = False
            return self._start(worker_urls, wait_for_workers)

    def restart(self, worker_urls: Sequence[str]) -> str:
        """Kill what is left of the router (SIGKILL to its process group: a stopped one too)
        and start it again in front of those of `worker_urls` that answer /health (a worker
        that does not holds the router's start up to worker_startup_timeout_s; rollout.health
        takes it out); its URL, on a fresh port unless `port` is fixed."""
        with self._lock:
            if self._stopped:
                raise RouterError("the router was stopped; not restarting it")
            if self.process is not None:
                self.process.kill()
                self.process.stop()  # closes its log
                self.process = None
            answering = [u for u in worker_urls if http_ok(f"{u.rstrip('/')}/health")]
            return self._start(answering, True)

    def _start(self, worker_urls: Sequence[str], wait_for_workers: bool) -> str:
        if self.process is not None and self.process.alive():
            raise RouterError(f"the router is already running at {self.url}")
        if importlib.util.find_spec("sglang_router") is None:
            raise RouterError("sglang-router is not installed (`pip install sglang-router==0.3.2`)")
        host, c = self.config.host, self.config
        try:
            check_bind(host, self.control_token, "the sglang-router")
        except ControlTokenMissing as e:
            raise RouterError(str(e)) from None
        for port, what in ((c.port, "port"), (c.prometheus_port, "prometheus_port")):
            if port and not port_is_free(host, port):
                raise RouterError(f"router {what} {port} on {host} is already in use")
        attempts = 1 if (c.port and c.prometheus_port) else 3  # auto ports can be raced: retry
        last: Exception | None = None
        for _ in range(attempts):
            port = c.port or free_port(host)
            prom = c.prometheus_port or free_port(host)
            while prom == port:
                prom = free_port(host)
            proc = spawn("sglang-router", self.argv(port, prom, worker_urls), log_path=self.log_path)
            try:
                proc.wait_healthy(f"http://{host}:{port}/health", c.startup_timeout_s)
            except ProcessStartError as e:
                last = e
                if "in use" in log_tail(proc.log_path).lower() or "address already" in str(e).lower():
                    continue  # someone took the port between our check and the bind
                raise RouterError(str(e)) from None
            self.process, self.port, self.prometheus_port = proc, port, prom
            break
        else:
            raise RouterError(f"router could not bind a port after {attempts} attempts: {last}")
        if wait_for_workers:
            for url in worker_urls:
                self._wait_listed(url, c.startup_timeout_s)
        return self.url

    def stop(self) -> None:
        with self._lock:  # after a restart under way
            self._stopped = True
            if self.process is not None:
                self.process.stop()
                self.process = None

    def __enter__(self) -> "Router":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.process is not None and self.process.alive() and http_ok(f"{self.url}/health")

    # -- workers ------------------------------------------------------------------------------
    def list_workers(self) -> list[RouterWorker]:
        status, body = _request("GET", f"{self.url}/workers", token=self.control_token)
        if status != 200 or not isinstance(body, dict):
            raise RouterError(f"GET {self.url}/workers answered {status}: {body}")
        return [
            RouterWorker(id=w["id"], url=w["url"], is_healthy=bool(w.get("is_healthy", True)),
                         load=int(w.get("load", 0)), model_id=w.get("model_id"))
            for w in body.get("workers", [])
        ]

    def add_worker(self, url: str, *, timeout_s: float | None = None) -> str:
        """Register `url` (checked reachable first); return its router id once it is listed."""
        url = url.rstrip("/")
        if not http_ok(f"{url}/health"):
            raise RouterError(f"worker {url} does not answer /health; not registering it")
        # the key the router sends this worker: workers given at start get --api-key's, one
        # registered later gets none unless named (the router warns "without API key")
        spec = {"url": url, **({"api_key": self.control_token} if self.control_token else {})}
        status, body = _request("POST", f"{self.url}/workers", spec, token=self.control_token)
        if status not in (200, 201, 202):
            raise RouterError(f"router refused worker {url}: HTTP {status} {body}")
        return self._wait_listed(url, timeout_s or self.config.startup_timeout_s).id

    def remove_worker(self, url_or_id: str, *, timeout_s: float = 30.0) -> None:
        """Unregister a worker by URL or router id; return once it is no longer listed."""
        target = url_or_id.rstrip("/")
        match = [w for w in self.list_workers() if target in (w.id, w.url)]
        if not match:
            raise RouterError(f"no worker {url_or_id!r} at the router {self.url}")
        status, body = _request("DELETE", f"{self.url}/workers/{match[0].id}",
                                token=self.control_token)
        if status not in (200, 202, 204):
            raise RouterError(f"router refused to remove {url_or_id}: HTTP {status} {body}")
        deadline = time.monotonic() + timeout_s
        while any(w.id == match[0].id for w in self.list_workers()):
            if time.monotonic() > deadline:
                raise RouterError(f"worker {url_or_id} still listed {timeout_s:.0f} s after removal")
            time.sleep(0.1)

    def _wait_listed(self, url: str, timeout_s: float) -> RouterWorker:
        deadline = time.monotonic() + timeout_s
        while True:
            for w in self.list_workers():
                if w.url.rstrip("/") == url.rstrip("/"):
                    return w
            if time.monotonic() > deadline:
                raise RouterError(
                    f"worker {url} not listed by the router {timeout_s:.0f} s after registration "
                    f"(router log {self.process.log_path if self.process else '?'}:\n"
                    f"{log_tail(self.process.log_path if self.process else None, 10)})")
            time.sleep(0.1)


class RouterProcessHandle:
    """rollout.health's handle on the router (its RouterHandle): probes go to the router's
    /health, a lost router's requests end in the client, and a restart moves the client to the
    new router's URL."""

    def __init__(self, router: Router, client: "EngineClient") -> None:
        self.router = router
        self.client = client

    async def probe(self, timeout_s: float) -> str | None:
        return await self.client.probe_router(timeout_s)

    async def abort_routed(self) -> int:
        return await self.client.abort_routed()

    async def restart(self, workers: list[str]) -> str:
        url = await asyncio.to_thread(self.router.restart, workers)
        self.client.follow_router(url)
        return url
