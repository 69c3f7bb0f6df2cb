"""Run a Python module's command line with the control token put into its arguments, and its
output written on with the token blanked.

    python -m rlkit.rollout.http.token_exec [--parent-pid PID] MODULE [ARGS...]

runs MODULE as __main__ with every TOKEN_PLACEHOLDER in ARGS replaced by $RLKIT_CONTROL_TOKEN.
Why: sglang-router and SGLang take their keys only as command-line flags, and a process's
command line is readable by every local user (/proc/PID/cmdline, ps) and quoted in rlkit's
start-up errors; the environment is not (only the same user reads /proc/PID/environ).
Rewriting sys.argv here changes what the program parses, not what the kernel shows.

The program then knows the token and may print it: SGLang logs every server argument at start
(`server_args=...`, api keys included) and its tracebacks quote them. So the program runs in a
child, its stdout and stderr (and those of every process it starts) go through a pipe, and this
process, the group's leader, writes what comes on to its own stdout with the token replaced by
REDACTED; it exits with the program's status once the pipe is closed. It ignores SIGTERM and
SIGINT, which reach the whole group: it ends when the program's last process has, so no line
of a shutdown is lost (a SIGKILL to the group ends it too).

`--parent-pid PID`: a watchdog kills the whole group (the program and what it started) once this
process is no longer PID's child, i.e. PID died without stopping it (the router's owner, the
rollout actor: rollout.http.router). A program that has no such flag of its own (sglang-router)
would otherwise keep listening after its run is gone.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time

from rlkit.rollout.http.auth import CONTROL_TOKEN_ENV, control_token_from_env

TOKEN_PLACEHOLDER = "{rlkit-control-token}"
REDACTED = b"<rlkit-control-token>"
_CHUNK = 1 << 16


def fill_token(args: list[str], token: str) -> list[str]:
    """`args` with every TOKEN_PLACEHOLDER replaced by `token` (what the program parses)."""
    return [a.replace(TOKEN_PLACEHOLDER, token) for a in args]


class Redactor:
    """Replaces `token` in a byte stream fed in pieces, a token split between pieces included:
    everything goes out at once but a tail that may be the start of a token."""

    def __init__(self, token: str) -> None:
        self.token = token.encode()
        self.pending = b""

    def feed(self, data: bytes) -> bytes:
        # REDACTED shares no byte with a token (url-safe characters only), so a replacement
        # never joins what follows into a new one
        text = (self.pending + data).replace(self.token, REDACTED)
        keep = next((k for k in range(min(len(self.token) - 1, len(text)), 0, -1)
                     if text.endswith(self.token[:k])), 0)
        self.pending = text[len(text) - keep:]
        return text[:len(text) - keep]

    def close(self) -> bytes:
        out, self.pending = self.pending, b""
        return out


def _pump(read_fd: int, write_fd: int, token: str) -> None:
    redactor = Redactor(token)
    while True:
        try:
            data = os.read(read_fd, _CHUNK)
        except InterruptedError:
            continue
        if not data:
            break
        _write_all(write_fd, redactor.feed(data))
    _write_all(write_fd, redactor.close())


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data):]
        except BrokenPipeError:  # nobody reads our output any more: drain on, say nothing
            return


def _watch_parent(parent_pid: int, child: int) -> None:
    """Kill the program's process group once re-parented (getppid is pid-reuse safe; the same
    rule as the built-in engine's --parent-pid)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    if os.getpgrp() == os.getpid():  # started in its own session (spawn): the group is ours
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(child, signal.SIGKILL)


def main() -> None:
    argv = sys.argv[1:]
    parent_pid = None
    if argv[:1] == ["--parent-pid"] and len(argv) >= 2:
        parent_pid, argv = int(argv[1]), argv[2:]
    if not argv:
        raise SystemExit(__doc__)
    module, *args = argv
    token = control_token_from_env()
    if token is None:
        raise SystemExit(f"rlkit.rollout.http.token_exec: {CONTROL_TOKEN_ENV} is not set; nothing to "
                         f"pass to {module}")
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    child = os.fork()
    if child == 0:  # the program, its output into the pipe
        os.close(read_fd)
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
        sys.argv = [module, *fill_token(args, token)]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    if parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(parent_pid, child), daemon=True,
                         name="parent-watchdog").start()
    os.close(write_fd)
    _pump(read_fd, 1, token)
    _, status = os.waitpid(child, 0)
    raise SystemExit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status)
                     else 128 + os.WTERMSIG(status))


if __name__ == "__main__":
    main()
