"""The engine side of weight updates: from disk, and from a trainer over a process group.

Distributed protocol (as SGLang; the trainer side is described in docs/engines.md):
1. `POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
   group_name, backend}`: this engine joins a process group of `world_size` ranks as rank
   `rank_offset` (the trainer is rank 0 and hosts the rendezvous store). The call returns once
   every rank has joined. The group is formed as SGLang's `init_custom_process_group` forms it
   (see `create_group`); it does not need torch.distributed's default group.
2. Per bucket, `POST /update_weights_from_distributed {names, dtypes, shapes, group_name,
   weight_version, ...}` while rank 0 broadcasts each tensor, in `names` order, from rank 0.
   The engine receives into fresh tensors, then copies them into the model between two decode
   steps. The answer comes after the whole bucket is received and loaded.
3. `POST /destroy_weights_update_group {group_name}` drops the group.

A bucket that names unknown parameters or wrong shapes is still received in full (so the
trainer's broadcasts complete and nobody hangs) and then refused with success=false.
"""

from __future__ import annotations

import datetime
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from rlkit.common.control_token import collectives_on_loopback

DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16,
    "half": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32,
}


class WeightUpdateError(ValueError):
    """A weight update that cannot be applied; the message names what and why."""


def parse_dtype(name: str) -> torch.dtype:
    key = name.removeprefix("torch.")
    if key not in DTYPES:
        raise WeightUpdateError(f"unsupported dtype {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[key]


def weight_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint or a trainer can set: parameters and persistent buffers by HF name
    (tied weights appear under both names and share storage)."""
    return model.state_dict(keep_vars=True)


def check_named_shapes(model: torch.nn.Module, named_shapes: Iterable[tuple[str, tuple[int, ...]]]) -> None:
    """Raise WeightUpdateError naming every unknown parameter or mismatched shape."""
    params = weight_targets(model)
    unknown, wrong = [], []
    for name, shape in named_shapes:
        target = params.get(name)
        if target is None:
            unknown.append(name)
        elif tuple(target.shape) != tuple(shape):
            wrong.append(f"{name}: got {list(shape)}, model has {list(target.shape)}")
    if unknown or wrong:
        parts = []
        if unknown:
            parts.append(f"unknown parameter names (HF names expected): {unknown[:10]}"
                         + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""))
        if wrong:
            parts.append(f"shape mismatches: {wrong[:10]}")
        raise WeightUpdateError("; ".join(parts))


@torch.no_grad()
def load_into_model(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy `tensors` (HF names) into the model's parameters/buffers, casting dtype and device.
    Tied parameters (lm_head / embed_tokens) share storage, so either name updates both."""
    check_named_shapes(model, ((n, tuple(t.shape)) for n, t in tensors.items()))
    params = weight_targets(model)
    for name, tensor in tensors.items():
        params[name].copy_(tensor)


def read_checkpoint(model_path: str) -> dict[str, torch.Tensor]:
    """All tensors of a HF safetensors checkpoint folder (single file or sharded)."""
    from safetensors.torch import load_file

    folder = Path(model_path)
    if not folder.is_dir():
        raise WeightUpdateError(f"model_path {model_path!r} is not a folder")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise WeightUpdateError(f"no *.safetensors file in {model_path!r}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(folder / f)))
    return tensors


def named_for_model(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep the checkpoint tensors the model has; a tied lm_head absent from the file is fine."""
    names = set(weight_targets(model))
    missing = names - set(tensors)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if missing - tied:
        raise WeightUpdateError(f"checkpoint lacks parameters {sorted(missing - tied)[:10]}")
    unknown = set(tensors) - names
    if unknown:
        raise WeightUpdateError(f"checkpoint has parameters the model lacks: {sorted(unknown)[:10]}")
    return tensors


@dataclass
class WeightGroup:
    """A joined weight-update process group."""

    name: str
    rank: int
    world_size: int
    backend: str
    group: dist.ProcessGroup
    lock: threading.Lock  # one bucket at a time: broadcasts must not interleave


def create_group(*, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str, backend: str, timeout_s: float = 600.0) -> dist.ProcessGroup:
    """Join the weight-update group the way SGLang's `init_custom_process_group` does, so the
    trainer side (train/weight_sync/group.py, or slime against real SGLang) meets us: rendezvous
    at tcp://master_address:master_port (rank 0 hosts the TCPStore), keys prefixed with the
    group name, an extra group with an identity rank map. No default group is needed. Blocks
    until every rank has joined."""
    if backend not in ("gloo", "nccl"):
        raise WeightUpdateError(f"backend must be gloo or nccl, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    collectives_on_loopback(master_address)  # all on this machine: gloo/NCCL on loopback too
    store, rank, world_size = next(
        c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), c10d.PrefixStore(group_name, store),
        group_name=group_name, timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def receive_bucket(group: WeightGroup, names: list[str], dtypes: list[str],
                   shapes: list[list[int]], device: torch.device) -> dict[str, torch.Tensor]:
    """Receive one bucket's tensors, in order, from rank 0's broadcasts."""
    comm_device = torch.device("cuda") if group.backend == "nccl" else torch.device("cpu")
    out: dict[str, torch.Tensor] = {}
    with group.lock:
        for name, dtype, shape in zip(names, dtypes, shapes):
            t = torch.empty(shape, dtype=parse_dtype(dtype), device=comm_device)
            dist.broadcast(t, src=0, group=group.group)
            out[name] = t if t.device == device else t.to(device)
    return out
