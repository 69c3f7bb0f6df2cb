"""The rollout box's one implementation: the RolloutBuffer, the RolloutManager and reward
scoring, in one process (rlkit/driver/rollout_box.py has the protocol it implements).

In a run it lives in one Ray actor (the buffer's home, docs/design.md); in tests and in the
simulator the loops call it directly. The engines are injected: the HTTP client in front of the
router in a run, fakes or simulated engines elsewhere; so is how groups are handed to the
trainer (`hand`: the groups themselves in process, Ray object references in the actor).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, TypeVar

from rlkit.buffers import Group, PromptSource, RolloutBuffer, Sample, load_buffer, save_buffer
from rlkit.common.weight_update import (PublisherFailed, WeightPublisher, WeightsMismatch,
                                        adapter_name, adapter_version)
from rlkit.driver.rollout_box import Handed, RolloutResult, handed_of, lag_record
from rlkit.rollout.config import RolloutConfig
from rlkit.rollout.engine_api import Engines
from rlkit.rollout.engine_updates import StatelessEngines, UpdateControl
from rlkit.rollout.episodes import EpisodeRunner
from rlkit.rollout.evaluator import Evaluator, eval_metrics
from rlkit.rollout.filters import GroupFilter
from rlkit.rollout.health import EngineMonitor, Restarter, RouterHandle
from rlkit.rollout.manager import RolloutManager, batch_target
from rlkit.rollout.policies import make_policy
from rlkit.rollout.rankers import LengthRanker
from rlkit.rollout.sample_rows import SamplePicker
from rlkit.rollout.reward_scheduler import REWARD_FAILURE_KINDS, RewardScheduler, ScoreFn, TeacherFn
from rlkit.rollout.step_report import StepReport

if TYPE_CHECKING:  # the HTTP layer: the service itself runs over any Engines
    from rlkit.rollout.http.frozen_groups import FrozenGroup

T = TypeVar("T")


class RolloutService:
    """The buffer and the manager over it, with what the driver's modes call (RolloutBox)."""

    def __init__(self, buffer: RolloutBuffer, manager: RolloutManager, batch_size: int,
                 evaluator: Evaluator | None = None,
                 hand: Callable[[list[Group]], Handed] = handed_of,
                 updates: "UpdateControl | None" = None) -> None:
        self.buffer = buffer
        self.manager = manager
        self.engines = manager.engines
        self.batch_size = batch_size
        self.evaluator = evaluator
        self.hand = hand
        # The engines' state around weight updates (rollout/engine_updates.py): HTTP control in
        # a run; engines with no state to hold (fakes, simulated) otherwise.
        self.updates: UpdateControl = updates if updates is not None else StatelessEngines()
        # LoRA adapter sync (train.lora.sync: adapter, set by the driver): each update loads the
        # trainer's adapter as `policy@v<version>` and new requests name it; `_adapters` are
        # those loaded and not yet unloaded (an adapter goes once no request names it)
        self.adapter_sync = False
        # tracking.samples_per_step (set by the driver): a few trained samples whole per step
        self.sample_picker: SamplePicker | None = None
        self._adapters: list[str] = []
        # train.lora.resume 'own' (set by the driver): adapters unfinished samples began under
        # stay loaded, the newest `keep_versions` at most (the current one included)
        self.resume_own_adapter = False
        self.keep_versions = 1
        # train.weight_sync.verify (set by the driver): after each update every engine scores
        # the trainer's probe, at the sampling temperature; None: no check
        self.verify_tolerance: float | None = None
        self.verify_temperature = 1.0
        self._probe_prev: tuple[list[int], list[float]] | None = None  # the last sync's trainer
        self._told_restarted: set[str] = set()  # restarted engines whose sleep was forgotten
        self._current: asyncio.Task | None = None
        self._untrained: list[Group] = []  # handed to the trainer since the last weight sync
        # Set when there is news for the driver while a step runs (an engine lost, restarted or
        # back): the step's progress stream pushes it at once instead of at the next heartbeat.
        self._news = asyncio.Event()
        self.frozen: dict[str, FrozenGroup] = {}  # rollout.frozen_engines (the actor owns them)
        if manager.health is not None:
            manager.health.listeners.append(self._news.set)

    @classmethod
    def from_config(
        cls,
        cfg: RolloutConfig,
        source: PromptSource,
        engines: Engines,
        score: ScoreFn,
        group_filter: GroupFilter | None = None,
        ranker: LengthRanker | None = None,
        restarter: Restarter | None = None,
        evaluator: Evaluator | None = None,
        hand: Callable[[list[Group]], Handed] = handed_of,
        episodes: EpisodeRunner | None = None,
        updates: "UpdateControl | None" = None,
        router: RouterHandle | None = None,
        frozen: "dict[str, FrozenGroup] | None" = None,
    ) -> "RolloutService":
        """`restarter`: how a lost engine is started again (none: the run goes on without it).
        A restarted engine serves once it has the weights (`update_weights`).
        `evaluator`: the recipe's held-out evaluation, over the same engines. `hand`: how ready
        groups go to the trainer (in process: the groups themselves). `episodes`: multi-turn
        rollouts (rlkit.plugins.load_episode_runner; None: one request per sample). `updates`:
        the engines' control around weight updates (EngineUpdates; None: engines with no state).
        `router`: the router in front of the engines, watched and restarted with them
        (rollout.health; None: not watched). `frozen`: the frozen engine groups by name
        (rollout.frozen_engines); the teacher among them scores every completed sample."""
        buffer = RolloutBuffer(
            source,
            n_samples_per_prompt=cfg.n_samples_per_prompt,
            max_staleness=cfg.max_staleness,
            staleness_policy=cfg.staleness_policy,
            max_token_lag=cfg.max_token_lag,
        )
        rewards = RewardScheduler(score, timeout_s=cfg.reward.timeout_s, on_error=cfg.reward.on_error,
                                  teacher=teacher_scorer(cfg, frozen or {}))
        health = (EngineMonitor(engines, cfg.health, restarter, router=router)
                  if cfg.health.enabled else None)
        manager = RolloutManager(buffer, engines, make_policy(cfg), cfg.sampling, rewards,
                                 group_filter=group_filter, ranker=ranker, health=health,
                                 relaunches_per_sample=cfg.health.relaunches_per_sample,
                                 episodes=episodes, max_resume_log_ratio=cfg.max_resume_log_ratio)
        service = cls(buffer, manager, cfg.batch_size, evaluator, hand, updates)
        service.frozen = dict(frozen or {})
        return service

    def start_step(self, version: int, *, for_version: int, final: bool,
                   take: int = 0) -> asyncio.Future[RolloutResult]:
        return asyncio.ensure_future(self.run_step(version, for_version=for_version, final=final,
                                                   take=take))

    async def run_step(self, version: int, *, for_version: int | None = None,
                       final: bool = False, take: int = 0) -> RolloutResult:
        """One rollout step with the engines at `version`, for groups the trainer takes at
        consumer version `for_version` (default: `version`; one more in async mode, which the
        buffer admits only within max_staleness); afterwards `batch_size` groups are ready.
        `final`: the run's last step (tail batching drains its long queue). `take`: that many
        ready groups are taken at its end and handed over with the result (`take(n)` without
        a round trip of its own)."""
        self.buffer.begin_production(version if for_version is None else for_version)
        failures_before = self.manager.rewards.failures.copy()
        frozen_before = {name: g.metrics() for name, g in self.frozen.items()}
        self._current = asyncio.ensure_future(
            self.manager.run_step(batch_target(self.buffer, self.batch_size), version,
                                  final=final))
        try:
            report: StepReport = await self._current
        finally:
            self._current = None
        # this step's reward failures by kind, beside the manager's total rollout/reward_failures
        failures = self.manager.rewards.failures
        by_kind = {f"rollout/reward_failures/{kind}": failures[kind] - failures_before[kind]
                   for kind in REWARD_FAILURE_KINDS}
        episodes = self.manager.episodes
        # the engines' prefix-cache hits of the step's requests (the HTTP client reads them)
        prefix = getattr(self.engines, "prefix_cache_metrics", lambda: {})()
        own = getattr(self.engines, "own_adapter_metrics", lambda: {})()  # LoRA resume 'own'
        return RolloutResult(
            metrics={**report.metrics(), **by_kind, **(episodes.metrics() if episodes else {}),
                     **prefix, **own, **self._frozen_metrics(frozen_before)},
            # the frozen groups' tries (a teacher's scoring, a judge's verdicts): lanes frozen:<name>
            timeline=[s.to_json() for s in [*report.timeline,
                                            *(x for g in self.frozen.values() for x in g.take_spans())]],
            completed=report.completed,
            buffer=self.stats(),
            header={"policy": report.policy, "round": report.round, "start": report.started,
                    "end": report.started + report.seconds, "workers": self.engines.workers(),
                    "source": "real"},
            report=report,
            handed=await self.take(take) if take else None,
            dropped=report.dropped_groups,
        )

    def _frozen_metrics(self, before: dict[str, dict[str, float]]) -> dict[str, float]:
        """The frozen groups' counts of this step (requests, seconds, retries, failures) and
        their engines' and router's health counts since the run began (as engines/*)."""
        out = {}
        for name, group in self.frozen.items():
            for key, value in group.metrics().items():
                tail = key.split("/", 2)[2]
                per_step = not tail.startswith(("engines/", "router/", "weight_versions"))
                out[key] = value - before[name].get(key, 0.0) if per_step else value
        return out

    async def run_step_streamed(self, version: int, *, for_version: int, final: bool,
                                take: int = 0, heartbeat_s: float = 0.5) -> AsyncIterator[Any]:
        """`run_step`, pushing news while it runs: a progress snapshot (`progress()`) when the
        engine set changes and at least every `heartbeat_s` (the console's progress line), then
        the RolloutResult as the last item. What the rollout actor streams to the driver."""
        step = asyncio.ensure_future(self.run_step(version, for_version=for_version, final=final,
                                                   take=take))
        try:
            while not step.done():
                self._news.clear()
                news = asyncio.ensure_future(self._news.wait())
                await asyncio.wait({step, news}, timeout=heartbeat_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                news.cancel()
                if not step.done() and (p := self.progress()) is not None:
                    yield p
            yield step.result()
        finally:  # the driver went away (Ctrl-C): stop the step as cancel() would
            if not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)

    async def evaluate(self, version: int) -> dict[str, float]:
        """The recipe's evaluation with the engines at `version` (its metrics row; {} when the
        recipe has none). Its samples are its own: the buffer and its accounting never see them."""
        if self.evaluator is None:
            return {}
        return eval_metrics(await self.evaluator.run(self.engines, version))

    def progress(self) -> dict[str, Any] | None:
        step = self.manager.current
        if step is None:
            return None
        return {**step.progress(), "awaiting_weights": self.engines_now()[1]}

    def engines_now(self) -> tuple[list[str], list[str]]:
        """The engines serving, and those restarted that wait for the current weights."""
        health = self.manager.health
        return self.engines.workers(), list(health.awaiting_weights) if health else []

    def _hold(self, held: bool) -> None:
        """Paused for a weight update (or asleep): rollout.health probes only that they answer."""
        if self.manager.health is not None:
            self.manager.health.hold(held)

    def _fresh(self, restarted: list[str]) -> None:
        """Restarted engines come back awake, whatever was known of their URL before: their
        sleep is forgotten once (a later call may put them to sleep again)."""
        fresh = [u for u in restarted if u not in self._told_restarted]
        self.updates.forget(fresh)
        self._told_restarted.update(fresh)

    async def update_weights(self, version: int, publisher: WeightPublisher, *,
                             colocated: bool = False, restarted_only: bool = False) -> dict[str, float]:
        """The one weight update of every mode (and of a resume), on the engines serving and
        those restarted (which serve from now on): open the update, have `publisher` (the
        trainer) publish `version` into it, close it; the buffer and the manager then know the
        engines' version. With every engine lost the trainer still takes the version (a
        checkpoint written now must agree with the step's), and the next rollout step stops
        the run. `restarted_only`: only the engines restarted since (mid-step, at the trainer's
        current version). `colocated`: the turn to generation (the sleeping engines wake).
        Metrics: the trainer's, and how long the engines were paused."""

        adapter = adapter_name(version) if self.adapter_sync else None

        async def push(targets: list[str]) -> dict[str, float]:
            t0 = asyncio.get_running_loop().time()
            update = await self._control("open", targets, version, colocated=colocated,
                                         adapter=adapter)
            if self.verify_tolerance is not None:
                update = dataclasses.replace(update, probe=True)
            try:
                metrics = await publisher.publish(update)
            except BaseException:
                await self._control("fail", update)  # the engines stay paused
                raise
            await self._control("close", update)
            return {**(metrics or {}), "sync/paused_seconds": asyncio.get_running_loop().time() - t0}

        if restarted_only and not self.engines_now()[1]:
            return {}
        self._hold(True)
        try:
            metrics, restarted = await self._on_engines_left(push, restarted_only)
        finally:
            self._hold(False)
        probe = (metrics.pop("sync/probe_ids", None), metrics.pop("sync/probe_logprobs", None),
                 metrics.pop("sync/probe_base_logprobs", None))
        if not restarted_only:
            await self.set_version(version)
            if adapter is not None:
                metrics = {**metrics, **await self._switch_adapter(adapter)}
        if probe[0] is not None:
            metrics = {**metrics, **await self._verify(version, *probe)}
        if restarted and self.resume_own_adapter:  # a restarted engine holds the newest alone
            self.engines.kept_adapters = frozenset(a for a in [self.engines.adapter] if a)
        if restarted and self.manager.health is not None:
            await self.manager.health.admit(restarted)
        self._told_restarted -= set(restarted)  # serving now: a later restart is news again
        return metrics

    async def _verify(self, version: int, ids: list[int], trainer: list[float],
                      base: list[float] | None) -> dict[str, float]:
        """train.weight_sync.verify: every engine scores the probe under the adapter requests
        name now; WeightsMismatch (the run stops) when one is further from the trainer than the
        tolerance, or clearly nearer another policy than this one: the previous sync's trainer
        (this sync did not arrive) or, with LoRA, the base model (`base`: the adapter was not
        applied). Below 1e-4 an engine equals the trainer at fp32 precision: that passes.
        Metrics: the largest mean |difference| to this sync's trainer and to the last one's."""
        tol = self.verify_tolerance
        assert tol is not None
        prev = self._probe_prev[1] if self._probe_prev and self._probe_prev[0] == ids else None
        self._probe_prev = (ids, trainer)
        others = [(what, ref) for what, ref in (("the previous sync's trainer", prev),
                                                ("the base model (adapter off)", base)) if ref]

        def mean_abs(a: list[float], b: list[float]) -> float:
            return sum(abs(x - y) for x, y in zip(a, b)) / len(b)

        adapter = getattr(self.engines, "adapter", None)
        workers = self.engines.workers()
        scored = await asyncio.gather(*(self.engines.score(
            w, ids, temperature=self.verify_temperature, adapter=adapter) for w in workers),
            return_exceptions=True)
        failed = [(w, e) for w, e in zip(workers, scored) if isinstance(e, BaseException)]
        if failed:  # an engine lost since the update: rollout.health takes it out (and its
            await self.check_engines()  # restart gets the weights, checked then); else raise
            serving = set(self.engines.workers())
            for w, e in failed:
                if w in serving:
                    raise e
        worst, worst_prev, bad = 0.0, 0.0, []
        for w, engine in zip(workers, scored):
            if isinstance(engine, BaseException):
                continue
            d = mean_abs(engine, trainer)
            worst = max(worst, d)
            if prev is not None:
                worst_prev = max(worst_prev, mean_abs(engine, prev))
            if d > tol:
                bad.append(f"{w}: mean |logprob - trainer's| {d:.3g} > {tol:g}")
                continue
            for what, ref in others:
                d_other = mean_abs(engine, ref)
                if d > 1e-4 and d_other < 0.5 * d:
                    bad.append(f"{w}: nearer {what} (mean |difference| {d_other:.3g}) than this "
                               f"sync's trainer ({d:.3g}): the update did not arrive")
                    break
        if bad:
            raise WeightsMismatch(
                f"after the weight sync to version {version}"
                f"{f' (LoRA adapter {adapter})' if adapter else ''}, the engines do not serve the "
                f"trainer's policy on the probe ({len(ids)} tokens): " + "; ".join(bad) +
                ". Stopping before more samples come from wrong weights "
                "(train.weight_sync.verify; verify_tolerance sets the bound)")
        out = {"sync/verify_abs_diff": worst}
        if prev is not None:
            out["sync/verify_prev_abs_diff"] = worst_prev
        return out

    async def _switch_adapter(self, adapter: str) -> dict[str, float]:
        """New requests name `adapter` (just loaded everywhere); adapters that no request in
        flight names any more are unloaded (one still named stays, and goes at a later update),
        but under resume 'own' those the newest unfinished samples began under stay, up to
        keep_versions. Metrics: the adapters loaded now."""
        self.engines.adapter = adapter
        if adapter not in self._adapters:
            self._adapters.append(adapter)
        in_use = getattr(self.engines, "adapters_in_use", dict)()
        kept = {adapter}
        if self.resume_own_adapter:
            began = self.buffer.unfinished_versions()
            # every adapter here is one of ours, adapter_name(version): it has a version
            versions = {a: adapter_version(a) for a in self._adapters if a != adapter}
            named = sorted((a for a, v in versions.items() if began.get(v)), key=versions.__getitem__)
            if self.keep_versions > 1:
                kept.update(named[-(self.keep_versions - 1):])
            # before any await: no request is sent naming one about to go
            self.engines.kept_adapters = frozenset(kept)
        stale = [a for a in self._adapters if a not in kept and not in_use.get(a)]
        if stale:
            gone = await self._control("unload_adapters", self.engines.workers(), stale)
            self._adapters = [a for a in self._adapters if a not in gone]
        return {"sync/adapters_loaded": float(len(self._adapters))}

    async def sleep_engines(self) -> dict[str, float]:
        """Colocated, the turn to training: the engines (idle: the step's rollout is over)
        release their KV cache and weights. They stay held until the update that wakes them:
        a sleeping engine queues generations, so probes ask only that it answers. Metrics."""
        self._hold(True)
        metrics, _ = await self._on_engines_left(lambda targets: self._control("release", targets))
        return metrics

    async def _on_engines_left(self, call: Callable[[list[str]], Awaitable[T]],
                               restarted_only: bool = False) -> tuple[T, list[str]]:
        """`call(targets)` on the engines serving and those restarted (waiting for weights), and
        again on the engines left while engines are lost during it: an engine that dies fails
        the call, every engine is probed (rollout.health takes the dead one out, and restarts
        it), and the call is made again on the set as it is now, as a generation request is
        relaunched. The same engines failing again is not an engine lost: that error is raised;
        so is the trainer's own (PublisherFailed). Its answer and the restarted engines."""
        failure: Exception | None = None
        targets: list[str] = []
        while True:
            serving, restarted = self.engines_now()
            now = [*([] if restarted_only else serving), *restarted]
            if failure is not None and set(now) == set(targets):
                raise failure
            targets = now
            self._fresh(restarted)
            try:
                return await call(targets), restarted
            except PublisherFailed:
                raise
            except Exception as e:  # noqa: BLE001 - raised above if the engines are all there
                failure = e
                await self.check_engines()

    async def _control(self, call: str, *args: Any, **kwargs: Any) -> Any:
        """An UpdateControl call: awaited when it is a coroutine (simulated engines, in virtual
        time), in a thread when the control `blocks` (HTTP), else made at once (a thread would
        let the simulator's virtual clock jump while it waits)."""
        fn = getattr(self.updates, call)
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        if getattr(self.updates, "blocks", False):
            return await asyncio.to_thread(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    async def check_engines(self) -> int:
        """Probe every engine now (as often as a hang takes to be declared); engines lost."""
        return await self.manager.health.sweep() if self.manager.health is not None else 0

    async def take(self, n: int) -> Handed:
        """The ready groups for one training step (the oldest first)."""
        try:
            groups = self.buffer.take(n, timeout=0)  # all n or none: a shortfall loses nothing
        except TimeoutError as e:
            raise RuntimeError(f"{e} (after the rollout step); nothing was taken") from None
        self._untrained += groups
        return self._handed(groups)

    async def next_ready(self) -> Handed:
        """The next ready group, as soon as there is one (stream mode). It waits on the event
        loop generation runs on without blocking it."""
        async for group in self.buffer.stream(1):
            self._untrained.append(group)
            return self._handed([group])
        raise RuntimeError("unreachable: stream(1) yields one group")

    def _handed(self, groups: list[Group]) -> Handed:
        """The groups to the trainer, each record with the lag of its trained tokens behind
        the version they are trained at: the consumer's, which the buffer has at hand-out
        (every mode's trainer trains the batch it takes at the version it takes it at)."""
        # a few whole, for the run viewer (tracking): picked, and marked, before they leave
        picked = self.sample_picker.pick(groups, self.buffer.version) if self.sample_picker else []
        handed = self.hand(groups)
        for record, group in zip(handed.records, groups):
            record.update(lag_record(group, self.buffer.version))
        handed.samples = picked
        return handed

    async def admits(self, for_version: int) -> bool:
        return self.buffer.admits(for_version)

    async def set_version(self, version: int) -> None:
        """The trainer's weights, as `version`, are on the engines now (the consumer's and
        the producer's version both move; a step in flight stamps its new tokens with it)."""
        self.buffer.set_version(version)
        self.buffer.set_producer_version(version)
        self.manager.set_weights_version(version)
        self._untrained = []  # trained: the weights came out of them
        new_batch = getattr(self.hand, "new_batch", None)  # a replica hand-off plans per batch
        if new_batch is not None:
            new_batch()

    async def give_back_untrained(self) -> int:
        """The run stops in the middle of a step (every engine down): the groups handed to the
        trainer since the last sync were not trained; back to the ready queue, so a checkpoint
        written now keeps them. How many."""
        groups, self._untrained = self._untrained, []
        self.buffer.untake(groups)
        return len(groups)

    def stats(self) -> dict[str, Any]:
        out = self.buffer.stats()
        stats = getattr(self.buffer.source, "stats", None)
        if callable(stats):
            out["source"] = stats()
        return out

    def save(self, path: str) -> None:
        save_buffer(self.buffer, Path(path))

    def load(self, path: str) -> None:
        load_buffer(self.buffer, Path(path))

    async def cancel(self) -> None:
        """Stop a running step (Ctrl-C): it aborts and parks everything before returning; stop
        watching the engines."""
        if self._current is not None and not self._current.done():
            self._current.cancel()
            await asyncio.gather(self._current, return_exceptions=True)
        await self.manager.close()


def teacher_scorer(cfg: RolloutConfig, frozen: "dict[str, FrozenGroup]") -> TeacherFn | None:
    """The teacher's scoring of a sample (rollout.frozen_engines' group with role teacher): its
    logprob of each response token given everything before it (observations of an episode
    included; the loss mask decides what trains), at the rollout temperature."""
    name = cfg.teacher
    if name is None:
        return None
    if name not in frozen:
        raise ValueError(f"rollout.frozen_engines.{name} (the teacher) was not started")
    group, temperature = frozen[name], cfg.sampling.temperature

    async def teacher(sample: Sample) -> list[float]:
        return await group.score(sample.input_ids(), len(sample.prompt_ids), temperature=temperature,
                                 sample=(sample.group_id, sample.index))

    return teacher
