"""`rlkit train` of an SFT recipe (train.algorithm.loss: sft): the trainer alone, no engine.

    for each step:
        rows  = the next rollout.batch_size rows        (seeded epochs, as an RL run's prompts)
        batch = prompt + response + EOS of each row     (the response's tokens trained)
        trainer.accumulate(batch); trainer.step()       (micro-batches over the DP replicas, one
                                                         optimizer step: the RL run's trainer)
        one metrics row; a checkpoint when due          (the data position saved with it)

Its checkpoints are an RL run's trainer checkpoints: `rlkit export RUN OUT` writes the HF model
an RL recipe starts from (`model.path: OUT`), the warm-up path (docs/training.md, "SFT"). A run
continued with `run.resume: auto` goes on from its newest checkpoint, at the same data position.
"""

from __future__ import annotations

import json
import signal
import time


from rlkit.checkpoint import latest_checkpoint, save_checkpoint
from rlkit.config.schema import Recipe
from rlkit.driver.lifecycle import died_message, open_run_dir, raise_interrupt
from rlkit.driver.loop import LoopState
from rlkit.tracking import Tracker


def train_sft(recipe: Recipe) -> LoopState:
    from transformers import AutoTokenizer

    from rlkit.common.errors import ProcessDied
    from rlkit.data.sft import load_sft_source, sft_sample
    from rlkit.driver.cluster import Cluster
    from rlkit.rollout.demo_models import resolve_model_path
    from rlkit.train.batch import TrainBatch

    run_dir, ckpt = open_run_dir(recipe)
    model_path = resolve_model_path(recipe.model.path)
    tokenizer = AutoTokenizer.from_pretrained(recipe.model.tokenizer or model_path)
    # a bad data file fails here, before any process starts
    source = load_sft_source(recipe.data, tokenizer, seed=recipe.run.seed)
    rows, cap = recipe.rollout.batch_size, recipe.rollout.sampling.max_new_tokens

    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    tracker = Tracker(recipe.tracking, run_dir, recipe.run.name, recipe.model_dump(mode="json"))
    cluster = Cluster(recipe, model_path, run_dir)  # SFT: the trainer's ranks alone
    state = LoopState(step=ckpt.step, version=ckpt.version) if ckpt is not None else LoopState()
    died: ProcessDied | None = None
    try:
        cluster.start()
        trainer = cluster.trainer
        if ckpt is not None:
            state.phase = "the checkpoint load"
            trainer.load(ckpt.trainer_dir)
            source.load_state_dict(json.loads(ckpt.buffer_file.read_text()))
        while state.step < recipe.run.num_steps:
            state.phase = "training"
            t0 = time.perf_counter()
            first = state.step * rows
            made = [sft_sample(source.next_prompt(), tokenizer, first + i, cap) for i in range(rows)]
            batch = TrainBatch([s for s, _ in made], policy_version=state.version)
            trainer.accumulate(batch)
            metrics = trainer.step()
            state.step += 1  # the version stays 0: it counts weight syncs, and no engine has any
            tracker.log(state.step, {
                **metrics, "step/seconds": time.perf_counter() - t0,
                "sft/rows": float(rows), "sft/tokens": float(batch.tokens),
                "sft/truncated": float(sum(cut for _, cut in made)), "sft/epoch": float(source.epoch),
            })
            every = recipe.checkpoint.every_steps
            if state.step == recipe.run.num_steps or (every and state.step % every == 0):
                state.phase = "the checkpoint write"
                save_checkpoint(
                    run_dir, state.step, state.version, save_trainer=trainer.save,
                    # the data position, where an RL run's buffer goes
                    save_buffer=lambda p: p.write_text(json.dumps(source.state_dict())),
                    keep_last=recipe.checkpoint.keep_last)
        return state
    except Exception as e:
        died = cluster.died(e, state.phase)
        if died is None:
            raise
        raise ProcessDied(died_message(str(died), state.current_step(), recipe,
                                        latest_checkpoint(run_dir))) from None
    finally:
        tracker.close()
        cluster.shutdown(graceful=died is None)
        signal.signal(signal.SIGTERM, previous)
