"""Push trainer weights to inference engines: pause -> flush -> update -> continue, versioned."""

from rlkit.train.weight_sync.engine_control import EngineControl, EngineControlError, HttpEngineControl
from rlkit.train.weight_sync.sender import SyncReport, WeightSender, WeightSyncError

__all__ = [
    "EngineControl",
    "EngineControlError",
    "HttpEngineControl",
    "SyncReport",
    "WeightSender",
    "WeightSyncError",
]
