"""WeightSender: the trainer side of a weight update (docs/facts.md; as slime does it).

Sequence for every method: [stage weights] -> pause(mode) -> flush_cache -> update -> continue,
with the new policy version sent along, so engines stamp it on every token generated afterwards.
Under `pause_mode: in_place` there is no flush: the paused requests keep their KV cache, and
SGLang (and the built-in engine) refuse a flush while any does (400; sglang
srt/managers/scheduler.py `flush_cache` needs the scheduler idle), so the updates are sent with
`flush_cache: false` too. The cache computed by the old weights is kept: that is in_place's
trade (no recomputation), and each token still carries the version that produced it.

- disk: the HF weights are written as a safetensors folder (before pausing, so engines keep
  generating meanwhile), then each engine loads it with /update_weights_from_disk.
- tensor (in memory): for engines on the trainer rank's own device, or its node's CPU: per bucket
  one /update_weights_from_tensor carrying handles to the trainer's CUDA memory or to a shared-
  memory copy (train/weight_sync/in_memory.py); the engine maps the same memory.
- distributed: a process group trainer(rank 0) + every TP rank of every engine is formed once per
  set of engines (/init_weights_update_group, joined concurrently by the trainer). SGLang joins
  TP rank r of an engine as `rank_offset + r`, so engine i gets rank_offset 1 + the TP sizes of
  engines 0..i-1 (each engine's TP size read from its /server_info) and the world is 1 + them all. Each update is
  /begin_weight_update, then per bucket one /update_weights_from_distributed per engine (names,
  dtypes, shapes) while the trainer broadcasts the bucket's tensors one by one from rank 0, then
  /end_weight_update. gloo on CPU, NCCL when the tensors are on a GPU.

Colocated (sleep and wake): `release(engines)` puts idle engines to sleep (SGLang's
/release_memory_occupation, every tag: KV cache, weights, CUDA graphs). An update that meets a
sleeping engine wakes it in stages instead of pausing it, as verl does, so the GPU never holds
both the old and the new allocation: resume its weights' memory, send the update (no flush:
its KV cache is gone), `after_send()` (the trainer frees its own copy), then resume the KV
cache and CUDA graphs. The sender remembers how far each engine has woken, so an update sent
again after a failure (to the engines left) does not resume what is already back: SGLang fails
a resume of memory that is not released.

If an update fails half-way the engines are left paused (continuing would serve a mix of two
weight versions) and WeightSyncError says which engine failed at which step.
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

from rlkit.buffers.control_token import is_loopback
from rlkit.train.weight_sync.engine_control import EngineControl, EngineControlError, HttpEngineControl
from rlkit.train.weight_sync.group import join_weight_group, leave_weight_group
from rlkit.train.weight_sync.topology import Place, TopologyError, plan_weight_sync, rank_offsets

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightSyncError(RuntimeError):
    """A weight update did not complete; the message names the engine and the step."""


@dataclass
class SyncReport:
    method: str
    version: int
    engines: int
    tensors: int = 0
    bytes: int = 0
    buckets: int = 0
    seconds_total: float = 0.0
    seconds_paused: float = 0.0  # from pause to continue: what generation loses
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
    """Pushes weights to a set of engines. One per trainer process (it holds the group)."""

    def __init__(
        self,
        *,
        bucket_mb: int = 256,
        pause_mode: str = "abort",
        timeout_s: float = 600.0,
        master_address: str | None = None,
        control_factory: Callable[[str], EngineControl] | None = None,
    ) -> None:
        self.bucket_bytes = bucket_mb * 1024 * 1024
        self.pause_mode = pause_mode
        self.timeout_s = timeout_s
        # where the group's store listens; None: toward the engines (address_toward)
        self.master_address = master_address
        self._control_factory = control_factory or (lambda url: HttpEngineControl(url, timeout_s))
        self._group: dist.ProcessGroup | None = None
        self._group_name = ""
        self._group_engines: tuple[str, ...] = ()
        self._group_backend = ""
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="weight-sync")
        # Engines put to sleep by `release`, by URL: "asleep" (every tag released) or "weights"
        # (weights resumed by an update that then failed; KV cache still released).
        self.sleeping: dict[str, str] = {}

    @property
    def flushes(self) -> bool:
        """Whether an update flushes the engines' cache: always, except under in_place (above)."""
        return self.pause_mode != "in_place"

    # -- helpers -------------------------------------------------------------------------------
    def _controls(self, engines: Sequence[str]) -> list[EngineControl]:
        if not engines:
            raise WeightSyncError("no engines to update")
        return [self._control_factory(u) for u in engines]

    def _on_all(self, controls: Sequence[EngineControl], step: str, call: Callable[[EngineControl], Any]) -> list:
        """`call` on every engine at once; their answers, in order."""
        return self._wait([(c, self._pool.submit(call, c)) for c in controls], step)

    def _wait(self, futures: Sequence[tuple[EngineControl, Future]], step: str,
              done: Callable[[EngineControl, Any], None] | None = None) -> list:
        """Wait for every engine's call; raise naming each engine that failed. `done(control,
        answer)` is called for each that succeeded, also when others failed."""
        errors, answers = [], []
        for c, f in futures:
            try:
                answers.append(f.result(timeout=self.timeout_s))
            except Exception as e:  # noqa: BLE001 - reported with the engine and step
                errors.append(f"{c.url}: {e}")
            else:
                if done is not None:
                    done(c, answers[-1])
        if errors:
            raise WeightSyncError(f"{step} failed on {len(errors)} engine(s): " + "; ".join(errors))
        return answers

    # -- disk ----------------------------------------------------------------------------------
    def sync_from_disk(
        self,
        engines: Sequence[str],
        folder: str | Path,
        version: int,
        *,
        write: Callable[[Path], None],
        keep_previous: bool = False,
        after_send: Callable[[], None] | None = None,
    ) -> SyncReport:
        """`write(path)` writes the HF folder; engines then load it. The previous folder written
        by this sender is deleted after a successful update unless `keep_previous`.
        `after_send`: called once the engines hold the new weights (module docstring)."""
        controls = self._controls(engines)
        t0 = time.perf_counter()
        path = Path(folder)
        if path.exists():
            shutil.rmtree(path)
        write(path)
        nbytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        t_staged = time.perf_counter()
        self._open(controls)
        t_paused = time.perf_counter()
        self._on_all(
            controls, "update_weights_from_disk",
            lambda c: c.update_from_disk(str(path.resolve()), version,
                                         flush_cache=self.flushes and c.url not in self.sleeping),
        )
        if after_send is not None:
            after_send()
        self._close(controls)
        t_end = time.perf_counter()
        previous = getattr(self, "_last_disk_folder", None)
        if previous is not None and previous != path and not keep_previous and previous.exists():
            shutil.rmtree(previous, ignore_errors=True)
        self._last_disk_folder = path
        return SyncReport(
            method="disk",
            version=version,
            engines=len(controls),
            bytes=nbytes,
            seconds_total=t_end - t0,
            seconds_paused=t_end - t_paused,
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

        controls = self._controls(engines)
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
        controls = self._controls(engines)
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
        controls = [self._control_factory(u) for u in self._group_engines]
        try:
            self._on_all(controls, "destroy_weights_update_group", lambda c: c.destroy_group(self._group_name))
        except WeightSyncError:
            pass  # engines that are gone cannot be told; the group is torn down on our side anyway
        finally:
            leave_weight_group(self._group)
            self._group, self._group_name, self._group_engines = None, "", ()

    def sync_distributed(self, engines: Sequence[str], tensors: NamedTensors, version: int,
                         after_send: Callable[[], None] | None = None) -> SyncReport:
        """Broadcast `tensors` (HF names, full tensors) to the engines in buckets."""
        def form_group(controls: list[EngineControl], first: torch.Tensor) -> float:
            return self.connect(engines, "nccl" if first.is_cuda else "gloo")

        return self._push("distributed", engines, tensors, version, form_group,
                          lambda controls, buckets, report: self._broadcast(controls, buckets, version, report),
                          after_send)

    def sync_in_memory(self, engines: Sequence[str], tensors: NamedTensors, version: int,
                       after_send: Callable[[], None] | None = None) -> SyncReport:
        """Weights in memory to engines on this process's device (CUDA IPC) or node's CPU
        (shared memory), bucket by bucket; an engine elsewhere refuses the handles, naming
        `distributed` and `disk` instead."""
        from rlkit.train.weight_sync.in_memory import push_in_memory
        from rlkit.train.weight_sync.topology import EnginePlan

        plans: list[EnginePlan] = []

        def plan(controls: list[EngineControl], first: torch.Tensor) -> float:
            t0 = time.perf_counter()
            memory = "cuda_ipc" if first.is_cuda else "shared_memory"
            sizes = self._on_all(controls, "server_info (tp_size)", lambda c: c.tp_size())
            plans.extend(EnginePlan(i, "tensor", n, memory=memory) for i, n in enumerate(sizes))
            return time.perf_counter() - t0

        def send(controls: list[EngineControl], buckets, report: SyncReport) -> None:
            stats = push_in_memory(list(zip(controls, plans)), buckets, version,
                                   submit=self._pool.submit, wait=self._wait)
            report.buckets, report.tensors, report.bytes = stats.buckets, stats.tensors, stats.bytes
            report.extra["memory"] = plans[0].memory

        return self._push("tensor", engines, tensors, version, plan, send, after_send)

    def _push(self, method: str, engines: Sequence[str], tensors: NamedTensors, version: int,
              stage: Callable[[list[EngineControl], torch.Tensor], float],
              send: Callable[[list[EngineControl], Iterator[list[tuple[str, torch.Tensor]]], SyncReport], None],
              after_send: Callable[[], None] | None = None,
              ) -> SyncReport:
        """The broadcast and in-memory paths: `stage` (given the first tensor: form the group,
        or read the TP sizes; its seconds), pause and flush (or wake), then `send` the buckets
        inside an update session, `after_send()`, continue (or resume the KV cache)."""
        controls = self._controls(engines)
        it = iter(tensors)
        first = next(it, None)
        if first is None:
            raise WeightSyncError("no tensors to send")
        t0 = time.perf_counter()
        report = SyncReport(method=method, version=version, engines=len(controls))
        report.seconds_stage = stage(controls, first[1])
        self._open(controls)
        t_paused = time.perf_counter()
        buckets = bucketize(itertools.chain([first], it), self.bucket_bytes)
        self._in_session(controls, lambda: send(controls, buckets, report))
        if after_send is not None:
            after_send()
        self._close(controls)
        t_end = time.perf_counter()
        report.seconds_total = t_end - t0
        report.seconds_paused = t_end - t_paused
        return report

    # -- around an update: pause or wake, continue or finish waking -----------------------
    def _open(self, controls: Sequence[EngineControl]) -> None:
        """Before an update: the awake engines pause (and flush, unless in_place); the sleeping
        ones take their weights' memory back, nothing else (their KV cache comes back after)."""
        awake = [c for c in controls if c.url not in self.sleeping]
        if awake:
            self._on_all(awake, "pause_generation", lambda c: c.pause(self.pause_mode))
            if self.flushes:
                self._on_all(awake, "flush_cache", lambda c: c.flush_cache())
        asleep = [c for c in controls if self.sleeping.get(c.url) == "asleep"]
        if asleep:
            self._wait([(c, self._pool.submit(c.resume_memory, ["weights"])) for c in asleep],
                       "resume_memory_occupation (weights)",
                       done=lambda c, _: self.sleeping.__setitem__(c.url, "weights"))

    def _close(self, controls: Sequence[EngineControl]) -> None:
        """After an update: the woken engines take their KV cache (and CUDA graphs) back; the
        others continue."""
        woken = [c for c in controls if c.url in self.sleeping]
        if woken:
            self._wait([(c, self._pool.submit(c.resume_memory, ["kv_cache", "cuda_graph"]))
                        for c in woken], "resume_memory_occupation (kv_cache, cuda_graph)",
                       done=lambda c, _: self.sleeping.pop(c.url, None))
        awake = [c for c in controls if c not in woken]
        if awake:
            self._on_all(awake, "continue_generation", lambda c: c.continue_generation())

    # -- sleep ------------------------------------------------------------------------------
    def release(self, engines: Sequence[str]) -> dict[str, float]:
        """Colocated: put these idle engines to sleep, releasing every tag (KV cache, weights,
        CUDA graphs); the next update wakes them. An engine already asleep is left as it is.
        Those that succeed are recorded asleep even when another fails (WeightSyncError
        naming it). Returns the bytes the engines report freed (the built-in engine reports
        them; SGLang answers with no body: 0) and the seconds taken."""
        t0 = time.perf_counter()
        todo = [c for c in self._controls(engines) if c.url not in self.sleeping]
        freed = 0

        def asleep(c: EngineControl, answer: dict) -> None:
            nonlocal freed
            self.sleeping[c.url] = "asleep"
            freed += sum(int(v) for v in (answer.get("freed_bytes") or {}).values())

        self._wait([(c, self._pool.submit(c.release_memory, None)) for c in todo],
                   "release_memory_occupation", done=asleep)
        return {"colocate/engine_freed_bytes": float(freed), "colocate/engines_slept": float(len(todo)),
                "colocate/engine_release_seconds": time.perf_counter() - t0}

    def forget(self, engines: Sequence[str]) -> None:
        """These engines are gone (a restarted one comes back awake): forget their sleep."""
        for url in engines:
            self.sleeping.pop(url, None)

    def _in_session(self, controls: Sequence[EngineControl], send: Callable[[], None]) -> None:
        """begin_weight_update, `send()`, end_weight_update on every engine. On failure the
        update session is closed wherever one opened (the engines stay paused): the sync sent
        again to the engines left (Run.push_weights) must be able to begin."""
        try:
            self._on_all(controls, "begin_weight_update", lambda c: c.begin_update())
            send()
        except WeightSyncError:
            for c in controls:
                try:
                    c.end_update()
                except Exception:  # noqa: BLE001 - a dead engine cannot be told; others may refuse
                    pass
            raise
        self._on_all(controls, "end_weight_update", lambda c: c.end_update())

    def _broadcast(self, controls: Sequence[EngineControl],
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
