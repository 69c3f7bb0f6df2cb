"""Each policy's knobs under the policy (rollout.partial, rollout.tail_batching,
rollout.ranked_dispatch; rollout.engine_model for the two that plan with predicted lengths):
the keys of the earlier layout load as aliases with one warning each, both names set
differently is an error naming both, unknown keys name their path, another policy's section is
ignored with a warning, and `rlkit config show` says where each value came from."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import yaml

from rlkit.cli import main
from rlkit.config import Recipe, RecipeError, load_recipe
from rlkit.config.loader import IgnoredKeyWarning, load_with_sources
from rlkit.config.provenance import provenance
from rlkit.rollout.config import MOVED_KEYS, DeprecatedKeyWarning, RolloutConfig
from rlkit.rollout.policy_names import POLICIES

CORRECTION = "train.algorithm.off_policy_correction=tis"

# every moved key, old path -> a value other than its default
OLD = {
    "over_provision": 3.0,
    "adaptive_over_provision.enabled": True,
    "adaptive_over_provision.min": 1.5,
    "adaptive_over_provision.max": 4.0,
    "adaptive_over_provision.utilization": 0.8,
    "dispatch.alpha": 0.3,
    "dispatch.cost_model": "streamrl",
    "dispatch.min_recall": 0.7,
    "dispatch.objective": "sum",
    "dispatch.profile": "some-profile",
    "dispatch.slots_per_engine": 16,
}
NEW = {
    "partial.over_provision": 3.0,
    "partial.adaptive.enabled": True,
    "partial.adaptive.min": 1.5,
    "partial.adaptive.max": 4.0,
    "partial.adaptive.utilization": 0.8,
    "ranked_dispatch.alpha": 0.3,
    "ranked_dispatch.cost_model": "streamrl",
    "ranked_dispatch.min_recall": 0.7,
    "ranked_dispatch.objective": "sum",
    "engine_model.profile": "some-profile",
    "engine_model.slots_per_engine": 16,
}
BASE = ["rollout.policy=ranked_dispatch", "rollout.ranked_dispatch.base=partial", CORRECTION]


def nested(flat: dict[str, object]) -> dict:
    out: dict = {}
    for key, value in flat.items():
        *parents, last = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def recipe_file(tmp_path: Path, rollout: dict, name: str = "r.yaml", extends: str | None = None) -> Path:
    data = {"extends": extends} if extends else {}
    data["rollout"] = {"policy": "ranked_dispatch", **rollout}
    data["rollout"].setdefault("ranked_dispatch", {})["base"] = "partial"
    data["train"] = {"algorithm": {"off_policy_correction": "tis"}}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def load_recording(*args) -> tuple[Recipe, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recipe = load_recipe(*args)
    return recipe, list(caught)


def of(caught, category) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, category)]


def test_the_table_covers_every_moved_key():
    assert {k.split(".")[0] for k in OLD} == {k.split(".")[0] for k in MOVED_KEYS}
    from rlkit.rollout.config import moved_to

    assert {moved_to(k) for k in OLD} == set(NEW)


def test_old_keys_in_a_file_load_as_the_new_ones_with_one_warning_each(tmp_path):
    new, caught = load_recording(recipe_file(tmp_path, nested(NEW), "new.yaml"))
    assert of(caught, DeprecatedKeyWarning) == []
    old, caught = load_recording(recipe_file(tmp_path, nested(OLD), "old.yaml"))
    assert old == new
    assert old.rollout.partial.adaptive.max == 4.0 and old.rollout.engine_model.slots_per_engine == 16
    said = of(caught, DeprecatedKeyWarning)
    assert len(said) == len(OLD)
    for (o, n), message in zip(zip(OLD, NEW), said):
        assert message.split(": ")[0].endswith("old.yaml")
        assert f"rollout.{o} is deprecated" in message and f"rollout.{n}" in message


def test_old_keys_on_the_command_line_load_as_the_new_ones(tmp_path):
    new = load_recipe(None, [*BASE, *(f"rollout.{k}={v}" for k, v in NEW.items())])
    old, caught = load_recording(None, [*BASE, *(f"rollout.{k}={v}" for k, v in OLD.items())])
    assert old == new
    said = of(caught, DeprecatedKeyWarning)
    assert len(said) == len(OLD) and all(m.startswith("command line: rollout.") for m in said)
    # an old section given whole on the command line moves key by key
    whole, caught = load_recording(None, [*BASE, "rollout.dispatch={alpha: 0.3, profile: p}"])
    assert (whole.rollout.ranked_dispatch.alpha, whole.rollout.engine_model.profile) == (0.3, "p")
    assert len(of(caught, DeprecatedKeyWarning)) == 2


def test_both_names_set_differently_is_an_error_naming_both(tmp_path):
    both = recipe_file(tmp_path, {"over_provision": 2.0, "partial": {"over_provision": 3.0}})
    with pytest.raises(RecipeError) as e:
        load_recipe(both)
    msg = str(e.value)
    assert "r.yaml: rollout.over_provision and rollout.partial.over_provision are both set" in msg
    assert "keep only rollout.partial.over_provision" in msg
    with pytest.raises(RecipeError, match="rollout.dispatch.profile and rollout.engine_model.profile"):
        load_recipe(recipe_file(tmp_path, {"dispatch": {"profile": "a"},
                                           "engine_model": {"profile": "b"}}))
    for order in (["rollout.over_provision=2", "rollout.partial.over_provision=3"],
                  ["rollout.partial.over_provision=3", "rollout.over_provision=2"]):
        with pytest.raises(RecipeError) as e, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_recipe(None, [*BASE, *order])
        assert ("command line: rollout.over_provision and rollout.partial.over_provision are "
                "both set, to different values (2 and 3)") in str(e.value)
    # the same value twice is one setting (still a warning for the old name)
    same, caught = load_recording(recipe_file(tmp_path, {"over_provision": 3.0,
                                                         "partial": {"over_provision": 3.0}}))
    assert same.rollout.partial.over_provision == 3.0 and len(of(caught, DeprecatedKeyWarning)) == 1


def test_a_file_extending_an_old_style_base_overrides_it_with_either_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files are named relative to the working folder
    recipe_file(tmp_path, {"over_provision": 2.0, "dispatch": {"alpha": 0.3}}, "base.yaml")
    child = recipe_file(tmp_path, {"partial": {"over_provision": 3.0}}, "child.yaml", "base.yaml")
    r, caught = load_recording(child)
    assert (r.rollout.partial.over_provision, r.rollout.ranked_dispatch.alpha) == (3.0, 0.3)
    assert all(m.startswith("base.yaml: ") for m in of(caught, DeprecatedKeyWarning))
    r, _ = load_recording(child, ["rollout.over_provision=4"])  # the command line over both
    assert r.rollout.partial.over_provision == 4.0


def test_unknown_keys_under_a_policy_section_name_the_key_path(tmp_path):
    cases = {
        "rollout.partial.over_provison=2": "rollout.partial.over_provison: unknown key (did you mean 'over_provision'?)",
        "rollout.partial.adaptive.enabeld=true": "rollout.partial.adaptive.enabeld: unknown key (did you mean 'enabled'?)",
        "rollout.ranked_dispatch.alpah=0.1": "rollout.ranked_dispatch.alpah: unknown key (did you mean 'alpha'?)",
        "rollout.tail_batching.eta=2": "rollout.tail_batching.eta: unknown key",
        "rollout.engine_model.profil=x": "rollout.engine_model.profil: unknown key (did you mean 'profile'?)",
        # under an old section: the key as written, and where that section's keys went
        "rollout.dispatch.alpah=0.1": "rollout.dispatch.alpah: unknown key (did you mean 'alpha'?)",
        "rollout.adaptive_over_provision.enabeld=true":
            "rollout.partial.adaptive.enabeld: unknown key (did you mean 'enabled'?) "
            "(written as rollout.adaptive_over_provision.enabeld)",
    }
    for override, expected in cases.items():
        with pytest.raises(RecipeError) as e, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_recipe(None, [*BASE, override])
        assert f"command line: {expected}" in str(e.value), (override, str(e.value))
    with pytest.raises(RecipeError) as e:
        load_recipe(recipe_file(tmp_path, {"partial": {"adaptive": {"nope": 1}}}))
    assert "r.yaml: rollout.partial.adaptive.nope: unknown key" in str(e.value)
    with pytest.raises(RecipeError, match="rollout.dispatch no longer exists: its keys moved to "
                       r"rollout.ranked_dispatch \(alpha"):
        load_recipe(recipe_file(tmp_path, {"dispatch": {"alpah": 0.1}}))


def test_another_policys_section_is_ignored_with_a_warning(tmp_path):
    r, caught = load_recording(None, ["rollout.policy=sync", "rollout.partial.over_provision=3",
                                      "rollout.tail_batching.eta_prompts=2"])
    said = of(caught, IgnoredKeyWarning)
    assert len(said) == 2
    assert "command line: rollout.partial is ignored: rollout.policy=sync does not read it" in said[0]
    assert "rollout.tail_batching is ignored" in said[1]
    # the same knobs read by the policy that owns them: nothing said
    _, caught = load_recording(None, ["rollout.policy=partial", "rollout.partial.over_provision=3",
                                      CORRECTION])
    assert of(caught, IgnoredKeyWarning) == []
    # ranked_dispatch reads partial only over base partial; engine_model only when planning
    _, caught = load_recording(None, ["rollout.policy=ranked_dispatch", "rollout.partial.over_provision=3"])
    assert any("rollout.partial is ignored: rollout.policy=ranked_dispatch (base sync)" in m
               for m in of(caught, IgnoredKeyWarning))
    _, caught = load_recording(None, ["rollout.policy=partial", CORRECTION,
                                      "rollout.engine_model.slots_per_engine=4"])
    assert any("rollout.engine_model is ignored" in m for m in of(caught, IgnoredKeyWarning))
    _, caught = load_recording(None, ["rollout.policy=partial", CORRECTION,
                                      "rollout.partial.adaptive.enabled=true",
                                      "rollout.engine_model.slots_per_engine=4"])
    assert of(caught, IgnoredKeyWarning) == []
    # inherited from an extended base: the base's business, nothing said
    recipe_file(tmp_path, {"partial": {"over_provision": 3.0}}, "base.yaml")
    child = tmp_path / "child.yaml"
    child.write_text("extends: base.yaml\nrollout:\n  policy: sync\n")
    _, caught = load_recording(child)
    assert of(caught, IgnoredKeyWarning) == []
    # ignored is ignored: the ranker is needed only by what is read
    r, _ = load_recording(None, ["rollout.policy=sync", "rollout.ranker.name=null",
                                 "rollout.partial.adaptive.enabled=true"])
    assert r.rollout.policy == "sync"
    with pytest.raises(RecipeError, match="rollout.partial.adaptive needs a length ranker"):
        load_recipe(None, ["rollout.policy=partial", CORRECTION, "rollout.ranker.name=null",
                           "rollout.partial.adaptive.enabled=true"])


def test_python_callers_and_old_run_folders_still_load():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = RolloutConfig(over_provision=3.0, dispatch={"alpha": 0.3})
    assert (cfg.partial.over_provision, cfg.ranked_dispatch.alpha) == (3.0, 0.3)
    assert len(of(caught, DeprecatedKeyWarning)) == 2
    # an earlier run's recipe.yaml: every key of the old layout, at its default
    old_dump = Recipe().model_dump(mode="json")
    rollout = old_dump["rollout"]
    partial, engine_model = rollout.pop("partial"), rollout.pop("engine_model")
    ranked = rollout["ranked_dispatch"]
    rollout["over_provision"] = partial["over_provision"]
    rollout["adaptive_over_provision"] = partial["adaptive"]
    rollout["dispatch"] = {**{k: ranked.pop(k) for k in ("alpha", "cost_model", "min_recall",
                                                         "objective")}, **engine_model}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert Recipe.model_validate(old_dump) == Recipe()


def test_bench_spec_knobs_name_keys_of_the_schema():
    from rlkit.config.loader import iter_fields

    known = {path for path, _, _ in iter_fields(RolloutConfig)}
    for decl in POLICIES.values():
        keys = list(decl.arg) + [k for opt in decl.options.values() for k in opt]
        keys += list(decl.off_policy.when) if decl.off_policy else []
        assert not set(keys) - known, (decl.name, set(keys) - known)


def test_config_show_marks_written_alias_default_and_derived(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files are named relative to the working folder
    base = recipe_file(tmp_path, {"batch_size": 4, "over_provision": 3.0}, "base.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recipe, src = load_with_sources(base, ["rollout.n_samples_per_prompt=2"])
        assert main(["config", "show", str(base), "rollout.n_samples_per_prompt=2"]) == 0
    marks = provenance(recipe, src)
    assert marks[("rollout", "batch_size")] == "written: base.yaml"
    assert marks[("rollout", "n_samples_per_prompt")] == "written: command line"
    assert marks[("rollout", "partial", "over_provision")] == "alias of rollout.over_provision: base.yaml"
    assert marks[("rollout", "ranked_dispatch", "alpha")] == "default"
    assert marks[("train", "weight_sync", "method")] == "derived (default auto)"
    # a bare name's fields: derived from it
    assert marks[("train", "algorithm", "off_policy_correction", "estimator")].startswith(
        "derived from train.algorithm.off_policy_correction: tis (base.yaml)")
    out = capsys.readouterr().out
    assert "batch_size: 4" in out and "# written: base.yaml" in out
    assert "over_provision: 3.0" in out and "# alias of rollout.over_provision: base.yaml" in out
    # the marks are comments: the output is the resolved recipe
    assert yaml.safe_load(out) == recipe.model_dump(mode="json")
    # --no-defaults: only what was written or derived
    assert main(["config", "show", "rollout.batch_size=3", "--no-defaults"]) == 0
    out = capsys.readouterr().out
    assert "batch_size: 3" in out and "# default" not in out and "alpha:" not in out
    # --plain: the YAML alone
    assert main(["config", "show", "--plain", "rollout.batch_size=3"]) == 0
    out = capsys.readouterr().out
    assert "#" not in out and yaml.safe_load(out)["rollout"]["batch_size"] == 3
    # a written 'auto' resolved by the schema, and another policy's section ignored
    recipe, src = load_with_sources(None, ["train.weight_sync.method=auto"])
    assert provenance(recipe, src)[("train", "weight_sync", "method")] == \
        "derived (written auto, written: command line)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recipe, src = load_with_sources(None, ["rollout.tail_batching.eta_prompts=2"])
    assert provenance(recipe, src)[("rollout", "tail_batching", "eta_prompts")] == \
        "written: command line; ignored: rollout.policy=sync does not read it"
