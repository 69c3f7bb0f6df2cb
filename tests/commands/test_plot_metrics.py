"""`rlkit plot metrics`: the held-out eval curves beside the training reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlkit import cli
from rlkit.commands import plot_metrics as pm

P1 = "eval/arith-heldout/greedy/pass@1"
S1 = "eval/arith-heldout/sampled/pass@1"
S4 = "eval/arith-heldout/sampled/pass@4"
LEN = "eval/arith-heldout/greedy/mean_response_length"


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _metrics(n: int = 9) -> list[dict]:
    return [{"step": s, "time_s": float(s), "batch/reward_mean": 0.1 * s,
             "rollout/reward_mean": 0.05 * s, "rollout/round": "long" if s == 3 else "short"}
            for s in range(1, n + 1)]


def _eval() -> list[dict]:
    return [
        {"step": 0, "time_s": 0.5, P1: 0.25, S1: 0.2, S4: 0.5, LEN: 40.0},
        {"step": 4, "time_s": 4.5, P1: 0.5, S1: None, S4: 0.75, LEN: 30.0},  # null: skipped
        {"step": 8, "time_s": 8.5, P1: 0.75, S1: 0.6, S4: 1.0, LEN: 20.0},
    ]


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "myrun"
    run.mkdir()
    _write(run / "metrics.jsonl", _metrics())
    _write(run / "eval.jsonl", _eval())
    return run


def _png_ok(path: Path) -> None:
    assert path.is_file()
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_default_draws_training_reward_and_held_out_pass_at_k(run_dir: Path, tmp_path: Path):
    rows, eval_rows = pm.load_metrics(run_dir), pm.load_eval(run_dir)
    drawn = pm.plot_metrics(rows, None, tmp_path / "a.png", "t", eval_rows)
    _png_ok(tmp_path / "a.png")
    assert drawn["batch/reward_mean"][0] == list(range(1, 10))
    assert drawn["rollout/reward_mean"][1] == pytest.approx([0.05 * s for s in range(1, 10)])
    assert drawn["held-out arith-heldout (greedy) pass@1"] == ([0, 4, 8], [0.25, 0.5, 0.75])
    assert drawn["held-out arith-heldout (sampled) pass@1"] == ([0, 8], [0.2, 0.6])
    assert drawn["held-out arith-heldout (sampled) pass@4"] == ([0, 4, 8], [0.5, 0.75, 1.0])
    assert not any("mean_response_length" in label for label in drawn)  # pass@k only
    panels = pm.collect_panels(rows, None, eval_rows)
    assert [p.eval for p in panels] == [False, True]
    assert panels[1].ylim == (-0.02, 1.02)
    assert list(panels[1].series) == ["held-out arith-heldout (greedy) pass@1",
                                      "held-out arith-heldout (sampled) pass@1",
                                      "held-out arith-heldout (sampled) pass@4"]


def test_cli_writes_png_with_eval_title(run_dir: Path, capsys, monkeypatch):
    seen = {}
    real_draw = pm.draw

    def spy(panels, rows, out, title):
        seen["title"], seen["panels"] = title, panels
        return real_draw(panels, rows, out, title)

    monkeypatch.setattr(pm, "draw", spy)
    assert cli.main(["plot", "metrics", str(run_dir)]) == 0
    _png_ok(run_dir / "metrics.png")
    assert "wrote" in capsys.readouterr().out
    assert seen["title"] == "myrun: training reward and held-out eval (pass@k)"
    assert len(seen["panels"]) == 2


def test_nan_written_as_null_and_nan_values_skipped(tmp_path: Path):
    run = tmp_path / "r"
    run.mkdir()
    _write(run / "metrics.jsonl", _metrics(3))
    (run / "eval.jsonl").write_text(
        json.dumps({"step": 0, P1: 0.1}) + "\n" + '{"step": 2, "%s": NaN}\n' % P1)
    drawn = pm.plot_metrics(pm.load_metrics(run), None, run / "m.png", "t", pm.load_eval(run))
    assert drawn["held-out arith-heldout (greedy) pass@1"] == ([0], [0.1])


def test_run_without_eval_unchanged(tmp_path: Path, monkeypatch):
    run = tmp_path / "plain"
    run.mkdir()
    _write(run / "metrics.jsonl", _metrics())
    assert pm.load_eval(run) == []
    seen = {}
    real_draw = pm.draw

    def spy(panels, rows, out, title):
        seen["title"] = title
        seen["drawn"] = real_draw(panels, rows, out, title)
        return seen["drawn"]

    monkeypatch.setattr(pm, "draw", spy)
    assert cli.main(["plot", "metrics", str(run)]) == 0
    _png_ok(run / "metrics.png")
    assert seen["title"] == "plain: per-step metrics"
    assert list(seen["drawn"]) == pm.DEFAULT_KEYS


def test_empty_eval_file_is_no_eval(tmp_path: Path):
    run = tmp_path / "r"
    run.mkdir()
    _write(run / "metrics.jsonl", _metrics(3))
    (run / "eval.jsonl").write_text("")
    panels = pm.collect_panels(pm.load_metrics(run), None, pm.load_eval(run))
    assert len(panels) == 1 and list(panels[0].series) == pm.DEFAULT_KEYS


def test_key_eval_metric_from_eval_jsonl(run_dir: Path, tmp_path: Path):
    drawn = pm.plot_metrics(pm.load_metrics(run_dir), [LEN], tmp_path / "len.png", "t",
                            pm.load_eval(run_dir))
    assert drawn == {"held-out arith-heldout (greedy) mean_response_length":
                     ([0, 4, 8], [40.0, 30.0, 20.0])}
    _png_ok(tmp_path / "len.png")
    out = tmp_path / "cli.png"
    assert cli.main(["plot", "metrics", str(run_dir), "--key", LEN, "--out", str(out)]) == 0
    _png_ok(out)


def test_key_mixing_training_and_eval(run_dir: Path):
    panels = pm.collect_panels(pm.load_metrics(run_dir), ["batch/reward_mean", P1],
                               pm.load_eval(run_dir))
    assert [list(p.series) for p in panels] == [
        ["batch/reward_mean"], ["held-out arith-heldout (greedy) pass@1"]]
    assert panels[1].series["held-out arith-heldout (greedy) pass@1"] == ([0, 4, 8],
                                                                         [0.25, 0.5, 0.75])


def test_unknown_key_names_it_and_both_files(run_dir: Path):
    with pytest.raises(SystemExit) as e:
        cli.main(["plot", "metrics", str(run_dir), "--key", "eval/nope/greedy/pass@1"])
    msg = str(e.value)
    assert "eval/nope/greedy/pass@1" in msg
    assert "metrics.jsonl" in msg and "eval.jsonl" in msg
    assert "batch/reward_mean" in msg and P1 in msg
    with pytest.raises(SystemExit, match="no values for 'rollout/nope'"):
        pm.collect_panels(pm.load_metrics(run_dir), ["rollout/nope"], pm.load_eval(run_dir))


def test_mismatch_figure_per_version_lag(tmp_path: Path, monkeypatch):
    run = tmp_path / "lagged"
    run.mkdir()
    rows = _metrics(4)
    for r in rows:  # lag 2 only from step 3 on; no step has lag 3+
        r["mismatch/lag0/kl_k3"], r["mismatch/lag1/kl_k3"] = 1e-5, 2e-4
        if r["step"] >= 3:
            r["mismatch/lag2/kl_k3"] = 9e-4
    _write(run / "metrics.jsonl", rows)
    seen = {}
    real_draw = pm.draw

    def spy(panels, rows, out, title):
        seen["title"], seen["drawn"] = title, real_draw(panels, rows, out, title)
        return seen["drawn"]

    monkeypatch.setattr(pm, "draw", spy)
    assert cli.main(["plot", "metrics", str(run), "--mismatch", "kl_k3"]) == 0
    _png_ok(run / "metrics.png")
    assert seen["title"] == "lagged: mismatch kl_k3 per version lag"
    assert list(seen["drawn"]) == [f"mismatch/lag{k}/kl_k3" for k in (0, 1, 2)]
    assert seen["drawn"]["mismatch/lag2/kl_k3"] == ([3, 4], [9e-4, 9e-4])
    _write(run / "metrics.jsonl", _metrics(2))
    with pytest.raises(SystemExit, match="no mismatch telemetry"):
        cli.main(["plot", "metrics", str(run), "--mismatch", "ess"])


def test_mismatch_table_is_token_weighted_over_steps(tmp_path: Path, capsys):
    run = tmp_path / "lagged"
    run.mkdir()
    rows = _metrics(3)
    for r, (n0, n1, k3_1, p99_1) in zip(rows, [(30, 10, 1e-3, 0.5), (10, 30, 3e-3, 0.9),
                                               (20, 0, 0.0, 0.0)]):
        r.update({"mismatch/lag0/tokens": n0, "mismatch/lag0/kl_k3": 1e-10,
                  "mismatch/lag1/tokens": n1, "mismatch/lag1/kl_k3": k3_1,
                  "mismatch/lag1/abs_log_ratio_p99": p99_1,
                  "mismatch/resumed/tokens": n1 // 2, "mismatch/resumed/kl_k3": 2 * k3_1})
    _write(run / "metrics.jsonl", rows)
    s = pm.mismatch_summary(pm.load_metrics(run))
    assert list(s) == ["lag0", "lag1", "resumed"]  # buckets without tokens are left out
    assert s["lag0"]["tokens"] == 60 and s["lag0"]["steps"] == 3
    # (10 x 1e-3 + 30 x 3e-3) / 40; the step without lag-1 tokens does not dilute it
    assert s["lag1"]["kl_k3"] == pytest.approx(2.5e-3) and s["lag1"]["steps"] == 2
    assert s["lag1"]["abs_log_ratio_p99"] == 0.9  # the largest step's
    assert cli.main(["plot", "metrics", str(run), "--mismatch-table"]) == 0
    out = capsys.readouterr().out
    assert "| lag1 | 2 | 40 (40%) |" in out and "| resumed | 2 | 20 (20%) |" in out
    assert not (run / "metrics.png").exists()
    _write(run / "metrics.jsonl", _metrics(2))
    with pytest.raises(SystemExit, match="no mismatch telemetry"):
        cli.main(["plot", "metrics", str(run), "--mismatch-table"])
