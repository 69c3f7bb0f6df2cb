"""The HTTP process's handle on the engine core process (see engine_core.py for the messages).

`EngineCoreClient` spawns the core, waits until it has loaded the model, and then mirrors every
submitted request as a `RemoteRequest` whose outputs grow as the core's per-step progress
messages arrive (read on the event loop through `add_reader`, no thread). Commands are
request/answer over the same pipe.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

from rlkit.rollout.engines.builtin.requests import DecodeRequest
from rlkit.rollout.engines.builtin.engine_core import CoreConfig, run_engine_core
from rlkit.rollout.http.protocol import FinishReason


class CoreError(RuntimeError):
    """A command the core refused or failed; the message says why."""


class CoreRefused(CoreError):
    """The core refused a command's arguments (the caller's mistake, an HTTP 400)."""


class CoreDied(CoreError):
    """The core process is gone."""


@dataclass(eq=False)
class RemoteRequest(DecodeRequest):
    """The HTTP side's view of one request: a DecodeRequest (the fields the handlers read),
    filled from the core's progress messages. `progressed` is set whenever new tokens or the
    finish reason arrive."""

    progressed: asyncio.Event = field(default_factory=asyncio.Event)


class EngineCoreClient:
    def __init__(self, config: CoreConfig) -> None:
        self.config = config
        self.info: dict[str, Any] = {}
        self.requests: dict[str, RemoteRequest] = {}
        self.crashed: str | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._process: mp.process.BaseProcess | None = None
        self._conn: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle --------------------------------------------------------------------------------
    def launch(self) -> None:
        """Spawn the core process (it starts loading the model at once)."""
        ctx = mp.get_context("spawn")  # no fork: torch threads and CUDA do not survive it
        parent, child = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=run_engine_core, args=(child, self.config),
                                    name="rlkit-engine-core", daemon=True)
        self._process.start()
        child.close()
        self._conn = parent

    async def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Wait for the core's "ready" message; then read its messages on the event loop."""
        assert self._process is not None and self._conn is not None, "launch() first"
        parent = self._conn
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(parent.poll, 0.1):
            if not self._process.is_alive():
                raise CoreDied(f"engine core exited with code {self._process.exitcode} while "
                               "loading the model (see the log above)")
            if time.monotonic() > deadline:
                raise CoreDied(f"engine core not ready after {timeout_s:.0f} s")
        message = pickle.loads(parent.recv_bytes())
        if message[0] != "ready":
            raise CoreDied(str(message[1]) if len(message) > 1 else "engine core failed to start")
        self.info = message[1]
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(parent.fileno(), self._on_readable)

    async def stop(self, timeout_s: float = 10.0) -> None:
        if self._process is None:
            return
        if self._loop is not None and self._conn is not None:
            self._loop.remove_reader(self._conn.fileno())
        try:
            self._send(("stop",))
        except (OSError, CoreDied):
            pass
        await asyncio.to_thread(self._process.join, timeout_s)
        if self._process.is_alive():
            self._process.kill()
            await asyncio.to_thread(self._process.join, timeout_s)
        self._conn.close()
        self._process = None

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive() and self.crashed is None

    # -- pipe ---------------------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        if not self.alive:
            raise CoreDied(f"engine core is not running ({self.crashed or 'stopped'})")
        self._conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def _on_readable(self) -> None:
        try:
            while self._conn.poll():
                self._dispatch(pickle.loads(self._conn.recv_bytes()))
        except (EOFError, OSError):
            self._lost("engine core process exited")

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "progress":
            for rid, ids, lps, versions, version, finish, input_lps in message[1]:
                r = self.requests.get(rid)
                if r is None:
                    continue
                if input_lps is not None:
                    r.input_logprobs = input_lps
                r.output_ids.extend(ids)
                r.output_logprobs.extend(lps)
                r.output_versions.extend(versions)
                r.weight_version = version
                if finish is not None:
                    r.finish_reason = FinishReason.model_validate(finish)
                    del self.requests[rid]
                r.progressed.set()
        elif kind == "result":
            future = self._calls.pop(message[1], None)
            if future is not None and not future.done():
                if message[2]:
                    future.set_result(message[3])
                else:
                    future.set_exception((CoreRefused if message[4] else CoreError)(message[3]))
        elif kind == "crashed":
            self._lost(message[1])

    def _lost(self, why: str) -> None:
        """The core is gone or crashed: fail what waits on it."""
        if self.crashed is None:
            self.crashed = why
        if self._loop is not None and self._conn is not None:
            try:
                self._loop.remove_reader(self._conn.fileno())
            except (ValueError, OSError):
                pass
        for r in list(self.requests.values()):
            r.finish_reason = FinishReason.abort(f"engine core failed: {why}", status_code=500)
            r.progressed.set()
        self.requests.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(CoreDied(f"engine core failed: {why}"))
        self._calls.clear()

    # -- requests -----------------------------------------------------------------------------------
    def submit(self, request: RemoteRequest) -> None:
        self.requests[request.rid] = request
        try:
            self._send(("submit", DecodeRequest(rid=request.rid, input_ids=request.input_ids,
                                                params=request.params, stream=request.stream,
                                                logprob_start_len=request.logprob_start_len,
                                                lora=request.lora)))
        except CoreDied:
            del self.requests[request.rid]
            raise

    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        self._send(("abort", rid, abort_all))

    async def call(self, name: str, **kwargs: Any) -> Any:
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            self._send(("call", call_id, name, kwargs))
        except CoreDied:
            self._calls.pop(call_id, None)
            raise
        return await future
