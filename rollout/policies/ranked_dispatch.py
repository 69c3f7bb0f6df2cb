"""Ranked dispatch (StreamRL §5.3): a base policy (sync or partial) whose groups a Dispatcher
places and orders by predicted length. The long tail gets engines of its own, where it decodes
in small, fast batches while the regular groups fill the others; within an engine the longest
predicted work is admitted first (LPT). The base policy's loop is unchanged: the step places
every group it launches (Step.dispatcher)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlkit.rollout.dispatch import Dispatcher

if TYPE_CHECKING:
    from rlkit.rollout.manager import RolloutPolicy, Step


@dataclass
class RankedDispatchPolicy:
    base: "RolloutPolicy"
    dispatcher: Dispatcher
    name: str = "ranked_dispatch"

    async def run(self, step: "Step") -> None:
        if step.ranker is None:
            raise RuntimeError("ranked_dispatch needs a length ranker (rollout.ranker.name)")
        step.dispatcher = self.dispatcher
        await self.base.run(step)
