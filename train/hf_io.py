"""Read and write HF model folders (config.json + safetensors), without transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# Files copied next to exported weights so the folder loads with from_pretrained and a tokenizer.
SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_config(path: str | Path) -> dict:
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: not an HF model folder (no config.json)")
    return json.loads(config_path.read_text())


def load_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the model folder's *.safetensors files (sharded or not)."""
    folder = Path(path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights (convert .bin checkpoints first)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                out[name] = fh.get_tensor(name)
    return out


def save_hf_folder(
    path: str | Path,
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    config: dict,
    *,
    side_files_from: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write config.json + model.safetensors (+ tokenizer files copied from `side_files_from`)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    # Loaders read every *.safetensors (or follow an index): other weights here would mix in.
    others = sorted(p.name for p in folder.iterdir() if p.name != "model.safetensors" and (
        p.suffix in (".safetensors", ".bin") or p.name.endswith(".index.json")))
    if others:
        raise FileExistsError(f"{folder}: already holds other weight files ({', '.join(others)}); "
                              "write the model to an empty folder")
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    state = {}
    for name, t in items:
        t = t.detach().to("cpu")
        state[name] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
    config = dict(config)
    # the dtype of the floating-point weights (integer buffers say nothing about the model)
    floats = [t.dtype for t in state.values() if t.is_floating_point()]
    if floats:
        names = {v: k for k, v in _DTYPES.items()}
        if floats[0] not in names:
            raise ValueError(f"{folder}: weights of dtype {floats[0]} cannot be written as an HF "
                             f"model; use one of {sorted(_DTYPES)} (the dtype argument)")
        config["dtype"] = names[floats[0]]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if side_files_from is not None:
        copy_side_files(side_files_from, folder)
    return folder


def copy_side_files(src: str | Path, dst: str | Path) -> None:
    """Copy the SIDE_FILES (tokenizer, generation config) that `src` has into `dst`."""
    for name in SIDE_FILES:
        f = Path(src) / name
        if f.is_file():
            shutil.copy2(f, Path(dst) / name)
