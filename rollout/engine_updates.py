"""The rollout side's hold on its engines around a weight update: it owns them (membership,
health, restarts: rollout.health; their state: here), and the trainer only publishes weights
into the update this opens (docs/design.md, "One owner for the engines"; slime keeps the same
split: the rollout side holds engine memory and update control, the trainer sends tensors).

One update, whatever the method:

    open     the awake engines pause (`pause_mode`) and flush their cache (not under in_place:
             the paused requests keep their KV cache, and SGLang and the built-in engine refuse
             a flush while any does); a sleeping engine (colocated) takes back only its
             weights' memory. For the broadcast and in-memory methods every engine then opens
             an update session (/begin_weight_update, which SGLang 0.5.23 requires).
    publish  the trainer's (WeightPublisher): into the open update, by the method it names
             (a disk folder, in-memory handles, an NCCL/gloo broadcast group).
    close    the session ends; the woken engines take back their KV cache and CUDA graphs, the
             others continue, each token after stamped with the new version.

If the publish fails half-way the engines stay paused (continuing would serve a mix of two
weight versions): `fail` ends the sessions that opened, and the caller sends the update again to
the engines left (RolloutService.update_weights). Sleep (`release`, colocated) frees every tag
(KV cache, weights, CUDA graphs) of idle engines; the next update wakes them in stages, as verl
does, so a GPU never holds the old and the new allocation at once.

Blocking (stdlib HTTP in a thread pool): the async caller runs each call in a thread.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence, TypeVar

from rlkit.common.engine_http import EngineControl, HttpEngine, WeightSyncError, fan_out
from rlkit.common.weight_update import SESSION_METHODS, Method, WeightUpdate
T = TypeVar("T")


class UpdateControl(Protocol):
    """What RolloutService asks of its engines around updates (EngineUpdates over HTTP,
    StatelessEngines for fakes, the simulator's in virtual time). A call may be a coroutine
    function; `blocks` True: the calls wait on the network (run in a thread)."""

    blocks: bool

    def open(self, urls: Sequence[str], version: int, *, colocated: bool = False,
             adapter: str | None = None) -> WeightUpdate: ...
    def close(self, update: WeightUpdate) -> None: ...
    def fail(self, update: WeightUpdate) -> None: ...
    def release(self, urls: Sequence[str]) -> dict[str, float]: ...
    def forget(self, urls: Sequence[str]) -> None: ...


@dataclass
class EngineUpdates:
    """The engines' state around updates, by URL: which sleep, which opened a session."""

    blocks = True  # stdlib HTTP: RolloutService runs each call in a thread

    method: Method
    pause_mode: str = "abort"
    folder: str | None = None
    timeout_s: float = 600.0
    control: Callable[[str], EngineControl] = field(default=lambda url: HttpEngine(url))
    # Engines put to sleep, by URL: "asleep" (every tag released) or "weights" (weights resumed
    # by an update that then failed; KV cache still released).
    sleeping: dict[str, str] = field(default_factory=dict)
    _pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=16, thread_name_prefix="engine-control"))

    @property
    def flushes(self) -> bool:
        return self.pause_mode != "in_place"

    def _on_all(self, engines: Sequence[EngineControl], step: str, call, done=None) -> list:
        return fan_out(self._pool, engines, step, call, self.timeout_s, done)

    def open(self, urls: Sequence[str], version: int, *, colocated: bool = False,
             adapter: str | None = None) -> WeightUpdate:
        """Pause (or start waking) these engines and open the update of `version` on them.
        `adapter`: a LoRA adapter update (the adapter is loaded beside the base and the ones in
        use, and only new requests name it): nothing pauses, flushes or opens a session."""
        if adapter is not None:
            if any(u in self.sleeping for u in urls):
                raise WeightSyncError("a LoRA adapter update cannot wake sleeping engines (their "
                                      "base weights were released); colocated runs sync merged")
            return WeightUpdate(version, tuple(urls), self.method, self.folder, False, colocated,
                                frozenset(), adapter)
        engines = [self.control(u) for u in urls]
        waking = frozenset(u for u in urls if u in self.sleeping)
        awake = [e for e in engines if e.url not in self.sleeping]
        if awake:
            self._on_all(awake, "pause_generation", lambda e: e.pause(self.pause_mode))
            if self.flushes:
                self._on_all(awake, "flush_cache", lambda e: e.flush_cache())
        asleep = [e for e in engines if self.sleeping.get(e.url) == "asleep"]
        if asleep:
            self._on_all(asleep, "resume_memory_occupation (weights)",
                         lambda e: e.resume_memory(["weights"]),
                         done=lambda e, _: self.sleeping.__setitem__(e.url, "weights"))
        update = WeightUpdate(version, tuple(urls), self.method, self.folder, self.flushes,
                              colocated, waking)
        if self.method in SESSION_METHODS:
            try:
                self._on_all(engines, "begin_weight_update", lambda e: e.begin_update())
            except WeightSyncError:
                self.fail(update)  # where it began, it ends: the update sent again can begin
                raise
        return update

    def run(self, urls: Sequence[str], version: int, publish: Callable[[WeightUpdate], T], *,
            colocated: bool = False) -> T:
        """One update, blocking: open it, `publish(update)` (the trainer's part), close it; if
        the publish fails the sessions end and the engines stay paused (RolloutService does
        the same around Ray, and sends it again to the engines left). The publish's answer."""
        update = self.open(urls, version, colocated=colocated)
        try:
            out = publish(update)
        except BaseException:
            self.fail(update)
            raise
        self.close(update)
        return out

    def close(self, update: WeightUpdate) -> None:
        """The weights are in: end the session; the woken engines take their KV cache (and
        CUDA graphs) back, the others continue."""
        if update.adapter is not None:  # nothing was paused (see open)
            return
        engines = [self.control(u) for u in update.engines]
        if update.method in SESSION_METHODS:
            self._on_all(engines, "end_weight_update", lambda e: e.end_update())
        woken = [e for e in engines if e.url in self.sleeping]
        if woken:
            self._on_all(woken, "resume_memory_occupation (kv_cache, cuda_graph)",
                         lambda e: e.resume_memory(["kv_cache", "cuda_graph"]),
                         done=lambda e, _: self.sleeping.pop(e.url, None))
        awake = [e for e in engines if e.url not in {w.url for w in woken}]
        if awake:
            self._on_all(awake, "continue_generation", lambda e: e.continue_generation())

    def fail(self, update: WeightUpdate) -> None:
        """The publish failed: end the session wherever one opened (the update sent again to
        the engines left must be able to begin); the engines stay paused."""
        if update.method not in SESSION_METHODS or update.adapter is not None:
            return
        for url in update.engines:
            try:
                self.control(url).end_update()
            except Exception:  # noqa: BLE001 - a dead engine cannot be told; others may refuse
                pass

    def unload_adapters(self, urls: Sequence[str], names: Sequence[str]) -> list[str]:
        """LoRA adapter sync: unload these adapters (no request of this run names them any more)
        from these engines. Those every engine unloaded (or did not hold: a restarted engine,
        `unload_lora` False); an engine that refuses one (a request still names it) keeps it
        for the next try."""
        done = []
        for name in names:
            ok = True
            for url in urls:
                try:
                    self.control(url).unload_lora(name)
                except Exception:  # noqa: BLE001 - an engine's refusal is per adapter
                    ok = False
            if ok:
                done.append(name)
        return done

    def release(self, urls: Sequence[str]) -> dict[str, float]:
        """Colocated: put these idle engines to sleep, releasing every tag; an engine already
        asleep is left as it is. Those that succeed are recorded asleep even when another
        fails (WeightSyncError naming it). The bytes the engines report freed (the built-in
        engine reports them; SGLang answers with no body: 0) and the seconds taken."""
        t0 = time.perf_counter()
        todo = [self.control(u) for u in urls if u not in self.sleeping]
        freed = 0

        def asleep(e: EngineControl, answer: dict) -> None:
            nonlocal freed
            self.sleeping[e.url] = "asleep"
            freed += sum(int(v) for v in (answer.get("freed_bytes") or {}).values())

        self._on_all(todo, "release_memory_occupation", lambda e: e.release_memory(None), done=asleep)
        return {"colocate/engine_freed_bytes": float(freed), "colocate/engines_slept": float(len(todo)),
                "colocate/engine_release_seconds": time.perf_counter() - t0}

    def forget(self, urls: Sequence[str]) -> None:
        """These engines were restarted (a restarted engine comes back awake)."""
        for url in urls:
            self.sleeping.pop(url, None)

    def close_pool(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class StatelessEngines:
    """EngineUpdates for engines that hold no state around an update (test fakes, simulated
    engines: their version moves with RolloutService.set_version): nothing is called."""

    blocks = False

    method: Method = "disk"
    folder: str | None = None
    sleeping: dict[str, str] = field(default_factory=dict)

    def open(self, urls: Sequence[str], version: int, *, colocated: bool = False,
             adapter: str | None = None) -> WeightUpdate:
        waking = frozenset(u for u in urls if u in self.sleeping)
        return WeightUpdate(version, tuple(urls), self.method, self.folder, True, colocated, waking,
                            adapter)

    def close(self, update: WeightUpdate) -> None:
        self.forget(update.engines)

    def fail(self, update: WeightUpdate) -> None:
        pass

    def unload_adapters(self, urls: Sequence[str], names: Sequence[str]) -> list[str]:
        return list(names)

    def release(self, urls: Sequence[str]) -> dict[str, float]:
        self.sleeping.update((u, "asleep") for u in urls)
        return {}

    def forget(self, urls: Sequence[str]) -> None:
        for url in urls:
            self.sleeping.pop(url, None)

    def close_pool(self) -> None:
        pass


__all__ = ["EngineUpdates", "StatelessEngines", "UpdateControl", "WeightSyncError"]
