"""The trainer process killed (SIGKILL) in the middle of a run: `rlkit train` ends with a message
naming what died, in which step, and the checkpoint `run.resume=auto` continues from; no process
or port of the run is left; the resumed run trains exactly the groups an uninterrupted run does.

The kill comes from the trainer's test-only switch ($RLKIT_TEST_TRAINER_FAULT, TrainerFault in
train/ray_group.py), not from the test at a moment it guessed: rank 0 stops as it begins step
2's batch, holds there while the test records the live run's processes and ports, and SIGKILLs
itself once released. So it dies in step 2, during training, after step 1's checkpoint, every
time.

The runs use the `sync` policy (exactly the batch's groups, no over-provisioning): which groups a
step trains then depends only on the data order and the buffer's state, so an uninterrupted run
is a reference the interrupted + resumed pair must equal as a multiset of group ids (nothing
trained twice, nothing lost). Under `partial` the groups a step keeps are the first to finish
on two engines racing each other, which differs from run to run however the seed is fixed:
tests/e2e/test_process_faults.py checks what holds there (its CI case kills the rollout actor
mid-rollout under `partial`), and every other phase and process kind.
"""

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import pytest

from rlkit.common.fault_switch import RELEASE, TRAINER_FAULT_ENV, read_fired
from tests.e2e.test_interrupt import listening_ports
from tests.netprobe import descendants

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _start_time(pid: int) -> str | None:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError):
        return None


def process_tree(root: int) -> dict[int, str | None]:
    """Every descendant of `root` (pid -> start time, to tell a reused pid apart)."""
    return {c: _start_time(c) for c in descendants(root)}


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(tree: dict[int, str | None]) -> list[str]:
    return [f"{pid} {cmdline(pid)[:80]}" for pid, t in tree.items() if t is not None and _start_time(pid) == t]


def in_session(sid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[4]) == sid:
                    out.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def ports_in_listen(ports: set[int], started_before: float | None = None) -> set[int]:
    """Which of `ports` anything on this machine still listens on; with `started_before` (seconds
    since boot), only sockets of processes started before then (or whose owner is not found): a
    port of the run recycled afterwards by another process (a test running beside it) is not the
    run's."""
    inodes: dict[str, int] = {}  # a listening socket's inode -> its port
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            port = int(parts[1].rsplit(":", 1)[1], 16)
            if parts[3] == "0A" and port in ports:
                inodes[parts[9]] = port
    if started_before is None or not inodes:
        return set(inodes.values())
    owners: dict[str, int] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                for fd in (proc / "fd").iterdir():
                    target = os.readlink(fd)
                    if target.startswith("socket:[") and target[8:-1] in inodes:
                        owners[target[8:-1]] = int(proc.name)
            except OSError:
                pass
    return {port for inode, port in inodes.items()
            if inode not in owners or _started_s(owners[inode]) < started_before}


def _uptime_s() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def _started_s(pid: int) -> float:
    """When `pid` started, in seconds since boot (inf when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return float("inf")
    return int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")


def trained(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "groups.jsonl").read_text().splitlines()]


def buffer_state(ckpt: Path) -> dict:
    return json.loads(gzip.open(ckpt / "buffer.json.gz").read())


def train_cmd(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "rlkit.cli", "train", str(ROOT / "recipes" / "grpo_tiny_ci.yaml"),
            f"run.output_dir={out}", "checkpoint.every_steps=1", "checkpoint.keep_last=5",
            "tracking.progress=false", "mode=sync", "run.seed=7", *overrides]


def trainer_fault(env: dict, folder: Path, step: int) -> dict:
    """`env` with rank 0 armed to die (SIGKILL) as it begins step `step`'s batch, holding there
    until the test releases it; once per folder."""
    return {**env, TRAINER_FAULT_ENV: f"action=kill,step={step},hold=1,dir={folder}"}


def held_run(cmd: list[str], env: dict, folder: Path, kill_held: str | None = None,
             live: Callable[[dict, dict, set[int]], None] | None = None,
             ) -> tuple[subprocess.CompletedProcess, dict]:
    """Start the run in a session of its own; once its armed process holds at the fault's point
    (its switch's hold=1), record the run's process tree and ports (`live(fired, tree, ports)`
    checks the live run), release it (or SIGKILL the process `kill_held` names, the armed one
    holding on), wait for the end, and check that nothing of the run is left: no process of its
    tree (as it was before the kill) or of its session, no port it listened on. Returns the run
    and the fault's record (its victim's pid)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while read_fired(folder) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    fired = read_fired(folder)
    assert proc.poll() is None and fired is not None, proc.communicate()
    tree = process_tree(proc.pid)
    assert fired["pid"] in tree, [cmdline(p) for p in tree]
    ports = listening_ports(set(tree))
    if live is not None:
        live(fired, tree, ports)
    if kill_held is not None:
        victims = [p for p in tree if cmdline(p).startswith(kill_held)]
        assert len(victims) == 1, [cmdline(p) for p in tree]
        os.kill(victims[0], signal.SIGKILL)
        fired = {**fired, "pid": victims[0]}
    else:
        (folder / RELEASE).touch()  # it dies now
    stdout, stderr = proc.communicate(timeout=600)
    assert_nothing_left(proc.pid, tree, ports)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), fired


def run_killing_the_trainer(cmd: list[str], env: dict, run_dir: Path, folder: Path,
                            at_step: int) -> tuple[subprocess.CompletedProcess, int]:
    """`held_run` with the TrainWorker armed (`trainer_fault`) to die as it begins step
    `at_step`'s batch, the live run checked first: the steps before it checkpointed, the one
    rank the armed one. Returns the finished run and the killed pid."""
    def live(fired: dict, tree: dict, ports: set[int]) -> None:
        assert fired["step"] == at_step
        marker = run_dir / "checkpoints" / f"step_{at_step - 1:06d}" / "state.json"
        assert marker.exists()  # the steps before it are checkpointed
        workers = [pid for pid in tree if cmdline(pid).startswith("ray::TrainWorker")]
        assert workers == [fired["pid"]], [cmdline(p) for p in tree]
        assert ports, "no listening port found in the run's processes"

    ran, fired = held_run(cmd, env, folder, live=live)
    return ran, fired["pid"]


def assert_nothing_left(sid: int, tree: dict, ports: set[int]) -> None:
    ended = _uptime_s()  # the run is over: nothing of it starts after this
    deadline = time.monotonic() + 60
    while (alive(tree) or in_session(sid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive(tree) == [], "processes of the run outlived it"
    assert in_session(sid) == []
    assert ports_in_listen(ports, started_before=ended) == set(), "ports of the run still held"


def test_trainer_killed_mid_run_resumes_to_the_groups_of_an_uninterrupted_run(tmp_path):
    env = {**os.environ, "RLKIT_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    steps = 2
    # What an uninterrupted run trains: the buffer numbers groups as it creates them and the
    # `sync` policy creates exactly the batch (4) each step, so groups 0..7 (the reference run
    # of tests/e2e/test_process_faults.py shows it under RLKIT_ALL_PROCESS_FAULTS=1; this test
    # ran one too, costing a third launch in CI).
    expected = Counter(range(steps * 4))

    out = tmp_path / "runs"
    run_dir = out / "grpo-tiny"
    cmd = train_cmd(out, f"run.num_steps={steps}", "rollout.policy=sync")
    folder = tmp_path / "fault"
    env = trainer_fault(env, folder, step=2)
    killed, pid = run_killing_the_trainer(cmd, env, run_dir, folder, at_step=2)
    done = len((run_dir / "metrics.jsonl").read_text().splitlines())  # steps it completed
    assert done == 1
    assert killed.returncode == 1, killed.stderr
    assert "Traceback" not in killed.stderr, killed.stderr
    assert f"rlkit: trainer rank 0 (pid {pid}) died during training (" in killed.stderr
    assert f", in step 2 of {steps}. The run stopped (all its processes)" in killed.stderr
    assert ("run the same command again (run.resume=auto) to continue from the checkpoint of "
            "step 1") in killed.stderr

    # the same environment: the fault fired (its record is there), so the resumed run is clean
    resumed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stderr
    assert read_fired(folder)["pid"] == pid
    rows = trained(run_dir)
    assert [r["step"] for r in rows] == sorted(r["step"] for r in rows)
    assert Counter(r["group_id"] for r in rows) == expected  # none twice, none lost
    assert len({r["source_index"] for r in rows}) == steps * 4  # eight prompts, each once
