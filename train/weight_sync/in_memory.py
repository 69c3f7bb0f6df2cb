"""Weights in memory, sender side: SGLang's `/update_weights_from_tensor` for an engine that runs on
the trainer rank's own device (CUDA IPC) or on its node's CPU (shared memory). Only handles go
over HTTP; the engine maps the same GPU memory or the same shared-memory pages and copies from
them into its model.

The wire format is SGLang 0.5.23's (srt/managers/io_struct.py `UpdateWeightsFromTensorReqInput`,
srt/utils/common.py `MultiprocessingSerializer`): `serialized_named_tensors` holds one entry per
TP rank of the engine, each a pickle of `[(hf_name, tensor), ...]` made with torch.multiprocessing's
reductions (a tensor becomes a handle, not data), base64-encoded for JSON; TP rank r opens entry r
only (srt/managers/tp_worker.py `deserialize_own_rank`), so each entry is pickled on its own: every
pickling takes a reference the receiver gives back. rlkit's pickler differs from a plain
ForkingPickler in two ways, both still read by SGLang's restricted unpickler:

- a CUDA tensor's device is written as the GPU's UUID, not its index (as SGLang's own
  `monkey_patch_torch_reductions` does, srt/utils/patch_torch.py): under Ray every process sees
  its GPU as index 0, the UUID names the same GPU in every process;
- a CPU tensor is shared by file name (torch's `file_system` strategy, `rebuild_storage_filename`)
  whatever the process's global sharing strategy, so an engine that is no child of the trainer
  can open it (a file-descriptor handle can be opened only by a child of the sender).

CPU weights are staged per bucket into one fresh shared-memory buffer (the caller's tensors are
never moved into shared memory behind its back); CUDA tensors are shared as they are. A bucket's
buffers are kept alive until every engine answered for it, so at most one bucket is in flight, as
on the broadcast path (`bucketize`, train/weight_sync/sender.py). Each pickled entry holds one
reference on its shared-memory segment that the engine gives back when it opens the entry (torch's
file_system protocol); an engine that fails before opening it leaves the segment in /dev/shm until
the trainer process exits (torch's shm manager removes it then).
"""

from __future__ import annotations

import base64
import inspect
import io
import pickle
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, Sequence

import torch
from torch.multiprocessing import reductions

from rlkit.train.weight_sync.topology import EnginePlan

Memory = Literal["cuda_ipc", "shared_memory"]
ALIGN = 64  # bytes: every tensor of a staged bucket starts at a multiple of this
# where rebuild_cuda_tensor takes the device (SGLang hardcodes 6; read it from torch instead)
_CUDA_DEVICE_ARG = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters).index("storage_device")


class InMemoryError(RuntimeError):
    """Weights that cannot be sent in memory the way asked (the message says why)."""


def gpu_uuid(index: int) -> str:
    """The UUID of this process's GPU `index`, as SGLang writes it (str of the device's uuid)."""
    return str(torch.cuda.get_device_properties(index).uuid)


class _HandlePickler(pickle.Pickler):
    """Pickles tensors as handles to their memory (see the module docstring), nothing else special."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.requires_grad:
                obj = obj.detach()
            fn, args = reductions.reduce_tensor(obj)
            if obj.is_cuda:
                args = list(args)
                args[_CUDA_DEVICE_ARG] = gpu_uuid(args[_CUDA_DEVICE_ARG])
                args = tuple(args)
            return fn, args
        if isinstance(obj, torch.storage.TypedStorage):
            return reductions.rebuild_typed_storage, (obj._untyped_storage, obj.dtype)
        if isinstance(obj, torch.UntypedStorage):
            if obj.device.type != "cpu":
                raise InMemoryError(f"cannot share a {obj.device} storage by itself; send the tensor")
            if obj.nbytes() == 0:
                return reductions.rebuild_storage_empty, (type(obj),)
            manager, handle, size = obj._share_filename_cpu_()
            obj._shared_incref()  # the receiver's rebuild_storage_filename gives it back
            return reductions.rebuild_storage_filename, (type(obj), manager, handle, size)
        return NotImplemented


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    """One TP rank's entry: the pickle of `[(name, tensor), ...]` as handles (not base64)."""
    buf = io.BytesIO()
    _HandlePickler(buf, protocol=4).dump([(str(n), t) for n, t in named])
    return buf.getvalue()


def _shared_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` in a fresh shared-memory segment opened by file name."""
    storage = torch.UntypedStorage._new_using_filename_cpu(max(nbytes, ALIGN))
    return torch.empty(0, dtype=torch.uint8).set_(storage)


@dataclass
class StagedBucket:
    """One bucket, ready to be sent in memory: `named` are the tensors the handles point at (views
    of one shared-memory buffer, or the caller's CUDA tensors). Keep it until every engine
    answered for it, then `release()`."""

    memory: Memory
    named: list[tuple[str, torch.Tensor]]
    nbytes: int
    _buffer: torch.Tensor | None = field(default=None, repr=False)

    def body(self, *, tp_size: int, version: int | str | None, flush_cache: bool = False,
             abort_all_requests: bool = False, load_format: str | None = None) -> dict[str, Any]:
        """The JSON body of `/update_weights_from_tensor` for an engine of `tp_size` TP ranks
        (sglang 0.5.23 srt/managers/io_struct.py:2027). Each TP rank's entry is pickled on its
        own (each takes its own reference on the shared memory)."""
        if tp_size < 1:
            raise InMemoryError(f"tp_size must be >= 1, got {tp_size}")
        if not self.named:
            raise InMemoryError("the bucket was released")
        return {
            "serialized_named_tensors": [
                base64.b64encode(serialize_named_tensors(self.named)).decode("ascii")
                for _ in range(tp_size)
            ],
            "load_format": load_format,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
            "weight_version": None if version is None else str(version),
        }

    def release(self) -> None:
        self.named, self._buffer = [], None


def stage_bucket(bucket: Sequence[tuple[str, torch.Tensor]], memory: Memory) -> StagedBucket:
    """Make one bucket sendable in memory. cuda_ipc: the tensors must be on a GPU and are shared
    as they are. shared_memory: every tensor (CPU or GPU) is copied into one shared buffer."""
    nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
    if memory == "cuda_ipc":
        off_gpu = [f"{n} ({t.device})" for n, t in bucket if not t.is_cuda]
        if off_gpu:
            raise InMemoryError(f"CUDA IPC needs CUDA tensors, got {off_gpu[:5]} (a CPU trainer "
                                "shares its weights with memory='shared_memory')")
        return StagedBucket(memory, [(n, t.detach()) for n, t in bucket], nbytes)
    if memory != "shared_memory":
        raise InMemoryError(f"memory must be 'cuda_ipc' or 'shared_memory', got {memory!r}")
    offsets, end = [], 0
    for _, t in bucket:
        offsets.append(end)
        end += -(-(t.numel() * t.element_size()) // ALIGN) * ALIGN
    flat = _shared_buffer(end)
    named = []
    with torch.no_grad():
        for (name, t), off in zip(bucket, offsets):
            n = t.numel() * t.element_size()
            view = flat[off : off + n].view(t.dtype).view(t.shape)
            view.copy_(t)
            named.append((name, view))
    return StagedBucket(memory, named, nbytes, flat)


class InMemoryPush:
    """The in-memory half of one weight update, bucket by bucket: each bucket is staged once per
    kind of memory the engines need, each engine gets its body, and the staged buffers live until
    `release()` (call it once every engine answered for the bucket).

    `targets`: (control, plan) of every engine whose plan says `tensor`; a control has
    `update_from_tensor(body)` (POST /update_weights_from_tensor)."""

    def __init__(self, targets: Sequence[tuple[Any, EnginePlan]], version: int, *,
                 flush_cache: bool = False) -> None:
        wrong = [p.index for _, p in targets if p.method != "tensor" or not p.memory]
        if wrong:
            raise InMemoryError(f"engines {wrong} are not planned for in-memory weights")
        self.targets = list(targets)
        self.version = version
        self.flush_cache = flush_cache
        self._live: list[StagedBucket] = []

    def submit(self, bucket: Sequence[tuple[str, torch.Tensor]],
               submit: Callable[..., Future]) -> list[tuple[Any, Future]]:
        """Stage `bucket` and post it to every target through `submit(fn, *args)` (an executor's
        submit); the futures, to wait for before `release()`."""
        self.release()
        staged = {m: stage_bucket(bucket, m) for m in sorted({p.memory for _, p in self.targets})}
        self._live = list(staged.values())
        futures = []
        for control, plan in self.targets:
            body = staged[plan.memory].body(tp_size=plan.tp_size, version=self.version,
                                            flush_cache=self.flush_cache)
            futures.append((control, submit(control.update_from_tensor, body)))
        return futures

    def release(self) -> None:
        for s in self._live:
            s.release()
        self._live = []


@dataclass
class InMemoryStats:
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0


def push_in_memory(
    targets: Sequence[tuple[Any, EnginePlan]],
    buckets: Iterable[Sequence[tuple[str, torch.Tensor]]],
    version: int,
    *,
    submit: Callable[..., Future],
    wait: Callable[[Sequence[tuple[Any, Future]], str], Any],
    flush_cache: bool = False,
) -> InMemoryStats:
    """Send `buckets` of (HF name, tensor) to every target (the sender's `bucketize(tensors,
    bucket_bytes)`), one bucket at a time: stage, post to every engine, `wait(futures, step)`
    (raises naming the engines that failed), release. The update around it is the rollout
    side's (rollout/engine_updates.py)."""
    push = InMemoryPush(targets, version, flush_cache=flush_cache)
    stats = InMemoryStats()
    try:
        for bucket in buckets:
            futures = push.submit(bucket, submit)
            wait(futures, f"update_weights_from_tensor of bucket {stats.buckets} ({bucket[0][0]}...)")
            push.release()
            stats.buckets += 1
            stats.tensors += len(bucket)
            stats.bytes += sum(t.numel() * t.element_size() for _, t in bucket)
    finally:
        push.release()
    return stats


__all__ = ["InMemoryError", "InMemoryPush", "InMemoryStats", "StagedBucket", "gpu_uuid",
           "push_in_memory", "serialize_named_tensors", "stage_bucket"]
