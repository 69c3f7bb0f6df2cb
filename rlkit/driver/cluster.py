"""Ray placement of a run's pieces, and their orderly shutdown.

    EngineActor x N     one engine server process each (hf or SGLang), on its GPU(s) if any
    RolloutActor        the router process, the RolloutBuffer, the RolloutManager, the HTTP
                        client and reward scoring (DESIGN.md: the buffer lives in one actor)
    TrainWorker x TP*DP the Megatron ranks (train.ray_group.TrainerGroup)

Placement groups hold them (rlkit.driver.placement has the rules). Every piece that owns a
process stops it in `stop()`; `Cluster.shutdown()` stops them in order (router, engines,
trainer), removes the placement groups, then stops the Ray it started or leaves the cluster it
joined (running), so no process or port of the run is left behind.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from rlkit.buffers.control_token import CONTROL_TOKEN_ENV, is_loopback
from rlkit.buffers.errors import UserError
from rlkit.config.schema import Recipe
from rlkit.driver.loop import Handed
from rlkit.driver.placement import (
    WILDCARD_HOSTS,
    ClusterJoinError,
    PlacementError,
    PlacementPlan,
    bundle,
    check_reachable,
    local_num_cpus,
    plan_placement,
    resolve_address,
)
from rlkit.driver.rollout_service import RolloutService, StepResult, group_record
from rlkit.rollout.engines.config import EngineConfig

DEFAULT_HOST = EngineConfig.model_fields["host"].default  # loopback: one node needs no more


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
        self.proc = start_engine(*self.args)

    def url(self) -> str:
        return self.proc.url  # type: ignore[return-value]

    def restart(self) -> str:
        """Kill what is left of the engine (a hung, stopped process too: SIGKILL to its process
        group) and start it again, in this actor's bundle; its new URL once healthy."""
        from rlkit.rollout.engines.fleet import start_engine

        self.proc.kill()
        self.proc = start_engine(*self.args)
        import ray

        return _advertised(self.url(), ray.util.get_node_ip_address())  # as Cluster.start does

    def stop(self) -> None:
        self.proc.stop()


class RolloutActor:
    """The rollout box as a Ray actor (async: steps run on the actor's event loop)."""

    def __init__(self, recipe: dict[str, Any], model_path: str, log_dir: str,
                 control_token: str | None = None) -> None:
        use_control_token(control_token)  # the EngineClient reads it from the environment
        self.recipe = Recipe.model_validate(recipe)
        self.model_path = model_path
        self.log_dir = Path(log_dir)
        self.tokenizer: Any = None
        self.source: Any = None
        self.score: Any = None
        self.group_filter: Any = None
        self.ranker: Any = None
        self.evaluator: Any = None
        self.router = None
        self.client = None
        self.service: RolloutService | None = None

    async def prepare(self) -> None:
        """Load the prompts and resolve the reward: no engine needed, so it runs while the
        engines start and a bad data file or reward name fails the run at once."""
        from transformers import AutoTokenizer

        from rlkit.data.prompts import load_prompt_source
        from rlkit.evaluation import make_evaluator
        from rlkit.plugins import load_group_filter, load_ranker
        from rlkit.rewards.scoring import make_score_fn, tokenizer_decode

        r = self.recipe
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.source = load_prompt_source(r.data, tokenizer, seed=r.run.seed)
        self.score = make_score_fn(r.rollout.reward, tokenizer_decode(tokenizer))
        self.group_filter = load_group_filter(r.rollout.filter)
        self.ranker = load_ranker(r.rollout.ranker)
        if r.eval.enabled:  # held-out sets: a bad row fails the run here, before any step
            self.evaluator = make_evaluator(r.eval, r.rollout, tokenizer, self.score)

    async def start(self, engine_urls: list[str], engine_actors: list[Any] = ()) -> None:
        """Start the router in front of the engines and the rollout service over them; a lost
        engine is restarted by its EngineActor (`engine_actors`, in the order of the URLs)."""
        from rlkit.rollout.client import EngineClient
        from rlkit.rollout.router import Router

        assert self.source is not None, "prepare() first"
        r = self.recipe
        self.router = Router(r.rollout.router, log_path=self.log_dir / "router.log")
        router_url = await asyncio.to_thread(self.router.start, engine_urls)
        self.client = await EngineClient(router_url, worker_urls=engine_urls,
                                         router_admin=self.router).connect()
        restarter = ActorRestarter(dict(zip(engine_urls, engine_actors))) if engine_actors else None
        self.service = RolloutService.from_config(r.rollout, self.source, self.client, self.score,
                                                  self.group_filter, self.ranker, restarter,
                                                  self.evaluator)

    async def run_step(self, version: int, for_version: int, final: bool) -> StepResult:
        assert self.service is not None
        result = await self.service.run_step(version, for_version=for_version, final=final)
        result.report = None  # the driver needs the plain data only
        return result

    async def evaluate(self, version: int) -> dict[str, float]:
        assert self.service is not None
        return await self.service.evaluate(version)

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

    def engine_set(self) -> tuple[list[str], list[str]]:
        assert self.service is not None
        return self.service.engine_set()

    async def admit_engines(self, urls: list[str]) -> None:
        assert self.service is not None
        await self.service.admit_engines(urls)

    def give_back_untrained(self) -> int:
        assert self.service is not None
        return self.service.give_back_untrained()

    async def check_engines(self) -> int:
        assert self.service is not None
        return await self.service.check_engines()

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


class ActorRestarter:
    """Restarts a lost engine through the EngineActor that owns it (rollout.health.Restarter)."""

    def __init__(self, actors: dict[str, Any]) -> None:
        self.actors = actors  # engine URL -> its EngineActor

    async def restart(self, worker: str) -> str:
        actor = self.actors.pop(worker)
        url = await actor.restart.remote()
        self.actors[url] = actor
        return url


def _refs(groups: list[Any]) -> tuple[list[Any], list[dict[str, Any]]]:
    import ray

    return [ray.put(g) for g in groups], [group_record(g) for g in groups]


class RayRolloutBox:
    """The driver's view of the RolloutActor (a mode's RolloutBox)."""

    def __init__(self, actor: Any, on_progress: Any = None, poll_s: float = 0.5) -> None:
        self.actor = actor
        self.on_progress = on_progress
        self.poll_s = poll_s
        # Run.restore_engines: engines restarted mid-step get the weights (set by the driver)
        self.on_engines_back: Any = None

    def start_step(self, version: int, *, for_version: int, final: bool) -> asyncio.Future[StepResult]:
        return asyncio.ensure_future(self._step(version, for_version, final))

    async def _step(self, version: int, for_version: int, final: bool) -> StepResult:
        done = asyncio.wrap_future(self.actor.run_step.remote(version, for_version, final).future())
        while True:
            finished, _ = await asyncio.wait({done}, timeout=self.poll_s)
            if finished:
                return done.result()
            p = await self.actor.progress.remote()
            if p and self.on_progress is not None:
                self.on_progress(p)
            if p and p.get("awaiting_weights") and self.on_engines_back is not None:
                await self.on_engines_back()

    async def next_ready(self) -> Handed:
        return Handed(*await self.actor.next_ready.remote())

    async def take(self, n: int) -> Handed:
        return Handed(*await self.actor.take.remote(n))

    async def admits(self, for_version: int) -> bool:
        return await self.actor.admits.remote(for_version)

    async def set_version(self, version: int) -> None:
        await self.actor.set_version.remote(version)

    async def evaluate(self, version: int) -> dict[str, float]:
        return await self.actor.evaluate.remote(version)

    async def engine_set(self) -> tuple[list[str], list[str]]:
        return await self.actor.engine_set.remote()

    async def admit_engines(self, urls: list[str]) -> None:
        await self.actor.admit_engines.remote(urls)

    async def give_back_untrained(self) -> int:
        return await self.actor.give_back_untrained.remote()

    async def check_engines(self) -> int:
        return await self.actor.check_engines.remote()

    def save(self, path: str) -> None:
        import ray

        ray.get(self.actor.save.remote(path))

    def load(self, path: str) -> None:
        import ray

        ray.get(self.actor.load.remote(path))


class Cluster:
    """Starts and stops every process of a run through Ray, on a local Ray or a joined cluster.

    Placement follows `rlkit.driver.placement` (trainer groups first, then one engine group).
    On a cluster of several nodes each engine binds its node's address (unless the recipe names
    another engine host) and, whenever anything binds beyond loopback, a fresh per-run control
    token reaches every actor (an argument it puts in its environment as RLKIT_CONTROL_TOKEN),
    never the recipe or logs.
    """

    def __init__(self, recipe: Recipe, model_path: str, run_dir: Path) -> None:
        self.recipe = recipe
        self.model_path = model_path
        self.log_dir = run_dir / "logs"
        self.engines: list[Any] = []
        self.engine_urls: list[str] = []
        self.rollout_actor: Any = None
        self.trainer: Any = None
        self.plan: PlacementPlan | None = None
        self.trainer_groups: list[Any] = []  # Ray placement groups, as in plan.trainer
        self.engine_group: Any = None
        self.multi_node = False
        self.bind_node_address = False  # engines bind their node's address, not loopback
        self._control_token: str | None = None
        self._connected = False  # this object called ray.init (so it calls ray.shutdown)
        self.joined: str | None = None  # the address of a cluster joined, not started

    # -- Ray connection ------------------------------------------------------------------------
    def _connect(self) -> None:
        import ray

        if ray.is_initialized():  # the caller's Ray: theirs to shut down
            return
        r = self.recipe
        address = resolve_address(r.cluster.address, os.environ)
        common = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
        if address == "local":
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local job needs no token
            eng = r.rollout.engine
            world = r.train.parallelism.tensor * r.train.parallelism.data
            cpus = eng.num_engines * r.cluster.cpus_per_engine + world * r.cluster.cpus_per_train_worker
            ray.init(address="local", num_cpus=local_num_cpus(cpus), **common)
        else:
            where = (f"cluster.address {r.cluster.address!r}, RAY_ADDRESS "
                     f"{os.environ.get('RAY_ADDRESS', '')!r}")
            try:
                # Ray waits minutes on an address where nothing listens: fail in seconds instead
                check_reachable(address)
                ray.init(address=address, **common)
            except Exception as e:
                raise ClusterJoinError(f"cannot join the Ray cluster at {address!r} ({where}): {e}") from e
            self.joined = address
        self._connected = True

    # -- placement -----------------------------------------------------------------------------
    def _place(self) -> None:
        """Plan for the alive nodes, create the placement groups and wait until they are placed."""
        import ray
        from ray.util import placement_group

        r, eng = self.recipe, self.recipe.rollout.engine
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        self.multi_node = len(nodes) > 1
        has_gpus = any(n.get("GPU", 0) > 0 for n in nodes)
        trainer_gpus = 1 if r.train.device == "cuda" or (r.train.device == "auto" and has_gpus) else 0
        engine_gpus = eng.gpus_per_engine if eng.kind == "sglang" else (1 if eng.device == "cuda" else 0)
        self.plan = plan_placement(
            num_engines=eng.num_engines,
            engine_bundle=bundle(r.cluster.cpus_per_engine, engine_gpus),
            tp=r.train.parallelism.tensor,
            dp=r.train.parallelism.data,
            trainer_bundle=bundle(r.cluster.cpus_per_train_worker, trainer_gpus),
            nodes=nodes,
        )
        groups = [*self.plan.trainer, self.plan.engines]
        made = []
        for g in groups:  # trainer first: its packing is the strictest constraint
            made.append(placement_group(list(g.bundles), strategy=g.strategy))
            if g is self.plan.engines:
                self.engine_group = made[-1]
            else:
                self.trainer_groups.append(made[-1])
        for g, pg in zip(groups, made):
            if not pg.wait(timeout_seconds=r.cluster.placement_timeout_s):
                raise PlacementError(
                    f"placement group '{g.name}' ({g.strategy}, {len(g.bundles)} x "
                    f"{g.bundles[0] if g.bundles else {}}) was not placed within "
                    f"{r.cluster.placement_timeout_s:.0f} s (cluster.placement_timeout_s); the "
                    f"cluster has {ray.cluster_resources()}, available {ray.available_resources()}")

    def _strategy(self, pg: Any, index: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)

    def engine_options(self, index: int) -> dict[str, Any]:
        """Ray options of engine `index`: its resources and its bundle."""
        assert self.plan is not None and self.engine_group is not None, "start() first"
        b = self.plan.engines.bundles[index]
        return {"num_cpus": b.get("CPU", 0.0), "num_gpus": b.get("GPU", 0.0),
                "scheduling_strategy": self._strategy(self.engine_group, index)}

    def placement(self) -> dict[str, Any]:
        """Where the bundles landed: node ids per trainer rank and per engine, and each node's
        address as Ray reports it."""
        import ray
        from ray.util import placement_group_table

        def nodes_of(pg: Any) -> list[str]:
            table = placement_group_table(pg)["bundles_to_node_id"]
            return [table[i] for i in range(len(table))]

        return {
            "trainer": [n for pg in self.trainer_groups for n in nodes_of(pg)],
            "engines": nodes_of(self.engine_group) if self.engine_group is not None else [],
            "addresses": {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")},
        }

    # -- start / shutdown ----------------------------------------------------------------------
    def start(self) -> "Cluster":
        import ray

        from rlkit.train.ray_group import TrainerGroup

        self.log_dir.mkdir(parents=True, exist_ok=True)
        r = self.recipe
        self._connect()
        try:
            self._place()
            eng = r.rollout.engine
            # Several nodes: an engine must be reachable from the others, so it binds its node's
            # address; a host the recipe names (anything but the loopback default) is kept.
            self.bind_node_address = self.multi_node and eng.host == DEFAULT_HOST
            beyond_loopback = (self.bind_node_address or not is_loopback(eng.host)
                               or not is_loopback(r.rollout.router.host))
            token = self._control_token = secrets.token_urlsafe(32) if beyond_loopback else None

            engine_cls = ray.remote(EngineActor)
            self.engines = [
                engine_cls.options(**self.engine_options(i)).remote(
                    self.model_path, eng.model_dump(), i, str(self.log_dir),
                    bind_node_address=self.bind_node_address, control_token=token)
                for i in range(eng.num_engines)
            ]
            # The router and its log stay on the driver's node (a soft preference: with Ray
            # Client the driver is on no node).
            rollout_options: dict[str, Any] = {"num_cpus": 0}
            driver_node = _driver_node_id()
            if driver_node is not None:
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                rollout_options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(driver_node, soft=True)
            self.rollout_actor = ray.remote(RolloutActor).options(**rollout_options).remote(
                r.model_dump(mode="json"), self.model_path, str(self.log_dir), control_token=token
            )
            ray.get(self.rollout_actor.prepare.remote())  # while the engines start
            urls = ray.get([e.url.remote() for e in self.engines])
            where = self.placement()
            self.engine_urls = [_advertised(u, where["addresses"].get(n, "")) for u, n in zip(urls, where["engines"])]
            ray.get(self.rollout_actor.start.remote(self.engine_urls, self.engines))
            assert self.plan is not None
            self.trainer = TrainerGroup(
                self.model_path, r.train, temperature=r.rollout.sampling.temperature,
                num_cpus_per_worker=self.plan.trainer[0].bundles[0].get("CPU", 0.0),
                num_gpus_per_worker=self.plan.trainer[0].bundles[0].get("GPU", 0.0),
                scheduling=[self._strategy(self.trainer_groups[g], b) for g, b in self.plan.trainer_slots()],
                control_token=token,
            )
        except BaseException:
            self.shutdown()
            raise
        return self

    def shutdown(self) -> None:
        """Stop everything, tolerating pieces that never started or already died. A joined
        cluster keeps running: only this run's actors and placement groups go."""
        import ray
        from ray.util import remove_placement_group

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
        for pg in [*self.trainer_groups, self.engine_group]:
            if pg is not None:
                _quietly(lambda pg=pg: remove_placement_group(pg))
        self.trainer_groups, self.engine_group = [], None
        self._control_token = None
        if self._connected:
            ray.shutdown()  # on a joined cluster this only disconnects the driver
            self._connected = False


def _driver_node_id() -> str | None:
    import ray

    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - Ray Client: the driver is on no node
        return None


def _advertised(url: str, node_address: str) -> str:
    """An engine bound to every interface is reached at its node's address."""
    parts = urlsplit(url)
    if parts.hostname in WILDCARD_HOSTS and node_address:
        host = f"[{node_address}]" if ":" in node_address else node_address  # IPv6
        return urlunsplit(parts._replace(netloc=f"{host}:{parts.port}"))
    return url


def _quietly(fn: Any) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - shutdown must go on past a dead piece
        pass


class TrainerDied(UserError):
    """A trainer rank's process died (killed, out of memory, a crash in native code). The run
    cannot go on without it; `rlkit.driver.run` adds the step and the checkpoint to resume from."""

    exit_code = 1  # not bad input: the run failed, and can be resumed


class RayTrainerBox:
    """The driver's view of the TrainerGroup (a mode's TrainerBox): calls are submitted at once
    and awaited at `finish`; group references go to the trainer actors as they are.

    Every wait returns at the first failure of any rank rather than in rank order: a rank that
    died leaves the others blocked in a collective. A dead rank ends the run as TrainerDied, and
    the other ranks are killed with it (they cannot finish a collective step without it)."""

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
        calls, self._calls = self._calls, []
        await self._wait(calls, "training")  # an error in any earlier call surfaces here
        return (await self._wait(self.group.finish_batch(), "the optimizer step"))[0]

    async def push_weights(self, version: int, urls: list[str] | None = None) -> None:
        """To `urls` (the engines serving now, and restarted ones); by default the first set."""
        urls = list(urls if urls is not None else self.engine_urls)
        folder = str(self.folder)
        method = self.recipe.train.weight_sync.method
        # TrainerGroup.sync_weights's calls, one per rank, so a dead rank is seen at once
        await self._wait([w.sync_weights.remote(urls, version, method, folder)
                          for w in self.group.workers], "the weight sync")

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

    def _died(self, e: Exception, what: str) -> TrainerDied:
        import ray

        actor_id = getattr(e, "actor_id", None)
        who = "a trainer rank"
        for rank, w in enumerate(self.group.workers):
            if actor_id and w._actor_id.hex() == actor_id:
                pid = (self.group.ranks[rank] or {}).get("pid") if rank < len(self.group.ranks) else None
                who = f"trainer rank {rank}" + (f" (pid {pid})" if pid else "")
        for w in self.group.workers:  # the others cannot finish a collective without it
            _quietly(lambda w=w: ray.kill(w))
        exit_type = re.search(r"Worker exit type: (\w+)", str(e))
        reason = (f"its process is gone, Ray's exit type {exit_type.group(1)}: killed, out of "
                  "memory or crashed" if exit_type else str(e).strip().split("\n")[0][:200])
        return TrainerDied(f"{who} died during {what} ({reason})")
