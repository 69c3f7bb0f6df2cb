"""`rlkit eval` argument resolution, without engines: what MODEL_OR_CHECKPOINT and
RECIPE_OR_DATA become (rlkit.commands.eval.plan), the errors, and the JSON report."""

import argparse
import json
import math

import pytest

from rlkit.cli import main
from rlkit.commands import eval as ev
from rlkit.config import RecipeError, load_recipe
from rlkit.rollout.evaluator import EvalResult


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    ev.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def hf_dir(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def write(path, text):
    path.write_text(text)
    return path


# -- MODEL_OR_CHECKPOINT ---------------------------------------------------------------------
def test_hf_folder_is_version_0(hf_dir):
    p = ev.plan(parse(str(hf_dir), "builtin:arithmetic"))
    assert (p.kind, p.path, p.version) == ("hf", hf_dir, 0)


def test_demo_name_is_resolved_later_not_built_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path / "cache"))
    p = ev.plan(parse("tiny", "builtin:arithmetic"))
    assert (p.kind, p.path, p.version) == ("demo", None, 0)
    assert not (tmp_path / "cache").exists()


def test_trainer_checkpoint_version_is_its_step(tmp_path):
    ckpt = tmp_path / "trainer_ckpt"
    ckpt.mkdir()
    (ckpt / "meta.json").write_text(json.dumps({"step": 7, "version": 7}))
    p = ev.plan(parse(str(ckpt), "builtin:arithmetic"))
    assert (p.kind, p.path, p.version) == ("checkpoint", ckpt, 7)


def run_checkpoint(run_dir, step):
    d = run_dir / "checkpoints" / f"step_{step}"
    (d / "trainer").mkdir(parents=True)
    (d / "trainer" / "meta.json").write_text(json.dumps({"step": step, "version": step}))
    (d / "state.json").write_text(json.dumps({"step": step, "version": step}))
    return d


def test_run_checkpoint_and_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    run_checkpoint(run_dir, 2)
    latest = run_checkpoint(run_dir, 4)
    p = ev.plan(parse(str(run_dir / "checkpoints" / "step_2"), "builtin:arithmetic"))
    assert (p.kind, p.version) == ("checkpoint", 2)
    p = ev.plan(parse(str(run_dir), "builtin:arithmetic"))
    assert (p.kind, p.path, p.version) == ("checkpoint", latest, 4)


@pytest.mark.parametrize("kind", ["missing", "empty_dir", "file"])
def test_bad_model_argument_is_a_one_line_user_error(tmp_path, kind, capsys):
    target = tmp_path / "nothing"
    if kind == "empty_dir":
        target.mkdir()
    elif kind == "file":
        target.write_text("x")
    with pytest.raises(ev.EvalArgumentError, match="MODEL_OR_CHECKPOINT"):
        ev.plan(parse(str(target), "builtin:arithmetic"))
    assert main(["eval", str(target), "builtin:arithmetic", "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlkit: MODEL_OR_CHECKPOINT") and "\n" not in err
    assert not (tmp_path / "o.json").exists()


# -- RECIPE_OR_DATA --------------------------------------------------------------------------
def test_data_path_is_one_dataset_with_the_default_loader_options(hf_dir, tmp_path):
    data = write(tmp_path / "held_out.jsonl", '{"prompt": "1+1?", "label": "2"}\n')
    p = ev.plan(parse(str(hf_dir), str(data)))
    (d,) = p.eval.datasets
    assert (d.name, d.path, d.limit) == ("held_out", str(data), None)
    default = load_recipe(None).data
    for key in ("prompt_key", "label_key", "metadata_keys", "apply_chat_template",
                "system_prompt", "max_prompt_tokens", "on_bad_row"):
        assert getattr(d, key) == getattr(default, key)
    assert [x.mode for x in p.eval.passes(p.recipe.rollout.sampling)] == ["greedy"]
    assert p.num_engines == load_recipe(None).rollout.engine.num_engines


def test_builtin_data_name_and_limit(hf_dir):
    p = ev.plan(parse(str(hf_dir), "builtin:arithmetic?split=test&rows=6", "--limit", "3",
                      "--engines", "1"))
    (d,) = p.eval.datasets
    assert (d.name, d.path, d.limit) == ("arithmetic", "builtin:arithmetic?split=test&rows=6", 3)
    assert p.num_engines == 1


def test_set_overrides_apply_to_the_default_recipe(hf_dir):
    p = ev.plan(parse(str(hf_dir), "builtin:arithmetic", "--set", "eval.n_samples=8",
                      "--set", "eval.k=4", "--set", "data.prompt_key=question",
                      "--set", "rollout.sampling.max_new_tokens=16"))
    assert (p.eval.n_samples, p.eval.k) == (8, 4)
    assert p.eval.datasets[0].prompt_key == "question"
    passes = p.eval.passes(p.recipe.rollout.sampling)
    assert [(x.mode, x.n, x.k, x.sampling.max_new_tokens) for x in passes] == [
        ("greedy", 1, 1, 16), ("sampled", 8, 4, 16)]


def test_recipe_eval_section_is_used_as_is(hf_dir, tmp_path):
    recipe = write(tmp_path / "r.yaml", """
eval:
  n_samples: 4
  k: 2
  greedy: false
  datasets:
    - {path: "builtin:arithmetic?split=test", name: math_test, limit: 5, prompt_key: q}
    - {path: other.jsonl, name: other}
""")
    p = ev.plan(parse(str(hf_dir), str(recipe)))
    assert p.eval == load_recipe(recipe).eval
    assert [x.name for x in p.eval.passes(p.recipe.rollout.sampling)] == [
        "math_test/sampled", "other/sampled"]
    # --limit caps each dataset, keeping a smaller limit; --set reaches the eval section
    p = ev.plan(parse(str(hf_dir), str(recipe), "--limit", "3", "--set", "eval.k=4"))
    assert [d.limit for d in p.eval.datasets] == [3, 3]
    assert p.eval.k == 4
    p = ev.plan(parse(str(hf_dir), str(recipe), "--limit", "9"))
    assert [d.limit for d in p.eval.datasets] == [5, 9]


def test_recipe_without_eval_datasets_evaluates_its_data(hf_dir, tmp_path):
    recipe = write(tmp_path / "my-run.yaml", """
data:
  path: "builtin:arithmetic?split=test"
  prompt_key: prompt
  apply_chat_template: false
""")
    p = ev.plan(parse(str(hf_dir), str(recipe)))
    (d,) = p.eval.datasets
    assert (d.name, d.path, d.apply_chat_template) == ("my-run", "builtin:arithmetic?split=test", False)


def test_recipe_without_datasets_or_data_is_an_error(hf_dir, tmp_path, capsys):
    recipe = write(tmp_path / "bare.yaml", "mode: sync\n")
    with pytest.raises(ev.EvalArgumentError, match="RECIPE_OR_DATA .*no eval.datasets"):
        ev.plan(parse(str(hf_dir), str(recipe)))
    # data given by an override counts
    p = ev.plan(parse(str(hf_dir), str(recipe), "--set", "data.path=builtin:arithmetic"))
    assert p.eval.datasets[0].name == "bare"
    assert main(["eval", str(hf_dir), str(recipe)]) == 2
    assert "RECIPE_OR_DATA" in capsys.readouterr().err


@pytest.mark.parametrize("source, match", [
    ("missing.yaml", "recipe file not found"),
    ("missing.jsonl", "data file not found"),
    ("notes.txt", "neither a recipe"),
])
def test_bad_source_argument(hf_dir, tmp_path, monkeypatch, source, match):
    monkeypatch.chdir(tmp_path)
    if source.endswith(".txt"):
        (tmp_path / source).write_text("x")
    with pytest.raises(ev.EvalArgumentError, match=f"RECIPE_OR_DATA .*{match}"):
        ev.plan(parse(str(hf_dir), source))


def test_an_eval_with_nothing_to_run_is_a_recipe_error(hf_dir):
    with pytest.raises(RecipeError, match="nothing to run"):
        ev.plan(parse(str(hf_dir), "builtin:arithmetic", "--set", "eval.greedy=false"))


def test_bad_limit_and_engines(hf_dir):
    with pytest.raises(ev.EvalArgumentError, match="--limit"):
        ev.plan(parse(str(hf_dir), "builtin:arithmetic", "--limit", "0"))
    with pytest.raises(ev.EvalArgumentError, match="--engines"):
        ev.plan(parse(str(hf_dir), "builtin:arithmetic", "--engines", "0"))


# -- report ----------------------------------------------------------------------------------
def test_report_is_strict_json_with_pass_at_k(capsys):
    nan = float("nan")
    r = EvalResult(name="d/sampled", version=3, prompts=2, n=4, k=2, samples=8, scored=0,
                   generated=0, mean_reward=nan, pass_at_1=0.0, pass_at_k=0.0,
                   mean_response_length=nan, max_response_length=0, truncation_rate=nan,
                   engine_failures=8, reward_failures=0, correct=[0, 0], errors=["engine: x"])
    report = ev.build_report("m", 3, [r])
    text = json.dumps(report, allow_nan=False)
    (row,) = json.loads(text)["results"]
    assert row["pass@2"] == row["pass@k"] == 0.0 and row["failures"] == 8
    assert row["mean_reward"] is None and row["errors"] == ["engine: x"]
    assert report["metrics"]["eval/d/sampled/pass@2"] == 0.0
    assert report["metrics"]["eval/d/sampled/mean_reward"] is None
    ev.print_table([r], "m", 3)
    assert "d/sampled" in capsys.readouterr().out
    assert not math.isnan(report["metrics"]["eval/d/sampled/samples"])
