"""`rlkit train`: start the pieces through Ray, run the mode's loop, shut everything down.

Whatever ends the run (the last step, Ctrl-C, a bad input, a trainer process killed mid-step),
every process of it is stopped before `train` returns or raises. A run continued with
`run.resume: auto` starts from its newest checkpoint: the trainer's state and the buffer's
(partial groups, long queue, data position), and the run's per-step files are cut back to that
step, so the steps redone after a crash are recorded once.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Awaitable


from rlkit.common.errors import ProcessDied, find_user_error
from rlkit.checkpoint import latest_checkpoint, save_checkpoint
from rlkit.config.schema import Recipe
from rlkit.driver.lifecycle import died_message, open_run_dir, raise_interrupt
from rlkit.driver.loop import LoopState, Run, step_recorder
from rlkit.driver.modes import MODES
from rlkit.tracking import Tracker
from rlkit.rollout.health import EnginesDown, RouterDown


def train(recipe: Recipe) -> LoopState:
    from rlkit.rollout.demo_models import resolve_model_path
    from rlkit.driver.cluster import Cluster
    from rlkit.driver.proxies import RayTrainerBox, RemoteRolloutBox

    from rlkit.plugins import check_plugins

    if recipe.train.algorithm.loss == "sft":  # the trainer alone, on the data's responses
        from rlkit.driver.sft import train_sft

        return train_sft(recipe)
    check_plugins(recipe)  # a misspelt plugin or argument fails here, before anything starts
    run_dir, ckpt = open_run_dir(recipe)
    model_path = resolve_model_path(recipe.model.path)

    # SIGTERM (a scheduler, `kill`) takes the same clean path as Ctrl-C.
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    tracker = Tracker(recipe.tracking, run_dir, recipe.run.name, recipe.model_dump(mode="json"))
    cluster = Cluster(recipe, model_path, run_dir)
    state = LoopState(step=ckpt.step, version=ckpt.version) if ckpt is not None else LoopState()
    died: ProcessDied | None = None
    try:
        cluster.start()

        def on_progress(p: dict) -> None:  # while the rollout of step state.step + 1 runs
            tracker.progress(state.step + 1, p["completed"], p["target"], p["tokens"], p["seconds"])

        box = RemoteRolloutBox(cluster.rollout_actor, on_progress=on_progress if recipe.tracking.progress else None)
        trainer = RayTrainerBox(cluster.trainer, recipe)
        if ckpt is not None:
            state.phase = "the checkpoint load"
            cluster.trainer.load(ckpt.trainer_dir)
            if ckpt.buffer_file.is_file():
                box.load(str(ckpt.buffer_file))
        run = Run(box, trainer, recipe.run.num_steps, recipe.rollout.batch_size,
                  step_recorder(recipe, tracker, box, trainer, run_dir), state,
                  eval_due=recipe.eval.due, on_eval=tracker.log_eval,
                  colocated=recipe.cluster.placement == "colocated")
        box.on_engines_back = run.restore_engines  # restarted engines get the weights mid-step

        async def main() -> LoopState:
            # Fresh engines hold the initial weights: give them the checkpoint's. Colocated, the
            # push also frees the trainer's GPU memory for the first rollout.
            try:
                if ckpt is not None or run.colocated:
                    state.phase = "the first weight push"
                    await run.push_weights(state.version)
                # the rollout actor's death stops the loop at once, whatever it waits for
                return await _unless_dead(MODES[recipe.mode](run), box.watch())
            except Exception as e:
                if (died := trainer.died(e)) is not None:  # a rank died while publishing weights
                    raise died from None
                down = find_user_error(e)  # Ray wraps the rollout actor's error
                if not isinstance(down, EnginesDown):
                    raise
                # The step parked every group with its tokens; keep them, and the steps done.
                await box.give_back_untrained()
                saved = save_checkpoint(
                    run_dir, state.step, state.version, save_trainer=trainer.save,
                    save_buffer=(lambda p: box.save(str(p))) if recipe.checkpoint.save_buffer else None,
                    keep_last=max(1, recipe.checkpoint.keep_last))
                what = "the router" if isinstance(down, RouterDown) else "the engines"
                raise type(down)(
                    f"{down}, in step {state.step + 1} of {recipe.run.num_steps}. The run stopped "
                    f"with every unfinished group parked with its tokens in the checkpoint of step "
                    f"{saved.step} ({saved.path}); once {what} can start, run it again with "
                    "run.resume=auto to continue from there") from None

        return asyncio.run(main())
    except Exception as e:
        # Any process of the run that died (a trainer rank, the rollout actor, ...): one line
        # naming it, the step and phase, and where to continue from; anything else propagates.
        died = cluster.died(e, state.phase)
        if died is None:
            raise
        raise ProcessDied(died_message(str(died), state.current_step(), recipe, latest_checkpoint(run_dir))) from None
    finally:
        tracker.close()
        cluster.shutdown(graceful=died is None)
        signal.signal(signal.SIGTERM, previous)


async def _unless_dead(loop: Awaitable[LoopState], watch: asyncio.Future) -> LoopState:
    """Run the mode's loop; if `watch` (the rollout actor's liveness) fails first, stop the
    loop and raise its error: the actor's death, named by Cluster.died in the phase the
    driver was in (without it, in sync mode, training would run to its end first)."""
    task = asyncio.ensure_future(loop)
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and watch.exception() is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise watch.exception()  # type: ignore[misc]
        return await task
    finally:
        watch.cancel()
