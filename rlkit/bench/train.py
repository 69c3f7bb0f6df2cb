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

Length mix (`--length-mix`: this comparison alone, the sections above skipped): one batch of
`--mix-samples` samples with short prompts and log-normal response lengths (median
`--mix-median`, sigma `--mix-sigma`; every sample, prompt included, at most `--mix-cap` tokens),
trained on `--mix-model` (tiny) at DP=`--mix-dp` (TrainerGroup, Ray, gloo) in the configurations
`--mix-configs` names: `by-count`, micro-batches by count (`train.micro_batch_size` =
`--mix-micro-batch-size`), replicas split by cost (n + w n^2); `by-count-split-by-tokens`, the
same micro-batches with replicas split by tokens alone (w = 0: rlkit before issue 23, longest
first by length); `by-tokens`, micro-batches by token budget (`train.max_tokens_per_micro_batch`
= `--mix-max-tokens`), replicas split by cost. Each configuration has its own TrainerGroup
(fresh rank processes, so each rank's peak RSS is that configuration's alone), run one after
the other (one warm-up step, then `--steps` timed steps) and shut down before the next starts:
side by side, an idle group's ranks keep their last step's memory, and at 8k the node's memory
cannot hold two configurations' ranks. Run it on an otherwise idle machine (the report gives
the load average before and after). Per configuration: tokens/s
(prompt + response tokens / (accumulate + step) seconds; fastest step, median in the JSON); peak
RSS per rank (the kernel's high-water mark, /proc/PID/status VmHWM = getrusage's ru_maxrss of
that process, read from here) and its growth over the RSS after setup; and the slowest DP
replica's share of the step: each replica's accumulate seconds (from the call's dispatch to its
result's arrival here; accumulate makes no cross-replica collective, so this is the replica's
own compute, plus milliseconds of Ray), slowest / mean, median over the timed steps (1.0: even).
The planner's own figure (cost n + w n^2 per replica, slowest / mean) and the largest
micro-batch (tokens, dense slots rows x width, mask entries rows x width^2) are reported beside;
the JSON adds each replica's dense slots and mask entries (the packed layout's work, padding
included, which the planner's per-sample cost does not count).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
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


def mix_kinds(text: str) -> tuple[str, ...]:
    from rlkit.buffers.errors import UserError

    kinds = tuple(k for k in text.split(",") if k)
    unknown = [k for k in kinds if k not in MIX_CONFIGS]
    if unknown or not kinds:
        raise UserError(f"--mix-configs {text!r}: name one or more of {', '.join(MIX_CONFIGS)}"
                        + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    return tuple(dict.fromkeys(kinds))


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


# -- length mix: micro-batches by count vs by token budget, DP replicas ----------------------
MIX_CONFIGS = ("by-count", "by-count-split-by-tokens", "by-tokens")


def length_mix_batch(vocab: int, *, samples: int, prompt: int, median: int, sigma: float, cap: int,
                     seed: int = 0):
    """`samples` samples of `prompt` prompt tokens and log-normal response lengths (median,
    sigma), each sample at most `cap` tokens in all."""
    from rlkit.buffers.errors import UserError

    if cap < prompt + 4:
        raise UserError(f"--mix-cap {cap}: a sample needs its {prompt} prompt tokens and at least 4 "
                        "response tokens")
    if samples < 1:
        raise UserError(f"--mix-samples {samples}: at least one sample")
    return synthetic_batch(vocab, samples, prompt, median, cap - prompt, sigma=sigma, seed=seed)


def slowest_share(seconds: list[float]) -> float:
    """The slowest replica's share of the step: slowest / mean (1.0: all equal)."""
    if not seconds:
        raise ValueError("no replica seconds")
    mean = sum(seconds) / len(seconds)
    return max(seconds) / mean if mean > 0 else 1.0


def process_memory_mb(pid: int) -> dict[str, float | None]:
    """A local process's resident memory now (VmRSS) and its lifetime peak (VmHWM, the figure
    getrusage's ru_maxrss gives that process), in MB; None where /proc cannot tell (not Linux)."""
    out: dict[str, float | None] = {"rss_mb": None, "peak_rss_mb": None}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out["rss_mb" if key == "VmRSS" else "peak_rss_mb"] = int(value.split()[0]) / 1024
    return out


def split_weight(kind: str, group_weight: float) -> float:
    """The attention weight the configuration's replica split uses: 0 (tokens alone, the split
    before issue 23) for by-count-split-by-tokens, else the group's own (rank 0's model)."""
    return 0.0 if kind == "by-count-split-by-tokens" else group_weight


def timed_accumulate(group, batch, weight: float) -> list[float]:
    """`accumulate(batch)` on every rank of `group` as TrainerGroup does it (the same plan and
    shares, replicas split with attention weight `weight`), returning each DP replica's seconds:
    from the calls' dispatch to the arrival of its result here (the slowest of its TP ranks)."""
    import ray

    from rlkit.train.ray_group import plan_for_data_parallel, replica_batches

    shares = replica_batches(batch, plan_for_data_parallel(batch, group.config, weight))
    objects = [ray.put(sub) for _, sub in shares]
    t0 = time.perf_counter()
    refs = [group.workers[d * group.tp + t].accumulate.remote(obj)
            for d, obj in enumerate(objects) for t in range(group.tp)]
    arrived: dict = {}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        now = time.perf_counter() - t0
        for ref in ready:
            arrived[ref] = now
    ray.get(refs)  # raise a rank's error
    per_rank = [arrived[ref] for ref in refs]
    return [max(per_rank[d * group.tp:(d + 1) * group.tp]) for d in range(len(shares))]


def mix_train_config(kind: str, *, dp: int, micro_batch_size: int, max_tokens: int):
    from rlkit.train.config import TrainConfig

    cfg: dict = {"device": "cpu", "parallelism": {"tensor": 1, "data": dp}, "optimizer": {"lr": 1e-6},
                 "micro_batch_size": micro_batch_size}
    if kind == "by-tokens":
        cfg["max_tokens_per_micro_batch"] = max_tokens
    elif kind not in MIX_CONFIGS:
        raise ValueError(f"unknown length-mix configuration {kind!r}")
    return TrainConfig.model_validate(cfg)


def plan_figures(batch, config, weight: float, cost_weight: float | None = None) -> dict:
    """The planner's view of `batch` under `config`, its replicas split with attention weight
    `weight`: micro-batches per replica (empty ones too), the largest micro-batch (tokens; dense
    slots rows x width and mask entries rows x width^2 as train/packing.py lays it out), the
    planned slowest / mean replica cost by sample (n + w n^2) and by the dense layout
    (`layout_cost`, w = `cost_weight`, default `weight`)."""
    from rlkit.train.microbatch_plan import layout_cost, row_slots
    from rlkit.train.ray_group import plan_for_data_parallel

    w = weight if cost_weight is None else cost_weight
    plan = plan_for_data_parallel(batch, config, weight)
    lengths = [s.length for s in batch.samples]
    largest = {"tokens": 0, "slots": 0, "mask_entries": 0}
    slots, mask = [0] * len(plan.replicas), [0] * len(plan.replicas)
    layout = [0.0] * len(plan.replicas)
    for d, replica in enumerate(plan.replicas):
        for mb in replica:
            if not mb:
                continue
            rows, width = row_slots([lengths[i] for i in mb], config.pack_row_tokens, config.packing)
            largest["tokens"] = max(largest["tokens"], sum(lengths[i] for i in mb))
            largest["slots"] = max(largest["slots"], rows * width)
            largest["mask_entries"] = max(largest["mask_entries"], rows * width * width)
            slots[d] += rows * width
            mask[d] += rows * width * width
            layout[d] += layout_cost([lengths[i] for i in mb], w, config.pack_row_tokens, config.packing)
    return {
        # the dense layout's work per replica (padding included): what the planner's cost
        # (n + w n^2 per sample) does not see
        "slots_per_replica": slots, "mask_entries_per_replica": mask,
        "micro_batches_per_replica": len(plan.replicas[0]) if plan.replicas else 0,
        "empty_micro_batches": [sum(1 for mb in r if not mb) for r in plan.replicas],
        "samples_per_replica": [len(plan.samples_of(d)) for d in range(len(plan.replicas))],
        "largest_micro_batch": largest,
        "planned_share": slowest_share(list(plan.loads)),
        "layout_share": slowest_share(layout),
    }


def cost_share(batch, config, weight: float, cost_weight: float) -> float:
    """Slowest / mean replica cost (n + w n^2, w = `cost_weight`) of the split made with
    attention weight `weight`: the split by tokens alone seen by the cost it ignores."""
    from rlkit.train.microbatch_plan import sample_cost
    from rlkit.train.ray_group import plan_for_data_parallel

    plan = plan_for_data_parallel(batch, config, weight)
    lengths = [s.length for s in batch.samples]
    return slowest_share([sum(sample_cost(lengths[i], cost_weight) for i in plan.samples_of(d))
                          for d in range(len(plan.replicas))])


class RssSampler:
    """The largest resident memory (VmRSS) seen per process, polled every `interval` seconds in
    a thread: a lower bound of the peak, kept for processes that died (the exact peak, VmHWM,
    dies with the process)."""

    def __init__(self, pids: list[int], interval: float = 0.2) -> None:
        self.peak_mb: dict[int, float] = {p: 0.0 for p in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            for pid in self.peak_mb:
                rss = process_memory_mb(pid)["rss_mb"]
                if rss is not None:
                    self.peak_mb[pid] = max(self.peak_mb[pid], rss)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def wait_exited(pids: list[int], timeout_s: float = 120.0) -> None:
    """Until no process of `pids` holds memory (gone, or a zombie: no VmRSS), or `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while any(process_memory_mb(p)["rss_mb"] for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)


def kill_group(group) -> None:
    """Stop a group one of whose ranks died: kill every rank (a survivor may wait in a
    collective for the dead one, so no graceful shutdown)."""
    import ray

    for w in group.workers:
        try:
            ray.kill(w)
        except Exception:  # noqa: BLE001 - dead already
            pass
    group.workers = []


def measure_length_mix(path: str, batch, *, dp: int, micro_batch_size: int, max_tokens: int,
                       steps: int, cpus: int, kinds: tuple[str, ...] = MIX_CONFIGS) -> dict:
    """The configurations `kinds` of the length mix on `batch` (Ray initialised by the caller),
    one after the other: a fresh TrainerGroup each, one warm-up step then `steps` timed steps,
    shut down before the next starts (side by side, an idle configuration's ranks kept their
    last step's memory, ~11 GB each by count at 8k, and Ray killed the next one's ranks for the
    node's memory). A configuration whose rank dies (Ray kills a rank at 95% of the node) is
    reported as failed, with the steps it completed and the memory its ranks were seen at."""
    steps = max(1, steps)
    return {kind: _measure_one(kind, path, batch, mix_train_config(
        kind, dp=dp, micro_batch_size=micro_batch_size, max_tokens=max_tokens), steps=steps,
        cpus=cpus) for kind in kinds}


def _measure_one(kind: str, path: str, batch, cfg, *, steps: int, cpus: int) -> dict:
    import ray

    from rlkit.train.ray_group import TrainerGroup

    dp = cfg.parallelism.data
    t0 = time.perf_counter()
    group = TrainerGroup(path, cfg, num_cpus_per_worker=cpus / dp, threads_per_worker=max(1, cpus // dp))
    sampler = None
    pids = [r["pid"] for r in group.ranks]
    try:
        weight = split_weight(kind, group.attention_weight)
        r: dict = {
            "config": ({"max_tokens_per_micro_batch": cfg.max_tokens_per_micro_batch}
                       if kind == "by-tokens" else {"micro_batch_size": cfg.micro_batch_size}),
            "setup_s": time.perf_counter() - t0, "pids": pids, "split_attention_weight": weight,
            "rss_after_setup_mb": [process_memory_mb(p)["rss_mb"] for p in pids],
            **plan_figures(batch, cfg, weight, group.attention_weight),
            # what the split by cost plans, whichever split the configuration ran: the
            # tokens-alone split's replicas priced as the cost planner prices them
            "cost_share": cost_share(batch, cfg, weight, group.attention_weight),
            "step_s_all": [], "replica_s_all": [], "shares": [],
        }
        sampler = RssSampler(pids)
        for round_ in range(1 + steps):
            t = time.perf_counter()
            try:
                replica_s = timed_accumulate(group, batch, weight)
                metrics = group.step()
            except ray.exceptions.RayError as e:
                r["failed"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
                r["failed_in_round"] = round_
                kill_group(group)
                break
            step_s = time.perf_counter() - t
            if round_ == 0:  # warm-up
                r.update(warmup_step_s=step_s, padding_fraction=metrics["train/padding_fraction"],
                         step_micro_batches=metrics["train/micro_batches"],
                         step_empty_micro_batches=metrics["train/empty_micro_batches"])
                continue
            r["step_s_all"].append(step_s)
            r["replica_s_all"].append(replica_s)
            r["shares"].append(slowest_share(replica_s))
        sampler.stop()
        r["rss_sampled_max_mb"] = [sampler.peak_mb[p] for p in pids]
        if "failed" in r:  # the ranks are gone, and their exact peaks with them
            r["peak_rss_mb"] = r["rss_growth_mb"] = [None] * len(pids)
        else:
            memory = [process_memory_mb(p) for p in pids]
            r["peak_rss_mb"] = [m["peak_rss_mb"] for m in memory]
            r["rss_growth_mb"] = [
                None if m["peak_rss_mb"] is None or a is None else m["peak_rss_mb"] - a
                for m, a in zip(memory, r["rss_after_setup_mb"])
            ]
    finally:
        if sampler is not None:
            sampler.stop()
        group.shutdown()
        # the next configuration starts once these ranks have exited and freed their memory
        # (a run started the next while they were exiting: Ray killed its rank at 95%)
        wait_exited(pids)
    if r["step_s_all"]:
        best, median = min(r["step_s_all"]), statistics.median(r["step_s_all"])
        r.update(
            step_s=best, step_s_median=median,
            train_tokens_per_s=batch.tokens / best, train_tokens_per_s_median=batch.tokens / median,
            slowest_share=statistics.median(r["shares"]),
        )
    return r


def bench_length_mix(*, model: str, samples: int, prompt: int, median: int, sigma: float, cap: int,
                     dp: int, micro_batch_size: int, max_tokens: int, steps: int, cpus: int,
                     kinds: tuple[str, ...] = MIX_CONFIGS) -> dict:
    from rlkit.driver.local_ray import local_ray
    from rlkit.train.hf_io import read_config

    load_before = os.getloadavg()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rlkit-bench-train-") as tmp:
        path = model_path(model, Path(tmp))
        batch = length_mix_batch(int(read_config(path)["vocab_size"]), samples=samples, prompt=prompt,
                                 median=median, sigma=sigma, cap=cap)
        lengths = sorted(s.length for s in batch.samples)
        with local_ray(cpus):
            configs = measure_length_mix(path, batch, dp=dp, micro_batch_size=micro_batch_size,
                                         max_tokens=max_tokens, steps=steps, cpus=cpus, kinds=kinds)
    return {
        "length_mix": {
            "model": model, "dp": dp, "samples": samples, "prompt_tokens": prompt,
            "median_response": median, "sigma": sigma, "cap": cap, "steps": max(1, steps),
            "tokens": batch.tokens, "longest": lengths[-1], "median_length": statistics.median(lengths),
            "lengths": lengths, "configs": configs,
        },
        "conditions": {
            "cpus": os.cpu_count(), "ray_cpus": cpus, "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(), "wall_s": time.perf_counter() - t_start,
            "memory_gb": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
            "note": "shared machine: other processes may run; compare figures within one run",
        },
    }


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
                    result["training"].append(time_training(path, name, tp, steps, cpus))
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



def mix_label(kind: str, config: dict) -> str:
    if kind == "by-tokens":
        return f"by-tokens {config['max_tokens_per_micro_batch']}"
    return f"by-count {config['micro_batch_size']}" + (", tok split" if kind != "by-count" else "")


def format_length_mix_table(result: dict) -> str:
    m = result["length_mix"]
    lines = [
        f"length mix: {m['model']}, DP={m['dp']}, {m['samples']} samples, {m['tokens']} tokens "
        f"(median {m['median_length']:g}, longest {m['longest']}, cap {m['cap']}); fastest of "
        f"{m['steps']} timed step(s) after a warm-up, configurations one after the other",
        "config               mbs/rep  largest mb tok  mask entries  pad%  best step s  tok/s best  "
        "tok/s med  peak RSS MB per rank  slowest/mean  cost plan  layout plan",
    ]
    notes = []
    for kind, r in m["configs"].items():
        c = r["config"]
        label = mix_label(kind, c)
        big = r["largest_micro_batch"]
        plans = f"{r['cost_share']:9.3f}  {r['layout_share']:11.3f}"
        head = f"{label:<20} {r['micro_batches_per_replica']:>7}  {big['tokens']:>14}  {big['mask_entries']:>12.3g}"
        if "step_s" in r:
            rss = "/".join("?" if v is None else f"{v:.0f}" for v in r["peak_rss_mb"])
            lines.append(
                f"{head}  {100 * r['padding_fraction']:4.1f}  {r['step_s']:11.2f}  "
                f"{r['train_tokens_per_s']:10.1f}  {r['train_tokens_per_s_median']:9.1f}  {rss:>20}  "
                f"{r['slowest_share']:12.3f}  {plans}"
            )
        else:
            lines.append(f"{head}  failed in round {r.get('failed_in_round')}: no timed step"
                         f"{' ' * 36}{plans}")
        if "failed" in r:
            seen = "/".join(f"{v:.0f}" for v in r["rss_sampled_max_mb"])
            notes.append(f"{label}: failed in round {r['failed_in_round']} (0: warm-up); its ranks "
                         f"were seen at {seen} MB RSS (sampled every 0.2 s); {r['failed']}")
    c = result["conditions"]
    lines.append("")
    lines.append("slowest/mean: the slowest DP replica's accumulate seconds over the mean (median "
                 "of the timed steps); cost plan: the same by the cost n + w n^2 per sample; layout "
                 "plan: by the dense layout's cost rows x width + 2 w rows x width^2 per micro-batch "
                 "(padding included: what the trainer computes)")
    lines.extend(notes)
    lines.append(
        f"{c['cpus']} CPUs ({c['ray_cpus']} to Ray), {c['memory_gb']:.1f} GB; load average before "
        f"{c['loadavg_before'][0]:.2f}, after {c['loadavg_after'][0]:.2f}; {c['wall_s']:.0f} s; {c['note']}"
    )
    return "\n".join(lines)
