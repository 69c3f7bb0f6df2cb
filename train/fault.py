"""A trainer rank's test-only fault switch, kept out of the code every rank runs (as the built-in
engine keeps its own in rollout/engines/builtin/fault.py): `trainer_fault(rank)` is None unless
a test set $RLKIT_TEST_TRAINER_FAULT (rlkit.common.fault_switch)."""

from __future__ import annotations

import os
import signal

from rlkit.common.fault_switch import TRAINER_FAULT_ENV, FaultSwitch, FaultSwitchError


def trainer_fault(rank: int) -> "TrainerFault | None":
    """This rank's fault, when a test asked for one ($RLKIT_TEST_TRAINER_FAULT is unset in
    every run: then None, and nothing else of this module runs)."""
    if not os.environ.get(TRAINER_FAULT_ENV):
        return None
    return TrainerFault.from_env(rank)


class TrainerFault:
    """The trainer's test-only fault switch ($RLKIT_TEST_TRAINER_FAULT, rlkit.common.fault_switch):

        RLKIT_TEST_TRAINER_FAULT="action=kill|hold,step=K,dir=FOLDER[,rank=R][,hold=1]"

    Rank R (0) records the fault in FOLDER/fired.json and SIGKILLs itself (as the OOM killer
    would) when it begins the batch of its K-th optimizer step: step K of a run with one
    optimizer step per rollout step, as every recipe here. With hold=1 it first waits there
    until the test creates FOLDER/release, so the test can look at the live run. action=hold
    only waits there for the release, then trains on: the run stays in step K until something
    the test waits for has happened. Once per folder. None unless the variable is set; never
    set it outside tests."""

    def __init__(self, switch: FaultSwitch) -> None:
        self.switch = switch
        self.step = switch.number("step")
        if self.step is None or self.step < 1:
            raise FaultSwitchError(f"${TRAINER_FAULT_ENV}: step must be >= 1")

    @classmethod
    def from_env(cls, rank: int) -> "TrainerFault | None":
        switch = FaultSwitch.from_env(TRAINER_FAULT_ENV, ("kill", "hold"), required=("step",),
                                      optional=("rank", "hold"))
        return cls(switch) if switch is not None and switch.number("rank", 0) == rank else None

    def at_batch(self, steps_taken: int) -> None:
        if steps_taken + 1 == self.step and self.switch.claim(step=self.step):
            if self.switch.number("hold", 0) or self.switch.action == "hold":
                self.switch.wait_for_release()
            if self.switch.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
