"""The rollout actor of the load stress test (tests/stress/load.py) (its own module: importing the driver's Ray
classes costs `rlkit --help` a third of a second)."""

from __future__ import annotations

from typing import Any

from tests.stress.load import PeakRss, build_service
from rlkit.driver.cluster import RolloutActor


class LoadRolloutActor(RolloutActor):
    """The real RolloutActor (its run_step, take, next_ready and `_refs` are used as they are)
    with the service built over InstantEngines instead of a router and engine servers."""

    def __init__(self, samples: int, batch_size: int, seed: int) -> None:
        # RolloutActor.__init__ wants a recipe to prepare() and start() from; this actor needs
        # neither, only the attributes its other methods read.
        self.router = None
        self.client = None
        self.service = build_service(samples, batch_size, seed)
        self._rss = PeakRss()

    def stats(self) -> dict[str, Any]:
        assert self.service is not None
        return self.service.stats()

    def memory(self) -> dict[str, float]:
        return self._rss.report()
