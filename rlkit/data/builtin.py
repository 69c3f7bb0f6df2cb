"""Data sets the project generates itself (no hub): `data.path: builtin:<name>`.

`builtin:arithmetic` is small integer arithmetic with exact answers, sized so that a 135M
instruct model solves some but not all of it at first: a reward signal that GRPO can raise on
two CPU cores. Options go after a '?': `builtin:arithmetic?rows=500&max_operand=30&seed=3`.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Iterator

from rlkit.data.errors import DataError


def arithmetic(rows: int = 2000, max_operand: int = 20, seed: int = 0) -> Iterator[dict[str, Any]]:
    rng = random.Random(seed)
    for _ in range(rows):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-*" if max_operand <= 12 else "+-")
        if op == "-" and b > a:
            a, b = b, a  # non-negative answers
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        yield {
            "prompt": f"What is {a} {op} {b}? Answer with the number only, as \\boxed{{N}}.",
            "label": str(answer),
        }


BUILTINS: dict[str, Callable[..., Iterator[dict[str, Any]]]] = {"arithmetic": arithmetic}


def builtin_rows(spec: str) -> Iterator[dict[str, Any]]:
    name, _, query = spec.partition("?")
    if name not in BUILTINS:
        raise DataError(f"builtin:{name}: unknown built-in data set (known: {', '.join(BUILTINS)})")
    kwargs: dict[str, int] = {}
    for part in filter(None, query.split("&")):
        key, _, value = part.partition("=")
        try:
            kwargs[key] = int(value)
        except ValueError:
            raise DataError(f"builtin:{spec}: option {key!r} needs an integer, got {value!r}") from None
    try:
        return BUILTINS[name](**kwargs)
    except TypeError as e:
        raise DataError(f"builtin:{spec}: {e}") from None
