"""The built-in engine's test-only fault switch ($RLKIT_TEST_ENGINE_FAULT, rlkit.common.fault_switch):
the engine server fails right after it has streamed its N-th token, so a test's fault lands at
an exact, reproducible point of a run. Off (None) unless the variable is set; never set it
outside tests.

    RLKIT_TEST_ENGINE_FAULT="action=kill,tokens=N[,version=V][,unfinished=1],dir=FOLDER"
    RLKIT_TEST_ENGINE_FAULT="action=kill,at=/begin_weight_update[,calls=K],dir=FOLDER"

- `tokens=N`: fire right after the stream chunk that carries the engine's N-th streamed token
  goes out (health probes are not streamed and do not count). With `version=V`, only tokens
  generated at weight version V count: in a `sync` run, step K's rollout runs at version K-1,
  so `version=1` puts the fault in step 2, on the first engine to stream N tokens of it. With
  `unfinished=1`, from the N-th token on it fires at the first chunk that leaves its request
  unfinished: that request is then surely lost with the tokens it streamed.
- `at=PATH`: instead of tokens, fire as the K-th call (default 1st) of the control endpoint
  PATH arrives, before it is handled: an engine dying during a weight sync (at=/pause_generation,
  /begin_weight_update, /update_weights_from_disk, ...) or a sleep or wake. The caller's
  request then finds the connection reset (kill) or no answer (hang). In a `sync` run the sync
  at the end of step K is the K-th of each weight-update call.
- `action`: `drop` (with `at=` a weight or adapter load: /update_weights_from_disk,
  /update_weights_from_tensor, /load_lora_adapter, /load_lora_adapter_from_tensors): that call
  is answered as a success and not applied (the weight version moves, an adapter's name is
  served by the base model): the silent failure the weight-sync check must catch; `kill`: the
  server and its engine core die at once (SIGKILL, as a crash or the OOM killer); `hang`: both stop (SIGSTOP): nothing streams, /health and probes get no answer, as
  a stuck process; `kill_all`: every engine server started with this folder (each registers
  itself there, `armed-<pid>`) is killed at that same instant, this one last.
- Once per folder: only the first engine to get there fires (it writes `FOLDER/fired.json`:
  its pid, URL, weight version, tokens streamed); an engine started afterwards, such as one
  rollout.health restarted, finds the record and runs clean.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from rlkit.common.fault_switch import ENGINE_FAULT_ENV, FaultSwitch, FaultSwitchError

ACTIONS = ("kill", "hang", "kill_all", "drop")
DROPPABLE = ("/update_weights_from_disk", "/update_weights_from_tensor", "/load_lora_adapter",
             "/load_lora_adapter_from_tensors")
SERVER_MODULE = "rlkit.rollout.engines.builtin.hf_server"


class EngineFault:
    def __init__(self, switch: FaultSwitch) -> None:
        self.switch = switch
        self.tokens = switch.number("tokens")
        self.at = switch.params.get("at")
        self.calls = switch.number("calls", 1)
        if (self.tokens is None) == (self.at is None):
            raise FaultSwitchError(f"${ENGINE_FAULT_ENV}: give tokens=N or at=/path, one of them")
        if self.tokens is not None and self.tokens < 1:
            raise FaultSwitchError(f"${ENGINE_FAULT_ENV}: tokens must be >= 1")
        if self.at is not None and (not self.at.startswith("/") or self.calls is None or self.calls < 1):
            raise FaultSwitchError(f"${ENGINE_FAULT_ENV}: at must be an endpoint path (/...) "
                                   "and calls >= 1")
        if switch.action == "drop" and self.at not in DROPPABLE:
            raise FaultSwitchError(f"${ENGINE_FAULT_ENV}: action=drop needs at= one of {DROPPABLE}")
        self.calls_seen = 0
        self.version = switch.params.get("version")
        self.unfinished = bool(switch.number("unfinished", 0))
        self.streamed_tokens = 0
        self.url = ""
        self.core_pid: int | None = None

    @classmethod
    def from_env(cls) -> EngineFault | None:
        switch = FaultSwitch.from_env(ENGINE_FAULT_ENV, ACTIONS,
                                      optional=("tokens", "version", "unfinished", "at", "calls"))
        return cls(switch) if switch is not None else None

    def arm(self, url: str, core_pid: int | None) -> None:
        """Once the server listens: what the record names, and (kill_all) its registration."""
        self.url, self.core_pid = url, core_pid
        if self.switch.action == "kill_all":
            self.switch.dir.mkdir(parents=True, exist_ok=True)
            (self.switch.dir / f"armed-{os.getpid()}").write_text(url)

    def streamed(self, n: int, version: str, finished: bool) -> bool:
        """A chunk of `n` tokens at weight `version` just went out on a stream (`finished`: the
        request's last). False once spent (another engine fired first): the server then drops
        the switch."""
        if self.tokens is None or (self.version is not None and version != self.version):
            return True
        self.streamed_tokens += n
        if self.streamed_tokens < self.tokens or (self.unfinished and finished):
            return True
        return self._fire(weight_version=version, streamed_tokens=self.streamed_tokens)

    def called(self, path: str) -> bool:
        """Control endpoint `path` was just called (before it is handled). False once spent."""
        if path != self.at:
            return True
        self.calls_seen += 1
        if self.calls_seen < self.calls:  # type: ignore[operator]
            return True
        return self._fire(at=path, calls=self.calls_seen)

    def drops(self, path: str) -> bool:
        """action=drop: whether this call of `path` is to be answered without being applied
        (the K-th call, on the first engine to get there)."""
        if self.switch.action != "drop" or path != self.at:
            return False
        self.calls_seen += 1
        return self.calls_seen == self.calls and self.switch.claim(
            url=self.url, core_pid=self.core_pid, at=path, calls=self.calls_seen)

    def _fire(self, **record: object) -> bool:
        if not self.switch.claim(url=self.url, core_pid=self.core_pid, **record):
            return False
        if self.switch.action == "hang":
            self._signal(self.core_pid, signal.SIGSTOP)
            os.kill(os.getpid(), signal.SIGSTOP)  # stops here; nothing continues it
            return False
        if self.switch.action == "kill_all":
            for f in self.switch.dir.glob("armed-*"):
                pid = int(f.name.removeprefix("armed-"))
                if pid != os.getpid() and _is_engine_server(pid):
                    _kill_group(pid)
        self._signal(self.core_pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
        return False  # not reached

    def middleware(self):  # noqa: ANN201 - an aiohttp middleware
        """Fires `at` a control call: runs before the endpoint's handler (and its auth check,
        being outermost: the call arriving is the moment)."""
        from aiohttp import web

        @web.middleware
        async def fire_at_call(request: web.Request, handler):  # noqa: ANN001, ANN202
            if self.at is not None and self.switch.action != "drop":  # drop: in the handler
                self.called(request.path)
            return await handler(request)

        return fire_at_call

    @staticmethod
    def _signal(pid: int | None, sig: int) -> None:
        if pid:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def _is_engine_server(pid: int) -> bool:
    try:
        return SERVER_MODULE in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def _kill_group(pid: int) -> None:
    """SIGKILL an engine server and its core: its process group when it leads one (started in a
    session of its own, as rollout.engines.process does), else the server alone."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
