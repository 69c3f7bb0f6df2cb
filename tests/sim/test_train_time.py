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


def test_lora_skips_the_base_weight_gradients_and_syncs_the_adapters_alone():
    """train.lora priced: 4 FLOPs per frozen base parameter and token instead of 6 (no weight
    gradients), 6 per adapter parameter; an adapter sync sends the adapters and pauses nothing,
    a merged one the full weights."""
    kw = dict(params=1e9, gpus=4, peak_flops=1e15, mfu=0.5, recompute=False, reference_model=True,
              overhead_s=1.0, sync_overhead_s=0.5, sync_bandwidth=1e9, bytes_per_param=2)
    m = TrainTimeModel(**kw, lora_params=1e7, adapter_overhead_s=0.1)
    assert m.flops_per_token == pytest.approx(8e9 + 6e7)  # 2 + 2 + 2 (old) + 2 (reference)
    assert m.sync_bytes == 2e7 and m.sync_s() == pytest.approx(0.1 + 0.02)
    merged = TrainTimeModel(**kw, lora_params=1e7, lora_sync="merged")
    assert merged.sync_s() == pytest.approx(0.5 + 2.0)  # the full weights, paused
    assert merged.train_s(200_000) == m.train_s(200_000) < TrainTimeModel(**kw).train_s(200_000)
    with pytest.raises(ValueError, match="lora_sync"):
        TrainTimeModel(params=1e9, gpus=1, lora_sync="both")
