"""The built-in environments and the tool runner (issue 22's building blocks): the calculator
never executes model text and agrees with Python's arithmetic on what it accepts; the guessing
game's episodes are deterministic per prompt and survive a snapshot mid-episode exactly; a tool
that raises, hangs or answers garbage is counted and the episode goes on; both resolve through
the one plugin rule."""

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlkit.rollout.environments.calculator import CalcError, CalculatorEnv, evaluate, format_value
from rlkit.rollout.environments.guess_number import GuessNumberEnv
from rlkit.rollout.environments.protocol import Environment, EpisodePrompt, Observation, can_snapshot
from rlkit.rollout.environments.tools import ToolRunner
from rlkit.plugins import PluginNotFound, resolve_plugin

PROMPT = EpisodePrompt("What is 12 * 7?", label="84", index=3)


def run(coro):
    return asyncio.run(coro)


# -- calculator ---------------------------------------------------------------------------------
@st.composite
def expressions(draw, depth=0):
    if depth > 3 or draw(st.booleans()):
        return str(draw(st.integers(0, 999)))
    op = draw(st.sampled_from(["+", "-", "*", "//", "%"]))
    return f"({draw(expressions(depth + 1))} {op} {draw(expressions(depth + 1))})"


@given(expressions())
def test_the_calculator_agrees_with_python_on_plain_arithmetic(expr):
    try:
        expected = eval(expr)  # noqa: S307 - the test's own generated arithmetic, never model text
    except ZeroDivisionError:
        with pytest.raises(CalcError, match="division by zero"):
            evaluate(expr)
        return
    assert evaluate(expr) == expected


@pytest.mark.parametrize("expr, why", [
    ("__import__('os').system('true')", "not Call"),
    ("x + 1", "not Name"),
    ("(1).__class__", "not Attribute"),
    ("[1, 2]", "not List"),
    ("'a' * 3", "not Constant"),
    ("2 ** 1000", "exponent 1000"),
    ("10 ** 19", "beyond"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 / 0", "division by zero"),
    ("1 +", "not an arithmetic expression"),
    ("1" * 201, "longer than 200"),
])
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expr, why):
    with pytest.raises(CalcError, match=why.replace("(", r"\(")):
        evaluate(expr)


def test_a_calculator_episode_answers_calls_then_ends_on_the_answer():
    env = CalculatorEnv(PROMPT, max_calls=2)
    assert isinstance(env, Environment) and can_snapshot(env)
    assert run(env.reset()) is None
    assert run(env.step("Let me compute <calc>12 * 7</calc>")) == Observation("<result>84</result>", info={"tool": "calc"})
    bad = run(env.step("<calc>12 * x</calc>"))
    assert bad.text.startswith("<error>only numbers") and not bad.done
    over = run(env.step("<calc>1 + 1</calc>"))  # a third call: over its budget of two
    assert over.done and over.info["over_budget"]
    assert run(CalculatorEnv(PROMPT).step("<calc>3 * 4")).text == "<result>12</result>"  # stop trimmed
    fresh = CalculatorEnv(PROMPT)
    assert run(fresh.step("The answer is \\boxed{84}")).done
    assert [format_value(v) for v in (3, 2.0, 1 / 3)] == ["3", "2", "0.333333"]


# -- guess the number -----------------------------------------------------------------------------
def play(env, guesses):
    return [run(env.step(f"I guess {g}")) for g in guesses]


def test_the_guessing_game_answers_higher_lower_correct_and_ends():
    env = GuessNumberEnv(EpisodePrompt("guess", label=37), high=100, max_turns=5)
    assert "1 to 100" in run(env.reset())
    obs = play(env, [50, 25, 37])
    assert [o.text for o in obs] == ["lower", "higher", "correct"]
    assert obs[-1].done and obs[-1].reward == 1.0 and obs[-1].info["turns"] == 3
    loser = GuessNumberEnv(EpisodePrompt("guess", label=37), high=100, max_turns=2)
    assert [(o.done, o.reward) for o in play(loser, [1, 2])] == [(False, None), (True, 0.0)]
    assert run(GuessNumberEnv(PROMPT).step("no idea")).text == "say a number"


@given(index=st.integers(0, 10_000), cut=st.integers(0, 7), guesses=st.lists(st.integers(1, 100), min_size=8, max_size=8))
def test_a_guessing_episode_restored_from_a_snapshot_mid_way_ends_as_the_uninterrupted_one(index, cut, guesses):
    prompt = EpisodePrompt("guess", index=index)
    whole = play(GuessNumberEnv(prompt, max_turns=8), guesses)
    first = GuessNumberEnv(prompt, max_turns=8)
    head = play(first, guesses[:cut])
    state = first.snapshot()
    again = GuessNumberEnv(EpisodePrompt("guess", index=index + 1), max_turns=8)  # another secret
    again.restore(state)
    assert head + play(again, guesses[cut:]) == whole
    assert GuessNumberEnv(prompt).secret == GuessNumberEnv(prompt).secret  # fixed per prompt


# -- the tool runner ----------------------------------------------------------------------------
class Raises:
    async def step(self, action):
        raise RuntimeError("the tool broke")


class Hangs:
    async def step(self, action):
        await asyncio.Event().wait()  # never answers


class Garbage:
    async def step(self, action):
        return {"not": "an observation"}


def test_tools_that_raise_hang_or_answer_garbage_are_counted_and_the_episode_goes_on():
    async def main():
        runner = ToolRunner(max_concurrency=2, timeout_s=0.05)
        answers = await asyncio.gather(*(runner.step(env, "act") for env in
                                         (Raises(), Hangs(), Garbage(), CalculatorEnv(PROMPT))))
        return runner, answers

    runner, answers = run(main())
    assert [a.info.get("tool_failure") for a in answers] == ["raised", "timeout", "bad_output", None]
    assert all(not a.done for a in answers[:3]) and answers[0].text.startswith("<tool_error>RuntimeError")
    assert dict(runner.failures) == {"raised": 1, "timeout": 1, "bad_output": 1} and runner.calls == 4


def test_no_more_tools_run_at_once_than_the_bound():
    running, peak = 0, 0

    class Slow:
        async def step(self, action):
            nonlocal running, peak
            running += 1
            peak = max(peak, running)
            await asyncio.sleep(0)
            running -= 1
            return Observation("ok")

    async def main():
        runner = ToolRunner(max_concurrency=3)
        await asyncio.gather(*(runner.step(Slow(), "x") for _ in range(10)))

    run(main())
    assert peak == 3


# -- plugins ------------------------------------------------------------------------------------
def test_environments_resolve_by_built_in_name_and_dotted_path():
    assert isinstance(resolve_plugin("environment", "calculator")(PROMPT), CalculatorEnv)
    make = resolve_plugin("environment", "rlkit.rollout.environments.guess_number:guess_number")
    assert make(PROMPT, high=10).high == 10
    with pytest.raises(PluginNotFound, match="environment 'nope' not found"):
        resolve_plugin("environment", "nope")


def test_the_recipe_s_episode_runner_tokenizes_observations_once_with_the_turn_markers(tmp_path):
    """rollout.episode resolves to a runner over the model's tokenizer: the turn's stop strings
    join the recipe's, and an observation becomes the template's tokens (ChatML's turn markers
    around the text), which decode back to it."""
    from transformers import AutoTokenizer

    from rlkit.config import load_recipe
    from rlkit.plugins import load_episode_runner
    from rlkit.rollout.demo_models import build_tiny

    build_tiny(tmp_path, arch="qwen2")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    r = load_recipe(None, ["rollout.episode.generator=multi_turn", "rollout.episode.environment=calculator",
                           "rollout.episode.turn_stop=['</calc>']", "rollout.sampling.stop=['###']"])
    runner = load_episode_runner(r.rollout.episode, r.rollout.sampling, tokenizer)
    assert runner.turn_sampling.stop == ["###", "</calc>"] and runner.turn_sampling.max_new_tokens == 512
    ids = runner.codec.encode_observation("<result>84</result>")
    assert tokenizer.decode(ids) == "<|im_end|>\n<|im_start|>user\n<result>84</result><|im_end|>\n<|im_start|>assistant\n"
    assert load_episode_runner(load_recipe(None, []).rollout.episode, r.rollout.sampling, tokenizer) is None


def test_a_misspelt_env_kwarg_fails_before_anything_starts(tmp_path, monkeypatch):
    """rollout.episode.env_kwargs is checked against the factory's signature in the driver,
    before Ray, engines or trainer start: one error naming the key, not a traceback at the first
    step (issue 32)."""
    from rlkit.config import load_recipe
    from rlkit.driver import cluster, run
    from rlkit.plugins import environment_factory

    def no_cluster(*a, **k):
        raise AssertionError("the cluster started")

    monkeypatch.setattr(cluster.Cluster, "__init__", no_cluster)
    recipe = load_recipe(None, ["rollout.episode.generator=multi_turn",
                                "rollout.episode.environment=guess_number",
                                "rollout.episode.env_kwargs={hihg: 10}",
                                f"run.output_dir={tmp_path}"])
    with pytest.raises(PluginNotFound, match=r"rollout.episode.env_kwargs \{'hihg': 10\}: "
                       r"environment 'guess_number' cannot take them \(got an unexpected "
                       r"keyword argument 'hihg'\); its factory is guess_number\(prompt"):
        run.train(recipe)
    assert not (tmp_path / recipe.run.name).exists()  # nothing written either
    ok = recipe.rollout.episode.model_copy(update={"env_kwargs": {"high": 10}})
    assert environment_factory(ok)(PROMPT, **ok.env_kwargs).high == 10
    with pytest.raises(PluginNotFound, match="reward 'nope' not found"):
        run.train(load_recipe(None, ["rollout.reward.name=nope", f"run.output_dir={tmp_path}"]))
