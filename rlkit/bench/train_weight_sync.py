"""`rlkit bench train`, weight sync: seconds per GB of each method of pushing the trainer's weights.

The trainer's HF weights are pushed by broadcast and through disk to (a) loopback
receivers (local processes that join the broadcast group and receive every tensor, or read the
safetensors folder, as an engine's receive side does, without a model: the transport alone) and
(b) one built-in engine server (rollout/engines/builtin/hf_server.py) that also loads the weights into
its model. Seconds per GB = wall time of one whole update (the rollout side's pause/flush, the
trainer's write or send, continue: rollout/engine_updates.py) divided by the GB sent; the first
distributed update, which forms the group, is reported apart. Paused seconds: the update less
the trainer's staging (writing the folder, forming the group), which it does inside the update.
"""

from __future__ import annotations

import statistics
from pathlib import Path


def time_weight_sync(path: str, rounds: int, receivers: str, workdir: Path) -> list[dict]:
    """Seconds per update and per GB of each method to `receivers`: 'loopback', 'engine' (one
    built-in engine server started here on the same model) or a comma list of engine URLs.
    In memory ('tensor') only to a real engine on this machine (a loopback receiver loads
    nothing, and a URL may be elsewhere)."""
    import time

    from rlkit.common.engine_http import HttpEngine
    from rlkit.rollout.engine_updates import EngineUpdates
    from rlkit.train.config import TrainConfig
    from rlkit.train.megatron.trainer import MegatronTrainer
    from rlkit.train.weight_sync.loopback import LoopbackEngines
    from rlkit.train.weight_sync.sender import WeightSender

    trainer = MegatronTrainer.single_process(path, TrainConfig(device="cpu"))
    loopback, engine_proc, control = None, None, HttpEngine
    if receivers == "loopback":
        loopback = LoopbackEngines(1)
        urls, control = loopback.urls, loopback.control
        trainer.attach_sender(WeightSender(bucket_mb=trainer.config.weight_sync.bucket_mb, engine_factory=loopback.control))
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
            updates = EngineUpdates(method=method, folder=str(workdir / "sync"), control=control)
            reports = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                metrics = updates.run(urls, trainer.version + 1, trainer.publish_weights)
                reports.append({**metrics, "seconds": time.perf_counter() - t0})
            steady = reports[1:] or reports  # the first distributed update also forms the group
            fastest = min(steady, key=lambda r: r["seconds"])
            gb = steady[0]["sync/bytes"] / 1e9
            out.append({
                "method": method, "receivers": receivers if receivers in ("loopback", "engine") else "urls",
                "engines": len(urls), "gb": gb, "buckets": int(steady[0]["sync/buckets"]),
                "seconds": fastest["seconds"], "seconds_per_gb": fastest["seconds"] / gb if gb else 0.0,
                "paused_seconds": fastest["seconds"] - fastest["sync/stage_seconds"],
                "seconds_median": statistics.median(r["seconds"] for r in steady),
                "first_update_seconds": reports[0]["seconds"],
            })
    finally:
        trainer.close()
        if loopback is not None:
            loopback.close()
        if engine_proc is not None:
            engine_proc.stop()
    return out


def table_lines(results: list[dict]) -> list[str]:
    lines = ["sync method   receivers   GB      best s    s/GB    paused s  first update s"]
    for r in results:
        lines.append(
            f"{r['method']:<13} {r['receivers']:<10} {r['gb']:6.3f} {r['seconds']:9.2f} "
            f"{r['seconds_per_gb']:7.2f} {r['paused_seconds']:9.2f} {r['first_update_seconds']:14.2f}"
        )
    return lines
