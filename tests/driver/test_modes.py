"""The driver modes' loops with the real buffer, manager, policies and per-rank training path
over fake engines and a recording trainer: versions advance, partials resume, accounting
balances, metrics are written, a resumed run continues with the buffered partial groups;
stream trains the same batches as sync; async with bound 0 is sync step for step, and with
bound 1 overlaps and never trains a token more than one version old."""

import asyncio
import json
import time

import pytest

from rlkit.buffers import ListPromptSource, Place, StalenessBoundError
from rlkit.buffers.source import records_from_token_lists
from rlkit.checkpoint import latest_checkpoint, list_checkpoints, restore_buffer
from rlkit.config import load_recipe
from rlkit.config.schema import TrackingConfig
from rlkit.driver.local import run_local
from rlkit.driver.loop import LoopState, step_recorder
from rlkit.driver.modes import MODES
from rlkit.driver.rollout_service import RolloutService
from rlkit.sim.clock import VirtualTimeLoop
from rlkit.tracking import Tracker
from tests.manager.fakes import FakeEngines


class RecordingTrainer:
    def __init__(self, engines=None):
        self.version, self.step_count, self.batches, self.synced = 0, 0, [], []
        self.engines = engines
        self.step_s = 0.05
        self.steps = []  # per optimizer step: the sample indices accumulated, with versions

    def logprobs(self, batch, policy="current"):
        raise AssertionError("not needed with one optimizer step and no KL")

    def accumulate(self, batch):
        self.batches.append(batch)
        return {}

    def step(self):
        time.sleep(self.step_s)  # (in a thread: generation goes on meanwhile in async mode)
        self.step_count += 1
        done, self.batches = self.batches, []
        self.steps.append(sorted((s.index, s.min_version, s.max_version, b.policy_version)
                                 for b in done for s in b.samples))
        return {"train/loss": 0.1 * self.step_count}

    def publish_weights(self, update):
        self.synced.append((update.engines, update.version, update.method))
        self.version = update.version
        if self.engines is not None:  # the engines now generate with these weights
            self.engines.weight_version = update.version

    def save(self, path):
        (path / "trainer.json").write_text(json.dumps({"version": self.version}))


class LocalBox:
    """The rollout service, and a synchronous way to run one step of it."""

    def __init__(self, service):
        self.s = service

    def run_step(self, version, final=False):
        return asyncio.run(self.s.run_step(version, final=final))

    def take(self, n):
        return asyncio.run(self.s.take(n)).refs


def drive(r, box, trainer, tracker, run_dir, state=None):
    """Run recipe r's mode over the box's service and the trainer."""
    on_step = step_recorder(r, tracker, box.s, trainer, run_dir)
    return run_local(r, box.s, trainer, on_step, state)


def tail(sample):
    return 150 if sample.group_id % 4 == 0 else 6  # every 4th prompt is long


def make_box(recipe):
    source = ListPromptSource(records_from_token_lists([[1, i] for i in range(40)]), shuffle=False)

    async def score(sample, group):
        return float(sample.slot)

    return LocalBox(RolloutService.from_config(recipe.rollout, source, FakeEngines(tail), score))


def recipe(tmp_path, steps):
    return load_recipe(None, [
        f"run.num_steps={steps}", "rollout.batch_size=3", "rollout.n_samples_per_prompt=2",
        "rollout.policy=partial", "rollout.partial.over_provision=2.0", "rollout.max_staleness=20",
        "train.algorithm.off_policy_correction=tis", "train.micro_batch_size=2",
        "checkpoint.every_steps=2", f"run.output_dir={tmp_path}",
    ])


def test_sync_loop_trains_every_step_and_resumes_partials(tmp_path):
    r = recipe(tmp_path, 4)
    box, trainer = make_box(r), RecordingTrainer()
    tracker = Tracker(TrackingConfig(wandb="disabled", progress=False), tmp_path, "t", {})
    state = drive(r, box, trainer, tracker, tmp_path)
    tracker.close()
    assert (state.step, state.version) == (4, 4)
    assert [v for _, v, _ in trainer.synced] == [1, 2, 3, 4]
    assert [len(st) for st in trainer.steps] == [6] * 4  # 3 groups x 2 samples
    assert [{v for *_, v in st} for st in trainer.steps] == [{0}, {1}, {2}, {3}]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert rows[0]["rollout/groups_carried_over"] > 0
    assert any(row["rollout/groups_resumed"] > 0 for row in rows[1:])
    assert all(row["rollout/tokens_discarded"] == 0 for row in rows)
    assert all(row["buffer/balanced"] for row in rows)
    assert (tmp_path / "timeline.jsonl").read_text().count("\n") > 0
    assert latest_checkpoint(tmp_path).step == 4


def test_a_resumed_run_continues_with_the_same_buffered_partials(tmp_path):
    r = recipe(tmp_path, 2)
    box = make_box(r)
    tracker = Tracker(TrackingConfig(wandb="disabled", progress=False), tmp_path, "t", {})
    drive(r, box, RecordingTrainer(), tracker, tmp_path)
    partial_before = {(g.group_id, g.tokens) for g in box.s.buffer.queued(Place.PARTIAL)}
    assert partial_before

    ckpt = latest_checkpoint(tmp_path)
    r2 = recipe(tmp_path, 3)
    resumed = make_box(r2)
    assert restore_buffer(ckpt, resumed.s.buffer)
    assert {(g.group_id, g.tokens) for g in resumed.s.buffer.queued(Place.PARTIAL)} == partial_before
    trainer = RecordingTrainer()
    state = drive(r2, resumed, trainer, tracker, tmp_path,
                  LoopState(step=ckpt.step, version=ckpt.version))
    tracker.close()
    assert state.step == 3
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["rollout/groups_resumed"] >= 1  # the restored partials went first
    assert resumed.s.buffer.stats()["balanced"]


def test_a_short_take_takes_nothing(tmp_path):
    box = make_box(recipe(tmp_path, 1))
    box.run_step(0)
    ready = box.s.buffer.stats()["ready"]
    with pytest.raises(RuntimeError, match="nothing was taken"):
        box.take(ready + 1)
    stats = box.s.buffer.stats()
    assert stats["ready"] == ready and stats["trained"] == 0 and stats["balanced"]


def tail_recipe(tmp_path, steps, *extra):
    return load_recipe(None, [
        f"run.num_steps={steps}", "rollout.batch_size=3", "rollout.n_samples_per_prompt=2",
        "rollout.policy=tail_batching", "rollout.tail_batching.eta_prompts=2.0",
        "rollout.tail_batching.long_round_size=6", "train.micro_batch_size=2",
        "checkpoint.every_steps=1", f"run.output_dir={tmp_path}", *extra,
    ])


class TakeRecorder(LocalBox):
    def __init__(self, service):
        super().__init__(service)
        self.taken = []

        orig = service.take

        async def take(n):
            handed = await orig(n)
            self.taken.append(sorted(g.group_id for g in handed.refs))
            return handed

        service.take = take


def test_tail_batching_checkpoints_its_long_queue_and_a_resumed_run_trains_it(tmp_path):
    tracker = Tracker(TrackingConfig(wandb="disabled", progress=False), tmp_path, "t", {})
    r = tail_recipe(tmp_path, 2)
    box = TakeRecorder(make_box(r).s)
    drive(r, box, RecordingTrainer(), tracker, tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # step 1 is a short round (its long prompts 0 and 4 are deferred); step 2, the run's last,
    # drains the long queue although it holds fewer than long_round_size
    assert [row["rollout/round"] for row in rows] == ["short", "long"]
    assert rows[0]["rollout/prompts_deferred"] == 2 and rows[0]["rollout/long_queue"] == 2
    assert rows[1]["rollout/long_queue"] == 0 and rows[1]["rollout/long_round"] == 1.0
    assert {0, 4} <= set(box.taken[1])
    # the timeline's step lines say the round (rlkit plot timeline draws them apart)
    heads = [json.loads(x) for x in (tmp_path / "timeline.jsonl").read_text().splitlines()
             if '"kind": "step"' in x]
    assert [(h["step"], h["policy"], h["round"]) for h in heads] == [
        (1, "tail_batching", "short"), (2, "tail_batching", "long")]

    # the checkpoint after step 1 holds the long queue; resuming from it trains those prompts
    ckpt = next(c for c in list_checkpoints(tmp_path) if c.step == 1)
    resumed = TakeRecorder(make_box(r).s)
    assert restore_buffer(ckpt, resumed.s.buffer)
    assert sorted(g.group_id for g in resumed.s.buffer.queued(Place.LONG)) == [0, 4]
    drive(r, resumed, RecordingTrainer(), tracker, tmp_path,
          LoopState(step=ckpt.step, version=ckpt.version))
    tracker.close()
    assert {0, 4} <= set(resumed.taken[0])
    assert resumed.s.buffer.stats()["balanced"]


def mode_recipe(tmp_path, mode, *extra, steps=4):
    return load_recipe(None, [
        f"mode={mode}", f"run.num_steps={steps}", "rollout.batch_size=3",
        "rollout.n_samples_per_prompt=2", "train.micro_batch_size=2", "checkpoint.every_steps=0",
        f"run.output_dir={tmp_path}", "tracking.progress=false", "tracking.wandb=disabled", *extra,
    ])


def run_mode(tmp_path, mode, *extra, steps=4, length=tail, trainer_cls=None, prompts=40,
             virtual=False):
    """The real loop on fake engines; `trainer_cls` (default RecordingTrainer) records what it
    was given. `virtual`: on a virtual-time loop, where the fakes' ticks are timers that no
    busy machine can delay, so two runs that should generate the same samples do (only for
    modes where nothing generates while the trainer's thread works: its real seconds would let
    the virtual clock run on)."""
    r = mode_recipe(tmp_path / mode, mode, *extra, steps=steps)
    engines = FakeEngines(length)
    source = ListPromptSource(records_from_token_lists([[1, i] for i in range(prompts)]), shuffle=False)

    async def score(sample, group):
        return float(sample.slot)

    service = RolloutService.from_config(r.rollout, source, engines, score)
    trainer = (trainer_cls or RecordingTrainer)(engines)
    tracker = Tracker(r.tracking, tmp_path / mode, "t", {})
    state = run_local(r, service, trainer, step_recorder(r, tracker, service, trainer, tmp_path / mode),
                      loop_factory=VirtualTimeLoop if virtual else None)
    tracker.close()
    rows = [json.loads(x) for x in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
    return state, trainer, service, rows


def test_the_modes_registry_is_the_recipe_s_list():
    from rlkit.config.schema import Recipe

    assert set(MODES) == {"sync", "stream", "async"}
    assert Recipe.model_fields["mode"].annotation.__args__ == tuple(MODES)


@pytest.mark.parametrize("policy", [[], ["rollout.policy=partial", "rollout.max_staleness=20",
                                         "train.algorithm.off_policy_correction=tis"]])
def test_stream_trains_the_same_batches_as_sync(tmp_path, policy):
    _, sync, _, sync_rows = run_mode(tmp_path, "sync", *policy, virtual=True)
    state, stream, service, rows = run_mode(tmp_path, "stream", *policy, virtual=True)
    assert (state.step, state.version) == (4, 4)
    assert stream.steps == sync.steps  # same samples, same versions, step by step
    assert [v for _, v, _ in stream.synced] == [1, 2, 3, 4]
    assert all(r["buffer/balanced"] for r in rows)
    assert service.buffer.stats()["balanced"]
    # a group reaches the trainer while the step still generates: micro-batches are
    # accumulated before the step's end (sync accumulates only after it)
    assert [r["batch/groups"] for r in rows] == [3] * 4


def test_async_with_bound_zero_is_sync_step_for_step(tmp_path):
    _, sync, _, sync_rows = run_mode(tmp_path, "sync", "rollout.max_staleness=0", virtual=True)
    _, asyn, _, rows = run_mode(tmp_path, "async", "rollout.max_staleness=0", virtual=True)
    assert asyn.steps == sync.steps
    assert asyn.synced == sync.synced
    assert [r["async/overlapped"] for r in rows] == [0.0] * 4
    keys = ("rollout/groups_completed", "batch/reward_mean", "buffer/trained", "version")
    assert [[r.get(k) for k in keys] for r in rows] == [[r.get(k) for k in keys] for r in sync_rows]


def slow_tail(sample):
    return 400 if sample.group_id % 4 == 0 else 30


@pytest.mark.parametrize("policy", ["sync", "partial", "tail_batching"])
def test_async_with_bound_one_overlaps_and_no_token_is_more_than_one_version_old(tmp_path, policy):
    extra = [f"rollout.policy={policy}", "rollout.max_staleness=1",
             "train.algorithm.off_policy_correction=tis"]
    if policy == "tail_batching":
        extra += ["rollout.tail_batching.long_round_size=3"]
    state, trainer, service, rows = run_mode(tmp_path, "async", *extra, steps=5, length=slow_tail)
    assert (state.step, state.version) == (5, 5)
    assert [r["async/overlapped"] for r in rows] == [1.0] * 4 + [0.0]
    for st in trainer.steps:  # every trained token at most one version behind the trainer
        assert all(v - lo <= 1 and hi <= v for _, lo, hi, v in st)
    # generation overlapped training: some step trained tokens of two versions or one old
    assert any(v - lo == 1 for st in trainer.steps for _, lo, _, v in st)
    stats = service.buffer.stats()
    assert stats["balanced"] and all(r["buffer/balanced"] for r in rows)
    assert stats["producer_version"] == stats["version"] == 5


def test_the_buffer_refuses_a_producer_past_the_bound():
    from rlkit.buffers import RolloutBuffer

    buf = RolloutBuffer(ListPromptSource(records_from_token_lists([[1]]), shuffle=False),
                        n_samples_per_prompt=1, max_staleness=1)
    assert buf.admits(1) and not buf.admits(2)
    buf.begin_production(1)  # one ahead: admitted
    with pytest.raises(StalenessBoundError, match="runs 2 versions ahead"):
        buf.begin_production(2)
    buf.set_version(1)
    buf.set_producer_version(1)
    assert buf.admits(2)


def test_async_needs_an_off_policy_correction_only_past_bound_zero(tmp_path):
    from rlkit.config.loader import RecipeError

    with pytest.raises(RecipeError, match="mode=async with rollout.max_staleness > 0"):
        load_recipe(None, ["mode=async", "rollout.max_staleness=1"])
    r = load_recipe(None, ["mode=async", "rollout.max_staleness=0"])
    assert r.train.weight_sync.pause_mode == "retract"  # auto: in-flight requests continue
    assert load_recipe(None, []).train.weight_sync.pause_mode == "abort"


class Publisher:
    """The trainer as the rollout side's WeightPublisher: records each update; `fail(update)`
    may raise (an engine that died during the publish)."""

    def __init__(self, fail=None):
        self.updates, self.fail = [], fail

    async def publish(self, update):
        self.updates.append(update)
        if self.fail is not None:
            self.fail(update)
        return {"sync/bytes": 1.0}


class Health:
    """rollout.health as the service sees it around an update: held, probed, admitting."""

    def __init__(self, service, serving):
        self.serving, self.awaiting_weights, self.held, self.admitted, self.sweeps = serving, [], [], [], 0
        service.manager.health = self
        service.engines_now = lambda: (list(self.serving), list(self.awaiting_weights))

    def hold(self, held):
        self.held.append(held)

    async def admit(self, urls):
        self.admitted += urls
        self.awaiting_weights = [u for u in self.awaiting_weights if u not in urls]

    async def sweep(self):
        self.sweeps += 1
        lost = int("b" in self.serving)
        self.serving = ["a"]
        return lost


def service_of(tmp_path):
    return make_box(recipe(tmp_path, 1)).s


def test_a_weight_sync_with_every_engine_lost_still_moves_the_trainer_s_version(tmp_path):
    """With no engine serving, the sync still tells the trainer its weights' version: the
    checkpoint written at that step (an outage stops the run there) would otherwise pair the
    step's state with the previous version's number and be refused on resume."""
    service = service_of(tmp_path)
    Health(service, [])
    publisher = Publisher()
    asyncio.run(service.update_weights(3, publisher))
    assert [(u.version, u.engines) for u in publisher.updates] == [(3, ())]
    assert service.buffer.version == 3


@pytest.mark.parametrize("taken_out_by", ["the sweep", "the monitor"])
def test_a_weight_sync_that_meets_a_dead_engine_goes_on_with_the_engines_left(tmp_path, taken_out_by):
    """An engine killed during a weight sync fails it. Whoever takes the dead engine out of
    service (the sweep the failure asks for, or the health monitor just before it: the race
    that ended 1 run in 11 with WeightSyncError), the sync goes on with the engines left and
    the restarted engine is admitted once it holds the weights. The same engines failing again
    is not an engine lost: that error is raised; nor is the trainer's own death retried."""
    from rlkit.common.weight_update import PublisherFailed

    service = service_of(tmp_path)
    health = Health(service, ["a", "b"])

    def b_dies(update):
        if "b" in update.engines:  # b died during this sync
            if taken_out_by == "the monitor":
                health.serving = ["a"]
            health.awaiting_weights = ["b2"]  # rollout.health restarts it
            raise RuntimeError("update_weights_from_disk failed on 1 engine(s): b")

    publisher = Publisher(b_dies)
    metrics = asyncio.run(service.update_weights(4, publisher))
    assert [list(u.engines) for u in publisher.updates] == [["a", "b"], ["a", "b2"]]
    assert health.sweeps == 1 and service.buffer.version == 4 and health.admitted == ["b2"]
    assert health.held == [True, False]  # probes ask only for an answer during the sync
    assert metrics["sync/bytes"] == 1.0 and metrics["sync/paused_seconds"] >= 0

    def own_error(update):
        raise RuntimeError("the trainer's own error")

    def rank_died(update):
        raise PublisherFailed("trainer rank 1 died", 1)

    for fail, sweeps in ((own_error, 1), (rank_died, 0)):
        service = service_of(tmp_path)
        health = Health(service, ["a"])
        broken = Publisher(fail)
        with pytest.raises(RuntimeError, match="own error|rank 1 died"):
            asyncio.run(service.update_weights(4, broken))
        assert len(broken.updates) == 1 and health.sweeps == sweeps
        assert service.buffer.version == 0 and health.held == [True, False]


class ColocatedTrainer(RecordingTrainer):
    """Records the turns: the engines sleep before training and wake at the push."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def step(self):
        self.log.append("train")
        return super().step()

    def publish_weights(self, update):
        assert update.colocated
        self.log.append("wake")
        super().publish_weights(update)
        return {"colocate/trainer_offloaded_bytes": 1.0}

    def take_device(self):
        self.log.append("onload")
        return {}

    def free_device(self):
        return {}


class SleepLog:
    """The rollout side's engine control, recording the sleeps (StatelessEngines otherwise)."""

    def __init__(self, log):
        from rlkit.rollout.engine_updates import StatelessEngines

        self.log, self.state = log, StatelessEngines()
        self.open, self.close, self.fail, self.forget = (self.state.open, self.state.close,
                                                        self.state.fail, self.state.forget)

    def release(self, urls):
        self.log.append("sleep")
        self.state.release(urls)
        return {"colocate/engine_freed_bytes": 2.0}


@pytest.mark.parametrize("policy", ["partial", "tail_batching"])
def test_colocated_engines_sleep_for_every_training_and_nothing_generates_while_asleep(tmp_path, policy):
    """Colocated (sync mode): the first push frees the trainer for the first rollout; then each
    step is rollout -> engines sleep -> train -> wake with the new weights, and no request is
    sent while the engines sleep. Partial groups are parked with their tokens at the step's end
    and resumed after the wake; the accounting balances."""
    r = load_recipe(None, [
        "run.num_steps=3", "rollout.batch_size=3", "rollout.n_samples_per_prompt=2",
        f"rollout.policy={policy}", "rollout.partial.over_provision=2.0", "rollout.max_staleness=20",
        "train.algorithm.off_policy_correction=tis", "train.micro_batch_size=2",
        "cluster.placement=colocated", f"run.output_dir={tmp_path}",
    ])
    log: list[str] = []
    box = make_box(r)
    generate = box.s.engines.generate

    async def logged(*args, **kwargs):
        log.append("generate")
        return await generate(*args, **kwargs)

    box.s.engines.generate = logged
    box.s.updates = SleepLog(log)
    trainer = ColocatedTrainer(log)
    tracker = Tracker(TrackingConfig(wandb="disabled", progress=False), tmp_path, "t", {})
    state = drive(r, box, trainer, tracker, tmp_path)
    tracker.close()
    assert (state.step, state.version) == (3, 3)
    turns = [e for i, e in enumerate(log) if e != "generate" or log[i - 1] != "generate"]
    assert turns == ["wake"] + ["generate", "sleep", "onload", "train", "wake"] * 3
    assert [v for _, v, _ in trainer.synced] == [0, 1, 2, 3]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(row["buffer/balanced"] for row in rows)
    assert all(row["colocate/engine_freed_bytes"] == 2.0 and row["colocate/trainer_offloaded_bytes"] == 1.0
               and row["colocate/sleep_seconds"] >= 0 and row["colocate/wake_seconds"] >= 0 for row in rows)
    if policy == "partial":
        assert rows[0]["rollout/groups_carried_over"] > 0
        assert any(row["rollout/groups_resumed"] > 0 for row in rows[1:])


@pytest.mark.parametrize("mode", ["stream", "async"])
def test_colocated_refuses_modes_that_generate_while_training(mode):
    with pytest.raises(ValueError, match=f"cannot run mode '{mode}'.*Use mode 'sync'"):
        load_recipe(None, [f"mode={mode}", "cluster.placement=colocated",
                           "train.algorithm.off_policy_correction=tis"])


def test_engines_put_to_sleep_while_one_dies_go_on_asleep_without_it(tmp_path):
    """Colocated: an engine that dies as it is told to sleep fails the call; the engines left
    are put to sleep (the one already asleep is left as it is), the restarted one is included,
    and the probes stay held (asleep engines queue generations) until the update wakes them."""
    from rlkit.rollout.engine_updates import EngineUpdates

    class Engine:
        def __init__(self, url):
            self.url = url

        def release_memory(self, tags=None):
            slept.append(self.url)
            if self.url == "b":
                health.awaiting_weights = ["b2"]
                raise RuntimeError("connection refused")
            return {"freed_bytes": {"weights": 5}}

        def pause(self, mode): calls.append(("pause", self.url))
        def flush_cache(self): calls.append(("flush", self.url))
        def resume_memory(self, tags=None): calls.append(("resume", self.url, tuple(tags))); return {}
        def continue_generation(self): calls.append(("continue", self.url))

    slept, calls = [], []
    service = service_of(tmp_path)
    health = Health(service, ["a", "b"])
    service.updates = EngineUpdates(method="disk", control=Engine)
    metrics = asyncio.run(service.sleep_engines())
    assert slept == ["a", "b", "b2"] and health.sweeps == 1  # a, asleep already, is left asleep
    assert health.held == [True]  # released by the update that wakes them
    assert metrics["colocate/engines_slept"] == 1.0 and metrics["colocate/engine_freed_bytes"] == 5.0

    # The wake: b2 was put to sleep above, so it wakes in stages like a; nothing pauses
    publisher = Publisher()
    asyncio.run(service.update_weights(1, publisher, colocated=True))
    assert publisher.updates[0].waking == {"a", "b2"}
    assert not publisher.updates[0].flushes("a") and not publisher.updates[0].flushes("b2")
    assert [c[0] for c in calls] == ["resume"] * 4  # weights, then KV cache, for each
    assert health.held == [True, True, False] and health.admitted == ["b2"]
