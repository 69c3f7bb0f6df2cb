"""Active partial rollouts (APRIL, arXiv 2509.18521).

Keep over_provision x target groups in flight; the buffer hands out last step's unfinished
groups first (oldest first). Once `target` groups are complete, abort everything still
running and park it in the partial queue with its tokens, log-probabilities and versions:
the long tail no longer holds the step, and none of its work is thrown away.

Under rollout.max_token_lag a group whose samples could not be resumed in the next step
without restarting one (its oldest token would then lag past the bound) must finish in this
one: the step waits for it after its target, instead of parking it and throwing its tokens
away next step (the buffer hands the oldest groups to the trainer first). At most the step's
target of them are launched (buffer.acquire's must_limit): one more would complete as a surplus
that the next batch trains a version later, past the bound. One version ahead (async) under a
bound of 1 every fresh group is on its last chance, so the step launches no more than its
target: over-provisioning cannot keep tokens that the bound would throw away.

Adaptive over-provisioning (with a ranker) replaces the fixed factor: groups are launched one
at a time while the predicted work in flight is too little to keep the engines at their
target utilization until the step's last needed group completes (rollout.dispatch's
InFlightSizer), within [min, max] x target; a filter's recent pass rate scales the need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlkit.rollout.dispatch import InFlightSizer
from rlkit.rollout.manager import EventKind

if TYPE_CHECKING:
    from rlkit.buffers.group import Group
    from rlkit.rollout.manager import Step


@dataclass
class PartialPolicy:
    over_provision: float = 2.0
    # Adaptive over-provisioning (rollout.partial.adaptive): groups in flight between
    # min and max x target, as many as `sizer` says keep the engines busy (needs a ranker).
    sizer: InFlightSizer | None = None
    min_factor: float = 1.0
    max_factor: float = 2.0
    name: str = "partial"
    pass_rate: float = 1.0  # share of complete groups the filter kept, recently (adaptive)
    # groups of this step launched on their last chance under rollout.max_token_lag: those
    # still running, the ids of all, and how many hold a slot of the batch (running or complete)
    _must: list["Group"] = field(default_factory=list, init=False, repr=False)
    _must_ids: set[int] = field(default_factory=set, init=False, repr=False)
    _must_slots: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.over_provision < 1.0:
            raise ValueError(f"over_provision must be >= 1, got {self.over_provision}")
        if not 1.0 <= self.min_factor <= self.max_factor:
            raise ValueError("adaptive over-provisioning needs 1 <= min <= max")

    async def run(self, step: Step) -> None:
        in_flight = math.ceil(self.over_provision * step.target)
        adaptive = self.sizer is not None and step.ranker is not None
        self._must, self._must_ids, self._must_slots = [], set(), 0
        while step.completed < step.target or self._waiting(step):
            if adaptive:
                self._fill(step)
            else:
                self._launch(step, self._acquire(step, in_flight - step.completed - step.running))
            event = await step.next_event()
            if event.kind is not EventKind.COMPLETED and event.group.group_id in self._must_ids:
                self._must_slots -= 1  # filtered, dropped or parked: its slot is free again
        if adaptive:
            self._learn_pass_rate(step)
        await step.stop(park="partial")

    def _fill(self, step: Step) -> None:
        """Launch one group at a time until the sizer says the work in flight is enough (or a
        bound is reached); a filter that turns groups down asks for proportionally more."""
        assert self.sizer is not None
        lo = math.ceil(self.min_factor * step.target)
        hi = math.ceil(self.max_factor * step.target)
        need = math.ceil((step.target - step.completed) / self.pass_rate)
        context = (step.response_lengths.quantile(0.5) or 0.0) / 2
        busy = self.sizer.busy_requests(len(step.engines.workers()), context)
        n = step.buffer.n_samples_per_prompt
        while step.completed + step.running < hi:
            if step.completed + step.running >= lo and self.sizer.enough(
                    step.running_groups(), need, n, busy):
                break
            groups = self._acquire(step, 1)
            if not groups:
                break
            self._launch(step, groups)

    def _acquire(self, step: Step, k: int) -> list[Group]:
        """Up to k groups, last-chance ones only while the batch has slots for them."""
        return step.buffer.acquire(k, must_limit=step.target - self._must_slots)

    def _launch(self, step: Step, groups: list[Group]) -> None:
        must = [g for g in groups if step.buffer.must_finish(g)]
        self._must += must
        self._must_ids.update(g.group_id for g in must)
        self._must_slots += len(must)
        step.launch_all(groups)

    def _waiting(self, step: Step) -> bool:
        """Whether a group launched on its last chance still runs (the step waits for it)."""
        self._must = [g for g in self._must if step.is_running(g)]
        return bool(self._must)

    def _learn_pass_rate(self, step: Step) -> None:
        kept, filtered = step.completed, sum(step.report_.filtered.values())
        if kept + filtered:
            self.pass_rate = max(0.05, 0.5 * self.pass_rate + 0.5 * kept / (kept + filtered))
