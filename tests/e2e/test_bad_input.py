"""`rlkit train` with bad input: one line naming what and where, exit code 2, nothing left
running (the prompts and reward load while the engines start, so it fails early)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_train_tiny import processes_with

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_missing_prompt_data_is_one_clear_line_and_leaves_nothing_running(tmp_path):
    env = {**os.environ, "RLKIT_CACHE": str(tmp_path / "cache")}
    missing = tmp_path / "no-such-prompts.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "rlkit.cli", "train", str(ROOT / "recipes" / "grpo_tiny_ci.yaml"),
         f"run.output_dir={tmp_path / 'runs'}", f"data.path={missing}", "tracking.progress=false"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"rlkit: {missing}: prompt data not found" in done.stderr
    assert "Traceback" not in done.stderr
    assert processes_with(str(tmp_path / "cache")) == []
