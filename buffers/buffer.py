"""RolloutBuffer: the one data plane every mode and policy schedules over.

Queues (see docs/design.md):

    source   fresh prompts (a PromptSource: dataset order, epoch, shuffle)
    partial  groups aborted mid-generation, with their tokens; handed out first, oldest first
    long     groups deferred by tail batching or predicted long by a ranker
    ready    complete, rewarded groups, in completion order, for the trainer

Life of a group: `acquire`/`acquire_long` hand it to the producer (IN_FLIGHT); the producer
then `complete`s it (-> ready), `requeue`s it (-> partial), `defer`s it (-> long, keeping its
tokens or restarting from the prompt) or `drop`s it with a reason. Consumers `take` (blocking) or `stream` (async) ready groups; a taken group is
trained. Every group created is, at any moment, in exactly one place: in flight, queued
(partial, long or ready), trained, or dropped with a reason; `stats()` shows the balance.

A prompt is never out twice at once: when the source wraps to a new epoch while the row's
previous copy is still in flight, partial or long (a deferred prompt waits for its long round),
the new copy is held back and handed out once the old one is ready, trained or dropped. With
fewer rows than live groups, `acquire` returns fewer groups rather than a duplicate. Held
prompts are part of the saved state; they are not groups yet, so the balance does not count them.

The staleness rule lives here and nowhere else: when a group whose oldest token lags the
consumer's version by more than `max_staleness` is about to be handed out (to the producer for
resumption, or to the trainer), the configured StalenessPolicy applies, and is counted.

The token-lag bound (`max_token_lag`, optional) is per sample and keeps the group: a sample of
a group about to be resumed whose oldest token would lag the version it is produced for by more
than the bound is restarted from its prompt (its tokens discarded and counted, `lag_restarts`,
`lag_restart_tokens`), its siblings kept; a complete group queued as ready (or still ready when
the consumer's version moves) whose samples lag more goes back to the partial queue with those
samples restarted. So no token the trainer takes lags more than the bound.

Thread-safe: producers and consumers may run in different threads or event loops.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import threading
import time
import warnings
from collections import Counter, deque
from typing import Any, AsyncIterator, Collection, Iterator, NamedTuple, Sequence

from rlkit.common.errors import UserError
from rlkit.buffers.group import Group, Lane, PromptRecord
from rlkit.buffers.sample import Sample, SampleStatus
from rlkit.buffers.source import PromptSource
from rlkit.buffers.staleness import StalenessPolicy, staleness

STATE_FORMAT = "rlkit.buffer"
STATE_VERSION = 1


class BufferError(RuntimeError):
    """A call that does not fit the group's place in the buffer (a bug in the caller)."""


class BufferClosed(RuntimeError):
    """The buffer was closed while a consumer waited."""


class StalenessBoundError(BufferError):
    """A producer asked to run further ahead of the consumer than max_staleness allows."""


class BufferStateError(UserError, ValueError):
    """A saved buffer state that cannot be loaded (corrupt, or from a different run set-up)."""


class Place(str, enum.Enum):
    IN_FLIGHT = "in_flight"
    PARTIAL = "partial"
    LONG = "long"
    READY = "ready"


_LIVE = frozenset({Place.IN_FLIGHT, Place.PARTIAL, Place.LONG})


class Completion(NamedTuple):
    """What `complete` did with a group."""

    surplus: list[Sample]  # speculative responses removed (still running: the caller cancels them)
    queued: bool  # True: ready for the trainer; False: the staleness rule dropped it or sent it
    # back to be regenerated, so it is not part of any batch


class _OldestFirst:
    """Groups ordered by id (creation order = age), with O(log n) push/pop and lazy removal."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int]] = []  # (group_id, ticket)
        self._live: dict[int, tuple[int, Group]] = {}  # group_id -> (ticket, group)
        self._tickets = 0

    def push(self, group: Group) -> None:
        self._tickets += 1
        self._live[group.group_id] = (self._tickets, group)
        heapq.heappush(self._heap, (group.group_id, self._tickets))

    def pop(self) -> Group | None:
        while self._heap:
            gid, ticket = heapq.heappop(self._heap)
            live = self._live.get(gid)
            if live is not None and live[0] == ticket:
                del self._live[gid]
                return live[1]
        return None

    def remove(self, group: Group) -> None:
        self._live.pop(group.group_id, None)

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, group: object) -> bool:
        return isinstance(group, Group) and group.group_id in self._live

    def __iter__(self) -> Iterator[Group]:
        return iter([g for _, g in sorted(self._live.values(), key=lambda tg: tg[1].group_id)])


class RolloutBuffer:
    def __init__(
        self,
        source: PromptSource | None,
        *,
        n_samples_per_prompt: int,
        max_staleness: int = 4,
        staleness_policy: StalenessPolicy | str = StalenessPolicy.DROP,
        max_token_lag: int | None = None,
    ) -> None:
        if n_samples_per_prompt < 1:
            raise ValueError("n_samples_per_prompt must be >= 1")
        if max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        if max_token_lag is not None and max_token_lag < 0:
            raise ValueError("max_token_lag must be >= 0 (or None: no bound)")
        self.source = source
        self.n_samples_per_prompt = n_samples_per_prompt
        self.max_staleness = max_staleness
        self.staleness_policy = StalenessPolicy(staleness_policy)
        self.max_token_lag = max_token_lag

        self._lock = threading.Lock()
        self._ready_cond = threading.Condition(self._lock)
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._closed = False

        self._version = 0  # the consumer's: the trainer's weights
        self._producer_version = 0  # the engines' weights (new tokens carry it)
        self._producing_for = 0  # the consumer version the running rollout step feeds
        self._next_group_id = 0
        self._next_sample_index = 0
        self._place: dict[int, Place] = {}
        self._in_flight: dict[int, Group] = {}
        self._partial = _OldestFirst()
        self._long = _OldestFirst()
        self._ready: deque[Group] = deque()
        self._live_rows: Counter[int] = Counter()  # source rows in flight, partial or long
        self._held: deque[PromptRecord] = deque()  # fresh draws whose row was live (see above)
        self._attached: dict[str, Any] = {}  # scheduling state saved with the buffer (a ranker)
        self._unclaimed: dict[str, dict[str, Any]] = {}  # loaded, for an object not attached yet
        self._counts: Counter[str] = Counter()
        self._dropped: Counter[str] = Counter()

    # -- version ------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The consumer's policy version (what the trainer's weights are at)."""
        return self._version

    def set_version(self, version: int) -> None:
        """The consumer's version moves on (the trainer stepped); ready groups now too old
        meet the staleness rule."""
        with self._lock:
            if version < self._version:
                raise BufferError(f"version cannot go back from {self._version} to {version}")
            self._producing_for = max(self._producing_for, version)
            if version != self._version:
                self._version = version
                self._sweep_ready()

    @property
    def producer_version(self) -> int:
        """The engines' weights: what the tokens generated now are stamped with."""
        return self._producer_version

    def set_producer_version(self, version: int) -> None:
        """New weights reached the engines (at a step boundary, or in the middle of a step in
        async mode: in-flight requests continue with them)."""
        with self._lock:
            if version < self._producer_version:
                raise BufferError(f"producer version cannot go back from "
                                  f"{self._producer_version} to {version}")
            self._producer_version = version

    @property
    def max_ahead(self) -> int:
        """How many versions a rollout step may run ahead of the engines' weights: the smaller
        of max_staleness and max_token_lag (tokens generated now lag that much when trained)."""
        if self.max_token_lag is None:
            return self.max_staleness
        return min(self.max_staleness, self.max_token_lag)

    def admits(self, for_version: int) -> bool:
        """Whether a rollout step whose groups will be trained at consumer version
        `for_version` may start now: its tokens, generated with the engines' current weights,
        would then lag by at most max_staleness and max_token_lag (the admission half of the
        bounds; hand-out is the other)."""
        return for_version - self._producer_version <= self.max_ahead

    def begin_production(self, for_version: int) -> None:
        """A rollout step starts, to be trained at consumer version `for_version` (the
        consumer's own in sync and stream modes, one ahead in async mode). Raises
        StalenessBoundError when that runs further ahead than max_staleness allows; groups
        handed to it for resumption meet the staleness rule against `for_version`."""
        with self._lock:
            if for_version < self._version:
                raise BufferError(f"a rollout step for version {for_version}, but the consumer "
                                  f"is at {self._version} already")
            if not self.admits(for_version):
                raise StalenessBoundError(
                    f"a rollout step for consumer version {for_version} with the engines at "
                    f"version {self._producer_version} runs {for_version - self._producer_version} "
                    f"versions ahead; rollout.max_staleness is {self.max_staleness}, "
                    f"rollout.max_token_lag {self.max_token_lag}")
            ahead = for_version > self._producing_for
            self._producing_for = for_version
            if ahead:  # the ready groups left are trained at for_version now: the rules again,
                self._sweep_ready()  # before the step counts them toward its target

    # -- producer side ------------------------------------------------------------------
    def acquire(self, k: int, *, must_limit: int | None = None) -> list[Group]:
        """Up to k groups to generate: partial groups first (oldest first), then fresh prompts
        (held-back ones first).

        `must_limit`: hand out at most this many groups that must finish in this step (see
        must_finish); the others stay queued, and no fresh prompt is drawn once fresh groups
        must finish too (one version ahead under a lag bound of 1). A policy that over-provisions
        passes the batch slots left, so it never waits for more last-chance groups than the
        trainer takes next: a surplus one would lag past the bound and be restarted.

        Returns fewer than k when the partial queue runs dry and there is no source, when every
        row the source offers is out already (fewer rows than live groups), or at must_limit.
        """
        with self._lock:
            out = self._pop_fit(self._partial, k, must_limit)
            for g in out:
                self._hand_out(g)
            if must_limit is not None:
                must_limit -= sum(self._must_finish(g) for g in out)
            fresh_must = self._must_finish(None)
            while len(out) < k and self.source is not None:
                if fresh_must and must_limit is not None and must_limit <= 0:
                    break
                if fresh_must and must_limit is not None:
                    must_limit -= 1
                g = self._new_group()
                if g is None:
                    break
                self._hand_out(g)  # before the next draw, which must see this row as live
                out.append(g)
        return out

    def acquire_long(self, k: int) -> list[Group]:
        """Up to k groups from the long queue, oldest first (a long round)."""
        with self._lock:
            out = self._pop_fit(self._long, k)
            for g in out:
                self._hand_out(g)
        return out

    def restart(self, group: Group) -> int:
        """Forget an in-flight group's responses and generate them again from the prompt (at the
        buffer's version): a policy that must stay on-policy was handed tokens of an older
        version. Returns the tokens discarded."""
        with self._lock:
            if self._place.get(group.group_id) is not Place.IN_FLIGHT:
                raise BufferError(f"restart: group {group.group_id} is not in flight")
            tokens = group.tokens
            self._discard(group.samples)
            group.regenerate(self._version)
            self._counts["restarted"] += 1
            return tokens

    def extend(self, group: Group, k: int) -> list[Sample]:
        """Add k speculative samples to an in-flight group (it still keeps target_n: the first
        to finish, see Group.settle). They take the lowest slots the group does not hold, so a
        group extended again after a park reuses the slots its discarded extras had."""
        with self._lock:
            if self._place.get(group.group_id) is not Place.IN_FLIGHT:
                raise BufferError(f"extend: group {group.group_id} is not in flight")
            held = {s.slot for s in group.samples}
            slots = [i for i in range(len(held) + k) if i not in held][:k]
            new = [
                Sample(self._next_sample_index + i, group.group_id, group.prompt.ids, slot=slot)
                for i, slot in enumerate(slots)
            ]
            self._next_sample_index += k
            group.samples.extend(new)
            return new

    def complete(self, group: Group) -> Completion:
        """A complete, rewarded group: settle it to its first target_n finished samples and
        put it in the ready queue through the staleness rule (consumers are woken)."""
        if not group.is_complete:
            raise BufferError(f"group {group.group_id} is not complete")
        if not group.trainable:
            failed = [s for s in group.first_finished() if s.status is SampleStatus.FAILED]
            raise BufferError(
                f"group {group.group_id} has failed samples ({failed[0].error!r}); "
                "drop it with a reason instead"
            )
        with self._lock:
            self._leave_flight(group, "complete")
            surplus = group.settle()
            self._discard(surplus)
            self._counts["completed"] += 1
            queued = self._to_ready(group)
            if queued:
                self._wake_consumers()
        return Completion(surplus, queued)

    def requeue(self, group: Group) -> int:
        """An in-flight group stopped early (abort): keep its tokens, resume it first later.

        A group that happened to finish during the abort goes to the ready queue instead, so
        completed work is never thrown away. Speculative extras are trimmed (see Group.trim).
        Returns the tokens discarded (the trimmed extras').
        """
        if group.trainable:
            return sum(len(s.response_ids) for s in self.complete(group).surplus)
        group.interrupt()
        with self._lock:
            self._leave_flight(group, "requeue")
            tokens = self._discard(group.trim())
            self._to_partial(group)
            self._counts["requeued"] += 1
        return tokens

    def defer(self, group: Group, *, restart: bool = False) -> int:
        """Move an in-flight group to the long queue (tail batching, ranker), keeping its tokens
        to resume them, or (`restart`) forgetting them so its long round starts from the prompt
        on the policy of that round. Speculative extras are trimmed. Returns the tokens
        discarded. A deferred group that happened to finish meanwhile is completed instead."""
        if group.trainable:
            return sum(len(s.response_ids) for s in self.complete(group).surplus)
        group.interrupt()
        with self._lock:
            self._leave_flight(group, "defer")
            tokens = self._discard(group.trim())
            if restart:
                tokens += self._discard(group.samples)
                group.regenerate(self._version)
            group.lane = Lane.LONG
            group.deferrals += 1
            self._to_long(group)
            self._counts["deferred"] += 1
        return tokens

    def drop(self, group: Group, reason: str) -> None:
        """End a group's life without training on it; counted under `reason`."""
        if not reason:
            raise BufferError("a drop needs a reason")
        with self._lock:
            place = self._place.get(group.group_id)
            if place is None:
                raise BufferError(f"group {group.group_id} is not in the buffer")
            if place is Place.IN_FLIGHT:
                del self._in_flight[group.group_id]
            elif place is Place.PARTIAL:
                self._partial.remove(group)
            elif place is Place.LONG:
                self._long.remove(group)
            else:
                self._ready.remove(group)
            self._end(group, reason)

    # -- consumer side ------------------------------------------------------------------
    def take(self, n: int, timeout: float | None = None) -> list[Group]:
        """Block until n ready groups are available, then take them (they count as trained).

        Raises TimeoutError (taking nothing) after `timeout` seconds, BufferClosed on close().
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._ready_cond:
            while True:
                if len(self._ready) >= n:
                    return [self._hand_to_trainer(self._pop_ready()) for _ in range(n)]
                if self._closed:
                    raise BufferClosed("buffer closed while waiting in take()")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"take({n}): {len(self._ready)} ready after {timeout} s")
                self._ready_cond.wait(remaining)

    def take_nowait(self, n: int) -> list[Group]:
        """Up to n ready groups, without waiting."""
        with self._lock:
            k = min(n, len(self._ready))
            return [self._hand_to_trainer(self._pop_ready()) for _ in range(k)]

    def untake(self, groups: Sequence[Group]) -> None:
        """Groups handed out (take, stream) that no trainer trained, because the run stopped in
        the middle of a step, go back to the front of the ready queue in their order and no
        longer count as trained: a checkpoint written now keeps them."""
        with self._ready_cond:
            if len({g.group_id for g in groups}) != len(groups):
                raise BufferError("untake: a group is given back twice")
            for g in groups:
                if g.group_id in self._place:
                    raise BufferError(f"untake: group {g.group_id} is still in the buffer "
                                      f"({self._place[g.group_id].value})")
            for g in reversed(groups):
                self._move(g, Place.READY)
                self._ready.appendleft(g)
                self._counts["trained"] -= 1
            self._wake_consumers()

    async def stream(self, n: int) -> AsyncIterator[Group]:
        """Yield n groups, each as soon as it is ready. Several consumers may stream at once:
        each group goes to exactly one of them."""
        loop = asyncio.get_running_loop()
        for _ in range(n):
            while True:
                with self._lock:
                    if self._ready:
                        group = self._hand_to_trainer(self._pop_ready())
                        break
                    if self._closed:
                        raise BufferClosed("buffer closed while streaming")
                    waiter = loop.create_future()
                    self._async_waiters.append((loop, waiter))
                try:
                    await waiter
                finally:
                    with self._lock:
                        if (loop, waiter) in self._async_waiters:
                            self._async_waiters.remove((loop, waiter))
            yield group

    def close(self) -> None:
        """Wake every waiting consumer with BufferClosed (shutdown)."""
        with self._lock:
            self._closed = True
            self._wake_consumers()

    # -- accounting -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        with self._lock:
            c = self._counts
            out = {
                "version": self._version,
                "producer_version": self._producer_version,
                "created": c["created"],
                "in_flight": len(self._in_flight),
                "partial": len(self._partial),
                "long": len(self._long),
                "ready": len(self._ready),
                "trained": c["trained"],
                "dropped": sum(self._dropped.values()),
                "dropped_by_reason": dict(self._dropped),
                "completed": c["completed"],
                "requeued": c["requeued"],
                "deferred": c["deferred"],
                "restarted": c["restarted"],
                "held": len(self._held),
                "stale_regenerated": c["stale_regenerated"],
                "stale_corrected": c["stale_corrected"],
                "discarded_tokens": c["discarded_tokens"],
                "lag_restarts": c["lag_restarts"],
                "lag_restart_tokens": c["lag_restart_tokens"],
                "mismatch_restarts": c["mismatch_restarts"],
                "mismatch_restart_tokens": c["mismatch_restart_tokens"],
            }
        out["balanced"] = out["created"] == (
            out["in_flight"] + out["partial"] + out["long"] + out["ready"]
            + out["trained"] + out["dropped"]
        )
        return out

    def queued(self, place: Place) -> list[Group]:
        """A snapshot of one queue, in hand-out order (read-only use: metrics, rankers)."""
        with self._lock:
            return list(self._queue(place))

    def count(self, place: Place) -> int:
        """How many groups one queue holds (cheap: policies ask it every step)."""
        with self._lock:
            return len(self._queue(place))

    def unfinished_versions(self) -> Counter[int]:
        """Per policy version, the unfinished responses of the live groups (in flight, parked,
        deferred) that began under it (their first token's version): what LoRA's resume 'own'
        keeps an adapter loaded for."""
        with self._lock:
            groups = [*self._in_flight.values(), *self._partial, *self._long]
            return Counter(s.oldest_version() for g in groups for s in g.samples
                           if s.versions and not s.status.terminal)

    def place_of(self, group: Group) -> Place | None:
        """Where a group is (None once trained or dropped)."""
        return self._place.get(group.group_id)

    # -- persistence ----------------------------------------------------------------------
    def attach(self, name: str, obj: Any) -> None:
        """Save `obj.state_dict()` (plain data) with the buffer's state and restore it with
        `obj.load_state_dict` on load: scheduling state that must survive a restart with the
        queues it describes (a length ranker, recent lengths). Attached after the buffer was
        loaded (a restored buffer handed to a new manager), it gets its saved state now."""
        self._attached[name] = obj
        saved = self._unclaimed.pop(name, None)
        if saved is not None:
            self._load_attached(name, obj, saved)

    @staticmethod
    def _load_attached(name: str, obj: Any, saved: dict[str, Any]) -> None:
        if saved["type"] != type(obj).__name__:
            warnings.warn(f"buffer state: the saved {name} is a {saved['type']}, this run's "
                          f"a {type(obj).__name__}; it starts fresh", stacklevel=3)
            return
        try:
            obj.load_state_dict(saved["state"])
        except (KeyError, TypeError, ValueError) as e:
            raise BufferStateError(f"buffer state: the saved {name} is malformed: "
                                   f"{type(e).__name__}: {e}") from None

    def fingerprint(self) -> dict[str, Any]:
        return {
            "n_samples_per_prompt": self.n_samples_per_prompt,
            "source": self.source.fingerprint() if self.source is not None else None,
        }

    def state_dict(self) -> dict[str, Any]:
        """Every queue, the source position, the version and the counters.

        Groups in flight are saved as partial groups (with the tokens they have), so a run
        restored from a save taken mid-step loses nothing; complete ones without failures are
        saved as ready (the staleness rule applies to them on load).
        """
        with self._lock:
            flight = sorted(self._in_flight.values(), key=lambda g: g.group_id)
            flight_done = [g for g in flight if g.trainable]
            flight_parked = [g for g in flight if not g.trainable]
            return {
                "format": STATE_FORMAT,
                "format_version": STATE_VERSION,
                "fingerprint": self.fingerprint(),
                "version": self._version,
                "producer_version": self._producer_version,
                "next_group_id": self._next_group_id,
                "next_sample_index": self._next_sample_index,
                "partial": [g.to_state() for g in (*self._partial, *flight_parked)],
                "long": [g.to_state() for g in self._long],
                "held": [p.to_state() for p in self._held],
                "ready": [g.to_state() for g in (*self._ready, *flight_done)],
                "counts": dict(self._counts),
                "dropped": dict(self._dropped),
                "source": self.source.state_dict() if self.source is not None else None,
                "attached": {name: {"type": type(obj).__name__, "state": obj.state_dict()}
                             for name, obj in self._attached.items()},
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by `state_dict` (onto an empty buffer of the same set-up)."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise BufferStateError("not an rlkit buffer state")
        if state.get("format_version") != STATE_VERSION:
            raise BufferStateError(
                f"buffer state format version {state.get('format_version')!r}; "
                f"this rlkit reads version {STATE_VERSION}"
            )
        mine, theirs = self.fingerprint(), state.get("fingerprint")
        if mine != theirs:
            diffs = _diff(theirs, mine)
            raise BufferStateError(
                "buffer state is from a different set-up: " + "; ".join(diffs)
            )
        try:
            partial = [Group.from_state(g) for g in state["partial"]]
            long = [Group.from_state(g) for g in state["long"]]
            ready = [Group.from_state(g) for g in state["ready"]]
            held = [PromptRecord.from_state(p) for p in state.get("held", [])]
            for g in ready:
                g.settle()  # groups saved in flight may still carry speculative extras
            for g in (*partial, *long):
                g.trim()
            for g in (*partial, *long, *ready):
                if g.n != self.n_samples_per_prompt:
                    raise BufferStateError(
                        f"group {g.group_id} has {g.n} samples, expected {self.n_samples_per_prompt}"
                    )
            if self.source is not None:
                self.source.load_state_dict(state["source"])
            self._unclaimed = {}
            for name, saved in state.get("attached", {}).items():
                obj = self._attached.get(name)
                if obj is None:  # none yet (attached later), or none in this run (turned off)
                    self._unclaimed[name] = saved
                else:
                    self._load_attached(name, obj, saved)
        except BufferStateError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise BufferStateError(f"buffer state is malformed: {type(e).__name__}: {e}") from None
        with self._lock:
            if self._place or self._counts["created"]:
                raise BufferError("load_state_dict needs a fresh buffer")
            self._version = int(state["version"])
            self._producer_version = int(state.get("producer_version", self._version))
            self._producing_for = self._version
            self._next_group_id = int(state["next_group_id"])
            self._next_sample_index = int(state["next_sample_index"])
            self._counts = Counter(state["counts"])
            self._dropped = Counter(state["dropped"])
            for g in partial:
                self._to_partial(g)
            for g in long:
                self._to_long(g)
            for g in ready:
                self._to_ready(g)  # groups saved in flight never met the staleness rule
            self._held = deque(held)

    # -- internals (lock held) ----------------------------------------------------------
    def _queue(self, place: Place) -> Collection[Group]:
        if place is Place.PARTIAL:
            return self._partial
        if place is Place.LONG:
            return self._long
        if place is Place.READY:
            return self._ready
        return self._in_flight.values()

    def _new_group(self) -> Group | None:
        """A group for the next prompt: a held-back one whose row is free again, else the
        source's next, holding back draws whose row is live (the module docstring). None when
        every row of the data set is out: then no draw can be handed out (each epoch has a free
        row otherwise, so the loop ends)."""
        prompt = self._free_held()
        while prompt is None:
            if len(self._live_rows) >= len(self.source):  # type: ignore[arg-type]
                return None
            prompt = self.source.next_prompt()  # type: ignore[union-attr]
            if prompt.source_index in self._live_rows:
                self._held.append(prompt)
                prompt = None
        group = Group.new(
            self._next_group_id, prompt, self.n_samples_per_prompt,
            self._next_sample_index, self._version,
        )
        self._next_group_id += 1
        self._next_sample_index += self.n_samples_per_prompt
        self._counts["created"] += 1
        return group

    def _free_held(self) -> PromptRecord | None:
        for i, prompt in enumerate(self._held):
            if prompt.source_index not in self._live_rows:
                del self._held[i]
                return prompt
        return None

    def _move(self, group: Group, place: Place | None) -> None:
        """The one place where a group's place changes (None: trained or dropped), keeping the
        count of live rows (in flight, partial or long) that fresh draws are checked against."""
        gid, row = group.group_id, group.prompt.source_index
        old = self._place.pop(gid, None) if place is None else self._place.get(gid)
        if place is not None:
            self._place[gid] = place
        was, now = old in _LIVE, place in _LIVE
        if now and not was:
            self._live_rows[row] += 1
        elif was and not now:
            self._live_rows[row] -= 1
            if not self._live_rows[row]:
                del self._live_rows[row]

    def _hand_out(self, group: Group) -> None:
        group.attempts += 1
        self._in_flight[group.group_id] = group
        self._move(group, Place.IN_FLIGHT)

    def _leave_flight(self, group: Group, what: str) -> None:
        if self._in_flight.pop(group.group_id, None) is None:
            place = self._place.get(group.group_id)
            where = place.value if place else "not in the buffer (trained or dropped)"
            raise BufferError(f"{what}: group {group.group_id} is not in flight: {where}")

    def _end(self, group: Group, reason: str) -> None:
        """Drop the group under `reason`; its tokens count as discarded."""
        self._move(group, None)
        self._dropped[reason] += 1
        self._counts["discarded_tokens"] += group.tokens

    def _pop_ready(self) -> Group:
        """The next ready group for the trainer: the first completed; under max_token_lag the
        one with the oldest token (the first completed among equals), so a group that cannot
        wait another version is trained before one that can."""
        if self.max_token_lag is None or len(self._ready) < 2:
            return self._ready.popleft()
        first = min(range(len(self._ready)), key=lambda i: (_oldest(self._ready[i]), i))
        group = self._ready[first]
        del self._ready[first]
        return group

    def _hand_to_trainer(self, group: Group) -> Group:
        self._move(group, None)
        self._counts["trained"] += 1
        return group

    def _enforce_staleness(self, group: Group, consumer: int | None = None) -> str:
        """The staleness rule, for a group about to be handed out or queued as ready, against
        the consumer version it will be trained at (by default the consumer's own).

        Returns 'fit' (within the bound), 'corrected' (kept, flagged for off-policy
        correction), 'regenerated' (responses discarded; generate again) or 'dropped'.
        """
        consumer = self._version if consumer is None else consumer
        if staleness(group.oldest_version(), consumer) <= self.max_staleness:
            return "fit"
        policy = self.staleness_policy
        if policy is StalenessPolicy.CORRECT:
            if not group.stale_corrected:
                group.stale_corrected = True
                self._counts["stale_corrected"] += 1
            return "corrected"
        if policy is StalenessPolicy.REGENERATE:
            self._discard(group.samples)
            group.regenerate(self._version)
            self._counts["stale_regenerated"] += 1
            return "regenerated"
        self._end(group, "stale")
        return "dropped"

    def must_finish(self, group: Group) -> bool:
        """Under max_token_lag: whether `group`, handed out now for the running production,
        must complete in this step, since resumed in the next one (one version later) some of its
        tokens would lag past the bound and be restarted. Its oldest token decides; a group
        without tokens is judged by the version its tokens get now (the engines')."""
        with self._lock:
            return self._must_finish(group)

    def _must_finish(self, group: Group | None) -> bool:
        """must_finish with the lock held; None stands for a fresh group (no tokens yet)."""
        if self.max_token_lag is None:
            return False
        oldest = None if group is None else group.oldest_version()
        if oldest is None:
            oldest = self._producer_version
        return self._producing_for + 1 - oldest > self.max_token_lag

    def _restart_lagging(self, group: Group, consumer: int) -> int:
        """The token-lag bound (max_token_lag) for a group about to be resumed or queued as
        ready, against the consumer version it will be trained at: each sample whose oldest
        token would lag more than the bound forgets its response (generated again from the
        prompt; a failed sample is left for its group's drop). Returns the samples restarted."""
        bound = self.max_token_lag
        if bound is None:
            return 0
        restarted = 0
        for s in group.samples:
            oldest = s.oldest_version()
            if oldest is None or consumer - oldest <= bound or s.status is SampleStatus.FAILED:
                continue
            self._restart(s, "lag")
            restarted += 1
        return restarted

    def restart_sample(self, sample: Sample) -> int:
        """A sample of a group in flight forgets its response, to be generated again from its
        prompt (rollout.max_resume_log_ratio: its parked tokens were re-scored past the bound).
        Its tokens are discarded and counted (`mismatch_restarts`, `mismatch_restart_tokens`).
        Returns the tokens discarded."""
        with self._lock:
            return self._restart(sample, "mismatch")

    def _restart(self, sample: Sample, why: str) -> int:
        """Forget `sample`'s response, its tokens discarded and counted as `why`_restarts and
        `why`_restart_tokens (lock held). Returns the tokens discarded."""
        tokens = self._discard([sample])
        sample.reset()
        self._counts[f"{why}_restarts"] += 1
        self._counts[f"{why}_restart_tokens"] += tokens
        return tokens

    def _pop_fit(self, queue: _OldestFirst, k: int, must_limit: int | None = None) -> list[Group]:
        """Up to k groups from a queue, oldest first, each through the staleness rule and the
        token-lag bound; past `must_limit` groups that must finish, those stay queued."""
        out: list[Group] = []
        kept: list[Group] = []
        while len(out) < k:
            group = queue.pop()
            if group is None:
                break
            if self._enforce_staleness(group, self._producing_for) == "dropped":
                continue
            self._restart_lagging(group, self._producing_for)
            if must_limit is not None and self._must_finish(group):
                if must_limit <= 0:
                    kept.append(group)
                    continue
                must_limit -= 1
            out.append(group)
        for group in kept:  # still in this queue's place: only the heap entry was popped
            queue.push(group)
        return out

    def _discard(self, samples: list[Sample]) -> int:
        tokens = sum(len(s.response_ids) for s in samples)
        self._counts["discarded_tokens"] += tokens
        return tokens

    def _to_partial(self, group: Group) -> None:
        self._partial.push(group)
        self._move(group, Place.PARTIAL)

    def _to_long(self, group: Group) -> None:
        self._long.push(group)
        self._move(group, Place.LONG)

    def _to_ready(self, group: Group) -> bool:
        """Queue a complete group as ready, through the staleness rule (a stale one goes back
        to partial or is dropped instead) and the token-lag bound (a group with samples past
        it goes back to partial, those samples restarted), both against the version the next
        take trains at: the running production's (async mode: one ahead of the consumer's), so
        a group the step counted as complete is still ready when the weights move mid-step.
        True if it was queued as ready."""
        consumer = self._producing_for
        verdict = self._enforce_staleness(group, consumer)
        if verdict != "dropped" and self._restart_lagging(group, consumer):
            verdict = "regenerated"
        if verdict == "regenerated":
            self._to_partial(group)
        elif verdict != "dropped":
            self._ready.append(group)
            self._move(group, Place.READY)
            return True
        return False

    def _sweep_ready(self) -> None:
        """After a version bump (the consumer's, or a production's for a later version): the
        staleness rule and the token-lag bound for every ready group."""
        waiting, self._ready = self._ready, deque()
        for group in waiting:
            self._to_ready(group)

    def _wake_consumers(self) -> None:
        self._ready_cond.notify_all()
        waiters, self._async_waiters = self._async_waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_resolve, fut)


def _oldest(group: Group) -> int:
    oldest = group.oldest_version()
    return -1 if oldest is None else oldest


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _diff(saved: Any, current: Any, path: str = "") -> list[str]:
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current)):
            out += _diff(saved.get(key), current.get(key), f"{path}{key}.")
        return out
    if saved != current:
        return [f"{path.rstrip('.')}: saved {saved!r}, now {current!r}"]
    return []
