"""The request path of a rollout step (rollout/manager.py's Step): each sample's requests to
the engines. A sample is generated to its budget or its next stop; with a dispatcher, its pinned
engine admits it longest-first (AdmissionGate); a request whose engine was lost (rollout.health)
goes again elsewhere with the tokens it streamed, `relaunches_per_sample` times (one that went
through a lost router, once the router is back: it waits for it); a resumed sample
whose parked tokens the engine re-scored past rollout.max_resume_log_ratio starts again from its
prompt; every request is a span of the step's timeline. `abort_all` is the step's stop.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rlkit.buffers.sample import Sample
from rlkit.rollout.config import SamplingConfig
from rlkit.rollout.dispatch import AdmissionGate, GateClosed
from rlkit.rollout.engine_api import EngineError, RouterLost, WorkerLost
from rlkit.rollout.timeline import Span


class SampleRequests:
    """One step's requests: the step's state (version, report, in-flight counts) is its own."""

    def __init__(self, step: Any) -> None:
        self.step = step  # rollout.manager.Step, which imports this module (no cycle back)
        self.gates: dict[str, AdmissionGate] = {}  # per engine, with a dispatcher

    def close_gates(self) -> None:
        """The step stops: a sample still waiting at a gate is never sent."""
        for gate in self.gates.values():
            gate.close()

    async def abort_all(self) -> None:
        """abort_all; an engine that fails it may have died since the last probe: probe, and
        if that took an engine out of service, abort the ones left."""
        st = self.step
        health = st._m.health
        lost_before = health.lost if health is not None else 0
        try:
            await st._m.engines.abort_all()
        except EngineError:
            # lost meanwhile (the periodic probe may have found it first), or found now
            if health is None or (health.lost == lost_before and not await health.sweep()):
                raise
            await st._m.engines.abort_all()

    async def generate(self, run: Any, s: Sample, sampling: SamplingConfig | None = None) -> None:
        """Generate `s` to its budget (or its next stop): requests, relaunched on a lost engine.
        `sampling`: the episode's turn settings (its stop strings) instead of the recipe's."""
        st = self.step
        sampling = sampling or st._m.sampling
        remaining = s.remaining_tokens(sampling.max_new_tokens)
        if remaining <= 0:  # resumed at its budget: nothing to ask for
            s.append([], [], st.version, finish_reason="length")
            return
        pinned = run.placed.get(s.index)
        gate = self.gate(pinned)
        if gate is not None:
            try:
                await gate.acquire(st.dispatcher.priority(run.group))
            except GateClosed:  # the step stopped first: never sent, nothing to park but itself
                s.interrupt()
                return
        try:
            await self._relaunched(run, s, pinned, sampling)
            # restarted, it has no parked tokens to re-score: the second round is the last
            if self._restart_mismatched(s) and not st._stopping:
                await self._relaunched(run, s, pinned, sampling)
        finally:
            if gate is not None:
                gate.release()

    async def _relaunched(self, run: Any, s: Sample, pinned: str | None,
                          sampling: SamplingConfig) -> None:
        """Requests for `s` until it settles (finished, parked or failed), relaunched on a
        lost engine."""
        st = self.step
        for attempt in range(st._m.relaunches_per_sample + 1):
            if not await self._request(run, s, pinned, sampling,
                                       last=attempt == st._m.relaunches_per_sample):
                return
            if s.remaining_tokens(sampling.max_new_tokens) <= 0:  # lost right at its budget
                s.append([], [], st.version, finish_reason="length")
                return

    def _restart_mismatched(self, s: Sample) -> bool:
        """rollout.max_resume_log_ratio: a resumed sample whose parked tokens the engine
        re-scored past the bound forgets its response (counted) and is generated again from its
        prompt. Its correction weight would be negligible (or the sample rejected), so the
        tokens are worth less than a fresh response. True if it was restarted."""
        st = self.step
        if s.resume_log_ratio is not None:
            st.report_.resume_rescored += 1
            st.report_.resume_abs_log_ratio_sum += abs(s.resume_log_ratio)
        if (not s.rescored_past(st._m.max_resume_log_ratio) or s.status.terminal
                or st._m.episodes is not None):  # an episode's environment cannot rewind
            return False
        tokens = st.buffer.restart_sample(s)
        st.report_.mismatch_restarts += 1
        st.report_.mismatch_restart_tokens += tokens
        return True

    async def _request(self, run: Any, s: Sample, pinned: str | None,
                       sampling: SamplingConfig, *, last: bool) -> bool:
        """One request for `s`. True when its engine was lost and it should go again."""
        st = self.step
        health = st._m.health
        if health is not None and not st.engines.workers():
            await health.wait_serving()  # none in service: wait for one, or EnginesDown
        if pinned is not None and health is not None and pinned not in st.engines.workers():
            pinned = None  # its engine is out of service: the router chooses
        if pinned is None and health is not None and not health.routing:
            if not await self._wait_routing():
                return False  # the step stopped first: never sent, parked with what it has
        lost_before = health.lost if health is not None else 0
        # through the router: a failure may be the router's (None: pinned, it needs none)
        router_before = health.router_lost if health is not None and pinned is None else None
        before, start, worker, outcome = len(s.response_ids), st._loop.time(), pinned, "abort"
        try:
            worker = await st._m.engines.generate(
                s, sampling, max_new_tokens=s.remaining_tokens(sampling.max_new_tokens),
                version=st.version, worker=pinned,
            ) or pinned
            if worker:
                run.served_by.add(worker)
            outcome = s.finish_reason if s.status.terminal else "abort"
            return False
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except EngineError as e:
            worker = e.worker or worker
            outcome = "error"
            if st._stopping and health is not None:
                # The step is ending (its abort): the sample keeps what it has and its group is
                # parked with it, as every unfinished group is; failing it would drop the group.
                outcome = "lost" if isinstance(e, WorkerLost) else "abort"
                return False
            if not last and await self._engine_lost(e, worker, lost_before, router_before):
                outcome = "lost"
                st.report_.requests_relaunched += 1
                st.report_.relaunched_tokens += len(s.response_ids)
                return True
            s.fail(f"engine: {e}")
            st.report_.engine_failures += 1
            return False
        finally:
            tokens = len(s.response_ids) - before
            st.report_.tokens_generated += tokens
            st.report_.timeline.append(Span(
                worker, run.group.group_id, s.index, start, st._loop.time(), tokens, outcome,
                response_before=before,
            ))

    async def _engine_lost(self, error: EngineError, worker: str | None, lost_before: int,
                           router_before: int | None) -> bool:
        """Whether a failed request's engine or router was lost (and some engine serves
        again): for a request through the router, probe the router first (a killed router
        breaks streams from engines that are fine); then the engine (every engine when the
        router chose and none is known) unless the monitor already said so. Raises
        EnginesDown when none serves and none can come back."""
        st = self.step
        health = st._m.health
        if health is None or st._stopping:
            return False
        if isinstance(error, RouterLost) or (
                router_before is not None and not isinstance(error, WorkerLost)
                and (health.router_lost != router_before or await health.check_router())):
            return not st._stopping  # sent again once the router is back (`_request` waits)
        if not isinstance(error, WorkerLost) and st.engines.workers():
            await health.check([worker] if worker in st.engines.workers() else None)
            if health.lost == lost_before and st.engines.workers():
                return False  # every engine answers: the request itself failed
        await health.wait_serving()
        return not st._stopping

    async def _wait_routing(self) -> bool:
        """The router is down: wait until it routes again (RouterDown when it cannot come
        back). False when the step stopped first (a stopping step does not wait for it)."""
        st = self.step
        if st._stopping:
            return False
        routing = asyncio.ensure_future(st._m.health.wait_routing())
        stopped = asyncio.ensure_future(st._stopped.wait())
        try:
            await asyncio.wait({routing, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not routing.done():
                routing.cancel()
        if routing.done() and not routing.cancelled():
            routing.result()  # RouterDown
        return not st._stopping

    def gate(self, worker: str | None) -> AdmissionGate | None:
        st = self.step
        if st.dispatcher is None or worker is None:
            return None
        gate = self.gates.get(worker)
        if gate is None:
            gate = self.gates[worker] = AdmissionGate(st.dispatcher.engine.slots)
        return gate
