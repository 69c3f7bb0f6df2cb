"""The viewer's data layer on a simulator run folder and on a real run's files, piece by piece
(a tiny-model run's folder is read by tests/e2e/test_train_tiny.py, through view_checks)."""

from __future__ import annotations

import json
import math

import pytest

from rlkit.rollout.timeline import StepTimeline, Span
from rlkit.rollout.timeline import assign_lanes
from rlkit.view.run_data import (RunData, ViewError, idle_share, panels, union_length,
                                 zero_variance_share)


def test_a_simulator_folder_gives_every_page(sim_run):
    folder, results = sim_run
    run = RunData(folder)
    o = run.overview()
    assert o["source"] == "sim" and o["steps"] == 2 and o["recipe"] == ""
    steps = run.steps()
    assert [r["step"] for r in steps["rows"]] == [0, 1, 2]
    for row, r in zip(steps["rows"], results):
        assert row["rollout/seconds"] == pytest.approx(r.rollout_s)
        assert 0.0 <= row["timeline/engine_idle_share"] < 1.0
    titles = [p["title"] for p in steps["panels"]]
    assert "seconds per step" in titles and "rollout tokens/s" in titles
    tl = run.timeline()
    assert tl["workers"] == ["sim-0", "sim-1"]
    n = len(tl["spans"]["lane"])
    lines = [json.loads(x) for x in (folder / "timeline.jsonl").read_text().splitlines()]
    assert n == sum(1 for x in lines if "kind" not in x) > 0
    for k, r in enumerate(results):  # every token the engines generated, step by step
        assert sum(t for t, s in zip(tl["spans"]["tokens"], tl["spans"]["step"]) if s == k) == r.engine_tokens
    assert all(len(col) == n for col in tl["spans"].values())
    # the rows of a lane never overlap: a lane's height is its running batch
    for lane in range(2):
        by_row: dict[int, list[tuple[float, float]]] = {}
        for i in range(n):
            if tl["spans"]["lane"][i] == lane:
                by_row.setdefault(tl["spans"]["row"][i], []).append((tl["spans"]["start"][i], tl["spans"]["end"][i]))
        for spans in by_row.values():
            spans.sort()
            assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
        assert tl["rows_per_lane"][lane] == len(by_row)
    # the trainer's phases: a train and a sync per step, after that step's rollout
    assert [(p["step"], p["name"]) for p in tl["phases"]] == [(s, n) for s in (0, 1, 2) for n in ("train", "sync")]
    for p in tl["phases"]:
        window = next(s for s in tl["steps"] if s["step"] == p["step"])
        assert p["start"] >= window["end"] - 1e-9 and p["end"] >= p["start"]
    assert run.groups() == {"step": 0, "steps": [], "groups": [], "samples": []}
    assert isinstance(run.advice(), list)


def test_a_real_run_folder_with_groups_dropped_and_samples(tmp_path):
    (tmp_path / "recipe.yaml").write_text("run:\n  name: r\n  mode: sync\nrollout:\n  policy: partial\n")
    rows = [{"step": 1, "rollout/reward_mean": 0.5, "batch/zero_variance_share": 0.25, "train/loss": None},
            {"step": 2, "rollout/reward_mean": 0.75}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "rollo')
    (tmp_path / "eval.jsonl").write_text(json.dumps({"step": 0, "eval/d/greedy/pass@1": 0.1}) + "\n")
    groups = [{"step": 1, "group_id": 3, "rewards": [1.0, 0.0], "lengths": [4, 5]},
              {"step": 1, "group_id": 4, "rewards": [1.0, 1.0], "lengths": [2, 2]}]
    (tmp_path / "groups.jsonl").write_text("".join(json.dumps(g) + "\n" for g in groups))
    (tmp_path / "dropped.jsonl").write_text(json.dumps(
        {"step": 1, "group_id": 5, "dropped": "filtered:zero_variance", "rewards": [0.0, 0.0], "lengths": [1, 1]}) + "\n")
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "step_000001.json").write_text(json.dumps(
        {"step": 1, "samples": [{"group_id": 3, "ids": [1, 2]}]}))
    run = RunData(tmp_path)
    o = run.overview()
    assert (o["name"], o["source"], o["steps"], o["mode"], o["policy"]) == ("r", "real", 2, "sync", "partial")
    steps = run.steps()
    # the half line a run is writing is skipped; eval rows join by the version evaluated
    assert [r["step"] for r in steps["rows"]] == [0, 1, 2]
    assert steps["rows"][0] == {"step": 0, "eval/d/greedy/pass@1": 0.1}
    assert "train/loss" not in steps["rows"][1]  # null (NaN) is no point
    assert {"title": "held-out accuracy (pass@1)", "series": ["eval/d/greedy/pass@1"]} in steps["panels"]
    g = run.groups()
    assert g["step"] == 1 and g["steps"] == [1]
    assert [(x["group_id"], x["kept"], x["saved"], x["zero_variance"]) for x in g["groups"]] == [
        (3, True, True, False), (4, True, False, True), (5, False, False, True)]
    assert g["samples"] == [{"group_id": 3, "ids": [1, 2]}]
    assert run.groups(7)["groups"] == []


def test_not_a_run_folder_is_said(tmp_path):
    with pytest.raises(ViewError, match="not a run folder"):
        RunData(tmp_path)
    with pytest.raises(ViewError, match="not a folder"):
        RunData(tmp_path / "missing")


def test_pieces():
    assert assign_lanes([(0, 3), (1, 2), (2, 4), (2.5, 3)]) == [0, 1, 1, 2]
    assert union_length([(0, 2), (1, 3), (5, 6), (6, 6)]) == 4
    assert zero_variance_share([{"rewards": [1, 1]}, {"rewards": [0, 1]}, {"rewards": [None, 1]}]) == 2 / 3
    assert math.isnan(zero_variance_share([]))
    tl = StepTimeline(1, "sync", 0.0, 10.0, ["a", "b"],
                      spans=[Span("a", 0, 0, 0.0, 10.0, 5, "stop"), Span("b", 1, 1, 0.0, 2.0, 5, "stop")])
    assert idle_share(tl) == pytest.approx(0.4)  # b idles 8 of 20 engine-seconds
    assert panels(["mismatch/lag0/kl_k3", "mismatch/lag1/kl_k3", "rollout/seconds"]) == [
        {"title": "seconds per step", "series": ["rollout/seconds"]},
        {"title": "train-inference mismatch by version lag (KL k3)",
         "series": ["mismatch/lag0/kl_k3", "mismatch/lag1/kl_k3"]}]


def test_a_compared_timeline_is_aligned_step_by_step(sim_run, tmp_path):
    folder, _ = sim_run
    from tests.view.conftest import simulate_run

    simulate_run(tmp_path, steps=2, engines=2)
    run = RunData(folder, compare=tmp_path)
    tl = run.timeline()
    c = tl["compare"]
    assert c["steps"] == [0, 1] and set(c["lanes"]) == {"0", "1"}
    for curve in c["lanes"].values():
        counts = [x[1] for x in curve]
        assert counts[-1] == 0 and min(counts) >= 0  # every request that starts ends
        starts = {s["step"]: s["start"] for s in tl["steps"]}
        assert curve[0][0] >= starts[0] - 1e-9
