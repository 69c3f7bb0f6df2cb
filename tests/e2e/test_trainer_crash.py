"""The trainer process killed (SIGKILL) in the middle of a run: `rlkit train` ends with a message
naming what died, in which step, and the checkpoint `run.resume=auto` continues from; no process
or port of the run is left; the resumed run trains exactly the groups an uninterrupted run does.

The runs use the `sync` policy (exactly the batch's groups, no over-provisioning): which groups a
step trains then depends only on the data order and the buffer's state, so an uninterrupted run
is a reference the interrupted + resumed pair must equal as a multiset of group ids (nothing
trained twice, nothing lost). Under `partial` the groups a step keeps are the first to finish
on two engines racing each other, which differs from run to run however the seed is fixed;
test_partial_run_killed_and_resumed_trains_each_group_at_most_once checks what holds there.
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

import pytest

from tests.e2e.test_interrupt import listening_ports

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(d.name))
    return out


def _start_time(pid: int) -> str | None:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError):
        return None


def process_tree(root: int) -> dict[int, str | None]:
    """Every descendant of `root` (pid -> start time, to tell a reused pid apart)."""
    children, out, todo = _children(), {}, [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out[c] = _start_time(c)
            todo.append(c)
    return out


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


def ports_in_listen(ports: set[int]) -> set[int]:
    """Which of `ports` anything on this machine still listens on."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            port = int(parts[1].rsplit(":", 1)[1], 16)
            if parts[3] == "0A" and port in ports:
                found.add(port)
    return found


def trained(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "groups.jsonl").read_text().splitlines()]


def buffer_state(ckpt: Path) -> dict:
    return json.loads(gzip.open(ckpt / "buffer.json.gz").read())


def train_cmd(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "rlkit.cli", "train", str(ROOT / "recipes" / "grpo_tiny_ci.yaml"),
            f"run.output_dir={out}", "checkpoint.every_steps=1", "checkpoint.keep_last=5",
            "tracking.progress=false", "mode=sync", "run.seed=7", *overrides]


def run_killing_the_trainer(cmd: list[str], env: dict, run_dir: Path,
                            after_step: int) -> tuple[subprocess.CompletedProcess, int]:
    """Start the run in a session of its own, SIGKILL its TrainWorker once the checkpoint of
    `after_step` is written (the driver is then in the next step), wait for the run to end, and
    check that nothing of it is left: no process of its tree (as it was before the kill) or of its
    session, no port it listened on. Returns the finished run and the killed pid."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    marker = run_dir / "checkpoints" / f"step_{after_step:06d}" / "state.json"
    deadline = time.monotonic() + 400
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None and marker.exists(), proc.communicate()
    tree = process_tree(proc.pid)
    workers = [pid for pid in tree if cmdline(pid).startswith("ray::TrainWorker")]
    assert len(workers) == 1, [cmdline(p) for p in tree]
    ports = listening_ports(set(tree))
    assert ports, "no listening port found in the run's processes"
    os.kill(workers[0], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=300)
    assert_nothing_left(proc.pid, tree, ports)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), workers[0]


def assert_nothing_left(sid: int, tree: dict, ports: set[int]) -> None:
    deadline = time.monotonic() + 60
    while (alive(tree) or in_session(sid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive(tree) == [], "processes of the run outlived it"
    assert in_session(sid) == []
    assert ports_in_listen(ports) == set(), "ports of the run still held"


def test_trainer_killed_mid_run_resumes_to_the_groups_of_an_uninterrupted_run(tmp_path):
    env = {**os.environ, "RLKIT_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    steps = 2
    reference = subprocess.run(train_cmd(tmp_path / "reference", f"run.num_steps={steps}",
                                         "rollout.policy=sync"),
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert reference.returncode == 0, reference.stderr
    expected = Counter(g["group_id"] for g in trained(tmp_path / "reference" / "grpo-tiny"))
    assert sum(expected.values()) == steps * 4

    out = tmp_path / "runs"
    run_dir = out / "grpo-tiny"
    cmd = train_cmd(out, f"run.num_steps={steps}", "rollout.policy=sync")
    killed, pid = run_killing_the_trainer(cmd, env, run_dir, after_step=1)
    done = len((run_dir / "metrics.jsonl").read_text().splitlines())  # steps it completed
    assert killed.returncode == 1, killed.stderr
    assert "Traceback" not in killed.stderr, killed.stderr
    assert f"rlkit: trainer rank 0 (pid {pid}) died during " in killed.stderr
    assert f", in step {done + 1} of {steps}. The run stopped (all its processes)" in killed.stderr
    assert (f"run the same command again (run.resume=auto) to continue from the checkpoint of "
            f"step {done}") in killed.stderr

    resumed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stderr
    rows = trained(run_dir)
    assert [r["step"] for r in rows] == sorted(r["step"] for r in rows)
    assert Counter(r["group_id"] for r in rows) == expected  # none twice, none lost


def test_partial_run_killed_and_resumed_trains_each_group_at_most_once(tmp_path):
    """Under `partial` the groups a step keeps depend on which finish first, so the strongest
    true statement is: every group trained at most once, each step trains its batch, and every
    group parked in the checkpoint the run resumed from is trained after it or still in the buffer
    (parked again, or finished beyond the batch and queued as ready for the next step)."""
    env = {**os.environ, "RLKIT_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    steps = 2
    out = tmp_path / "runs"
    run_dir = out / "grpo-tiny"
    cmd = train_cmd(out, f"run.num_steps={steps}", "rollout.policy=partial")
    killed, _ = run_killing_the_trainer(cmd, env, run_dir, after_step=1)
    assert killed.returncode == 1 and "run.resume=auto" in killed.stderr, killed.stderr
    ckpt = max((run_dir / "checkpoints").glob("step_*"))
    done = json.loads((ckpt / "state.json").read_text())["step"]
    saved = buffer_state(ckpt)
    parked = {g["group_id"] for g in saved["partial"] + saved["long"]}
    assert parked, "the checkpoint holds no partial group to resume"
    before = [r for r in trained(run_dir) if r["step"] <= done]

    resumed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stderr
    rows = trained(run_dir)
    ids = [r["group_id"] for r in rows]
    assert len(ids) == len(set(ids)) == steps * 4  # none twice, each step its batch
    assert [r for r in rows if r["step"] <= done] == before  # the steps before the kill stand
    final = buffer_state(max((run_dir / "checkpoints").glob("step_*")))
    still = {g["group_id"] for g in final["partial"] + final["long"] + final["ready"]}
    after = {r["group_id"] for r in rows if r["step"] > done}
    assert parked <= after | still, ("a parked group was lost", parked - after - still, final["dropped"])
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == steps and last["buffer/balanced"]
