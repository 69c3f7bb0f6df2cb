"""What every driver mode's loop works with: the two boxes, the run's length, the state, and
one place for the end of a step (`Run.end_step`: train, sync, report) and for the weight sync.

    rollout box  the buffer + manager (RolloutService; the protocol is rlkit/driver/
                 rollout_box.py): a Ray actor in a run, an in-process object in tests and in
                 the simulator. `start_step` returns a handle at once (an awaitable, as slime's
                 `generate.remote` returns a future).
    trainer box  the trainer: TP x DP Ray actors in a run, a local trainer in tests, a
                 time model in the simulator. It takes groups as they become ready.

`step_recorder` builds what a real run does with each ended step (metrics row, timeline,
checkpoint).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from rlkit.buffers.sample import TRACED_LOGPROBS
from rlkit.driver.rollout_box import Handed, RolloutBox, RolloutResult, batch_metrics
from rlkit.rollout.timeline import Phase

if TYPE_CHECKING:
    from rlkit.common.weight_update import WeightPublisher
    from rlkit.config.schema import Recipe
    from rlkit.tracking import Tracker


@dataclass
class LoopState:
    step: int = 0  # steps completed
    version: int = 0  # policy version of the trainer's weights (and the engines', after a sync)
    # What the driver is waiting for (a process that dies is reported as dying during it).
    phase: str = "start-up"
    # The trainer phases of the step just ended, for its timeline (rollout/timeline.py Phase):
    # what the driver waited for after the rollout, on the run's clock.
    trainer_phases: list["Phase"] = field(default_factory=list)

    def current_step(self) -> int:
        """The step the phase belongs to (1-based): a checkpoint is written after its step."""
        return self.step if self.phase == "the checkpoint write" else self.step + 1


class TrainerBox(Protocol):
    """The driver's calls on the training side (LocalTrainerBox in process, RayTrainerBox over
    the TrainerGroup's ranks, the simulator's TimedTrainerBox); TRAINER_CALLS lists them."""

    def begin(self, version: int) -> None: ...  # a rollout batch trained at `version` starts

    def add(self, handed: Handed) -> None: ...  # its groups, as they come (returns at once)

    async def finish(self) -> dict[str, float]: ...  # all in: optimizer step(s), metrics

    def publisher(self) -> "WeightPublisher":
        """What the rollout side calls to have the trainer's weights published into a weight
        update it opened on its engines (the trainer never touches the engines' state)."""
        ...

    def save(self, path: str | Path) -> None: ...


TRAINER_CALLS: frozenset[str] = frozenset(n for n in vars(TrainerBox) if not n.startswith("_"))


OnStep = Callable[[LoopState, RolloutResult, Handed, dict[str, float]], None]
OnEval = Callable[[int, dict[str, float]], None]  # steps done (= version evaluated), metrics


@dataclass
class Run:
    """What a mode's loop needs; the modes differ only in where they wait."""

    rollout: RolloutBox
    trainer: TrainerBox
    num_steps: int
    batch_size: int
    on_step: OnStep  # after each ended step (a real run's: `step_recorder`)
    state: LoopState = field(default_factory=LoopState)
    final_step: bool = True  # the last step is the run's final one (benchmarks of the steady state: no)
    # Held-out evaluation (recipe `eval`): whether one is due after k steps, and its report.
    eval_due: Callable[[int], bool] = lambda step: False
    on_eval: OnEval | None = None
    # cluster.placement colocated: engines and trainer take turns on the same GPUs (sync mode
    # only): `to_training` before each step's training, the weight push wakes the engines.
    colocated: bool = False
    _turn: dict[str, float] = field(default_factory=dict)  # the step's colocation metrics
    _phases: list[Phase] = field(default_factory=list)  # the step's trainer phases so far
    _asleep: bool = False  # colocated, from the engines' sleep to the push that wakes them
    _last_end: float | None = None
    _eval: asyncio.Task | None = None
    _eval_skip: int | None = None  # a resumed run's checkpoint step: evaluated before the stop
    # Held while the trainer's weights differ from what `state.version` says (training, the
    # sync), so a restarted engine is given weights only at a version boundary.
    _weights: asyncio.Lock = field(default_factory=asyncio.Lock)

    def now(self) -> float:
        return asyncio.get_running_loop().time()  # virtual time in the simulator

    def start(self) -> None:
        """Start the step clock (the first step's seconds count from here)."""
        self._last_end = self.now()
        self.state.phase = "the rollout"
        self._eval_skip = self.state.step if self.state.step > 0 else None

    def start_eval(self) -> None:
        """Start the evaluation due after the steps done (before the first: the initial
        policy), at the engines' current version; returns at once."""
        step, version = self.state.step, self.state.version
        if step == self._eval_skip or not self.eval_due(step):
            return
        assert self._eval is None or self._eval.done(), "one evaluation at a time"

        async def evaluate() -> None:
            metrics = await self.rollout.evaluate(version)
            if self.on_eval is not None and metrics:
                self.on_eval(step, metrics)

        self._eval = asyncio.ensure_future(evaluate())

    async def eval_done(self) -> float | None:
        """Wait for the evaluation in flight (its error is raised here): seconds waited; None
        when none was in flight."""
        if self._eval is None:
            return None
        t0 = self.now()
        task, self._eval = self._eval, None
        await task
        return self.now() - t0

    async def evaluate(self) -> None:
        """The evaluation due now, waited for (sync and stream: between steps). Its time is
        its own (RUN/eval.jsonl): the next step's step/seconds starts after it."""
        self.start_eval()
        phase, self.state.phase = self.state.phase, "evaluation"
        waited = await self.eval_done()
        self.state.phase = phase
        if waited is not None:  # on the next step's timeline: the engines served it
            self._phases.append(Phase("eval", self.now() - waited, self.now()))
        if waited is not None and self._last_end is not None:
            self._last_end += waited

    def is_final(self, step: int) -> bool:
        """Whether 1-based `step` is the run's last (tail batching drains its long queue)."""
        return self.final_step and step == self.num_steps

    async def push_weights(self, version: int) -> None:
        """The one weight sync of every mode (and of a resume): the rollout side opens the
        update on its engines (those serving, and those restarted, which serve from now on),
        the trainer publishes `version` into it, the engines go on with it. One round trip from
        here (the trainer's publish is the rollout side's call). Colocated, it wakes them."""
        t0 = self.now()
        metrics = await self.rollout.update_weights(version, self.trainer.publisher(),
                                                    colocated=self.colocated)
        self._turn.update(metrics)
        if self.colocated:
            self._turn["colocate/wake_seconds"] = self.now() - t0
            self._asleep = False

    async def to_training(self) -> None:
        """Colocated: the engines sleep (the step's rollout is over, so they are idle); the
        trainer takes its state back onto their GPUs when its batch begins. Nothing otherwise."""
        if not self.colocated:
            return
        self.state.phase = "training"  # the engines' sleep is the turn to it
        self._asleep = True
        t0 = self.now()
        metrics = await self.rollout.sleep_engines()
        self._turn = {**metrics, "colocate/sleep_seconds": self.now() - t0}
        self._phases.append(Phase("sleep", t0, self.now()))

    async def restore_engines(self) -> None:
        """Engines restarted in the middle of a step (rollout.health) get the current weights
        and serve again; during training (colocated: from the engines' sleep on) they wait for
        its end (the next sync, which wakes the others)."""
        if self._weights.locked() or self._asleep:
            return
        async with self._weights:
            await self.rollout.update_weights(self.state.version, self.trainer.publisher(),
                                              restarted_only=True)

    async def end_step(self, result: RolloutResult, handed: Handed, **row: float) -> None:
        """Every mode's end of a step, once the trainer has all of its groups: what training
        is left and the optimizer step(s), the weight sync, then count, time and report it."""
        async with self._weights:
            t1 = self.now()
            self.state.phase = "training"
            metrics = await self.trainer.finish()
            t2 = self.now()
            # An evaluation still running (async mode) ends on the weights it began with.
            waited = await self.eval_done()
            t3 = self.now()
            self.state.phase = "the weight sync"
            await self.push_weights(self.state.version + 1)
        now = self.now()
        self._phases += [Phase("train", t1, t2), *([Phase("eval_wait", t2, t3)] if waited is not None else []),
                         Phase("sync", t3, now)]
        self.state.trainer_phases, self._phases = self._phases, []
        self.state.step += 1
        self.state.version += 1
        if waited is not None:  # what the sync waited for the evaluation (async mode)
            row = {**row, "eval/wait_seconds": waited}
        turn, self._turn = self._turn, {}
        row = {**metrics, **turn, **row, "train/seconds": t2 - t1, "sync/seconds": now - t2 - (waited or 0.0),
               "step/seconds": now - (self._last_end if self._last_end is not None else now)}
        self._last_end = now
        self.on_step(self.state, result, handed, row)
        self.state.phase = "the rollout"  # of the next step (async: under way already)


def step_recorder(recipe: "Recipe", tracker: "Tracker", rollout: RolloutBox, trainer: TrainerBox,
                  run_dir: Path) -> OnStep:
    """The real run's end of a step: its metrics row (rollout, batch, train, buffer),
    timeline and trained groups to the tracker, and a checkpoint when one is due (always
    after the last)."""
    from rlkit.checkpoint import save_checkpoint

    def on_step(state: LoopState, result: RolloutResult, handed: Handed,
                row: dict[str, float]) -> None:
        # the trainer's logprobs of the samples saved for the viewer join their rows
        traced: dict = row.pop(TRACED_LOGPROBS, None) or {}  # type: ignore[assignment]
        for s in handed.samples:
            s["trainer_logprobs"] = traced.get(f"{s['group_id']}/{s['sample_index']}")
        tracker.log(state.step, {
            **result.metrics,
            **batch_metrics(handed.records),
            **_staleness(handed.records, state.version - 1),
            **row,
            "version": state.version,
            **{f"buffer/{k}": v for k, v in result.buffer.items() if isinstance(v, (int, float))},
        })
        tracker.log_timeline(state.step, result.timeline, header=result.header,
                             phases=[p.to_json() for p in state.trainer_phases])
        tracker.log_groups(state.step, handed.records, dropped=result.dropped)
        tracker.log_samples(state.step, handed.samples)
        every = recipe.checkpoint.every_steps
        if state.step == recipe.run.num_steps or (every and state.step % every == 0):
            state.phase = "the checkpoint write"
            save_checkpoint(
                run_dir, state.step, state.version,
                save_trainer=trainer.save,
                save_buffer=(lambda p: rollout.save(str(p))) if recipe.checkpoint.save_buffer else None,
                keep_last=recipe.checkpoint.keep_last,
            )

    return on_step


def _staleness(records: Sequence[dict[str, Any]], trained_at: int) -> dict[str, float]:
    """How many versions the oldest trained token lagged the trainer (0 in sync mode)."""
    oldest = [r["oldest_version"] for r in records if r.get("oldest_version") is not None]
    return {"batch/max_staleness": float(trained_at - min(oldest))} if oldest else {}
