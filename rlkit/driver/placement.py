"""Where a run's pieces go on a Ray cluster: a pure plan (no Ray), so its rules are testable.

Rules (docs/reliability.md, "Beyond one machine"):

- Trainer ranks are created first (their constraint is the strictest). Each rank is one bundle
  ({GPU: 1} on GPUs, plus `cluster.cpus_per_train_worker` CPUs). If the whole TP x DP world fits
  one node, it is one STRICT_PACK group (every rank on one node). Otherwise the world is cut into
  the largest chunks of k consecutive ranks, k a multiple of TP that divides the world, such that
  the nodes can hold world/k chunks of k; each chunk is a STRICT_PACK group, so a TP group (the
  innermost, chattiest ranks) never spans two nodes. If no such k exists (TP itself does not fit
  a node), the world is one PACK group: Ray packs it as tightly as it can.
- Engines are one PACK group with one bundle per engine: its GPUs (`gpus_per_engine` for
  SGLang, 1 for hf on cuda, 0 on CPU) and `cluster.cpus_per_engine` CPUs. An engine must fit
  one node.
- The rollout actor (router, buffer) takes no resources and stays on the driver's node.

Colocated (`cluster.placement: colocated`, `plan_colocated`): there is no engine group. Each
trainer rank's bundle also holds the engine that shares its GPU: {GPU: 1} and the CPUs of both,
grouped by the trainer's rule above. On GPUs the engines' GPUs must be the trainer's ranks
(num_engines x GPUs per engine = TP x DP), and the rank and the engine each ask Ray for half of
the bundle's GPU, so Ray shows both processes the same device. Engines of one GPU only: an
engine of several GPUs would need its processes on several bundles' devices, which one Ray
actor cannot hold. On CPUs engines are spread over the ranks' bundles in turn.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from typing import Mapping, Sequence
from urllib.parse import urlsplit, urlunsplit

from rlkit.common.errors import UserError

Bundle = dict[str, float]


class PlacementError(UserError, RuntimeError):
    """The cluster cannot hold the run's pieces; the message says which and what it has."""


class ClusterJoinError(UserError, RuntimeError):
    """The Ray cluster named by cluster.address or RAY_ADDRESS cannot be joined."""


@dataclass(frozen=True)
class GroupPlan:
    name: str
    strategy: str  # a Ray placement strategy: STRICT_PACK or PACK
    bundles: tuple[Bundle, ...]


@dataclass(frozen=True)
class PlacementPlan:
    trainer: tuple[GroupPlan, ...]  # rank order: group 0 holds the first ranks
    engines: GroupPlan  # colocated: no bundles (engines live in the trainer's)
    # Colocated: the (trainer group, bundle) of each engine; the GPU share of each process.
    engine_slots: tuple[tuple[int, int], ...] = ()
    gpu_share: float = 1.0

    def trainer_slots(self) -> list[tuple[int, int]]:
        """(group, bundle) of each trainer rank, in rank order."""
        return [(g, b) for g, group in enumerate(self.trainer) for b in range(len(group.bundles))]

    @property
    def colocated(self) -> bool:
        return bool(self.engine_slots)

    def totals(self) -> Bundle:
        out: Bundle = {}
        for group in (*self.trainer, self.engines):
            for bundle in group.bundles:
                for k, v in bundle.items():
                    out[k] = out.get(k, 0.0) + v
        return out


def bundle(cpus: float, gpus: float) -> Bundle:
    """A Ray bundle; Ray rejects zero-valued entries, so they are left out."""
    return {k: float(v) for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}


def fits(node: Mapping[str, float], b: Bundle, times: int = 1) -> bool:
    return all(node.get(k, 0.0) >= v * times for k, v in b.items())


def capacity(node: Mapping[str, float], b: Bundle) -> int:
    """How many copies of bundle `b` one node holds."""
    return min((int(node.get(k, 0.0) // v) for k, v in b.items() if v > 0), default=0)


def plan_placement(
    *,
    num_engines: int,
    engine_bundle: Bundle,
    tp: int,
    dp: int,
    trainer_bundle: Bundle,
    nodes: Sequence[Mapping[str, float]],
) -> PlacementPlan:
    """The placement groups for `nodes` (each node's total resources, as Ray reports them)."""
    world = tp * dp
    if not nodes:
        raise PlacementError("the Ray cluster has no alive node")
    placed = [("a trainer rank", trainer_bundle)]
    if num_engines:  # an engineless run (SFT) places none
        placed.append(("an engine", engine_bundle))
    for what, b in placed:
        if not any(fits(n, b) for n in nodes):
            raise PlacementError(
                f"{what} needs {b} on one node, but no node has that: nodes have "
                f"{[_short(n) for n in nodes]}")
    need = PlacementPlan(
        (GroupPlan("trainer", "PACK", (trainer_bundle,) * world),),
        GroupPlan("engines", "PACK", (engine_bundle,) * num_engines),
    ).totals()
    have = {k: float(sum(n.get(k, 0.0) for n in nodes)) for k in need}
    if any(have[k] < v for k, v in need.items()):
        raise PlacementError(
            f"the run needs {need} in all ({num_engines} engines x {engine_bundle} + "
            f"{world} trainer ranks x {trainer_bundle}), the Ray cluster has {have}")

    caps = [capacity(n, trainer_bundle) for n in nodes]
    trainer: tuple[GroupPlan, ...] = (GroupPlan("trainer", "PACK", (trainer_bundle,) * world),)
    for k in range(world, tp - 1, -tp):  # chunk sizes: multiples of TP that divide the world
        if world % k == 0 and sum(c // k for c in caps) >= world // k:
            trainer = tuple(
                GroupPlan(f"trainer-{i}" if k < world else "trainer", "STRICT_PACK",
                          (trainer_bundle,) * k)
                for i in range(world // k))
            break
    return PlacementPlan(trainer, GroupPlan("engines", "PACK", (engine_bundle,) * num_engines))


COLOCATED_GPU_SHARE = 0.5  # of a bundle's GPU, to the trainer rank and to the engine on it


def colocated_rank_cpus(num_engines: int, world: int, train_cpus: float, engine_cpus: float) -> float:
    """CPUs of each colocated bundle: a trainer rank's and those of the most engines one rank's
    bundle holds (engines go over the ranks in turn). Every bundle is the biggest one: Ray's
    groups are uniform here, and CPUs are cheap."""
    return train_cpus + -(-num_engines // world) * engine_cpus


def plan_colocated(
    *,
    num_engines: int,
    gpus_per_engine: int,
    engine_cpus: float,
    tp: int,
    dp: int,
    train_cpus: float,
    on_gpu: bool,
    nodes: Sequence[Mapping[str, float]],
) -> PlacementPlan:
    """Engines in the trainer ranks' bundles (module docstring). `gpus_per_engine`: what each
    engine uses when `on_gpu` (ignored on CPU)."""
    world = tp * dp
    if on_gpu:
        if gpus_per_engine != 1:
            raise PlacementError(
                f"cluster.placement colocated runs engines of one GPU (rollout.engine."
                f"gpus_per_engine is {gpus_per_engine}): an engine of several GPUs would need "
                "its TP processes on several trainer ranks' devices, which one Ray actor cannot "
                "hold. Use gpus_per_engine 1 with more engines, or placement disaggregated")
        if num_engines != world:
            raise PlacementError(
                f"cluster.placement colocated puts one engine on each trainer rank's GPU: "
                f"{num_engines} engines x 1 GPU != {world} trainer ranks (TP {tp} x DP {dp}). "
                f"Set rollout.engine.num_engines to {world}")
    slots = [i % world for i in range(num_engines)]  # engines in turn over the ranks' bundles
    shared = bundle(colocated_rank_cpus(num_engines, world, train_cpus, engine_cpus), 1 if on_gpu else 0)
    plan = plan_placement(num_engines=0, engine_bundle={}, tp=tp, dp=dp, trainer_bundle=shared,
                          nodes=nodes)
    ranks = plan.trainer_slots()
    return PlacementPlan(plan.trainer, GroupPlan("engines", "PACK", ()),
                         engine_slots=tuple(ranks[r] for r in slots),
                         gpu_share=COLOCATED_GPU_SHARE if on_gpu else 1.0)


def trainer_threads(*, train_threads: int, reserved_cpus: float, overlaps: bool, one_node: bool,
                    ranks: int, cores: int) -> int:
    """Torch threads of each trainer rank on CPU (`cluster.train_threads`; 0 chooses).

    Where generation never overlaps training on one node, the engines wait while the trainer
    works: its ranks share the node's cores. On the 2-core machine that is 2 threads instead of
    1, and the train phase takes 0.6x the time. Where they overlap (stream, async with
    staleness), a rank keeps its reserved CPUs beside the engines' threads: more would
    oversubscribe the cores they generate on. Across nodes the node's cores are not known here."""
    if train_threads:
        return train_threads
    reserved = max(1, int(reserved_cpus))
    if overlaps or not one_node:
        return reserved
    return max(reserved, cores // max(1, ranks))


def local_num_cpus(plan_cpus: float) -> int:
    """CPUs a locally started Ray offers: the machine's cores, or more when the plan reserves
    more (logical CPUs only: on a small machine the pieces share its cores, as they always have)."""
    return max(os.cpu_count() or 1, math.ceil(plan_cpus))


def _short(node: Mapping[str, float]) -> dict[str, float]:
    return {k: node[k] for k in ("CPU", "GPU") if node.get(k)}


# -- addresses ------------------------------------------------------------------------------
def resolve_address(address: str, environ: Mapping[str, str]) -> str:
    """What `ray.init(address=...)` gets for `cluster.address`: '' means $RAY_ADDRESS if set,
    else 'local' (a fresh local Ray: never a cluster someone else started on this machine)."""
    if address == "":
        return environ.get("RAY_ADDRESS", "") or "local"
    return address


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Raise ConnectionError when nothing accepts a connection at a 'host:port' or
    'ray://host:port' address ('auto' is left to Ray)."""
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        if address == "auto":
            return
        raise ConnectionError(f"{address!r} is not 'host:port', 'ray://host:port', 'auto' or 'local'")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConnectionError(f"nothing accepts connections at {hostport} ({e})") from None


WILDCARD_HOSTS = ("0.0.0.0", "::")


def advertised(url: str, node_address: str) -> str:
    """An engine bound to every interface is reached at its node's address."""
    parts = urlsplit(url)
    if parts.hostname in WILDCARD_HOSTS and node_address:
        host = f"[{node_address}]" if ":" in node_address else node_address  # IPv6
        return urlunsplit(parts._replace(netloc=f"{host}:{parts.port}"))
    return url
