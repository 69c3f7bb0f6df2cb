"""Checkpoints: atomic, newest complete one wins, rotation, buffer with partials restored; a full
disk or an unwritable folder is an error naming the path and leaves the previous checkpoint
loadable; a resumed run's per-step files are cut back to its checkpoint."""

import json

import pytest

from rlkit.buffers import Place, save_buffer
from rlkit.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    restore_buffer,
    resume_point,
    save_checkpoint,
)
from rlkit.config.schema import TrackingConfig
from rlkit.tracking import Tracker, rewind
from tests.buffers.helpers import buffer_with_a_partial, make_buffer
from tests.faults import make_read_only, run_with_file_size_limit


def fake_trainer_save(path):
    (path / "weights.bin").write_bytes(b"w")


def test_save_rotate_and_resume_the_newest_complete(tmp_path):
    buf = buffer_with_a_partial()
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
    t.log(2, {"train/loss": 0.5})
    t.log_eval(1, {"eval/held/greedy/pass@1": 0.5})  # async: step 1's eval ends during step 2
    t.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def _assert_step_1_intact(run_dir):
    ckpt = latest_checkpoint(run_dir)
    assert ckpt.step == 1 and (ckpt.trainer_dir / "weights.bin").read_bytes() == b"w"
    fresh = make_buffer(n=2)
    assert restore_buffer(ckpt, fresh)
    (partial,) = fresh.queued(Place.PARTIAL)
    assert partial.samples[0].response_ids == [1, 2, 3]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000001"]  # no leftovers


def test_a_full_disk_names_the_path_and_keeps_the_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 1, 1, fake_trainer_save, lambda p: save_buffer(buffer_with_a_partial(), p),
                    keep_last=2)
    # step 2's trainer writes 1 MiB where files may not exceed 64 KiB (EFBIG, as a full disk)
    done = run_with_file_size_limit(f"""
        from pathlib import Path
        from rlkit.checkpoint import CheckpointError, save_checkpoint
        def big(path):
            (path / "weights.bin").write_bytes(b"w" * (1 << 20))
        try:
            save_checkpoint(Path({str(tmp_path)!r}), 2, 2, big, None, keep_last=2)
        except CheckpointError as e:
            print(e)
        else:
            raise SystemExit("saved")
    """, limit=64 * 1024)
    assert done.returncode == 0, done.stdout + done.stderr
    message = done.stdout
    assert f"cannot write the checkpoint of step 2 into {tmp_path / 'checkpoints'}: File too large" in message
    assert "step_000001, step 1) is intact" in message
    _assert_step_1_intact(tmp_path)


def test_a_full_disk_while_writing_the_buffer_names_the_buffer_file(tmp_path):
    save_checkpoint(tmp_path, 1, 1, fake_trainer_save, lambda p: save_buffer(buffer_with_a_partial(), p),
                    keep_last=2)
    done = run_with_file_size_limit(f"""
        from pathlib import Path
        from rlkit.buffers import save_buffer
        from rlkit.checkpoint import CheckpointError, save_checkpoint
        from tests.buffers.helpers import make_buffer
        import random
        buf = make_buffer(n=2, rows=20)
        rng = random.Random(0)
        for g in buf.acquire(10):  # parked groups with 20k random tokens: far over the limit
            g.samples[0].start_request()
            g.samples[0].append([rng.randrange(50000) for _ in range(2000)], [-0.5] * 2000, 0)
            buf.requeue(g)
        try:
            save_checkpoint(Path({str(tmp_path)!r}), 2, 2, lambda p: None,
                            lambda p: save_buffer(buf, p), keep_last=2)
        except CheckpointError as e:
            print(e)
        else:
            raise SystemExit("saved")
    """, limit=16 * 1024)
    assert done.returncode == 0, done.stdout + done.stderr
    assert str(tmp_path / "checkpoints" / ".step_000002.tmp" / "buffer.json.gz") in done.stdout
    _assert_step_1_intact(tmp_path)


def test_an_unwritable_checkpoint_folder_names_it_and_keeps_the_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 1, 1, fake_trainer_save, lambda p: save_buffer(buffer_with_a_partial(), p),
                    keep_last=2)
    make_read_only(tmp_path / "checkpoints")
    try:
        with pytest.raises(CheckpointError) as e:
            save_checkpoint(tmp_path, 2, 2, fake_trainer_save, None, keep_last=2)
    finally:
        (tmp_path / "checkpoints").chmod(0o755)
    assert "Permission denied" in str(e.value)
    assert str(tmp_path / "checkpoints" / ".step_000002.tmp") in str(e.value)
    _assert_step_1_intact(tmp_path)


def test_a_writer_that_fails_otherwise_is_not_called_a_write_error(tmp_path):
    def broken(path):
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        save_checkpoint(tmp_path, 1, 1, broken, None, keep_last=2)
    assert list((tmp_path / "checkpoints").iterdir()) == []  # the temporary folder is gone


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    save_checkpoint(tmp_path, 1, 1, fake_trainer_save, None, keep_last=2)
    save_checkpoint(tmp_path, 1, 1, lambda p: (p / "other.bin").write_bytes(b"o"), None, keep_last=2)
    ckpt = latest_checkpoint(tmp_path)
    assert [f.name for f in ckpt.trainer_dir.iterdir()] == ["other.bin"]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000001"]


def test_rewind_drops_the_rows_of_steps_after_the_checkpoint(tmp_path):
    t = Tracker(TrackingConfig(wandb="disabled", progress=False), tmp_path, "r", {})
    for step in (1, 2, 3):
        t.log(step, {"train/loss": 0.5})
        t.log_timeline(step, [{"worker": "w", "start": 0.0, "end": 1.0}], header={"round": "short"})
        t.log_groups(step, [{"group_id": 10 * step}, {"group_id": 10 * step + 1}])
    t.close()
    with open(tmp_path / "groups.jsonl", "a") as f:
        f.write('{"step": 3, "group_i')  # a line cut short by a crash
    rewind(tmp_path, 2)
    for name in ("metrics.jsonl", "timeline.jsonl", "groups.jsonl"):
        steps = [json.loads(x)["step"] for x in (tmp_path / name).read_text().splitlines()]
        assert steps and max(steps) == 2 and 1 in steps, name
    assert len((tmp_path / "groups.jsonl").read_text().splitlines()) == 4
    rewind(tmp_path, 0)
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_checkpoint_whose_trainer_state_is_from_another_step_is_refused(tmp_path):
    def trainer_of_version(v):
        return lambda path: (path / "meta.json").write_text(json.dumps({"version": v}))

    save_checkpoint(tmp_path, 2, 2, trainer_of_version(2), None, keep_last=2)
    assert resume_point(tmp_path, "auto").step == 2
    save_checkpoint(tmp_path, 3, 3, trainer_of_version(2), None, keep_last=2)
    with pytest.raises(CheckpointError, match=r"step_000003/trainer/meta.json: trainer weights of "
                                              r"policy version 2, but .*step_000003/state.json says version 3"):
        resume_point(tmp_path, "auto")
