"""The synchronous baseline: launch exactly the target and wait for every group."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlkit.rollout.manager import Step


class SyncPolicy:
    name = "sync"

    async def run(self, step: Step) -> None:
        while step.completed < step.target:
            # Only a dropped or filtered group makes room for another.
            step.launch_all(step.buffer.acquire(step.target - step.completed - step.running))
            await step.next_event()
