"""Tail batching (the seed paper's Flexes, published as RollPacker, arXiv 2509.21009).

Every step is a short round or a long round, and each trains batch_size (P) prompts:

- **short round**: launch ceil(eta_prompts x P) prompts with ceil(eta_responses x n) responses
  each, every response its own request. A prompt is done at its first n finished responses
  (the buffer keeps those; the step cancels the rest and counts them as speculative waste).
  Once P prompts are done the round ends and every prompt still running is deferred to the
  buffer's long queue: restarted from the prompt (`deferred: restart`, on-policy, as the
  paper) or keeping its tokens (`resume`, off-policy, as APRIL).
- **long round**: once the long queue holds long_round_size prompts (default P), or on the
  run's final step if it holds any: the P oldest deferred prompts (topped up with fresh ones if
  fewer are queued), n responses each, no speculation, every response to its natural end or
  the cap. The long tail runs together instead of holding every short round.

What the public code gets wrong and this gets right: the long queue is in the buffer's
checkpoint; a row still queued when the data wraps to the next epoch is not handed out twice
(the buffer holds the new copy back); a filtered prompt is dropped, never queued; the final
step drains the queue; and a prompt parked in the long queue `max_deferrals` times (an
interrupted long round, a ranker that deferred it up front) is waited for by the next round
that runs it instead of being deferred again.

Adaptive over-launch (`adaptive`, default): a fixed eta_prompts covers a long share of at most
1 - 1/eta_prompts (20% at 1.25). On a bimodal workload with more long prompts than that, every
short round still waits for long ones, so it costs a sync step, and the prompts it defers come
back as long rounds on top (measured 0.86x sync's speed). So the short round is sized from the
estimated long share q (`LongShare`): the fewest prompts L whose expected short ones cover the
batch with a margin (`cover_launch`), at most max_eta_prompts x P. The rule for when deferral
cannot pay: a short round pays only if it can end without a long prompt; one that must wait for
a long prompt lasts as long as a sync step whatever it launches, and each prompt it defers adds
long-round work on top. So when even max_eta_prompts x P prompts hold fewer than P short ones
on average (a long share above 1 - 1/max_eta_prompts, 2/3 at 3.0), the step runs as a sync
step instead: P prompts, the long queue's first (they are waited for anyway), no speculation.

Cost: a short round keeps about eta_prompts x eta_responses (1.56x at 1.25) more requests in
flight, and under `restart` the short-round tokens of deferred prompts are thrown away
(`rollout/deferred_tokens_discarded`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from rlkit.buffers.buffer import Place

if TYPE_CHECKING:
    from rlkit.buffers.group import Group
    from rlkit.rollout.config import RolloutConfig
    from rlkit.rollout.manager import Step


def cover_launch(target: int, share: float, *, eta_min: float = 1.0, eta_max: float = 3.0,
                 sigmas: float = 1.0) -> int | None:
    """Prompts a short round launches when each is long with probability `share` (q): the
    least L whose short ones cover `target` with a margin, L(1-q) - sigmas x sqrt(L q (1-q))
    >= target (a binomial's mean less `sigmas` standard deviations), within [eta_min, eta_max]
    x target. None when even eta_max x target prompts hold fewer than `target` short ones on
    average, q > 1 - 1/eta_max: the typical round could not end without waiting for a long
    prompt, so deferring cannot pay."""
    q = min(max(share, 0.0), 1.0)
    least = math.ceil(eta_min * target - 1e-9)
    # the bound never falls below the floor (eta_min = eta_max with a fractional product
    # would otherwise launch ceil(eta x target) yet judge coverage on floor(eta x target))
    most = max(math.floor(eta_max * target + 1e-9), least)
    if most * (1.0 - q) < target:
        return None
    # sqrt(L) is the positive root of (1-q) x^2 - sigmas sqrt(q(1-q)) x - target = 0
    b = sigmas * math.sqrt(q * (1.0 - q))
    root = (b + math.sqrt(b * b + 4.0 * (1.0 - q) * target)) / (2.0 * (1.0 - q))
    return max(min(math.ceil(root * root - 1e-9), most), least)


@dataclass
class LongShare:
    """The estimated share of long prompts: recent finished groups whose mean length is at
    least `fraction` x the longest recent response, counting the prompts waiting in the long
    queue as long (they finish later: without them the share right after a short round would
    miss exactly the long ones); with a ranker, at least the share of fresh prompts it
    predicts that long (a moving average over draws, `predicted`)."""

    fraction: float = 0.5
    smoothing: float = 0.3  # weight of the newest draw in `predicted`
    predicted: float | None = None

    def bar(self, step: "Step") -> float | None:
        longest = step.response_lengths.quantile(1.0)
        return None if longest is None else self.fraction * longest

    def observe_predictions(self, step: "Step", groups: list["Group"]) -> None:
        bar = self.bar(step)
        lengths = [g.predicted_length for g in groups
                   if g.predicted_length is not None and g.deferrals == 0 and not g.has_tokens]
        if bar is None or not lengths:
            return
        share = sum(x >= bar for x in lengths) / len(lengths)
        a = self.smoothing
        self.predicted = share if self.predicted is None else (1 - a) * self.predicted + a * share

    def state_dict(self) -> dict[str, Any]:
        return {"predicted": self.predicted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.predicted = None if state["predicted"] is None else float(state["predicted"])

    def estimate(self, step: "Step") -> float | None:
        """None until a batch's worth of groups has finished."""
        window, bar = step.group_lengths, self.bar(step)
        if bar is None or len(window) < step.target:
            return None
        queued = step.buffer.count(Place.LONG)
        observed = (window.count_at_least(bar) + queued) / (len(window) + queued)
        return observed if self.predicted is None else max(observed, self.predicted)


@dataclass
class TailBatchingPolicy:
    eta_prompts: float = 1.25
    eta_responses: float = 1.25
    long_round_size: int = 0  # 0: the step's target (batch_size)
    deferred: Literal["restart", "resume"] = "restart"
    max_deferrals: int = 2
    proactive: bool = False  # prompts the ranker predicts long skip the short round
    adaptive: bool = True  # short rounds sized from the long share; sync rounds past the max
    max_eta_prompts: float = 3.0
    long_fraction: float = 0.5
    cover_sigmas: float = 1.0
    name: str = "tail_batching"

    @classmethod
    def from_config(cls, cfg: "RolloutConfig") -> "TailBatchingPolicy":
        tb = cfg.tail_batching
        return cls(tb.eta_prompts, tb.eta_responses, tb.long_round_size, tb.deferred,
                   tb.max_deferrals, tb.proactive, adaptive=tb.adaptive,
                   max_eta_prompts=tb.max_eta_prompts, long_fraction=tb.long_fraction,
                   cover_sigmas=tb.cover_sigmas)

    def __post_init__(self) -> None:
        if self.eta_prompts < 1.0 or self.eta_responses < 1.0:
            raise ValueError("eta_prompts and eta_responses must be >= 1")
        if self.long_round_size < 0 or self.max_deferrals < 1:
            raise ValueError("long_round_size must be >= 0 and max_deferrals >= 1")
        if self.deferred not in ("restart", "resume"):
            raise ValueError(f"deferred must be 'restart' or 'resume', got {self.deferred!r}")
        if self.max_eta_prompts < 1.0 or not 0.0 < self.long_fraction <= 1.0:
            raise ValueError("max_eta_prompts must be >= 1 and long_fraction in (0, 1]")
        self.estimator = LongShare(self.long_fraction)

    @property
    def saved_with_buffer(self) -> dict[str, Any]:
        """Scheduling state a checkpoint keeps (RolloutPolicy): the ranker-fed long share."""
        return {"long_share": self.estimator}

    async def run(self, step: "Step") -> None:
        step.park_to = "long"  # also where an interrupted round's groups go, with their tokens
        step.exact_target = self.deferred == "restart"  # on-policy: no group left over
        queued = step.buffer.count(Place.LONG)
        if queued >= (self.long_round_size or step.target) or (step.final and queued):
            await self._full_round(step, "long")
            return
        prompts = self.short_launch(step)
        if prompts is None:  # deferring cannot pay (module docstring): a sync step
            await self._full_round(step, "sync")
        else:
            await self._short_round(step, prompts)

    def short_launch(self, step: "Step") -> int | None:
        """Prompts the next short round launches; None: run a sync round instead."""
        fixed = math.ceil(self.eta_prompts * step.target)
        share = self.estimator.estimate(step) if self.adaptive else None
        if share is None:
            return fixed
        return cover_launch(step.target, share, eta_min=self.eta_prompts,
                            eta_max=max(self.eta_prompts, self.max_eta_prompts),
                            sigmas=self.cover_sigmas)

    async def _short_round(self, step: "Step", prompts: int) -> None:
        step.round = "short"
        responses = math.ceil(self.eta_responses * step.buffer.n_samples_per_prompt)
        must_finish: list[Group] = []  # deferred often enough: this round waits for them
        # Proactive deferrals one round may make; past them it runs what it draws (a ranker that
        # thinks everything long must neither drain the data into the long queue nor stall).
        max_deferred, deferred = 4 * prompts, 0
        extra = prompts - step.target  # the speculative over-launch

        def wanted() -> int:
            # A filtered or dropped prompt frees its place for a fresh one; a prompt deferred
            # up front takes one of the over-launch's places (they are there for the long tail).
            if step.completed >= step.target:
                return 0
            launch = prompts - min(extra, deferred)
            return launch - step.completed - step.running

        while step.completed < step.target or any(map(step.is_running, must_finish)):
            while (want := wanted()) > 0:
                groups = step.buffer.acquire(want)
                if len(groups) < want:  # the data ran dry: train what the long queue holds
                    groups += step.buffer.acquire_long(want - len(groups))
                if not groups:
                    break
                step.predict(groups)  # the proactive bar and the recall metric read them
                if self.adaptive:
                    self.estimator.observe_predictions(step, groups)
                if self.proactive and deferred < max_deferred:
                    groups, skipped = self._skip_predicted_long(step, groups)
                    deferred += skipped
                for g in groups:
                    wait = g.deferrals >= self.max_deferrals
                    self._launch(step, g, responses, reserve=wait)
                    if wait:
                        must_finish.append(g)
            await step.next_event()
        await step.stop(park="long", restart_deferred=self.deferred == "restart")

    def long_threshold(self, step: "Step") -> float | None:
        """Proactive tail batching's bar: the 1/eta_prompts quantile of recent groups' mean
        lengths (a short round defers the longest 1 - 1/eta_prompts share anyway); None until
        a batch's worth of groups has finished."""
        if len(step.group_lengths) < step.target:
            return None
        return step.group_lengths.quantile(1.0 / self.eta_prompts)

    def _skip_predicted_long(self, step: "Step", groups: list["Group"]
                             ) -> tuple[list["Group"], int]:
        """Proactive tail batching: a fresh prompt the ranker predicts long (its
        predicted_length, set by the caller) goes straight to the long queue. Returns the
        groups to run and how many were deferred."""
        threshold = self.long_threshold(step)
        if threshold is None:
            return groups, 0
        keep, deferred = [], 0
        for g in groups:
            fresh = g.deferrals == 0 and not g.has_tokens  # the long queue's own stay put
            if fresh and (g.predicted_length or 0.0) >= threshold:
                step.defer(g)
                deferred += 1
            else:
                keep.append(g)
        return keep, deferred

    async def _full_round(self, step: "Step", kind: str) -> None:
        """A long round, or a sync round (adaptive fallback): the long queue's oldest first,
        topped up with fresh prompts, n responses each, every one to its end."""
        step.round = kind
        n = step.buffer.n_samples_per_prompt
        # One launch per open place: completed + running never exceeds the target, so when
        # the target is met nothing is left running and nothing is deferred again.
        while step.completed < step.target:
            want = step.target - step.completed - step.running
            if want > 0:
                groups = step.buffer.acquire_long(want)
                if len(groups) < want:
                    groups += step.buffer.acquire(want - len(groups))
                step.predict(groups)
                for g in groups:
                    self._launch(step, g, n)
            await step.next_event()

    def _launch(self, step: "Step", group: "Group", responses: int, reserve: bool = False) -> None:
        oldest = group.oldest_version()
        if self.deferred == "restart" and oldest is not None and oldest < step.version:
            # On-policy: tokens from older weights (an interrupted step's, resumed later) are
            # generated again rather than trained on.
            step.buffer.restart(group)
        step.launch(group, responses=responses, reserve=reserve)
