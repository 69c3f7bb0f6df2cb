"""The engine side of in-memory weight updates: SGLang's `POST /update_weights_from_tensor`.

Body (sglang 0.5.23 srt/managers/io_struct.py `UpdateWeightsFromTensorReqInput`):
`serialized_named_tensors` (one entry per TP rank, base64 of a torch.multiprocessing pickle of
`[(hf_name, tensor), ...]`, whose tensors are handles: CUDA IPC or shared memory opened by file
name), `load_format` (None or "direct": HF names; SGLang's "flattened_bucket" is not read here),
`flush_cache`, `abort_all_requests`, `weight_version`. The engine opens its own TP rank's entry
only, maps the memory the handles name, and loads the tensors with the same code as every other
update (`weight_receiver.load_into_model`); the trainer keeps the memory alive until the answer.

The entry is read by a restricted unpickler: torch's tensor/storage rebuild functions, dtypes and
a few torch classes, nothing that runs other code. A CUDA handle's device may be an index or a
GPU UUID (SGLang's senders write UUIDs, srt/utils/patch_torch.py); it must name a GPU this process
sees. A handle that cannot be opened here (another GPU, another node, a process with no CUDA, a
shared-memory segment that does not exist on this host) is refused with InMemoryHandleError,
which says so: in-memory weights reach only an engine on the trainer's device or its node's CPU.
SGLang's `LocalSerializedTensor` (one handle per TP rank inside each tensor, as slime and verl send
to TP engines) is read too.

Importing this module does not import torch (the HTTP process validates the body with
`UpdateWeightsFromTensorRequest` and passes the entries on; only the core process opens them).
"""

from __future__ import annotations

import base64
import binascii
import functools
import inspect
import io
import pickle
from typing import TYPE_CHECKING, Any, Sequence

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    import torch

LOAD_FORMATS = (None, "direct", "auto")  # all mean: (HF name, full tensor) pairs
_WHERE = ("in-memory weights reach only an engine on the trainer rank's own device (CUDA IPC) or "
          "its node's CPU (shared memory); use weight_sync method distributed or disk for this engine")


class TensorUpdateError(ValueError):
    """An /update_weights_from_tensor request the engine refuses (a ValueError: the engine core
    answers it as refused, 400, like weight_receiver.WeightUpdateError)."""


class InMemoryHandleError(TensorUpdateError):
    """An in-memory weight handle that cannot be opened or read in this process."""


class UpdateWeightsFromTensorRequest(BaseModel):
    """The body of /update_weights_from_tensor (fields rlkit reads; SGLang's others are ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class _LocalSerializedTensor:
    """Stand-in for SGLang's LocalSerializedTensor: `values[r]` is TP rank r's pickled tensor."""

    values: list


def _local_gpu(device: Any) -> int:
    """This process's index of the GPU a CUDA handle names (an index or a UUID)."""
    import torch

    if not torch.cuda.is_available():
        raise InMemoryHandleError(f"the weights are CUDA IPC handles on GPU {device!r}, and this engine "
                                  f"process has no CUDA device: {_WHERE}")
    count = torch.cuda.device_count()
    if isinstance(device, int):
        if not 0 <= device < count:
            raise InMemoryHandleError(f"CUDA IPC handle on GPU index {device}, this process sees {count} "
                                      f"GPU(s): {_WHERE}")
        return device
    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]
    if str(device) not in uuids:
        raise InMemoryHandleError(f"CUDA IPC handle on GPU {device}, which this engine process does not "
                                  f"see (its GPUs: {uuids}): {_WHERE}")
    return uuids.index(str(device))


def _rebuild_cuda_tensor(*args: Any) -> "torch.Tensor":
    from torch.multiprocessing import reductions

    where = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters).index("storage_device")
    args_l = list(args)
    device = args_l[where]
    args_l[where] = _local_gpu(device)
    try:
        return reductions.rebuild_cuda_tensor(*args_l)
    except RuntimeError as e:  # cudaIpcOpenMemHandle failed: another node, or the sender itself
        raise InMemoryHandleError(f"cannot open the CUDA IPC handle on GPU {device!r} here ({e}): {_WHERE}") from None


def _rebuild_storage_filename(cls: Any, manager: bytes, handle: bytes, size: int, dtype: Any = None) -> Any:
    from torch.multiprocessing import reductions

    try:
        return reductions.rebuild_storage_filename(cls, manager, handle, size, dtype)
    except RuntimeError as e:  # no such segment, or the sender's shm manager unreachable
        name = handle.decode(errors="replace") if isinstance(handle, bytes) else handle
        raise InMemoryHandleError(f"cannot open shared-memory segment {name!r} ({size} bytes) here ({e}): "
                                  f"{_WHERE}") from None


_R = "torch.multiprocessing.reductions"
_FD_HANDLES = {(_R, "rebuild_storage_fd"), ("multiprocessing.resource_sharer", "DupFd")}


@functools.cache
def _allowed() -> dict[tuple[str, str], Any]:
    """What an entry may name: torch's tensor and storage rebuild functions (two wrapped, to
    translate GPU UUIDs and to say why a handle does not open), dtypes, a few torch classes."""
    import torch
    from torch.multiprocessing import reductions

    allowed: dict[tuple[str, str], Any] = {
        (_R, "rebuild_tensor"): reductions.rebuild_tensor,
        (_R, "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
        (_R, "rebuild_storage_filename"): _rebuild_storage_filename,
        (_R, "rebuild_storage_empty"): reductions.rebuild_storage_empty,
        (_R, "rebuild_typed_storage"): reductions.rebuild_typed_storage,
        ("torch", "Tensor"): torch.Tensor,
        ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
        ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
        ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
        ("torch", "UntypedStorage"): torch.UntypedStorage,
        ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"):
            _LocalSerializedTensor,
        ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): _LocalSerializedTensor,
    }
    allowed.update({("torch", name): value for name, value in vars(torch).items()
                    if isinstance(value, torch.dtype)})
    return allowed


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _allowed()
        if (module, name) in allowed:
            return allowed[(module, name)]
        if (module, name) in _FD_HANDLES:
            raise InMemoryHandleError(
                "CPU tensors shared by file descriptor can be opened only by a child of the sender; "
                "share them by file name (torch's file_system strategy, as rlkit's sender does)")
        raise InMemoryHandleError(f"refused to unpickle {module}.{name}: an in-memory weight update "
                                  "holds tensors and torch's rebuild functions only")


def payload_bytes(entry: str | bytes | bytearray | memoryview) -> bytes:
    """One entry of `serialized_named_tensors` as raw pickle bytes (JSON carries base64)."""
    if isinstance(entry, str):
        try:
            return base64.b64decode(entry, validate=True)
        except (binascii.Error, ValueError) as e:
            raise TensorUpdateError(f"serialized_named_tensors entry is not base64: {e}") from None
    data = bytes(entry)
    if len(data) >= 2 and data[0] == 0x80:  # a pickle already
        return data
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise TensorUpdateError(f"serialized_named_tensors entry is neither a pickle nor base64: {e}") from None


def _load(entry: str | bytes) -> Any:
    try:
        return _HandleUnpickler(io.BytesIO(payload_bytes(entry))).load()
    except TensorUpdateError:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed payload, whatever the unpickler met
        raise TensorUpdateError(f"cannot read the serialized tensors: {type(e).__name__}: {e}") from None


def tensors_from_payload(entry: str | bytes, *, tp_rank: int = 0) -> list[tuple[str, "torch.Tensor"]]:
    """The (name, tensor) pairs of one TP rank's entry, the tensors mapping the sender's memory
    (copy them into the model, then drop them)."""
    import torch

    pairs = _load(entry)
    if not isinstance(pairs, (list, tuple)):
        raise TensorUpdateError(f"expected a list of (name, tensor), got {type(pairs).__name__} "
                                "(load_format 'flattened_bucket' is not supported)")
    out = []
    for item in pairs:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and isinstance(item[0], str)):
            raise TensorUpdateError(f"expected (name, tensor) pairs, got {type(item).__name__}")
        name, tensor = item
        if isinstance(tensor, _LocalSerializedTensor):
            values = getattr(tensor, "values", None) or []
            if not 0 <= tp_rank < len(values):
                raise TensorUpdateError(f"{name}: LocalSerializedTensor has {len(values)} rank(s), "
                                        f"this is TP rank {tp_rank}")
            tensor = _load(values[tp_rank])
        if not isinstance(tensor, torch.Tensor):
            raise TensorUpdateError(f"{name}: expected a tensor, got {type(tensor).__name__}")
        out.append((name, tensor))
    return out


def tensors_from_request(serialized_named_tensors: Sequence[str | bytes], *, tp_rank: int = 0,
                         load_format: str | None = None) -> list[tuple[str, "torch.Tensor"]]:
    """The (name, tensor) pairs for TP rank `tp_rank` of an /update_weights_from_tensor request,
    ready for `weight_receiver.load_into_model(model, dict(pairs))`. Only this rank's entry is
    opened (another rank's handles belong to that rank)."""
    if load_format not in LOAD_FORMATS:
        raise TensorUpdateError(f"load_format {load_format!r} is not supported by the built-in engine "
                                "(None or 'direct': HF names and full tensors)")
    if not 0 <= tp_rank < len(serialized_named_tensors):
        raise TensorUpdateError(f"serialized_named_tensors has {len(serialized_named_tensors)} entries, "
                                f"one per TP rank; this is TP rank {tp_rank}")
    return tensors_from_payload(serialized_named_tensors[tp_rank], tp_rank=tp_rank)


__all__ = ["InMemoryHandleError", "TensorUpdateError", "UpdateWeightsFromTensorRequest", "payload_bytes",
           "tensors_from_payload", "tensors_from_request"]
