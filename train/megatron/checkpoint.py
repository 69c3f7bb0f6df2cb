"""Trainer checkpoints: model, optimizer, RNG, step and version; resumable at the same TP size.

Layout of a checkpoint folder:
  meta.json              step, version, TP/DP sizes, the architecture, format version
  hf/                    config.json + tokenizer files of the source model (for `rlkit export`)
  model_tp{r:02d}.pt     Megatron parameters of TP rank r (written by DP rank 0; DP replicas are equal)
  optim_tp{r:02d}.pt     optimizer state of TP rank r (same)
  rng_rank{g:04d}.pt     python/torch(/cuda) RNG states of global rank g

Every rank writes its own files (each through a temporary sibling renamed into place), then a
barrier; rank 0 writes meta.json last, so a folder with meta.json is complete. Files are loaded
with `weights_only=True` (tensors and plain data; nothing in a file runs code), and a missing,
truncated or mismatched one (another model, another TP size) is refused naming the file.
Loading needs the same TP size (shards are TP-specific; change TP through an HF export); a
different DP size loads too, and ranks without a saved RNG state are reseeded.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rlkit.buffers.errors import CheckpointError
from rlkit.train.hf_io import copy_side_files
from rlkit.train.megatron.parallel import seed_everything



class Checkpointed(Protocol):
    """What saving and loading need of a trainer (MegatronTrainer is one): typed structurally so
    this module and the trainer, which calls it, do not import each other."""

    rank: Any  # parallel.RankInfo: rank, tp_rank, dp_rank
    optimizer: Any
    device: torch.device
    dtype: torch.dtype
    model_path: Path
    arch: Any  # hf_arch.HFArch
    config: Any  # train.config.TrainConfig
    step_count: int
    version: int
    pending_samples: int

    def megatron_state(self) -> dict[str, torch.Tensor]: ...
    def _load_megatron_state(self, state: dict[str, torch.Tensor]) -> None: ...
    def discard_gradients(self) -> None: ...

FORMAT_VERSION = 1


def _rng_state(device: torch.device) -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        state["cuda"] = torch.cuda.get_rng_state()
        state["megatron_tracker"] = get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        torch.cuda.set_rng_state(state["cuda"])
        get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def save_checkpoint(trainer: Checkpointed, path: Path) -> None:
    if trainer.pending_samples:
        raise CheckpointError(
            f"save: {trainer.pending_samples} samples accumulated since the last step; step first"
        )
    r = trainer.rank
    meta_file = path / "meta.json"
    try:
        path.mkdir(parents=True, exist_ok=True)
        if r.rank == 0 and meta_file.exists():
            meta_file.unlink()  # the folder is being rewritten: incomplete until meta.json is back
    except OSError as e:
        raise CheckpointError(f"{path}: cannot write the trainer checkpoint ({e.strerror or e})") from None
    if r.dp_rank == 0:
        model = {n: t.detach().cpu().clone() for n, t in trainer.megatron_state().items()}
        _save(model, path / f"model_tp{r.tp_rank:02d}.pt")
        _save(trainer.optimizer.state_dict(), path / f"optim_tp{r.tp_rank:02d}.pt")
    _save(_rng_state(trainer.device), path / f"rng_rank{r.rank:04d}.pt")
    if r.rank == 0:
        hf = path / "hf"
        try:
            hf.mkdir(exist_ok=True)
            shutil.copy2(trainer.model_path / "config.json", hf / "config.json")
            copy_side_files(trainer.model_path, hf)
        except OSError as e:
            raise CheckpointError(f"{hf}: cannot write ({e.strerror or e})") from None
    if dist.is_initialized() and r.world_size > 1:
        dist.barrier()
    if r.rank == 0:
        meta = {
            "format_version": FORMAT_VERSION,
            "step": trainer.step_count,
            "version": trainer.version,
            "tensor_parallel": r.tp_size,
            "data_parallel": r.dp_size,
            "arch": trainer.arch.to_dict(),
            "source_model": str(trainer.model_path),
            "dtype": str(trainer.dtype).removeprefix("torch."),
        }
        _replace(meta_file, lambda tmp: tmp.write_text(json.dumps(meta, indent=2)))
    if dist.is_initialized() and r.world_size > 1:
        dist.barrier()


def _save(obj: object, file: Path) -> None:
    _replace(file, lambda tmp: torch.save(obj, tmp))


def _replace(file: Path, write) -> None:
    """Write `file` through a temporary sibling renamed over it, so a crash or a full disk never
    leaves a half-written file under the real name. A write failure names the file."""
    tmp = file.with_name(f".{file.name}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, file)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
        tmp.unlink(missing_ok=True)
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[-1]
        raise CheckpointError(f"{file}: cannot write ({why})") from None


def _load(file: Path, what: str) -> dict:
    """A checkpoint file as tensors and plain data only (weights_only: never runs code from the
    file); a missing, truncated or foreign file is refused with its name."""
    if not file.is_file():
        raise CheckpointError(f"{file}: missing {what} (an incomplete checkpoint?)")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch reports a cut zip, a bad pickle, ... differently
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{file}: unreadable {what}, truncated or not a checkpoint file ({why})") from None


def read_meta(path: Path) -> dict:
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise CheckpointError(f"{path}: no meta.json (not a checkpoint, or an incomplete one)")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_file}: unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        got = meta.get("format_version") if isinstance(meta, dict) else None
        raise CheckpointError(f"{meta_file}: format_version {got} != {FORMAT_VERSION}")
    missing = {"step", "version", "tensor_parallel", "arch"} - set(meta)
    if missing:
        raise CheckpointError(f"{meta_file}: lacks {', '.join(sorted(missing))}")
    return meta


def load_checkpoint(trainer: Checkpointed, path: Path) -> None:
    meta = read_meta(path)
    r = trainer.rank
    if meta["tensor_parallel"] != r.tp_size:
        raise CheckpointError(
            f"{path / 'meta.json'}: saved with TP={meta['tensor_parallel']}, this trainer runs "
            f"TP={r.tp_size} (export to HF and start from that folder to change TP)"
        )
    if meta["arch"] != trainer.arch.to_dict():
        theirs, mine = meta["arch"], trainer.arch.to_dict()
        diff = ", ".join(f"{k} {theirs.get(k)!r} vs {mine.get(k)!r}" for k in sorted(set(theirs) | set(mine))
                         if theirs.get(k) != mine.get(k))
        raise CheckpointError(
            f"{path / 'meta.json'}: saved for a different architecture than {trainer.model_path} ({diff})"
        )
    model_file = path / f"model_tp{r.tp_rank:02d}.pt"
    model = _load(model_file, "model shard")
    try:
        trainer._load_megatron_state(model)
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{model_file}: does not fit this model ({e})") from None
    optim_file = path / f"optim_tp{r.tp_rank:02d}.pt"
    optim = _load(optim_file, "optimizer state")
    try:
        trainer.optimizer.load_state_dict(optim)
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{optim_file}: does not fit this optimizer ({e})") from None
    rng_file = path / f"rng_rank{r.rank:04d}.pt"
    if rng_file.is_file():
        _set_rng_state(_load(rng_file, "RNG state"), trainer.device)
    else:
        seed_everything(trainer.config.seed + r.rank + 7919 * meta["step"])
    trainer.step_count = int(meta["step"])
    trainer.version = int(meta["version"])
    trainer.discard_gradients()


def checkpoint_hf_shards(path: Path) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """(meta, Megatron state of every TP rank) of a checkpoint, for export without megatron."""
    meta = read_meta(path)
    shards = [_load(path / f"model_tp{t:02d}.pt", "model shard") for t in range(meta["tensor_parallel"])]
    return meta, shards
