"""A calculator tool for the arithmetic data: the model may write `<calc>EXPR</calc>` in its
turn; the environment evaluates EXPR and answers `<result>VALUE</result>`; a turn without a
call is the model's answer, which ends the episode (the recipe's reward scores it, e.g. the
math reward). At most `max_calls` calls per episode: the one past it ends the episode. Inside
the tag, the expression ends at a '<' or a '=' (`EXPRESSION_END`): `<calc>3 + 7 =</calc>` is
a call of 3 + 7.

EXPR is evaluated without `eval`: Python's `ast` parses it and only numbers, parentheses,
+ - * / // % ** and unary signs are walked, with bounds on its length, on exponents and on the
size of every intermediate value (model text is never executed). A bad expression is an
observation (`<error>...</error>`), not an exception: the model reads it and goes on."""

from __future__ import annotations

import ast
import math
import operator
import re
from typing import Any, Callable

from rlkit.rollout.environments.protocol import EpisodePrompt, Observation

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e18  # any intermediate value beyond this is refused (no giant integers)
# the closing tag may be missing: a turn stopped at "</calc>" may come back without it
CALL = re.compile(r"<calc>(.*?)(?:</calc>|$)", re.DOTALL)
# what the expression ends at inside the tag: a '<' (a garbled closing tag, "<calc>6 + 7</calc
# </calc>") or a '=' (the model's own claimed result, "<calc>3 + 7 = 18</calc>"), both seen
# in SmolLM2-135M's step-0 calls
EXPRESSION_END = re.compile(r"[<=]")

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """An expression the calculator refuses or cannot compute; the message says why."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression, or CalcError."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalcError(f"not an arithmetic expression: {expression.strip()[:60]!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _bounded(_UNARY[type(node.op)](_value(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalcError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except (OverflowError, ValueError, TypeError) as e:  # e.g. (-8) ** 0.5 is complex
            raise CalcError(f"cannot compute: {e}") from None
    raise CalcError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex) or not isinstance(value, (int, float)):
        raise CalcError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise CalcError(f"a value beyond {MAX_MAGNITUDE:g}")
    return value


def format_value(value: int | float) -> str:
    """Integers as integers; floats to 6 significant digits, integral floats without '.0'."""
    if isinstance(value, float):
        if value.is_integer():
            return str(int(value))
        return f"{value:.6g}"
    return str(value)


class CalculatorEnv:
    """One episode with the calculator tool (module docstring)."""

    def __init__(self, prompt: EpisodePrompt, max_calls: int = 4) -> None:
        if max_calls < 0:
            raise ValueError(f"max_calls must be >= 0, got {max_calls}")
        self.prompt = prompt
        self.max_calls = max_calls
        self.calls = 0

    async def reset(self) -> str | None:
        return None  # the prompt says how to call the tool

    async def step(self, action: str) -> Observation:
        call = CALL.search(action)
        if call is None:  # no call: this turn is the answer
            return Observation("", done=True, info={"calls": self.calls})
        if self.calls >= self.max_calls:
            return Observation("", done=True, info={"calls": self.calls, "over_budget": True})
        self.calls += 1
        try:
            result = f"<result>{format_value(evaluate(EXPRESSION_END.split(call.group(1), 1)[0]))}</result>"
        except CalcError as e:
            return Observation(f"<error>{e}</error>", info={"tool": "calc", "error": str(e)})
        return Observation(result, info={"tool": "calc"})

    def snapshot(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def restore(self, state: dict[str, Any]) -> None:
        self.calls = int(state["calls"])


def calculator(prompt: EpisodePrompt, max_calls: int = 4) -> CalculatorEnv:
    """The built-in `calculator` environment's factory."""
    return CalculatorEnv(prompt, max_calls=max_calls)
