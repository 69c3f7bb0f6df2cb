"""Ray placement of a run's pieces, and their orderly shutdown.

    EngineActor x N     one engine server process each (hf or SGLang), on its GPU(s) if any
    RolloutActor        the router process, the RolloutBuffer, the RolloutManager, the HTTP
                        client and reward scoring (DESIGN.md: the buffer lives in one actor)
    TrainWorker x TP*DP the Megatron ranks (train.ray_group.TrainerGroup)

Every piece that owns a process stops it in `stop()`; `Cluster.shutdown()` stops them in order
(router, engines, trainer) before Ray goes down, so no process or port is left behind.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from rlkit.config.schema import Recipe
from rlkit.driver.loop import Handed
from rlkit.driver.rollout_service import RolloutService, StepResult, group_record


class EngineActor:
    """Owns one engine server process."""

    def __init__(self, model_path: str, engine: dict[str, Any], index: int, log_dir: str) -> None:
        from rollout.engines.config import EngineConfig
        from rollout.engines.fleet import start_engine

        self.proc = start_engine(model_path, EngineConfig.model_validate(engine), index, Path(log_dir))

    def url(self) -> str:
        return self.proc.url  # type: ignore[return-value]

    def stop(self) -> None:
        self.proc.stop()


class RolloutActor:
    """The rollout box as a Ray actor (async: steps run on the actor's event loop)."""

    def __init__(self, recipe: dict[str, Any], model_path: str, log_dir: str) -> None:
        self.recipe = Recipe.model_validate(recipe)
        self.model_path = model_path
        self.log_dir = Path(log_dir)
        self.tokenizer: Any = None
        self.source: Any = None
        self.score: Any = None
        self.group_filter: Any = None
        self.ranker: Any = None
        self.router = None
        self.client = None
        self.service: RolloutService | None = None

    async def prepare(self) -> None:
        """Load the prompts and resolve the reward: no engine needed, so it runs while the
        engines start and a bad data file or reward name fails the run at once."""
        from transformers import AutoTokenizer

        from rlkit.data.prompts import load_prompt_source
        from rlkit.plugins import load_group_filter, load_ranker
        from rlkit.rewards.scoring import make_score_fn

        r = self.recipe
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.source = load_prompt_source(r.data, tokenizer, seed=r.run.seed)

        def decode(ids: Any) -> str:
            return tokenizer.decode(list(ids), skip_special_tokens=True)

        self.score = make_score_fn(r.rollout.reward, decode)
        self.group_filter = load_group_filter(r.rollout.filter)
        self.ranker = load_ranker(r.rollout.ranker)

    async def start(self, engine_urls: list[str]) -> None:
        """Start the router in front of the engines and the rollout service over them."""
        from rollout.client import EngineClient
        from rollout.router import Router

        assert self.source is not None, "prepare() first"
        r = self.recipe
        self.router = Router(r.rollout.router, log_path=self.log_dir / "router.log")
        router_url = await asyncio.to_thread(self.router.start, engine_urls)
        self.client = await EngineClient(router_url, worker_urls=engine_urls).connect()
        self.service = RolloutService.from_config(r.rollout, self.source, self.client, self.score,
                                                  self.group_filter, self.ranker)

    async def run_step(self, version: int, for_version: int, final: bool) -> StepResult:
        assert self.service is not None
        result = await self.service.run_step(version, for_version=for_version, final=final)
        result.report = None  # the driver needs the plain data only
        return result

    def progress(self) -> dict[str, Any] | None:
        return self.service.progress() if self.service is not None else None

    async def next_ready(self) -> tuple[list[Any], list[dict[str, Any]]]:
        """The next ready group as an object reference (the trainer actors fetch it from here,
        not through the driver) and its record. Waits without blocking generation."""
        assert self.service is not None
        return _refs([await self.service.next_ready()])

    def take(self, n: int) -> tuple[list[Any], list[dict[str, Any]]]:
        assert self.service is not None
        return _refs(self.service.take(n))

    def admits(self, for_version: int) -> bool:
        assert self.service is not None
        return self.service.admits(for_version)

    def set_version(self, version: int) -> None:
        assert self.service is not None
        self.service.set_version(version)

    def save(self, path: str) -> None:
        assert self.service is not None
        self.service.save(path)

    def load(self, path: str) -> None:
        assert self.service is not None
        self.service.load(path)

    async def stop(self) -> None:
        if self.service is not None:
            await self.service.cancel()
        if self.client is not None:
            await self.client.close()
            self.client = None
        if self.router is not None:
            await asyncio.to_thread(self.router.stop)
            self.router = None


def _refs(groups: list[Any]) -> tuple[list[Any], list[dict[str, Any]]]:
    import ray

    return [ray.put(g) for g in groups], [group_record(g) for g in groups]


class RayRolloutBox:
    """The driver's view of the RolloutActor (a mode's RolloutBox)."""

    def __init__(self, actor: Any, on_progress: Any = None, poll_s: float = 0.5) -> None:
        self.actor = actor
        self.on_progress = on_progress
        self.poll_s = poll_s

    def start_step(self, version: int, *, for_version: int, final: bool) -> asyncio.Future[StepResult]:
        return asyncio.ensure_future(self._step(version, for_version, final))

    async def _step(self, version: int, for_version: int, final: bool) -> StepResult:
        done = asyncio.wrap_future(self.actor.run_step.remote(version, for_version, final).future())
        while True:
            finished, _ = await asyncio.wait({done}, timeout=self.poll_s)
            if finished:
                return done.result()
            if self.on_progress is not None:
                p = await self.actor.progress.remote()
                if p:
                    self.on_progress(p)

    async def next_ready(self) -> Handed:
        return Handed(*await self.actor.next_ready.remote())

    async def take(self, n: int) -> Handed:
        return Handed(*await self.actor.take.remote(n))

    async def admits(self, for_version: int) -> bool:
        return await self.actor.admits.remote(for_version)

    async def set_version(self, version: int) -> None:
        await self.actor.set_version.remote(version)

    def save(self, path: str) -> None:
        import ray

        ray.get(self.actor.save.remote(path))

    def load(self, path: str) -> None:
        import ray

        ray.get(self.actor.load.remote(path))


class Cluster:
    """Starts and stops every process of a run through Ray."""

    def __init__(self, recipe: Recipe, model_path: str, run_dir: Path) -> None:
        self.recipe = recipe
        self.model_path = model_path
        self.log_dir = run_dir / "logs"
        self.engines: list[Any] = []
        self.engine_urls: list[str] = []
        self.rollout_actor: Any = None
        self.trainer: Any = None
        self._ray_started = False

    def start(self) -> "Cluster":
        import ray

        from train.ray_group import TrainerGroup

        self.log_dir.mkdir(parents=True, exist_ok=True)
        r = self.recipe
        world = r.train.parallelism.tensor * r.train.parallelism.data
        if not ray.is_initialized():
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local job needs no token
            ray.init(
                num_cpus=max(os.cpu_count() or 1, world + 1),
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
            self._ray_started = True
        try:
            eng = r.rollout.engine
            gpus = eng.gpus_per_engine if eng.kind == "sglang" else (1 if eng.device == "cuda" else 0)
            engine_cls = ray.remote(num_cpus=0, num_gpus=gpus)(EngineActor)
            self.engines = [
                engine_cls.remote(self.model_path, eng.model_dump(), i, str(self.log_dir))
                for i in range(eng.num_engines)
            ]
            rollout_cls = ray.remote(num_cpus=0)(RolloutActor)
            self.rollout_actor = rollout_cls.remote(
                r.model_dump(mode="json"), self.model_path, str(self.log_dir)
            )
            ray.get(self.rollout_actor.prepare.remote())  # while the engines start
            self.engine_urls = ray.get([e.url.remote() for e in self.engines])
            ray.get(self.rollout_actor.start.remote(self.engine_urls))
            # The trainer gets the cores the engines do not use for compute on CPU.
            self.trainer = TrainerGroup(
                self.model_path, r.train, temperature=r.rollout.sampling.temperature,
                num_cpus_per_worker=1.0,
            )
        except BaseException:
            self.shutdown()
            raise
        return self

    def shutdown(self) -> None:
        """Stop everything, tolerating pieces that never started or already died."""
        import ray

        if not ray.is_initialized():
            return
        if self.rollout_actor is not None:
            _quietly(lambda: ray.get(self.rollout_actor.stop.remote(), timeout=60))
        for e in self.engines:
            _quietly(lambda e=e: ray.get(e.stop.remote(), timeout=60))
        if self.trainer is not None:
            _quietly(self.trainer.shutdown)
        for a in [self.rollout_actor, *self.engines]:
            if a is not None:
                _quietly(lambda a=a: ray.kill(a))
        self.rollout_actor, self.engines, self.trainer = None, [], None
        if self._ray_started:
            ray.shutdown()
            self._ray_started = False


def _quietly(fn: Any) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - shutdown must go on past a dead piece
        pass


class RayTrainerBox:
    """The driver's view of the TrainerGroup (a mode's TrainerBox): calls are submitted at once
    and awaited at `finish`; group references go to the trainer actors as they are."""

    def __init__(self, group: Any, recipe: Recipe, engine_urls: list[str], run_dir: Path) -> None:
        self.group = group
        self.recipe = recipe
        self.engine_urls = engine_urls
        self.folder = run_dir / "weights"
        self.samples = recipe.rollout.samples_per_step
        self._calls: list[Any] = []

    def begin(self, version: int) -> None:
        self._calls = self.group.begin_batch(version, self.samples)

    def add(self, handed: Handed) -> None:
        self._calls += self.group.add_groups(handed.refs)

    async def finish(self) -> dict[str, float]:
        import ray

        calls, self._calls = self._calls, []
        await asyncio.to_thread(ray.get, calls)  # an error in any earlier call surfaces here
        return (await asyncio.to_thread(ray.get, self.group.finish_batch()))[0]

    async def push_weights(self, version: int) -> None:
        await asyncio.to_thread(self.group.sync_weights, self.engine_urls, version=version,
                                method=self.recipe.train.weight_sync.method, folder=self.folder)

    def save(self, path: str | Path) -> None:
        self.group.save(path)
