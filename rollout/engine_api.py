"""The manager's engine interface: what the RolloutManager and its policies may ask of engines.

Two implementations: `rollout.http.client.EngineClient` (HTTP: the router and the engine servers
behind it) and the simulated engines (virtual time). Policies and the manager only ever see
this Protocol, so the same scheduling code runs against both.

The worker set changes when an engine is lost and comes back (rollout.health): `probe`,
`progress`, `abort_worker`, `remove_worker` and `add_worker` are what the health monitor uses.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from rlkit.buffers.sample import Sample
from rlkit.rollout.config import SamplingConfig


class EngineError(RuntimeError):
    """A request failed for a reason other than an abort (after the endpoint's retries).
    `worker`: the engine it failed on, when known."""

    def __init__(self, message: str = "", worker: str | None = None) -> None:
        super().__init__(message)
        self.worker = worker


class WorkerLost(EngineError):
    """The request's engine was declared dead or hung (`abort_worker`): the sample keeps what
    it streamed (PARTIAL or PENDING) and may be sent again to another engine."""

    def __init__(self, worker: str, message: str = "") -> None:
        super().__init__(message or f"engine {worker} was lost", worker)


class RouterLost(WorkerLost):
    """The request went through the router, which was declared dead or hung (rollout.health):
    as with WorkerLost, the sample keeps what it streamed and is sent again once the router is
    back. No engine is named: the engine that served it may be fine."""

    def __init__(self, message: str = "the router was lost") -> None:
        EngineError.__init__(self, message, None)


@runtime_checkable
class Engines(Protocol):
    def workers(self) -> list[str]:
        """Ids of the engine workers serving now (their URLs for HTTP engines)."""
        ...

    async def generate(
        self,
        sample: Sample,
        sampling: SamplingConfig,
        *,
        max_new_tokens: int,
        version: int,
        worker: str | None = None,
    ) -> str | None:
        """Generate (or resume) `sample` for at most `max_new_tokens` more tokens.

        Returns the id of the worker that served the request, when known (timelines).

        Calls `sample.start_request()` as the request is sent (the caller never does), then
        sends prompt + response ids so far, with a fresh request id. Appends each span to the
        sample with `Sample.append` as it arrives (streaming), stamped with the engine's
        weight version (or `version` if the engine reports none), and applies the finish
        reason ('stop' or 'length') at the end. If the request is aborted (abort_all, or the
        calling task is cancelled) the sample keeps what it has and is left PARTIAL (or
        PENDING if it got no token; `Sample.interrupt()`). `worker=None` lets the router
        choose. Raises EngineError when the request fails; never re-submits an aborted
        request. `max_new_tokens` is always >= 1.
        """
        ...

    async def abort_all(self) -> None:
        """Abort every in-flight request on every worker and return once all are idle."""
        ...

    async def loads(self) -> dict[str, int]:
        """Requests running or queued on each worker."""
        ...

    async def probe(self, worker: str, timeout_s: float, *, generate: bool = True) -> str | None:
        """A real one-token generation on `worker`, straight (not through the router): None
        when it answered within `timeout_s`, else why not ('timeout: ...' when it did not
        answer in time, anything else when the connection was refused or the answer bad).
        `generate=False`: only that the server answers (an engine paused for a weight sync, or
        asleep, queues generations: its liveness is all a probe can ask then)."""
        ...

    async def progress(self, worker: str, timeout_s: float) -> int | None:
        """A mark of `worker`'s progress, read straight from it without queueing behind its
        work (a probe's generation does queue): it changes whenever the engine's scheduler
        moves (a prefill or decode step done; SGLang's also while it waits with work queued),
        so two equal marks mean the engine did nothing in between. None when it did not answer
        within `timeout_s`, failed, or reports no mark: no progress can be told. The health
        monitor reads it around a generation probe that timed out (busy, or hung?).
        HTTP engines: `rollout.http.protocol.progress_mark` of GET /v1/loads."""
        ...

    async def abort_worker(self, worker: str) -> int:
        """End every request of this client that may be on `worker` now, without asking it (it
        is dead or hung): each raises `WorkerLost` with its sample interrupted, keeping its
        tokens. Returns how many."""
        ...

    async def remove_worker(self, worker: str) -> None:
        """Stop routing to `worker` (the router forgets it; `workers()` no longer lists it)."""
        ...

    async def add_worker(self, worker: str) -> None:
        """Route to `worker` again (a restarted engine, holding the current weights)."""
        ...
