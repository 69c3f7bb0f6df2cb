"""The rollout actor's test-only fault switches (rlkit.common.fault_switch): the rollout actor
dies, or the router it owns dies or stops, at a point of the run a test names. Off (None) unless
a variable is set; never set them outside tests.

    RLKIT_TEST_ROLLOUT_FAULT="action=kill,phase=P,dir=FOLDER[,step=K][,tokens=N][,hold=1]"
    RLKIT_TEST_ROUTER_FAULT="action=kill|hang,phase=P,dir=FOLDER[,step=K][,tokens=N][,hold=1]"

Phases (step K: the K-th rollout step of the run, the one trained at version K - 1):
- `startup`: the rollout actor as it prepares (the router is not started yet: actor only);
- `rollout`: during step K's rollout, once N tokens (default 1) of it have streamed through the
  router, so requests are in flight with tokens;
- `idle`: as step K's rollout has ended, before its result leaves: the trainer trains while it is
  dead or stopped (in sync mode nothing generates then);
- `sync`: as the weight update at the end of step K opens (the update_weights call of version K);
- `checkpoint`: as the buffer of step K's checkpoint is written.

`kill` is SIGKILL (the actor itself; the router's process group), `hang` SIGSTOP (the router's
group: it answers nothing, as a deadlocked process). With hold=1 the actor first waits there
until the test creates FOLDER/release (the test records the live run's processes and ports).
Once per folder (fired.json), like the engine's and the trainer's switches.
"""

from __future__ import annotations

import os
import re
import signal
from typing import Any

from rlkit.common.fault_switch import (
    ROLLOUT_FAULT_ENV,
    ROUTER_FAULT_ENV,
    FaultSwitch,
    FaultSwitchError,
)

PHASES = ("startup", "rollout", "idle", "sync", "checkpoint")


class RolloutFaults:
    """Both switches of one rollout actor; `owner` is the actor (its router is killed)."""

    def __init__(self, owner: Any, switches: list[FaultSwitch]) -> None:
        self.owner = owner
        self.switches = switches
        self._tokens_seen = 0  # routed tokens when the step began (the client counts from 0)
        self._step_base = 0
        self.step = 0

    @classmethod
    def from_env(cls, owner: Any) -> "RolloutFaults | None":
        if not (os.environ.get(ROLLOUT_FAULT_ENV) or os.environ.get(ROUTER_FAULT_ENV)):
            return None
        switches = []
        for env, actions in ((ROLLOUT_FAULT_ENV, ("kill",)), (ROUTER_FAULT_ENV, ("kill", "hang"))):
            sw = FaultSwitch.from_env(env, actions, required=("phase",), optional=("step", "tokens", "hold"))
            if sw is None:
                continue
            if sw.params["phase"] not in PHASES or (env == ROUTER_FAULT_ENV and sw.params["phase"] == "startup"):
                raise FaultSwitchError(f"${env}: phase must be one of {list(PHASES)} (startup: the "
                                       f"rollout actor only), got {sw.params['phase']!r}")
            switches.append(sw)
        return cls(owner, switches) if switches else None

    # -- the points the rollout actor passes ------------------------------------------------
    def at(self, phase: str, step: int = 0) -> None:
        for sw in self.switches:
            if sw.params["phase"] == phase and sw.number("step", 0) in (0, step) \
                    and self._claim(sw, phase=phase, step=step):
                self._fire(sw)

    def rollout_begins(self, step: int) -> None:
        self.step, self._step_base = step, self._tokens_seen

    def routed_tokens(self, total: int) -> None:
        """The client's count of tokens streamed through the router (EngineClient.on_routed_tokens)."""
        self._tokens_seen = total
        for sw in self.switches:
            if (sw.params["phase"] == "rollout" and sw.number("step", 0) in (0, self.step)
                    and total - self._step_base >= (sw.number("tokens", 1) or 1)
                    and self._claim(sw, phase="rollout", step=self.step, tokens=total - self._step_base)):
                self._fire(sw)

    def _router(self) -> Any:
        return getattr(self.owner.router, "process", None)

    def _claim(self, sw: FaultSwitch, **details: Any) -> bool:
        """Record the fault with its victim's pid (the router's, for the router's switch)."""
        router = self._router()
        if sw.env == ROUTER_FAULT_ENV:
            if router is None:
                return False  # no router yet: the point comes again
            details["victim_pid"] = router.pid
        return sw.claim(**details)

    def _fire(self, sw: FaultSwitch) -> None:
        if sw.number("hold", 0):  # the test looks at the live run first (blocks this actor)
            sw.wait_for_release()
        if sw.env == ROLLOUT_FAULT_ENV:
            os.kill(os.getpid(), signal.SIGKILL)
        # the router runs in its own process group (rlkit.rollout.engines.process.spawn)
        os.killpg(self._router().pid, signal.SIGKILL if sw.action == "kill" else signal.SIGSTOP)


def checkpoint_step(path: str) -> int:
    """The step of the checkpoint a buffer file is written into (`.step_000012.tmp/...`)."""
    m = re.search(r"step_(\d+)", path)
    return int(m.group(1)) if m else 0
