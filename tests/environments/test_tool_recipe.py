"""The calculator recipe teaches its call format (issue 32 item 4): the worked episodes in its
system prompt are exactly what the calculator and the observation template produce, evaluation
sees them too, and the call forms SmolLM2-135M writes at step 0 are read as calls, still on
Python's ast only."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from rlkit.config import load_recipe
from rlkit.rollout.environments.calculator import CalculatorEnv
from rlkit.rollout.environments.protocol import EpisodePrompt

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "grpo_smollm2_tool.yaml"
PROMPT = EpisodePrompt("What is 6 + 7?", label="13")


def step(action: str):
    return asyncio.run(CalculatorEnv(PROMPT).step(action))


@pytest.mark.parametrize("action, text", [
    ("<calc>6 + 7</calc>", "<result>13</result>"),
    ("<calc>6 + 7</calc</calc>", "<result>13</result>"),  # a garbled closing tag
    ("<calc>3 + 7 = 18, rounded", "<result>10</result>"),  # its own claimed result is ignored
    ("<calc>12 * 7 =</calc>", "<result>84</result>"),
])
def test_step_zero_call_forms_are_calls(action, text):
    assert step(action).text == text


@pytest.mark.parametrize("action", ["<calc>x = 1</calc>", "<calc>__import__('os').system('true')</calc>",
                                    "<calc>(1).__class__ <</calc>", "<calc>= 2</calc>"])
def test_the_cut_lets_nothing_but_arithmetic_through(action):
    obs = step(action)
    assert obs.text.startswith("<error>") and not obs.done


def test_the_worked_episodes_are_what_the_environment_and_the_template_produce():
    r = load_recipe(RECIPE)
    ep, system = r.rollout.episode, r.data.system_prompt
    assert r.eval.datasets and all(d.system_prompt == system for d in r.eval.datasets)
    turns = re.findall(r"<\|im_start\|>assistant\n(<calc>.*?</calc>)(.*?)<\|im_start\|>assistant\n(\\boxed\{\d+\})",
                       system, re.DOTALL)
    assert len(turns) == 2
    for call, between, answer in turns:
        obs = step(call)
        assert not obs.done
        assert ep.observation_template.format(observation=obs.text) == between + "<|im_start|>assistant\n"
        assert answer == "\\boxed{" + obs.text.removeprefix("<result>").removesuffix("</result>") + "}"
    assert ep.turn_stop == ["</calc>"] and system.endswith("\\boxed{5}")  # the template closes it


def test_the_prompt_renders_as_chat_turns(tmp_path):
    from transformers import AutoTokenizer

    from rlkit.data.prompts import load_prompts
    from rlkit.rollout.demo_models import build_tiny

    build_tiny(tmp_path, arch="qwen2")
    tok = AutoTokenizer.from_pretrained(tmp_path)
    r = load_recipe(RECIPE, ["data.path=builtin:arithmetic?rows=4"])
    text = load_prompts(r.data, tok).record(0).text
    # one system turn holding the examples, then the problem as the last user turn
    assert text.startswith("<|im_start|>system\nYou have a calculator") and text.count("<|im_start|>user") == 5
    assert text.endswith("as \\boxed{N}.<|im_end|>\n<|im_start|>assistant\n")
