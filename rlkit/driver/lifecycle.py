"""What every kind of run shares around its loop (`rlkit.driver.run` for RL, `rlkit.driver.sft`
for SFT): its folder, SIGTERM taken as Ctrl-C, and the one line that says which process died,
when, and how to continue."""

from __future__ import annotations

from pathlib import Path

import yaml

from rlkit.checkpoint import Checkpoint, resume_point
from rlkit.config.schema import Recipe
from rlkit.tracking import rewind


def run_dir_of(recipe: Recipe) -> Path:
    return Path(recipe.run.output_dir) / recipe.run.name


def open_run_dir(recipe: Recipe) -> tuple[Path, Checkpoint | None]:
    """The run's folder, made, with the recipe written in it, and the checkpoint it resumes
    from (run.resume). Resuming with `auto`, the rows of steps after that checkpoint are
    redone, so they are dropped from the per-step files."""
    run_dir = run_dir_of(recipe)
    ckpt = resume_point(run_dir, recipe.run.resume)
    run_dir.mkdir(parents=True, exist_ok=True)
    if recipe.run.resume == "auto":
        rewind(run_dir, ckpt.step if ckpt is not None else 0)
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
    return run_dir, ckpt


def died_message(what: str, step: int, recipe: Recipe, ckpt: Checkpoint | None) -> str:
    """Which piece died, at which step, and how the run continues."""
    again = ("run the same command again (run.resume=auto)" if recipe.run.resume == "auto"
             else "run it again with run.resume=auto")
    if ckpt is not None:
        how = f"{again} to continue from the checkpoint of step {ckpt.step} ({ckpt.path})"
        if ckpt.buffer_file.is_file():
            how += (", at its data position" if recipe.train.algorithm.loss == "sft"
                    else ", with its buffered partial groups and long queue")
    else:
        how = f"no checkpoint was written yet: {again} to start over from step 0"
    return f"{what}, in step {step} of {recipe.run.num_steps}. The run stopped (all its processes); {how}"


def raise_interrupt(signum: int, frame: object) -> None:
    """The SIGTERM handler: a scheduler's or `kill`'s stop takes Ctrl-C's clean path."""
    raise KeyboardInterrupt(f"signal {signum}")
