"""`rlkit check-reward NAME_OR_PATH`: run a reward function on sample inputs and report every
contract violation plainly (exit 1 if there is one)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

# (prompt, response, label, finish_reason): ordinary and awkward cases a reward must survive.
SAMPLES: list[tuple[str, str, Any, str]] = [
    ("What is 8 + 5?", "8 + 5 = 13, so the answer is \\boxed{13}.", "13", "stop"),
    ("What is 8 + 5?", "The answer is \\boxed{12}.", "13", "stop"),
    ("What is 8 + 5?", "13", "13", "stop"),
    ("What is 8 + 5?", "", "13", "stop"),
    ("What is 8 + 5?", "Let me think step by step about this" * 40, "13", "length"),
    ("Combien font 2 + 2 ?", "Ça fait \\boxed{4} 🙂", "4", "stop"),
    ("What is 1/2 + 1/4?", "$\\frac{3}{4}$", "\\frac{3}{4}", "stop"),
    ("Name a color.", "\\boxed{blue", None, "stop"),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reward", help="built-in name, entry point name, or pkg.module:function")
    parser.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments")
    parser.add_argument(
        "--samples", help="jsonl of {prompt, response, label[, finish_reason]} to use instead"
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per call")
    parser.add_argument("--isolation", choices=("process", "thread"), default="process",
                        help="where a sync reward runs (as rollout.reward.isolation)")


def run(args: argparse.Namespace) -> int:
    from rlkit.rewards import RewardNotFound, call_reward, is_async, make_runner
    from rlkit.rewards.scoring import load_reward

    try:
        kwargs = json.loads(args.kwargs)
        if not isinstance(kwargs, dict):
            raise ValueError("not an object")
    except ValueError as e:
        print(f"--kwargs must be a JSON object ({e})")
        return 2
    try:
        fn = load_reward(args.reward)
    except RewardNotFound as e:
        print(f"FAIL  {e}")
        return 1
    cases = _load_samples(args.samples) if args.samples else SAMPLES
    try:
        call = call_reward(fn, make_runner(args.isolation))
    except ValueError as e:
        print(f"FAIL  {e}")
        return 1
    kind = "async" if is_async(fn) else f"sync (run in a worker {args.isolation})"
    print(f"reward {args.reward!r}: {getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}, {kind}")
    values: list[Any] = []
    problems = asyncio.run(_check_all(call, cases, kwargs, args.timeout, values))
    print(f"{len(cases) - problems} of {len(cases)} calls kept the contract "
          "(a finite float, no exception, within the timeout)")
    warning = constant_warning(values)
    if warning:
        print(warning)
    return 1 if problems else 0


def constant_warning(values: list[Any]) -> str | None:
    """A warning when every good call returned the same value (two or more): a reward that
    reads a misspelled attribute of `sample` (getattr with a default, or a try/except) scores
    every input alike and otherwise passes the check; None when the values vary."""
    if len(values) < 2 or any(float(v) != float(values[0]) for v in values[1:]):
        return None
    return (
        f"WARN  the reward returned {float(values[0])!r} on all {len(values)} inputs: a reward whose "
        "value never varies teaches the policy nothing. A reward reading a misspelled attribute "
        "of `sample` does this; `sample` has: " + ", ".join(sample_attributes()) + "."
    )


def sample_attributes() -> list[str]:
    """The public fields (and properties) of RewardInput, the object a reward receives."""
    import dataclasses

    from rlkit.rewards import RewardInput

    names = [f.name for f in dataclasses.fields(RewardInput)]
    names += [n for n, v in vars(RewardInput).items()
              if isinstance(v, property) and not n.startswith("_") and n not in names]
    return names


async def _check_all(call: Any, cases: list[tuple[str, str, Any, str]], kwargs: dict[str, Any],
                     timeout: float, values: list[Any] | None = None) -> int:
    """Call the reward on each case under the timeout (one event loop: a timed-out sync call's
    worker is killed, and nothing waits for it at exit); the number of violations. The values
    of the calls that kept the contract are appended to values when given."""
    from rlkit.rewards import RewardInput
    from rlkit.rollout.reward_scheduler import check_reward_value, describe_error

    problems = 0
    for i, (prompt, response, label, finish) in enumerate(cases):
        sample = RewardInput(prompt=prompt, response=response, label=label, finish_reason=finish,
                             index=i)
        t0 = time.perf_counter()
        try:
            value = await asyncio.wait_for(call(sample, kwargs), timeout)
            problem = check_reward_value(value)
        except asyncio.TimeoutError:
            value, problem = None, f"took longer than {timeout} s"
        except Exception as e:
            value, problem = None, f"raised {describe_error(e)}"
        ms = (time.perf_counter() - t0) * 1000
        shown = response if len(response) <= 40 else response[:37] + "..."
        status = "ok  " if problem is None else "FAIL"
        print(f"{status}  #{i} {shown!r} label={label!r}: "
              f"{value if problem is None else problem} ({ms:.1f} ms)")
        problems += problem is not None
        if problem is None and values is not None:
            values.append(value)
    runner = getattr(call, "runner", None)
    if runner is not None:
        runner.close()
    return problems


def _load_samples(path: str) -> list[tuple[str, str, Any, str]]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
                out.append((row.get("prompt", ""), row["response"], row.get("label"),
                            row.get("finish_reason", "stop")))
            except (ValueError, KeyError, AttributeError) as e:
                raise SystemExit(
                    f"{path}:{n}: expected a JSON object with prompt, response, label"
                    f"[, finish_reason] ({type(e).__name__}: {e})"
                ) from None
    return out
