"""The trainer's half of a weight update: publish weights into an update the rollout side
opened (rollout/engine_updates.py), by disk, in-memory handles or a broadcast group, versioned."""

from rlkit.common.engine_http import EngineControlError, EngineWeights, HttpEngine, WeightSyncError
from rlkit.train.weight_sync.sender import SyncReport, WeightSender

__all__ = [
    "EngineControlError",
    "EngineWeights",
    "HttpEngine",
    "SyncReport",
    "WeightSender",
    "WeightSyncError",
]
