"""Replay a length trace on any `Engines`: simulated or real HTTP engines alike.

`TraceReplayEngines(inner, trace, prompt_of)` wraps an engine set. For each request it looks
up the response's natural length in the trace by (prompt source_index, epoch, sample.slot),
and asks the inner engines for exactly the tokens still missing to reach it (never more than
the manager's `max_new_tokens`), with `ignore_eos=True` so a real model cannot stop early.
A response that reaches its natural length below the trace's cap then ends as a stop
('stop', status DONE), as the traced response did; one that reaches the cap is truncated
('length'); an aborted one is partial, exactly as without the wrapper. In a multi-turn trace
(rlkit.sim.episodes) a request is one model turn of an episode: it ends as a stop where the
trace ends that turn (as a stop string would), and the episode layer goes on.

The key never involves the global sample index (which depends on the policy: over-provisioned
groups take indices), so sync and partial runs over the same trace do the same work.

`prompt_of(sample) -> PromptRecord` finds a sample's prompt; `BufferPrompts(buffer)` does it
from the buffer's in-flight groups (the Engines interface passes only the sample).
"""

from __future__ import annotations

from typing import Callable

from rlkit.buffers.buffer import Place, RolloutBuffer
from rlkit.buffers.group import PromptRecord
from rlkit.buffers.sample import Sample, SampleStatus
from rlkit.rollout.config import SamplingConfig
from rlkit.rollout.engine_api import Engines
from rlkit.sim.trace import Trace, TraceError


class BufferPrompts:
    """`prompt_of` over a RolloutBuffer: the prompt of a sample of an in-flight group.

    Cached by group id; a miss refreshes the cache from the in-flight groups (so the cache
    holds only groups in flight, and refreshes happen once per batch of launches)."""

    def __init__(self, buffer: RolloutBuffer) -> None:
        self._buffer = buffer
        self._cache: dict[int, PromptRecord] = {}

    def __call__(self, sample: Sample) -> PromptRecord:
        prompt = self._cache.get(sample.group_id)
        if prompt is None:
            self._cache = {g.group_id: g.prompt for g in self._buffer.queued(Place.IN_FLIGHT)}
            prompt = self._cache.get(sample.group_id)
            if prompt is None:
                raise TraceError(
                    f"sample {sample.index}: group {sample.group_id} is not in flight in the "
                    "buffer, so its prompt (and trace key) is unknown"
                )
        return prompt


class TraceReplayEngines:
    """An `Engines` that makes every response as long as the trace says."""

    def __init__(
        self, inner: Engines, trace: Trace, prompt_of: Callable[[Sample], PromptRecord]
    ) -> None:
        self.inner = inner
        self.trace = trace
        self.prompt_of = prompt_of
        self._replay_sampling: dict[int, tuple[SamplingConfig, SamplingConfig]] = {}

    def natural_length(self, sample: Sample) -> int:
        """Where the sample's request ends: its traced length, or in a multi-turn trace the end
        of the episode's current model turn (the turn that holds its response so far)."""
        p = self.prompt_of(sample)
        if not self.trace.multi_turn:
            return self.trace.length(p.source_index, p.epoch, sample.slot)
        at, n = 0, len(sample.response_ids)
        for model, _, observation in self.trace.episode(p.source_index, p.epoch, sample.slot):
            if n < at + model + observation:
                return min(self.trace.cap, at + model)
            at += model + observation
        return min(self.trace.cap, at)  # past the episode's end: nothing left to generate

    # -- Engines ----------------------------------------------------------------------------
    def workers(self) -> list[str]:
        return self.inner.workers()

    async def generate(
        self,
        sample: Sample,
        sampling: SamplingConfig,
        *,
        max_new_tokens: int,
        version: int,
        worker: str | None = None,
    ) -> str | None:
        natural = self.natural_length(sample)
        need = natural - len(sample.response_ids)
        if need <= 0:  # already as long as the trace says (resumed right at its end)
            sample.start_request()
            sample.append([], [], version, finish_reason=self._end(natural))
            return worker
        served = await self.inner.generate(
            sample, self._sampling(sampling), max_new_tokens=min(max_new_tokens, need),
            version=version, worker=worker,
        )
        if (
            sample.status is SampleStatus.TRUNCATED
            and len(sample.response_ids) == natural
            and natural < self.trace.cap
        ):
            _mark_stopped(sample)
        return served

    async def abort_all(self) -> None:
        await self.inner.abort_all()

    async def loads(self) -> dict[str, int]:
        return await self.inner.loads()

    async def probe(self, worker: str, timeout_s: float, *, generate: bool = True) -> str | None:
        return await self.inner.probe(worker, timeout_s, generate=generate)

    async def progress(self, worker: str, timeout_s: float) -> int | None:
        return await self.inner.progress(worker, timeout_s)

    async def abort_worker(self, worker: str) -> int:
        return await self.inner.abort_worker(worker)

    async def remove_worker(self, worker: str) -> None:
        await self.inner.remove_worker(worker)

    async def add_worker(self, worker: str) -> None:
        await self.inner.add_worker(worker)

    # -- internals ---------------------------------------------------------------------------
    def _end(self, natural: int) -> str:
        return "length" if natural >= self.trace.cap else "stop"

    def _sampling(self, sampling: SamplingConfig) -> SamplingConfig:
        cached = self._replay_sampling.get(id(sampling))
        if cached is None or cached[0] is not sampling:
            cached = (sampling, sampling.model_copy(update={"ignore_eos": True}))
            self._replay_sampling[id(sampling)] = cached
        return cached[1]


def _mark_stopped(sample: Sample) -> None:
    """The engine stopped the response at its budget ('length'), which the replay set to the
    traced natural length: the traced response ended there with EOS."""
    sample.relabel_finish("stop")
