"""Ctrl-C during a run: everything shuts down, no process or port is left behind, and a
complete checkpoint is left to resume from. While it runs, nothing of it can be entered from the
network without its secrets (every listening socket probed, and a Ray client tried)."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.e2e.test_train_tiny import processes_with
from tests.netprobe import environ_of, listeners, own_address, probe, process_tree, refused

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.integration]


def listening_ports(pids: set[int]) -> set[int]:
    """TCP ports in LISTEN state owned by any of `pids` (from /proc)."""
    return {s.port for s in listeners(dict.fromkeys(pids, ""))}


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def closed_to_the_network(root: int, tmp_path: Path) -> dict[str, str]:
    """Every listening socket of the run (the process tree under `root`: Ray's GCS, raylet and
    runtime-env agent, every actor, engines, router, trainer ranks, their gloo sockets) is on
    loopback or refuses a caller from the machine's address without a token; a Ray client
    without the token cannot join the run's Ray. Returns the run's secrets, read from its
    processes' environments."""
    tree = process_tree(root)
    socks = listeners(tree)
    host = own_address() or "127.0.0.1"  # a wildcard socket is reached at either
    open_ = [f"{s.process} {s.address}:{s.port}: {outcome}" for s in socks if not s.loopback_only
             for outcome in [probe(host if s.address in ("0.0.0.0", "::") else s.address, s.port)]
             if not refused(outcome)]
    assert not open_, "reachable without a token:\n" + "\n".join(open_)
    names = {s.process for s in socks}
    assert {"gcs_server", "raylet", "sglang::router"} <= names, names  # the probe saw the run
    assert any("hf_server" in n for n in names) and any("TrainWorker" in n for n in names), names
    # beyond loopback: Ray's own servers only (every engine, router, store and gloo socket of
    # the run's own is on 127.0.0.1)
    outside = {s.process for s in socks if not s.loopback_only}
    assert all(n.startswith(("ray::", "raylet", "gcs_server", "python -m rlkit.cli")) for n in outside), outside

    gcs = next(s for s in socks if s.process == "gcs_server")
    home = tmp_path / "stranger"  # no ~/.ray/auth_token of the user's to find
    home.mkdir()
    stranger = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RLKIT_"))}
    # a few tries, not Ray's 20 (it retries a GCS it cannot use once a second); each is refused
    client = subprocess.run(
        [sys.executable, "-c", f"import ray; ray.init(address='{host}:{gcs.port}'); "
                               "print('joined', ray.cluster_resources())"],
        env={**stranger, "HOME": str(home), "RAY_gcs_server_port_wait_time_s": "5"},
        capture_output=True, text=True, timeout=120)
    assert client.returncode != 0 and "joined" not in client.stdout, client.stdout
    assert "InvalidAuthToken" in client.stderr, client.stderr[-2000:]

    secrets = {}
    for pid in tree:
        env = environ_of(pid)
        for name in ("RAY_AUTH_TOKEN", "RLKIT_CONTROL_TOKEN"):
            if env.get(name):
                secrets[name] = env[name]
    assert set(secrets) == {"RAY_AUTH_TOKEN", "RLKIT_CONTROL_TOKEN"}
    assert not (Path.home() / ".ray" / "auth_token").exists()  # Ray wrote no token file
    return secrets


@pytest.fixture
def ray_tmp():
    """Ray's session folder for the run, to search afterwards (short: Ray's socket paths)."""
    path = Path(tempfile.mkdtemp(prefix="rk", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_ctrl_c_stops_every_process_and_leaves_a_checkpoint_to_resume_from(tmp_path, ray_tmp):
    env = {**os.environ, "RLKIT_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1",
           "RAY_TMPDIR": str(ray_tmp)}
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
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 1:  # every process is up
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.stdout.read()
    model = str(tmp_path / "cache")
    running = set(processes_with(model))
    assert running, "no engine process found while the run was going"
    ports = listening_ports(running)
    assert ports
    secrets = closed_to_the_network(proc.pid, tmp_path)

    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 130, output
    deadline = time.monotonic() + 30
    while processes_with(model) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_with(model) == [], "engine processes outlived the run"
    assert listening_ports(running) == set()

    # neither secret was written down: not in the run folder, nor in Ray's session logs
    for name, value in secrets.items():
        hits = [str(f) for d in (out, ray_tmp) for f in d.rglob("*")
                if f.is_file() and value.encode() in f.read_bytes()]
        assert not hits, f"{name} written to {hits}"

    # what the interrupted run resumes from (run.resume=auto): a complete checkpoint of a step
    # it finished. (A resume itself is run after a planned stop, a trainer crash and engines
    # down, tests/e2e: here the CI's budget keeps to what Ctrl-C alone could break.)
    from rlkit.checkpoint import latest_checkpoint

    done = len(metrics.read_text().splitlines())
    ckpt = latest_checkpoint(out / "grpo-tiny")
    assert ckpt is not None and 1 <= ckpt.step <= done and ckpt.version == ckpt.step
    assert ckpt.trainer_dir.is_dir() and ckpt.buffer_file.is_file()
