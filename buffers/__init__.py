"""The data plane: samples, groups and the one RolloutBuffer every mode schedules over.

Pure Python: nothing here imports torch, Ray or an HTTP library.
"""

from rlkit.buffers.buffer import (
    BufferClosed, BufferError, BufferStateError, Place, RolloutBuffer, StalenessBoundError,
)
from rlkit.buffers.group import Group, Lane, PromptRecord
from rlkit.buffers.persistence import load_buffer, save_buffer
from rlkit.buffers.sample import FINISH_REASON_STATUS, Sample, SampleError, SampleStatus
from rlkit.buffers.source import EpochOrder, ListPromptSource, PromptSource
from rlkit.buffers.staleness import StalenessPolicy, staleness

__all__ = [
    "FINISH_REASON_STATUS",
    "BufferClosed",
    "BufferError",
    "BufferStateError",
    "EpochOrder",
    "Group",
    "Lane",
    "ListPromptSource",
    "Place",
    "PromptRecord",
    "PromptSource",
    "RolloutBuffer",
    "Sample",
    "SampleError",
    "SampleStatus",
    "StalenessBoundError",
    "StalenessPolicy",
    "load_buffer",
    "save_buffer",
    "staleness",
]
