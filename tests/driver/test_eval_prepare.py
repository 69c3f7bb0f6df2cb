"""The run loads its held-out sets with the prompts, before any engine serves or step runs:
a bad eval row stops it there, naming the eval key, the file and the row."""

import asyncio

import pytest

from rlkit.config import load_recipe
from rlkit.data.errors import DataError
from rlkit.driver.actors import RolloutActor
from rlkit.rollout.demo_models import resolve_model_path


@pytest.fixture()
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("RLKIT_CACHE", str(tmp_path / "cache"))
    return resolve_model_path("tiny")


def prepared(tmp_path, model, *overrides):
    r = load_recipe(None, ["rollout.reward.isolation=thread", *overrides])
    actor = RolloutActor(r.model_dump(mode="json"), model, str(tmp_path))
    asyncio.run(actor.prepare())
    return actor


def test_a_bad_eval_row_stops_the_run_before_it_starts(tmp_path, tiny):
    bad = tmp_path / "held.jsonl"
    bad.write_text('{"prompt": "1 + 1?", "label": "2"}\n{"prompt": "2 + 2?"}\n')
    with pytest.raises(DataError, match=r"eval\.datasets\[0\] \(held\): .*held\.jsonl: line 2: "
                                        r"missing key 'label'"):
        prepared(tmp_path, tiny, f"eval.datasets=[{{name: held, path: '{bad}'}}]",
                 "eval.every_steps=1")


def test_the_eval_sets_are_loaded_with_the_prompts(tmp_path, tiny):
    actor = prepared(tmp_path, tiny, "eval.datasets=[{name: h, path: 'builtin:arithmetic?split=test&rows=5'}]",
                     "eval.every_steps=2", "eval.n_samples=4", "eval.k=2")
    ev = actor.evaluator
    assert [len(v) for v in ev.datasets.values()] == [5]
    assert [(p.name, p.n, p.k) for p in ev.passes] == [("h/greedy", 1, 1), ("h/sampled", 4, 2)]
    assert prepared(tmp_path, tiny).evaluator is None  # no eval section: nothing loaded


@pytest.mark.parametrize("section", ["rollout.reward", "eval.reward"])
def test_an_unknown_reward_names_the_recipe_key_it_came_from(tmp_path, tiny, section):
    from rlkit.plugins import PluginNotFound

    with pytest.raises(PluginNotFound, match=rf"^{section}\.name: reward 'no_such' not found"):
        prepared(tmp_path, tiny, "eval.datasets=[{name: h, path: 'builtin:arithmetic?split=test&rows=2'}]",
                 "eval.every_steps=1", f"{section}.name=no_such")
