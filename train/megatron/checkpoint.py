"""Trainer checkpoints: model, optimizer, RNG, step and version; resumable at the same TP size.

Layout of a checkpoint folder:
  meta.json              step, version, TP/DP sizes, the architecture, format version
  hf/                    config.json + tokenizer files of the source model (for `rlkit export`)
  model_tp{r:02d}.pt     Megatron parameters of TP rank r (written by DP rank 0; DP replicas are equal)
  optim_tp{r:02d}.pt     optimizer state of TP rank r (same)
  rng_rank{g:04d}.pt     python/torch(/cuda) RNG states of global rank g

Every rank writes its own files, then a barrier; rank 0 writes meta.json last, so a folder with
meta.json is complete. Loading needs the same TP size (shards are TP-specific; change TP through an
HF export); a different DP size loads too, and ranks without a saved RNG state are reseeded.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from train.hf_io import copy_side_files

if TYPE_CHECKING:
    from train.megatron.trainer import MegatronTrainer

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete or does not fit this trainer."""


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


def save_checkpoint(trainer: "MegatronTrainer", path: Path) -> None:
    if trainer.pending_samples:
        raise CheckpointError(
            f"save: {trainer.pending_samples} samples accumulated since the last step; step first"
        )
    r = trainer.rank
    path.mkdir(parents=True, exist_ok=True)
    meta_file = path / "meta.json"
    if r.rank == 0 and meta_file.exists():
        meta_file.unlink()  # the folder is being rewritten: incomplete until meta.json is back
    if r.dp_rank == 0:
        model = {n: t.detach().cpu().clone() for n, t in trainer.megatron_state().items()}
        torch.save(model, path / f"model_tp{r.tp_rank:02d}.pt")
        torch.save(trainer.optimizer.state_dict(), path / f"optim_tp{r.tp_rank:02d}.pt")
    torch.save(_rng_state(trainer.device), path / f"rng_rank{r.rank:04d}.pt")
    if r.rank == 0:
        hf = path / "hf"
        hf.mkdir(exist_ok=True)
        shutil.copy2(trainer.model_path / "config.json", hf / "config.json")
        copy_side_files(trainer.model_path, hf)
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
        meta_file.write_text(json.dumps(meta, indent=2))
    if dist.is_initialized() and r.world_size > 1:
        dist.barrier()


def read_meta(path: Path) -> dict:
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise CheckpointError(f"{path}: no meta.json (not a checkpoint, or an incomplete one)")
    meta = json.loads(meta_file.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {meta.get('format_version')} != {FORMAT_VERSION}")
    return meta


def load_checkpoint(trainer: "MegatronTrainer", path: Path) -> None:
    meta = read_meta(path)
    r = trainer.rank
    if meta["tensor_parallel"] != r.tp_size:
        raise CheckpointError(
            f"{path}: saved with TP={meta['tensor_parallel']}, this trainer runs TP={r.tp_size} "
            "(export to HF and start from that folder to change TP)"
        )
    if meta["arch"] != trainer.arch.to_dict():
        raise CheckpointError(f"{path}: saved for a different architecture than {trainer.model_path}")
    model = torch.load(path / f"model_tp{r.tp_rank:02d}.pt", map_location="cpu", weights_only=True)
    trainer._load_megatron_state(model)
    optim = torch.load(path / f"optim_tp{r.tp_rank:02d}.pt", map_location="cpu", weights_only=False)
    trainer.optimizer.load_state_dict(optim)
    rng_file = path / f"rng_rank{r.rank:04d}.pt"
    if rng_file.is_file():
        _set_rng_state(torch.load(rng_file, weights_only=False), trainer.device)
    else:
        from train.megatron.trainer import seed_everything

        seed_everything(trainer.config.seed + r.rank + 7919 * meta["step"])
    trainer.step_count = int(meta["step"])
    trainer.version = int(meta["version"])
    trainer.discard_gradients()


def checkpoint_hf_shards(path: Path) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    """(meta, Megatron state of every TP rank) of a checkpoint, for export without megatron."""
    meta = read_meta(path)
    shards = [
        torch.load(path / f"model_tp{t:02d}.pt", map_location="cpu", weights_only=True)
        for t in range(meta["tensor_parallel"])
    ]
    return meta, shards
