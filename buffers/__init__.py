"""The data plane: samples, groups and the one RolloutBuffer every mode schedules over.

Pure Python: nothing here imports torch, Ray or an HTTP library.
"""

from buffers.group import Group, Lane, PromptRecord
from buffers.sample import FINISH_REASON_STATUS, Sample, SampleError, SampleStatus

__all__ = [
    "FINISH_REASON_STATUS",
    "Group",
    "Lane",
    "PromptRecord",
    "Sample",
    "SampleError",
    "SampleStatus",
]
