"""The driver's side of the run's actors: the two boxes a mode's loop calls.

    RemoteRolloutBox  the RolloutBox protocol over the RolloutActor: every call forwarded by
                      name (one generic call), each rollout step a stream on which the actor
                      pushes its progress
    RayTrainerBox     the TrainerBox over the TrainerGroup's ranks; a dead rank is ProcessDied
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Awaitable, Callable

from rlkit.buffers.sample import TRACED_LOGPROBS
from rlkit.common.errors import ProcessDied, actor_death
from rlkit.common.weight_update import PublisherFailed
from rlkit.config.schema import Recipe
from rlkit.driver.rollout_box import BOX_CALLS, Handed, RolloutResult


class RemoteRolloutBox:
    """The RolloutBox protocol over a RolloutActor. `on_progress(p)` gets the progress the
    actor pushes while a step runs; `on_engines_back()` (Run.restore_engines, set by the
    driver) runs when the push says restarted engines wait for the weights."""

    def __init__(self, actor: Any, on_progress: Callable[[dict], None] | None = None) -> None:
        self.actor = actor
        self.on_progress = on_progress
        self.on_engines_back: Callable[[], Awaitable[None]] | None = None

    def start_step(self, version: int, *, for_version: int, final: bool,
                   take: int = 0) -> asyncio.Future[RolloutResult]:
        return asyncio.ensure_future(self._step(version, for_version, final, take))

    async def _step(self, version: int, for_version: int, final: bool, take: int) -> RolloutResult:
        stream = self.actor.run_step_streamed.options(num_returns="streaming").remote(
            version, for_version, final, take)
        async for ref in stream:
            item = await ref
            if isinstance(item, RolloutResult):
                return item
            if self.on_progress is not None:
                self.on_progress(item)
            if item.get("awaiting_weights") and self.on_engines_back is not None:
                await self.on_engines_back()
        raise RuntimeError("the rollout actor's step stream ended without a result")

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        if name not in BOX_CALLS:
            raise AttributeError(name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await self.actor.call.remote(name, *args, **kwargs)

        return call

    def watch(self) -> asyncio.Future:
        """A future that fails as soon as the actor dies (its pending `until_stopped` call)."""
        return asyncio.wrap_future(self.actor.until_stopped.remote().future())

    # Checkpoints are written between steps, from the driver's synchronous end of a step.
    def save(self, path: str) -> None:
        import ray

        ray.get(self.actor.call.remote("save", path))

    def load(self, path: str) -> None:
        import ray

        ray.get(self.actor.call.remote("load", path))


class RayTrainerBox:
    """The driver's view of the TrainerGroup (a mode's TrainerBox): calls are submitted at once
    and awaited at `finish`; group references go to the trainer actors as they are.

    Every wait returns at the first failure of any rank rather than in rank order: a rank that
    died leaves the others blocked in a collective. A dead rank ends the run as ProcessDied, and
    the other ranks are killed with it (they cannot finish a collective step without it)."""

    def __init__(self, group: Any, recipe: Recipe) -> None:
        self.group = group
        self.samples = recipe.rollout.samples_per_step
        self.colocated = recipe.cluster.placement == "colocated"
        self._calls: list[Any] = []  # the batch's calls: every rank's begin_batch first

    def begin(self, version: int) -> None:
        self._calls = self.group.begin_batch(version, self.samples, self.colocated)

    def add(self, handed: Handed) -> None:
        self._calls = [*self._calls, *self.group.add_groups(handed.refs)]

    async def finish(self) -> dict[str, float]:
        calls, self._calls = self._calls, []
        # an error in any earlier call surfaces here; rank 0's begin_batch answer comes first:
        # colocated, the state it took back onto the GPU
        moved = (await self._wait(calls, "training"))[0] if calls else {}
        answers = await self._wait(self.group.finish_batch(self.colocated), "the optimizer step")
        # each replica counted its own samples (it received only its share): the batch's sum
        off = [a.get("train/off_policy_samples", 0.0) for a in answers[:: self.group.tp]]
        metrics = {**(moved or {}), **answers[0], "train/off_policy_samples": float(sum(off))}
        # the samples picked for the viewer: each replica scored its own (rlkit/view)
        traced = {k: v for a in answers[:: self.group.tp] for k, v in a.get(TRACED_LOGPROBS, {}).items()}
        if traced:
            metrics[TRACED_LOGPROBS] = traced
        return metrics

    def publisher(self) -> Any:
        """The ranks' publisher (train.ray_group.RayPublisher), handed to the rollout actor."""
        return self.group.publisher()

    def died(self, error: BaseException) -> ProcessDied | None:
        """A failed weight update whose cause is a trainer rank that died (PublisherFailed, as
        the rollout actor passes it on): ProcessDied naming it, the other ranks killed."""
        cause = getattr(error, "cause", None) or error
        if not isinstance(cause, PublisherFailed):
            return None
        return self._died(cause, "the weight sync", rank=cause.rank)

    def save(self, path: str | Path) -> None:
        import ray

        try:
            self.group.save(path)
        except ray.exceptions.RayActorError as e:
            raise self._died(e, "the checkpoint save") from None

    async def _wait(self, refs: list[Any], what: str) -> list[Any]:
        futures = [asyncio.wrap_future(r.future()) for r in refs]
        if not futures:
            return []
        done, _ = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
        failed = [f.exception() for f in futures if f in done and f.exception() is not None]
        if failed:
            import ray

            if isinstance(failed[0], ray.exceptions.RayActorError):
                raise self._died(failed[0], what) from None
            raise failed[0]
        return [f.result() for f in futures]

    def _died(self, e: Exception, what: str, rank: int | None = None) -> ProcessDied:
        import ray

        death = actor_death(e)
        who = "a trainer rank"
        for r, w in enumerate(self.group.workers):
            if r == rank or (death is not None and w._actor_id.hex() == death.actor_id):
                pid = (self.group.ranks[r] or {}).get("pid") if r < len(self.group.ranks) else None
                who = f"trainer rank {r}" + (f" (pid {pid})" if pid else "")
        for w in self.group.workers:  # the others cannot finish a collective without it
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - already gone
                pass
        reason = (death.reason() if death is not None else getattr(e, "reason", None)
                  or str(e).strip().split("\n")[0][:200])
        return ProcessDied(f"{who} died during {what} ({reason})")
