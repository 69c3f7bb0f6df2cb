"""Checkpoints: atomic, newest complete one wins, rotation, buffer with partials restored."""

import json

import pytest

from buffers import Place, save_buffer
from rlkit.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    restore_buffer,
    resume_point,
    save_checkpoint,
)
from rlkit.config.schema import TrackingConfig
from rlkit.tracking import Tracker
from tests.buffers.helpers import make_buffer


def fake_trainer_save(path):
    (path / "weights.bin").write_bytes(b"w")


def test_save_rotate_and_resume_the_newest_complete(tmp_path):
    buf = make_buffer(n=2)
    (g,) = buf.acquire(1)
    g.samples[0].start_request()
    g.samples[0].append([1, 2, 3], [-0.1] * 3, 0)
    buf.requeue(g)
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, step, fake_trainer_save,
                        lambda path: save_buffer(buf, path), keep_last=2)
    assert [c.step for c in list_checkpoints(tmp_path)] == [4, 6]
    # an interrupted save (no state.json) is ignored
    (tmp_path / "checkpoints" / "step_000008" / "trainer").mkdir(parents=True)
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.step == 6 and (ckpt.trainer_dir / "weights.bin").is_file()
    fresh = make_buffer(n=2)
    assert restore_buffer(ckpt, fresh)
    (partial,) = fresh.queued(Place.PARTIAL)
    assert partial.samples[0].response_ids == [1, 2, 3]


def test_resume_never_refuses_an_existing_run(tmp_path):
    assert resume_point(tmp_path, "never") is None
    save_checkpoint(tmp_path, 1, 1, fake_trainer_save, None, keep_last=1)
    with pytest.raises(CheckpointError, match="already has checkpoints"):
        resume_point(tmp_path, "never")
    assert resume_point(tmp_path, "auto").step == 1


def test_tracker_writes_jsonl_without_nan(tmp_path):
    t = Tracker(TrackingConfig(wandb="disabled", progress=False), tmp_path, "r", {})
    t.log(0, {"rollout/reward_mean": float("nan"), "train/loss": 0.5})
    t.log_timeline(0, [{"worker": "w", "start": 0.0, "end": 1.0}])
    t.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["rollout/reward_mean"] is None and rows[0]["train/loss"] == 0.5
    assert json.loads((tmp_path / "timeline.jsonl").read_text())["step"] == 0


def test_tracker_wandb_offline_writes_a_local_run(tmp_path):
    t = Tracker(TrackingConfig(wandb="offline", progress=False), tmp_path, "r", {"a": 1})
    t.log(0, {"train/loss": 1.0})
    t.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))
