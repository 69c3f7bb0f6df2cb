"""`rlkit bench train --length-mix`: micro-batches by count vs by token budget on a long-tail
batch, DP replicas as Ray actors (this comparison alone: the other sections are skipped).

One batch of `--mix-samples` samples with short prompts and log-normal response lengths (median
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

import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from rlkit.bench.train_inputs import model_path, synthetic_batch

MIX_CONFIGS = ("by-count", "by-count-split-by-tokens", "by-tokens")


def mix_kinds(text: str) -> tuple[str, ...]:
    from rlkit.common.errors import UserError

    kinds = tuple(k for k in text.split(",") if k)
    unknown = [k for k in kinds if k not in MIX_CONFIGS]
    if unknown or not kinds:
        raise UserError(f"--mix-configs {text!r}: name one or more of {', '.join(MIX_CONFIGS)}"
                        + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    return tuple(dict.fromkeys(kinds))


def length_mix_batch(vocab: int, *, samples: int, prompt: int, median: int, sigma: float, cap: int,
                     seed: int = 0):
    """`samples` samples of `prompt` prompt tokens and log-normal response lengths (median,
    sigma), each sample at most `cap` tokens in all."""
    from rlkit.common.errors import UserError

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
