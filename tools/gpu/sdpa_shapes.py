"""Why is the first decode at a new shape slow on the H100? (docs/gpu.md, "Step-time scatter")

    python3 tools/gpu/sdpa_shapes.py

A SmolLM2-shaped random Llama (bf16, no weights needed: step time does not depend on them)
generates 64 tokens after a 32-token prompt, as `rlkit bench engine`'s plain side does, twice in
a row per batch size (round 1 meets new attention shapes, round 2 repeats them), with torch's
default SDPA backends and with the cuDNN SDPA backend disabled. Prints seconds per token.
"""

from __future__ import annotations

import subprocess
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=1e5,
               rms_norm_eps=1e-5, tie_word_embeddings=True)


def clocks() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as e:  # pragma: no cover
        return repr(e)


def gen(model, b: int, prompt: int, n: int) -> float:
    ids = torch.randint(10, 40000, (b, prompt), device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=True, temperature=1.0, top_k=None, top_p=None, eos_token_id=None,
                       pad_token_id=0)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def main() -> None:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(torch.bfloat16).eval()
    gen(model, 1, 8, 4)
    print("clock", clocks(), "cudnn sdp enabled", torch.backends.cuda.cudnn_sdp_enabled(), flush=True)
    prompt = 32
    for label, cudnn in (("default", True), ("cudnn_sdp_off", False), ("default_again", True)):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for b in (1, 32):
            prompt += 3  # new prompt length: every attention shape is new in round 1
            r1 = gen(model, b, prompt, 64)
            r2 = gen(model, b, prompt, 64)
            print(f"{label:14s} B={b:2d} prompt {prompt}: round1 {1e3 * r1:6.2f} ms/token, "
                  f"round2 {1e3 * r2:6.2f} ms/token, clock after {clocks()}", flush=True)


if __name__ == "__main__":
    main()
