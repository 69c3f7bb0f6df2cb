"""Disk faults for tests: a full disk (a file-size limit) and an unwritable folder."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_with_file_size_limit(code: str, limit: int, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run Python `code` (from the repository root) in a child whose files cannot grow past
    `limit` bytes (RLIMIT_FSIZE): a write beyond it fails with EFBIG, as a full disk fails one
    with ENOSPC (Python ignores SIGXFSZ, so the write raises instead of killing the child). It
    needs no privileges and works as root, where a read-only folder stops nothing."""

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, env=os.environ,
                          preexec_fn=limit_files, capture_output=True, text=True, timeout=timeout)


def make_read_only(folder: Path) -> None:
    """chmod the folder read-only; skip the test where that stops nothing (root)."""
    folder.chmod(0o555)
    probe = folder / ".probe"
    try:
        probe.write_text("x")
    except PermissionError:
        return
    probe.unlink()
    folder.chmod(0o755)
    pytest.skip("running as root: a read-only folder does not stop writes (the file-size limit "
                "test covers the failed write)")
