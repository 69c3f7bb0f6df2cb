"""`rlkit bench learn`: the aggregation with known numbers (standard error, 'within noise',
time to reach, mean curves, the run order) and every configuration accepted by the recipe
loader. The command's scaled-down run on the tiny model is its row in
tests/commands/test_cli_smoke.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rlkit import cli
from rlkit.bench import learn
from rlkit.config import load_recipe

ROOT = Path(__file__).resolve().parents[2]


def test_standard_error_over_seeds():
    mean, se = learn.mean_se([0.5, 0.6, 0.7])
    assert mean == pytest.approx(0.6)
    assert se == pytest.approx(0.1 / math.sqrt(3))  # stdev 0.1 (n - 1), over sqrt(3)
    assert learn.mean_se([0.4])[0] == 0.4 and math.isnan(learn.mean_se([0.4])[1])
    assert all(math.isnan(x) for x in learn.mean_se([]))
    assert learn.mean_se([0.2, math.nan, 0.4]) == (pytest.approx(0.3), pytest.approx(0.1))


def test_within_noise_is_two_standard_errors_of_the_difference():
    # se of the difference: sqrt(0.03^2 + 0.04^2) = 0.05, so the bound is 0.10
    assert learn.within_noise(0.60, 0.03, 0.70, 0.04) is True  # 0.10 apart: on the bound
    assert learn.within_noise(0.59, 0.03, 0.70, 0.04) is False
    assert learn.within_noise(0.79, 0.03, 0.70, 0.04) is True
    assert learn.within_noise(0.60, math.nan, 0.70, 0.04) is None  # one seed: unknown
    assert learn.within_noise(0.60, 0.0, 0.60, 0.0) is True


def test_time_to_reach_interpolates_between_evaluations():
    curve = [(0.0, 0.50), (100.0, 0.60), (200.0, 0.70)]
    assert learn.time_to_reach(curve, 0.65) == pytest.approx(150.0)
    assert learn.time_to_reach(curve, 0.60) == pytest.approx(100.0)
    assert learn.time_to_reach(curve, 0.70) == pytest.approx(200.0)
    assert learn.time_to_reach(curve, 0.45) == 0.0  # the initial policy already has it
    assert learn.time_to_reach(curve, 0.71) is None  # not reached
    assert learn.time_to_reach(curve, math.nan) is None
    # a dip and recovery: the first crossing counts
    assert learn.time_to_reach([(0, 0.5), (10, 0.7), (20, 0.6), (30, 0.8)], 0.65) == pytest.approx(7.5)


def _run(accs, seconds, samples=(0, 16, 32)):
    return {"curve": [{"step": i * 4, "samples": float(n), "seconds": float(s), "accuracy": a}
                      for i, (n, s, a) in enumerate(zip(samples, seconds, accs))],
            "telemetry": {"step/seconds": seconds[-1] / 8, "batch/max_staleness": 0.0}}


def test_summary_of_known_runs():
    results = {
        "sync": [_run([0.5, 0.6, 0.70], [0, 100, 200]), _run([0.5, 0.6, 0.74], [0, 110, 220]),
                 _run([0.5, 0.6, 0.72], [0, 90, 180])],
        "fast": [_run([0.5, 0.72, 0.74], [0, 50, 100]), _run([0.5, 0.70, 0.72], [0, 50, 100]),
                 _run([0.5, 0.74, 0.73], [0, 50, 100])],
        "worse": [_run([0.5, 0.5, 0.50], [0, 50, 100]), _run([0.5, 0.5, 0.52], [0, 50, 100]),
                  _run([0.5, 0.5, 0.48], [0, 50, 100])],
        "failed": [{"curve": [], "telemetry": {}, "error": "boom"}],
    }
    s = learn.summarize(results, "sync")
    assert s["sync"]["final_accuracy"] == pytest.approx(0.72)
    assert s["sync"]["final_se"] == pytest.approx(0.02 / math.sqrt(3))
    assert s["sync"]["diff_vs_reference"] == 0.0 and s["sync"]["within_noise"] is True
    assert s["sync"]["final_seconds"] == pytest.approx(200.0)
    # sync's mean curve: (0, 0.5), (100, 0.6), (200, 0.72): reaches 0.72 at its end
    assert s["sync"]["seconds_to_reference_final"] == pytest.approx(200.0)
    assert [p["samples"] for p in s["sync"]["curve"]] == [0, 16, 32]
    # fast: mean curve (0, 0.5), (50, 0.72): reached at 50 s
    assert s["fast"]["curve"][1]["accuracy"] == pytest.approx(0.72)
    assert s["fast"]["seconds_to_reference_final"] == pytest.approx(50.0)
    assert s["fast"]["within_noise"] is True
    assert s["worse"]["final_accuracy"] == pytest.approx(0.50)
    assert s["worse"]["diff_vs_reference"] == pytest.approx(-0.22)
    assert s["worse"]["within_noise"] is False
    assert s["worse"]["seconds_to_reference_final"] is None
    assert (s["failed"]["runs"], s["failed"]["failed"], s["failed"]["curve"]) == (1, 1, [])
    assert s["failed"]["within_noise"] is None
    table = learn.format_table(s, "sync", {"recipe": "r.yaml", "steps": 8, "seeds": 3,
                                           "samples_per_step": 4, "eval_rows": 200,
                                           "initial_accuracy": 0.5})
    lines = table.splitlines()
    row = {line.split(" | ")[0].strip("| "): line for line in lines if line.startswith("| ")}
    assert "acc @ 16 samples" in lines[2] and "acc @ 32 samples" in lines[2]
    assert "0.720 ± 0.012" in row["sync"] and "| yes |" in row["sync"]
    assert "| **no** |" in row["worse"] and "not reached" in row["worse"]
    assert "| 50 |" in row["fast"]
    assert "(1 failed)" in row["failed"]


def test_mean_curve_keeps_the_steps_every_run_evaluated():
    a = _run([0.5, 0.6, 0.7], [0, 10, 20])
    b = _run([0.5, 0.8], [0, 30])  # stopped early: only step 0 and 4
    c = learn.mean_curve([a, b])
    assert [p["step"] for p in c] == [0, 4]
    assert c[1]["accuracy"] == pytest.approx(0.7) and c[1]["seconds"] == pytest.approx(20.0)
    assert c[1]["se"] == pytest.approx(0.1)


def test_runs_alternate_direction_across_seeds():
    assert learn.run_order(["a", "b", "c"], 3) == [
        (1, "a"), (1, "b"), (1, "c"), (2, "c"), (2, "b"), (2, "a"), (3, "a"), (3, "b"), (3, "c")]


def test_eval_schedule():
    assert learn.eval_every(8, 0) == 8 and learn.eval_every(1, 0) == 1  # the last step only
    assert learn.eval_every(8, 2) == 2
    with pytest.raises(SystemExit, match="must divide"):
        learn.eval_every(8, 3)


def test_read_run_builds_the_curve_from_the_run_files(tmp_path):
    key = "eval/heldout/greedy/pass@1"
    rows = [{"step": k, "train/samples": 16.0, "step/seconds": 10.0 + k, "batch/max_staleness": k % 2,
             "mismatch/lag0/tokens": 30.0, "mismatch/lag1/tokens": 10.0 * (k % 2)}
            for k in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "eval.jsonl").write_text(
        json.dumps({"step": 0, key: 0.5, "eval/heldout/greedy/seconds": 9.0}) + "\n"
        + json.dumps({"step": 2, key: 0.55}) + "\n" + json.dumps({"step": 4, key: 0.6}) + "\n")
    r = learn.read_run(tmp_path, key, None)
    assert r["initial"] == {"accuracy": 0.5, "seconds": 9.0}
    assert [(p["step"], p["samples"], p["seconds"], p["accuracy"]) for p in r["curve"]] == [
        (0, 0.0, 0.0, 0.5), (2, 32.0, 23.0, 0.55), (4, 64.0, 50.0, 0.6)]
    assert r["telemetry"]["batch/max_staleness"] == 0.5
    assert r["telemetry"]["lag>=1 token share"] == pytest.approx(20 / 140)
    # a later run without its own initial evaluation borrows the first one's
    (tmp_path / "eval.jsonl").write_text(json.dumps({"step": 4, key: 0.6}) + "\n")
    r = learn.read_run(tmp_path, key, {"accuracy": 0.5, "seconds": 9.0})
    assert [p["step"] for p in r["curve"]] == [0, 4] and r["curve"][0]["accuracy"] == 0.5
    # an evaluation whose engines failed answers is left out (NaN), not scored 0, and counted
    (tmp_path / "eval.jsonl").write_text(json.dumps(
        {"step": 4, key: 0.0, "eval/heldout/greedy/failures/engine": 200.0}) + "\n")
    r = learn.read_run(tmp_path, key, {"accuracy": 0.5, "seconds": 9.0})
    assert math.isnan(r["curve"][-1]["accuracy"])
    s = learn.summarize({"sync": [r, _run([0.5, 0.6, 0.7], [0, 10, 20])]}, "sync")["sync"]
    assert s["failed_evals"] == 1 and s["final_accuracy"] == pytest.approx(0.6)  # step 4, one seed
    assert s["curve"][-1]["seeds"] == 1


@pytest.mark.parametrize("recipe", ["grpo_smollm2_cpu.yaml", "grpo_tiny_ci.yaml"])
def test_every_configuration_is_a_valid_recipe(recipe):
    for corr in ("tis", "mis", "icepop"):
        for name, overrides in learn.expand_configs("all", corr, teacher="tiny").items():
            r = load_recipe(ROOT / "recipes" / recipe, [*learn.SCALE, *overrides])
            off = r.rollout.off_policy_reason() is not None or r.mode == "async"
            want = corr if f"+{corr}" in name else "none"
            assert r.train.algorithm.off_policy_correction.estimator == want, name
            assert not (off and want == "none" and "+" in name)
    assert list(learn.expand_configs("sync,partial+tis", "tis")) == ["sync", "partial+tis"]
    with pytest.raises(SystemExit, match="unknown nope"):
        learn.expand_configs("sync,nope", "tis")
    # the distillation configurations need a teacher; 'all' leaves them out without one
    assert not set(learn.TEACHER_CONFIGS) & set(learn.expand_configs("all", "tis"))
    with pytest.raises(SystemExit, match="give --teacher"):
        learn.expand_configs("sync,opd", "tis")
    r = load_recipe(ROOT / "recipes" / recipe,
                    learn.expand_configs("opd", "tis", teacher="/some/sft/export")["opd"])
    assert r.rollout.frozen_engines["teacher"].model == "/some/sft/export"
    assert (r.train.algorithm.distill_coef, r.train.algorithm.reward_weight) == (1.0, 0.0)


def _report(tmp_path, name, runs: dict, **settings):
    base = {"recipe": "r.yaml", "steps": 8, "seeds": 2, "eval_every": 4, "eval_rows": 200,
            "samples_per_step": 16, "max_new_tokens": 24, "lr": 2e-5, "model": "m",
            "correction": "tis", "accuracy_key": "eval/h/greedy/pass@1", "overrides": ["a=1"],
            "order": [f"{c}/seed{r['seed']}" for c, rs in runs.items() for r in rs],
            "initial_accuracy": 0.5, "wall_s": 100.0, **settings}
    out = tmp_path / name
    out.mkdir()
    learn._report(out, runs, next(iter(runs)), base, final=False)
    return out


def test_merge_makes_one_table_of_reports_run_apart(tmp_path):
    def seeded(seed, accs, seconds):
        return {**_run(accs, seconds), "seed": seed}

    a = _report(tmp_path, "a", {"sync": [seeded(1, [0.5, 0.6, 0.70], [0, 100, 200]),
                                         seeded(2, [0.5, 0.6, 0.74], [0, 110, 220])]})
    nan_run = seeded(2, [0.5, math.nan, 0.72], [0, 50, 100])  # stored as null
    b = _report(tmp_path, "b", {"fast": [seeded(1, [0.5, 0.72, 0.74], [0, 50, 100]), nan_run]},
                initial_accuracy=None, wall_s=50.0)
    assert cli.main(["bench", "learn", "--merge", str(a), str(b), "--out", str(tmp_path / "m")]) == 0
    report = json.loads((tmp_path / "m" / "learn.json").read_text())
    s, settings = report["summary"], report["settings"]
    assert settings["wall_s"] == 150.0 and settings["initial_accuracy"] == 0.5
    assert settings["order"] == ["sync/seed1", "sync/seed2", "fast/seed1", "fast/seed2"]
    assert s["sync"]["final_accuracy"] == pytest.approx(0.72)
    assert s["fast"]["diff_vs_reference"] == pytest.approx(0.73 - 0.72)
    assert s["fast"]["failed_evals"] == 1  # the null came back as NaN, not as a crash
    assert "| fast | 2 (1 eval(s) failed) | 0.730 ± 0.010 | +0.010 ± 0.022 | yes |" in (
        tmp_path / "m" / "learn.md").read_text()
    c = _report(tmp_path, "c", {"sync": [seeded(1, [0.5, 0.6, 0.7], [0, 1, 2])]})
    with pytest.raises(SystemExit, match="sync seed 1 is in more than one report"):
        cli.main(["bench", "learn", "--merge", str(a), str(c), "--out", str(tmp_path / "m2")])
    d = _report(tmp_path, "d", {"tail": [seeded(1, [0.5, 0.6, 0.7], [0, 1, 2])]}, lr=3e-5)
    with pytest.raises(SystemExit, match=r"settings.lr differs: 3e-05"):
        cli.main(["bench", "learn", "--merge", str(a), str(d), "--out", str(tmp_path / "m3")])
