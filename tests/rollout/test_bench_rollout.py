"""`rlkit bench rollout`: registry policy specs, speed-ups and rounds in the summary. (A trace
file replayed on the real engines, `--trace`, is its row of tests/commands/test_cli_smoke.py.)"""

from __future__ import annotations

import argparse

import pytest

from rlkit.bench import rollout as bench
from rlkit.sim.trace import TraceSpec, generate_trace


def parse(*argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_specs_and_trace_slots_are_checked_before_any_engine_starts(tmp_path):
    specs = bench.policy_specs(parse("--policy", "sync,partial@1.5,tail_batching+resume"))
    assert specs["partial@1.5"].partial.over_provision == 1.5
    assert specs["tail_batching+resume"].tail_batching.deferred == "resume"
    with pytest.raises(SystemExit, match="unknown policy 'magic'"):
        bench.policy_specs(parse("--policy", "sync,magic"))
    trace = generate_trace(TraceSpec(rows=8, epochs=1, group_size=2, slots=2, cap=64))
    with pytest.raises(SystemExit, match="launches 3 responses per prompt but the trace has 2"):
        bench.check_trace_slots(trace, bench.policy_specs(parse("--policy", "tail_batching@1.5",
                                                                "--n", "2")))


def test_summary_speedup_and_rounds():
    def row(seconds, rnd="", tokens=100):
        return {"seconds": seconds, "tokens": tokens, "trained_tokens": 80, "completed": 2,
                "round": rnd, "max_response_length": 9, "resumed_token_share": 0.0,
                "carried_over": 0, "discarded": 20}

    trace = generate_trace(TraceSpec(rows=8, epochs=1, group_size=2, cap=64))
    out = bench.summarise({"sync": [row(2.0), row(2.0)],
                           "tail_batching": [row(0.5, "short"), row(2.5, "long")]},
                          vars(parse()), trace)
    tail = out["policies"]["tail_batching"]
    assert tail["speedup_vs_first"] == pytest.approx(4.0 / 3.0)
    assert tail["rounds"]["short"]["steps"] == 1 and tail["rounds"]["long"]["seconds_mean"] == 2.5
    assert "1 x 0.50 s" in bench.format_table(out)
