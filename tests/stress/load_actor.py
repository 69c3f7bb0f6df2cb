"""The rollout actor of the load stress test (tests/stress/load.py) (its own module: importing the driver's Ray
classes costs `rlkit --help` a third of a second)."""

from __future__ import annotations

from typing import Any

from tests.stress.load import PeakRss, build_service
from rlkit.driver.actors import RolloutActor, ray_handed


class LoadRolloutActor(RolloutActor):
    """The real RolloutActor (its generic `call` and streamed step are used as they are)
    with the service built over InstantEngines instead of a router and engine servers."""

    def __init__(self, samples: int, batch_size: int, seed: int) -> None:
        # RolloutActor.__init__ wants a recipe to prepare() and start() from; this actor needs
        # neither, only the attributes its other methods read.
        self.router = None
        self.client = None
        self.faults = None  # no test-only fault switch here
        self.service = build_service(samples, batch_size, seed)
        self.service.hand = ray_handed  # groups leave as object references, as in a run
        self._rss = PeakRss()

    def stats(self) -> dict[str, Any]:
        assert self.service is not None
        return self.service.stats()

    def memory(self) -> dict[str, float]:
        return self._rss.report()
