"""Start, watch and stop engine-side processes (engine servers, the router) without orphans.

Every process is started in its own session (its own process group), so stopping it - or
cleaning up after a failed start - signals the whole group: SGLang's scheduler subprocesses and
the router's workers go with their parent. Output goes to a log file whose tail is quoted in
every start-up error.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from rlkit.common.errors import UserError
from rlkit.rollout.engines.config import EngineConfig


class ProcessStartError(UserError, RuntimeError):
    """A process died or did not become healthy in time; the message quotes its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (another process may still take it: callers that can
    should let the server bind port 0 and report it, as the hf server does with --port-file)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def log_tail(path: Path | None, lines: int = 30) -> str:
    if path is None or not path.exists():
        return "(no log)"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:]) or "(empty log)"


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 300
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


@dataclass
class ManagedProcess:
    """A child process in its own process group, with its log file."""

    name: str
    argv: list[str]
    process: subprocess.Popen
    log_path: Path
    url: str | None = None
    _log_file: object = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_healthy(self, health_url: str, timeout_s: float, interval_s: float = 0.2) -> None:
        """Poll `health_url` until it answers 2xx; raise (after stopping the group) if the
        process exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                code = self.process.returncode
                self.stop()
                raise ProcessStartError(
                    f"{self.name} exited with code {code} before becoming healthy.\n"
                    f"command: {' '.join(self.argv)}\nlog {self.log_path}:\n{log_tail(self.log_path)}"
                )
            if http_ok(health_url):
                return
            time.sleep(interval_s)
        self.stop()
        raise ProcessStartError(
            f"{self.name} did not answer {health_url} within {timeout_s:.0f} s.\n"
            f"command: {' '.join(self.argv)}\nlog {self.log_path}:\n{log_tail(self.log_path)}"
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after `timeout_s`."""
        if self.alive():
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        # Children that outlive the leader still belong to the group.
        _signal_group(self.process.pid, signal.SIGKILL)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
        if self._log_file is not None:
            self._log_file.close()  # type: ignore[attr-defined]
            self._log_file = None

    def kill(self) -> None:
        """Kill the group at once (tests use it to simulate a crashed worker)."""
        _signal_group(self.process.pid, signal.SIGKILL)
        self.process.wait(10)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # pgid == pid: started with start_new_session
    except (ProcessLookupError, PermissionError):
        pass


def spawn(name: str, argv: Sequence[str], *, log_path: Path | None = None,
          env: dict[str, str] | None = None) -> ManagedProcess:
    """Start `argv` in a new session with stdout+stderr to `log_path` (a temp file if None)."""
    if log_path is None:
        fd, tmp = tempfile.mkstemp(prefix=f"rlkit-{name}-", suffix=".log")
        os.close(fd)
        log_path = Path(tmp)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "ab")
    try:
        proc = subprocess.Popen(
            list(argv), stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env={**os.environ, **(env or {})},
        )
    except FileNotFoundError as e:
        log_file.close()
        raise ProcessStartError(f"cannot start {name}: {e}") from None
    return ManagedProcess(name=name, argv=list(argv), process=proc, log_path=log_path,
                          _log_file=log_file)


# -- the built-in hf engine server --------------------------------------------------------------
def default_threads(num_engines: int) -> int:
    """Intra-op threads per engine: the cores split between engines, at least 1 (more threads
    than free cores makes OpenMP spin-wait and slows everything on a shared machine)."""
    return max(1, (os.cpu_count() or 1) // max(1, num_engines))


def hf_server_argv(model_path: str, config: EngineConfig, *, port: int, port_file: str | None,
                   threads: int, seed: int = 0, weight_version: str = "0") -> list[str]:
    argv = [
        sys.executable, "-m", "rlkit.rollout.engines.builtin.hf_server",
        "--model", model_path, "--host", config.host, "--port", str(port),
        "--device", config.device, "--dtype", config.dtype, "--threads", str(threads),
        "--max-running-requests", str(config.max_running_requests),
        "--max-prefill-tokens", str(config.max_prefill_tokens),
        "--random-seed", str(seed), "--weight-version", weight_version,
        "--stream-interval", str(config.stream_interval),
        "--parent-pid", str(os.getpid()),  # the engine exits if its launcher dies
    ]
    if port_file:
        argv += ["--port-file", port_file]
    if config.max_total_tokens:
        argv += ["--max-total-tokens", str(config.max_total_tokens)]
    if config.incremental_streaming_output:
        argv.append("--incremental-streaming-output")
    return argv


def start_hf_server(
    model_path: str,
    config: EngineConfig | None = None,
    *,
    seed: int = 0,
    threads: int | None = None,
    weight_version: str = "0",
    log_path: Path | None = None,
) -> ManagedProcess:
    """Start one built-in engine server on a free port and wait for /health.

    The server binds port 0 itself and writes the port to a file, so two servers started at the
    same time never race for a port. Returns the process with `.url` set; call `.stop()`."""
    config = config or EngineConfig()
    threads = threads if threads is not None else (config.cpu_threads or default_threads(config.num_engines))
    port_dir = Path(tempfile.mkdtemp(prefix="rlkit-port-"))
    port_file = port_dir / "port"
    argv = hf_server_argv(model_path, config, port=0, port_file=str(port_file), threads=threads,
                          seed=seed, weight_version=weight_version)
    proc = spawn("hf-engine", argv, log_path=log_path)
    deadline = time.monotonic() + config.startup_timeout_s
    while not port_file.exists():
        if not proc.alive() or time.monotonic() > deadline:
            code = proc.process.poll()
            proc.stop()
            raise ProcessStartError(
                f"hf engine for {model_path} {'exited with code ' + str(code) if code is not None else 'did not start listening'}"
                f" during start-up.\ncommand: {' '.join(argv)}\nlog {proc.log_path}:\n{log_tail(proc.log_path)}"
            )
        time.sleep(0.1)
    port = int(port_file.read_text())
    port_file.unlink()
    port_dir.rmdir()
    proc.url = f"http://{config.host}:{port}"
    proc.wait_healthy(f"{proc.url}/health", max(1.0, deadline - time.monotonic()))
    return proc
