"""Any process of a run killed at any phase of a step: the run survives it (router, engine) with
the counts to show, or stops with one line naming what died, where, and the checkpoint to
continue from (rollout actor, trainer rank), leaves nothing running or listening, and the same
command continues exactly: no group trained twice, none lost beyond the checkpoint.

Every fault comes from the run itself, at a point it passes (the test-only switches of
rlkit.common.fault_switch: the engine's after its N-th token, the rollout actor's and the
router's in rlkit/driver/rollout_fault.py, the trainer's in train/fault.py), never from a
kill the test times. A fatal fault holds there (`hold=1`) while the test records the live run's
process tree and listening ports, then fires; afterwards none of them may be left.

CI runs `CI_CASES` (one per process kind that stops the run; the router's restart rides on the
mode and colocation runs, tests/e2e/test_modes_tiny.py and test_train_tiny.py, and the engine's
on tests/e2e/test_engine_faults.py); `RLKIT_ALL_PROCESS_FAULTS=1` runs the whole table
(docs/reliability.md, "Any process of a run": each case and how long it takes).

With the `sync` policy a step trains exactly its batch, so an uninterrupted run's groups (the
`reference`, one run shared by the cases) are what a killed and resumed run must train, as a
multiset. Under `partial` the groups a step keeps are the first to finish on two racing
engines: the check is then each group at most once, each step its batch, and every group the
checkpoint parked trained after it or still buffered.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlkit.common.fault_switch import (
    ENGINE_FAULT_ENV,
    ROLLOUT_FAULT_ENV,
    ROUTER_FAULT_ENV,
    TRAINER_FAULT_ENV,
    read_fired,
)
from tests.e2e.test_trainer_crash import ROOT, buffer_state, held_run, train_cmd, trained

pytestmark = [pytest.mark.slow, pytest.mark.integration]

STEPS = 2
ALL = os.environ.get("RLKIT_ALL_PROCESS_FAULTS") == "1"


@dataclass(frozen=True)
class Case:
    process: str  # what dies: router, engine, rollout actor, trainer rank R
    phase: str  # where in the run (the switch's point)
    env: str
    spec: str  # the switch, without its folder
    who: str = ""  # a fatal case: how the one line names the process ("" = survived)
    during: str = ""  # ... and the phase
    step: int = 2  # the step the line names
    checkpoint: int | None = 1  # the checkpoint it names (None: none written yet)
    policy: str = "sync"
    overrides: tuple[str, ...] = ()
    # the victim is another process, SIGKILLed by the test when the armed one holds at its
    # point (a process whose command line starts with this): a death while nothing calls it
    kill_held: str | None = None

    @property
    def id(self) -> str:
        return f"{self.process.replace(' ', '_')}-{self.phase}" + ("" if self.policy == "sync" else f"-{self.policy}")


ROUTER = "router"
CASES = [
    # survived: the router comes back, its requests go on elsewhere with their tokens
    Case(ROUTER, "rollout", ROUTER_FAULT_ENV, "action=kill,phase=rollout,step=2,tokens=24"),
    Case(ROUTER, "rollout_hang", ROUTER_FAULT_ENV, "action=hang,phase=rollout,step=2,tokens=24"),
    Case(ROUTER, "idle", ROUTER_FAULT_ENV, "action=kill,phase=idle,step=1"),
    Case(ROUTER, "sync", ROUTER_FAULT_ENV, "action=kill,phase=sync,step=1"),
    Case("engine", "rollout", ENGINE_FAULT_ENV, "action=kill,tokens=24,version=1,unfinished=1"),
    # fatal: one line, nothing left, an exact resume
    Case("rollout actor", "startup", ROLLOUT_FAULT_ENV, "action=kill,phase=startup,hold=1",
         who="the rollout actor", during="start-up", step=1, checkpoint=None),
    Case("rollout actor", "rollout", ROLLOUT_FAULT_ENV, "action=kill,phase=rollout,step=2,tokens=24,hold=1",
         who="the rollout actor", during="the rollout"),
    Case("rollout actor", "rollout", ROLLOUT_FAULT_ENV, "action=kill,phase=rollout,step=2,tokens=24,hold=1",
         who="the rollout actor", during="the rollout", policy="partial"),
    Case("rollout actor", "sync", ROLLOUT_FAULT_ENV, "action=kill,phase=sync,step=2,hold=1",
         who="the rollout actor", during="the weight sync"),
    Case("rollout actor", "training", TRAINER_FAULT_ENV, "action=hold,phase=train,step=2",
         who="the rollout actor", during="training", kill_held="ray::RolloutActor"),
    Case("rollout actor", "checkpoint", ROLLOUT_FAULT_ENV, "action=kill,phase=checkpoint,step=1,hold=1",
         who="the rollout actor", during="the checkpoint write", step=1, checkpoint=None),
    Case("trainer rank 0", "startup", TRAINER_FAULT_ENV, "action=kill,phase=startup,hold=1",
         who="a trainer rank", during="start-up", step=1, checkpoint=None),
    Case("trainer rank 0", "between_steps", TRAINER_FAULT_ENV, "action=kill,phase=batch,step=2,hold=1",
         who="trainer rank 0", during="training"),
    Case("trainer rank 0", "logprobs", TRAINER_FAULT_ENV, "action=kill,phase=logprobs,step=2,hold=1",
         who="trainer rank 0", during="training"),
    Case("trainer rank 0", "train", TRAINER_FAULT_ENV, "action=kill,phase=train,step=2,hold=1",
         who="trainer rank 0", during="the optimizer step"),
    Case("trainer rank 0", "sync", TRAINER_FAULT_ENV, "action=kill,phase=sync,step=2,hold=1",
         who="trainer rank 0", during="the weight sync"),
    Case("trainer rank 0", "first_sync", TRAINER_FAULT_ENV, "action=kill,phase=sync,step=1,hold=1",
         who="trainer rank 0", during="the weight sync", step=1, checkpoint=None),
    Case("trainer rank 0", "checkpoint", TRAINER_FAULT_ENV, "action=kill,phase=checkpoint,step=1,hold=1",
         who="trainer rank 0", during="the checkpoint save", step=1, checkpoint=None),
    Case("trainer rank 1", "train", TRAINER_FAULT_ENV, "action=kill,phase=train,step=2,rank=1,hold=1",
         who="trainer rank 1", during="the optimizer step", overrides=("train.parallelism.data=2",)),
]
# one per process kind that stops the run (the survived ones ride on other runs in CI)
CI_CASES = {"rollout_actor-rollout-partial"}


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "RLKIT_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[tuple[str, ...], Counter]:
    """The groups uninterrupted `sync` runs train, per set of overrides (made when first asked)."""
    made: dict[tuple[str, ...], Counter] = {}

    def groups(overrides: tuple[str, ...]) -> Counter:
        if overrides not in made:
            tmp = tmp_path_factory.mktemp("reference")
            cmd = train_cmd(tmp, f"run.num_steps={STEPS}", "rollout.policy=sync", *overrides)
            ran = subprocess.run(cmd, cwd=ROOT, env=_env(tmp), capture_output=True, text=True, timeout=600)
            assert ran.returncode == 0, ran.stderr
            made[overrides] = Counter(g["group_id"] for g in trained(tmp / "grpo-tiny"))
        return made[overrides]

    return groups  # type: ignore[return-value]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_process_killed_at_a_phase(case: Case, tmp_path, reference):
    if not ALL and case.id not in CI_CASES:
        pytest.skip("the whole table runs with RLKIT_ALL_PROCESS_FAULTS=1 (CI runs "
                    f"{sorted(CI_CASES)} for its 20-minute budget)")
    folder = tmp_path / "fault"
    env = {**_env(tmp_path), case.env: f"{case.spec},dir={folder}"}
    out = tmp_path / "runs"
    run_dir = out / "grpo-tiny"
    cmd = train_cmd(out, f"run.num_steps={STEPS}", f"rollout.policy={case.policy}", *case.overrides)
    t0 = time.monotonic()

    if not case.who:  # survived: the run finishes as an uninterrupted one would
        ran = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert ran.returncode == 0, ran.stderr
        assert read_fired(folder) is not None, "the fault never fired"
        rows = _metrics(run_dir)
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        if case.process == ROUTER:
            assert max(r.get("router/restarts", 0) for r in rows) == 1, rows
        else:  # lost (its restart may still be starting when a 2-step run ends)
            assert max(r.get("engines/lost", 0) for r in rows) == 1, rows
        if case.phase.startswith("rollout") or case.process == "engine":  # its requests went on
            assert rows[1]["rollout/requests_relaunched"] > 0, rows[1]
        assert Counter(r["group_id"] for r in trained(run_dir)) == reference(case.overrides)
        print(f"{case.id}: survived in {time.monotonic() - t0:.0f} s")
        return

    killed, fired = held_run(cmd, env, folder, case.kill_held)
    assert killed.returncode == 1, killed.stderr
    assert "Traceback" not in killed.stderr, killed.stderr
    line = [x for x in killed.stderr.splitlines() if x.startswith("rlkit: ")]
    assert len(line) == 1, killed.stderr
    line = line[0]
    assert line.startswith(f"rlkit: {case.who} (pid {fired['pid']}) died during {case.during} ("), line
    assert f", in step {case.step} of {STEPS}. The run stopped (all its processes)" in line, line
    if case.checkpoint is None:
        assert "no checkpoint was written yet: run the same command again" in line, line
    else:
        assert (f"run the same command again (run.resume=auto) to continue from the checkpoint of "
                f"step {case.checkpoint} (") in line, line
    kill_s = time.monotonic() - t0
    print(line)
    done = case.checkpoint or 0
    ckpts = sorted((run_dir / "checkpoints").glob("step_*")) if (run_dir / "checkpoints").exists() else []
    parked = set()
    if ckpts:
        saved = buffer_state(ckpts[-1])
        parked = {g["group_id"] for g in saved["partial"] + saved["long"]}
    before = [r for r in trained(run_dir) if r["step"] <= done] if (run_dir / "groups.jsonl").exists() else []

    resumed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    rows = trained(run_dir)
    assert [r["step"] for r in rows] == sorted(r["step"] for r in rows)
    assert [r for r in rows if r["step"] <= done] == before  # the steps before the fault stand
    if case.policy == "sync":
        assert Counter(r["group_id"] for r in rows) == reference(case.overrides)  # none twice, none lost
    else:
        ids = [r["group_id"] for r in rows]
        assert len(ids) == len(set(ids)) == STEPS * 4  # none twice, each step its batch
        final = buffer_state(max((run_dir / "checkpoints").glob("step_*")))
        still = {g["group_id"] for g in final["partial"] + final["long"] + final["ready"]}
        after = {r["group_id"] for r in rows if r["step"] > done}
        assert parked <= after | still, ("a parked group was lost", parked - after - still)
    last = _metrics(run_dir)[-1]
    assert last["step"] == STEPS and last["buffer/balanced"]
    print(f"{case.id}: stopped in {kill_s:.0f} s, resumed in {time.monotonic() - t0 - kill_s:.0f} s")
