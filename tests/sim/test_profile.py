"""Engine profiles: the shared JSON format, interpolation, the packaged GPU-like profiles."""

from __future__ import annotations

import json

import pytest

from rlkit.rollout.engines.profile import (
    EngineProfile, ProfileError, constant_profile, load_profile, packaged_profiles, save_profile,
)


def test_ptl_interpolates_between_measured_batch_sizes_and_adds_the_kv_term():
    p = constant_profile([0.01, 0.03], [1, 5], kv_s_per_token=1e-6)
    assert p.ptl(1) == pytest.approx(0.01)
    assert p.ptl(3) == pytest.approx(0.02)
    assert p.ptl(3, kv_tokens=1000) == pytest.approx(0.021)
    assert p.ptl(50) == pytest.approx(0.03)  # flat beyond the last measured batch


def test_the_bench_engine_format_loads(tmp_path):
    """The minimal format `rlkit bench engine` writes (no optional keys)."""
    data = {"name": "cpu", "source": "rlkit bench engine", "device": "cpu", "model": "tiny",
            "batch_sizes": [1, 2, 8], "ptl_s": [0.01, 0.012, 0.03], "prefill_s_per_token": 1e-4}
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(data))
    p = load_profile(path)
    assert p.batch_limit == 8 and p.kv_s_per_token == 0 and p.kv_capacity_tokens is None
    assert p.to_json() == data
    save_profile(p, tmp_path / "again.json")
    assert load_profile(tmp_path / "again.json") == p


@pytest.mark.parametrize("broken, message", [
    ({"ptl_s": [0.01]}, "equally long"),
    ({"batch_sizes": [2, 1, 3]}, "increasing"),
    ({"ptl_s": [0.01, -1, 0.02]}, "positive"),
])
def test_malformed_profiles_are_refused(tmp_path, broken, message):
    data = {"name": "x", "source": "s", "device": "d", "model": "m", "batch_sizes": [1, 2, 3],
            "ptl_s": [0.01, 0.02, 0.03], "prefill_s_per_token": 0.0, **broken}
    path = tmp_path / "x.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=message):
        load_profile(path)


def test_missing_keys_and_unknown_names_are_named():
    with pytest.raises(ProfileError, match="missing key"):
        EngineProfile.from_json({"name": "x"})
    with pytest.raises(ProfileError, match="packaged profiles"):
        load_profile("no-such-profile")


def test_packaged_gpu_profiles_document_their_derivation():
    names = packaged_profiles()
    assert "h100-qwen3-4b-tp2-april" in names and "h100-qwen3-4b-tp1" in names
    for name in names:
        p = load_profile(name)
        assert "published" in p.source and "derivation" in p.extra
        assert p.kv_capacity_tokens and p.kv_s_per_token > 0
        # decode is memory-bound at small batch: a bigger batch raises throughput
        assert p.peak_throughput(1000)[0] > 8 / p.ptl(1, 1000)


def test_peak_throughput_respects_the_kv_capacity():
    p = constant_profile([0.01, 0.02], [1, 100], kv_capacity_tokens=1000, max_running_requests=100)
    tput, batch = p.peak_throughput(mean_context=100)
    assert batch == 10  # 10 requests x 100 tokens fill the cache
    assert tput == pytest.approx(10 / p.ptl(10, 1000))


def test_prefill_forward_cost_and_kv_slope_per_batch(tmp_path):
    prof = constant_profile([0.01, 0.02], [1, 5], prefill_s_per_forward=0.001,
                            prefill_s_per_token=1e-5, prefill_s_per_token_sq=1e-7,
                            max_prefill_tokens=64)
    assert prof.prefill_forward_s([]) == 0.0
    assert prof.prefill_forward_s([10, 30]) == pytest.approx(0.001 + 1e-5 * 40 + 1e-7 * 1000)
    assert prof.prefill_forward_s([10, 30], padded=True) == pytest.approx(
        0.001 + 1e-5 * 60 + 1e-7 * 1800)
    by_batch = EngineProfile.from_json({**prof.to_json(), "kv_s_per_token_by_batch": [1e-6, 5e-6]})
    assert by_batch.kv_s(3) == pytest.approx(3e-6)
    assert by_batch.ptl(3, 100) == pytest.approx(0.015 + 3e-4)
    path = tmp_path / "p.json"
    save_profile(by_batch, path)
    again = load_profile(path)
    assert again == by_batch and again.max_prefill_tokens == 64
    with pytest.raises(ProfileError, match="kv_s_per_token_by_batch"):
        EngineProfile.from_json({**prof.to_json(), "kv_s_per_token_by_batch": [1e-6]})


def test_ptl_fit_recovers_the_step_time_model_and_floors_noise():
    from rlkit.sim.measure_hf import fit_ptl

    rows = [{"batch": b, "kv_tokens": kv, "s": 0.01 * b + 2e-6 * kv}
            for b in (1, 4) for kv in (100, 1000, 5000)]
    ptl, slope = fit_ptl(rows, [1, 4], "s")
    assert ptl == pytest.approx([0.01, 0.04]) and slope == pytest.approx([2e-6, 2e-6])
    noisy = [{"batch": 1, "kv_tokens": kv, "s": s} for kv, s in ((100, 0.05), (5000, 0.01))]
    ptl, slope = fit_ptl(noisy, [1], "s")  # falling with context: no negative slope
    assert slope == [0.0] and ptl[0] >= 0.005
