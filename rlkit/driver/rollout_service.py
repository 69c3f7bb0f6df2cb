"""The rollout box: the RolloutBuffer, the RolloutManager and reward scoring, in one process.

In a run it lives in one Ray actor (the buffer's home, DESIGN.md); in tests it is a plain
object. The engines are injected: the HTTP client in front of the router in a run, fakes or
simulated engines elsewhere.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from buffers import Group, PromptSource, RolloutBuffer, load_buffer, save_buffer
from rollout.config import RolloutConfig
from rollout.engine_api import Engines
from rollout.filters import GroupFilter
from rollout.manager import RolloutManager, StepReport, batch_target
from rollout.policies import make_policy
from rollout.rankers import LengthRanker
from rollout.rewards import RewardScheduler, ScoreFn


@dataclass
class StepResult:
    """What the driver needs back from a rollout step (plain data: it crosses Ray)."""

    metrics: dict[str, Any]
    timeline: list[dict[str, Any]]
    completed: list[int]
    buffer: dict[str, Any] = field(default_factory=dict)
    header: dict[str, Any] = field(default_factory=dict)  # the timeline's step line


class RolloutService:
    def __init__(
        self,
        cfg: RolloutConfig,
        source: PromptSource,
        engines: Engines,
        score: ScoreFn,
        group_filter: GroupFilter | None = None,
        ranker: LengthRanker | None = None,
    ) -> None:
        self.cfg = cfg
        self.engines = engines
        self.buffer = RolloutBuffer(
            source,
            n_samples_per_prompt=cfg.n_samples_per_prompt,
            max_staleness=cfg.max_staleness,
            staleness_policy=cfg.staleness_policy,
        )
        rewards = RewardScheduler(score, timeout_s=cfg.reward.timeout_s, on_error=cfg.reward.on_error)
        self.manager = RolloutManager(self.buffer, engines, make_policy(cfg), cfg.sampling, rewards,
                                      group_filter=group_filter, ranker=ranker)
        self._current: asyncio.Task | None = None

    async def run_step(self, version: int, *, final: bool = False) -> StepResult:
        """One rollout step at policy `version`; afterwards `batch_size` groups are ready.
        `final`: the run's last step (tail batching drains its long queue)."""
        self.buffer.set_version(version)
        self._current = asyncio.ensure_future(
            self.manager.run_step(batch_target(self.buffer, self.cfg.batch_size), version,
                                  final=final))
        try:
            report: StepReport = await self._current
        finally:
            self._current = None
        return StepResult(
            metrics=report.metrics(),
            timeline=[s.to_json() for s in report.timeline],
            completed=report.completed,
            buffer=self.stats(),
            header={"policy": report.policy, "round": report.round, "start": report.started,
                    "end": report.started + report.seconds, "workers": self.engines.workers(),
                    "source": "real"},
        )

    def progress(self) -> dict[str, Any] | None:
        step = self.manager.current
        return step.progress() if step is not None else None

    def take(self, n: int) -> list[Group]:
        """The ready groups for one training step (the oldest first)."""
        try:
            return self.buffer.take(n, timeout=0)  # all n or none: a shortfall loses nothing
        except TimeoutError as e:
            raise RuntimeError(f"{e} (after the rollout step); nothing was taken") from None

    def set_version(self, version: int) -> None:
        self.buffer.set_version(version)

    def stats(self) -> dict[str, Any]:
        out = self.buffer.stats()
        stats = getattr(self.buffer.source, "stats", None)
        if callable(stats):
            out["source"] = stats()
        return out

    def save(self, path: str) -> None:
        save_buffer(self.buffer, Path(path))

    def load(self, path: str) -> None:
        load_buffer(self.buffer, Path(path))

    async def cancel(self) -> None:
        """Stop a running step (Ctrl-C): it aborts and parks everything before returning."""
        if self._current is not None and not self._current.done():
            self._current.cancel()
            await asyncio.gather(self._current, return_exceptions=True)


def batch_metrics(groups: Sequence[Group]) -> dict[str, float]:
    """Reward statistics of the groups a training step uses."""
    rewards = [s.reward for g in groups for s in g.samples if s.reward is not None]
    lengths = [len(s.response_ids) for g in groups for s in g.samples]
    if not rewards:
        return {}
    mean = sum(rewards) / len(rewards)
    return {
        "batch/reward_mean": mean,
        "batch/reward_max": max(rewards),
        "batch/response_length_mean": sum(lengths) / len(lengths),
        "batch/response_length_max": max(lengths),
        "batch/groups": len(groups),
    }


