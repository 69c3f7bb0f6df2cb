"""Typed recipes: errors name the key path and the file; extends and overrides compose; every
field is documented; the generated reference is current; the shipped recipes validate."""

import re
import warnings
from pathlib import Path

import pytest
from pydantic import BaseModel

from rlkit.cli import main
from rlkit.config import Recipe, RecipeError, load_recipe
from rlkit.config.loader import iter_fields
from rlkit.config.reference import render_reference
from rlkit.rollout.policies import POLICY_NAMES

ROOT = Path(__file__).resolve().parents[2]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults_validate():
    r = load_recipe(None)
    assert r.rollout.policy == "sync" and r.mode == "sync"


def test_unknown_key_names_path_file_and_suggests(tmp_path):
    f = write(tmp_path / "r.yaml", "rollout:\n  batch_sise: 2\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(f)
    msg = str(e.value)
    assert "r.yaml: rollout.batch_sise: unknown key (did you mean 'batch_size'?)" in msg
    # a misspelt key that moved: the suggestion names its new place
    with pytest.raises(RecipeError, match=r"rollout.over_provison: unknown key \(did you mean "
                       r"'over_provision'\? it is now rollout.partial.over_provision\)"):
        load_recipe(write(tmp_path / "r.yaml", "rollout:\n  over_provison: 2\n"))


def test_wrong_type_and_out_of_range_name_the_key(tmp_path):
    f = write(tmp_path / "r.yaml", "rollout:\n  batch_size: many\n  sampling:\n    top_p: 1.5\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(f)
    msg = str(e.value)
    assert "r.yaml: rollout.batch_size: Input should be a valid integer" in msg
    assert "r.yaml: rollout.sampling.top_p: Input should be less than or equal to 1 (got 1.5)" in msg


def test_extends_merges_and_reports_the_file_that_set_the_bad_value(tmp_path):
    write(tmp_path / "base.yaml", "rollout:\n  batch_size: 4\n  n_samples_per_prompt: 0\n")
    child = write(
        tmp_path / "child.yaml",
        "extends: base.yaml\nrollout:\n  batch_size: 6\nrun:\n  name: child\n",
    )
    with pytest.raises(RecipeError, match=r"base\.yaml: rollout\.n_samples_per_prompt"):
        load_recipe(child)
    r = load_recipe(child, ["rollout.n_samples_per_prompt=3"])
    assert (r.rollout.batch_size, r.rollout.n_samples_per_prompt, r.run.name) == (6, 3, "child")


def test_extends_list_and_cycle(tmp_path):
    write(tmp_path / "a.yaml", "run: {seed: 1}\n")
    write(tmp_path / "b.yaml", "run: {seed: 2, name: b}\n")
    c = write(tmp_path / "c.yaml", "extends: [a.yaml, b.yaml]\n")
    assert load_recipe(c).run.seed == 2  # later bases win
    write(tmp_path / "x.yaml", "extends: y.yaml\n")
    write(tmp_path / "y.yaml", "extends: x.yaml\n")
    with pytest.raises(RecipeError, match="'extends' cycle"):
        load_recipe(tmp_path / "x.yaml")


def test_overrides_are_typed_and_errors_say_command_line():
    r = load_recipe(None, ["train.optimizer.lr=3e-6", "rollout.sampling.stop=[a, b]"])
    assert r.train.optimizer.lr == 3e-6 and r.rollout.sampling.stop == ["a", "b"]
    with pytest.raises(RecipeError, match="command line: rollout.nope: unknown key"):
        load_recipe(None, ["rollout.nope=1"])
    with pytest.raises(RecipeError, match="command line: rollout.batch_size: Input should be a valid"):
        load_recipe(None, ["rollout.batch_size.x=1"])
    with pytest.raises(RecipeError, match="rollout.batch_size is a value, not a section"):
        load_recipe(None, ["rollout.batch_size=2", "rollout.batch_size.x=1"])
    with pytest.raises(RecipeError, match="not of the form key.path=value"):
        load_recipe(None, ["rollout.batch_size"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "none.yaml")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(write(tmp_path / "bad.yaml", "rollout: [unclosed\n"))
    with pytest.raises(RecipeError, match="must be a mapping"):
        load_recipe(write(tmp_path / "list.yaml", "- 1\n- 2\n"))


def test_off_policy_modes_require_an_explicit_correction_choice():
    with pytest.raises(RecipeError, match="off_policy_correction must be chosen explicitly"):
        load_recipe(None, ["rollout.policy=partial"])
    with pytest.raises(RecipeError, match="mode=async with rollout.max_staleness > 0"):
        load_recipe(None, ["mode=async"])
    assert load_recipe(None, ["mode=async", "rollout.max_staleness=0"]).mode == "async"
    r = load_recipe(None, ["rollout.policy=partial", "train.algorithm.off_policy_correction=tis"])
    assert r.train.algorithm.off_policy_correction.estimator == "tis"
    # the correction is a section: its fields by path, a bare name's fields only once written so
    r = load_recipe(None, ["rollout.policy=partial", "train.algorithm.off_policy_correction.estimator=mis",
                           "train.algorithm.off_policy_correction.level=geometric"])
    c = r.train.algorithm.off_policy_correction
    assert (c.estimator, c.level, c.low, c.high) == ("mis", "geometric", 0.5, 2.0)
    with pytest.raises(RecipeError, match="bare name .'tis'. takes fields once written as a section"):
        load_recipe(None, ["train.algorithm.off_policy_correction=tis",
                           "train.algorithm.off_policy_correction.level=sequence"])
    with pytest.raises(RecipeError, match="tis_cap is now train.algorithm.off_policy_correction.high"):
        load_recipe(None, ["train.algorithm.tis_cap=3"])
    # the registry says which policies make off-policy tokens: tail batching only when resuming
    assert load_recipe(None, ["rollout.policy=tail_batching"]).rollout.tail_batching.deferred == "restart"
    with pytest.raises(RecipeError, match="tail_batching.deferred=resume continues deferred"):
        load_recipe(None, ["rollout.policy=tail_batching", "rollout.tail_batching.deferred=resume"])
    with pytest.raises(RecipeError, match="staleness_policy=correct keeps stale groups"):
        load_recipe(None, ["rollout.staleness_policy=correct"])


def test_global_batch_must_divide_the_rollout_batch():
    with pytest.raises(RecipeError, match="must divide the rollout batch"):
        load_recipe(None, ["rollout.batch_size=3", "rollout.n_samples_per_prompt=2",
                           "train.micro_batch_size=4", "train.global_batch_size=4"])


def test_router_ports_must_differ():
    with pytest.raises(RecipeError, match="rollout.router: router.port and router.prometheus_port are both 30000"):
        load_recipe(None, ["rollout.router.port=30000", "rollout.router.prometheus_port=30000"])


def test_every_field_has_a_description_and_a_default():
    for path, field, _ in iter_fields(Recipe):
        assert field.description and field.description.strip(), f"{path} has no description"
        assert not field.is_required(), f"{path} has no default"
    for name, field in Recipe.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            assert field.description, f"section {name} has no description"


def test_generated_reference_is_current():
    committed = (ROOT / "docs" / "recipe-reference.md").read_text()
    assert committed == render_reference(), "docs/recipe-reference.md is stale: run `rlkit config docs`"


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "recipes").glob("*.yaml")))
def test_shipped_recipes_validate(recipe):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no moved key, no other policy's section
        load_recipe(ROOT / "recipes" / recipe)


def test_config_show_prints_the_resolved_recipe(capsys):
    assert main(["config", "show", "rollout.batch_size=5"]) == 0
    assert "batch_size: 5" in capsys.readouterr().out
    assert main(["config", "show", "rollout.bogus=1"]) == 2
    assert "rollout.bogus: unknown key" in capsys.readouterr().err


def test_an_unknown_policy_is_refused_naming_the_registered_ones():
    with pytest.raises(RecipeError, match="rollout.policy") as e:
        load_recipe(None, ["rollout.policy=magic_dispatch"])
    for name in POLICY_NAMES:
        assert repr(name) in str(e.value)


def test_a_check_across_a_section_names_every_file_that_set_its_keys(tmp_path):
    write(tmp_path / "base.yaml", "rollout:\n  sampling:\n    max_new_tokens: 64\n    min_new_tokens: 8\n")
    child = write(tmp_path / "child.yaml", "extends: base.yaml\nrollout:\n  sampling:\n    max_new_tokens: 4\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(child)
    where = re.search(r"\n  (.*): rollout\.sampling: sampling\.min_new_tokens", str(e.value))
    assert where and sorted(Path(p).name for p in where[1].split(", ")) == ["base.yaml", "child.yaml"]
    with pytest.raises(RecipeError) as e:
        load_recipe(tmp_path / "base.yaml", ["rollout.sampling.max_new_tokens=4"])
    where = re.search(r"\n  (.*): rollout\.sampling: ", str(e.value))
    assert where and {Path(p).name for p in where[1].split(", ")} == {"base.yaml", "command line"}


def test_a_bad_policy_names_the_key_the_value_and_the_choices_not_the_section():
    with pytest.raises(RecipeError) as e:
        load_recipe(None, ["rollout.policy=parital", "rollout.batch_size=8"])
    msg = str(e.value)
    assert "command line: rollout.policy: Input should be" in msg and "(got 'parital')" in msg
    assert all(repr(name) in msg for name in POLICY_NAMES)
    assert "batch_size" not in msg and "{" not in msg
    # a check across the section's keys names them itself: the section is not printed back
    with pytest.raises(RecipeError) as e:
        load_recipe(None, ["rollout.policy=ranked_dispatch", "rollout.ranker.name=null",
                            "rollout.batch_size=8"])
    msg = str(e.value)
    assert "rollout: rollout.policy=ranked_dispatch needs a length ranker" in msg
    assert "batch_size" not in msg and "{" not in msg


def test_distillation_and_its_teacher_come_together():
    teacher = "rollout.frozen_engines={t: {role: teacher, model: tiny}}"
    r = load_recipe(ROOT / "recipes" / "grpo_tiny_ci.yaml", [teacher, "train.algorithm.distill_coef=1"])
    assert r.rollout.teacher == "t" and r.train.algorithm.distill_coef == 1
    for overrides, words in [
        (["train.algorithm.distill_coef=1"], "needs a teacher"),
        ([teacher], "distill_coef, which is 0"),
        (["rollout.frozen_engines={j: {role: judge, model: tiny}}", "train.algorithm.loss=sft",
          "data.response_key=response"], "starts no engine"),
    ]:
        with pytest.raises(Exception, match=words):
            load_recipe(ROOT / "recipes" / "grpo_tiny_ci.yaml", overrides)
