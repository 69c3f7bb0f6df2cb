"""TrainerGroup: TP x DP megatron trainer ranks as Ray actors, driven as one Trainer.

Rank layout follows megatron (TP innermost): global rank g has tp_rank = g % TP and
dp_rank = g // TP. The driver-side group

- plans each batch for every DP replica (train/microbatch_plan.py: samples to replicas by
  compute cost, longest-processing-time first; micro-batches by token budget or count; every
  replica as many, padded with empty ones) and sends every TP rank of a replica the same samples
  with that replica's micro-batches;
- gathers per-sample results from TP rank 0 of each replica and restores the batch order;
- calls `step`, `publish_weights`, `save`, `load`, `export_hf` on every rank (they are collective);
  `publisher()` hands the rollout side what it calls to have the weights published into an
  update it opened (`RayPublisher`).

Normalisation is global (see train/megatron/trainer.py), so how samples are split across DP
replicas does not change the gradient.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Sequence

import torch

from rlkit.common.control_token import CONTROL_TOKEN_ENV
from rlkit.common.errors import actor_death
from rlkit.common.weight_update import PublisherFailed, WeightUpdate
from rlkit.common.memory import release_free_memory
from rlkit.train.fault import trainer_fault
from rlkit.train.batch import TrainBatch
from rlkit.train.config import TrainConfig
from rlkit.train.microbatch_plan import MicroBatchPlan, plan_micro_batches, warn_over_budget


def plan_for_data_parallel(batch: TrainBatch, config: TrainConfig, weight: float) -> MicroBatchPlan:
    """The batch's plan over `config.parallelism.data` replicas (`weight`: the attention term of
    the sample cost, train.megatron.trainer.MegatronTrainer.attention_weight)."""
    return plan_micro_batches(
        [s.length for s in batch.samples], dp_size=config.parallelism.data,
        max_tokens=config.max_tokens_per_micro_batch, micro_batch_size=config.micro_batch_size,
        attention_weight=weight, padded=not config.packing, row_tokens=config.pack_row_tokens,
    )


def replica_batches(batch: TrainBatch, plan: MicroBatchPlan) -> list[tuple[list[int], TrainBatch]]:
    """Per replica: its sample indices in `batch` and its sub-batch carrying its micro-batches."""
    out = []
    for d in range(len(plan.replicas)):
        idx = plan.samples_of(d)
        sub = batch.subset(idx)
        sub.micro_batch_plan = plan.local(d)
        out.append((idx, sub))
    return out


class TrainWorker:
    """One trainer rank inside a Ray actor (wrapped with ray.remote by TrainerGroup)."""

    def __init__(self, rank: int, world_size: int, tp: int, threads: int | None,
                 control_token: str | None = None) -> None:
        if control_token:  # weight sync calls the engines' control endpoints
            os.environ[CONTROL_TOKEN_ENV] = control_token
        self.rank, self.world_size, self.tp = rank, world_size, tp
        if threads:
            torch.set_num_threads(threads)
        self.trainer = None
        self.config: TrainConfig | None = None
        self.batch = None  # the rollout batch being trained (train.stream.RolloutBatchStep)
        self.fault = trainer_fault(rank)  # test-only: None unless a test set its variable

    def master_address(self, loopback: bool = False) -> tuple[str, int]:
        """Where the world's rendezvous store listens (this rank, rank 0, hosts it): loopback
        when every rank is on this node, else the node's address."""
        import ray

        from rlkit.train.megatron.parallel import free_port

        ip = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def setup(self, master: tuple[str, int], model_path: str, config: dict, temperature: float) -> dict:
        from rlkit.train.megatron.parallel import init_parallel, resolve_device
        from rlkit.train.megatron.trainer import MegatronTrainer

        self._fault_at("startup")

        cfg = TrainConfig.model_validate(config)
        device = resolve_device(cfg.device)
        init_parallel(
            rank=self.rank,
            world_size=self.world_size,
            tp=self.tp,
            master_addr=master[0],
            master_port=master[1],
            device=device,
            seed=cfg.seed,
            timeout_s=cfg.weight_sync.timeout_s,
        )
        self.trainer = MegatronTrainer(model_path, cfg, temperature=temperature)
        self.config = cfg
        r = self.trainer.rank
        return {"rank": r.rank, "tp_rank": r.tp_rank, "dp_rank": r.dp_rank, "pid": os.getpid(),
                "attention_weight": self.trainer.attention_weight}

    def logprobs(self, batch: TrainBatch, policy: str) -> list[torch.Tensor] | None:
        out = self.trainer.logprobs(batch, policy=policy)
        return out if self.trainer.rank.tp_rank == 0 else None

    def accumulate(self, batch: TrainBatch) -> dict[str, float]:
        return self.trainer.accumulate(batch)

    def step(self) -> dict[str, float]:
        return self.trainer.step()

    # -- a rollout batch fed group by group (every driver mode) ----------------------------
    def begin_batch(self, version: int, rollout_samples: int, colocated: bool = False) -> dict[str, float]:
        """Colocated, the turn to training: the engines sleep already (the rollout side put
        them to sleep before this call was made), so the state comes back onto the device."""
        from rlkit.train.stream import RolloutBatchStep

        self._fault_at("batch")
        moved = self.trainer.take_device() if colocated else {}
        self.batch = RolloutBatchStep.for_config(
            self.trainer, self.config, policy_version=version, rollout_samples=rollout_samples,
            dp_rank=self.trainer.rank.dp_rank, dp_size=self.config.parallelism.data)
        return moved

    def add_groups(self, refs: list) -> None:
        """Groups (or this replica's shares of them) as object references: fetched here from
        the rollout actor's store."""
        import ray

        self._fault_at("logprobs")
        self.batch.add_all(ray.get(refs))

    def finish_batch(self, colocated: bool = False) -> dict[str, float]:
        """The optimizer step; colocated, gradients and optimizer state then leave the device
        (the engines wake into it at the weight update)."""
        self._fault_at("train")
        batch, self.batch = self.batch, None
        metrics = batch.finish()
        # the step's activations (about 1 GiB for SmolLM2) go back to the system before the
        # weight sync and the rollout, when the engines hold their own peaks (rlkit/common/memory.py)
        release_free_memory()
        return {**metrics, **self.trainer.free_device()} if colocated else metrics

    def publish_weights(self, update: WeightUpdate) -> dict[str, float] | None:
        self._fault_at("sync")
        out = self.trainer.publish_weights(update)
        # the HF tensors built for the engines, freed now, go back too before the rollout (in a
        # thread: nothing here waits for it)
        threading.Thread(target=release_free_memory, name="release-free-memory", daemon=True).start()
        return out

    def free_device(self) -> dict[str, float]:
        return self.trainer.free_device()

    def take_device(self) -> dict[str, float]:
        return self.trainer.take_device()

    def export_hf(self, path: str) -> str | None:
        out = self.trainer.export_hf(path)
        return str(out) if out is not None else None

    def save(self, path: str) -> None:
        self._fault_at("checkpoint")
        self.trainer.save(path)

    def load(self, path: str) -> None:
        self.trainer.load(path)

    def counters(self) -> dict[str, int]:
        return {"step": self.trainer.step_count, "version": self.trainer.version}

    def finalize_grads_for_test(self) -> dict[str, torch.Tensor]:
        return self.trainer.finalize_grads_for_test()

    def discard_gradients(self) -> None:
        self.trainer.discard_gradients()

    def _fault_at(self, phase: str) -> None:
        """Test-only: die here if a test armed this rank for this point (train/fault.py)."""
        if self.fault is not None:
            self.fault.at(phase, self.trainer.step_count if self.trainer is not None else 0)

    def shutdown(self) -> None:
        from rlkit.train.megatron.parallel import shutdown_parallel

        if self.trainer is not None:
            self.trainer.close()
        shutdown_parallel()


class TrainerGroup:
    """The Trainer protocol over TP x DP Ray actors. Ray must be initialised by the caller."""

    def __init__(
        self,
        model_path: str | Path,
        config: TrainConfig,
        *,
        temperature: float = 1.0,
        num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float | None = None,
        threads_per_worker: int | None = None,
        scheduling: Sequence[Any] | None = None,
        control_token: str | None = None,
        loopback: bool = False,
    ) -> None:
        """`scheduling`: one Ray scheduling strategy per rank (rlkit.driver.cluster gives each
        rank its placement-group bundle); None lets Ray place them. `control_token`: the run's
        token for the engines' control endpoints, put in every rank's environment.
        `loopback`: every rank is on this node, so the world meets on 127.0.0.1 and its gloo or
        NCCL sockets bind loopback (train.megatron.parallel.init_parallel)."""
        import ray

        self.config = config
        self.tp = config.parallelism.tensor
        self.dp = config.parallelism.data
        world = self.tp * self.dp
        if num_gpus_per_worker is None:
            wants_gpu = config.device == "cuda" or (
                config.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
            )
            num_gpus_per_worker = 1.0 if wants_gpu else 0.0
        threads = threads_per_worker or max(1, int(num_cpus_per_worker))
        actor_cls = ray.remote(TrainWorker)
        self.workers = []
        if scheduling is not None and len(scheduling) != world:
            raise ValueError(f"scheduling has {len(scheduling)} strategies for {world} ranks")
        for rank in range(world):
            options: dict[str, Any] = {"num_cpus": num_cpus_per_worker, "num_gpus": num_gpus_per_worker}
            if scheduling is not None:
                options["scheduling_strategy"] = scheduling[rank]
            self.workers.append(actor_cls.options(**options).remote(rank, world, self.tp, threads,
                                                                    control_token))
        try:
            master = ray.get(self.workers[0].master_address.remote(loopback))
            self.ranks = ray.get(
                [
                    w.setup.remote(master, str(model_path), config.model_dump(), temperature)
                    for w in self.workers
                ]
            )
        except Exception:
            self.shutdown()
            raise
        # the sample cost's attention term (the model's shape, read where the model is)
        self.attention_weight: float = self.ranks[0]["attention_weight"]

    # -- helpers -------------------------------------------------------------------------------
    def _scatter(self, batch: TrainBatch, method: str, *args: Any) -> tuple[list[list[int]], list[Any]]:
        import ray

        if method == "accumulate":
            warn_over_budget([s.length for s in batch.samples], self.config.max_tokens_per_micro_batch)
        shares = replica_batches(batch, plan_for_data_parallel(batch, self.config, self.attention_weight))
        refs = []
        for d, (_, sub) in enumerate(shares):
            ref = ray.put(sub)
            for t in range(self.tp):
                refs.append(getattr(self.workers[d * self.tp + t], method).remote(ref, *args))
        return [idx for idx, _ in shares], refs

    def _all(self, method: str, *args: Any) -> list[Any]:
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    # -- Trainer protocol ------------------------------------------------------------------------
    def logprobs(self, batch: TrainBatch, *, policy: str = "current") -> list[torch.Tensor]:
        import ray

        parts, refs = self._scatter(batch, "logprobs", policy)
        results = ray.get(refs)
        out: list[torch.Tensor | None] = [None] * len(batch)
        for d, idx in enumerate(parts):
            for i, lp in zip(idx, results[d * self.tp]):
                out[i] = lp
        return out  # type: ignore[return-value]

    def accumulate(self, batch: TrainBatch) -> dict[str, float]:
        import ray

        _, refs = self._scatter(batch, "accumulate")
        results = ray.get(refs)
        heads = results[:: self.tp]
        return {k: sum(r[k] for r in heads) for k in heads[0]} if heads else {}

    def step(self) -> dict[str, float]:
        return self._all("step")[0]

    # -- a rollout batch fed group by group: calls return object references at once ---------
    def begin_batch(self, version: int, rollout_samples: int, colocated: bool = False) -> list[Any]:
        return [w.begin_batch.remote(version, rollout_samples, colocated) for w in self.workers]

    def add_groups(self, refs: list[Any]) -> list[Any]:
        """Each rank gets its replica's share of every group (rlkit/driver/handoff.py: per group
        a list of references, one per replica; the TP ranks of a replica fetch the same one), or
        every group (a plain reference: each rank keeps its replica's samples). A rank runs its
        calls in the order they were made."""
        def mine(rank: int) -> list[Any]:
            return [r[rank // self.tp] if isinstance(r, list) else r for r in refs]

        return [w.add_groups.remote(mine(rank)) for rank, w in enumerate(self.workers)]

    def finish_batch(self, colocated: bool = False) -> list[Any]:
        return [w.finish_batch.remote(colocated) for w in self.workers]

    def publish_weights(self, update: WeightUpdate) -> dict[str, float] | None:
        """Every rank publishes into `update` (collective); rank 0's metrics."""
        return self._all("publish_weights", update)[0]

    def free_device(self) -> dict[str, float]:
        return self._all("free_device")[0]

    def take_device(self) -> dict[str, float]:
        return self._all("take_device")[0]

    def publisher(self) -> "RayPublisher":
        """What the rollout side calls to have the weights published into an update it opened
        (it crosses Ray: the ranks' handles)."""
        return RayPublisher(list(self.workers))

    def export_hf(self, path: str | Path) -> Path:
        return Path(self._all("export_hf", str(path))[0])

    def save(self, path: str | Path) -> None:
        self._all("save", str(path))

    def load(self, path: str | Path) -> None:
        self._all("load", str(path))

    @property
    def version(self) -> int:
        import ray

        return ray.get(self.workers[0].counters.remote())["version"]

    @property
    def step_count(self) -> int:
        import ray

        return ray.get(self.workers[0].counters.remote())["step"]

    def shutdown(self, graceful: bool = True) -> None:
        """Every rank leaves its process group (at most 60 s in all: a rank blocked in a
        collective never answers), then its actor goes. Not `graceful` (a process of the run
        died, the state is lost anyway): the actors go at once."""
        import ray

        if graceful:
            calls = [w.shutdown.remote() for w in self.workers]
            ray.wait(calls, num_returns=len(calls), timeout=60)
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - the actor may be dead already
                pass
        self.workers = []


class RayPublisher:
    """The trainer ranks as a WeightPublisher (rlkit.common.weight_update), for the rollout side:
    every rank publishes (the call is collective). A rank that died fails the publish as
    PublisherFailed naming it (an update sent again would not help); an engine that failed
    fails it with the WeightSyncError of rank 0, which sends."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers

    async def publish(self, update: WeightUpdate) -> dict[str, float]:
        import asyncio

        import ray

        futures = [asyncio.wrap_future(w.publish_weights.remote(update).future()) for w in self.workers]
        done, _ = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
        failed = [(rank, f.exception()) for rank, f in enumerate(futures)
                  if f in done and f.exception() is not None]
        if failed:
            rank, error = next(((r, e) for r, e in failed if isinstance(e, ray.exceptions.RayActorError)),
                               failed[0])
            if isinstance(error, ray.exceptions.RayActorError):
                death = actor_death(error)
                raise PublisherFailed(f"trainer rank {rank} died while publishing weights "
                                      f"v{update.version}: {str(error).splitlines()[0][:200]}", rank,
                                      death.reason() if death is not None else None)
            raise error
        return futures[0].result() or {}
