"""`rlkit bench train`: training tokens per second and weight-sync seconds per GB.

Training: for each model and TP size, a TrainerGroup (Ray actors, gloo on CPU; the machine's CPUs
split evenly between TP ranks, one torch thread per CPU) runs `accumulate(batch) + step()` on a
fixed synthetic batch whose response lengths follow a long-tailed (log-normal) distribution.
One warm-up step, then the timed steps; tokens/s counts prompt + response tokens of the batch and
uses the fastest step (the least disturbed by other load on a shared machine; medians are in the
JSON).

Packing: in this process (TP=1), forward+backward of the same batch in three layouts: packed
into rows as long as the micro-batch's longest sample (the default), packed into rows of up to
2048 tokens, and padded (one row per sample); alternated round-robin so that load changes on a
shared machine hit all alike. Ratios of the fastest rounds to the padded one are the figures
(medians in the JSON).

Models: `tiny` (2 layers, hidden 64), `smollm2` (SmolLM2-135M-Instruct; 9 heads / 3 KV heads, so
it cannot be split over TP=2) and `smollm2-shaped` (random weights, SmolLM2's sizes with 12
heads x 48 / 4 KV heads: the same parameter count and FLOPs, shardable over TP=2).

Weight sync: the trainer's HF weights are pushed by broadcast and through disk to (a) loopback
receivers (local processes that join the broadcast group and receive every tensor, or read the
safetensors folder, as an engine's receive side does, without a model: the transport alone) and
(b) one built-in engine server (rollout/engines/builtin/hf_server.py) that also loads the weights into
its model. Seconds per GB = wall time of one whole update (write + pause/flush/update/continue)
divided by the GB sent; the first distributed update, which forms the group, is reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from rlkit.bench.report import add_out_argument, out_folder, write_report

MODELS = ("tiny", "smollm2", "smollm2-shaped")
SHAPES = {  # (samples, prompt tokens, median response, max response)
    "tiny": (32, 32, 64, 512),
    "smollm2": (8, 32, 64, 256),
    "smollm2-shaped": (8, 32, 64, 256),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="tiny,smollm2,smollm2-shaped", help=f"comma list of {MODELS}")
    parser.add_argument("--tp", default="1,2", help="comma list of tensor-parallel sizes")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per configuration")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2, help="CPUs given to Ray")
    parser.add_argument("--no-padding-compare", action="store_true", help="skip the packing layouts")
    parser.add_argument("--packing-rounds", type=int, default=4, help="rounds of the packing layouts")
    parser.add_argument("--sync-model", default="smollm2", help="model whose weights are synced ('' skips)")
    parser.add_argument("--sync-rounds", type=int, default=4, help="updates per sync method")
    parser.add_argument(
        "--sync-receivers", default="loopback,engine",
        help="comma list: 'loopback' (receive-only processes), 'engine' (a built-in engine server "
        "started here), or engine worker URLs given as url1+url2",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_out_argument(parser, "train")


def run(args: argparse.Namespace) -> int:
    out = out_folder(args.out)
    result = bench_train(
        models=[m for m in args.models.split(",") if m],
        tps=[int(t) for t in args.tp.split(",") if t],
        steps=args.steps,
        cpus=args.cpus,
        compare_padding=not args.no_padding_compare,
        packing_rounds=args.packing_rounds,
        sync_model=args.sync_model,
        sync_rounds=args.sync_rounds,
        sync_receivers=[r.replace("+", ",") for r in args.sync_receivers.split(",") if r],
    )
    table = format_table(result)
    print(json.dumps(result, indent=2) if args.json else table)
    write_report(out, "train", result, table)
    return 0


# -- models and batches ----------------------------------------------------------------------
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


# -- measurements ------------------------------------------------------------------------------
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


PACKING_LAYOUTS = {  # name -> (packing, pack_row_tokens)
    "packed-longest": (True, 0),
    "packed-2048": (True, 2048),
    "padded": (False, 0),
}


def compare_packing(path: str, name: str, rounds: int) -> dict:
    """Median fwd+bwd seconds of the batch in each layout, alternated in one trainer."""
    from rlkit.train.config import TrainConfig
    from rlkit.train.hf_io import read_config
    from rlkit.train.megatron.trainer import MegatronTrainer
    from rlkit.train.packing import pack_samples

    batch = synthetic_batch(int(read_config(path)["vocab_size"]), *SHAPES[name])
    trainer = MegatronTrainer.single_process(path, TrainConfig(device="cpu", micro_batch_size=8))
    times: dict[str, list[float]] = {k: [] for k in PACKING_LAYOUTS}
    padding: dict[str, float] = {}
    for layout, (pack, row_tokens) in PACKING_LAYOUTS.items():  # fixed per layout: pack once
        rows = [
            pack_samples([s.tokens for s in m.samples], [s.prompt_length for s in m.samples], row_tokens, pack=pack)
            for m in batch.micro_batches(trainer.config.micro_batch_size)
        ]
        padding[layout] = 1 - sum(r.tokens for r in rows) / sum(r.slots for r in rows)
    for _ in range(rounds):
        for layout, (pack, row_tokens) in PACKING_LAYOUTS.items():
            trainer.config.packing, trainer.config.pack_row_tokens = pack, row_tokens
            t = time.perf_counter()
            trainer.accumulate(batch)
            times[layout].append(time.perf_counter() - t)
            trainer.discard_gradients()
    best = {k: min(v) for k, v in times.items()}
    return {
        "model": name, "tokens": batch.tokens, "rounds": rounds,
        "layouts": {
            k: {"seconds": best[k], "seconds_median": statistics.median(times[k]),
                "tokens_per_s": batch.tokens / best[k], "padding_fraction": padding[k],
                "speedup_vs_padded": best["padded"] / best[k]}
            for k in PACKING_LAYOUTS
        },
    }


def time_weight_sync(path: str, rounds: int, receivers: str, workdir: Path) -> list[dict]:
    """Seconds per update and per GB of each method to `receivers`: 'loopback', 'engine' (one
    built-in engine server started here on the same model) or a comma list of engine URLs.
    In memory ('tensor') only to a real engine on this machine (a loopback receiver loads
    nothing, and a URL may be elsewhere)."""
    from rlkit.train.config import TrainConfig
    from rlkit.train.megatron.trainer import MegatronTrainer
    from rlkit.train.weight_sync.loopback import LoopbackEngines
    from rlkit.train.weight_sync.sender import WeightSender

    trainer = MegatronTrainer.single_process(path, TrainConfig(device="cpu"))
    loopback, engine_proc = None, None
    if receivers == "loopback":
        loopback = LoopbackEngines(1)
        urls = loopback.urls
        trainer.attach_sender(WeightSender(bucket_mb=trainer.config.weight_sync.bucket_mb, control_factory=loopback.control))
    elif receivers == "engine":
        from rlkit.rollout.engines.config import EngineConfig
        from rlkit.rollout.engines.process import start_hf_server

        engine_proc = start_hf_server(path, EngineConfig(num_engines=1, cpu_threads=1, startup_timeout_s=300))
        urls = [engine_proc.url]
    else:
        urls = [u for u in receivers.split(",") if u]
    out = []
    try:
        for method in ("distributed", "disk", *(("tensor",) if receivers == "engine" else ())):
            reports = [trainer.sync_weights(urls, method=method, folder=workdir / "sync") for _ in range(rounds)]
            steady = reports[1:] or reports  # the first distributed update also forms the group
            fastest = min(steady, key=lambda r: r.seconds_total)
            out.append({
                "method": method, "receivers": receivers if receivers in ("loopback", "engine") else "urls",
                "engines": len(urls), "gb": steady[0].bytes / 1e9, "buckets": steady[0].buckets,
                "seconds": fastest.seconds_total, "seconds_per_gb": fastest.seconds_per_gb,
                "paused_seconds": fastest.seconds_paused,
                "seconds_median": statistics.median(r.seconds_total for r in steady),
                "first_update_seconds": reports[0].seconds_total,
            })
    finally:
        trainer.close()
        if loopback is not None:
            loopback.close()
        if engine_proc is not None:
            engine_proc.stop()
    return out


def bench_train(
    *, models: list[str], tps: list[int], steps: int, cpus: int, compare_padding: bool,
    packing_rounds: int,
    sync_model: str, sync_rounds: int, sync_receivers: list[str],
) -> dict:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    result: dict = {"training": [], "packing": [], "weight_sync": []}
    with tempfile.TemporaryDirectory(prefix="rlkit-bench-train-") as tmp:
        workdir = Path(tmp)
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            for name in models:
                path = model_path(name, workdir)
                for tp in tps:
                    if name == "smollm2" and tp > 1:
                        result["training"].append({"model": name, "tp": tp, "skipped": "9 heads / 3 KV heads do not split over TP=2; see smollm2-shaped"})
                        continue
                    result["training"].append(time_training(path, name, tp, steps, cpus))
        finally:
            ray.shutdown()
        if compare_padding:
            result["packing"] = [
                compare_packing(model_path(name, workdir), name, max(2, packing_rounds))
                for name in models if name != "smollm2-shaped"
            ]
        if sync_model:
            sync_path = model_path(sync_model, workdir)
            for receivers in sync_receivers:
                result["weight_sync"] += time_weight_sync(sync_path, sync_rounds, receivers, workdir)
    result["conditions"] = {
        "cpus": os.cpu_count(), "ray_cpus": cpus, "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(), "wall_s": time.perf_counter() - t_start,
        "note": "shared machine: other processes may run; compare figures within one run",
    }
    return result


def format_table(result: dict) -> str:
    lines = ["model            TP   tokens  pad%   best step s  train tok/s  fwd tok/s"]
    for r in result["training"]:
        if "skipped" in r:
            lines.append(f"{r['model']:<16} {r['tp']:>2}  skipped: {r['skipped']}")
            continue
        lines.append(
            f"{r['model']:<16} {r['tp']:>2}  {r['tokens']:>7} {100 * r['padding_fraction']:5.1f}    "
            f"{r['step_s']:8.2f} {r['train_tokens_per_s']:12.1f} {r['forward_tokens_per_s']:10.1f}"
        )
    if result["packing"]:
        lines.append("")
        lines.append("packing (TP=1, fwd+bwd, alternated)   layout          pad%  best s   tok/s   vs padded")
        for r in result["packing"]:
            for layout, v in r["layouts"].items():
                lines.append(
                    f"{r['model']:<16} {r['tokens']:>6} tokens        {layout:<15} {100 * v['padding_fraction']:5.1f} "
                    f"{v['seconds']:8.2f} {v['tokens_per_s']:7.1f} {v['speedup_vs_padded']:8.2f}x"
                )
    if result["weight_sync"]:
        lines.append("")
        lines.append("sync method   receivers   GB      best s    s/GB    paused s  first update s")
        for r in result["weight_sync"]:
            lines.append(
                f"{r['method']:<13} {r['receivers']:<10} {r['gb']:6.3f} {r['seconds']:9.2f} "
                f"{r['seconds_per_gb']:7.2f} {r['paused_seconds']:9.2f} {r['first_update_seconds']:14.2f}"
            )
    c = result["conditions"]
    lines.append("")
    lines.append(
        f"{c['cpus']} CPUs ({c['ray_cpus']} to Ray); load average before {c['loadavg_before'][0]:.2f}, "
        f"after {c['loadavg_after'][0]:.2f}; {c['wall_s']:.0f} s; {c['note']}"
    )
    return "\n".join(lines)
