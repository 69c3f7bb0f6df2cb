"""`rlkit bench train --length-mix`: micro-batches by count vs by token budget on a long-tail
batch (two TrainerGroups over Ray, gloo), end to end at the smallest sizes, and the figures it
derives (the slowest replica's share, the planner's view, process memory).

The end-to-end run is at DP=1 (`--mix-dp 1`: two one-rank groups, ~9 s here): the bench's
default DP=2 starts four ranks, whose setup alone takes ~9 s on two cores (~14 s in all), over
the CI budget. What DP=2 adds is the per-replica timing (`timed_accumulate` returns one figure
per replica, DP=1 has one) and the share computed from it, tested here on its own."""

from __future__ import annotations

import json
import os

import pytest

from rlkit.bench.train_length_mix import (
    cost_share, format_length_mix_table, length_mix_batch, mix_kinds, mix_train_config, plan_figures,
    process_memory_mb, slowest_share, split_weight,
)
from rlkit.common.errors import UserError
from rlkit.cli import main


def test_slowest_share_is_the_slowest_over_the_mean():
    assert slowest_share([2.0, 2.0]) == 1.0
    assert slowest_share([1.0, 3.0]) == pytest.approx(1.5)
    assert slowest_share([4.0]) == 1.0
    assert slowest_share([0.0, 0.0]) == 1.0
    assert slowest_share([1.0, 2.0, 3.0]) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        slowest_share([])


def test_the_batch_is_capped_prompt_included_and_the_budget_bounds_the_plan():
    batch = length_mix_batch(512, samples=40, prompt=16, median=64, sigma=1.5, cap=300)
    lengths = [s.length for s in batch.samples]
    assert max(lengths) == 300 and min(lengths) >= 16 + 4  # the tail reaches the cap
    by_tokens = plan_figures(batch, mix_train_config("by-tokens", dp=2, micro_batch_size=4, max_tokens=300), 0.001)
    by_count = plan_figures(batch, mix_train_config("by-count", dp=2, micro_batch_size=4, max_tokens=300), 0.001)
    assert by_tokens["largest_micro_batch"]["tokens"] <= 300
    assert by_tokens["largest_micro_batch"]["slots"] < 3 * 300
    assert by_count["largest_micro_batch"]["slots"] >= 300  # a row as wide as the longest sample
    assert sum(by_count["samples_per_replica"]) == sum(by_tokens["samples_per_replica"]) == 40
    assert by_count["planned_share"] >= 1.0 and by_tokens["layout_share"] >= 1.0


def test_the_split_by_tokens_alone_is_the_old_rule_and_costs_more_on_a_long_tail():
    # the split before issue 23: longest first by length, w = 0; the cost planner's: n + w n^2
    batch = length_mix_batch(512, samples=64, prompt=32, median=512, sigma=1.2, cap=8192)
    cfg = mix_train_config("by-count-split-by-tokens", dp=2, micro_batch_size=4, max_tokens=8192)
    assert cfg == mix_train_config("by-count", dp=2, micro_batch_size=4, max_tokens=8192)
    w = 1 / 830  # the tiny model's attention weight
    assert split_weight("by-count-split-by-tokens", w) == 0.0 and split_weight("by-count", w) == w
    by_tokens_alone, by_cost = cost_share(batch, cfg, 0.0, w), cost_share(batch, cfg, w, w)
    assert by_cost == plan_figures(batch, cfg, w)["planned_share"] < 1.01
    assert by_tokens_alone > by_cost  # the attention term it ignores unbalances it
    assert plan_figures(batch, cfg, 0.0)["planned_share"] < 1.01  # balanced by its own measure


def test_mix_configs_are_named_from_the_list():
    assert mix_kinds("by-tokens,by-count,by-tokens") == ("by-tokens", "by-count")
    for bad in ("", "by-count,by-rows"):
        with pytest.raises(UserError, match="--mix-configs .*by-count-split-by-tokens"):
            mix_kinds(bad)


def test_process_memory_of_this_process():
    m = process_memory_mb(os.getpid())
    if m["rss_mb"] is None:
        pytest.skip("no /proc here")
    assert 0 < m["rss_mb"] <= m["peak_rss_mb"]


@pytest.mark.slow
@pytest.mark.integration
def test_length_mix_end_to_end(tmp_path, capsys):
    out = tmp_path / "mix"
    rc = main(["bench", "train", "--length-mix", "--mix-dp", "1", "--mix-samples", "6", "--mix-cap",
               "256", "--mix-median", "48", "--mix-max-tokens", "256", "--mix-micro-batch-size", "2",
               "--steps", "1", "--cpus", "2", "--mix-configs", "by-count,by-tokens",
               "--out", str(out)])
    stdout = capsys.readouterr().out
    assert rc == 0
    r = json.loads((out / "train.json").read_text())
    m = r["length_mix"]
    assert m["dp"] == 1 and m["samples"] == 6 and m["longest"] <= 256
    assert set(m["configs"]) == {"by-count", "by-tokens"}
    for kind, c in m["configs"].items():
        assert c["train_tokens_per_s"] > 0 and c["train_tokens_per_s_median"] > 0, kind
        (peak,) = c["peak_rss_mb"]  # one rank
        assert peak > 0 and c["rss_growth_mb"][0] >= 0, kind
        assert len(c["step_s_all"]) == 1 and len(c["replica_s_all"][0]) == 1, kind
        assert 0 < c["replica_s_all"][0][0] < c["step_s_all"][0], kind
        assert c["slowest_share"] >= 1.0, kind
        assert c["step_micro_batches"] == c["micro_batches_per_replica"], kind
    assert m["configs"]["by-tokens"]["largest_micro_batch"]["tokens"] <= 256
    assert m["configs"]["by-count"]["config"] == {"micro_batch_size": 2}
    assert stdout.strip() == (out / "train.md").read_text().strip() == format_length_mix_table(r)
    assert "by-count 2" in stdout and "by-tokens 256" in stdout


def test_a_configuration_killed_for_memory_is_a_row_and_a_note():
    """The node's memory can end a configuration (Ray kills a rank at 95%): the table says so,
    with the memory its ranks were seen at, and keeps the other configuration's figures."""
    planned = {"micro_batches_per_replica": 8, "largest_micro_batch": {"tokens": 13732, "mask_entries": 1.3e8},
               "planned_share": 1.0, "cost_share": 1.0, "layout_share": 1.143}
    ok = {**planned, "config": {"max_tokens_per_micro_batch": 8192}, "padding_fraction": 0.1, "step_s": 30.0,
          "train_tokens_per_s": 2000.0, "train_tokens_per_s_median": 1900.0, "peak_rss_mb": [5000.0, 5100.0],
          "slowest_share": 1.05}
    killed = {**planned, "config": {"micro_batch_size": 4}, "failed": "OutOfMemoryError: 2 worker(s) were killed",
              "failed_in_round": 0, "rss_sampled_max_mb": [9660.0, 10700.0], "peak_rss_mb": [None, None]}
    result = {
        "length_mix": {"model": "tiny", "dp": 2, "samples": 64, "tokens": 73891, "median_length": 630,
                       "longest": 8192, "cap": 8192, "steps": 2,
                       "configs": {"by-count": killed, "by-tokens": ok}},
        "conditions": {"cpus": 2, "ray_cpus": 2, "memory_gb": 25.3, "loadavg_before": [0.1], "loadavg_after": [2.0],
                       "wall_s": 200.0, "note": "shared machine"},
    }
    table = format_length_mix_table(result)
    assert "by-count 4" in table and "failed in round 0" in table and "9660/10700 MB" in table
    assert "OutOfMemoryError" in table
    assert "2000.0" in table and "5000/5100" in table and "1.050" in table
    assert "1.143" in table  # the layout plan
