"""`rlkit export CHECKPOINT OUT`: write a trainer checkpoint as an HF model folder.

CHECKPOINT is a trainer checkpoint folder (meta.json + dist/, or format 1's model_tp*.pt) or a
run checkpoint (`<run>/checkpoints/step_N`, whose trainer/ subfolder is used). dist/ is read as
whole tensors in this process (torch.distributed.checkpoint, no process group, no megatron),
format 1's TP shards are merged; the config and tokenizer files saved with the checkpoint are
copied, so OUT loads with `AutoModelForCausalLM.from_pretrained(OUT)` and serves with SGLang or
the built-in engine. A LoRA run's checkpoint exports merged (W + scale B A), or with `--adapter`
as the adapter alone: a PEFT folder (adapter_config.json + adapter_model.safetensors) that
`peft.PeftModel.from_pretrained` loads onto the base model, and SGLang's /load_lora_adapter too.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path,
                        help="trainer or run checkpoint folder, or a run folder (its newest "
                        "checkpoint)")
    parser.add_argument("out", type=Path, help="HF model folder to write (created)")
    parser.add_argument(
        "--dtype", choices=("keep", "float32", "bfloat16"), default="keep",
        help="tensor dtype of the export (default: as trained)",
    )
    parser.add_argument(
        "--adapter", action="store_true",
        help="a LoRA run's checkpoint: write the adapter alone as a PEFT folder (default: the "
        "merged model)",
    )


def trainer_checkpoint_dir(path: Path) -> Path:
    from rlkit.checkpoint import TRAINER_DIR, CheckpointError, latest_checkpoint

    if (path / "meta.json").is_file():
        return path
    if (path / TRAINER_DIR / "meta.json").is_file():
        return path / TRAINER_DIR
    if (newest := latest_checkpoint(path)) is not None:  # a run folder
        return newest.trainer_dir
    raise CheckpointError(f"{path}: neither a trainer checkpoint, a run checkpoint with trainer/ "
                          "nor a run folder with a checkpoint")


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


def export_adapter(checkpoint: Path, out: Path, dtype: str = "keep") -> Path:
    """A LoRA run's checkpoint as a PEFT folder (the adapters in HF's layout, TP=1)."""
    import json

    import torch

    from rlkit.train.hf_arch import ModelArch
    from rlkit.train.megatron.checkpoint import CheckpointError, read_dist_model, read_meta
    from rlkit.train.megatron.lora import adapter_to_hf, peft_config, peft_tensor_names, target_of, write_peft_folder

    ckpt = trainer_checkpoint_dir(checkpoint)
    meta = read_meta(ckpt)
    plan = meta.get("lora") or {}
    if not plan:
        raise CheckpointError(f"{ckpt}: not a LoRA run's checkpoint (meta.json names no adapters); "
                              "export it without --adapter")
    arch = ModelArch.from_hf_config(json.loads((ckpt / "hf" / "config.json").read_text()))
    state = read_dist_model(ckpt, meta)
    target = None if dtype == "keep" else getattr(torch, dtype)
    tensors, ranks, scales, targets = {}, set(), set(), []
    for name, (a, b, scale) in plan.items():
        ranks.add(int(state[a].shape[0]))
        scales.add(float(scale))
        if target_of(name) not in targets:
            targets.append(target_of(name))
        for module, ta, tb in adapter_to_hf(name, [state[a]], [state[b]], arch):
            na, nb = peft_tensor_names(module)
            tensors[na], tensors[nb] = (t if target is None else t.to(target) for t in (ta, tb))
    if len(ranks) != 1 or len(scales) != 1:
        raise CheckpointError(f"{ckpt}: adapters of several ranks or scales ({sorted(ranks)}, "
                              f"{sorted(scales)}): PEFT holds one of each")
    rank, scale = ranks.pop(), scales.pop()
    return write_peft_folder(out, tensors, peft_config(
        rank=rank, alpha=scale * rank, dropout=0.0, targets=targets,
        base_model=str(meta.get("source_model", ""))))


def run(args: argparse.Namespace) -> int:
    export = export_adapter if args.adapter else export_checkpoint
    out = export(args.checkpoint, args.out, args.dtype)
    print(f"rlkit export: wrote {out}")
    return 0
