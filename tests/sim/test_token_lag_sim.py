"""The simulator's SimulatedStep carries the trained tokens' lag (it runs the real loops), and
rollout.max_token_lag bounds it there as in a run: partial rollouts then wait for the groups on
their last chance instead of restarting them."""

import pytest

from rlkit.bench.suite import make_policy
from rlkit.buffers.staleness import lag_counts
from rlkit.rollout.engines.profile import load_profile
from rlkit.sim.engine import SimConfig
from rlkit.sim.simulate import run_simulation
from rlkit.sim.trace import TraceSpec, generate_trace
from rlkit.sim.train_time import TrainTimeModel


@pytest.fixture(scope="module")
def trace():
    return generate_trace(TraceSpec(rows=256, epochs=2, cap=2048, group_size=4, batch_size=8))


def simulate(trace, mode, bound):
    batches = []
    steps = run_simulation(
        SimConfig(engines=2, profile=load_profile("h100-qwen3-4b-tp1")), trace,
        make_policy("partial@2.0"), steps=10, batch_size=8, mode=mode, max_token_lag=bound,
        train=TrainTimeModel(params=4e9, gpus=1),
        on_batch=lambda version, groups: batches.append(lag_counts(
            [s for g in groups for s in g.samples], version)))
    return steps, batches


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_each_step_reports_the_lag_of_what_it_trained_and_the_bound_holds(trace, mode):
    free, batches = simulate(trace, mode, None)
    assert [(s.trained_lag_tokens, s.trained_max_lag) for s in free] == batches
    assert max(s.trained_max_lag for s in free) > 2  # unbounded, partial rollouts lag further
    assert sum(s.lag_restarts for s in free) == 0
    bounded, batches = simulate(trace, mode, 2)
    assert [(s.trained_lag_tokens, s.trained_max_lag) for s in bounded] == batches
    assert max(s.trained_max_lag for s in bounded) <= 2
    # partial waits for a group on its last chance rather than parking it to be restarted
    assert sum(s.lag_restarts for s in bounded) == sum(s.lag_restart_tokens for s in bounded) == 0
    assert sum(s.rollout_s for s in bounded) > sum(s.rollout_s for s in free)  # the price
    if mode == "async":  # generated with the weights one version behind the trainer's
        assert sum(s.trained_lag_tokens[1] for s in bounded) > 0
