"""A colocated trainer rank's turns on the GPU it shares with an engine (cluster.placement
colocated, docs/colocation.md), as metrics: what leaves the device when, and what comes back.
The mechanics of moving memory are train/megatron/offload.py's; the engines' sleep and wake are
the rollout side's (rollout/engine_updates.py).

    end of training   `free_device`: gradients and optimizer state leave (the parameters stay,
                      to be sent), so the engines can take their weights' memory back
    weight update     `publishing`: the parameters on the device while they are sent, then
                      they leave too, before the engines take their KV cache back
    turn to training  `take_device`: the engines sleep; everything comes back
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch


def device_used(device: torch.device) -> float | None:
    """Bytes in use on a CUDA device, by every process (the colocated engine's share too);
    None on CPU."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return float(total - free)


def add_moved(into: dict[str, float], direction: str, report: dict[str, float]) -> None:
    """Add one TrainerOffload report to a turn's metrics (several moves make one turn; one that
    moved nothing, e.g. parameters already on the device, adds no key)."""
    if not report["bytes"]:
        return
    for key, value in ((f"colocate/trainer_{direction}ed_bytes", report["bytes"]),
                       (f"colocate/trainer_{direction}_seconds", report["seconds"])):
        into[key] = into.get(key, 0.0) + float(value)


class Colocation:
    """One rank's turns; `trainer`: a MegatronTrainer (its device and its state to move)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._offload = None

    @property
    def offload(self):
        """The rank's TrainerOffload, made on first use (a disaggregated rank never makes one)."""
        if self._offload is None:
            from rlkit.train.megatron.offload import TrainerOffload

            self._offload = TrainerOffload(self.trainer)
        return self._offload

    def free_device(self) -> dict[str, float]:
        moved: dict[str, float] = {}
        add_moved(moved, "offload", self.offload.offload(("grads", "optimizer")))
        return moved

    def take_device(self) -> dict[str, float]:
        report: dict[str, float] = {}
        asleep = device_used(self.trainer.device)
        add_moved(report, "onload", self.offload.onload(("params", "grads", "optimizer")))
        training = device_used(self.trainer.device)
        if asleep is not None:  # device-wide, the engines' share included
            report.update({"colocate/device_used_asleep_bytes": asleep,
                           "colocate/device_used_training_bytes": training})
        return report

    def publishing(self, moved: dict[str, float]) -> Callable[[], None]:
        """Before a colocated update's send: only the parameters on the device (a free_device
        that did not happen, e.g. the run's first update, happens here); returns `after_send`,
        which takes them off. Both add to `moved`."""
        add_moved(moved, "offload", self.offload.offload(("grads", "optimizer")))
        add_moved(moved, "onload", self.offload.onload(("params",)))
        return lambda: add_moved(moved, "offload", self.offload.offload(("params",)))

    def generating(self, out: dict[str, float]) -> None:
        """After the update: what the device holds with the engines awake again."""
        if (used := device_used(self.trainer.device)) is not None:
            out["colocate/device_used_generating_bytes"] = used

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The whole state on the device for a moment (a checkpoint, an export) and back where
        it was: an offloaded tensor must never be read (train/megatron/offload.py)."""
        away = self._offload.offloaded if self._offload is not None else ()
        if away:
            self._offload.onload(away)
        try:
            yield
        finally:
            if away:
                self._offload.offload(away)
