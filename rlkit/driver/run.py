"""`rlkit train`: start the pieces through Ray, run the mode's loop, shut everything down."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import yaml

from rlkit.checkpoint import resume_point
from rlkit.config.schema import Recipe
from rlkit.driver.loop import LoopState, Run, finish_step
from rlkit.driver.modes import MODES
from rlkit.tracking import Tracker


def run_dir_of(recipe: Recipe) -> Path:
    return Path(recipe.run.output_dir) / recipe.run.name


def train(recipe: Recipe) -> LoopState:
    from rlkit.demo_models import resolve_model_path
    from rlkit.driver.cluster import Cluster, RayRolloutBox, RayTrainerBox

    run_dir = run_dir_of(recipe)
    ckpt = resume_point(run_dir, recipe.run.resume)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
    model_path = resolve_model_path(recipe.model.path)

    # SIGTERM (a scheduler, `kill`) takes the same clean path as Ctrl-C.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    tracker = Tracker(recipe.tracking, run_dir, recipe.run.name, recipe.model_dump(mode="json"))
    cluster = Cluster(recipe, model_path, run_dir)
    try:
        cluster.start()

        def on_progress(p: dict) -> None:  # while the rollout of step state.step + 1 runs
            tracker.progress(state.step + 1, p["completed"], p["target"], p["tokens"], p["seconds"])

        box = RayRolloutBox(cluster.rollout_actor, on_progress=on_progress if recipe.tracking.progress else None)
        trainer = RayTrainerBox(cluster.trainer, recipe, cluster.engine_urls, run_dir)
        state = LoopState()
        if ckpt is not None:
            cluster.trainer.load(ckpt.trainer_dir)
            if ckpt.buffer_file.is_file():
                box.load(str(ckpt.buffer_file))
            state = LoopState(step=ckpt.step, version=ckpt.version)
        run = Run(box, trainer, recipe.run.num_steps, recipe.rollout.batch_size,
                  finish_step(recipe, tracker, box, trainer, run_dir), state)

        async def main() -> LoopState:
            if ckpt is not None:  # fresh engines hold the initial weights: give them the checkpoint's
                await run.push_weights(ckpt.version)
            return await MODES[recipe.mode](run)

        return asyncio.run(main())
    finally:
        tracker.close()
        cluster.shutdown()
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
