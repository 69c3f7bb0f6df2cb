"""A run's cluster lifecycle: connect to Ray, place the pieces, start them, stop them all.

    EngineActor x N     one engine server process each (hf or SGLang), on its GPU(s) if any
    RolloutActor        the router process and the rollout box (docs/design.md: the buffer
                        lives in one actor)
    TrainWorker x TP*DP the Megatron ranks (train.ray_group.TrainerGroup)

The actors are rlkit/driver/actors.py; the driver's side of them, rlkit/driver/proxies.py.

Placement groups hold them (rlkit.driver.placement has the rules). Every piece that owns a
process stops it in `stop()`; `Cluster.shutdown()` stops them in order (router, engines,
trainer), removes the placement groups, then stops the Ray it started or leaves the cluster it
joined (running), so no process or port of the run is left behind.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from rlkit.common.errors import ActorDeath, ProcessDied, UserError, actor_death, find_user_error
from rlkit.config.modes import OVERLAPS_TRAINING
from rlkit.config.schema import Recipe
from rlkit.driver.actors import EngineActor, RolloutActor
from rlkit.driver.local_ray import LocalRay
from rlkit.driver.placement import (
    ClusterJoinError,
    GroupPlan,
    PlacementError,
    PlacementPlan,
    advertised,
    bundle,
    check_reachable,
    colocated_rank_cpus,
    local_num_cpus,
    plan_colocated,
    plan_placement,
    resolve_address,
    trainer_threads,
)
from rlkit.rollout.engines.config import EngineConfig

DEFAULT_HOST = EngineConfig.model_fields["host"].default  # loopback: one node needs no more


class Cluster:
    """Starts and stops every process of a run through Ray, on a local Ray or a joined cluster.

    Placement follows `rlkit.driver.placement` (trainer groups first, then one engine group).
    On a cluster of several nodes each engine binds its node's address (unless the recipe names
    another engine host); on one node everything the run starts itself binds loopback. A fresh
    per-run control token reaches every actor (an argument it puts in its environment as
    RLKIT_CONTROL_TOKEN), never the recipe or logs. A Ray it starts runs with Ray's token
    authentication and a token of its own (rlkit.driver.local_ray).
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
        # rollout.frozen_engines: name -> its EngineActors, and their one placement group
        self.frozen: dict[str, list[Any]] = {}
        self.frozen_group: Any = None
        self.multi_node = False
        self.bind_node_address = False  # engines bind their node's address, not loopback
        self._control_token: str | None = None
        self._connected = False  # this object called ray.init (so it calls ray.shutdown)
        self._local_ray: LocalRay | None = None  # the Ray this run started, if it started one
        self.joined: str | None = None  # the address of a cluster joined, not started
        # SFT (train.algorithm.loss sft) starts the trainer alone: no engine, router or rollout
        self.engineless = recipe.train.algorithm.loss == "sft"
        self.num_engines = 0 if self.engineless else recipe.rollout.engine.num_engines

    # -- Ray connection ------------------------------------------------------------------------
    def _connect(self) -> None:
        import ray

        if ray.is_initialized():  # the caller's Ray: theirs to shut down
            return
        r = self.recipe
        address = resolve_address(r.cluster.address, os.environ)
        if address == "local":
            eng = r.rollout.engine
            world = r.train.parallelism.tensor * r.train.parallelism.data
            cpus = self.num_engines * r.cluster.cpus_per_engine + world * r.cluster.cpus_per_train_worker
            if r.cluster.placement == "colocated":  # the engines' CPUs are in the ranks' bundles
                cpus = world * colocated_rank_cpus(eng.num_engines, world, r.cluster.cpus_per_train_worker,
                                                   r.cluster.cpus_per_engine)
            cpus += len(self._frozen_bundles()) * r.cluster.cpus_per_engine
            self._local_ray = LocalRay()  # token auth with this run's own token (local_ray.py)
            self._local_ray.start(local_num_cpus(cpus))
        else:
            where = (f"cluster.address {r.cluster.address!r}, RAY_ADDRESS "
                     f"{os.environ.get('RAY_ADDRESS', '')!r}")
            try:
                # Ray waits minutes on an address where nothing listens: fail in seconds instead
                check_reachable(address)
                ray.init(address=address, include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
            except Exception as e:
                raise ClusterJoinError(f"cannot join the Ray cluster at {address!r} ({where}): {e}") from e
            self.joined = address
            _warn_if_open(address)
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
        if self.engineless:
            engine_gpus = 0
        if (r.train.device == "cuda" or engine_gpus) and not has_gpus:
            asks = [k for k, on in (("train.device cuda", r.train.device == "cuda"),
                                    (f"rollout.engine {eng.kind} on GPUs", engine_gpus)) if on]
            raise PlacementError(
                f"this recipe needs a CUDA GPU ({', '.join(asks)}), but no node of the Ray cluster "
                f"has one (nodes: {[{k: n[k] for k in ('CPU', 'GPU') if n.get(k)} for n in nodes]}). "
                "Run it on a machine with a GPU, or use a CPU recipe (recipes/grpo_smollm2_cpu.yaml)")
        if r.cluster.placement == "colocated" and not self.engineless:
            self.plan = plan_colocated(
                num_engines=eng.num_engines, gpus_per_engine=max(engine_gpus, 1),
                engine_cpus=r.cluster.cpus_per_engine, tp=r.train.parallelism.tensor,
                dp=r.train.parallelism.data, train_cpus=r.cluster.cpus_per_train_worker,
                on_gpu=trainer_gpus > 0 or engine_gpus > 0, nodes=nodes)
        else:
            self.plan = plan_placement(
                num_engines=self.num_engines,
                engine_bundle=bundle(r.cluster.cpus_per_engine, engine_gpus),
                tp=r.train.parallelism.tensor,
                dp=r.train.parallelism.data,
                trainer_bundle=bundle(r.cluster.cpus_per_train_worker, trainer_gpus),
                nodes=nodes,
            )
        # colocated: the engines live in the trainer's bundles, there is no engine group
        groups = [*self.plan.trainer,
                  *([] if self.plan.colocated or self.engineless else [self.plan.engines])]
        frozen = self._frozen_bundles()
        check_frozen_fit(groups, frozen, nodes)  # before any placement group is made
        made = []
        for g in groups:  # trainer first: its packing is the strictest constraint
            made.append(placement_group(list(g.bundles), strategy=g.strategy))
            if g is self.plan.engines:
                self.engine_group = made[-1]
            else:
                self.trainer_groups.append(made[-1])
        if frozen:  # beside the others in both placements: frozen engines never sleep
            groups.append(GroupPlan("frozen", "PACK", tuple(frozen)))
            made.append(placement_group(list(frozen), strategy="PACK"))
            self.frozen_group = made[-1]
        for g, pg in zip(groups, made):
            if not pg.wait(timeout_seconds=r.cluster.placement_timeout_s):
                raise PlacementError(
                    f"placement group '{g.name}' ({g.strategy}, {len(g.bundles)} x "
                    f"{g.bundles[0] if g.bundles else {}}) was not placed within "
                    f"{r.cluster.placement_timeout_s:.0f} s (cluster.placement_timeout_s); the "
                    f"cluster has {ray.cluster_resources()}, available {ray.available_resources()}")

    def _frozen_bundles(self) -> list[dict[str, float]]:
        """The bundle of every frozen engine (rollout.frozen_engines), group by group: its CPUs,
        and its GPUs as the policy's engines get them."""
        if self.engineless:
            return []
        out = []
        for g in self.recipe.rollout.frozen_engines.values():
            e = g.engine
            gpus = e.gpus_per_engine if e.kind == "sglang" else (1 if e.device == "cuda" else 0)
            out += [bundle(self.recipe.cluster.cpus_per_engine, gpus)] * e.num_engines
        return out

    def _strategy(self, pg: Any, index: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)

    def engine_options(self, index: int) -> dict[str, Any]:
        """Ray options of engine `index`: its resources and its bundle (colocated: a share of a
        trainer rank's bundle, so Ray shows it the rank's GPU)."""
        assert self.plan is not None, "start() first"
        cpus = self.recipe.cluster.cpus_per_engine
        if self.plan.colocated:
            g, b = self.plan.engine_slots[index]
            gpu = self.plan.trainer[g].bundles[b].get("GPU", 0.0) * self.plan.gpu_share
            return {"num_cpus": cpus, "num_gpus": gpu,
                    "scheduling_strategy": self._strategy(self.trainer_groups[g], b)}
        assert self.engine_group is not None, "start() first"
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

        trainer = [nodes_of(pg) for pg in self.trainer_groups]
        if self.plan is not None and self.plan.colocated:
            engines = [trainer[g][b] for g, b in self.plan.engine_slots]
        else:
            engines = nodes_of(self.engine_group) if self.engine_group is not None else []
        return {
            "trainer": [n for group in trainer for n in group],
            "engines": engines,
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
            # Every run has a control token, on loopback too: every endpoint of its engines and
            # router but the health probes needs it (rlkit/common/control_token.py)
            token = self._control_token = secrets.token_urlsafe(32)
            if not self.engineless:
                self._start_rollout(token)
            assert self.plan is not None
            rank_bundle = self.plan.trainer[0].bundles[0]
            self.trainer = TrainerGroup(
                self.model_path, r.train, temperature=r.rollout.sampling.temperature,
                num_cpus_per_worker=(r.cluster.cpus_per_train_worker if self.plan.colocated
                                     else rank_bundle.get("CPU", 0.0)),
                num_gpus_per_worker=rank_bundle.get("GPU", 0.0) * self.plan.gpu_share,
                threads_per_worker=self.train_threads(),
                scheduling=[self._strategy(self.trainer_groups[g], b) for g, b in self.plan.trainer_slots()],
                control_token=token,
                loopback=not self.multi_node,  # one node: the ranks' rendezvous on 127.0.0.1
            )
            if not self.engineless:
                ray.get(self.rollout_actor.hand_off_to.remote(self.trainer.attention_weight))
        except BaseException as e:
            # a process that died while the run started is named before its actor is gone
            died = self.died(e, "start-up") if isinstance(e, Exception) else None
            self.shutdown(graceful=died is None)
            if died is not None:
                raise died from None
            raise
        return self

    def _start_rollout(self, token: str) -> None:
        """The engines (one actor each) and the rollout actor, which starts the router."""
        import ray

        r, eng = self.recipe, self.recipe.rollout.engine
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
        frozen_urls = self._start_frozen(token)
        ray.get(self.rollout_actor.prepare.remote())  # while the engines start
        urls = ray.get([e.url.remote() for e in self.engines])
        where = self.placement()
        self.engine_urls = [advertised(u, where["addresses"].get(n, "")) for u, n in zip(urls, where["engines"])]
        frozen = {name: (urls, self.frozen[name]) for name, urls in self._frozen_urls(frozen_urls).items()}
        ray.get(self.rollout_actor.start.remote(self.engine_urls, self.engines, frozen))

    def _start_frozen(self, token: str) -> dict[str, list[Any]]:
        """Start every frozen group's engines (one EngineActor each, in the frozen placement
        group; logs under logs/<group>/); references to their URLs, by group."""
        import ray

        from rlkit.rollout.demo_models import resolve_model_path

        engine_cls = ray.remote(EngineActor)
        bundles, index, refs = self._frozen_bundles(), 0, {}
        for name, g in self.recipe.rollout.frozen_engines.items():
            try:
                model = resolve_model_path(g.model)
            except Exception as e:  # noqa: BLE001 - named with its key
                raise UserError(f"rollout.frozen_engines.{name}.model: {e}") from None
            if g.role == "teacher":
                _check_same_tokenizer(self.model_path, model, name)
            self.frozen[name] = []
            for i in range(g.engine.num_engines):
                self.frozen[name].append(engine_cls.options(
                    num_cpus=bundles[index].get("CPU", 0.0), num_gpus=bundles[index].get("GPU", 0.0),
                    scheduling_strategy=self._strategy(self.frozen_group, index)).remote(
                    model, g.engine.model_dump(), i, str(self.log_dir / name),
                    bind_node_address=self.bind_node_address, control_token=token))
                index += 1
            refs[name] = [a.url.remote() for a in self.frozen[name]]
        return refs

    def _frozen_urls(self, refs: dict[str, list[Any]]) -> dict[str, list[str]]:
        """The frozen engines' URLs as the other nodes reach them (as the policy's)."""
        import ray
        from ray.util import placement_group_table

        if self.frozen_group is None:
            return {}
        table = placement_group_table(self.frozen_group)["bundles_to_node_id"]
        addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
        out, index = {}, 0
        for name, group_refs in refs.items():
            out[name] = []
            for url in ray.get(group_refs):
                out[name].append(advertised(url, addresses.get(table[index], "")))
                index += 1
        return out

    def train_threads(self) -> int:
        """Torch threads of each trainer rank (rlkit.driver.placement.trainer_threads)."""
        r = self.recipe
        overlaps = OVERLAPS_TRAINING[r.mode] and not (r.mode == "async" and r.rollout.max_staleness == 0)
        return trainer_threads(
            train_threads=r.cluster.train_threads, reserved_cpus=r.cluster.cpus_per_train_worker,
            overlaps=overlaps and r.cluster.placement != "colocated", one_node=not self.multi_node,
            ranks=r.train.parallelism.tensor * r.train.parallelism.data, cores=os.cpu_count() or 1)

    # -- a process of the run that died --------------------------------------------------------
    def died(self, error: BaseException, during: str) -> ProcessDied | None:
        """The death of a process of this run behind `error`, as one line (ProcessDied: which
        process, its pid, Ray's exit type, `during` what), or None when `error` is no death.

        Ray names the dead actor when a call on it failed (ActorDiedError). A death can also
        surface elsewhere first: a trainer rank fetching groups whose owner, the rollout actor,
        died; a rank's collective broken by another rank's death. For an error from Ray that
        names no actor of the run, every actor of the run is asked whether it is alive (Ray's
        built-in `__ray_ready__`: a dead one answers at once with its death; one busy in a call
        does not answer within the wait and counts as alive)."""
        if isinstance(error, ProcessDied):
            return error
        if find_user_error(error) is not None:  # an error the user can fix (a bad data file)
            return None
        names = self._actor_names()
        death = actor_death(error)
        if death is None or death.actor_id not in names:
            if not _from_ray(error):
                return None
            death = self._find_dead(names) or death
            if death is None:
                return None
        who = names.get(death.actor_id or "") or _ACTOR_KINDS.get(death.class_name or "", "a process of the run")
        pid = f" (pid {death.pid})" if death.pid else ""
        return ProcessDied(f"{who}{pid} died during {during} ({death.reason()})")

    def _actor_names(self) -> dict[str, str]:
        """Actor id (hex) -> what it is, for every actor of the run now."""
        names = {}
        if self.rollout_actor is not None:
            names[self.rollout_actor._actor_id.hex()] = "the rollout actor"
        for r, w in enumerate(self.trainer.workers if self.trainer is not None else []):
            names[w._actor_id.hex()] = f"trainer rank {r}"
        for i, e in enumerate(self.engines):
            names[e._actor_id.hex()] = f"engine {i}'s actor"
        for group, actors in self.frozen.items():
            for i, e in enumerate(actors):
                names[e._actor_id.hex()] = f"frozen group {group!r} engine {i}'s actor"
        return names

    def _find_dead(self, names: dict[str, str], wait_s: float = 10.0) -> ActorDeath | None:
        import ray

        actors = [a for a in [self.rollout_actor, *(self.trainer.workers if self.trainer else []),
                              *self.engines, *self._frozen_actors()] if a is not None]
        if not actors or not ray.is_initialized():  # stopped already: a Ray call would start one
            return None
        refs = [a.__ray_ready__.remote() for a in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 - only a death is looked for
                if (death := actor_death(e)) is not None:
                    return death
        return None

    def _frozen_actors(self) -> list[Any]:
        return [a for actors in self.frozen.values() for a in actors]

    def shutdown(self, graceful: bool = True) -> None:
        """Stop everything, tolerating pieces that never started or already died. A joined
        cluster keeps running: only this run's actors and placement groups go. Not `graceful`
        (a process of the run died): the trainer ranks, which may be blocked in a collective or
        on the dead process, are killed without being asked to leave their process group."""
        import ray
        from ray.util import remove_placement_group

        if not ray.is_initialized():
            return
        if self.rollout_actor is not None:
            _quietly(lambda: ray.get(self.rollout_actor.stop.remote(), timeout=60))
        stops = [s for s in (_quietly(e.stop.remote) for e in [*self.engines, *self._frozen_actors()])
                 if s is not None]
        _quietly(lambda: ray.wait(stops, num_returns=len(stops), timeout=60))  # all at once
        if self.trainer is not None:
            _quietly(lambda: self.trainer.shutdown(graceful))
        for a in [self.rollout_actor, *self.engines, *self._frozen_actors()]:
            if a is not None:
                _quietly(lambda a=a: ray.kill(a))
        self.rollout_actor, self.engines, self.trainer, self.frozen = None, [], None, {}
        for pg in [*self.trainer_groups, self.engine_group, self.frozen_group]:
            if pg is not None:
                _quietly(lambda pg=pg: remove_placement_group(pg))
        self.trainer_groups, self.engine_group, self.frozen_group = [], None, None
        self._control_token = None
        if self._connected:
            if self._local_ray is not None:
                self._local_ray.stop()  # and the environment it started with is restored
                self._local_ray = None
            else:
                ray.shutdown()  # on a joined cluster this only disconnects the driver
            self._connected = False


def check_frozen_fit(groups: list[Any], frozen: list[dict[str, float]],
                     nodes: list[dict[str, float]]) -> None:
    """Refuse frozen engines (`frozen`: their bundles) the cluster (`nodes`) cannot hold beside
    the placement groups `groups` (the trainer's and the policy's engines'), with the numbers."""
    for res in ("GPU", "CPU"):
        need = sum(b.get(res, 0.0) for g in groups for b in g.bundles)
        extra = sum(b.get(res, 0.0) for b in frozen)
        have = sum(n.get(res, 0.0) for n in nodes)
        if extra and need + extra > have:
            raise PlacementError(
                f"rollout.frozen_engines need {extra:g} {res}s beside the {need:g} of the "
                f"trainer and the policy's engines, but the cluster has {have:g}: fewer or "
                "smaller frozen engines, or a bigger cluster (frozen engines never share the "
                "trainer's GPUs)")


def _check_same_tokenizer(policy: str, teacher: str, name: str) -> None:
    """A teacher scores the policy's token ids: its vocabulary must be the policy's."""
    from transformers import AutoTokenizer

    mine, theirs = (AutoTokenizer.from_pretrained(p).get_vocab() for p in (policy, teacher))
    if mine != theirs:
        differ = len(set(mine.items()) ^ set(theirs.items()))
        raise UserError(f"rollout.frozen_engines.{name}: the teacher's tokenizer ({teacher}) is not "
                        f"the policy's ({policy}; {differ} vocabulary entries differ): it would "
                        "score other tokens than the policy sampled. Use a teacher of the same "
                        "tokenizer family")


def _warn_if_open(address: str) -> None:
    """Say so when the joined cluster took this driver without a token: it has no token
    authentication, so anyone who can reach it can run code in it (docs/reliability.md, "On a
    cluster of several nodes: what the operator sets")."""
    import warnings

    from ray._raylet import AuthenticationMode, get_authentication_mode

    if get_authentication_mode() != AuthenticationMode.TOKEN:
        warnings.warn(f"the Ray cluster at {address!r} accepted this run without a token: it runs "
                      "without token authentication, and anyone who can reach it can run code in "
                      "it. Start its nodes with RAY_AUTH_MODE=token and one RAY_AUTH_TOKEN "
                      "(docs/reliability.md, 'Who can reach a run')", stacklevel=3)


def _driver_node_id() -> str | None:
    import ray

    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - Ray Client: the driver is on no node
        return None


# What an actor of the run is, by its class (when Ray names one this run no longer holds, as a
# trainer rank that died while its group started)
_ACTOR_KINDS = {"RolloutActor": "the rollout actor", "TrainWorker": "a trainer rank",
                "EngineActor": "an engine's actor"}


def _from_ray(error: BaseException) -> bool:
    """Whether Ray raised `error` or something in its chain (a task's error, a lost object)."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__module__.startswith("ray."):
            return True
        cause = getattr(e, "cause", None)
        e = cause if isinstance(cause, BaseException) else (e.__cause__ or e.__context__)
    return False


def _quietly(fn: Any) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - shutdown must go on past a dead piece
        pass
