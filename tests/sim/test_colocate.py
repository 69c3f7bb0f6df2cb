"""Colocated placement in the simulator: the real sync loop with Run(colocated=True), whose
turns (engines sleep, trainer onloads; trainer offloads, engines wake with the new weights)
take a ColocationModel's time (rlkit/sim/train_time.py)."""

from __future__ import annotations

import pytest

from rlkit.rollout.engines.profile import constant_profile
from rlkit.rollout.policies import PartialPolicy, SyncPolicy
from rlkit.sim.engine import SimConfig
from rlkit.sim.simulate import run_simulation
from rlkit.sim.trace import TraceSpec, generate_trace
from rlkit.sim.train_time import ColocationModel, TrainTimeModel

TRACE = generate_trace(TraceSpec(rows=128, epochs=2, cap=1024, group_size=4, batch_size=8))
PROFILE = constant_profile([0.004, 0.005, 0.008], [1, 16, 64], prefill_s_per_token=2e-5,
                           kv_s_per_token=2e-8, max_running_requests=64)
TRAIN = TrainTimeModel(params=1e9, gpus=2)


def test_turn_costs_are_the_stated_formula():
    m = ColocationModel(params=4e9, gpus=8, model_parallel=2, host_bandwidth=20e9,
                        release_s=0.5, weights_resume_s=0.1, kv_resume_s=1.0,
                        update_bandwidth=100e9, update_overhead_s=0.5)
    assert m.state_bytes_per_gpu == pytest.approx(18 * 4e9 / 2)  # DP replicas hold a copy each
    assert m.sleep_s() == pytest.approx(0.5 + 36e9 / 20e9)
    assert m.update_s() == pytest.approx(0.5 + 8e9 / 100e9)
    assert m.wake_s() == pytest.approx(36e9 / 20e9 + 0.1 + m.update_s() + 1.0)
    assert m.turn_s() == pytest.approx(m.sleep_s() + m.wake_s())
    # a distributed optimizer shards master weights and Adam over every GPU
    d = ColocationModel(params=4e9, gpus=8, model_parallel=2, distributed_optimizer=True)
    assert d.state_bytes_per_gpu == pytest.approx(6 * 4e9 / 2 + 12 * 4e9 / 8)
    # LoRA: the base's bf16 weights and the adapters', gradients and Adam for the adapters alone
    lora = ColocationModel(params=4e9, gpus=8, model_parallel=2, lora_params=4e7)
    assert lora.state_bytes_per_gpu == pytest.approx((2 * 4.04e9 + 16 * 4e7) / 2)
    with pytest.raises(ValueError, match="not a multiple of the model-parallel size 4"):
        ColocationModel(params=1e9, gpus=6, model_parallel=4)


@pytest.mark.parametrize("policy", [SyncPolicy(), PartialPolicy(2.0)], ids=["sync", "partial"])
def test_colocated_step_is_rollout_plus_turns_plus_train(policy):
    colo = ColocationModel(params=TRAIN.params, gpus=TRAIN.gpus)
    steps = run_simulation(SimConfig(2, PROFILE), TRACE, policy, steps=3, batch_size=8,
                           train=TRAIN, placement="colocated", colocation=colo)
    for r in steps:
        assert r.placement == "colocated"
        # (train_s: the trainer's slowest data-parallel replica, at least the even share)
        assert r.train_s >= TRAIN.train_s(r.train_tokens) - 1e-9
        expected = r.rollout_s + colo.sleep_s() + r.train_s + colo.wake_s()
        assert r.step_s == pytest.approx(expected, rel=1e-9, abs=1e-9)
        # Run's own measures of the turns, and the model's parts, are in the step's row
        assert r.turn["colocate/sleep_seconds"] == pytest.approx(colo.sleep_s())
        assert r.turn["colocate/wake_seconds"] == pytest.approx(colo.wake_s())
        assert r.turn["colocate/onload_seconds"] == pytest.approx(colo.move_s())
        assert r.turn["colocate/update_seconds"] == pytest.approx(colo.update_s())
        assert r.waited_train_s == pytest.approx(r.step_s - r.rollout_s)


def test_disaggregated_is_unchanged_and_has_no_turns():
    [d] = run_simulation(SimConfig(2, PROFILE), TRACE, SyncPolicy(), steps=1, batch_size=8,
                         train=TRAIN)
    [c] = run_simulation(SimConfig(2, PROFILE), TRACE, SyncPolicy(), steps=1, batch_size=8,
                         train=TRAIN, placement="colocated")
    assert d.placement == "disaggregated" and d.turn == {}
    assert d.step_s == pytest.approx(d.rollout_s + d.train_s + TRAIN.sync_s())
    assert d.train_s >= TRAIN.train_s(d.train_tokens) - 1e-9  # the slowest replica
    # the same rollout (engines do not sleep mid-step); the sync is replaced by the turns
    colo = ColocationModel(params=TRAIN.params, gpus=TRAIN.gpus)
    assert c.rollout_s == d.rollout_s
    assert c.step_s - d.step_s == pytest.approx(colo.turn_s() - TRAIN.sync_s())


@pytest.mark.parametrize("kw, message", [
    (dict(mode="async"), "cannot run mode 'async'"),
    (dict(mode="stream"), "cannot run mode 'stream'"),
    (dict(train=TrainTimeModel(params=1e9, gpus=4)),
     "2 engines use 2 GPUs but the trainer has 4"),
    (dict(colocation=ColocationModel(params=1e9, gpus=1)),
     "2 engines use 2 GPUs but the turn model has 1"),
    (dict(train=None), "needs `train` or `colocation`"),
    (dict(placement="shared"), "unknown placement 'shared'"),
])
def test_colocated_refuses_what_it_cannot_run(kw, message):
    args = {"train": TRAIN, "placement": "colocated", **kw}
    with pytest.raises(ValueError, match=message):
        run_simulation(SimConfig(2, PROFILE), TRACE, SyncPolicy(), steps=1, batch_size=8, **args)
