"""Buffer state files: gzip-compressed JSON, written atomically, refused clearly when wrong.

gzip's CRC catches truncation and bit rot; the state's own header (format, version,
fingerprint) catches a file from another program or another run set-up.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
import zlib
from pathlib import Path

from rlkit.buffers.buffer import BufferStateError, RolloutBuffer


def save_buffer(buffer: RolloutBuffer, path: str | os.PathLike) -> Path:
    """Write the buffer's state to `path` atomically: into a temporary sibling, then renamed over
    it, so a crash or a full disk never leaves half a file (nor harms the file already there).
    An unwritable folder or a full disk is a BufferStateError naming the path."""
    path = Path(path)
    data = json.dumps(buffer.state_dict(), separators=(",", ":")).encode()
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
            gz.write(data)
            gz.flush()
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise BufferStateError(f"{path}: cannot write the buffer state ({e.strerror or e})") from None
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_buffer(buffer: RolloutBuffer, path: str | os.PathLike) -> None:
    """Restore `buffer` (fresh, same set-up) from a file written by save_buffer."""
    path = Path(path)
    if not path.is_file():
        raise BufferStateError(f"{path}: buffer state file not found")
    try:
        with gzip.open(path, "rb") as f:
            state = json.loads(f.read())
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BufferStateError(f"{path}: corrupt or not a buffer state file ({e})") from None
    try:
        buffer.load_state_dict(state)
    except BufferStateError as e:
        raise BufferStateError(f"{path}: {e}") from None


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename into `path` durable (a power cut after it keeps the new name): the one
    helper the run's and the trainer's checkpoints share."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
