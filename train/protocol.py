"""The Trainer protocol: what every driver mode (sync, stream, async) calls on the training side.

Implemented by `train.megatron.trainer.MegatronTrainer` (one process, TP=DP=1, or one rank of a
larger world) and by `train.ray_group.TrainerGroup` (TP x DP Ray actors, driven as one).

The contract that makes stream mode equal sync mode: `accumulate` may be called any number of
times, with any partition of the global batch in any order; `step` normalises by the total
denominator of everything accumulated since the previous step (token count for token_mean,
sample count for sequence_mean), so the update is the same as one `accumulate(whole batch)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import torch

from rlkit.common.weight_update import WeightUpdate
from rlkit.train.batch import TrainBatch

Policy = Literal["current", "reference"]


@runtime_checkable
class Trainer(Protocol):
    version: int  # policy version of the current weights, as last published to engines
    step_count: int  # optimizer steps taken

    def logprobs(self, batch: TrainBatch, *, policy: Policy = "current") -> list[torch.Tensor]:
        """Per-sample response-token logprobs (fp32, CPU) under the current or reference weights."""
        ...

    def accumulate(self, batch: TrainBatch) -> dict[str, float]:
        """Forward + backward over `batch` in micro-batches; gradients add up; no step."""
        ...

    def step(self) -> dict[str, float]:
        """Normalise, clip and apply the accumulated gradients; metrics under 'train/'."""
        ...

    def publish_weights(self, update: WeightUpdate) -> dict[str, float] | None:
        """Publish the current weights into `update` (opened on the engines by the rollout
        side, which owns them) and take its version. Metrics (rank 0 of a world)."""
        ...

    def free_device(self) -> dict[str, float]:
        """Colocated, the end of training: gradients and optimizer state leave the device."""
        ...

    def take_device(self) -> dict[str, float]:
        """Colocated, the turn to training: the whole state comes back onto the device."""
        ...

    def export_hf(self, path: str | Path) -> Path | None:
        """Write the current weights as an HF model folder."""
        ...

    def save(self, path: str | Path) -> None: ...

    def load(self, path: str | Path) -> None: ...
