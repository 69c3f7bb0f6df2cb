"""The sync mode: rollout step -> train on the batch -> sync weights. One loop.

The loop talks to two boxes (DESIGN.md): the rollout box (buffer + manager; a local object or
its Ray actor) and the trainer (the Trainer protocol; one process or a TP x DP Ray group).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from buffers import Group
from rlkit.checkpoint import save_checkpoint
from rlkit.config.schema import Recipe
from rlkit.driver.rollout_service import StepResult, batch_metrics
from rlkit.tracking import Tracker
from train.batch import TrainBatch, build_batch_from_config
from train.protocol import Trainer


class RolloutBox(Protocol):
    def run_step(self, version: int, final: bool = False) -> StepResult: ...

    def take(self, n: int) -> list[Group]: ...

    def set_version(self, version: int) -> None: ...

    def save(self, path: str) -> None: ...


@dataclass
class LoopState:
    step: int = 0  # steps completed
    version: int = 0  # policy version the engines generate with


def train_on_batch(trainer: Trainer, batch: TrainBatch, recipe: Recipe) -> dict[str, float]:
    """One or more optimizer steps over a rollout batch (global_batch_size splits it)."""
    algo = recipe.train.algorithm
    if algo.kl_coef > 0:
        batch = batch.with_logprobs(ref=trainer.logprobs(batch, policy="reference"))
    gbs = recipe.train.global_batch_size or len(batch)
    if len(batch) > gbs:
        # pi_old must be the weights that saw the whole batch, not those after the first step
        batch = batch.with_logprobs(old=trainer.logprobs(batch))
    parts = batch.micro_batches(gbs)
    metrics: dict[str, float] = {}
    for part in parts:
        trainer.accumulate(part)
        metrics = trainer.step()
    metrics["train/optimizer_steps"] = float(len(parts))
    metrics["train/off_policy_samples"] = float(batch.metadata.get("off_policy_samples", 0))
    return metrics


def push_weights(trainer: Trainer, rollout: RolloutBox, engine_urls: Sequence[str], version: int,
                 recipe: Recipe, run_dir: Path) -> None:
    """The trainer's weights, as `version`, to the engines, and the rollout box told which
    version it now generates with: the one weight sync of every mode and of a resume."""
    trainer.sync_weights(list(engine_urls), version=version,
                         method=recipe.train.weight_sync.method, folder=run_dir / "weights")
    rollout.set_version(version)


def finish_step(recipe: Recipe, state: LoopState, tracker: Tracker, rollout: RolloutBox,
                trainer: Trainer, run_dir: Path, result: StepResult, groups: list[Group],
                row: dict[str, float]) -> None:
    """After a trained step: its metrics row (rollout, batch, train, buffer), timeline and
    trained groups to the tracker, and a checkpoint when one is due (always after the last)."""
    tracker.log(state.step, {
        **result.metrics,
        **batch_metrics(groups),
        **row,
        "version": state.version,
        **{f"buffer/{k}": v for k, v in result.buffer.items() if isinstance(v, (int, float))},
    })
    tracker.log_timeline(state.step, result.timeline, header=result.header)
    tracker.log_groups(state.step, groups)
    every = recipe.checkpoint.every_steps
    if state.step == recipe.run.num_steps or (every and state.step % every == 0):
        save_checkpoint(
            run_dir, state.step, state.version,
            save_trainer=trainer.save,
            save_buffer=(lambda p: rollout.save(str(p))) if recipe.checkpoint.save_buffer else None,
            keep_last=recipe.checkpoint.keep_last,
        )


def run_sync(
    recipe: Recipe,
    rollout: RolloutBox,
    trainer: Trainer,
    engine_urls: Sequence[str],
    tracker: Tracker,
    run_dir: Path,
    state: LoopState,
) -> LoopState:
    while state.step < recipe.run.num_steps:
        t0 = time.monotonic()
        result = rollout.run_step(state.version, final=state.step + 1 == recipe.run.num_steps)
        groups = rollout.take(recipe.rollout.batch_size)
        t1 = time.monotonic()
        batch = build_batch_from_config(groups, recipe.train.algorithm, state.version)
        metrics = train_on_batch(trainer, batch, recipe)
        t2 = time.monotonic()
        state.version += 1
        push_weights(trainer, rollout, engine_urls, state.version, recipe, run_dir)
        t3 = time.monotonic()
        state.step += 1
        finish_step(recipe, state, tracker, rollout, trainer, run_dir, result, groups,
                    {**metrics, "train/seconds": t2 - t1, "sync/seconds": t3 - t2,
                     "step/seconds": t3 - t0})
    return state
