"""`rlkit bench train`: training tokens per second and weight-sync seconds per GB.

The command: its arguments, and the benches it runs in turn into one report. Each bench is a
module of its own, on the models and batches of rlkit/bench/train_inputs.py:

- training tokens/s by model and TP size: rlkit/bench/train_throughput.py;
- forward+backward in each packing layout: rlkit/bench/train_packing.py;
- weight-sync seconds per GB by method and receiver: rlkit/bench/train_weight_sync.py;
- `--length-mix` (that comparison alone, the three above skipped): micro-batches by count vs by
  token budget, DP replicas as Ray actors: rlkit/bench/train_length_mix.py.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from rlkit.bench import train_packing, train_throughput, train_weight_sync
from rlkit.bench.report import add_out_argument, out_folder, write_report
from rlkit.bench.train_inputs import MODELS, model_path
from rlkit.bench.train_length_mix import MIX_CONFIGS, bench_length_mix, format_length_mix_table, mix_kinds


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
    mix = parser.add_argument_group("length mix (--length-mix)")
    mix.add_argument(
        "--length-mix", action="store_true",
        help="only the length-mix comparison: micro-batches by count vs by token budget on a "
        "long-tail batch, DP replicas as Ray actors (--steps and --cpus apply; the other "
        "sections are skipped)",
    )
    mix.add_argument("--mix-model", default="tiny", help=f"model of the length mix, one of {MODELS}")
    mix.add_argument("--mix-samples", type=int, default=64, help="samples in the batch")
    mix.add_argument("--mix-prompt", type=int, default=32, help="prompt tokens per sample")
    mix.add_argument("--mix-median", type=int, default=512, help="median response tokens (log-normal)")
    mix.add_argument("--mix-sigma", type=float, default=1.2, help="sigma of the log-normal response lengths")
    mix.add_argument("--mix-cap", type=int, default=8192, help="longest sample, prompt included (tokens)")
    mix.add_argument("--mix-dp", type=int, default=2, help="data-parallel replicas")
    mix.add_argument("--mix-micro-batch-size", type=int, default=4, help="samples per micro-batch (by count)")
    mix.add_argument("--mix-max-tokens", type=int, default=0,
                     help="train.max_tokens_per_micro_batch of the token-budget configuration "
                     "(0: --mix-cap, so that no sample is over the budget)")
    mix.add_argument("--mix-configs", default=",".join(MIX_CONFIGS),
                     help=f"comma list of configurations, from {', '.join(MIX_CONFIGS)}")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_out_argument(parser, "train")


def run(args: argparse.Namespace) -> int:
    out = out_folder(args.out)
    if args.length_mix:
        result = bench_length_mix(
            model=args.mix_model, samples=args.mix_samples, prompt=args.mix_prompt,
            median=args.mix_median, sigma=args.mix_sigma, cap=args.mix_cap, dp=args.mix_dp,
            micro_batch_size=args.mix_micro_batch_size, max_tokens=args.mix_max_tokens or args.mix_cap,
            steps=args.steps, cpus=args.cpus, kinds=mix_kinds(args.mix_configs),
        )
        table = format_length_mix_table(result)
        print(json.dumps(result, indent=2) if args.json else table)
        write_report(out, "train", result, table)
        return 0
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


def bench_train(
    *, models: list[str], tps: list[int], steps: int, cpus: int, compare_padding: bool,
    packing_rounds: int,
    sync_model: str, sync_rounds: int, sync_receivers: list[str],
) -> dict:
    from rlkit.driver.local_ray import local_ray

    load_before = os.getloadavg()
    t_start = time.perf_counter()
    result: dict = {"training": [], "packing": [], "weight_sync": []}
    with tempfile.TemporaryDirectory(prefix="rlkit-bench-train-") as tmp:
        workdir = Path(tmp)
        with local_ray(cpus):
            for name in models:
                path = model_path(name, workdir)
                for tp in tps:
                    if name == "smollm2" and tp > 1:
                        result["training"].append({"model": name, "tp": tp, "skipped": "9 heads / 3 KV heads do not split over TP=2; see smollm2-shaped"})
                        continue
                    result["training"].append(train_throughput.time_training(path, name, tp, steps, cpus))
        if compare_padding:
            result["packing"] = [
                train_packing.compare_packing(model_path(name, workdir), name, max(2, packing_rounds))
                for name in models if name != "smollm2-shaped"
            ]
        if sync_model:
            sync_path = model_path(sync_model, workdir)
            for receivers in sync_receivers:
                result["weight_sync"] += train_weight_sync.time_weight_sync(sync_path, sync_rounds, receivers, workdir)
    result["conditions"] = {
        "cpus": os.cpu_count(), "ray_cpus": cpus, "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(), "wall_s": time.perf_counter() - t_start,
        "note": "shared machine: other processes may run; compare figures within one run",
    }
    return result


def format_table(result: dict) -> str:
    lines = train_throughput.table_lines(result["training"])
    if result["packing"]:
        lines.append("")
        lines.extend(train_packing.table_lines(result["packing"]))
    if result["weight_sync"]:
        lines.append("")
        lines.extend(train_weight_sync.table_lines(result["weight_sync"]))
    c = result["conditions"]
    lines.append("")
    lines.append(
        f"{c['cpus']} CPUs ({c['ray_cpus']} to Ray); load average before {c['loadavg_before'][0]:.2f}, "
        f"after {c['loadavg_after'][0]:.2f}; {c['wall_s']:.0f} s; {c['note']}"
    )
    return "\n".join(lines)

