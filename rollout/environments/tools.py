"""Running environment steps (tool calls) so that none can stall a rollout step: at most
`max_concurrency` at once, each within `timeout_s`; one that raises, hangs or answers with
something that is not an Observation is recorded and counted by kind, never dropped silently,
and the episode goes on with an error observation the model reads (`<tool_error>...`).

    runner = ToolRunner(max_concurrency=32, timeout_s=30)
    obs = await runner.step(env, action)        # always an Observation
    runner.failures                             # Counter: raised / timeout / bad_output

Pure asyncio: no HTTP, Ray or torch."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from rlkit.rollout.environments.protocol import Environment, Observation

TOOL_FAILURE_KINDS = ("raised", "timeout", "bad_output")


class ToolRunner:
    def __init__(self, max_concurrency: int = 32, timeout_s: float = 30.0) -> None:
        if max_concurrency < 1 or timeout_s <= 0:
            raise ValueError(f"max_concurrency must be >= 1 and timeout_s > 0, got "
                             f"{max_concurrency} and {timeout_s}")
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(max_concurrency)
        self.failures: Counter[str] = Counter({k: 0 for k in TOOL_FAILURE_KINDS})
        self.calls = 0

    async def step(self, env: Environment, action: str) -> Observation:
        """`env.step(action)`, bounded; a failure becomes an observation naming it."""
        async with self._slots:
            self.calls += 1
            try:
                obs: Any = await asyncio.wait_for(env.step(action), self.timeout_s)
            except asyncio.TimeoutError:
                return self._failed("timeout", f"the tool did not answer within {self.timeout_s:g} s")
            except asyncio.CancelledError:
                raise  # the step is ending: the caller parks the episode
            except Exception as e:  # noqa: BLE001 - a user's tool: recorded, the episode goes on
                return self._failed("raised", f"{type(e).__name__}: {e}"[:300])
        if not isinstance(obs, Observation) or not isinstance(obs.text, str):
            return self._failed("bad_output", f"the tool answered {type(obs).__name__}, not an Observation")
        return obs

    def _failed(self, kind: str, message: str) -> Observation:
        self.failures[kind] += 1
        return Observation(f"<tool_error>{message}</tool_error>", info={"tool_failure": kind, "error": message})
