"""The sync loop's control flow with the real buffer, manager and policies over fake engines and
a recording trainer: versions advance, partials resume, accounting balances, metrics are
written, and a resumed run continues with the buffered partial groups."""

import asyncio
import json

import pytest

from buffers import ListPromptSource, Place
from buffers.source import records_from_token_lists
from rlkit.checkpoint import latest_checkpoint, list_checkpoints, restore_buffer
from rlkit.config import load_recipe
from rlkit.config.schema import TrackingConfig
from rlkit.driver.rollout_service import RolloutService
from rlkit.driver.sync import LoopState, run_sync
from rlkit.tracking import Tracker
from tests.manager.fakes import FakeEngines


class RecordingTrainer:
    def __init__(self):
        self.version, self.step_count, self.batches, self.synced = 0, 0, [], []

    def logprobs(self, batch, policy="current"):
        raise AssertionError("not needed with one optimizer step and no KL")

    def accumulate(self, batch):
        self.batches.append(batch)
        return {}

    def step(self):
        self.step_count += 1
        return {"train/loss": 0.1 * self.step_count}

    def sync_weights(self, engines, *, version=None, method=None, folder=None):
        self.synced.append((tuple(engines), version, method))
        self.version = version

    def save(self, path):
        (path / "trainer.json").write_text(json.dumps({"version": self.version}))


class LocalBox:
    """The rollout service driven synchronously, as the Ray actor handle is."""

    def __init__(self, service):
        self.s = service

    def run_step(self, version, final=False):
        return asyncio.run(self.s.run_step(version, final=final))

    def take(self, n):
        return self.s.take(n)

    def set_version(self, v):
        self.s.set_version(v)

    def save(self, path):
        self.s.save(path)


def tail(sample):
    return 150 if sample.group_id % 4 == 0 else 6  # every 4th prompt is long


def make_box(recipe):
    source = ListPromptSource(records_from_token_lists([[1, i] for i in range(40)]), shuffle=False)

    async def score(sample, group):
        return float(sample.slot)

    return LocalBox(RolloutService(recipe.rollout, source, FakeEngines(tail), score))


def recipe(tmp_path, steps):
    return load_recipe(None, [
        f"run.num_steps={steps}", "rollout.batch_size=3", "rollout.n_samples_per_prompt=2",
        "rollout.policy=partial", "rollout.over_provision=2.0", "rollout.max_staleness=20",
        "train.algorithm.off_policy_correction=tis", "train.micro_batch_size=2",
        "checkpoint.every_steps=2", f"run.output_dir={tmp_path}",
    ])


def test_sync_loop_trains_every_step_and_resumes_partials(tmp_path):
    r = recipe(tmp_path, 4)
    box, trainer = make_box(r), RecordingTrainer()
    tracker = Tracker(TrackingConfig(wandb="disabled", progress=False), tmp_path, "t", {})
    state = run_sync(r, box, trainer, ["http://e0", "http://e1"], tracker, tmp_path, LoopState())
    tracker.close()
    assert (state.step, state.version) == (4, 4)
    assert [v for _, v, _ in trainer.synced] == [1, 2, 3, 4]
    assert all(len(b) == 6 for b in trainer.batches)  # 3 groups x 2 samples
    assert [b.policy_version for b in trainer.batches] == [0, 1, 2, 3]
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
    run_sync(r, box, RecordingTrainer(), ["e"], tracker, tmp_path, LoopState())
    partial_before = {(g.group_id, g.tokens) for g in box.s.buffer.queued(Place.PARTIAL)}
    assert partial_before

    ckpt = latest_checkpoint(tmp_path)
    r2 = recipe(tmp_path, 3)
    resumed = make_box(r2)
    assert restore_buffer(ckpt, resumed.s.buffer)
    assert {(g.group_id, g.tokens) for g in resumed.s.buffer.queued(Place.PARTIAL)} == partial_before
    trainer = RecordingTrainer()
    state = run_sync(r2, resumed, trainer, ["e"], tracker, tmp_path,
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

    def take(self, n):
        groups = super().take(n)
        self.taken.append(sorted(g.group_id for g in groups))
        return groups


def test_tail_batching_checkpoints_its_long_queue_and_a_resumed_run_trains_it(tmp_path):
    tracker = Tracker(TrackingConfig(wandb="disabled", progress=False), tmp_path, "t", {})
    r = tail_recipe(tmp_path, 2)
    box = TakeRecorder(make_box(r).s)
    run_sync(r, box, RecordingTrainer(), ["e"], tracker, tmp_path, LoopState())
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
    run_sync(r, resumed, RecordingTrainer(), ["e"], tracker, tmp_path,
             LoopState(step=ckpt.step, version=ckpt.version))
    tracker.close()
    assert {0, 4} <= set(resumed.taken[0])
    assert resumed.s.buffer.stats()["balanced"]
