"""The models and synthetic batches the `rlkit bench train` benches run on.

Models: `tiny` (2 layers, hidden 64), `smollm2` (SmolLM2-135M-Instruct; 9 heads / 3 KV heads, so
it cannot be split over TP=2) and `smollm2-shaped` (random weights, SmolLM2's sizes with 12
heads x 48 / 4 KV heads: the same parameter count and FLOPs, shardable over TP=2).
"""

from __future__ import annotations

from pathlib import Path

MODELS = ("tiny", "smollm2", "smollm2-shaped")
SHAPES = {  # (samples, prompt tokens, median response, max response)
    "tiny": (32, 32, 64, 512),
    "smollm2": (8, 32, 64, 256),
    "smollm2-shaped": (8, 32, 64, 256),
}


def model_path(name: str, workdir: Path) -> str:
    from rlkit.rollout.demo_models import prepare_model

    if name in ("tiny", "smollm2"):
        return str(prepare_model(name))
    if name == "smollm2-shaped":
        return str(build_smollm2_shaped(workdir / "smollm2-shaped"))
    raise ValueError(f"unknown bench model {name!r}; expected one of {MODELS}")


def build_smollm2_shaped(path: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlkit.train.hf_io import read_config

    if (path / "config.json").is_file():
        return path
    base = read_config(model_path("smollm2", path.parent))
    base.update(num_attention_heads=12, num_key_value_heads=4, head_dim=48)
    base.pop("_model_name_or_path", None)
    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in base.items() if k not in ("architectures", "transformers_version")})
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def synthetic_batch(vocab: int, n: int, prompt: int, median: int, cap: int, *, sigma: float = 0.8,
                    min_len: int = 4, group_size: int = 4, seed: int = 0):
    """n random samples of one prompt length and log-normal response lengths (median, sigma,
    clamped to [min_len, cap]), advantages +-1: a fixed batch for timing the trainer."""
    import torch

    from rlkit.train.batch import TrainBatch, TrainSample

    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, generator=g) * sigma + torch.log(torch.tensor(float(median))))
    lengths = lengths.round().clamp(min_len, cap).long().tolist()
    samples = []
    for i, r in enumerate(lengths):
        samples.append(
            TrainSample(
                index=i, group_id=i // group_size,
                tokens=torch.randint(0, vocab, (prompt + r,), generator=g),
                prompt_length=prompt, loss_mask=torch.ones(r), rollout_logprobs=torch.full((r,), -2.0),
                advantage=1.0 if i % 2 else -1.0, reward=float(i % 2), min_version=0, max_version=0,
            )
        )
    return TrainBatch(samples, 0)

