"""WeightSender: the trainer's half of a weight update: it publishes the current weights into
an update the rollout side opened (rlkit.common.weight_update; rollout/engine_updates.py pauses,
flushes, wakes and continues the engines: the trainer never changes an engine's state). With the
version of the update, so engines stamp it on every token generated afterwards.

- disk: the HF weights are written as a safetensors folder, then each engine loads it with
  /update_weights_from_disk (flushing its cache unless the update says not to: an engine woken
  from sleep has none, and under pause_mode in_place the paused requests keep theirs).
- tensor (in memory): for engines on the trainer rank's own device, or its node's CPU: per bucket
  one /update_weights_from_tensor carrying handles to the trainer's CUDA memory or to a shared-
  memory copy (train/weight_sync/in_memory.py); the engine maps the same memory.
- distributed: a process group trainer(rank 0) + every TP rank of every engine is formed once per
  set of engines (/init_weights_update_group, joined concurrently by the trainer). SGLang joins
  TP rank r of an engine as `rank_offset + r`, so engine i gets rank_offset 1 + the TP sizes of
  engines 0..i-1 (each engine's TP size read from its /server_info) and the world is 1 + them
  all. Per bucket one /update_weights_from_distributed per engine (names, dtypes, shapes) while
  the trainer broadcasts the bucket's tensors one by one from rank 0. gloo on CPU, NCCL when the
  tensors are on a GPU.

A publish that fails raises WeightSyncError naming the engine and the step; the rollout side
then leaves the engines paused and sends the update again to the engines left.
"""

from __future__ import annotations

import itertools
import shutil
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from rlkit.common.control_token import is_loopback
from rlkit.common.engine_http import EngineControlError, EngineWeights, HttpEngine, WeightSyncError, fan_out, wait_all
from rlkit.common.weight_update import WeightUpdate
from rlkit.train.weight_sync.group import join_weight_group, leave_weight_group
from rlkit.train.weight_sync.topology import Place, TopologyError, plan_weight_sync, rank_offsets

NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclass
class SyncReport:
    method: str
    version: int
    engines: int
    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    seconds_total: float = 0.0
    seconds_paused: float = 0.0  # sending into the open update (the engines wait, paused)
    seconds_stage: float = 0.0  # writing files (disk) or forming the group (distributed, first time)
    extra: dict = field(default_factory=dict)

    @property
    def seconds_per_gb(self) -> float:
        return self.seconds_total / (self.bytes / 1e9) if self.bytes else 0.0


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def bucketize(tensors: NamedTensors, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most `bucket_bytes` (a larger tensor is alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def address_toward(engines: Sequence[str]) -> str:
    """This process's address as the engines at these URLs reach it, for the store the group
    meets at: 127.0.0.1 when every engine is on loopback (the store is then reachable from
    nowhere else), else the source address of the route to the first other one (a UDP connect
    sends nothing), the node's address on the network the engines are on."""
    import socket
    from urllib.parse import urlsplit

    away = [(u.hostname, u.port or 80) for u in map(urlsplit, engines) if not is_loopback(u.hostname or "")]
    if not away:
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in away[0][0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(away[0])
        return s.getsockname()[0]


@dataclass(frozen=True)
class NcclCheck:
    """WeightSender.nccl_conflict's answer: why the group would put two ranks on one GPU (None:
    it would not, as far as could be checked), and the engines that report no GPU."""

    clash: str | None
    unchecked: tuple[str, ...] = ()


class WeightSender:
    """Publishes weights into open updates. One per trainer process (it holds the group)."""

    def __init__(
        self,
        *,
        bucket_mb: int = 256,
        timeout_s: float = 600.0,
        master_address: str | None = None,
        engine_factory: Callable[[str], EngineWeights] | None = None,
    ) -> None:
        self.bucket_bytes = bucket_mb * 1024 * 1024
        self.timeout_s = timeout_s
        # where the group's store listens; None: toward the engines (address_toward)
        self.master_address = master_address
        self._engine_factory = engine_factory or (lambda url: HttpEngine(url, timeout_s))
        self._group: dist.ProcessGroup | None = None
        self._group_name = ""
        self._group_engines: tuple[str, ...] = ()
        self._group_backend = ""
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="weight-sync")

    # -- helpers -------------------------------------------------------------------------------
    def _engines(self, engines: Sequence[str]) -> list[EngineWeights]:
        if not engines:
            raise WeightSyncError("no engines to update")
        return [self._engine_factory(u) for u in engines]

    def _on_all(self, engines: Sequence[EngineWeights], step: str, call: Callable[[EngineWeights], Any]) -> list:
        """`call` on every engine at once; their answers, in order."""
        return fan_out(self._pool, engines, step, call, self.timeout_s)

    def _wait(self, futures: Sequence[tuple[EngineWeights, Future]], step: str, done=None) -> list:
        return wait_all(futures, step, self.timeout_s, done)

    def publish(self, update: WeightUpdate, weights: NamedTensors, *,
                write: Callable[[Path, NamedTensors], None] | None = None,
                method: str | None = None, after_send: Callable[[], None] | None = None) -> SyncReport:
        """`weights` into the open `update`, by `method` (default the update's; the trainer
        may fall back to disk). Disk writes `write(folder, weights)` under the update's folder.
        `after_send`: called once the engines hold the new weights (colocated: the trainer
        frees its copy before the engines take their KV cache back)."""
        method = method or update.method
        if method == "disk":
            if write is None or update.folder is None:
                raise WeightSyncError("a disk update needs a folder to write to (the rollout side "
                                      "names one in a run; elsewhere set train.weight_sync.disk_dir)")
            return self.sync_from_disk(update, Path(update.folder) / f"v{update.version:06d}",
                                       write=lambda p: write(p, weights), after_send=after_send)
        if method == "tensor":
            return self.sync_in_memory(update, weights, after_send=after_send)
        if method == "distributed":
            return self.sync_distributed(update, weights, after_send=after_send)
        raise WeightSyncError(f"unknown weight sync method {method!r}")

    # -- LoRA adapters ---------------------------------------------------------------------------
    def publish_adapter(self, update: WeightUpdate, tensors: NamedTensors, config: dict, *,
                        method: str, write: Callable[[Path], None] | None = None) -> SyncReport:
        """The LoRA adapter alone (PEFT names and `config`), loaded on every engine of `update`
        as `update.adapter`: in memory (method 'tensor': one bucket of handles, SGLang's
        /load_lora_adapter_from_tensors) or as a PEFT folder `write(path)` writes under the
        update's folder (any other method: /load_lora_adapter). The base weights stay."""
        name = update.adapter
        if name is None:
            raise WeightSyncError("publish_adapter: the update names no adapter")
        engines = self._engines(update.engines)
        named = [(n, t.detach()) for n, t in tensors]
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        t0 = time.perf_counter()
        report = SyncReport(method=f"adapter-{method}", version=update.version,
                            engines=len(engines), tensors=len(named), bytes=nbytes, buckets=1)
        if method == "tensor":
            from rlkit.train.weight_sync.in_memory import stage_bucket

            staged = stage_bucket(named, "cuda_ipc" if named and named[0][1].is_cuda else "shared_memory")
            try:
                sizes = self._on_all(engines, "server_info (tp_size)", lambda e: e.tp_size())
                bodies = [{"lora_name": name, "config_dict": config, "load_format": None,
                           "serialized_named_tensors": staged.body(tp_size=n, version=None)[
                               "serialized_named_tensors"]} for n in sizes]
                report.seconds_stage = time.perf_counter() - t0
                t_sent = time.perf_counter()
                self._wait([(e, self._pool.submit(e.load_lora_from_tensors, b))
                            for e, b in zip(engines, bodies)], "load_lora_adapter_from_tensors")
            finally:
                staged.release()
        else:
            if write is None or update.folder is None:
                raise WeightSyncError("an adapter update by disk needs a folder (the rollout side "
                                      "names one in a run; elsewhere set train.weight_sync.disk_dir)")
            path = Path(update.folder) / name.replace("@", "-")
            if path.exists():
                shutil.rmtree(path)
            write(path)
            report.seconds_stage = time.perf_counter() - t0
            t_sent = time.perf_counter()
            self._on_all(engines, "load_lora_adapter",
                         lambda e: e.load_lora(name, str(path.resolve())))
            # the engines hold it in memory now; the folder before last goes (the last stays
            # for an engine restarted before the next update)
            self._adapter_folders = [*getattr(self, "_adapter_folders", []), path][-2:]
            for old in Path(update.folder).glob("policy-v*"):
                if old not in self._adapter_folders:
                    shutil.rmtree(old, ignore_errors=True)
        t_end = time.perf_counter()
        report.seconds_total, report.seconds_paused = t_end - t0, t_end - t_sent
        return report

    # -- disk ----------------------------------------------------------------------------------
    def sync_from_disk(
        self,
        update: WeightUpdate,
        folder: str | Path,
        *,
        write: Callable[[Path], None],
        keep_previous: bool = False,
        after_send: Callable[[], None] | None = None,
    ) -> SyncReport:
        """`write(path)` writes the HF folder; the update's engines then load it. The previous
        folder written by this sender is deleted after a successful update unless `keep_previous`."""
        engines = self._engines(update.engines)
        t0 = time.perf_counter()
        path = Path(folder)
        if path.exists():
            shutil.rmtree(path)
        write(path)
        nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        t_staged = time.perf_counter()
        self._on_all(
            engines, "update_weights_from_disk",
            lambda e: e.update_from_disk(str(path.resolve()), update.version,
                                         flush_cache=update.flushes(e.url)),
        )
        if after_send is not None:
            after_send()
        t_end = time.perf_counter()
        previous = getattr(self, "_last_disk_folder", None)
        if previous is not None and previous != path and not keep_previous and previous.exists():
            shutil.rmtree(previous, ignore_errors=True)
        self._last_disk_folder = path
        return SyncReport(
            method="disk",
            version=update.version,
            engines=len(engines),
            bytes=nbytes,
            seconds_total=t_end - t0,
            seconds_paused=t_end - t_staged,
            seconds_stage=t_staged - t0,
        )

    # -- distributed -------------------------------------------------------------------------
    def connect(self, engines: Sequence[str], backend: str) -> float:
        """Form the broadcast group with these engines (no-op if already formed). Seconds taken."""
        key = tuple(engines)
        if self._group is not None and self._group_engines == key and self._group_backend == backend:
            return 0.0
        self.disconnect()
        from rlkit.train.megatron.parallel import free_port

        controls = self._engines(engines)
        t0 = time.perf_counter()
        master = self.master_address or address_toward(engines)
        port = free_port(master)
        name = f"rlkit-weights-{uuid.uuid4().hex[:8]}"
        offsets, world = rank_offsets(self._on_all(controls, "server_info (tp_size)", lambda c: c.tp_size()))
        futures = [
            (c, self._pool.submit(c.init_group, master, port, offset, world, name, backend))
            for c, offset in zip(controls, offsets)
        ]
        # Join in a thread so that an engine whose init call fails is reported at once instead of
        # after the rendezvous timeout (the abandoned join then times out on its own).
        joined: dict[str, object] = {}

        def join() -> None:
            try:
                joined["group"] = join_weight_group(
                    backend=backend,
                    master_address=master,
                    master_port=port,
                    world_size=world,
                    rank=0,
                    group_name=name,
                    timeout_s=self.timeout_s,
                )
            except Exception as e:  # noqa: BLE001 - reported below
                joined["error"] = e

        joiner = threading.Thread(target=join, name="weight-group-join", daemon=True)
        joiner.start()
        while joiner.is_alive():
            joiner.join(0.05)
            failed = [f"{c.url}: {f.exception()}" for c, f in futures if f.done() and f.exception()]
            if failed:
                raise WeightSyncError(
                    f"forming the weight-update group {name}: init_weights_update_group failed on "
                    + "; ".join(failed)
                )
        if "error" in joined:
            raise WeightSyncError(
                f"forming the weight-update group {name} with {len(controls)} engine(s) failed: "
                f"{joined['error']}"
            ) from joined["error"]  # type: ignore[misc]
        group = joined["group"]  # type: ignore[assignment]
        for c, f in futures:
            try:
                f.result(timeout=self.timeout_s)
            except Exception as e:  # noqa: BLE001
                leave_weight_group(group)
                raise WeightSyncError(f"{c.url}: init_weights_update_group failed: {e}") from e
        self._group, self._group_name, self._group_engines, self._group_backend = group, name, key, backend
        return time.perf_counter() - t0

    def nccl_conflict(self, engines: Sequence[str], trainer_gpu: str) -> "NcclCheck":
        """Whether an NCCL broadcast group with these engines would put two ranks on one GPU
        (NCCL refuses: "Duplicate GPU detected"). GPUs are compared by UUID: the trainer rank's
        and those the engines report in /server_info (`gpu_uuids`: the built-in engine does;
        SGLang reports none, nor anything that names a physical device: its `base_gpu_id`
        counts within the CUDA_VISIBLE_DEVICES it was started with, which it does not report).
        An engine that reports none cannot be checked: it is counted apart, on a GPU of its
        own, and named in `unchecked`. The rule is train/weight_sync/topology.py's."""
        controls = self._engines(engines)
        ids = self._on_all(controls, "server_info (gpu_uuids)", lambda c: c.gpu_ids())
        sizes = self._on_all(controls, "server_info (tp_size)", lambda c: c.tp_size())
        here = "node"  # UUIDs are unique across nodes: one name for every node will do
        ranks = [[Place(here, gid) for gid in gids] if gids
                 else [Place(here, f"unknown-{i}-{r}") for r in range(n)]
                 for i, (gids, n) in enumerate(zip(ids, sizes))]
        plan = plan_weight_sync(Place(here, trainer_gpu), ranks, method="distributed")
        clash = [f"{controls[e.index].url} ({e.reason})" for e in plan.engines if e.method == "disk"]
        return NcclCheck("; ".join(clash) or None, tuple(c.url for c, gids in zip(controls, ids) if not gids))

    def disconnect(self) -> None:
        if self._group is None:
            return
        controls = [self._engine_factory(u) for u in self._group_engines]
        try:
            self._on_all(controls, "destroy_weights_update_group", lambda c: c.destroy_group(self._group_name))
        except WeightSyncError:
            pass  # engines that are gone cannot be told; the group is torn down on our side anyway
        finally:
            leave_weight_group(self._group)
            self._group, self._group_name, self._group_engines = None, "", ()

    def sync_distributed(self, update: WeightUpdate, tensors: NamedTensors,
                         after_send: Callable[[], None] | None = None) -> SyncReport:
        """Broadcast `tensors` (HF names, full tensors) to the update's engines in buckets."""
        def form_group(engines: list[EngineWeights], first: torch.Tensor) -> float:
            return self.connect(update.engines, "nccl" if first.is_cuda else "gloo")

        return self._push("distributed", update, tensors, form_group,
                          lambda engines, buckets, report: self._broadcast(engines, buckets, update.version, report),
                          after_send)

    def sync_in_memory(self, update: WeightUpdate, tensors: NamedTensors,
                       after_send: Callable[[], None] | None = None) -> SyncReport:
        """Weights in memory to engines on this process's device (CUDA IPC) or node's CPU
        (shared memory), bucket by bucket; an engine elsewhere refuses the handles, naming
        `distributed` and `disk` instead."""
        from rlkit.train.weight_sync.in_memory import push_in_memory
        from rlkit.train.weight_sync.topology import EnginePlan

        plans: list[EnginePlan] = []

        def plan(engines: list[EngineWeights], first: torch.Tensor) -> float:
            t0 = time.perf_counter()
            memory = "cuda_ipc" if first.is_cuda else "shared_memory"
            sizes = self._on_all(engines, "server_info (tp_size)", lambda e: e.tp_size())
            plans.extend(EnginePlan(i, "tensor", n, memory=memory) for i, n in enumerate(sizes))
            return time.perf_counter() - t0

        def send(engines: list[EngineWeights], buckets, report: SyncReport) -> None:
            stats = push_in_memory(list(zip(engines, plans)), buckets, update.version,
                                   submit=self._pool.submit, wait=self._wait)
            report.buckets, report.tensors, report.bytes = stats.buckets, stats.tensors, stats.bytes
            report.extra["memory"] = plans[0].memory

        return self._push("tensor", update, tensors, plan, send, after_send)

    def _push(self, method: str, update: WeightUpdate, tensors: NamedTensors,
              stage: Callable[[list[EngineWeights], torch.Tensor], float],
              send: Callable[[list[EngineWeights], Iterator[list[tuple[str, torch.Tensor]]], SyncReport], None],
              after_send: Callable[[], None] | None = None,
              ) -> SyncReport:
        """The broadcast and in-memory paths: `stage` (given the first tensor: form the group,
        or read the TP sizes; its seconds), then `send` the buckets, `after_send()`."""
        engines = self._engines(update.engines)
        it = iter(tensors)
        first = next(it, None)
        if first is None:
            raise WeightSyncError("no tensors to send")
        t0 = time.perf_counter()
        report = SyncReport(method=method, version=update.version, engines=len(engines))
        report.seconds_stage = stage(engines, first[1])
        t_sent = time.perf_counter()
        send(engines, bucketize(itertools.chain([first], it), self.bucket_bytes), report)
        if after_send is not None:
            after_send()
        t_end = time.perf_counter()
        report.seconds_total = t_end - t0
        report.seconds_paused = t_end - t_sent
        return report

    def _broadcast(self, controls: Sequence[EngineWeights],
                   buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int,
                   report: SyncReport) -> None:
        """Per bucket: announce it to every engine, and broadcast its tensors from rank 0."""
        for bucket in buckets:
            names = [n for n, _ in bucket]
            dtypes = [dtype_name(t.dtype) for _, t in bucket]
            shapes = [list(t.shape) for _, t in bucket]
            futures = [
                (c, self._pool.submit(c.update_from_distributed, names, dtypes, shapes, self._group_name, version))
                for c in controls
            ]
            try:
                for _, t in bucket:
                    dist.broadcast(t.contiguous(), src=0, group=self._group)
            except Exception as e:
                raise WeightSyncError(f"broadcast of bucket {report.buckets} ({names[0]}...) failed: {e}") from e
            self._wait(futures, f"update_weights_from_distributed of bucket {report.buckets}")
            report.buckets += 1
            report.tensors += len(bucket)
            report.bytes += sum(t.numel() * t.element_size() for _, t in bucket)

    def close(self) -> None:
        self.disconnect()
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["WeightSender", "SyncReport", "WeightSyncError", "bucketize", "EngineControlError",
           "TopologyError", "rank_offsets"]
