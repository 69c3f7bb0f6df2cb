"""`rlkit bench train`, training: tokens per second of the trainer by model and TP size.

For each model and TP size, a TrainerGroup (Ray actors, gloo on CPU; the machine's CPUs
split evenly between TP ranks, one torch thread per CPU) runs `accumulate(batch) + step()` on a
fixed synthetic batch whose response lengths follow a long-tailed (log-normal) distribution.
One warm-up step, then the timed steps; tokens/s counts prompt + response tokens of the batch and
uses the fastest step (the least disturbed by other load on a shared machine; medians are in the
JSON).
"""

from __future__ import annotations

import statistics
import time

from rlkit.bench.train_inputs import SHAPES, synthetic_batch


def time_training(path: str, name: str, tp: int, steps: int, cpus: int) -> dict:
    from rlkit.train.config import TrainConfig
    from rlkit.train.hf_io import read_config
    from rlkit.train.ray_group import TrainerGroup

    cfg = TrainConfig.model_validate(
        {"device": "cpu", "parallelism": {"tensor": tp}, "micro_batch_size": 8, "optimizer": {"lr": 1e-6}}
    )
    batch = synthetic_batch(int(read_config(path)["vocab_size"]), *SHAPES[name])
    per_worker = max(1, cpus // tp)
    t0 = time.perf_counter()
    group = TrainerGroup(path, cfg, num_cpus_per_worker=per_worker, threads_per_worker=per_worker)
    setup_s = time.perf_counter() - t0
    try:
        group.accumulate(batch)
        first = group.step()  # warm-up
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            group.accumulate(batch)
            group.step()
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
        group.logprobs(batch)
        forward_s = time.perf_counter() - t
    finally:
        group.shutdown()
    step_s = min(times)
    return {
        "model": name, "tp": tp, "samples": len(batch),
        "tokens": batch.tokens, "padding_fraction": first["train/padding_fraction"],
        "step_s": step_s, "step_s_median": statistics.median(times),
        "train_tokens_per_s": batch.tokens / step_s,
        "forward_tokens_per_s": batch.tokens / forward_s, "setup_s": setup_s,
    }


def table_lines(results: list[dict]) -> list[str]:
    lines = ["model            TP   tokens  pad%   best step s  train tok/s  fwd tok/s"]
    for r in results:
        if "skipped" in r:
            lines.append(f"{r['model']:<16} {r['tp']:>2}  skipped: {r['skipped']}")
            continue
        lines.append(
            f"{r['model']:<16} {r['tp']:>2}  {r['tokens']:>7} {100 * r['padding_fraction']:5.1f}    "
            f"{r['step_s']:8.2f} {r['train_tokens_per_s']:12.1f} {r['forward_tokens_per_s']:10.1f}"
        )
    return lines
