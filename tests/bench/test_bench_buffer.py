"""The buffer bench runs end to end (figures are reported by `rlkit bench buffer`, not asserted)."""

from rlkit.bench.buffer import TARGET_OPS, bench_buffer, format_table


def test_buffer_bench_reports_every_operation():
    r = bench_buffer(groups=50, samples=8, tokens=4096, rounds=1)
    assert set(TARGET_OPS) <= set(r["ops_per_s"])
    assert all(v > 0 for v in r["ops_per_s"].values())
    assert "| put |" in format_table(r)


def test_more_groups_out_at_once_than_a_small_data_set_has_rows():
    """The bench holds every group of a round out at once (acquired, then requeued and resumed).
    The buffer never hands out a row that is already out, so the bench's prompt source needs a
    row per group: with a fixed 64-row source, acquire(1) returned [] from the 65th group on and
    the default `rlkit bench buffer` (2,000 groups) died with an IndexError."""
    r = bench_buffer(groups=200, samples=2, tokens=16, rounds=1)
    assert r["groups"] == 200 and all(v > 0 for v in r["ops_per_s"].values())
