"""The built-in judge reward: a frozen engine group (rollout.frozen_engines, role 'judge')
reads the prompt and the response through a template and answers a verdict, which a parser
turns into the reward.

    rollout:
      frozen_engines: {judge: {role: judge, model: smollm2}}
      reward: {name: judge, kwargs: {group: judge, verdicts: {"yes": 1.0, "no": 0.0}}}

Every request goes through the group's limits (concurrency, rate, timeout, retries) and is
counted there (frozen/<group>/...); an answer with no verdict is a bad output, retried like a
failed request. A call that fails every try fails the sample as any failing reward does
(rollout.reward.on_error), counted in rollout/reward_failures/error. It is async, so it runs on
the rollout actor's event loop, where the group lives.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from rlkit.rewards.input import RewardInput

DEFAULT_TEMPLATE = (
    "Question: {prompt}\nReference answer: {label}\nStudent answer: {response}\n"
    "Is the student answer correct? Answer yes or no.\nAnswer:"
)
DEFAULT_VERDICTS = {"yes": 1.0, "no": 0.0}


def parse_verdict(text: str, verdicts: Mapping[str, float]) -> float:
    """The score of the first verdict word in `text` (whole words, any case); ValueError when
    there is none."""
    words = sorted(verdicts, key=len, reverse=True)  # 'not correct' before 'correct'
    pattern = re.compile(r"\b(" + "|".join(re.escape(w) for w in words) + r")\b", re.IGNORECASE)
    match = pattern.search(text)
    if match is None:
        raise ValueError(f"no verdict ({', '.join(verdicts)}) in the judge's answer {text[:120]!r}")
    lowered = {k.lower(): v for k, v in verdicts.items()}
    return float(lowered[match.group(1).lower()])


async def judge(sample: RewardInput, *, group: str = "judge", template: str = DEFAULT_TEMPLATE,
                verdicts: Mapping[str, float] | None = None, max_new_tokens: int = 8,
                temperature: float = 0.0, **_: Any) -> float:
    """The verdict of frozen group `group` on the sample, as `verdicts` scores it."""
    from rlkit.rollout.http.frozen_groups import engine_group

    table = dict(verdicts or DEFAULT_VERDICTS)
    prompt = template.format(prompt=sample.prompt, response=sample.response,
                             label="" if sample.label is None else sample.label)
    return await engine_group(group).generate_text(
        prompt, max_new_tokens=max_new_tokens, temperature=temperature,
        parse=lambda text: parse_verdict(text, table), sample=(sample.group_id, sample.index))
