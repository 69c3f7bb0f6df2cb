"""A scriptable fake SGLang worker (in-process aiohttp) for client tests: each test says what
/generate answers, and the worker records what it was sent."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from aiohttp import web
from aiohttp.test_utils import TestServer

Script = Callable[[web.Request, dict], Awaitable[web.StreamResponse]]


@dataclass
class FakeWorker:
    generate: list[Script] = field(default_factory=list)  # one per call, in order
    loads_sequence: list[int] = field(default_factory=lambda: [0])  # last one repeats
    requests: list[tuple[str, Any]] = field(default_factory=list)
    methods: list[tuple[str, str]] = field(default_factory=list)  # (method, path) of each request
    server_info: dict[str, Any] = field(default_factory=lambda: {"tp_size": 1})  # as SGLang's
    server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return str(self.server.make_url("")).rstrip("/")

    def calls(self, path: str) -> list[Any]:
        return [body for p, body in self.requests if p == path]

    async def start(self) -> "FakeWorker":
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/v1/loads", self._loads)
        app.router.add_get("/health", self._ok)
        app.router.add_get("/server_info", self._server_info)
        app.router.add_route("*", "/{path:.*}", self._control)
        self.server = TestServer(app, host="127.0.0.1")
        await self.server.start_server()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.close()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self._record(request, body)
        script = self.generate.pop(0)
        return await script(request, body)

    async def _loads(self, request: web.Request) -> web.Response:
        self._record(request, None)
        n = self.loads_sequence.pop(0) if len(self.loads_sequence) > 1 else self.loads_sequence[0]
        return web.json_response({"loads": [{"dp_rank": 0, "num_running_reqs": n, "num_waiting_reqs": 0}]})

    def _record(self, request: web.Request, body: Any) -> None:
        self.requests.append((request.path, body))
        self.methods.append((request.method, request.path))

    async def _server_info(self, request: web.Request) -> web.Response:
        self._record(request, None)
        return web.json_response(self.server_info)

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _control(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self._record(request, json.loads(raw) if raw else None)
        return web.json_response({"success": True, "message": "ok"})


# -- scripts --------------------------------------------------------------------------------------
def answer_json(payload: Any, status: int = 200) -> Script:
    async def script(request: web.Request, body: dict) -> web.StreamResponse:
        return web.json_response(payload, status=status)
    return script


def answer_sse(text: str, *, stall_after: int | None = None, close_after: int | None = None) -> Script:
    """Replay SSE `text` line by line; optionally stall (until cancelled) or drop the connection
    after that many data lines."""
    async def script(request: web.Request, body: dict) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sent = 0
        for line in text.splitlines():
            if not line.strip():
                continue
            if stall_after is not None and sent == stall_after:
                await asyncio.sleep(3600)
            if close_after is not None and sent == close_after:
                request.transport.close()  # type: ignore[union-attr]
                return resp
            await resp.write(line.encode() + b"\n\n")
            sent += 1
        return resp
    return script


def tokens_chunk(ids: list[int], lps: list[float], *, total: int, finish: dict | None,
                 version: str = "3") -> str:
    return "data: " + json.dumps({"text": "", "meta_info": {
        "id": "x", "finish_reason": finish, "completion_tokens": total, "weight_version": version,
        "output_token_logprobs": [[lp, t, None] for t, lp in zip(ids, lps)]}})
