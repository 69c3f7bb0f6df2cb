"""The Megatron trainer on one CUDA GPU: logprob parity, GRPO steps, a checkpoint round trip and
training tokens/s (docs/gpu.md). Each subcommand runs in its own process (megatron's parallel
state is global) and writes one JSON file.

    python3 tools/gpu/train_cuda.py parity     --model smollm2       --out $OUT/parity.json
    python3 tools/gpu/train_cuda.py grpo       --model smollm2       --out $OUT/grpo.json
    python3 tools/gpu/train_cuda.py throughput --model smollm2       --out $OUT/tput-smollm2.json
    python3 tools/gpu/train_cuda.py throughput --model llama-0.5b    --out $OUT/tput-0.5b.json

Models: a demo name (`smollm2`, `tiny`: rollout.demo_models, built from local files, never a hub)
or `llama-0.5b`: a random-init LlamaForCausalLM shaped like Qwen2.5-0.5B (hidden 896, 24 layers,
14 heads over 2 KV heads, MLP 4864, vocabulary 151,936, tied embeddings; 494M parameters),
built here in bfloat16. Runs on CPU too (tiny model, float32) so the script can be checked
without a GPU: `--device cpu`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

LLAMA_05B = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, rope_theta=1e6,
    rms_norm_eps=1e-6, tie_word_embeddings=True,
)

PROMPTS = [
    "What is the capital of France?", "What is 7 + 5? Answer with a number.",
    "Name a colour of the sky.", "How many legs does a spider have?",
    "Write one word that rhymes with cat.", "What is 12 times 3?",
    "Who wrote Romeo and Juliet?", "What is the boiling point of water in Celsius?",
]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def model_dir(name: str, workdir: Path) -> Path:
    if name == "llama-0.5b":
        return build_llama_05b(workdir / "llama-0.5b")
    from rlkit.rollout.demo_models import prepare_model

    return Path(prepare_model(name))


def build_llama_05b(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_05B)).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    del model
    return path


def conditions(device: torch.device) -> dict:
    out = {"device": str(device), "torch": torch.__version__, "cpus": os.cpu_count(),
           "machine": platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if device.type == "cuda":
        out |= {"gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda}
    try:
        import megatron.core

        out["megatron_core"] = megatron.core.__version__
    except Exception:  # pragma: no cover - informational
        pass
    return out


def make_trainer(path: Path, device: str, dtype: str, **overrides):
    from rlkit.train.config import TrainConfig
    from rlkit.train.megatron.trainer import MegatronTrainer

    cfg = TrainConfig.model_validate({"device": device, "dtype": dtype, **overrides})
    return MegatronTrainer.single_process(path, cfg)


# -- a batch of real responses ------------------------------------------------------------------
def sampled_batch(path: Path, device: torch.device, n_per_prompt: int, new_tokens: int, seed: int = 0):
    """Responses sampled by transformers from the model itself (chat prompts; for a model
    without a tokenizer, random prompts), GRPO advantages from a fixed reward: 1 if the
    response holds a digit or the word 'Paris', else 0 (what matters is a fixed batch)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlkit.train.algorithms.advantages import group_advantages
    from rlkit.train.batch import TrainBatch, TrainSample

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception:
        tok = None
    torch.manual_seed(seed)
    samples, texts = [], []
    vocab = model.get_input_embeddings().weight.shape[0]
    for g, question in enumerate(PROMPTS):
        if tok is not None and getattr(tok, "chat_template", None):
            prompt = tok.apply_chat_template([{"role": "user", "content": question}],
                                             add_generation_prompt=True, tokenize=True)
            if not isinstance(prompt, list):  # a BatchEncoding in newer transformers
                prompt = list(prompt["input_ids"])
        else:
            prompt = torch.randint(3, vocab, (16 + g,)).tolist()
        ids = torch.tensor([prompt] * n_per_prompt, device=device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=1.0, top_k=None, top_p=None, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
        responses = out[:, len(prompt):].cpu()
        rewards = []
        for r in responses:
            text = tok.decode(r.tolist()) if tok is not None else ""
            texts.append(text)
            rewards.append(1.0 if any(c.isdigit() for c in text) or "Paris" in text else float(int(r.sum()) % 2))
        adv = group_advantages(rewards, "grpo").tolist()
        for i, r in enumerate(responses):
            samples.append(TrainSample(
                index=len(samples), group_id=g, tokens=torch.tensor(prompt + r.tolist()),
                prompt_length=len(prompt), loss_mask=torch.ones(len(r)),
                rollout_logprobs=torch.zeros(len(r)), advantage=adv[i], reward=rewards[i],
                min_version=0, max_version=0))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return TrainBatch(samples, 0), texts


def hf_logprobs(path: Path, batch, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """transformers' logprobs of every response token, one sample per forward (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    out = []
    with torch.no_grad():
        for s in batch.samples:
            logits = model(s.tokens[None].to(device)).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)[s.prompt_length - 1: -1]
            out.append(lp.gather(-1, s.tokens[s.prompt_length:, None].to(device))[:, 0].cpu())
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    d = torch.cat([(x.float() - y.float()).abs() for x, y in zip(a, b)])
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean()), "p99_abs": float(d.quantile(0.99)),
            "tokens": int(d.numel())}


# -- subcommands --------------------------------------------------------------------------------
def cmd_parity(args, path: Path, device: torch.device) -> dict:
    """Megatron vs transformers logprobs on the same weights, fp32 and bf16, on `device`."""
    from rlkit.train.megatron.optimizer import MegatronOptimizer

    batch, texts = sampled_batch(path, device, n_per_prompt=2, new_tokens=args.new_tokens)
    result: dict = {"samples": len(batch), "tokens": batch.tokens, "example_response": texts[0][:200]}
    ref32 = hf_logprobs(path, batch, device, torch.float32)
    ref16 = hf_logprobs(path, batch, device, torch.bfloat16) if device.type == "cuda" else None
    for dtype in (["float32", "bfloat16"] if device.type == "cuda" else ["float32"]):
        for packing in ({}, {"packing": False}):
            trainer = make_trainer(path, args.device, dtype, micro_batch_size=4, **packing)
            ours = trainer.logprobs(batch)
            key = f"megatron_{dtype}_{'packed' if not packing else 'padded'}"
            result[key] = {"vs_hf_float32": diff(ours, ref32),
                           "optimizer": type(trainer.optimizer).__name__,
                           "megatron_optimizer": isinstance(trainer.optimizer, MegatronOptimizer),
                           "param_dtype": str(next(trainer.module.parameters()).dtype)}
            if ref16 is not None:
                result[key]["vs_hf_bfloat16"] = diff(ours, ref16)
            del trainer
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if ref16 is not None:
        result["hf_bfloat16_vs_hf_float32"] = diff(ref16, ref32)
    return result


def cmd_grpo(args, path: Path, device: torch.device) -> dict:
    """GRPO steps on one fixed batch (pi_old fixed at the first step's weights): the clipped
    surrogate loss must fall. Then a checkpoint round trip: save, step, load, step again; the
    two steps must give the same weights."""
    batch, _ = sampled_batch(path, device, n_per_prompt=4, new_tokens=args.new_tokens)
    trainer = make_trainer(path, args.device, args.dtype, micro_batch_size=8,
                           optimizer={"lr": args.lr, "grad_clip": 1.0})
    old = trainer.logprobs(batch)
    fixed = batch.with_logprobs(old=old)
    steps = []
    for _ in range(args.steps):
        sync(device)
        t = time.perf_counter()
        trainer.accumulate(fixed)
        m = trainer.step()
        sync(device)
        steps.append({k.removeprefix("train/"): v for k, v in m.items()} | {"seconds": time.perf_counter() - t})
        print(f"step {len(steps)}: loss {m['train/loss']:+.5f} clip_frac {m['train/clip_frac']:.3f} "
              f"ratio {m['train/ratio']:.4f} grad_norm {m['train/grad_norm']:.3f}", flush=True)
    after = trainer.logprobs(batch)
    pos = [float((a - b).mean()) for a, b, s in zip(after, old, batch.samples) if s.advantage > 0]
    neg = [float((a - b).mean()) for a, b, s in zip(after, old, batch.samples) if s.advantage < 0]
    losses = [s["loss"] for s in steps]
    result = {
        "samples": len(batch), "tokens": batch.tokens, "lr": args.lr, "dtype": args.dtype,
        "optimizer": type(trainer.optimizer).__name__, "steps": steps, "losses": losses,
        "loss_fell_every_step": all(b < a for a, b in zip(losses, losses[1:])),
        "mean_logprob_change_positive_adv": statistics.mean(pos) if pos else None,
        "mean_logprob_change_negative_adv": statistics.mean(neg) if neg else None,
    }
    # checkpoint round trip on this device
    with tempfile.TemporaryDirectory() as tmp:
        trainer.save(Path(tmp) / "ckpt")
        trainer.accumulate(fixed)
        trainer.step()
        w_a = {n: p.clone() for n, p in trainer.megatron_state().items()}
        trainer.load(Path(tmp) / "ckpt")
        trainer.accumulate(fixed)
        trainer.step()
        w_b = trainer.megatron_state()
        result["checkpoint_resume_max_abs_weight_diff"] = max(
            float((w_a[n].float() - w_b[n].float()).abs().max()) for n in w_a)
    return result


def cmd_throughput(args, path: Path, device: torch.device) -> dict:
    """accumulate + step of one fixed batch: 1 warm-up, then timed steps (synchronised);
    tokens/s = prompt + response tokens of the batch / step seconds. Forward-only (logprobs)
    timed too."""
    from rlkit.bench.train_inputs import synthetic_batch
    from rlkit.train.hf_io import read_config

    cfg = read_config(path)
    batch = synthetic_batch(int(cfg["vocab_size"]), args.samples, args.prompt_len, args.median,
                            args.cap, sigma=0.6, min_len=8, group_size=8)
    trainer = make_trainer(path, args.device, args.dtype, micro_batch_size=args.micro_batch,
                           optimizer={"lr": 1e-6})
    params = sum(p.numel() for p in trainer.module.parameters())
    embed = int(cfg["vocab_size"]) * int(cfg["hidden_size"])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, fwd = [], []
    for i in range(args.steps + 1):
        sync(device)
        t = time.perf_counter()
        trainer.accumulate(batch)
        m = trainer.step()
        sync(device)
        if i:
            times.append(time.perf_counter() - t)
    for _ in range(2):
        sync(device)
        t = time.perf_counter()
        trainer.logprobs(batch)
        sync(device)
        fwd.append(time.perf_counter() - t)
    best, med = min(times), statistics.median(times)
    # matmul FLOPs: 6 x (parameters that multiply every token: all but the input embedding; the
    # output layer counts, tied or not) per trained token; attention scores excluded.
    matmul_params = params - embed + (embed if cfg.get("tie_word_embeddings") else 0)
    flops = 6 * matmul_params * batch.tokens
    out = {
        "samples": len(batch), "tokens": batch.tokens, "micro_batch_size": args.micro_batch,
        "padding_fraction": m["train/padding_fraction"], "params": params, "dtype": args.dtype,
        "optimizer": type(trainer.optimizer).__name__,
        "step_s": times, "step_s_best": best, "step_s_median": med,
        "train_tokens_per_s": batch.tokens / med, "train_tokens_per_s_best": batch.tokens / best,
        "forward_s": fwd, "forward_tokens_per_s": batch.tokens / min(fwd),
        "model_tflops_per_s": flops / med / 1e12,
    }
    if device.type == "cuda":
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["parity", "grpo", "throughput"])
    p.add_argument("--model", default="smollm2", help="demo model name, llama-0.5b, or an HF folder")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--new-tokens", type=int, default=48, help="sampled response tokens (parity, grpo)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--median", type=int, default=384, help="median response tokens (log-normal)")
    p.add_argument("--cap", type=int, default=1536)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--workdir", default=os.environ.get("RLKIT_GPU_WORKDIR", "runs/gpu"))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from rlkit.train.megatron.parallel import resolve_device

    device = resolve_device(args.device)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = Path(args.model) if Path(args.model).is_dir() else model_dir(args.model, workdir)
    t0 = time.perf_counter()
    result = {"parity": cmd_parity, "grpo": cmd_grpo, "throughput": cmd_throughput}[args.command](args, path, device)
    result = {"command": "python3 tools/gpu/train_cuda.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": args.model, "conditions": conditions(device), "wall_s": time.perf_counter() - t0, **result}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("steps", "step_s", "forward_s")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
