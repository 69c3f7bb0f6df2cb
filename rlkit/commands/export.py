"""`rlkit export CHECKPOINT OUT`: write a trainer checkpoint as an HF model folder.

CHECKPOINT is a trainer checkpoint folder (meta.json + dist/, or format 1's model_tp*.pt) or a
run checkpoint (`<run>/checkpoints/step_N`, whose trainer/ subfolder is used). dist/ is read as
whole tensors in this process (torch.distributed.checkpoint, no process group, no megatron),
format 1's TP shards are merged; the config and tokenizer files saved with the checkpoint are
copied, so OUT loads with `AutoModelForCausalLM.from_pretrained(OUT)` and serves with SGLang or
the built-in engine.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path, help="trainer or run checkpoint folder")
    parser.add_argument("out", type=Path, help="HF model folder to write (created)")
    parser.add_argument(
        "--dtype", choices=("keep", "float32", "bfloat16"), default="keep",
        help="tensor dtype of the export (default: as trained)",
    )


def trainer_checkpoint_dir(path: Path) -> Path:
    from rlkit.checkpoint import TRAINER_DIR, CheckpointError

    if (path / "meta.json").is_file():
        return path
    if (path / TRAINER_DIR / "meta.json").is_file():
        return path / TRAINER_DIR
    raise CheckpointError(f"{path}: neither a trainer checkpoint nor a run checkpoint with trainer/")


def export_checkpoint(checkpoint: Path, out: Path, dtype: str = "keep") -> Path:
    import json

    import torch

    from rlkit.train.convert import iter_megatron_to_hf
    from rlkit.train.hf_arch import ModelArch
    from rlkit.train.hf_io import save_hf_folder
    from rlkit.train.megatron.checkpoint import CheckpointError, checkpoint_hf_shards

    ckpt = trainer_checkpoint_dir(checkpoint)
    meta, shards = checkpoint_hf_shards(ckpt)
    config = json.loads((ckpt / "hf" / "config.json").read_text())
    arch = ModelArch.from_hf_config(config)
    if arch.to_dict() != meta["arch"]:
        raise CheckpointError(f"{ckpt / 'hf' / 'config.json'}: does not describe the saved architecture")
    target = None if dtype == "keep" else getattr(torch, dtype)
    return save_hf_folder(out, iter_megatron_to_hf(shards, arch), config, side_files_from=ckpt / "hf", dtype=target)


def run(args: argparse.Namespace) -> int:
    out = export_checkpoint(args.checkpoint, args.out, args.dtype)
    print(f"rlkit export: wrote {out}")
    return 0
