"""`rlkit bench faults` at tiny scale: faults injected into simulated engines while the real
manager, buffer and health monitor run; what survives and what is lost (virtual time).

Three manager bugs the bench found are pinned below as regression tests."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from rlkit.bench.faults import FaultBench, invariants
from rlkit.bench.suite import make_policy
from rlkit.cli import main
from rlkit.sim.simulate import run_simulation
from rlkit.rollout.config import HealthConfig
from rlkit.rollout.manager import batch_target
from rlkit.rollout.policies import PartialPolicy, SyncPolicy
from rlkit.sim.clock import run_virtual
from rlkit.sim.engine import SimConfig
from rlkit.sim.faults import Fault, random_faults
from rlkit.rollout.engines.profile import load_profile
from rlkit.sim.trace import TraceSpec, generate_trace
from rlkit.sim.train_time import TrainTimeModel
from tests.manager.test_engine_faults import make

PROFILE = "h100-qwen3-4b-tp1"


@pytest.fixture(autouse=True)
def _quiet_monitor():
    logging.getLogger("rlkit.rollout.health").setLevel(logging.ERROR)
    yield
    logging.getLogger("rlkit.rollout.health").setLevel(logging.NOTSET)


@pytest.fixture(scope="module")
def tiny():
    cluster = SimConfig(3, load_profile(PROFILE), abort_latency_s=0.2)
    trace = generate_trace(TraceSpec(rows=256, epochs=2, group_size=4, cap=2048, seed=0,
                                     batch_size=8))
    return cluster, trace, TrainTimeModel(params=4.02e9, gpus=1, mfu=0.35)


def bench(tiny, **kw) -> FaultBench:
    cluster, trace, train = tiny
    args = dict(health=HealthConfig(), batch_size=8, steps=4, restart_s=20.0, seed=0)
    args.update(kw)
    return FaultBench(cluster, trace, train, **args)


def test_no_fault_simulate_equals_simulate_without_the_new_arguments(tiny):
    cluster, trace, train = tiny
    kw = dict(steps=3, batch_size=8, train=train, final_step=False)
    plain = run_simulation(cluster, trace, make_policy("partial@1.5"), **kw)
    watched = run_simulation(cluster, trace, make_policy("partial@1.5"), health=HealthConfig(),
                             faults=[], **kw)
    assert [r.to_json() for r in watched] == [r.to_json() for r in plain]


def test_faults_without_a_monitor_are_refused(tiny):
    cluster, trace, train = tiny
    with pytest.raises(ValueError, match="health monitor"):
        run_simulation(cluster, trace, SyncPolicy(), steps=1, batch_size=8,
                       health=HealthConfig(enabled=False), faults=[Fault(1.0, "kill")])


def test_fault_schedule_is_seeded_and_checked():
    assert random_faults(3, 4, 100.0, 4) == random_faults(3, 4, 100.0, 4)
    assert random_faults(3, 4, 100.0, 4) != random_faults(4, 4, 100.0, 4)
    assert all(0 <= f.at_s < 100 and 0 <= f.worker < 4 for f in random_faults(1, 20, 100.0, 4))
    with pytest.raises(ValueError, match="unknown fault kind"):
        Fault(1.0, "reboot")  # type: ignore[arg-type]


@pytest.mark.parametrize("scenario", ["kill", "hang", "mixed"])
def test_sync_survives_faults_losing_only_a_hung_step_in_flight(tiny, scenario):
    rows = bench(tiny).run(["sync"], ["baseline", scenario])
    base, row = rows
    assert base.problems == [] and base.requests_relaunched == 0 and base.slowdown == 1.0
    assert row.problems == [], row.problems
    assert row.steps_completed == row.steps and row.outcome == "completed"
    assert row.groups_dropped == 0 and row.groups_lost == 0 and row.tokens_lost == 0
    assert row.engine_tokens == row.tokens_accounted
    assert row.injected >= 1 and row.engines_lost == len(row.detect_s) <= row.injected
    if scenario == "kill":  # a killed engine's streams break at once: it loses nothing
        assert row.tokens_lost_in_flight == 0
    assert row.restarted == len(row.back_s)
    # a restart comes back no sooner than its backoff + start after the loss was detected
    for detect, back in zip(row.detect_s, row.back_s):
        assert back >= detect + 20.0


def test_detection_times_follow_the_health_config(tiny):
    """A kill is found by the next probe (or at once by a failed request); a hang after
    `hung_after_timeouts` probes time out."""
    h = HealthConfig(interval_s=2.0, probe_timeout_s=10.0, hung_after_timeouts=2)
    b = bench(tiny, health=h)
    kill = b.run_one("sync", "kill", [Fault(10.0, "kill", 0)])
    hang = b.run_one("sync", "hang", [Fault(10.0, "hang", 1)])
    assert kill.detect_s and all(0 <= d <= h.interval_s for d in kill.detect_s)
    assert hang.detect_s and all(
        h.probe_timeout_s * h.hung_after_timeouts <= d
        <= h.interval_s + h.probe_timeout_s * h.hung_after_timeouts + h.interval_s
        for d in hang.detect_s)


def test_every_engine_down_mid_step_stops_with_every_group_parked(tiny):
    """(Killed between steps instead, the next step drops its groups: the third bug below.)"""
    row = bench(tiny).run_one("sync", "all-down", [Fault(1.0, "kill", 0)] * 3)
    assert row.outcome.startswith("EnginesDown"), row.outcome
    assert row.restarted == 0 and row.engines_lost == 3
    assert row.groups_in_flight == 0 and row.groups_dropped == 0 and row.groups_lost == 0
    assert row.groups_parked > 0 and row.tokens_lost == 0
    assert row.problems == []


def test_the_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "report"  # --out is a folder (created): faults.json and faults.md in it
    code = main(["bench", "faults", "--cap", "2048", "--prompts", "256", "--batch-size", "8",
                 "--group-size", "4", "--engines", "3", "--profile", PROFILE, "--steps", "3",
                 "--train-gpus", "1", "--policies", "sync", "--scenarios", "baseline,kill",
                 "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "| sync | baseline |" in text and "| sync | kill |" in text
    rows = json.loads((out / "faults.json").read_text())["rows"]
    assert "| sync | kill |" in (out / "faults.md").read_text()
    assert [r["scenario"] for r in rows] == ["baseline", "kill"]
    assert all(invariants_ok(r) for r in rows)


def invariants_ok(r: dict) -> bool:
    return r["groups_lost"] == 0 and r["tokens_lost"] == 0 and r["problems"] == []


def test_invariants_name_what_broke():
    from rlkit.bench.faults import FaultRow

    row = FaultRow("p", "all-down", 4, [], steps_completed=1, outcome="EnginesFailing: x",
                   groups_dropped=2)
    assert invariants(row) == ["2 groups dropped", "ended with EnginesFailing, not EnginesDown"]


# -- regressions: three manager bugs the bench found (fixed) --------------------------------

def _partial_with_a_hang(health: HealthConfig):
    buf, sim, monitor, mgr = make(PartialPolicy(over_provision=2.0), engines=4, rows=40, n=2,
                                  health=health)

    async def hang_soon():
        await asyncio.sleep(0.25)  # requests are on it by then
        sim.hang(sim.workers()[1])

    async def main():
        task = asyncio.ensure_future(hang_soon())
        try:
            for v in range(3):
                await mgr.run_step(batch_target(buf, 4), v)
                buf.take(4, timeout=0)
        finally:
            task.cancel()
            await mgr.close()
            await sim.aclose()

    run_virtual(main)
    return buf


def test_an_engine_lost_during_the_abort_parks_its_groups():
    buf = _partial_with_a_hang(HealthConfig())  # defaults: 2 s interval, 10 s probe timeout
    assert buf.stats()["dropped_by_reason"] == {}


def test_a_hung_engine_found_by_the_watch_during_the_abort_does_not_fail_the_step():
    _partial_with_a_hang(HealthConfig(interval_s=1.0, probe_timeout_s=2.0))


def test_a_step_started_with_every_engine_down_parks_and_stops():
    buf, sim, monitor, mgr = make(SyncPolicy(), restart_s=None)

    async def main():
        monitor.start()
        for w in sim.workers():
            sim.kill(w)
        await asyncio.sleep(5)  # the probes find both dead; no restart
        try:
            await mgr.run_step(8, 0)
        finally:
            await mgr.close()
            await sim.aclose()

    from rlkit.rollout.health import EnginesDown
    with pytest.raises(EnginesDown):
        run_virtual(main)
    assert buf.stats()["dropped"] == 0
