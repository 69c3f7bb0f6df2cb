"""Built-in rewards: math answers (math-verify), exact match, and a format check."""

from __future__ import annotations

import logging
import re
from typing import Any

from rlkit.rewards.input import RewardInput

_BOXED = re.compile(r"\\boxed\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (nested braces allowed), or None."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def math_reward(sample: RewardInput, **_: Any) -> float:
    """1.0 if the response's answer equals the label mathematically (math-verify: LaTeX,
    \\boxed{}, plain numbers and expressions), else 0.0."""
    from math_verify import parse, verify

    # math-verify's own timeout uses signal.alarm, which only works in the main thread;
    # rewards run in worker threads and the reward scheduler enforces the timeout instead.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    label = str(sample.label)
    gold = parse(label if "$" in label or "\\" in label else f"${label}$", parsing_timeout=None)
    pred = parse(sample.response, parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


def exact_match(sample: RewardInput, *, boxed: bool = True, case_sensitive: bool = False, **_: Any) -> float:
    """1.0 if the answer (the last \\boxed{} content when boxed=True and present, else the whole
    response), stripped, equals the label."""
    answer = (last_boxed(sample.response) if boxed else None) or sample.response
    a, b = answer.strip(), str(sample.label).strip()
    if not case_sensitive:
        a, b = a.lower(), b.lower()
    return 1.0 if a == b else 0.0


def boxed_format(sample: RewardInput, *, pattern: str | None = None, **_: Any) -> float:
    """1.0 if the response has the expected form: a non-empty \\boxed{...} answer, or a match of
    the regex `pattern` when given; else 0.0."""
    if pattern is not None:
        return 1.0 if re.search(pattern, sample.response) else 0.0
    inner = last_boxed(sample.response)
    return 1.0 if inner is not None and inner.strip() else 0.0
