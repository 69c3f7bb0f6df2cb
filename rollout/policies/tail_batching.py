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

Cost: a short round keeps about eta_prompts x eta_responses (1.56x at 1.25) more requests in
flight, and under `restart` the short-round tokens of deferred prompts are thrown away
(`rollout/deferred_tokens_discarded`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rlkit.buffers.buffer import Place

if TYPE_CHECKING:
    from rlkit.buffers.group import Group
    from rlkit.rollout.config import RolloutConfig
    from rlkit.rollout.manager import Step


@dataclass
class TailBatchingPolicy:
    eta_prompts: float = 1.25
    eta_responses: float = 1.25
    long_round_size: int = 0  # 0: the step's target (batch_size)
    deferred: Literal["restart", "resume"] = "restart"
    max_deferrals: int = 2
    proactive: bool = False  # prompts the ranker predicts long skip the short round
    name: str = "tail_batching"

    @classmethod
    def from_config(cls, cfg: "RolloutConfig") -> "TailBatchingPolicy":
        tb = cfg.tail_batching
        return cls(tb.eta_prompts, tb.eta_responses, tb.long_round_size, tb.deferred,
                   tb.max_deferrals, tb.proactive)

    def __post_init__(self) -> None:
        if self.eta_prompts < 1.0 or self.eta_responses < 1.0:
            raise ValueError("eta_prompts and eta_responses must be >= 1")
        if self.long_round_size < 0 or self.max_deferrals < 1:
            raise ValueError("long_round_size must be >= 0 and max_deferrals >= 1")
        if self.deferred not in ("restart", "resume"):
            raise ValueError(f"deferred must be 'restart' or 'resume', got {self.deferred!r}")

    async def run(self, step: "Step") -> None:
        step.park_to = "long"  # also where an interrupted round's groups go, with their tokens
        step.exact_target = self.deferred == "restart"  # on-policy: no group left over
        queued = step.buffer.count(Place.LONG)
        if queued >= (self.long_round_size or step.target) or (step.final and queued):
            await self._long_round(step)
        else:
            await self._short_round(step)

    async def _short_round(self, step: "Step") -> None:
        step.round = "short"
        prompts = math.ceil(self.eta_prompts * step.target)
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

    async def _long_round(self, step: "Step") -> None:
        step.round = "long"
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
