"""The manager's engine interface: what the RolloutManager and its policies may ask of engines.

Two implementations: `rollout.client.EngineClient` (HTTP: the router and the engine servers
behind it) and the simulated engines (virtual time). Policies and the manager only ever see
this Protocol, so the same scheduling code runs against both.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from buffers.sample import Sample
from rollout.config import SamplingConfig


class EngineError(RuntimeError):
    """A request failed for a reason other than an abort (after the endpoint's retries)."""


@runtime_checkable
class Engines(Protocol):
    def workers(self) -> list[str]:
        """Ids of the engine workers (their URLs for HTTP engines), stable for a run."""
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
