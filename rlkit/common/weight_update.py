"""A weight update as the two sides of a run hand it to each other: the rollout side, which owns
the engines, opens it (rollout/engine_updates.py) and hands it to the trainer, which publishes
its weights into it (train/weight_sync/sender.py) and never touches the engines' state.
Plain data: it crosses Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

Method = Literal["disk", "distributed", "tensor"]
SESSION_METHODS = ("distributed", "tensor")  # those sent inside /begin_weight_update ... /end


@dataclass(frozen=True)
class WeightUpdate:
    """An open weight update, handed to the trainer to publish into (plain data: it crosses
    Ray). `flush`: whether updates flush the engines' cache (not under pause_mode in_place;
    never for an engine it wakes: its cache is gone). `folder`: where a disk update writes (the
    trainer may fall back to disk when NCCL cannot take its engines)."""

    version: int
    engines: tuple[str, ...]
    method: Method
    folder: str | None = None
    flush: bool = True
    colocated: bool = False  # the turn to generation: the trainer frees its device after sending
    waking: frozenset[str] = frozenset()  # engines this update wakes from sleep (colocated)
    # LoRA adapter sync (train.lora.sync: adapter): the trainer sends its adapter alone, loaded
    # under this name (`policy@v12`) beside the base and the adapters still in use; requests
    # name it from then on. None: the full weights.
    adapter: str | None = None
    # train.weight_sync.verify: the trainer also answers with its logprobs of the probe sequence
    # (`sync/probe_ids`, `sync/probe_logprobs`), which the rollout side has every engine score
    probe: bool = False

    def flushes(self, url: str) -> bool:
        return self.flush and url not in self.waking


def adapter_name(version: int) -> str:
    """The name the adapter of policy `version` is loaded under on the engines."""
    return f"policy@v{version}"


def adapter_version(name: str) -> int | None:
    """The policy version an adapter name carries (None: not one of rlkit's)."""
    head, sep, tail = name.rpartition("@v")
    return int(tail) if sep and head == "policy" and tail.isdigit() else None


class WeightPublisher(Protocol):
    """The trainer, as the rollout side sees it during an update: it publishes its current
    weights, as `update.version`, into the update; metrics (the sync's, the memory moved)."""

    async def publish(self, update: WeightUpdate) -> dict[str, float]: ...


class WeightsMismatch(RuntimeError):
    """After a sync an engine does not serve the trainer's policy (train.weight_sync.verify):
    a sync that did not arrive, or arrived wrong. The run stops; the message has the numbers."""


class PublisherFailed(RuntimeError):
    """The trainer (not an engine) failed while publishing: sending the update again to the
    engines left would not help, so the update stops here. `rank`: the trainer rank, if known;
    `reason`: why its process is gone, as Ray says (rlkit.common.errors.ActorDeath.reason)."""

    def __init__(self, message: str, rank: int | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.reason = reason

    def __reduce__(self):  # keeps `rank` and `reason` across Ray
        return (type(self), (str(self), self.rank, self.reason))
