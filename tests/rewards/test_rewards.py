"""Reward plugins: built-ins give known answers; names resolve as built-in, entry point (a real
pip-installed package) or dotted path; contract violations are reported plainly; the score
function decodes tokens and passes metadata and kwargs."""

import asyncio
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from rlkit.buffers import Group, PromptRecord
from rlkit.cli import main
from rlkit.config import load_recipe
from rlkit.rewards import RewardInput, RewardNotFound, resolve_reward
from rlkit.rewards.scoring import make_score_fn
from rlkit.rollout.config import RewardConfig

ROOT = Path(__file__).resolve().parents[2]


def inp(response, label="13", finish="stop"):
    return RewardInput(prompt="What is 8 + 5?", response=response, label=label, finish_reason=finish)


@pytest.mark.parametrize(
    "name, response, label, expect",
    [
        ("math", "so \\boxed{13}.", "13", 1.0),
        ("math", "The answer is 13", "13", 1.0),
        ("math", "\\boxed{12}", "13", 0.0),
        ("math", "$0.5$", "\\frac{1}{2}", 1.0),
        ("math", "", "13", 0.0),
        ("exact_match", "\\boxed{ Paris }", "paris", 1.0),
        ("exact_match", "Paris, France", "paris", 0.0),
        ("format", "\\boxed{x}", None, 1.0),
        ("format", "no box", None, 0.0),
        ("format", "\\boxed{ }", None, 0.0),
    ],
)
def test_builtin_rewards_known_answers(name, response, label, expect):
    assert resolve_reward(name)(inp(response, label)) == expect


def test_dotted_paths_resolve_both_spellings():
    assert resolve_reward("tests.rewards.plugins:async_reward") is not None
    assert resolve_reward("tests.rewards.plugins.async_reward") is not None
    with pytest.raises(RewardNotFound, match="has no attribute 'nope'"):
        resolve_reward("tests.rewards.plugins:nope")
    with pytest.raises(RewardNotFound, match="cannot import module"):
        resolve_reward("no_such_module:fn")
    for malformed in (".relative:fn", ":fn"):
        with pytest.raises(RewardNotFound, match="cannot import module"):
            resolve_reward(malformed)


def test_unknown_name_lists_what_exists():
    with pytest.raises(RewardNotFound) as e:
        resolve_reward("mystery")
    assert "not a built-in (math, exact_match, format, judge)" in str(e.value)
    assert "rlkit.rewards" in str(e.value)


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory):
    """pip-install the example plugin package (into a folder put on sys.path, so the test does
    not change the environment)."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(ROOT / "examples" / "reward-plugin")],
        check=True,
    )
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    yield target
    sys.path.remove(str(target))
    sys.modules.pop("rlkit_example_reward", None)


def test_pip_installed_plugin_is_found_by_entry_point_and_used_from_a_recipe(installed_plugin, tmp_path):
    fn = resolve_reward("concise_math")
    assert fn.__module__ == "rlkit_example_reward"
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  reward:\n    name: concise_math\n    kwargs: {max_chars: 10}\n")
    cfg = load_recipe(recipe).rollout.reward
    score = make_score_fn(cfg, decode=lambda ids: "".join(chr(i) for i in ids))
    group = Group.new(0, PromptRecord(ids=(1,), text="q", label="13"), 1, 0, 0)
    s = group.samples[0]
    s.append([ord(c) for c in "\\boxed{13}"], [-0.1] * 10, 0, finish_reason="stop")
    assert asyncio.run(score(s, group)) == 1.0
    assert main(["check-reward", "concise_math"]) == 0


def test_pip_installed_filter_is_found_by_entry_point_through_the_same_rule(installed_plugin):
    from rlkit.plugins import load_group_filter, resolve_plugin
    from rlkit.rollout.config import FilterConfig

    assert resolve_plugin("filter", "min_spread").__module__ == "rlkit_example_reward"
    f = load_group_filter(FilterConfig(name="min_spread", kwargs={"spread": 0.5}))
    group = Group.new(0, PromptRecord(ids=(1,), text="q"), 2, 0, 0)
    for s, r in zip(group.samples, (0.2, 0.4)):
        s.append([3], [-0.1], 0, finish_reason="stop")
        s.set_reward(r)
    assert f.reason(group) == "narrow"
    group.samples[1].reward = 1.0
    assert f.reason(group) is None


def test_score_fn_decodes_and_passes_metadata_and_kwargs():
    seen = {}

    async def spy(sample, **kwargs):
        seen.update(kwargs, response=sample.response, label=sample.label, truncated=sample.truncated)
        return 0.5

    import tests.rewards.plugins as plugins

    plugins.spy = spy
    cfg = RewardConfig(name="tests.rewards.plugins:spy", kwargs={"scale": 2})
    score = make_score_fn(cfg, decode=lambda ids: "-".join(map(str, ids)))
    group = Group.new(0, PromptRecord(ids=(1,), text="q", label="L", metadata={"difficulty": 3}), 1, 0, 0)
    s = group.samples[0]
    s.append([4, 5], [-0.1, -0.2], 0, finish_reason="length")
    assert asyncio.run(score(s, group)) == 0.5
    assert seen == {"difficulty": 3, "scale": 2, "response": "4-5", "label": "L", "truncated": True}


def test_check_reward_reports_violations(capsys):
    assert main(["check-reward", "tests.rewards.plugins:bad_reward"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "expected a float" in out and "raised ZeroDivisionError" in out
    assert main(["check-reward", "tests.rewards.plugins:no_args"]) == 1
    assert "cannot be called as fn(sample, **kwargs)" in capsys.readouterr().out
    assert main(["check-reward", "tests.rewards.plugins:async_reward"]) == 0


def test_check_reward_warns_when_the_value_never_varies(capsys):
    # keeps the contract (exit 0, as before) but scores every input 0.0: a misspelled attribute
    assert main(["check-reward", "tests.rewards.plugins:misspelled_attribute"]) == 0
    out = capsys.readouterr().out
    assert "WARN  the reward returned 0.0 on all 8 inputs" in out
    assert "misspelled attribute of `sample`" in out
    assert "prompt, response, label, metadata, finish_reason" in out and "truncated" in out
    # a reward whose value varies gets no warning
    assert main(["check-reward", "tests.rewards.plugins:async_reward"]) == 0
    assert "WARN" not in capsys.readouterr().out
