"""`rlkit bench lora`: what LoRA saves, measured on one machine: the trainer's memory (parameters,
gradient buffers, optimizer state) with full training and with adapters of each rank, and each
weight sync to one built-in engine server started here: the full weights, the merged weights of
a LoRA trainer, and the adapter alone (in memory and through a PEFT folder); bytes sent and
seconds per sync (the rollout side's update around the trainer's publish: EngineUpdates.run, as
a run does it), and the weight-sync check (train.weight_sync.verify) of each: the engine's mean
|logprob difference| to the trainer on the probe, under the adapter requests would name.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from rlkit.bench.report import add_out_argument, out_folder, write_report
from rlkit.bench.train_inputs import MODELS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help=f"one of {MODELS}")
    parser.add_argument("--ranks", default="8,32", help="comma list of LoRA ranks")
    parser.add_argument("--rounds", type=int, default=3, help="syncs timed per configuration")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_out_argument(parser, "lora")


def trainer_memory(trainer: Any) -> dict[str, float]:
    """Bytes of the parameters, of those trained, of their gradient buffers (megatron DDP's
    main_grad) and of the optimizer state (Adam's moments, after a step)."""
    params = list(trainer.module.parameters())
    trained = [p for p in params if p.requires_grad]
    nbytes = lambda ts: float(sum(t.numel() * t.element_size() for t in ts))  # noqa: E731
    state = [t for s in trainer.optimizer._opt.state.values() for t in s.values()
             if hasattr(t, "numel") and t.dim() > 0]
    grads = [p.main_grad for p in trained if getattr(p, "main_grad", None) is not None]
    out = {"params_bytes": nbytes(params), "trained_params_bytes": nbytes(trained),
           "grad_bytes": nbytes(grads), "optimizer_bytes": nbytes(state)}
    out["total_bytes"] = out["params_bytes"] + out["grad_bytes"] + out["optimizer_bytes"]
    return out


def bench_lora(model: str, ranks: list[int], rounds: int, workdir: Path) -> dict:
    """Each trainer (full, then each rank) takes one optimizer step, is measured, and syncs to
    the engine `rounds` times by each way it can; the engine's base is reloaded from the model
    between trainers (a merged or full sync changes it)."""
    import time

    from rlkit.bench.train_inputs import model_path, synthetic_batch
    from rlkit.common.engine_http import HttpEngine
    from rlkit.common.weight_update import adapter_name
    from rlkit.rollout.engine_updates import EngineUpdates
    from rlkit.rollout.engines.config import EngineConfig
    from rlkit.rollout.engines.process import start_hf_server
    from rlkit.train.config import TrainConfig
    from rlkit.train.megatron.trainer import MegatronTrainer

    path = model_path(model, workdir)
    engine = start_hf_server(path, EngineConfig(num_engines=1, cpu_threads=1, startup_timeout_s=300))
    control = HttpEngine(engine.url)
    trainers, syncs = [], []
    try:
        for rank in [0, *ranks]:
            cfg = TrainConfig.model_validate({
                "device": "cpu", "micro_batch_size": 4, "optimizer": {"lr": 1e-3},
                **({"lora": {"rank": rank, "alpha": 2.0 * rank}} if rank else {})})
            trainer = MegatronTrainer.single_process(path, cfg)
            trainer.accumulate(synthetic_batch(trainer.arch.vocab_size, 8, 32, 32, 64))
            trainer.step()
            label = f"LoRA r{rank}" if rank else "full"
            trainers.append({"trainer": label, "rank": rank, **trainer_memory(trainer)})
            ways = [("adapter", "tensor"), ("adapter", "disk"), ("merged", "tensor")] if rank else [
                ("full", "tensor")]
            for kind, method in ways:
                updates = EngineUpdates(method=method, folder=str(workdir / "sync"), control=HttpEngine)
                seconds, sent, name = [], 0.0, None
                for _ in range(rounds):  # the sync alone is timed (the check's probe is not)
                    if name is not None:
                        control.unload_lora(name)
                    version = trainer.version + 1
                    name = adapter_name(version) if kind == "adapter" else None
                    t0 = time.perf_counter()
                    update = updates.open([engine.url], version, adapter=name)
                    metrics = trainer.publish_weights(update)
                    updates.close(update)
                    seconds.append(time.perf_counter() - t0)
                    sent = float(metrics["sync/bytes"])
                ids, theirs, _ = trainer.probe_logprobs()  # what the check compares, once
                mine = _score(engine.url, ids, name)
                if name is not None:
                    control.unload_lora(name)
                syncs.append({"trainer": label, "rank": rank, "sync": kind, "method": method,
                              "bytes": sent, "seconds_median": statistics.median(seconds),
                              "seconds_min": min(seconds),
                              "check_abs_diff": sum(abs(a - b) for a, b in zip(mine, theirs)) / len(theirs)})
            trainer.close()
            control.update_from_disk(str(path), 0)  # the base back for the next trainer
    finally:
        engine.stop()
    full = next(t for t in trainers if t["rank"] == 0)
    for t in trainers:
        t["total_vs_full"] = t["total_bytes"] / full["total_bytes"]
    full_sync = next(s for s in syncs if s["sync"] == "full")
    for s_ in syncs:
        s_["bytes_vs_full"] = s_["bytes"] / full_sync["bytes"]
        s_["seconds_vs_full"] = s_["seconds_median"] / full_sync["seconds_median"]
    return {"model": model, "rounds": rounds, "trainers": trainers, "syncs": syncs}


def format_table(result: dict) -> str:
    mib = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
    lines = [f"`{result['model']}`, one optimizer step each, fp32 on CPU; syncs to one built-in "
             f"engine, {result['rounds']} each (median seconds)", "",
             "| trainer | parameters MiB | trained MiB | gradients MiB | optimizer MiB | total MiB | vs full |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for t in result["trainers"]:
        lines.append(f"| {t['trainer']} | {mib(t['params_bytes'])} | {mib(t['trained_params_bytes'])} | "
                     f"{mib(t['grad_bytes'])} | {mib(t['optimizer_bytes'])} | {mib(t['total_bytes'])} | "
                     f"{t['total_vs_full']:.2f}x |")
    lines += ["", "| trainer | sync | method | bytes sent | vs full | seconds | vs full | check: mean abs diff |",
              "|---|---|---|---:|---:|---:|---:|---:|"]
    for s_ in result["syncs"]:
        lines.append(f"| {s_['trainer']} | {s_['sync']} | {s_['method']} | {s_['bytes']:,.0f} | "
                     f"{s_['bytes_vs_full']:.4f} | {s_['seconds_median']:.3f} | {s_['seconds_vs_full']:.2f}x | "
                     f"{s_['check_abs_diff']:.2g} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import json
    import tempfile

    out = out_folder(args.out)
    with tempfile.TemporaryDirectory(prefix="rlkit-bench-lora-") as tmp:
        result = bench_lora(args.model, [int(r) for r in args.ranks.split(",") if r], args.rounds,
                            Path(tmp))
    table = format_table(result)
    print(json.dumps(result, indent=2) if args.json else table)
    write_report(out, "lora", result, table)
    return 0


def _score(url: str, ids: list[int], adapter: str | None) -> list[float]:
    import asyncio

    from rlkit.rollout.http.client import EngineClient

    async def go() -> list[float]:
        client = await EngineClient(None, worker_urls=[url]).connect()
        try:
            return await client.score(url, ids, temperature=1.0, adapter=adapter)
        finally:
            await client.close()

    return asyncio.run(go())
