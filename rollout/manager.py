"""RolloutManager: one rollout step = a policy driving a Step over the buffer and the engines.

A policy decides what to launch, where, and when the step is over (see rollout/policies). The
Step does the mechanics every policy shares:

- generation of each sample through the `Engines` interface (HTTP or simulated), tokens
  streaming onto the sample as they arrive;
- a reward for each sample the moment it finishes, concurrently with generation;
- settling a group the moment it is complete (the buffer keeps its first n finished samples
  and the step cancels the speculative rest), passing it through the group filter (dynamic
  sampling: a filtered group is dropped with its reason and does not count), or dropping it
  with a reason when a sample failed (or failing the step, as the recipe chooses);
- events: `next_event()` says what happened to which group (completed, dropped, filtered,
  parked) and which workers it freed, so a policy can react to each;
- `stop()`: abort every in-flight request on every engine, wait for them to return their
  partial tokens, and park each unfinished group where the policy says (partial queue to
  resume it, long queue to defer it): nothing generated is lost unless the policy restarts
  deferred prompts from scratch, and then it is counted;
- engine faults (with a health monitor, rollout.health): a request whose engine was lost goes
  on elsewhere with the tokens it streamed, in the same step (`relaunches_per_sample` times);
  when no engine serves and none can come back the step fails with `EnginesDown` and, as for
  any failure, parks every group with its tokens;
- per-step metrics and a per-request timeline.

Only asyncio primitives and `loop.time()` are used, so a step runs unchanged in virtual time.
"""

from __future__ import annotations

import asyncio
import bisect
import enum
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol, Union

from rlkit.buffers.buffer import Place, RolloutBuffer
from rlkit.buffers.group import Group
from rlkit.buffers.sample import Sample, SampleStatus
from rlkit.rollout.config import SamplingConfig
from rlkit.rollout.dispatch import Dispatcher, LengthWindow
from rlkit.rollout.engine_api import EngineError, Engines
from rlkit.rollout.episodes import EpisodeRunner, EpisodeStep
from rlkit.rollout.filters import FilterFailure, GroupFilter
from rlkit.rollout.health import EngineMonitor
from rlkit.rollout.rankers import LengthRanker, TurnRanker, group_lengths, mean_length, mean_turns
from rlkit.rollout.requests import SampleRequests
from rlkit.rollout.reward_scheduler import RewardFailure, RewardScheduler
from rlkit.rollout.step_report import StepReport

Park = Literal["partial", "long"]  # where stop() puts an unfinished group
Parking = Union[Park, Callable[[Group], Park]]


class StepStalled(RuntimeError):
    """The step needs more groups but the buffer has none to give."""


class EnginesFailing(EngineError):
    """Too many requests failed in one step: the engines are down, not unlucky."""


class RolloutPolicy(Protocol):
    """A policy may also have `saved_with_buffer`, a dict name -> object with state_dict /
    load_state_dict: estimates it keeps across steps, saved in checkpoints with the buffer."""

    name: str

    async def run(self, step: "Step") -> None:
        """Launch groups and return once the step's target is met (see rollout/policies)."""
        ...


class EventKind(str, enum.Enum):
    COMPLETED = "completed"  # ready for the trainer; counts toward the target
    DROPPED = "dropped"  # a sample failed, or the staleness rule dropped it (see `reason`)
    FILTERED = "filtered"  # the group filter turned it down (see `reason`)
    PARKED = "parked"  # every request ended unfinished (or the staleness rule sent it back)


@dataclass(frozen=True)
class StepEvent:
    """What happened to one launched group; the group no longer runs in this step."""

    kind: EventKind
    group: Group
    # The engines its requests ran on (each has a slot free now). A request that failed on an
    # engine the router chose does not say which one, so a dropped group may name none.
    workers: tuple[str, ...]
    reason: str | None = None


def batch_target(buffer: RolloutBuffer, batch_size: int) -> int:
    """Groups a step must complete so that `batch_size` are ready: groups that completed past
    the last step's target (during its abort, say) count toward this one's, so the ready queue
    never grows step after step, its groups staler each time."""
    return max(0, batch_size - buffer.count(Place.READY))


class RolloutManager:
    def __init__(
        self,
        buffer: RolloutBuffer,
        engines: Engines,
        policy: RolloutPolicy,
        sampling: SamplingConfig,
        rewards: RewardScheduler,
        *,
        group_filter: GroupFilter | None = None,
        ranker: LengthRanker | None = None,
        abort_grace_s: float = 30.0,
        health: EngineMonitor | None = None,
        relaunches_per_sample: int = 3,
        episodes: "EpisodeRunner | None" = None,
        max_resume_log_ratio: float | None = None,
    ) -> None:
        """`episodes`: multi-turn rollouts (rlkit/rollout/episodes.py); None: one request per
        sample. `max_resume_log_ratio`: restart a resumed sample whose parked tokens, re-scored
        by the engine (EngineClient.max_resume_log_ratio), are past it (single-turn only)."""
        self.buffer = buffer
        self.engines = engines
        self.policy = policy
        self.sampling = sampling
        self.rewards = rewards
        self.group_filter = group_filter
        self.ranker = ranker
        if ranker is not None:  # its state is saved and restored with the buffer's
            buffer.attach("ranker", ranker)
        self.abort_grace_s = abort_grace_s
        self.health = health
        self.relaunches_per_sample = relaunches_per_sample
        self.episodes = episodes
        self.max_resume_log_ratio = max_resume_log_ratio
        self.current: Step | None = None  # the step running now, for progress reports
        # The buffer's lag-restart counters at the last report (None before the first step):
        # each report counts the restarts since, between steps too (a version bump's sweep).
        self._lag_mark: tuple[int, int] | None = None
        # Recent lengths of finished groups, across steps: the distribution D the dispatcher's
        # cost model and the ranker-driven policies' thresholds read (responses; group means).
        self.response_lengths = LengthWindow(4096)
        self.group_lengths = LengthWindow(1024)
        # Saved with the buffer too: a run resumed from a checkpoint sizes its launches (partial's
        # in-flight estimate, tail batching's long share, dispatch's cost model) from the same
        # lengths as the run that went on, not from an empty window.
        buffer.attach("response_lengths", self.response_lengths)
        buffer.attach("group_lengths", self.group_lengths)
        for name, obj in getattr(policy, "saved_with_buffer", {}).items():
            buffer.attach(name, obj)

    def set_weights_version(self, version: int) -> None:
        """New weights reached the engines in the middle of a step (async mode): requests
        sent from now on, and spans an engine reports no version for, carry `version`."""
        if self.current is not None:
            self.current.version = max(self.current.version, version)

    async def run_step(self, target: int, version: int, *, final: bool = False) -> StepReport:
        """Run one rollout step: `target` groups become ready in the buffer (or an error).
        `final`: the run's last step (a policy may drain what it queued, e.g. tail batching's
        long queue)."""
        if self.health is not None:
            self.health.start()
        step = self.current = Step(self, target, version, final=final)
        try:
            if target > 0:  # else the ready queue already holds the batch (see `batch_target`)
                await self.policy.run(step)
                await step.stop()  # a no-op when the policy left nothing in flight
        except BaseException:
            # Ctrl-C, an engine outage, a failing reward under fail_step: abort and park
            # everything with its tokens before the error propagates.
            await asyncio.shield(step.stop())
            raise
        finally:
            self.current = None
            if self.health is not None:
                step.report_.engines = self.health.metrics()
            if self.episodes is not None:  # parked episodes keep their environments; no others
                self.episodes.retain({s.index for place in (Place.IN_FLIGHT, Place.PARTIAL, Place.LONG)
                                      for g in self.buffer.queued(place) for s in g.samples})
        return step.report()

    async def close(self) -> None:
        if self.health is not None:
            await self.health.close()


@dataclass(eq=False)
class _GroupRun:
    group: Group
    placed: dict[int, str]  # sample index -> the engine its request is pinned to (if any)
    tasks: dict[int, asyncio.Task] = field(default_factory=dict)  # sample index -> task
    scoring: set[int] = field(default_factory=set)  # sample indices whose reward is running
    served_by: set[str] = field(default_factory=set)  # workers its requests ran on
    reserved: bool = False  # Step.launch(reserve=True)
    settled: bool = False


class Step:
    """What a policy sees of one rollout step."""

    def __init__(self, manager: RolloutManager, target: int, version: int, *,
                 final: bool = False) -> None:
        self.target = target
        self.version = version
        self.final = final  # the run's last step
        self.buffer = manager.buffer
        self.engines = manager.engines
        # Where stop() parks unfinished groups unless told otherwise, also when the step is
        # interrupted (Ctrl-C, an engine outage): a policy that defers sets "long".
        self.park_to: Park = "partial"
        # On-policy policies that launch more than the target (tail batching) set this: the step
        # completes exactly `target` groups, and one that completes after that (in the same
        # instant, or during the abort) is restarted from its prompt and requeued, rather than
        # left ready to be trained a version later.
        self.exact_target = False
        # A policy that places its groups sets this (ranked_dispatch): every launch is then
        # placed on an engine and admitted longest-first there.
        self.dispatcher: Dispatcher | None = None
        self.ranker = manager.ranker
        self._in_flight: Counter[str] = Counter()  # requests this step has on each engine
        self._planned = False
        self._m = manager
        self._loop = asyncio.get_running_loop()
        self._runs: dict[int, _GroupRun] = {}
        self._events: deque[StepEvent] = deque()
        self._wakeup = asyncio.Event()
        self._error: BaseException | None = None
        self._stopping = False  # also closes rewards: stop() does not wait for them
        self._stopped = asyncio.Event()  # set by stop(): an episode waiting on a tool parks
        self._filter_failed = False
        self._t0 = self._loop.time()
        stats = self.buffer.stats()
        self._discarded0 = stats["discarded_tokens"]
        if manager._lag_mark is None:
            manager._lag_mark = (stats["lag_restarts"], stats["lag_restart_tokens"])
        self._completed: list[Group] = []
        self._cancelled: list[asyncio.Task] = []  # awaited by stop(): their spans count too
        self._tokens_at_launch: dict[int, int] = {}  # sample index -> response length at launch
        self.report_ = StepReport(version, target, manager.policy.name, started=self._t0)
        self.requests = SampleRequests(self)  # each sample's requests (rollout/requests.py)

    # -- what policies use ------------------------------------------------------------
    @property
    def completed(self) -> int:
        """Groups completed (ready for the trainer) during this step."""
        return len(self._completed)

    @property
    def running(self) -> int:
        """Groups launched and not yet completed, dropped or parked."""
        return len(self._runs)

    def is_running(self, group: Group) -> bool:
        return group.group_id in self._runs

    def running_groups(self) -> list[Group]:
        return [run.group for run in self._runs.values()]

    @property
    def response_lengths(self) -> LengthWindow:
        """Recent finished responses' lengths (all steps so far)."""
        return self._m.response_lengths

    @property
    def group_lengths(self) -> LengthWindow:
        """Recent finished groups' mean response lengths (all steps so far)."""
        return self._m.group_lengths

    @property
    def round(self) -> str:
        return self.report_.round

    @round.setter
    def round(self, kind: str) -> None:
        """The policy's name for this kind of step (metrics, timelines)."""
        self.report_.round = kind

    def launch(self, group: Group, *, worker: str | None = None, responses: int | None = None,
               reserve: bool = False) -> None:
        """Start generating every unfinished sample of an in-flight group.

        `responses` > group.n launches speculative extra responses; the group keeps the
        first n to finish. `worker` pins the group's requests to one engine; with a dispatcher
        and no `worker`, each request is placed on its own (a group's responses spread over
        the engines of its class, as the router would spread them). `reserve`: the policy
        will wait for this group, so an exact-target step keeps it a place (other groups
        complete only while completed + reserved running < target).
        """
        if self._stopping:
            raise RuntimeError("launch after stop()")
        if responses is not None and responses > len(group.samples):
            self.buffer.extend(group, responses - len(group.samples))
        # (an episode rewarded by its environment may still want its teacher logprobs)
        todo = [s for s in group.samples if not s.is_finished or self._m.rewards.wants(s)]
        if worker is not None:
            placed = {s.index: worker for s in todo}
        elif self.dispatcher is not None:
            placed = dict(zip((s.index for s in todo),
                              self.dispatcher.place(group, len(todo), self._in_flight)))
        else:
            placed = {}
        run = _GroupRun(group, placed, served_by=set(placed.values()), reserved=reserve)
        if group.predicted_length is not None:
            self.report_.launched_predictions.append((group.group_id, group.predicted_length))
        self._runs[group.group_id] = run
        for s in group.samples:  # what each response had before this step (resumed partials)
            self._tokens_at_launch.setdefault(s.index, len(s.response_ids))
        self.report_.groups_launched += 1
        if group.has_tokens:
            self.report_.groups_resumed += 1
        for s in todo:
            if s.index in placed:
                self._in_flight[placed[s.index]] += 1
            run.tasks[s.index] = asyncio.create_task(self._sample(run, s))
        self._check(run)

    def progress(self) -> dict[str, Any]:
        """A snapshot for live progress: groups done of target, tokens, seconds so far."""
        return {
            "completed": self.completed,
            "target": self.target,
            "running": self.running,
            "tokens": self.report_.tokens_generated,
            "seconds": self._loop.time() - self._t0,
        }

    def launch_all(self, groups: list[Group], **kwargs: Any) -> None:
        """Launch groups (with `launch`'s options). With a ranker their lengths are predicted
        first; with a dispatcher they are placed, in the dispatcher's order."""
        groups = list(groups)
        self.predict(groups)
        if self.dispatcher is None or kwargs.get("worker") is not None:
            for g in groups:
                self.launch(g, **kwargs)
            return
        if not self._planned:  # a step plans on its first launch
            self._planned = True
            plan = self.dispatcher.plan(self.engines.workers(), groups,
                                        self.buffer.n_samples_per_prompt, self._m.response_lengths)
            self.report_.dispatch = {"long_engines": len(plan.long_workers),
                                     "threshold": plan.threshold if plan.long_workers else 0.0}
        for g in self.dispatcher.order(groups):
            self.launch(g, **kwargs)

    def predict(self, groups: list[Group]) -> None:
        """Set each group's predicted_length from the ranker (again at each launch: a parked
        group's partial progress changes it), and its predicted_turns in multi-turn rollouts
        when the ranker predicts turns. A no-op without a ranker."""
        if self.ranker is not None and groups:
            for g, length in zip(groups, self.ranker.predict(groups)):
                g.predicted_length = float(length)
            if self._m.episodes is not None and isinstance(self.ranker, TurnRanker):
                for g, turns in zip(groups, self.ranker.predict_turns(groups)):
                    g.predicted_turns = float(turns)

    def defer(self, group: Group) -> None:
        """Send an in-flight group that was never launched straight to the long queue (a ranker
        predicts it long)."""
        self.report_.prompts_deferred += 1
        self.buffer.defer(group)

    async def next_event(self) -> StepEvent:
        """The next thing that happened to a launched group (in order; events since the last
        call, e.g. during `launch`, are not lost), waiting for one if none is pending."""
        while True:
            if self._error is not None:
                raise self._error
            if self._events:
                return self._events.popleft()
            if not self._runs:
                raise StepStalled(
                    f"{self.completed} of {self.target} groups complete and nothing is "
                    "running: the buffer has no prompts left to give"
                )
            self._wakeup.clear()
            await self._wakeup.wait()

    async def stop(self, park: Parking | None = None, *, restart_deferred: bool = False) -> None:
        """End the step: abort what is in flight and park each unfinished group: `park` is a
        place ('partial': resumed first next step; 'long': the long queue) or a function
        choosing one per group; None means `self.park_to`. `restart_deferred`: groups parked
        in the long queue forget their tokens and start again from the prompt (counted)."""
        if self._stopping:
            return
        self._stopping = True
        self._stopped.set()
        choose = park if callable(park) else (lambda g, p=park or self.park_to: p)
        self.requests.close_gates()
        abort_error: BaseException | None = None
        tasks = [t for run in self._runs.values() for t in run.tasks.values() if not t.done()]
        if tasks:
            # Rewards of groups that will not complete now are not worth waiting for (a slow
            # judge must not hold the step, slime#2176): their samples stay finished but
            # unrewarded, and are scored when the group resumes.
            for run in self._runs.values():
                for index in run.scoring:
                    run.tasks[index].cancel()
            try:
                await self.requests.abort_all()
            except BaseException as e:  # unreachable engines: cancel our requests, park, re-raise
                abort_error = e
            grace = 0 if abort_error is not None else self._m.abort_grace_s
            _, pending = await asyncio.wait(tasks, timeout=grace)
            for t in pending:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*self._cancelled, return_exceptions=True)
        for run in list(self._runs.values()):
            self._settle(run)  # some may have completed during the abort
            if run.settled:
                continue
            run.settled = True
            del self._runs[run.group.group_id]
            self.report_.groups_carried_over += 1
            self._park(run.group, choose(run.group), restart_deferred)
        self.report_.seconds = self._loop.time() - self._t0
        if abort_error is not None:
            raise abort_error

    # -- mechanics --------------------------------------------------------------------
    async def _sample(self, run: _GroupRun, s: Sample) -> None:
        try:
            if not s.status.terminal:
                if self._m.episodes is None:  # one request per sample (the default)
                    await self.requests.generate(run, s)
                else:  # a multi-turn episode: model turns through its requests, tool calls between
                    await self._m.episodes.run(s, run.group, EpisodeStep(
                        lambda sampling: self.requests.generate(run, s, sampling), self._stopped,
                        lambda: self.version))
            if (
                s.status in (SampleStatus.DONE, SampleStatus.TRUNCATED)
                and self._m.rewards.wants(s)
                and not self._stopping
            ):
                if s.finished_at is None:
                    s.finished_at = self._loop.time()
                run.scoring.add(s.index)
                if not await self._m.rewards.score(s, run.group):
                    self.report_.reward_failures += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug or an unexpected engine failure: fail the step loudly
            if self._error is None:
                self._error = e
            s.interrupt()
        finally:
            run.scoring.discard(s.index)
            if s.index in run.placed:
                self._in_flight[run.placed[s.index]] -= 1
            self._check(run, finishing=asyncio.current_task())

    def _check(self, run: _GroupRun, finishing: asyncio.Task | None = None) -> None:
        """After any sample of the group changed: settle the group if it can be settled.
        `finishing` is the sample task calling from its `finally` (not done() yet)."""
        if not run.settled:
            self._settle(run, finishing)
        if self._error is not None:
            self._wakeup.set()

    def _emit(self, kind: EventKind, run: _GroupRun, reason: str | None = None) -> None:
        if not self._stopping:  # after stop() no policy is listening
            self._events.append(StepEvent(kind, run.group, tuple(sorted(run.served_by)), reason))
            self._wakeup.set()

    def _settle(self, run: _GroupRun, finishing: asyncio.Task | None = None) -> None:
        g = run.group
        if run.settled:
            return
        if g.trainable:
            try:
                reason = self._filter_reason(g)
            except FilterFailure as e:  # a broken plugin fails the step; stop() parks the group
                self._filter_failed = True
                if self._error is None:
                    self._error = e
                return
            full = self.exact_target and not run.reserved and len(self._completed) + sum(
                r.reserved for r in self._runs.values() if r is not run) >= self.target
            run.settled = True
            del self._runs[g.group_id]
            if reason is not None:
                self._filter_out(run, reason, finishing)
            elif full:
                self._restart_surplus(run, finishing)
            else:
                self._complete(run)
            return
        failed = g.failed
        if failed:
            reward_failed = any(not (s.error or "").startswith("engine:") for s in failed)
            if reward_failed and self._m.rewards.on_error == "fail_step":
                if self._error is None:
                    self._error = RewardFailure(
                        f"group {g.group_id}, sample {failed[0].index}: {failed[0].error}"
                    )
                return  # stop() parks it, with the failed sample recorded on it
            run.settled = True
            del self._runs[g.group_id]
            self._cancel_all(run, finishing)
            reason = "reward_failed" if reward_failed else "engine_failed"
            self.buffer.drop(g, reason)
            self.report_.dropped[reason] = self.report_.dropped.get(reason, 0) + 1
            self.report_.record_dropped(g, reason)
            self._emit(EventKind.DROPPED, run, reason)
            if self.report_.engine_failures > max(8, 2 * self.target) and self._error is None:
                self._error = EnginesFailing(
                    f"{self.report_.engine_failures} requests failed in this step; last: "
                    f"{[s.error for s in failed][-1]}"
                )
            # A reward that fails for almost every sample (a judge answering no verdict, a
            # plugin raising) would have the step sample forever: stop it, saying why.
            dropped = self.report_.dropped.get("reward_failed", 0)
            if dropped > max(8, 4 * self.target) and self._error is None:
                self._error = RewardFailure(
                    f"{dropped} groups dropped for failing rewards in this step (more than 4 x "
                    f"its {self.target}); last: {[s.error for s in failed][-1]}")
            return
        if not self._stopping and run.tasks and all(
            t.done() or t is finishing for t in run.tasks.values()
        ):
            # Every request ended without completing the group (an abort from outside the
            # step): park it rather than wait for nothing.
            run.settled = True
            del self._runs[g.group_id]
            self.report_.groups_carried_over += 1
            self._park(g, self.park_to, restart=False)
            self._emit(EventKind.PARKED, run, "interrupted")

    def _complete(self, run: _GroupRun) -> None:
        done = self.buffer.complete(run.group)
        for s in done.surplus:  # speculative responses, most still running
            self._cancel(run.tasks.get(s.index))
        self.report_.speculative_aborted += len(done.surplus)
        self.report_.speculative_tokens += sum(len(s.response_ids) for s in done.surplus)
        self._observe(run.group)
        if done.queued:  # not dropped or sent back by the staleness rule
            self._completed.append(run.group)
            self._emit(EventKind.COMPLETED, run)
        elif self.buffer.place_of(run.group) is None:
            self.report_.record_dropped(run.group, "stale")
            self._emit(EventKind.DROPPED, run, "stale")
        else:
            self._emit(EventKind.PARKED, run, "stale")

    def _filter_out(self, run: _GroupRun, reason: str, finishing: asyncio.Task | None) -> None:
        self._cancel_all(run, finishing)
        self._observe(run.group)  # its lengths are real, whatever its rewards
        self.report_.filtered[reason] = self.report_.filtered.get(reason, 0) + 1
        self.report_.filtered_tokens += run.group.tokens
        self.buffer.drop(run.group, f"filtered:{reason}")
        self.report_.record_dropped(run.group, f"filtered:{reason}")
        self._emit(EventKind.FILTERED, run, reason)

    def _restart_surplus(self, run: _GroupRun, finishing: asyncio.Task | None) -> None:
        """A group complete past an exact target (see `exact_target`): from the prompt again."""
        self._cancel_all(run, finishing)
        self.report_.surplus_restarted += 1
        self.buffer.restart(run.group)
        self.buffer.requeue(run.group)
        self._emit(EventKind.PARKED, run, "surplus")

    def _cancel_all(self, run: _GroupRun, finishing: asyncio.Task | None) -> None:
        for task in run.tasks.values():
            if task is not finishing:
                self._cancel(task)

    def _filter_reason(self, g: Group) -> str | None:
        f = self._m.group_filter
        if f is None or self._filter_failed:  # after a failure, stop() completes groups as they are
            return None
        if sum(self.report_.filtered.values()) >= f.limit(self.target):
            self.report_.filter_exhausted += 1
            return None
        return f.reason(g)

    def _observe(self, g: Group) -> None:
        """Lengths of a finished (or, as lower bounds, parked) group: to the ranker, and to the
        recent-length windows when finished."""
        if self.ranker is not None:
            self.ranker.observe(g)
        if g.is_complete and self.dispatcher is not None:
            self.dispatcher.observe(g)
        if g.is_complete:
            self._m.response_lengths.add(group_lengths(g)[0])
            self._m.group_lengths.add([mean_length(g)])

    def _park(self, g: Group, place: Park, restart: bool) -> None:
        self._observe(g)  # before a restart forgets its tokens
        if place == "long":
            discarded = self.buffer.defer(g, restart=restart)
            self.report_.prompts_deferred += 1
            if restart:
                self.report_.deferred_tokens_discarded += discarded
        elif place == "partial":
            self.buffer.requeue(g)
        else:
            raise ValueError(f"park: {place!r} is not a place (partial, long)")

    def _cancel(self, task: asyncio.Task | None) -> None:
        if task is not None and not task.done():
            task.cancel()
            self._cancelled.append(task)

    def report(self) -> StepReport:
        r = self.report_
        r.completed = [g.group_id for g in self._completed]
        r.long_queue = self.buffer.count(Place.LONG)
        r.predictions = [
            (g.predicted_length, mean_length(g)) for g in self._completed if g.predicted_length is not None
        ]
        r.turn_predictions = [
            (g.predicted_turns, mean_turns(g)) for g in self._completed if g.predicted_turns is not None
        ]
        rewards: list[float] = []
        for g in self._completed:
            for s in g.samples:
                r.tokens_in_batch += len(s.response_ids)
                r.max_response_length = max(r.max_response_length, len(s.response_ids))
                r.tokens_from_earlier += self._tokens_at_launch.get(s.index, 0)
                r.max_versions_per_sample = max(r.max_versions_per_sample, _distinct_sorted(s.versions))
                if s.reward is not None:
                    rewards.append(s.reward)
        r.reward_mean = sum(rewards) / len(rewards) if rewards else math.nan
        stats = self.buffer.stats()
        r.tokens_discarded = stats["discarded_tokens"] - self._discarded0
        mark = (stats["lag_restarts"], stats["lag_restart_tokens"])
        before = self._m._lag_mark or mark
        r.lag_restarts, r.lag_restart_tokens = mark[0] - before[0], mark[1] - before[1]
        self._m._lag_mark = mark
        return r


def _distinct_sorted(values: list[int]) -> int:
    """Distinct values of a sorted list, in O(distinct x log n)."""
    n, i = 0, 0
    while i < len(values):
        n += 1
        i = bisect.bisect_right(values, values[i], i)
    return n
