"""Ctrl-C during a run: everything shuts down, no process or port is left behind, and the run
can be resumed from its last checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_train_tiny import processes_with

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.integration]


def listening_ports(pids: set[int]) -> set[int]:
    """TCP ports in LISTEN state owned by any of `pids` (from /proc)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            pass
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:
                ports.add(int(parts[1].rsplit(":", 1)[1], 16))
    return ports


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_every_process_and_the_run_resumes(tmp_path):
    env = {**os.environ, "RLKIT_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "rlkit.cli", "train", str(ROOT / "recipes" / "grpo_tiny_ci.yaml"),
           f"run.output_dir={out}", "run.num_steps=200", "checkpoint.every_steps=1",
           "tracking.progress=false"]
    # A new session, so the signal below reaches the whole foreground group as Ctrl-C does.
    # SIGINT back to its default first: a shell without job control starts background jobs
    # (`.ci/run &`) with SIGINT ignored, and Python then keeps ignoring it, as it should.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True,
                            preexec_fn=_default_sigint,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = out / "grpo-tiny" / "metrics.jsonl"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.stdout.read()
    model = str(tmp_path / "cache")
    running = set(processes_with(model))
    assert running, "no engine process found while the run was going"
    ports = listening_ports(running)
    assert ports

    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, output
    deadline = time.monotonic() + 30
    while processes_with(model) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_with(model) == [], "engine processes outlived the run"
    assert listening_ports(running) == set()

    # the interrupted run resumes from its newest checkpoint
    done = len(metrics.read_text().splitlines())
    resumed = subprocess.run(cmd[:-3] + [f"run.num_steps={done + 1}", "tracking.progress=false"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    last = json.loads(metrics.read_text().splitlines()[-1])
    assert last["step"] == done + 1
