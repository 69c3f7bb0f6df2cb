"""`rlkit bench train` runs end to end on the tiny model and reports positive figures."""

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_bench_train_tiny(monkeypatch):
    from rlkit.bench.train import bench_train, format_table

    result = bench_train(models=["tiny"], tps=[1], steps=1, cpus=2, compare_padding=True,
                         sync_model="tiny", sync_rounds=2, engines=None)
    (train,) = result["training"]
    assert train["train_tokens_per_s"] > 0 and train["padding_fraction"] == 0.0
    (packing,) = result["packing"]
    assert packing["padded_padding_fraction"] > 0.3 and packing["packed_padding_fraction"] < 0.05
    methods = {r["method"]: r for r in result["weight_sync"]}
    assert set(methods) == {"distributed", "disk"}
    assert all(r["gb"] > 0 and r["seconds_per_gb"] > 0 for r in methods.values())
    assert "train tok/s" in format_table(result)
