"""Long-tail traces: the published length figures, determinism, the jsonl format."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlkit.sim.trace import (Trace, TraceError, TraceSpec, bimodal_spec, generate_trace,
                             length_stats)


@pytest.fixture(scope="module")
def trace16k() -> Trace:
    return generate_trace(TraceSpec(rows=2048, epochs=1, cap=16384, group_size=8, seed=0))


def test_lengths_match_the_published_distributions_at_a_16k_cap(trace16k):
    """docs/facts.md: P75 755-1.1k, maxima at the cap, std 4,000-4,500 across a batch and under
    1,500 within one prompt's group."""
    s = length_stats(trace16k)
    assert 755 <= s["p75"] <= 1100
    assert s["max"] == 16384 and 0.01 < s["cap_fraction"] < 0.1
    assert 4000 <= s["batch_std"] <= 4500
    assert s["within_group_std_rms"] < 1500
    # lengths vary far more across prompts than within a group
    assert s["within_group_std_rms"] < 0.3 * s["std"]
    assert s["p50"] < 2000  # more than half within a few thousand tokens


def test_the_shape_scales_with_the_cap():
    a = length_stats(generate_trace(TraceSpec(rows=1024, epochs=1, cap=8192)))
    b = length_stats(generate_trace(TraceSpec(rows=1024, epochs=1, cap=32768)))
    assert b["max"] == 32768 and a["max"] == 8192
    assert b["mean"] == pytest.approx(4 * a["mean"], rel=0.05)


def test_same_spec_same_trace_and_other_seed_other_trace():
    spec = TraceSpec(rows=64, epochs=2, cap=4096)
    assert generate_trace(spec).records == generate_trace(spec).records
    assert generate_trace(spec).records != generate_trace(TraceSpec(rows=64, epochs=2, cap=4096,
                                                                    seed=1)).records


@pytest.mark.parametrize("share", [0.1, 0.5])
def test_bimodal_traces_have_exactly_the_long_share_near_the_cap(share):
    spec = bimodal_spec(share, rows=400, epochs=2, cap=8192, group_size=8)
    t = generate_trace(spec)
    assert t.name == f"bimodal{share:g}-cap8192-seed0"
    means = {i: np.mean(t.records[(i, 0)].lengths[:8]) for i in range(t.rows)}
    long = [i for i, m in means.items() if m > 0.5 * t.cap]
    assert len(long) == round(share * 400)  # exactly the share, not a draw of it
    assert min(means[i] for i in long) > 0.65 * t.cap
    assert np.median([m for i, m in means.items() if i not in long]) < 0.05 * t.cap
    assert generate_trace(spec).records == t.records  # deterministic by seed
    assert generate_trace(bimodal_spec(share, rows=400, epochs=2, cap=8192, seed=1)).records \
        != t.records


def test_growth_lengthens_later_steps():
    t = generate_trace(TraceSpec(rows=512, epochs=2, cap=1 << 20, growth_per_step=0.05,
                                 batch_size=32))
    early = [np.mean(r.lengths) for r in t.records.values() if r.step < 8]
    late = [np.mean(r.lengths) for r in t.records.values() if r.step >= 24]
    assert np.median(late) > 2 * np.median(early)


def test_jsonl_roundtrip_and_lookups(tmp_path):
    t = generate_trace(TraceSpec(rows=16, epochs=2, cap=2048, group_size=4))
    path = t.save(tmp_path / "t.jsonl")
    head = json.loads(path.read_text().splitlines()[0])
    assert head["format"] == "rlkit.trace" and head["slots"] == 8
    back = Trace.load(path)
    assert back.records == t.records and back.header() == t.header()
    assert back.length(3, 1, 5) == t.records[(3, 1)].lengths[5]
    with pytest.raises(TraceError, match="epoch 2"):
        back.length(3, 2, 0)
    with pytest.raises(TraceError, match="slot 8"):
        back.length(3, 0, 8)
    prompts = back.prompt_records()
    assert [len(p.ids) for p in prompts] == [t.records[(i, 0)].prompt_len for i in range(16)]
    assert [p.ids for p in prompts] == [p.ids for p in t.prompt_records()]


def test_bad_files_name_the_line(tmp_path):
    t = generate_trace(TraceSpec(rows=4, epochs=1, cap=512, group_size=2))
    lines = t.save(tmp_path / "t.jsonl").read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([lines[0], lines[1], '{"source_index": 1}']))
    with pytest.raises(TraceError, match=r"bad.jsonl:3: bad record"):
        Trace.load(bad)
    bad.write_text("\n".join([lines[0], lines[1]]))
    with pytest.raises(TraceError, match="missing"):
        Trace.load(bad)
    bad.write_text('{"format": "something else"}')
    with pytest.raises(TraceError, match="not an rlkit trace"):
        Trace.load(bad)
