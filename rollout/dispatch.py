"""Skewness-aware dispatch (StreamRL Algorithm 2) and longest-first admission (LPT).

Given a step's groups with predicted lengths (a ranker's, on `Group.predicted_length`):

- `Dispatcher.plan` sorts them longest first, marks the top `alpha` share long-tail, and picks
  how many engines serve the long tail alone (small batches, fast per token) and how many the
  rest, by one of two cost models:
  - `streamrl` (Algorithm 2 as published): per engine Eq. 2, PTL(BS) x L x ceil(M / BS), with
    M its requests, BS the batch it can run (slots, KV capacity), L the P90 of recent response
    lengths for the long tail and the P50 for the rest; the two classes' latencies combined by
    `max` (they run in parallel) or `sum` (as the pseudocode writes it); always a split.
  - `fluid` (rlkit's): each engine's makespan under continuous batching, from the predicted
    length of every request placed on it (its batch shrinks as requests finish, each decode
    step costing PTL(batch, KV)); the slowest engine is the cost, and "no split" (every
    engine serves every class, longest first, evenly) is a candidate. P50 understates the
    regular class's own tail, so on a trace whose short responses finish early, the published
    model gives the long tail too many engines, concentrating it in bigger, slower batches.
    It splits only while the ranker's recent recall of the long tail is at least
    `min_recall`: a split on wrong predictions sends the wrong groups to the long engines.
    Its makespan is the time until every request finishes, which is a sync step; a partial
    step ends at its target and parks the rest, so under partial it only places
    (`split=False`): no split, and no LPT order either, which would put the resumed groups,
    closest to done, last (APRIL resumes them first): in the simulator that cost partial up to
    5% and grew the version spread of what it trained (measured, docs/policies.md).
  Lengths are the predicted remaining ones (a resumed partial has generated some already).
- `Dispatcher.place` puts every request of a group on an engine of its class, each on the
  one with the fewest requests in flight (counts the manager keeps, not a load query per
  launch): a group's responses spread over its pool, as the router spreads them. Placement
  is complete: no request is left to the router, which could send it to a long-tail engine.
- `AdmissionGate` (one per engine) lets at most `slots` requests run and, as slots free,
  admits the highest `Dispatcher.priority` first: the longest predicted remaining work in a
  step that waits for all its groups (Graham's LPT, within 4/3 of optimal), arrival order
  under partial.

Pure Python: the same code runs on real and simulated engines.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Sequence

from rlkit.buffers.group import Group
from rlkit.rollout.rankers import mean_length

Objective = Literal["max", "sum"]
CostModel = Literal["fluid", "streamrl"]


@dataclass(frozen=True)
class EngineModel:
    """What the cost model knows of one engine. `ptl(batch, kv_tokens)`: seconds per decode
    step; None: 1.0 whatever the batch (the split then balances predicted work only)."""

    slots: int
    kv_tokens: int | None = None
    ptl: Callable[[int, int], float] | None = None

    def batch(self, context: float) -> int:
        """The batch it runs at a mean context of `context` tokens (slots, then KV capacity)."""
        if self.kv_tokens is None:
            return self.slots
        return max(1, min(self.slots, int(self.kv_tokens // max(1.0, context))))

    def saturation_batch(self, context: float, utilization: float) -> int:
        """The smallest batch at which one engine decodes at `utilization` of its peak
        throughput (at a mean context of `context` tokens); every slot without a PTL model."""
        limit = self.batch(context)
        if self.ptl is None:
            return limit
        rates = [b / self.ptl(b, int(b * context)) for b in range(1, limit + 1)]
        peak = max(rates)
        return next(b for b, r in enumerate(rates, 1) if r >= utilization * peak)

    def makespan(self, lengths: Sequence[float]) -> float:
        """Seconds until one engine finishes requests of these lengths, all admitted at once
        (the batch shrinks as they finish); past its batch limit, the rest is throughput."""
        if not lengths:
            return 0.0
        ordered = sorted(lengths)
        m, done, t, prev = len(ordered), 0, 0.0, 0.0
        cap = self.batch(ordered[-1] / 2)
        if m > cap:  # waves: the longest cap requests set the tail, the rest adds work
            tail = self.makespan(ordered[-cap:])
            step = self.ptl(cap, int(cap * ordered[m // 2] / 2)) if self.ptl else 1.0
            return max(tail, sum(ordered) / cap * step)
        for length in ordered:
            running = m - done
            if length > prev:
                kv = int(running * (prev + length) / 2)
                t += (length - prev) * (self.ptl(running, kv) if self.ptl else 1.0)
                prev = length
            done += 1
        return t

    def latency(self, requests: int, length: float) -> float:
        """Eq. 2: one engine decoding `requests` responses of `length` tokens."""
        if requests <= 0:
            return 0.0
        context = length / 2  # the mean KV a response holds over its decode
        bs = min(requests, self.batch(context))
        step = self.ptl(bs, int(bs * context)) if self.ptl is not None else 1.0
        return step * length * math.ceil(requests / bs)


class LengthWindow:
    """Recent response lengths, for the cost model's P50 / P90 (and other quantiles)."""

    def __init__(self, size: int) -> None:
        self._recent: deque[float] = deque(maxlen=size)

    def add(self, lengths: Sequence[float]) -> None:
        self._recent.extend(lengths)

    def __len__(self) -> int:
        return len(self._recent)

    def quantile(self, q: float) -> float | None:
        if not self._recent:
            return None
        ordered = sorted(self._recent)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def count_at_least(self, bar: float) -> int:
        return sum(1 for x in self._recent if x >= bar)

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self._recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._recent.clear()
        self._recent.extend(float(x) for x in state["recent"])  # the newest kept if it shrank


@dataclass(frozen=True)
class Plan:
    long_workers: tuple[str, ...]  # empty: no split (every engine serves every group)
    regular_workers: tuple[str, ...]
    threshold: float  # a group predicted at least this long is long-tail
    cost: float = 0.0

    def pool(self, group: Group) -> tuple[str, ...]:
        if self.long_workers and remaining(group) >= self.threshold:
            return self.long_workers
        return self.regular_workers


class Dispatcher:
    def __init__(self, engine: EngineModel, *, alpha: float = 0.2,
                 objective: Objective = "max", cost_model: CostModel = "fluid",
                 min_recall: float = 0.5, split: bool = True) -> None:
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"dispatch alpha must be in (0, 1), got {alpha}")
        if objective not in ("max", "sum"):
            raise ValueError(f"dispatch objective must be 'max' or 'sum', got {objective!r}")
        if cost_model not in ("fluid", "streamrl"):
            raise ValueError(f"dispatch cost_model must be 'fluid' or 'streamrl', got {cost_model!r}")
        self.engine, self.alpha, self.objective = engine, alpha, objective
        self.cost_model = cost_model
        self.min_recall = min_recall
        # False (a partial step): no LPT order, and the fluid model keeps no split; the
        # published model splits as published, by the user's explicit choice.
        self.split = split
        self._seen: deque[tuple[float, float]] = deque(maxlen=512)  # (predicted, actual)
        self.plan_: Plan | None = None

    def observe(self, group: Group) -> None:
        """A finished group: how long it was against its prediction (the ranker's recall)."""
        if group.predicted_length is not None and group.samples:
            actual = mean_length(group)
            self._seen.append((group.predicted_length, actual))

    def recall(self) -> float | None:
        """Recall of the truly longest `alpha` share of recent groups among those predicted
        longest; None until a few groups are seen."""
        if len(self._seen) < 20:
            return None
        from rlkit.rollout.rankers.recall import recall_at

        return recall_at([a for _, a in self._seen], [p for p, _ in self._seen], self.alpha)

    def plan(self, workers: Sequence[str], groups: Sequence[Group], n: int,
             lengths: LengthWindow) -> Plan:
        """Algorithm 2 over this step's groups, with `lengths` the recent response lengths (D);
        later groups of the step are classed by the same threshold. No split before any
        length is known, or with one engine."""
        workers = list(workers)
        ranked = sorted((remaining(g) for g in groups), reverse=True)
        k_long = math.floor(self.alpha * len(ranked))
        l_long, l_reg = lengths.quantile(0.9), lengths.quantile(0.5)
        no_split = Plan((), tuple(workers), math.inf)
        if len(workers) < 2 or k_long == 0 or l_long is None or l_reg is None:
            self.plan_ = no_split
            return self.plan_
        if self.cost_model == "fluid":
            recall = self.recall()
            if not self.split or recall is None or recall < self.min_recall:
                # A ranker that misses the long tail would send the wrong groups to the
                # long-tail engines: spread everything, longest predicted first (harmless).
                self.plan_ = no_split
                return self.plan_
            self.plan_ = self._fluid_plan(workers, ranked, k_long, n, no_split)
            return self.plan_
        long_requests, reg_requests = k_long * n, (len(ranked) - k_long) * n
        best: tuple[float, int] | None = None
        for n_long in range(1, len(workers)):
            a = self.engine.latency(math.ceil(long_requests / n_long), l_long)
            b = self.engine.latency(math.ceil(reg_requests / (len(workers) - n_long)), l_reg)
            cost = max(a, b) if self.objective == "max" else a + b
            if best is None or cost < best[0]:
                best = (cost, n_long)
        assert best is not None
        cost, n_long = best
        self.plan_ = Plan(tuple(workers[:n_long]), tuple(workers[n_long:]),
                          ranked[k_long - 1], cost)
        return self.plan_

    def _fluid_plan(self, workers: list[str], ranked: list[float], k_long: int, n: int,
                    no_split: Plan) -> Plan:
        """The split (or none) whose slowest engine finishes first, by `EngineModel.makespan`
        over the predicted lengths, each class spread longest first over its engines."""
        def slowest(lengths: list[float], engines: int) -> float:
            per: list[list[float]] = [[] for _ in range(engines)]
            for i, length in enumerate(lengths):  # sorted longest first: even, LPT-like
                per[i % engines].append(length)
            return max(self.engine.makespan(p) for p in per)

        requests = [length for length in ranked for _ in range(n)]
        best = (slowest(requests, len(workers)), 0)
        long, regular = requests[:k_long * n], requests[k_long * n:]
        for n_long in range(1, len(workers)):
            cost = max(slowest(long, n_long), slowest(regular, len(workers) - n_long))
            if cost < best[0]:
                best = (cost, n_long)
        cost, n_long = best
        if n_long == 0:
            return Plan((), tuple(workers), math.inf, cost)
        return Plan(tuple(workers[:n_long]), tuple(workers[n_long:]), ranked[k_long - 1], cost)

    def order(self, groups: Sequence[Group]) -> list[Group]:
        """Launch order: longest predicted remaining first (LPT) for a step that waits for
        all its groups; the policy's own order (resumed partials first) otherwise."""
        return longest_first(groups) if self.split else list(groups)

    def priority(self, group: Group) -> float:
        """Admission priority at an engine's gate (higher enters first): the predicted
        remaining work under LPT; first come, first served otherwise."""
        return remaining(group) if self.split else 0.0

    def place(self, group: Group, requests: int, in_flight: Mapping[str, int]) -> list[str]:
        """An engine for each of the group's `requests`: in its class's pool, each to the
        engine with the fewest requests in flight (counting the ones placed before it), so a
        group's responses spread over its pool as a router would spread them."""
        if self.plan_ is None:
            raise RuntimeError("Dispatcher.place before plan")
        pool = self.plan_.pool(group)
        counts = {w: in_flight.get(w, 0) for w in pool}
        out = []
        for _ in range(requests):
            w = min(pool, key=lambda w: (counts[w], pool.index(w)))
            counts[w] += 1
            out.append(w)
        return out


def longest_first(groups: Sequence[Group]) -> list[Group]:
    """LPT launch order: the longest predicted remaining work first (ties: oldest first)."""
    return sorted(groups, key=lambda g: (-remaining(g), g.group_id))


def remaining(group: Group) -> float:
    """Predicted tokens still to generate per response (a resumed group has some already)."""
    done = group.tokens / max(1, len(group.samples))
    return max(1.0, (group.predicted_length or 0.0) - done)


class GateClosed(Exception):
    """The step stopped while the request waited for a slot: it was never sent."""


class AdmissionGate:
    """At most `slots` requests at once on one engine; waiting ones enter longest-first."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError("an admission gate needs at least one slot")
        self.slots = slots
        self.running = 0
        self._waiting: list[tuple[float, int, asyncio.Future]] = []
        self._order = itertools.count()
        self._closed = False
        self.admitted: list[float] = []  # priorities in admission order (tests, diagnostics)

    async def acquire(self, work: float) -> None:
        """Wait for a slot; `work` (predicted remaining tokens) orders the waiters."""
        if self._closed:
            raise GateClosed()
        if self.running < self.slots and not self._waiting:
            self._admit(work)
            return
        fut = asyncio.get_running_loop().create_future()
        entry = (-work, next(self._order), fut)
        heapq.heappush(self._waiting, entry)
        self._wake()  # a free slot behind waiters that were cancelled meanwhile
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release()  # admitted just as it was cancelled: pass the slot on
            elif entry in self._waiting:
                self._waiting.remove(entry)
                heapq.heapify(self._waiting)
            raise

    def release(self) -> None:
        self.running -= 1
        self._wake()

    def close(self) -> None:
        """Refuse new requests and send every waiter away (the step is stopping)."""
        self._closed = True
        waiting, self._waiting = self._waiting, []
        for _, _, fut in waiting:
            if not fut.done():
                fut.set_exception(GateClosed())

    def _admit(self, work: float) -> None:
        self.running += 1
        self.admitted.append(work)

    def _wake(self) -> None:
        while self._waiting and self.running < self.slots:
            neg, _, fut = heapq.heappop(self._waiting)
            if not fut.done():
                self._admit(-neg)
                fut.set_result(None)


@dataclass(frozen=True)
class InFlightSizer:
    """Adaptive over-provisioning for partial rollouts: is the work in flight enough to keep
    every engine at `utilization` of its peak throughput until the step's last needed group
    completes? With `need` more completions wanted, that moment is (by prediction) when the
    need-th shortest remaining group finishes, T tokens from now; the engines decode at least
    at that share of peak while their batch is at least `saturation_batch`, so the work until
    then, n x sum(min(remaining, T)), must cover engines x saturation_batch x T."""

    engine: EngineModel
    utilization: float = 0.9

    def busy_requests(self, engines: int, context: float) -> int:
        """Requests that keep `engines` at `utilization` of peak at a mean context of
        `context` tokens (one PTL scan of the batch sizes: compute it once per fill)."""
        return engines * self.engine.saturation_batch(context, self.utilization)

    def enough(self, running: Sequence[Group], need: int, n: int, busy: int) -> bool:
        """Is the predicted work of `running` (n requests each) at least `busy` requests
        decoding until the need-th shortest finishes?"""
        if need <= 0:
            return True
        rems = sorted(remaining(g) for g in running)
        if len(rems) < need:
            return False
        horizon = rems[need - 1]
        work = n * sum(min(r, horizon) for r in rems)
        return work >= busy * horizon
