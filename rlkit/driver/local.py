"""In-process boxes: the rollout service and a trainer in this process, for tests and for
driving a mode's loop without Ray (`run_local`). The simulator builds on them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from rlkit.driver.loop import Handed, LoopState, OnEval, OnStep, Run, handed_of
from rlkit.driver.rollout_service import RolloutService, StepResult
from rlkit.train.stream import RolloutBatchStep

if TYPE_CHECKING:
    from rlkit.config.schema import Recipe
    from rlkit.train.config import TrainConfig
    from rlkit.train.protocol import Trainer


class LocalRolloutBox:
    def __init__(self, service: RolloutService) -> None:
        self.service = service

    def start_step(self, version: int, *, for_version: int, final: bool) -> asyncio.Future[StepResult]:
        return asyncio.ensure_future(
            self.service.run_step(version, for_version=for_version, final=final))

    async def next_ready(self) -> Handed:
        return handed_of([await self.service.next_ready()])

    async def take(self, n: int) -> Handed:
        return handed_of(self.service.take(n))

    async def admits(self, for_version: int) -> bool:
        return self.service.admits(for_version)

    async def set_version(self, version: int) -> None:
        self.service.set_version(version)

    async def evaluate(self, version: int) -> dict[str, float]:
        return await self.service.evaluate(version)

    async def engine_set(self) -> tuple[list[str], list[str]]:
        return self.service.engine_set()

    async def admit_engines(self, urls: list[str]) -> None:
        await self.service.admit_engines(urls)

    async def give_back_untrained(self) -> int:
        return self.service.give_back_untrained()

    async def check_engines(self) -> int:
        return await self.service.check_engines()

    def save(self, path: str) -> None:
        self.service.save(path)


class LocalTrainerBox:
    """A Trainer (protocol) in this process; groups are trained as `add` hands them over."""

    def __init__(self, trainer: "Trainer", cfg: "TrainConfig", rollout_samples: int, *,
                 weights_folder: str | Path | None = None) -> None:
        self.trainer = trainer
        self.cfg = cfg
        self.rollout_samples = rollout_samples
        self.weights_folder = weights_folder
        self._batch: RolloutBatchStep | None = None

    def begin(self, version: int) -> None:
        self._batch = RolloutBatchStep.for_config(
            self.trainer, self.cfg, policy_version=version, rollout_samples=self.rollout_samples)

    def add(self, handed: Handed) -> None:
        assert self._batch is not None, "begin() first"
        self._batch.add_all(handed.refs)

    async def finish(self) -> dict[str, float]:
        assert self._batch is not None, "begin() first"
        batch, self._batch = self._batch, None
        return await asyncio.to_thread(batch.finish)  # generation goes on meanwhile (async mode)

    async def push_weights(self, version: int, urls: Sequence[str]) -> None:
        """To `urls` (the engines serving now; none when every engine is lost)."""
        self.trainer.sync_weights(list(urls), version=version,
                                  method=self.cfg.weight_sync.method, folder=self.weights_folder)

    def save(self, path: str | Path) -> None:
        self.trainer.save(path)


def run_local(recipe: "Recipe", service: RolloutService, trainer: "Trainer", on_step: OnStep,
              state: LoopState | None = None, on_eval: OnEval | None = None) -> LoopState:
    """Run `recipe.mode`'s loop over an in-process rollout service and trainer; the service's
    evaluator (if any) runs when `recipe.eval` says, reporting to `on_eval`."""
    from rlkit.driver.modes import MODES

    trainer_box = LocalTrainerBox(trainer, recipe.train, recipe.rollout.samples_per_step)
    run = Run(LocalRolloutBox(service), trainer_box,
              recipe.run.num_steps, recipe.rollout.batch_size, on_step, state or LoopState(),
              eval_due=recipe.eval.due, on_eval=on_eval)
    return asyncio.run(MODES[recipe.mode](run))
