"""Timelines: the simulator's and the real driver's lines read back; the Gantt picture."""

from __future__ import annotations

import json

import pytest

from rlkit.cli import main
from rlkit.commands.plot_timeline import assign_lanes
from rlkit.rollout.policies import PartialPolicy
from rlkit.sim.engine import SimConfig
from rlkit.sim.simulate import run_simulation
from rlkit.rollout.engines.profile import constant_profile
from rlkit.rollout.timeline import Span, TimelineError, read_timeline
from rlkit.sim.trace import TraceSpec, generate_trace


def test_simulated_run_timeline_roundtrip_and_plot(tmp_path):
    trace = generate_trace(TraceSpec(rows=64, epochs=2, cap=1024, group_size=4, batch_size=4))
    cluster = SimConfig(2, constant_profile([0.005, 0.01], [1, 32], prefill_s_per_token=1e-5))
    results = run_simulation(cluster, trace, PartialPolicy(2.0), steps=3, batch_size=4,
                             timeline_path=tmp_path / "timeline.jsonl")
    steps = read_timeline(tmp_path)
    assert [s.step for s in steps] == [0, 1, 2]
    for tl, r in zip(steps, results):
        assert tl.workers == ["sim-0", "sim-1"] and tl.source == "sim"
        assert tl.end - tl.start == pytest.approx(r.rollout_s)
        assert sum(s.tokens for s in tl.spans) == r.engine_tokens
        assert all(tl.start - 1e-9 <= s.start <= s.end <= tl.end + 1e-9 for s in tl.spans)
        assert {s.outcome for s in tl.spans} <= {"stop", "length", "abort", "cancelled", "preempt"}
    assert any(s.outcome == "abort" for s in steps[0].spans)  # partial parks the tail
    assert any(s.response_before > 0 for s in steps[1].spans)  # and resumes it
    assert main(["plot", "timeline", str(tmp_path), "--step", "all"]) == 0
    for k in range(3):
        png = tmp_path / f"timeline_step{k}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_real_driver_lines_are_read(tmp_path):
    """rlkit.tracking writes {"step": k, **Span.to_json()} with no step line."""
    spans = [Span("http://a", 1, 10, 5.0, 9.0, 40, "stop"),
             Span("http://b", 1, 11, 5.5, 12.0, 70, "abort", response_before=30),
             Span(None, 2, 12, 6.0, 6.5, 0, "cancelled")]
    path = tmp_path / "timeline.jsonl"
    path.write_text("".join(json.dumps({"step": 3, **s.to_json()}) + "\n" for s in spans))
    [tl] = read_timeline(path)
    assert (tl.step, tl.start, tl.end, tl.source) == (3, 5.0, 12.0, "real")
    assert tl.workers == ["http://a", "http://b"]
    assert tl.spans == spans
    out = tmp_path / "x.png"
    assert main(["plot", "timeline", str(path), "--out", str(out)]) == 0
    assert out.exists()


def test_bad_lines_are_named(tmp_path):
    path = tmp_path / "timeline.jsonl"
    path.write_text('{"step": 0, "worker": "a"}\n')
    with pytest.raises(TimelineError, match="timeline.jsonl:1"):
        read_timeline(path)


def test_lanes_never_overlap():
    intervals = [(0, 5), (1, 2), (2, 3), (4, 9), (5, 6), (0, 1), (8, 10)]
    lanes = assign_lanes(intervals)
    for i, (a, b) in enumerate(intervals):
        for j, (c, d) in enumerate(intervals):
            if i < j and lanes[i] == lanes[j]:
                assert b <= c or d <= a
    assert max(lanes) + 1 == 2  # the most intervals open at once (half-open intervals)


def test_the_simulators_old_cancel_spelling_reads_as_cancelled(tmp_path):
    path = tmp_path / "timeline.jsonl"
    path.write_text(json.dumps({"step": 0, **Span("sim-0", 1, 2, 0.0, 1.0, 3, "cancelled").to_json(),
                                "outcome": "cancel"}) + "\n")
    [tl] = read_timeline(path)
    assert [s.outcome for s in tl.spans] == ["cancelled"]


def test_tail_batching_rounds_are_recorded_and_drawn_apart(tmp_path):
    from rlkit.rollout.policies import TailBatchingPolicy

    trace = generate_trace(TraceSpec(rows=64, epochs=2, cap=1024, group_size=2, batch_size=4))
    cluster = SimConfig(2, constant_profile([0.005, 0.01], [1, 32], prefill_s_per_token=1e-5))
    results = run_simulation(cluster, trace, TailBatchingPolicy(2.0, 1.5), steps=4, batch_size=4,
                             timeline_path=tmp_path / "timeline.jsonl")
    steps = read_timeline(tmp_path)
    assert [tl.round for tl in steps] == [r.round for r in results]
    assert {"short", "long"} <= {tl.round for tl in steps}
    assert main(["plot", "timeline", str(tmp_path), "--step", "all"]) == 0
    assert (tmp_path / "timeline_rounds.png").read_bytes()[:4] == b"\x89PNG"

    rows = [{"step": r.step + 1, "rollout/round": r.round, "rollout/long_queue": r.long_queue}
            for r in results]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "m.png"
    assert main(["plot", "metrics", str(tmp_path), "--key", "rollout/long_queue",
                 "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("header", [False, True])
def test_a_real_runs_title_names_its_policy_and_round(tmp_path, monkeypatch, header):
    """A real run's timeline, with the driver's step line (policy, round) or without one (the
    driver before it wrote them): the title names the policy (recipe.yaml's rollout.policy when
    the timeline does not), never 'policy ?'."""
    from matplotlib.axes import Axes

    titles = []
    set_title = Axes.set_title
    monkeypatch.setattr(Axes, "set_title", lambda ax, t, *a, **k: (titles.append(t), set_title(ax, t, *a, **k))[1])
    (tmp_path / "recipe.yaml").write_text("rollout:\n  policy: tail_batching\n")
    span = Span("http://a", 1, 10, 5.0, 9.0, 40, "stop")
    lines = [json.dumps({"step": 2, **span.to_json()})]
    if header:
        lines.insert(0, json.dumps({"kind": "step", "step": 2, "policy": "tail_batching",
                                    "round": "long", "start": 5.0, "end": 9.0,
                                    "workers": ["http://a"], "source": "real"}))
    (tmp_path / "timeline.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["plot", "timeline", str(tmp_path), "--out", str(tmp_path / "x.png")]) == 0
    [title] = titles
    assert title.startswith("step 2, policy tail_batching" + (", long round" if header else " (real)"))
    assert "?" not in title
