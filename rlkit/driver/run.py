"""`rlkit train`: start the pieces through Ray, run the mode's loop, shut everything down."""

from __future__ import annotations

import signal
from pathlib import Path

import yaml

from rlkit.checkpoint import resume_point
from rlkit.config.schema import Recipe
from rlkit.driver.sync import LoopState, push_weights, run_sync
from rlkit.tracking import Tracker


def run_dir_of(recipe: Recipe) -> Path:
    return Path(recipe.run.output_dir) / recipe.run.name


def train(recipe: Recipe) -> LoopState:
    from rlkit.demo_models import resolve_model_path
    from rlkit.driver.cluster import Cluster, RayRolloutBox

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
        state = LoopState()
        if ckpt is not None:
            cluster.trainer.load(ckpt.trainer_dir)
            if ckpt.buffer_file.is_file():
                box.load(str(ckpt.buffer_file))
            state = LoopState(step=ckpt.step, version=ckpt.version)
            # fresh engines hold the initial weights: give them the checkpoint's
            push_weights(cluster.trainer, box, cluster.engine_urls, ckpt.version, recipe, run_dir)

        return run_sync(recipe, box, cluster.trainer, cluster.engine_urls, tracker, run_dir, state)
    finally:
        tracker.close()
        cluster.shutdown()
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
