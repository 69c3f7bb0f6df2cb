"""EngineMonitor: find dead and hung engines, take them out of service, bring them back.

Every `interval_s` (and at once when a request fails) each serving engine gets a real probe: a
one-token generation sent straight to it (`Engines.probe`), because an engine can answer
/health while its scheduler is stuck; while the driver holds the engines (a weight sync pauses
them, `hold`), only an answer from the server, as paused engines queue generations. A refused
or reset connection declares the engine dead at the first probe.

A generation probe queues behind the engine's own work (prefills, running requests), so on a
busy engine it can time out on a healthy scheduler. As SGLang's /health_generate (healthy when
the scheduler produced anything since the probe began), a timed-out probe is judged by the
engine's progress (`Engines.progress`, read without queueing): its mark at the probe's start
(or, after a timed-out probe, the one read at that probe's end) against its mark when the probe
timed out. Changed: the engine is busy, not hung (`busy_probes`; the run of timeouts ends).
Unchanged, or not answered (a stopped process answers nothing; a mark not read at the start is
not read at the end, so a stopped engine costs one probe per round, and one read more in the
round it stopped in): the probe counts as a timeout, and `hung_after_timeouts` of those in a
row declare the engine hung.

A lost engine leaves the router first (no new request goes there; sglang-router 0.3.2 would
keep choosing it, docs/facts.md), then every request this client may have on it ends at once
(`Engines.abort_worker`): its sample keeps the tokens it streamed and the manager sends it
again to the engines left (rollout.manager). Then, within the engine's restart budget and
after a backoff, the `Restarter` kills what is left of it (a hung process too) and starts it
again. A restarted engine holds the initial weights: it waits in `awaiting_weights` until the
driver has pushed the current ones (`admit`), and only then serves. Where weights do not
matter (simulated engines, tests) `needs_weights=False` admits it at once.

When no engine serves and none can come back, `wait_serving` raises `EnginesDown`: the step
stops, parks every group with its tokens, and the run ends with a checkpoint to resume from.

The router in front of the engines (a `RouterHandle`, when given) is watched the same way: its
/health each round (and at once when a request through it fails), dead at the first refused
connection, hung after `hung_after_timeouts` timeouts. A lost router stops routing (requests
that need it wait in `wait_routing`; those pinned to an engine go on), every request through
it ends client-side and is sent again once it is back, and it is restarted (within
`max_restarts`, after the same backoff) in front of the engines serving then. Its restart and
every change of the engine set at the router take one lock, so an engine lost or admitted
meanwhile is neither kept nor forgotten there. When it cannot come back, `RouterDown`.

Only asyncio and the `Engines` interface: the same monitor runs in the simulator.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any, Awaitable, Callable, Protocol, TypeVar

from rlkit.common.errors import UserError
from rlkit.rollout.config import HealthConfig
from rlkit.rollout.engine_api import EngineError, Engines

log = logging.getLogger(__name__)
T = TypeVar("T")
ROUTER = "router"  # the router's name in the events (engines are named by their URL or id)


class EnginesDown(EngineError, UserError):
    """No engine serves and none can be brought back: the run stops (its groups parked) and
    can be resumed, hence a UserError (its message, no traceback)."""

    exit_code = 1  # not bad input: the run failed, and can be resumed


class RouterDown(EnginesDown):
    """The router is down and cannot be brought back: the run stops as with EnginesDown."""


class Restarter(Protocol):
    async def restart(self, worker: str) -> str:
        """Stop what is left of `worker`'s engine (killing a hung process) and start it again;
        return its new id (URL) once it is healthy. It holds the initial weights."""
        ...


class RouterHandle(Protocol):
    """The router and the client routing through it, as the monitor sees them (in a run:
    rollout.http.router.RouterProcessHandle)."""

    async def probe(self, timeout_s: float) -> str | None:
        """The router's own /health: None when it answered within `timeout_s`, else why not
        ('timeout: ...' when it did not answer in time, anything else when refused)."""
        ...

    async def abort_routed(self) -> int:
        """End client-side every request that went through the router (each raises RouterLost,
        its sample keeping its tokens); requests for it fail at once until `restart`. How many."""
        ...

    async def restart(self, workers: list[str]) -> str:
        """Kill what is left of the router (a hung one too), start it again in front of
        `workers`, and route through it from now on; its new URL."""
        ...


class EngineMonitor:
    def __init__(self, engines: Engines, config: HealthConfig | None = None,
                 restarter: Restarter | None = None, *, needs_weights: bool = True,
                 router: RouterHandle | None = None) -> None:
        self.engines = engines
        self.cfg = config or HealthConfig()
        self.restarter = restarter
        self.needs_weights = needs_weights
        self.lost = 0  # engines declared lost so far: a failed request compares it (manager)
        self.awaiting_weights: list[str] = []  # restarted, not serving until given weights
        self.held = False  # paused or asleep by the driver's doing: probe liveness (`hold`)
        self.events: list[dict[str, Any]] = []  # lost / restarted / restart_failed / back / gave_up
        self.counts: Counter[str] = Counter()
        self._timeouts: Counter[str] = Counter()
        # Timed-out probes of an engine that made progress meanwhile (busy, not hung), per engine
        self.busy_probes: Counter[str] = Counter()
        # An engine's progress mark read when its last probe timed out: the next probe's baseline
        self._marks: dict[str, int] = {}
        self._probing: dict[str, asyncio.Future] = {}  # one probe per engine at a time
        self._slot: dict[str, str] = {w: w for w in engines.workers()}  # URL -> first URL
        self._restarts: Counter[str] = Counter()  # per slot
        self._restarting: set[asyncio.Task] = set()
        self._changed = asyncio.Event()
        # Called on every change of the engine set (lost, restarted, back): the rollout box
        # pushes its progress to the driver then, so restarted engines get weights at once.
        self.listeners: list[Callable[[], None]] = []
        self._task: asyncio.Task | None = None
        self._losing: set[str] = set()  # engines being taken out of service now
        # The router (None: not watched, e.g. simulated engines)
        self.router = router
        self.routing = True  # False from the router's loss to its restart
        self.router_lost = 0  # times it was declared lost: a failed request compares it
        self.router_counts: Counter[str] = Counter()
        self._router_timeouts = 0
        self._router_probing: asyncio.Future | None = None
        self._router_task: asyncio.Task | None = None
        self._router_restarting = False  # a restart is pending or under way
        # One at a time: a router restart and each change of the engine set at the router, so
        # the restart registers the set as it is and no add or remove lands on a dying router.
        self._admin = asyncio.Lock()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the periodic probes (on the running loop); idempotent."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="engine-health")

    async def close(self) -> None:
        tasks = [t for t in (self._task, *self._restarting, *self._probing.values(),
                             self._router_probing, self._router_task) if t]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                if self.router is None:
                    await self.check(fresh=False)
                else:  # a hung engine's probe must not delay the router's
                    for result in await asyncio.gather(self.check(fresh=False),
                                                       self.check_router(fresh=False),
                                                       return_exceptions=True):
                        if isinstance(result, Exception):
                            raise result
            except Exception:  # noqa: BLE001 - the watch must outlive one bad round
                log.exception("engine health check failed")

    # -- checks ------------------------------------------------------------------------------
    async def check(self, workers: list[str] | None = None, *, fresh: bool = True) -> int:
        """Probe `workers` (default: every serving engine) now; how many were lost by it.
        `fresh`: a probe already under way, which began before what the caller saw (a failed
        request), does not answer for it unless it found the engine lost."""
        serving = self.engines.workers()
        targets = [w for w in (workers if workers is not None else serving) if w in serving]
        lost = await asyncio.gather(*(self._probe_once(w, fresh) for w in targets))
        return sum(lost)

    async def sweep(self) -> int:
        """After a control call failed (abort, weight sync): probe every engine until one is
        lost or none can be (a hang takes `hung_after_timeouts` probes). Engines lost."""
        for _ in range(self.cfg.hung_after_timeouts):
            if lost := await self.check():
                return lost
        return 0

    async def _probe_once(self, worker: str, fresh: bool) -> bool:
        fut = self._probing.get(worker)
        if fut is not None:  # one probe per engine at a time: wait for the one under way
            if await asyncio.shield(fut) or not fresh or worker not in self.engines.workers():
                return bool(fut.result())
            fut = self._probing.get(worker)  # another caller may have started the next one
        if fut is None:
            fut = self._probing[worker] = asyncio.ensure_future(self._probe(worker))
            fut.add_done_callback(lambda _f, w=worker: self._probing.pop(w, None))
        return await asyncio.shield(fut)

    def hold(self, held: bool) -> None:
        """The driver holds the engines (paused for a weight sync, or asleep): they queue
        generations, so a probe asks only that each answers (`Engines.probe(generate=False)`).
        A generation probe would time out on every engine of a sync longer than
        hung_after_timeouts x probe_timeout_s and declare them all hung."""
        self.held = held

    async def _probe(self, worker: str) -> bool:
        timeout_s = self.cfg.probe_timeout_s
        if self.held:
            why = await self.engines.probe(worker, timeout_s, generate=False)
        else:  # the mark at the probe's start, read beside it (it does not queue)
            start = asyncio.ensure_future(self._mark(worker, timeout_s))
            try:
                why = await self.engines.probe(worker, timeout_s)
                if why is not None and why.startswith("timeout") and await self._busy(
                        worker, await start, timeout_s):
                    self._timeouts[worker] = 0
                    self.busy_probes[worker] += 1
                    log.info("engine %s busy: its probe timed out (%s) while it made progress",
                             worker, why)
                    return False
            finally:
                if not start.done():
                    start.cancel()
        if why is None:
            self._timeouts[worker] = 0
            self._marks.pop(worker, None)
            return False
        if why.startswith("timeout"):
            self._timeouts[worker] += 1
            if self._timeouts[worker] < self.cfg.hung_after_timeouts:
                return False
            await self.lose(worker, f"hung ({self._timeouts[worker]} probes timed out without "
                            f"progress: {why})")
        else:
            await self.lose(worker, f"dead ({why})")
        return True

    async def _busy(self, worker: str, start: int | None, timeout_s: float) -> bool:
        """After a generation probe timed out: whether the engine made progress since the
        baseline (the mark read when its previous probe timed out, else `start`, read at this
        probe's start). Not read now when `start` got no answer. The mark read now becomes the
        next probe's baseline."""
        baseline = self._marks.pop(worker, None)
        if start is None:
            return False  # no answer to a read that does not queue: no progress to be seen
        if baseline is None:
            baseline = start
        now = await self._mark(worker, timeout_s)
        if now is None:
            return False
        self._marks[worker] = now
        return now != baseline

    async def _mark(self, worker: str, timeout_s: float) -> int | None:
        try:
            return await self.engines.progress(worker, timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed read shows no progress
            log.debug("progress of engine %s not read: %s: %s", worker, type(e).__name__, e)
            return None

    async def lose(self, worker: str, why: str) -> None:
        """Take `worker` out of service now and schedule its restart."""
        if worker not in self.engines.workers() or worker in self._losing:
            return
        self._losing.add(worker)
        self._marks.pop(worker, None)
        self.lost += 1
        self._record("lost", worker, why)
        try:
            async with self._admin:
                await self.engines.remove_worker(worker)  # first: nothing new goes there
        except Exception as e:  # noqa: BLE001 - the router may be gone too; go on
            self._record("remove_failed", worker, f"{type(e).__name__}: {e}")
        finally:
            self._losing.discard(worker)
        await self.engines.abort_worker(worker)  # its requests go on elsewhere
        slot = self._slot.get(worker, worker)
        if self.restarter is not None and self._restarts[slot] < self.cfg.max_restarts:
            task = asyncio.ensure_future(self._restart(worker, slot))
            self._restarting.add(task)
            task.add_done_callback(self._restarting.discard)
        else:
            self._record("gave_up", worker, f"restarts used: {self._restarts[slot]} of "
                         f"{self.cfg.max_restarts}")
        self._notify()

    async def _restart(self, worker: str, slot: str) -> None:
        assert self.restarter is not None
        new = await self._restarted(worker, slot, lambda: self.restarter.restart(worker))
        if new is None:
            self._notify()
            return
        self._slot[new] = slot
        self._record("restarted", new, f"was {worker}")
        if self.needs_weights:
            self.awaiting_weights.append(new)
            self._notify()
        else:
            await self.admit([new])

    async def _restarted(self, name: str, slot: str, attempt: Callable[[], Awaitable[T]]) -> T | None:
        """Restart attempts for an engine's slot or the router (ROUTER), within max_restarts
        for it, each after the backoff (doubling): the first attempt's result, each failed one
        counted (restart_failed); None, counted as gave_up, when none is left."""
        delay = self.cfg.restart_backoff_s
        while self._restarts[slot] < self.cfg.max_restarts:
            self._restarts[slot] += 1
            await asyncio.sleep(delay)
            delay *= 2
            try:
                return await attempt()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - counted, then the next attempt
                self._record("restart_failed", name, f"{type(e).__name__}: {e}")
        self._record("gave_up", name, f"{self.cfg.max_restarts} restarts used")
        return None

    async def admit(self, workers: list[str]) -> None:
        """Restarted engines hold the current weights now: route to them again."""
        for w in workers:
            async with self._admin:
                try:
                    await self.engines.add_worker(w)
                except Exception as e:
                    # Listed by the client all the same (EngineClient.add_worker): when the
                    # router is down, its restart registers it. A router that answers refused it.
                    if not await self._router_unanswering():
                        raise
                    self._record("add_failed", w, f"{type(e).__name__}: {e}; the router's "
                                 "restart registers it")
            if w in self.awaiting_weights:
                self.awaiting_weights.remove(w)
            self._timeouts[w] = 0
            self._record("back", w, "")
        self._notify()

    # -- the router --------------------------------------------------------------------------
    async def check_router(self, *, fresh: bool = True) -> bool:
        """Probe the router now (no-op without one); whether it is out of service, found by
        this probe or before. `fresh` as for `check`."""
        if self.router is None:
            return False
        fut = self._router_probing
        if self.routing and fut is not None:  # one probe at a time: wait for the one under way
            await asyncio.shield(fut)
            if not fresh or not self.routing:
                return not self.routing
            fut = self._router_probing  # another caller may have started the next one
            if fut is not None and fut.done():
                fut = None
        if self.routing:
            if fut is None:
                fut = self._router_probing = asyncio.ensure_future(self._probe_router())
                fut.add_done_callback(self._router_probed)
            await asyncio.shield(fut)
        return not self.routing

    def _router_probed(self, fut: asyncio.Future) -> None:
        if self._router_probing is fut:
            self._router_probing = None

    async def _probe_router(self) -> None:
        assert self.router is not None
        lost = self.router_lost
        why = await self.router.probe(self.cfg.probe_timeout_s)
        if lost != self.router_lost or not self.routing:
            return  # the router was lost meanwhile: this answer is the old one's
        if why is None:
            self._router_timeouts = 0
        elif not why.startswith("timeout"):
            await self.lose_router(f"dead ({why})")
        else:
            self._router_timeouts += 1
            if self._router_timeouts >= self.cfg.hung_after_timeouts:
                await self.lose_router(f"hung ({self._router_timeouts} probes timed out: {why})")

    async def _router_unanswering(self) -> bool:
        """After a call to the router failed: whether it is down, or did not answer a probe
        now (a hung router is declared after hung_after_timeouts of them)."""
        return await self.check_router() or self._router_timeouts > 0

    async def lose_router(self, why: str) -> None:
        """Take the router out of service now: requests that need it wait (`wait_routing`),
        those that went through it end (their samples are sent again once it is back), and its
        restart is scheduled."""
        if self.router is None or not self.routing:
            return
        self.routing = False
        self.router_lost += 1
        self._record("lost", ROUTER, why)
        await self.router.abort_routed()
        if self._restarts[ROUTER] < self.cfg.max_restarts:
            self._router_restarting = True
            self._router_task = asyncio.ensure_future(self._restart_router())
        else:
            self._record("gave_up", ROUTER, f"restarts used: {self._restarts[ROUTER]} of "
                         f"{self.cfg.max_restarts}")
        self._notify()

    async def _restart_router(self) -> None:
        assert self.router is not None
        router = self.router

        async def attempt() -> tuple[str, int]:
            async with self._admin:  # the engine set cannot change until the router has it
                workers = self.engines.workers()
                url = await router.restart(workers)
                self._router_timeouts = 0
                self.routing = True
            return url, len(workers)

        try:
            if (started := await self._restarted(ROUTER, ROUTER, attempt)) is not None:
                self._record("restarted", ROUTER, f"at {started[0]}, in front of {started[1]} engines")
        finally:
            self._router_restarting = False  # before the news: a waiter reads it at once
            self._notify()

    async def wait_routing(self) -> None:
        """Return once the router routes (at once when it does, or without a router); raise
        RouterDown when it is down and cannot come back, or did not within `wait_for_engine_s`."""
        await self._wait_until(
            lambda: self.routing, lambda: self._router_restarting,
            lambda: RouterDown(f"the router is down and cannot be restarted ({self._router_summary()})"),
            lambda: RouterDown(f"the router is down and was not back within "
                               f"{self.cfg.wait_for_engine_s:.0f} s ({self._router_summary()})"))

    def _router_summary(self) -> str:
        recent = "; ".join(f"{e['event']}: {e['detail']}" for e in self.events
                           if e["worker"] == ROUTER)
        return (f"restarts tried: {self._restarts[ROUTER]} of rollout.health.max_restarts="
                f"{self.cfg.max_restarts}; {recent}")

    # -- engines serving -----------------------------------------------------------------------
    async def wait_serving(self) -> None:
        """Return once some engine serves; raise EnginesDown when none does and none can come
        back, or none came back within `wait_for_engine_s`."""
        await self._wait_until(
            lambda: bool(self.engines.workers()),
            lambda: bool(self._restarting or self.awaiting_weights),
            lambda: EnginesDown(f"every engine is down and none can be restarted ({self._summary()})"),
            lambda: EnginesDown(f"no engine served for {self.cfg.wait_for_engine_s:.0f} s "
                                f"({self._summary()})"))

    async def _wait_until(self, ready: Callable[[], bool], coming_back: Callable[[], bool],
                          gone: Callable[[], EnginesDown], late: Callable[[], EnginesDown]) -> None:
        """Wait for `ready()`, woken by every change of the engine set or the router; `gone()`
        is raised when nothing is `coming_back()`, `late()` after `wait_for_engine_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.wait_for_engine_s
        while not ready():
            if not coming_back():
                raise gone()
            left = deadline - loop.time()
            if left <= 0:
                raise late()
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    # -- reporting ---------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        out = {
            "engines/serving": float(len(self.engines.workers())),
            "engines/lost": float(self.counts["lost"]),
            "engines/restarted": float(self.counts["restarted"]),
            "engines/restart_failed": float(self.counts["restart_failed"]),
            "engines/gave_up": float(self.counts["gave_up"]),
            # generation probes that timed out on an engine making progress (busy, not hung)
            "engines/busy_probes": float(sum(self.busy_probes.values())),
        }
        if self.router is not None:
            out.update({
                "router/lost": float(self.router_counts["lost"]),
                "router/restarts": float(self.router_counts["restarted"]),
                "router/restart_failed": float(self.router_counts["restart_failed"]),
            })
        return out

    def _record(self, kind: str, worker: str, detail: str) -> None:
        (self.router_counts if worker == ROUTER else self.counts)[kind] += 1
        event = {"t": asyncio.get_running_loop().time(), "event": kind, "worker": worker,
                 "detail": detail}
        self.events.append(event)
        (log.warning if kind in ("lost", "restart_failed", "gave_up") else log.info)(
            "%s %s %s %s", "the" if worker == ROUTER else "engine", worker, kind, detail)

    def _summary(self) -> str:
        recent = "; ".join(f"{e['event']} {e['worker']} {e['detail']}".strip()
                           for e in self.events[-6:])
        return f"{self.counts['lost']} lost, {self.counts['restarted']} restarted; {recent}"

    def _notify(self) -> None:
        self._changed.set()
        for listener in self.listeners:
            listener()
