"""In-process boxes, for tests and for driving a mode's loop without Ray (`run_local`): the
rollout box is the RolloutService itself; the trainer box wraps a Trainer in this process. The
simulator builds on them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from rlkit.driver.loop import LoopState, OnEval, OnStep, Run
from rlkit.driver.rollout_box import Handed
from rlkit.driver.rollout_service import RolloutService
from rlkit.train.stream import RolloutBatchStep

if TYPE_CHECKING:
    from rlkit.common.weight_update import WeightUpdate
    from rlkit.config.schema import Recipe
    from rlkit.train.config import TrainConfig
    from rlkit.train.protocol import Trainer


class LocalTrainerBox:
    """A Trainer (protocol) in this process; groups are trained as `add` hands them over. It is
    its own publisher: the rollout side calls `publish` inside the update it opened."""

    def __init__(self, trainer: "Trainer", cfg: "TrainConfig", rollout_samples: int, *,
                 colocated: bool = False) -> None:
        self.trainer = trainer
        self.colocated = colocated
        self.cfg = cfg
        self.rollout_samples = rollout_samples
        self._batch: RolloutBatchStep | None = None
        self._moved: dict[str, float] = {}

    def begin(self, version: int) -> None:
        # colocated: the engines sleep already (Run.to_training), the state comes back
        self._moved = self.trainer.take_device() if self.colocated else {}
        self._batch = RolloutBatchStep.for_config(
            self.trainer, self.cfg, policy_version=version, rollout_samples=self.rollout_samples)

    def add(self, handed: Handed) -> None:
        assert self._batch is not None, "begin() first"
        self._batch.add_all(handed.refs)

    async def finish(self) -> dict[str, float]:
        assert self._batch is not None, "begin() first"
        batch, self._batch = self._batch, None
        metrics = await asyncio.to_thread(batch.finish)  # generation goes on meanwhile (async mode)
        if self.colocated:  # gradients and optimizer state leave the device before the wake
            metrics = {**metrics, **self._moved, **self.trainer.free_device()}
        return metrics

    def publisher(self) -> "LocalTrainerBox":
        return self

    async def publish(self, update: WeightUpdate) -> dict[str, float]:
        # In this thread, holding the loop: in process nothing else runs during the update, as
        # on a cluster the paused engines generate nothing (a thread would let fakes and
        # simulated engines generate with weights the buffer does not know of yet).
        return self.trainer.publish_weights(update) or {}

    def save(self, path: str | Path) -> None:
        self.trainer.save(path)


def run_local(recipe: "Recipe", service: RolloutService, trainer: "Trainer", on_step: OnStep,
              state: LoopState | None = None, on_eval: OnEval | None = None, *,
              loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> LoopState:
    """Run `recipe.mode`'s loop over an in-process rollout service and trainer; the service's
    evaluator (if any) runs when `recipe.eval` says, reporting to `on_eval`. `loop_factory`
    (default asyncio's) picks the event loop: tests that compare two runs exactly pass
    rlkit.sim.clock.VirtualTimeLoop, so that engines that tick on timers progress by virtual
    time and a busy machine cannot change what a step generated."""
    from rlkit.driver.modes import MODES

    colocated = recipe.cluster.placement == "colocated"
    trainer_box = LocalTrainerBox(trainer, recipe.train, recipe.rollout.samples_per_step,
                                  colocated=colocated)
    run = Run(service, trainer_box,
              recipe.run.num_steps, recipe.rollout.batch_size, on_step, state or LoopState(),
              eval_due=recipe.eval.due, on_eval=on_eval, colocated=colocated)

    async def main() -> LoopState:
        if colocated:  # the trainer frees its memory for the first rollout (run.py does the same)
            await run.push_weights(run.state.version)
        return await MODES[recipe.mode](run)

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main())
