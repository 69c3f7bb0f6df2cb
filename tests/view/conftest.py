"""A simulator run folder (a timeline with trainer phases, no recipe) for the viewer's tests."""

from __future__ import annotations

import pytest

from rlkit.rollout.engines.profile import constant_profile
from rlkit.rollout.policies import PartialPolicy
from rlkit.sim.engine import SimConfig
from rlkit.sim.simulate import run_simulation
from rlkit.sim.trace import TraceSpec, generate_trace
from rlkit.sim.train_time import TrainTimeModel

PROFILE = constant_profile([0.005, 0.01], [1, 32], prefill_s_per_token=1e-5)


def simulate_run(folder, steps: int = 3, batch_size: int = 4, engines: int = 2, rows: int = 64,
                 mode: str = "sync"):
    trace = generate_trace(TraceSpec(rows=rows, epochs=2, cap=1024, group_size=4, batch_size=batch_size))
    return run_simulation(SimConfig(engines, PROFILE), trace, PartialPolicy(2.0), steps=steps,
                          batch_size=batch_size, timeline_path=folder / "timeline.jsonl",
                          train=TrainTimeModel(params=1e8, gpus=1, overhead_s=0.5, sync_overhead_s=0.3),
                          mode=mode)


@pytest.fixture(scope="session")
def sim_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("simrun")
    results = simulate_run(folder)
    return folder, results
