"""The simulator runs the real driver loops: the modes of rlkit/driver/modes.py over the real
RolloutService (buffer, manager, policies) on simulated engines, with a trainer whose time
comes from a TrainTimeModel, all in virtual time.

    results = run_simulation(SimConfig(engines=4, profile=load_profile("h100-qwen3-4b-tp2-april")),
                             trace, SyncPolicy(), steps=6, batch_size=32, mode="async")

builds, over one trace: a `ListPromptSource` of the trace's prompts (in the trace's order), a
`RolloutBuffer`, `SimEngines` wrapped in `TraceReplayEngines`, a reward that passes with
probability 1 - difficulty (deterministic per response), and a `RolloutManager` driving the
given policy; then runs `mode`'s loop for `steps` steps and measures each (rlkit.sim.harness).

Placement (`placement`, as the recipe's cluster.placement): "disaggregated" (engines and trainer
on GPUs of their own) or "colocated" (sync mode only): the engines share the trainer's GPUs, so
the loop is built as `Run(..., colocated=True)` and each step also pays the turns of a
`ColocationModel` (rlkit/sim/train_time.py) in virtual time: the engines' sleep
(`SimEngineUpdates.release`: engines release their memory, the trainer onloads its state)
before training, and the trainer's publish is the wake (trainer offloads, engines resume,
weights updated in memory). A
colocated step is then rollout + sleep + train + wake; the step's row has
colocate/sleep_seconds and colocate/wake_seconds (Run's) and the model's parts
(`SimulatedStep.turn`).

What the simulated trainer does not model: in async mode a weight sync pauses the engines on a
real cluster (retract, update, continue); here generation goes on through it (sync_s is a few
seconds against steps of minutes).

A multi-turn trace (rlkit.sim.episodes) runs every sample as an episode through the real
episode layer: model turns end where the trace says, tool calls wait their traced seconds.

Engine faults (`health`, `faults`, `restart_s`; `rlkit bench faults`): the manager gets the real
EngineMonitor over the replay engines, restarting a lost engine `restart_s` after its backoff
(SimRestarter; None: never), and a task injects each Fault at its virtual time
(rlkit.sim.faults). Restarted simulated engines need no weights (admitted at once). Without
`health` and `faults` nothing of this is built: results are exactly those of a run without them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from rlkit.buffers.buffer import RolloutBuffer
from rlkit.buffers.group import Group
from rlkit.common.weight_update import WeightUpdate
from rlkit.driver.loop import LoopState, Run
from rlkit.driver.modes import MODES
from rlkit.driver.rollout_box import Handed, RolloutResult, batch_lags
from rlkit.driver.rollout_service import RolloutService
from rlkit.rollout.config import HealthConfig, SamplingConfig
from rlkit.rollout.engine_updates import StatelessEngines
from rlkit.rollout.filters import GroupFilter
from rlkit.rollout.manager import RolloutManager, RolloutPolicy
from rlkit.rollout.health import EngineMonitor
from rlkit.rollout.rankers import LengthRanker
from rlkit.rollout.reward_scheduler import RewardScheduler
from rlkit.sim.clock import run_virtual
from rlkit.sim.engine import SimConfig, SimEngines, SimRestarter, SimWorker
from rlkit.sim.episodes import episode_runner
from rlkit.sim.faults import Fault, FaultedRun, FaultInjector
from rlkit.sim.harness import SimulatedStep, measure, span, trace_reward, trace_source
from rlkit.sim.replay import BufferPrompts, TraceReplayEngines
from rlkit.sim.trace import Trace
from rlkit.gpu_plan import gpus_per_engine
from rlkit.sim.train_time import ColocationModel, TrainTimeModel
from rlkit.train.microbatch_plan import sample_cost
from rlkit.rollout.timeline import StepTimeline, append_step


DEFAULT_RESTART_S = 60.0  # a lost engine's restart: process start + loading a 4B model on GPU
PLACEMENTS = ("disaggregated", "colocated")  # as the recipe's cluster.placement


class TimedTrainerBox:
    """A trainer that takes virtual time: each group's tokens are computed as they arrive
    (one after another, at the model's tokens/s), the step's overhead once all are in, and a
    weight sync takes `sync_s`. With `colocation` (colocated placement) the engines' sleep and
    wake take the model's turn costs instead, and the wake is the weight sync.
    `on_batch(version, groups)` sees each trained batch."""

    def __init__(self, model: TrainTimeModel | None,
                 on_batch: Callable[[int, list[Group]], None] | None = None,
                 colocation: ColocationModel | None = None) -> None:
        self.model = model
        self.on_batch = on_batch
        self.colocation = colocation
        self._free = 0.0  # when the trainer is done with what it was handed
        self._groups: list[Group] = []
        self._version = 0

    def begin(self, version: int) -> None:
        self._version, self._groups = version, []
        self._free = asyncio.get_running_loop().time()

    def add(self, handed: Handed) -> None:
        now = asyncio.get_running_loop().time()
        for g in handed.refs:
            self._groups.append(g)
            if self.model is not None:  # each group's compute as it arrives (stream mode's overlap)
                cost = sum(sample_cost(n, self.model.attention_weight) for n in lengths_of([g]))
                self._free = max(now, self._free) + cost / self.model.tokens_per_s

    async def finish(self) -> dict[str, float]:
        loop = asyncio.get_running_loop()
        end = self._free
        if self.model is not None:  # the step waits for its slowest data-parallel replica
            lengths = lengths_of(self._groups)
            even = sum(sample_cost(n, self.model.attention_weight) for n in lengths)
            end += self.model.overhead_s + (self.model.slowest_replica(lengths) - even) / self.model.tokens_per_s
        if end > loop.time():
            await asyncio.sleep(end - loop.time())
        if self.on_batch is not None:
            self.on_batch(self._version, self._groups)
        return {}

    def publisher(self) -> "TimedTrainerBox":
        return self

    async def publish(self, update: WeightUpdate) -> dict[str, float]:
        """Publishing takes the sync's time; colocated, the update that wakes sleeping engines
        is the turn to generation (trainer offloads, engines resume, weights in memory)."""
        c = self.colocation
        if c is not None and update.waking:
            return await _take(c.wake())
        if c is not None:  # only restarted engines (awake): an update, no turn
            await asyncio.sleep(c.update_s())
        elif self.model is not None:
            await asyncio.sleep(self.model.sync_s())
        return {}

    def save(self, path: Any) -> None:
        raise NotImplementedError("a simulated run keeps no checkpoint")


async def _take(parts: dict[str, float]) -> dict[str, float]:
    """Spend the parts' seconds in (virtual) time, and report them."""
    await asyncio.sleep(sum(parts.values()))
    return parts


@dataclass
class SimEngineUpdates:
    """The simulated engines around a weight update, in virtual time: when it closes, requests
    still running (async mode's mid-step sync) decode the rest of their tokens with the new
    weights, stamped with its version; colocated, their sleep costs the ColocationModel's turn
    to training (engines release, trainer onloads)."""

    engines: SimEngines
    colocation: ColocationModel | None = None
    state: StatelessEngines = field(default_factory=StatelessEngines)
    blocks = False  # in virtual time: nothing may wait in a thread

    def open(self, urls: Sequence[str], version: int, *, colocated: bool = False,
             adapter: str | None = None) -> WeightUpdate:
        return self.state.open(urls, version, colocated=colocated, adapter=adapter)

    def close(self, update: WeightUpdate) -> None:
        self.state.close(update)
        self.engines.set_weights_version(update.version)

    def fail(self, update: WeightUpdate) -> None:
        pass

    def unload_adapters(self, urls: Sequence[str], names: Sequence[str]) -> list[str]:
        return list(names)

    async def release(self, urls: Sequence[str]) -> dict[str, float]:
        if self.colocation is None:
            raise RuntimeError("engines sleep in the colocated placement's turn; this simulation "
                               "was built without a ColocationModel")
        self.state.release(urls)
        return await _take(self.colocation.sleep())

    def forget(self, urls: Sequence[str]) -> None:
        self.state.forget(urls)


class MeasuredRolloutBox:
    """The in-process rollout box (the RolloutService), noting the engines' counters around
    each rollout step; every other call is the service's own."""

    def __init__(self, service: RolloutService, engines: SimEngines) -> None:
        self.service = service
        self.engines = engines
        self.measured: deque[tuple[Any, Any, float, float, list]] = deque()

    def start_step(self, version: int, *, for_version: int, final: bool,
                   take: int = 0) -> asyncio.Future:
        async def measured() -> RolloutResult:
            loop = asyncio.get_running_loop()
            before, t0 = self.engines.stats(), loop.time()
            result = await self.service.run_step(version, for_version=for_version, final=final,
                                                 take=take)
            self.measured.append((before, self.engines.stats(), t0, loop.time(),
                                  self.engines.drain_segments()))
            return result

        return asyncio.ensure_future(measured())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.service, name)


def tokens_of(groups: list[Group]) -> int:
    """Prompt + response tokens of the trained samples (what the trainer computes over)."""
    return sum(lengths_of(groups))


def lengths_of(groups: list[Group]) -> list[int]:
    """Each trained sample's prompt + response tokens."""
    return [len(s.prompt_ids) + len(s.response_ids) for g in groups for s in g.samples]


async def simulate(
    cluster: SimConfig,
    trace: Trace,
    policy: RolloutPolicy,
    *,
    steps: int,
    batch_size: int | None = None,
    max_new_tokens: int | None = None,
    train: TrainTimeModel | None = None,
    max_staleness: int = 1000,
    max_token_lag: int | None = None,
    timeline_path: str | Path | None = None,
    seed: int = 0,
    observer: Callable[[SimWorker, str], None] | None = None,
    on_batch: Callable[[int, list[Group]], None] | None = None,
    group_filter: GroupFilter | None = None,
    ranker: LengthRanker | None = None,
    buffer: RolloutBuffer | None = None,
    first_step: int = 0,
    final_step: bool = True,
    mode: str = "sync",
    health: HealthConfig | None = None,
    faults: Sequence[Fault] = (),
    restart_s: float | None = DEFAULT_RESTART_S,
    on_faults: Callable[[FaultedRun], None] | None = None,
    placement: str = "disaggregated",
    colocation: ColocationModel | None = None,
) -> list[SimulatedStep]:
    """The coroutine behind `run_simulation` (run it on a VirtualTimeLoop). `observer` sees
    every simulated worker at every event; `on_batch(step, groups)` each trained batch.
    `buffer` (with `first_step`, its version) continues a run from a restored buffer; by
    default a fresh one over the trace's prompts. The last of `steps` is the run's final step
    (tail batching drains its long queue there) unless `final_step` is False, as benchmarks of
    the steady state want. `mode`: the driver loop (rlkit/driver/modes.py).
    `health` (default HealthConfig() when `faults` are given) watches the engines; `faults` are
    injected at their times; a lost engine is restarted after `restart_s` (None: never);
    `on_faults` gets the run's FaultedRun when it ends, also when it fails (EnginesDown).
    `placement`: "disaggregated" or "colocated" (the module docstring); colocated, the turns
    cost `colocation` (default: a ColocationModel with `train`'s params and GPUs), whose GPUs
    must be the engines' (engines x GPUs per engine)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (modes: {', '.join(MODES)})")
    colocation = _colocation(placement, mode, cluster, train, colocation)
    batch = batch_size or trace.batch_size
    cap = max_new_tokens or trace.cap
    if buffer is None:
        buffer = RolloutBuffer(trace_source(trace), n_samples_per_prompt=trace.group_size,
                               max_staleness=max_staleness, max_token_lag=max_token_lag)
    engines = SimEngines(cluster, observer=observer)
    replay = TraceReplayEngines(engines, trace, BufferPrompts(buffer))
    sampling = SamplingConfig(max_new_tokens=cap, temperature=1.0)
    # -- engine faults (absent by default: then the manager is built exactly as before) --
    if faults and health is None:
        health = HealthConfig()
    monitor = injector = None
    watch: dict[str, Any] = {}
    if health is not None and health.enabled:
        restarter = SimRestarter(engines, restart_s) if restart_s is not None else None
        monitor = EngineMonitor(replay, health, restarter, needs_weights=False)
        injector = FaultInjector(engines, faults)
        watch = {"health": monitor, "relaunches_per_sample": health.relaunches_per_sample}
    elif faults:
        raise ValueError("faults need a health monitor (health.enabled)")
    if trace.multi_turn:  # every sample an episode, through the real episode layer
        watch["episodes"] = episode_runner(trace, sampling)
    manager = RolloutManager(buffer, replay, policy, sampling,
                             RewardScheduler(trace_reward(trace, seed)), group_filter=group_filter,
                             ranker=ranker, **watch)
    service = RolloutService(buffer, manager, batch, updates=SimEngineUpdates(engines, colocation))
    box = MeasuredRolloutBox(service, engines)
    results: list[SimulatedStep] = []
    reports: list[Any] = []  # the manager's StepReports, kept only when engines are watched

    def on_step(state: LoopState, result: RolloutResult, handed: Handed, row: dict[str, float]) -> None:
        before, after, t0, t1, segments = box.measured.popleft()
        step, report = state.step - 1, result.report
        tokens = tokens_of(handed.refs)
        sync_s = (colocation.wake_s() if colocation is not None
                  else train.sync_s() if train else 0.0)
        r = measure(step, policy.name, cluster, report, before, after, tokens,
                    train.batch_s(lengths_of(handed.refs)) if train else 0.0, sync_s)
        r.step_s, r.mode, r.placement = row["step/seconds"], mode, placement
        r.trained_lag_tokens, r.trained_max_lag = batch_lags(handed.records)
        r.turn = {k: v for k, v in row.items() if k.startswith("colocate/")}
        r.waited_train_s = (row["train/seconds"] + row["sync/seconds"]
                            + r.turn.get("colocate/sleep_seconds", 0.0))
        results.append(r)
        if monitor is not None:
            reports.append(report)  # relaunches, for FaultedRun
        if timeline_path is not None:
            append_step(timeline_path, StepTimeline(
                step, policy.name, t0, t1, engines.workers(), "sim",
                [span(s, min(cap, trace.cap)) for s in segments], round=report.round,
                phases=list(state.trainer_phases),
            ))

    run = Run(box, TimedTrainerBox(train, on_batch, colocation), first_step + steps, batch,
              on_step, LoopState(step=first_step, version=first_step), final_step=final_step,
              colocated=colocation is not None)
    loop = asyncio.get_running_loop()
    started, error = loop.time(), None
    inject = asyncio.ensure_future(injector.run()) if injector is not None else None
    try:
        await MODES[mode](run)
    except BaseException as e:
        error = e
        raise
    finally:
        if inject is not None:
            inject.cancel()
            await asyncio.gather(inject, return_exceptions=True)
            await manager.close()
        await engines.aclose()
        if monitor is not None and injector is not None and on_faults is not None:
            on_faults(FaultedRun(engines, monitor, injector.injected, results, reports,
                                 started, loop.time(), error))
    return results


def _colocation(placement: str, mode: str, cluster: SimConfig, train: TrainTimeModel | None,
                colocation: ColocationModel | None) -> ColocationModel | None:
    """The turn model of a colocated simulation (None: disaggregated), checked as a colocated
    cluster must be: sync mode, every GPU both an engine's and the trainer's."""
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r} (placements: {', '.join(PLACEMENTS)})")
    if placement == "disaggregated":
        if colocation is not None:
            raise ValueError("a ColocationModel is for placement 'colocated'")
        return None
    if mode != "sync":
        raise ValueError(f"placement 'colocated' cannot run mode {mode!r}: the engines sleep "
                         "while the trainer trains, so nothing overlaps (sync mode only)")
    if colocation is None:
        if train is None:
            raise ValueError("placement 'colocated' needs `train` or `colocation` (the trainer's "
                             "params and GPUs price the turns)")
        colocation = ColocationModel(params=train.params, gpus=train.gpus)
    gpus = cluster.engines * gpus_per_engine(cluster.profile)
    trainer = train.gpus if train is not None else gpus
    for what, n in (("the trainer", trainer), ("the turn model", colocation.gpus)):
        if n != gpus:
            raise ValueError(f"colocated: {cluster.engines} engines use {gpus} GPUs but {what} "
                             f"has {n}; colocated engines and trainer share every GPU")
    return colocation


def run_simulation(cluster: SimConfig, trace: Trace, policy: RolloutPolicy, **kwargs: Any
                   ) -> list[SimulatedStep]:
    """Simulate `steps` steps of a driver mode's loop in virtual time (see `simulate`)."""
    return run_virtual(simulate(cluster, trace, policy, **kwargs))
