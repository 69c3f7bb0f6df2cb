"""Engine faults on a schedule, in virtual time: what `simulate(..., faults=...)` injects into
its simulated engines while the real manager, health monitor and driver loop run.

    faults = [Fault(120.0, "kill", 0), Fault(300.0, "hang", 2)]

`Fault.worker` is an index among the engines that serve at the fault's time and have not been
hit yet (modulo their count), so a schedule does not need to know the engines' ids, which
change with every restart, and several faults at one instant hit distinct engines.

A hung simulated engine freezes in the middle of its run of decode steps: the tokens it has
decoded since its last event were never streamed and are in no counter (rlkit.sim.engine).
`FaultInjector` computes them at the fault, as `Injected.tokens_in_flight`: the only tokens a
fault may lose. (A real engine streams every token, so it loses at most the decode step in
progress; the simulator's figure is an upper bound of that.)

Pure asyncio over `SimEngines`; no HTTP, Ray or torch.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Sequence

from rlkit.sim.engine import SimEngines

if TYPE_CHECKING:
    from rlkit.rollout.health import EngineMonitor
    from rlkit.sim.harness import SimulatedStep

FaultKind = Literal["kill", "hang"]
FAULT_KINDS: tuple[FaultKind, ...] = ("kill", "hang")


@dataclass(frozen=True)
class Fault:
    """At `at_s` virtual seconds after the run starts, `kind` hits serving engine `worker`."""

    at_s: float
    kind: FaultKind
    worker: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r} (kinds: {', '.join(FAULT_KINDS)})")
        if not self.at_s >= 0:
            raise ValueError(f"a fault's time must be >= 0 s, got {self.at_s}")
        if self.worker < 0:
            raise ValueError(f"a fault's worker index must be >= 0, got {self.worker}")


@dataclass
class Injected:
    """One fault as it happened. `worker` is None when no engine was left to hit."""

    fault: Fault
    t: float  # loop time of the injection
    worker: str | None
    tokens_in_flight: int = 0  # decoded by a hung engine since its last event: never streamed


@dataclass
class FaultedRun:
    """What `simulate` hands `on_faults` when a run with a health monitor ends (also when it
    failed, e.g. with EnginesDown): enough to account for every engine, group and token."""

    engines: SimEngines
    monitor: "EngineMonitor"
    injected: list[Injected]
    results: list["SimulatedStep"]  # the steps that completed
    reports: list[Any]  # their manager StepReports (requests_relaunched, relaunched_tokens)
    started: float  # loop time the run started (fault times count from here)
    ended: float
    error: BaseException | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def random_faults(seed: int, count: int, horizon_s: float, engines: int,
                  kinds: Sequence[FaultKind] = FAULT_KINDS) -> list[Fault]:
    """`count` faults at uniform times in [0, horizon_s), of uniform kinds, on uniform engine
    indices; sorted by time. Deterministic in `seed`."""
    if count < 0 or horizon_s <= 0 or engines < 1:
        raise ValueError("random_faults needs count >= 0, horizon_s > 0 and engines >= 1")
    rng = random.Random(seed)
    faults = [Fault(round(rng.uniform(0, horizon_s), 3), rng.choice(list(kinds)),
                    rng.randrange(engines)) for _ in range(count)]
    return sorted(faults, key=lambda f: f.at_s)


class FaultInjector:
    """Injects a schedule of faults into `engines` (run `run()` as a task from the start)."""

    def __init__(self, engines: SimEngines, faults: Sequence[Fault]) -> None:
        self.engines = engines
        self.faults = sorted(faults, key=lambda f: f.at_s)  # stable: ties keep their order
        self.injected: list[Injected] = []
        self._hit: set[str] = set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for f in self.faults:
            if (wait := t0 + f.at_s - loop.time()) > 0:
                await asyncio.sleep(wait)
            self.inject(f)

    def inject(self, f: Fault) -> Injected:
        # Not yet hit: a fault's engine stays listed as serving until the monitor notices.
        candidates = [w for w in self.engines.workers() if w not in self._hit]
        now = asyncio.get_running_loop().time()
        if not candidates:
            done = Injected(f, now, None)
        else:
            wid = candidates[f.worker % len(candidates)]
            self._hit.add(wid)
            lost = unstreamed_tokens(self.engines, wid) if f.kind == "hang" else 0
            getattr(self.engines, f.kind)(wid)
            done = Injected(f, now, wid, lost)
        self.injected.append(done)
        return done


def unstreamed_tokens(engines: SimEngines, worker: str) -> int:
    """Tokens `worker` has decoded in its current run of decode steps (not yet on any sample,
    nor in its counters: they are advanced at the run's end or when it is interrupted).
    SimEngines exposes no accessor for this, hence the private attributes (read only)."""
    w = engines._workers[worker]  # noqa: SLF001
    plan = w._plan  # noqa: SLF001
    if plan is None:
        return 0
    done = plan.steps_done(asyncio.get_running_loop().time() - plan.t0)
    return sum(min(done, r.remaining) for r in w.running.values())
