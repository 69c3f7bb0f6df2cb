"""The training-time model is the stated formula."""

import pytest

from rlkit.sim.train_time import TrainTimeModel


def test_train_and_sync_time():
    m = TrainTimeModel(params=1e9, gpus=4, peak_flops=1e15, mfu=0.5, recompute=False,
                       reference_model=True, overhead_s=1.0, sync_overhead_s=0.5,
                       sync_bandwidth=1e9, bytes_per_param=2)
    assert m.flops_per_token == 10e9  # 6 + 2 (old logprobs) + 2 (reference)
    assert m.tokens_per_s == pytest.approx(4 * 1e15 * 0.5 / 10e9)
    assert m.train_s(200_000) == pytest.approx(1.0 + 1.0)
    assert m.sync_s() == pytest.approx(0.5 + 2.0)
    assert m.sync_step_s(10.0, 200_000) == pytest.approx(10 + 2 + 2.5)
    with pytest.raises(ValueError):
        TrainTimeModel(params=1e9, gpus=1, mfu=0)
