"""One trainer box: the driver's calls on the training side are listed once (TRAINER_CALLS)
and every box implements each as declared; the Ray box's calls go through the TrainerGroup,
whose ranks serve each once; one sync step costs the driver at most four sequential round
trips (docs/design.md: generation, training, the weight update and, inside it, the trainer's
publish), the engines' bookkeeping all on the rollout side."""

import inspect

from rlkit.driver.local import LocalTrainerBox
from rlkit.driver.loop import TRAINER_CALLS, TrainerBox
from rlkit.driver.proxies import RayTrainerBox
from rlkit.sim.simulate import TimedTrainerBox
from rlkit.train.protocol import Trainer
from rlkit.train.ray_group import TrainerGroup, TrainWorker
from tests.driver.test_modes import RecordingTrainer, make_box, recipe


def test_every_trainer_box_implements_every_call_as_declared():
    assert TRAINER_CALLS == {"begin", "add", "finish", "publisher", "save"}
    for box in (LocalTrainerBox, RayTrainerBox, TimedTrainerBox):
        for name in TRAINER_CALLS:
            declared, mine = getattr(TrainerBox, name), getattr(box, name)
            assert inspect.iscoroutinefunction(mine) == inspect.iscoroutinefunction(declared), (box, name)
            assert list(inspect.signature(mine).parameters) == list(inspect.signature(declared).parameters), (box, name)


def test_the_group_and_its_ranks_serve_the_trainer_protocol_once_per_rank():
    """What the Ray box calls on the TrainerGroup, each rank serves under the same name; the
    group is a Trainer, as a single rank is."""
    calls = {"begin_batch", "add_groups", "finish_batch", "publish_weights", "save", "load",
             "export_hf", "free_device", "take_device", "logprobs", "accumulate", "step"}
    for name in calls:
        assert callable(getattr(TrainerGroup, name)) and callable(getattr(TrainWorker, name)), name
    protocol = {n for n in vars(Trainer) if not n.startswith("_") and callable(getattr(Trainer, n))}
    assert protocol <= set(dir(TrainerGroup)), sorted(protocol - set(dir(TrainerGroup)))
    for name in ("publish_weights", "begin_batch", "finish_batch"):  # same arguments, rank and group
        group = list(inspect.signature(getattr(TrainerGroup, name)).parameters)
        # (ray.remote adds its tracing argument to the class's methods once a group was made)
        rank = [p for p in inspect.signature(getattr(TrainWorker, name)).parameters if p != "_ray_trace_ctx"]
        assert group == rank, name


class Counted:
    """Counts the calls a loop waits for (a Ray round trip each in a run) on one side."""

    def __init__(self, inner, log, side):
        self.inner, self.log, self.side = inner, log, side

    def __getattr__(self, name):
        value = getattr(self.inner, name)
        if not callable(value):
            return value

        def call(*args, **kwargs):
            out = value(*args, **kwargs)
            if inspect.isawaitable(out):
                self.log.append(f"{self.side}.{name}")
            return out

        return call


def test_a_sync_step_costs_four_sequential_round_trips(tmp_path, monkeypatch):
    """Counted in process over the real loop: per sync step the driver waits for the rollout
    step (its batch comes with the result), the trainer's finish and the weight update; inside
    the update the rollout side waits for the trainer's publish. Before the engines had one
    owner the same step waited eight times (take, hold, engine_set, the push, unhold,
    set_version, finish, the step)."""
    from rlkit.driver.local import run_local

    r = recipe(tmp_path, 3)
    box, log = make_box(r), []
    trainer = RecordingTrainer()
    publishes = []
    counted = Counted(box.s, log, "rollout")
    original = LocalTrainerBox.publish

    async def publish(self, update):
        publishes.append(update.version)
        log.append("trainer.publish (inside rollout.update_weights)")
        return await original(self, update)

    finish = LocalTrainerBox.finish

    async def counted_finish(self):
        log.append("trainer.finish")
        return await finish(self)

    monkeypatch.setattr(LocalTrainerBox, "publish", publish)
    monkeypatch.setattr(LocalTrainerBox, "finish", counted_finish)
    state = run_local(r, counted, trainer, lambda *a: None)
    assert state.step == 3 and publishes == [1, 2, 3]
    per_step = ["rollout.start_step", "trainer.finish", "rollout.update_weights",
                "trainer.publish (inside rollout.update_weights)"]
    # update_weights is logged when its coroutine is made, the publish while it runs
    assert log == per_step * 3, log
