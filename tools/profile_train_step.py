"""One SmolLM2 train step of the default recipe's shape, timed in one process, three ways.

    python tools/profile_train_step.py [--threads 2] [--steps 3]

32 samples (8 prompts x 4, 45-token prompts, 8-64-token responses), micro-batches of 8, fp32,
MegatronTrainer.accumulate + step; and transformers' own forward+backward of the same padded
micro-batches (what TRL's GRPOTrainer trains with). Prints the median accumulate seconds of
steps after the first, and the process's peak RSS. The table in docs/training.md ("Packing")
comes from it.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time

import torch


def samples(seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(32):
        if i % 4 == 0:
            prompt = torch.randint(0, 49000, (45,), generator=gen)
        r = rng.choice([8, 12, 16, 20, 24, 28, 32, 40, 48, 64])
        out.append((torch.cat([prompt, torch.randint(0, 49000, (r,), generator=gen)]), 45))
    return out


def megatron_seconds(path: str, data, share: bool, steps: int) -> list[float]:
    from rlkit.train.batch import TrainBatch, TrainSample
    from rlkit.train.config import TrainConfig
    from rlkit.train.megatron.trainer import MegatronTrainer

    cfg = TrainConfig.model_validate({"micro_batch_size": 8, "share_prompts": share})
    trainer = MegatronTrainer.single_process(path, cfg)
    rng = random.Random(1)
    times = []
    for _ in range(steps):
        batch = TrainBatch([
            TrainSample(index=k, group_id=k // 4, tokens=t, prompt_length=p, reward=0.0,
                        loss_mask=torch.ones(len(t) - p), rollout_logprobs=-torch.rand(len(t) - p),
                        advantage=rng.gauss(0, 1), min_version=0, max_version=0)
            for k, (t, p) in enumerate(data)], 0)
        t0 = time.perf_counter()
        trainer.accumulate(batch)
        times.append(time.perf_counter() - t0)
        trainer.step()
    return times


def transformers_seconds(path: str, data, steps: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.98), weight_decay=0.0)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for m in range(0, 32, 8):
            chunk = data[m:m + 8]
            width = max(len(t) for t, _ in chunk)
            ids = torch.zeros(8, width, dtype=torch.long)
            mask = torch.zeros(8, width, dtype=torch.long)
            for j, (t, _) in enumerate(chunk):
                ids[j, :len(t)], mask[j, :len(t)] = t, 1
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            (lp * mask[:, 1:]).sum().backward()
        times.append(time.perf_counter() - t0)
        opt.step()
        opt.zero_grad()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--way", choices=["shared", "unshared", "transformers"], default="shared")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from rlkit.rollout.demo_models import resolve_model_path

    path, data = resolve_model_path("smollm2"), samples()
    if args.way == "transformers":
        times = transformers_seconds(path, data, args.steps)
    else:
        times = megatron_seconds(path, data, args.way == "shared", args.steps)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"{args.way} threads={args.threads}: accumulate median {statistics.median(times[1:] or times):.1f} s "
          f"(steps {', '.join(f'{t:.1f}' for t in times)}), peak RSS {rss:.2f} GiB")


if __name__ == "__main__":
    main()
