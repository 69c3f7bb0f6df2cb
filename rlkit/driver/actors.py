"""The Ray actors of a run, each owning its processes (Cluster places them; rlkit/driver/
proxies.py is the driver's side of them).

    EngineActor x N     one engine server process each (hf or SGLang), on its GPU(s) if any
    RolloutActor        the router process and the rollout box (RolloutService: the
                        RolloutBuffer, the RolloutManager, the HTTP client, reward scoring)

The trainer ranks are rlkit.train.ray_group's TrainWorkers.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from pathlib import Path
from typing import Any, AsyncIterator

from rlkit.buffers import Group
from rlkit.common.control_token import CONTROL_TOKEN_ENV
from rlkit.config.schema import Recipe
from rlkit.driver.placement import advertised
from rlkit.driver.rollout_box import BOX_CALLS, Handed, RolloutResult, group_record
from rlkit.driver.rollout_fault import RolloutFaults, checkpoint_step
from rlkit.driver.rollout_service import RolloutService


def use_control_token(token: str | None) -> None:
    """Put the run's control token in this actor's environment (engine servers started from it
    inherit it; clients read it there). It travels as an actor argument, not in a Ray
    runtime_env, because Ray's runtime-env agent logs env_vars in clear."""
    if token:
        os.environ[CONTROL_TOKEN_ENV] = token


class EngineActor:
    """Owns one engine server process."""

    def __init__(self, model_path: str, engine: dict[str, Any], index: int, log_dir: str,
                 bind_node_address: bool = False, control_token: str | None = None) -> None:
        from rlkit.rollout.engines.config import EngineConfig
        from rlkit.rollout.engines.fleet import start_engine

        use_control_token(control_token)
        if bind_node_address:  # a cluster of several nodes: reachable from the other nodes
            import ray

            engine = {**engine, "host": ray.util.get_node_ip_address()}
        self.args = (model_path, EngineConfig.model_validate(engine), index, Path(log_dir))
        # Ray shows this actor its bundle's GPUs only (CUDA_VISIBLE_DEVICES)
        self.proc = start_engine(*self.args, own_gpus=True)

    def url(self) -> str:
        return self.proc.url  # type: ignore[return-value]

    def restart(self) -> str:
        """Kill what is left of the engine (a hung, stopped process too: SIGKILL to its process
        group) and start it again, in this actor's bundle; its new URL once healthy."""
        from rlkit.rollout.engines.fleet import start_engine

        self.proc.kill()
        self.proc = start_engine(*self.args, own_gpus=True)
        import ray

        return advertised(self.url(), ray.util.get_node_ip_address())  # as Cluster.start does

    def stop(self) -> None:
        self.proc.stop()


class RolloutActor:
    """The rollout box as a Ray actor (async: steps run on the actor's event loop). It builds
    the RolloutService (`prepare`, then `start` once the engines serve) and serves the box's
    calls generically (`call`) and each rollout step as a stream (`run_step_streamed`)."""

    def __init__(self, recipe: dict[str, Any], model_path: str, log_dir: str,
                 control_token: str | None = None) -> None:
        use_control_token(control_token)  # the EngineClient reads it from the environment
        self.recipe = Recipe.model_validate(recipe)
        self.model_path = model_path
        self.log_dir = Path(log_dir)
        self.tokenizer: Any = None
        self.decode: Any = None  # token ids -> text, for the sample rows (tracking)
        self.source: Any = None
        self.score: Any = None
        self.group_filter: Any = None
        self.ranker: Any = None
        self.evaluator: Any = None
        self.episodes: Any = None  # rlkit.rollout.episodes.EpisodeRunner (rollout.episode)
        self.router = None
        self.client = None
        self.service: RolloutService | None = None
        # rollout.frozen_engines: name -> (its FrozenGroup, its Router)
        self.frozen: dict[str, tuple[Any, Any]] = {}
        self.faults = RolloutFaults.from_env(self)  # test-only: None unless a test armed one

    async def prepare(self) -> None:
        """Load the prompts and resolve the reward: no engine needed, so it runs while the
        engines start and a bad data file or reward name fails the run at once."""
        from transformers import AutoTokenizer

        from rlkit.data.prompts import load_prompt_source
        from rlkit.evaluator_factory import make_evaluator
        from rlkit.plugins import load_episode_runner, load_group_filter, load_ranker
        from rlkit.rewards.scoring import make_score_fn, tokenizer_decode

        if self.faults is not None:
            self.faults.at("startup")
        r = self.recipe
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.source = load_prompt_source(r.data, tokenizer, seed=r.run.seed)
        self.score = make_score_fn(r.rollout.reward, tokenizer_decode(tokenizer))
        self.decode = lambda ids: tokenizer.decode(list(ids))  # special tokens shown
        self.group_filter = load_group_filter(r.rollout.filter)
        self.ranker = load_ranker(r.rollout.ranker)
        self.episodes = load_episode_runner(r.rollout.episode, r.rollout.sampling, tokenizer)
        if r.eval.enabled:  # held-out sets: a bad row fails the run here, before any step
            self.evaluator = make_evaluator(r.eval, r.rollout, tokenizer, self.score)

    async def start(self, engine_urls: list[str], engine_actors: list[Any] = (),
                    frozen: dict[str, tuple[list[str], list[Any]]] | None = None) -> None:
        """Start the router in front of the engines and the rollout service over them; a lost
        engine is restarted by its EngineActor (`engine_actors`, in the order of the URLs), a
        lost router by rollout.health, here (RouterProcessHandle). `frozen`: each frozen
        group's engine URLs and actors (rollout.frozen_engines), given routers of their own."""
        from rlkit.rollout.http.client import EngineClient
        from rlkit.rollout.engine_updates import EngineUpdates
        from rlkit.rollout.http.router import Router, RouterProcessHandle

        assert self.source is not None, "prepare() first"
        r = self.recipe
        for name, (urls, actors) in (frozen or {}).items():
            self.frozen[name] = await start_frozen_group(name, r.rollout, urls, actors, self.log_dir)
        self.router = Router(r.rollout.router, log_path=self.log_dir / "router.log")
        router_url = await asyncio.to_thread(self.router.start, engine_urls)
        self.client = await EngineClient(
            router_url, worker_urls=engine_urls, router_admin=self.router,
            max_resume_log_ratio=r.rollout.max_resume_log_ratio).connect()
        restarter = ActorRestarter(dict(zip(engine_urls, engine_actors))) if engine_actors else None
        # The engines' state around weight updates is this actor's (docs/design.md: one owner);
        # a disk update's folders go beside the logs, in the run's folder.
        ws = r.train.weight_sync
        updates = EngineUpdates(method=ws.method, pause_mode=ws.pause_mode, timeout_s=ws.timeout_s,
                                folder=str(self.log_dir.parent / "weights"))
        self.service = RolloutService.from_config(r.rollout, self.source, self.client, self.score,
                                                  self.group_filter, self.ranker, restarter,
                                                  self.evaluator, hand=ray_handed,
                                                  episodes=self.episodes, updates=updates,
                                                  router=RouterProcessHandle(self.router, self.client),
                                                  frozen={n: g for n, (g, _) in self.frozen.items()})
        if r.tracking.samples_per_step:  # a few samples whole per step (run viewer, wandb)
            from rlkit.rollout.sample_rows import SamplePicker

            self.service.sample_picker = SamplePicker(r.tracking.samples_per_step,
                                                      r.rollout.batch_size, self.decode)
        lora = r.train.lora
        self.service.adapter_sync = lora.rank > 0 and lora.sync == "adapter"
        if self.service.adapter_sync and lora.resume == "own":
            self.service.resume_own_adapter = self.client.resume_own_adapter = True
            self.service.keep_versions = lora.keep_versions
        if ws.verify:  # every sync checked on a probe (rollout_service.RolloutService._verify)
            self.service.verify_tolerance = ws.verify_tolerance
            self.service.verify_temperature = r.rollout.sampling.temperature

    async def hand_off_to(self, attention_weight: float) -> None:
        """The trainer is up: ready groups leave split by its data-parallel replicas, placed
        by its rule (`attention_weight`: the sample cost's term, read where the model is)."""
        from rlkit.driver.handoff import ReplicaHandOff

        assert self.service is not None, "start() first"
        self.service.hand = ReplicaHandOff.for_recipe(self.recipe, attention_weight)

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Any RolloutBox call on the service, by name (RemoteRolloutBox sends them all here)."""
        if name not in BOX_CALLS:
            raise AttributeError(f"the rollout box has no call {name!r}")
        assert self.service is not None, "start() first"
        if self.faults is not None:  # test-only points: the weight update opens, a checkpoint
            if name == "update_weights":
                self.faults.at("sync", kwargs.get("version", args[0] if args else 0))
            elif name == "save":
                self.faults.at("checkpoint", checkpoint_step(str(args[0] if args else kwargs["path"])))
        out = getattr(self.service, name)(*args, **kwargs)
        return await out if inspect.isawaitable(out) else out

    async def run_step_streamed(self, version: int, for_version: int, final: bool,
                                take: int = 0) -> AsyncIterator[Any]:
        """One rollout step as a Ray streaming generator: the service's progress while it runs,
        pushed to the driver, then the RolloutResult (plain data only)."""
        assert self.service is not None, "start() first"
        if self.faults is not None:  # test-only: step K's rollout is trained at version K - 1
            self.faults.rollout_begins(for_version + 1)
            self.client.on_routed_tokens = self.faults.routed_tokens
        async for item in self.service.run_step_streamed(version, for_version=for_version,
                                                         final=final, take=take):
            if isinstance(item, RolloutResult):
                item.report = None  # the driver needs the plain data only
                if self.faults is not None:
                    self.faults.at("idle", for_version + 1)
            yield item

    async def until_stopped(self) -> None:
        """Returns when `stop` ran; the driver keeps this call pending for the whole run, so
        the actor's death reaches it at once (its reference fails with Ray's ActorDiedError),
        whatever the driver is waiting for then (training, in sync mode, calls nothing here)."""
        await self._stopped().wait()

    def _stopped(self) -> asyncio.Event:
        if getattr(self, "_stop_event", None) is None:
            self._stop_event = asyncio.Event()  # made on the actor's event loop
        return self._stop_event

    async def stop(self) -> None:
        self._stopped().set()
        if self.service is not None:
            await self.service.cancel()
        if self.client is not None:
            await self.client.close()
            self.client = None
        if self.router is not None:
            await asyncio.to_thread(self.router.stop)
            self.router = None
        for name, (group, router) in list(self.frozen.items()):
            await stop_frozen_group(group, router)
            del self.frozen[name]


class ActorRestarter:
    """Restarts a lost engine through the EngineActor that owns it (rollout.health.Restarter)."""

    def __init__(self, actors: dict[str, Any]) -> None:
        self.actors = actors  # engine URL -> its EngineActor

    async def restart(self, worker: str) -> str:
        actor = self.actors.pop(worker)
        url = await actor.restart.remote()
        self.actors[url] = actor
        return url


async def start_frozen_group(name: str, rollout: Any, urls: list[str], actors: list[Any],
                             log_dir: Path) -> tuple[Any, Any]:
    """A frozen engine group's router in front of its engines, its client, and its health
    monitor (rollout.health's settings; no weights to wait for: a restarted frozen engine
    serves its model at once), registered for reward plugins (rlkit.rewards.engine_group)."""
    from rlkit.rollout.http import frozen_groups
    from rlkit.rollout.health import EngineMonitor
    from rlkit.rollout.http.client import EngineClient
    from rlkit.rollout.http.router import Router, RouterProcessHandle

    cfg = rollout.frozen_engines[name]
    router = Router(cfg.router, log_path=log_dir / f"router-{name}.log")
    url = await asyncio.to_thread(router.start, urls)
    client = await EngineClient(url, worker_urls=urls, router_admin=router).connect()
    monitor = None
    if rollout.health.enabled:
        monitor = EngineMonitor(client, rollout.health, ActorRestarter(dict(zip(urls, actors))),
                                needs_weights=False, router=RouterProcessHandle(router, client))
        monitor.start()  # watched from now on, between steps too
    group = frozen_groups.FrozenGroup(name, cfg, client, monitor)
    frozen_groups.register(group)
    return group, router


async def stop_frozen_group(group: Any, router: Any) -> None:
    from rlkit.rollout.http import frozen_groups

    frozen_groups.unregister(group.name)
    if group.monitor is not None:
        await group.monitor.close()
    await group.client.close()
    await asyncio.to_thread(router.stop)


def ray_handed(groups: list[Group]) -> Handed:
    """Ready groups leave the rollout actor as object references in its object store: each
    trainer rank fetches them itself, the driver sees only their records."""
    import ray

    return Handed([ray.put(g) for g in groups], [group_record(g) for g in groups])
