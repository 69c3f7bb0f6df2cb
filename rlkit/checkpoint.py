"""Checkpoints of a run: trainer state, the rollout buffer (partial rollouts included), step
and policy version, saved atomically; `run.resume: auto` continues from the newest.

    <run_dir>/checkpoints/step_000012/
        trainer/            written by the trainer (weights, optimizer, RNG)
        buffer.json.gz      every queue of the buffer, the data position, the version
        state.json          step, version; written last: a folder without it is incomplete

A checkpoint is written into a hidden sibling (`.step_000012.tmp`) and renamed into place only
once complete, so a crash, a full disk or an unwritable folder never touches the checkpoints
already there: the error names the path, and the previous checkpoint stays the one to resume.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rlkit.buffers import BufferStateError, RolloutBuffer, load_buffer
from rlkit.common.errors import CheckpointError, find_user_error
from rlkit.buffers.persistence import fsync_dir

STATE = "state.json"
TRAINER_DIR = "trainer"
BUFFER_FILE = "buffer.json.gz"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int  # steps completed
    version: int  # policy version of the saved weights

    @property
    def trainer_dir(self) -> Path:
        return self.path / TRAINER_DIR

    @property
    def buffer_file(self) -> Path:
        return self.path / BUFFER_FILE


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Checkpoint]:
    """Complete checkpoints, oldest first."""
    out = []
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return out
    for d in sorted(root.glob("step_*")):
        state_file = d / STATE
        if not state_file.is_file():
            continue  # interrupted while saving
        try:
            state = json.loads(state_file.read_text())
            out.append(Checkpoint(d, int(state["step"]), int(state["version"])))
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{state_file}: unreadable checkpoint state ({e})") from None
    return sorted(out, key=lambda c: c.step)


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(
    run_dir: Path,
    step: int,
    version: int,
    save_trainer: Callable[[Path], None],
    save_buffer: Callable[[Path], None] | None,
    keep_last: int,
) -> Checkpoint:
    """Write a checkpoint; the writers get the folder (trainer) or file (buffer) to fill.
    The buffer may live in another process (the rollout actor), hence callbacks."""
    root = checkpoints_dir(run_dir)
    final = root / f"step_{step:06d}"
    tmp = root / f".step_{step:06d}.tmp"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / TRAINER_DIR).mkdir(parents=True)
        save_trainer(tmp / TRAINER_DIR)
        if save_buffer is not None:
            save_buffer(tmp / BUFFER_FILE)
        _write_synced(tmp / STATE, json.dumps({"step": step, "version": version}))
        if final.exists():  # the same step saved again (a resumed run): swap, never delete first
            old = root / f".step_{step:06d}.old"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        fsync_dir(root)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = find_user_error(e) or getattr(e, "cause", None) or e  # unwrapped from Ray's
        if isinstance(cause, (OSError, CheckpointError, BufferStateError)):
            raise _write_error(run_dir, step, tmp, cause) from None
        raise  # not a write failure (a dead trainer, a bug): as it is
    for old_ckpt in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old_ckpt.path, ignore_errors=True)
    return Checkpoint(final, step, version)


def _write_error(run_dir: Path, step: int, tmp: Path, cause: BaseException) -> CheckpointError:
    """What a failed save says: where, why (the errno text, or the writer's own message) and
    which checkpoint a resume would use instead."""
    if isinstance(cause, OSError):
        why = cause.strerror or str(cause)
        why = f"{cause.filename}: {why}" if cause.filename else why
    else:
        why = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
    try:
        previous = latest_checkpoint(run_dir)
    except CheckpointError:
        previous = None
    kept = (f"the previous checkpoint ({previous.path}, step {previous.step}) is intact"
            if previous is not None else "no earlier checkpoint exists")
    return CheckpointError(
        f"cannot write the checkpoint of step {step} into {tmp.parent}: {why}. Free disk space or "
        f"make the folder writable; {kept}"
    )


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def restore_buffer(ckpt: Checkpoint, buffer: RolloutBuffer) -> bool:
    """Load the checkpoint's buffer into a fresh buffer; False if it saved none."""
    if not ckpt.buffer_file.is_file():
        return False
    load_buffer(buffer, ckpt.buffer_file)
    return True


def resume_point(run_dir: Path, resume: str) -> Checkpoint | None:
    """The checkpoint to continue from, per `run.resume`."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None and resume == "never":
        raise CheckpointError(
            f"{run_dir} already has checkpoints (newest: step {ckpt.step}); set run.resume=auto "
            "to continue it, or choose another run.name"
        )
    if resume != "auto":
        return None
    if ckpt is not None:
        _check_parts_agree(ckpt)
    return ckpt


def _check_parts_agree(ckpt: Checkpoint) -> None:
    """The trainer state inside a checkpoint is the one its state.json describes (a folder put
    together from two checkpoints would resume weights of one step with the data of another)."""
    meta_file = ckpt.trainer_dir / "meta.json"
    if not meta_file.is_file():
        return  # the trainer's own load names what is missing
    try:
        version = json.loads(meta_file.read_text())["version"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{meta_file}: unreadable trainer checkpoint metadata ({e})") from None
    if version != ckpt.version:
        raise CheckpointError(
            f"{meta_file}: trainer weights of policy version {version}, but {ckpt.path / STATE} "
            f"says version {ckpt.version}: the folder mixes two checkpoints"
        )
