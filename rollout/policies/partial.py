"""Active partial rollouts (APRIL, arXiv 2509.18521).

Keep over_provision x target groups in flight; the buffer hands out last step's unfinished
groups first (oldest first). Once `target` groups are complete, abort everything still
running and park it in the partial queue with its tokens, log-probabilities and versions:
the long tail no longer holds the step, and none of its work is thrown away.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.manager import Step


@dataclass
class PartialPolicy:
    over_provision: float = 2.0
    name: str = "partial"

    def __post_init__(self) -> None:
        if self.over_provision < 1.0:
            raise ValueError(f"over_provision must be >= 1, got {self.over_provision}")

    async def run(self, step: Step) -> None:
        in_flight = math.ceil(self.over_provision * step.target)
        while step.completed < step.target:
            step.launch_all(step.buffer.acquire(in_flight - step.completed - step.running))
            await step.next_event()
        await step.stop(park="partial")
