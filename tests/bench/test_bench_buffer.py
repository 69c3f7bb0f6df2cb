"""The buffer bench runs end to end (figures are reported by `rlkit bench buffer`, not asserted)."""

from rlkit.bench.buffer import TARGET_OPS, bench_buffer, format_table


def test_buffer_bench_reports_every_operation():
    r = bench_buffer(groups=50, samples=8, tokens=4096, rounds=1)
    assert set(TARGET_OPS) <= set(r["ops_per_s"])
    assert all(v > 0 for v in r["ops_per_s"].values())
    assert "| put |" in format_table(r)
