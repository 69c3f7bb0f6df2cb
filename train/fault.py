"""A trainer rank's test-only fault switch, kept out of the code every rank runs (as the built-in
engine keeps its own in rollout/engines/builtin/fault.py): `trainer_fault(rank)` is None unless
a test set $RLKIT_TEST_TRAINER_FAULT (rlkit.common.fault_switch)."""

from __future__ import annotations

import os
import signal

from rlkit.common.fault_switch import TRAINER_FAULT_ENV, FaultSwitch, FaultSwitchError

# Where in a step a rank can be made to die, and which optimizer-step count (steps done) names
# step K there: before its optimizer step, steps done is K - 1; after it, K.
PHASES: dict[str, int] = {
    "startup": 0,     # as the rank sets up (its model, its process group): before step 1
    "batch": 1,       # as it begins step K's batch (in sync mode: between steps, after the rollout)
    "logprobs": 1,    # as step K's groups arrive (pi_old / reference logprobs, forward/backward)
    "train": 1,       # as it begins step K's optimizer step
    "sync": 0,        # as it publishes step K's weights (K = 0: the first push of a resume)
    "checkpoint": 0,  # as it writes step K's checkpoint
}


def trainer_fault(rank: int) -> "TrainerFault | None":
    """This rank's fault, when a test asked for one ($RLKIT_TEST_TRAINER_FAULT is unset in
    every run: then None, and nothing else of this module runs)."""
    if not os.environ.get(TRAINER_FAULT_ENV):
        return None
    return TrainerFault.from_env(rank)


class TrainerFault:
    """The trainer's test-only fault switch ($RLKIT_TEST_TRAINER_FAULT, rlkit.common.fault_switch):

        RLKIT_TEST_TRAINER_FAULT="action=kill|hold,step=K,dir=FOLDER[,phase=P][,rank=R][,hold=1]"

    Rank R (0) records the fault in FOLDER/fired.json and SIGKILLs itself (as the OOM killer
    would) at phase P (`PHASES`; default `batch`) of step K (a run with one optimizer step per
    rollout step, as every recipe here). With hold=1 it first waits there until the test creates
    FOLDER/release, so the test can look at the live run. action=hold only waits there for the
    release, then goes on: the run stays at that point until something the test waits for has
    happened. Once per folder. None unless the variable is set; never set it outside tests."""

    def __init__(self, switch: FaultSwitch) -> None:
        self.switch = switch
        self.phase = switch.params.get("phase", "batch")
        if self.phase not in PHASES:
            raise FaultSwitchError(f"${TRAINER_FAULT_ENV}: phase must be one of {list(PHASES)}, "
                                   f"got {self.phase!r}")
        self.step = switch.number("step", 0 if self.phase == "startup" else None)
        if self.step is None or self.step < (0 if self.phase in ("startup", "sync") else 1):
            raise FaultSwitchError(f"${TRAINER_FAULT_ENV}: step must be >= 1")

    @classmethod
    def from_env(cls, rank: int) -> "TrainerFault | None":
        switch = FaultSwitch.from_env(TRAINER_FAULT_ENV, ("kill", "hold"), optional=("step", "rank", "hold", "phase"))
        return cls(switch) if switch is not None and switch.number("rank", 0) == rank else None

    def at(self, phase: str, steps_done: int) -> None:
        """The rank is at `phase` with `steps_done` optimizer steps behind it: fire if that is
        the switch's point (once per folder)."""
        if phase != self.phase or steps_done + PHASES[phase] != self.step:
            return
        if not self.switch.claim(step=self.step, phase=phase):
            return
        if self.switch.number("hold", 0) or self.switch.action == "hold":
            self.switch.wait_for_release()
        if self.switch.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
