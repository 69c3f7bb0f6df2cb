"""Data sets the project generates itself (no hub): `data.path: builtin:<name>`.

`builtin:arithmetic` is small integer arithmetic with exact answers, sized so that a 135M
instruct model solves some but not all of it at first: a reward signal that GRPO can raise on
two CPU cores. Options go after a '?': `builtin:arithmetic?rows=500&max_operand=30&seed=3`; `split=train` and
`split=test` cut the problems into a training part and a held-out part (see `arithmetic`).
"""

from __future__ import annotations

import random
import zlib
from typing import Any, Callable, Iterator

from rlkit.data.errors import DataError


def arithmetic(rows: int = 2000, max_operand: int = 20, seed: int = 0, split: str = "all",
               holdout: int = 10) -> Iterator[dict[str, Any]]:
    """`split`: 'all' (every problem), 'train' (all but a fixed `holdout` percent of the
    problems, chosen by a hash of the problem, so it does not depend on `seed` or `rows`) or
    'test' (only those held-out problems, each once: up to `rows` of them). A recipe trains on
    'train' and evaluates on 'test' with the same max_operand: no test problem is trained on."""
    for key, value in (("rows", rows), ("max_operand", max_operand), ("seed", seed),
                       ("holdout", holdout)):
        if not isinstance(value, int):
            raise DataError(f"builtin:arithmetic: option {key!r} needs an integer, got {value!r}")
    if split not in ("all", "train", "test"):
        raise DataError(f"builtin:arithmetic: split must be all, train or test, got {split!r}")
    if not 0 < holdout < 100:
        raise DataError(f"builtin:arithmetic: holdout is a percent in 1..99, got {holdout}")
    return _arithmetic(rows, max_operand, seed, split, holdout)


def _arithmetic(rows: int, max_operand: int, seed: int, split: str,
                holdout: int) -> Iterator[dict[str, Any]]:
    ops = "+-*" if max_operand <= 12 else "+-"
    rng = random.Random(seed)
    if split == "test":
        problems = sorted({_normal(a, op, b) for a in range(max_operand + 1)
                           for b in range(max_operand + 1) for op in ops})
        held = [p for p in problems if _held_out(p, holdout)]
        rng.shuffle(held)
        for a, op, b in held[:rows]:
            yield _row(a, op, b)
        return
    made = 0
    while made < rows:
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        a, op, b = _normal(a, rng.choice(ops), b)
        if split == "train" and _held_out((a, op, b), holdout):
            continue
        made += 1
        yield _row(a, op, b)


def _normal(a: int, op: str, b: int) -> tuple[int, str, int]:
    return (b, op, a) if op == "-" and b > a else (a, op, b)  # non-negative answers


def _held_out(problem: tuple[int, str, int], holdout: int) -> bool:
    return zlib.crc32("{}{}{}".format(*problem).encode()) % 100 < holdout


def _row(a: int, op: str, b: int) -> dict[str, Any]:
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {
        "prompt": f"What is {a} {op} {b}? Answer with the number only, as \\boxed{{N}}.",
        "label": str(answer),
        # what SFT learns (data.response_key): the sum worked once, then the boxed answer
        "response": f"{a} {op} {b} = {answer}. \\boxed{{{answer}}}",
    }


BUILTINS: dict[str, Callable[..., Iterator[dict[str, Any]]]] = {"arithmetic": arithmetic}


def builtin_rows(spec: str) -> Iterator[dict[str, Any]]:
    name, _, query = spec.partition("?")
    if name not in BUILTINS:
        raise DataError(f"builtin:{name}: unknown built-in data set (known: {', '.join(BUILTINS)})")
    kwargs: dict[str, int | str] = {}
    for part in filter(None, query.split("&")):
        key, _, value = part.partition("=")
        kwargs[key] = int(value) if value.lstrip("-").isdigit() else value
    try:
        return BUILTINS[name](**kwargs)
    except TypeError as e:
        raise DataError(f"builtin:{spec}: {e}") from None
