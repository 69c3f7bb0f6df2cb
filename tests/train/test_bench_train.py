"""`rlkit bench train` runs end to end on the tiny model and reports positive figures."""

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_bench_train_tiny(monkeypatch, tmp_path):
    from rlkit.bench.train import bench_train, format_table

    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path))  # build the tiny model here, not in ~/.cache
    result = bench_train(models=["tiny"], tps=[1], steps=1, cpus=2, compare_padding=True, packing_rounds=2,
                         sync_model="tiny", sync_rounds=2, sync_receivers=["loopback", "engine"])
    (train,) = result["training"]
    assert train["train_tokens_per_s"] > 0 and 0.0 <= train["padding_fraction"] < 0.3
    (packing,) = result["packing"]
    layouts = packing["layouts"]
    assert layouts["padded"]["padding_fraction"] > 0.3
    assert layouts["packed-longest"]["padding_fraction"] < layouts["padded"]["padding_fraction"]
    assert layouts["packed-2048"]["padding_fraction"] < 0.05
    assert {(r["method"], r["receivers"]) for r in result["weight_sync"]} == {
        (m, r) for m in ("distributed", "disk") for r in ("loopback", "engine")}
    assert all(r["gb"] > 0 and r["seconds_per_gb"] > 0 for r in result["weight_sync"])
    assert "train tok/s" in format_table(result)
