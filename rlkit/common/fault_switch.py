"""Test-only fault switches: a process of a run fails at an exact point of the run that the test
chose, instead of a test killing it from outside at a moment it guessed by polling.

    RLKIT_TEST_ENGINE_FAULT   the built-in engine server (rollout/engines/builtin/fault.py)
    RLKIT_TEST_TRAINER_FAULT  a trainer rank (train/ray_group.py, TrainerFault)
    RLKIT_TEST_ROLLOUT_FAULT  the rollout actor (rlkit/driver/rollout_fault.py)
    RLKIT_TEST_ROUTER_FAULT   the router, killed or stopped by the rollout actor that owns it
                              (rlkit/driver/rollout_fault.py)

Off by default, and free when off: a process reads its switch once, at start (None when the
variable is unset), and the point where a fault may fire checks one attribute. Tests set them;
nothing else should.

A switch is comma-separated key=value pairs, e.g. `action=kill,tokens=40,version=1,dir=/tmp/f`.
`dir` (required) is a folder the test owns. The process that fires first claims
`dir/fired.json` (created atomically with what fired, where, and at which point) and only it
fires: a fault happens once per folder, hence once per run, and a process started after it (an
engine restarted by rollout.health, which inherits the variable) finds the record at start and
runs clean. The test reads the record to know its victim.

Here, at the bottom of the package graph and stdlib only, because the engine (rollout) and the
trainer (train, which imports no rollout code) both read one.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENGINE_FAULT_ENV = "RLKIT_TEST_ENGINE_FAULT"
TRAINER_FAULT_ENV = "RLKIT_TEST_TRAINER_FAULT"
ROLLOUT_FAULT_ENV = "RLKIT_TEST_ROLLOUT_FAULT"
ROUTER_FAULT_ENV = "RLKIT_TEST_ROUTER_FAULT"
FIRED = "fired.json"  # the record of the fault, in the switch's folder
RELEASE = "release"  # a held fault (hold=1) fires once the test creates this file


class FaultSwitchError(ValueError):
    """A switch that does not parse: the process refuses to start rather than run without it."""


@dataclass(frozen=True)
class FaultSwitch:
    env: str
    action: str
    dir: Path
    params: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: str, actions: tuple[str, ...], required: tuple[str, ...] = (),
                 optional: tuple[str, ...] = ()) -> FaultSwitch | None:
        """The switch in $env; None when unset, or when its fault already fired (the record is
        in its folder): this process runs clean."""
        raw = os.environ.get(env, "").strip()
        if not raw:
            return None
        pairs: dict[str, str] = {}
        for part in raw.split(","):
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                raise FaultSwitchError(f"${env}: {part!r} is not key=value (in {raw!r})")
            pairs[key.strip()] = value.strip()
        action, folder = pairs.pop("action", ""), pairs.pop("dir", "")
        if action not in actions:
            raise FaultSwitchError(f"${env}: action must be one of {list(actions)}, got {action!r}")
        if not folder:
            raise FaultSwitchError(f"${env}: dir=FOLDER is required (the fault's record goes there)")
        unknown = sorted(set(pairs) - set(required) - set(optional))
        missing = sorted(set(required) - set(pairs))
        if unknown or missing:
            raise FaultSwitchError(f"${env}: unknown keys {unknown}, missing keys {missing} "
                                   f"(keys: action, dir, {', '.join((*required, *optional))})")
        switch = cls(env, action, Path(folder), pairs)
        return None if switch.fired() else switch

    def number(self, key: str, default: int | None = None) -> int | None:
        if key not in self.params:
            return default
        try:
            return int(self.params[key])
        except ValueError:
            raise FaultSwitchError(f"${self.env}: {key} must be an integer, got "
                                   f"{self.params[key]!r}") from None

    def fired(self) -> bool:
        return (self.dir / FIRED).exists()

    def claim(self, **details: Any) -> bool:
        """Record that the fault fires in this process now; False when another fired first.
        The record appears whole or not at all (written aside, then hard-linked in place)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        record = {"action": self.action, "pid": os.getpid(), "time": time.time(),
                  **self.params, **details}
        tmp = self.dir / f".{FIRED}.{os.getpid()}"
        tmp.write_text(json.dumps(record))
        try:
            os.link(tmp, self.dir / FIRED)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def wait_for_release(self, timeout_s: float = 900.0) -> None:
        """Hold here until the test creates `dir/release` (it looks at the live run first)."""
        deadline = time.monotonic() + timeout_s
        while not (self.dir / RELEASE).exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def read_fired(folder: str | Path) -> dict[str, Any] | None:
    """The record of the fault that fired with this folder, or None."""
    path = Path(folder) / FIRED
    return json.loads(path.read_text()) if path.exists() else None
