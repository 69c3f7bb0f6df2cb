"""Measure what the simulator needs to model rlkit's built-in hf engine on a CPU machine.

    python -m rlkit.sim.measure_hf --model tiny --profile docs/profiles/cpu-tiny-t1.json

Writes (merges into) the profile JSON, keeping its other keys. What it measures, and how:

1. Decode steps (`ptl_s`, `kv_s_per_token_by_batch`, `kv_s_per_token`, and
   `serving.cpu_interference`): a fleet of two real hf engine servers behind sglang-router,
   driven by EngineClient exactly as in a rollout (streamed, stream interval 8). For each
   batch size B and prompt width W, B requests of W tokens pinned to engine 0 decode N1 and
   then N2 tokens (`ignore_eos`); engine 0's core-process CPU time (psutil) for N2 minus that
   for N1 is N2 - N1 whole decode-loop iterations (step, sampling, progress reports), the
   prefill cancelled out. CPU time, not wall time, so other work on the machine (and the
   time-slicing the simulator models separately) does not inflate it; what the serving
   stack and the other engine do to the engine's caches does. Per B, a least-squares line
   over the widths in the mean KV tokens read gives the step at zero context (ptl_s) and the
   cost per KV token (the slope grows with B on CPU). Rows of equal width: padded = paged.
   Each point runs alone (engine 1 idle) and beside engine 1 running the same load; the
   profile is fitted on "alone", and `cpu_interference` is the median ratio both/alone - 1
   (shared L3 cache and memory bandwidth). Median of 2 passes over the whole grid.
2. Prefill forwards (`prefill_s_per_forward`, `prefill_s_per_token`, `prefill_s_per_token_sq`):
   `BatchedDecoder._prefill` (the engine's own prefill: one left-padded forward, KV moved into
   the batch, first token sampled) on R requests of W tokens, thread CPU time, median of
   reps; least squares of `fixed + a R W + b R W^2` with errors weighted by 1/sqrt(cost)
   (between relative and absolute: the long forwards, which dominate a step's prefill time,
   weigh more); attention over the context is quadratic in it and dominates the tiny model's
   prefill beyond a few hundred tokens.
   `max_prefill_tokens` is the engine's default (rows x longest context per forward).
3. The serving stack (`serving`: read by `SimConfig.from_profile`), through one real engine
   server behind the real sglang-router and rlkit's EngineClient, CPU times of every process
   (psutil): `chunk_cpu_s`, CPU seconds in the HTTP process + router + client per streamed
   chunk (B=32 requests of 1,024 tokens, stream interval 8, minus the per-request part);
   `request_cpu_s` (bursts of 1-token requests); `request_latency_s`, the round trip of a
   1-token streamed request minus its prefill (the simulator charges it before the request
   reaches its engine); `control_rtt_s`, GET /v1/loads straight to the worker; the client's
   abort poll back-off (`abort_poll_s`, from EngineClient); and `abort_all` on 32 running
   requests, measured as is (for comparison with the simulated poll). `cpu_cores` is the
   machine's core count: the engines, the serving stack and other work share them.

Needs torch and transformers (the engine's dependencies); the simulator itself does not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
DECODE_WIDTHS = (32, 512, 2048)
PREFILL_ROWS = (1, 2, 4, 8)
PREFILL_WIDTHS = (32, 128, 256, 512, 1024, 1536, 2048)
MAX_PREFILL_TOKENS = 8192  # rollout.engines.config.EngineConfig.max_prefill_tokens


def _cpu(proc: Any) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _core_process(http: Any) -> Any:
    """The engine's core process: the one child of its HTTP server process that is not
    multiprocessing's resource tracker."""
    return [k for k in http.children(recursive=True)
            if "resource_tracker" not in " ".join(k.cmdline())][0]


async def _batch(client: Any, prompts: list[list[int]], n: int,
                 workers: list[str] | None = None) -> float:
    """Generate n tokens (ignoring EOS) for each prompt at once, through the router or pinned
    to `workers` (one per prompt); the wall seconds it took."""
    from rlkit.buffers.sample import Sample
    from rlkit.rollout.config import SamplingConfig

    sampling = SamplingConfig(max_new_tokens=n, ignore_eos=True, temperature=1.0)
    samples = [Sample(index=i, group_id=i, prompt_ids=p) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    await asyncio.gather(*(client.generate(s, sampling, max_new_tokens=n, version=0, worker=w)
                           for s, w in zip(samples, workers or [None] * len(samples))))
    return time.perf_counter() - t0


# -- 1. decode ------------------------------------------------------------------------------------
def measure_decode(model_path: str, batches=DECODE_BATCHES, widths=DECODE_WIDTHS,
                   n1: int = 32, n2: int = 416, passes: int = 2) -> dict[str, Any]:
    """Decode-loop CPU per step of engine 0 in a fleet of two, through the router and the
    client, alone (engine 1 idle) and beside engine 1 running the same load."""
    import psutil

    from rlkit.rollout.engines.config import EngineConfig, RouterConfig
    from rlkit.rollout.engines.fleet import EngineFleet

    cfg = EngineConfig(num_engines=2, cpu_threads=1, max_running_requests=256)
    grid = [(b, w) for b in batches for w in widths if b * w <= 65536]
    per_point: dict[tuple[int, int, str], list[float]] = {}
    with EngineFleet(model_path, cfg, RouterConfig()) as fleet:
        core = _core_process(psutil.Process(fleet.engines[0].pid))
        urls = fleet.worker_urls
        seq = [0]

        async def run(client: Any, b: int, w: int, n: int, both: bool) -> float:
            prompts, workers = [], []
            for url in urls if both else urls[:1]:
                for _ in range(b):
                    seq[0] += 1
                    prompts.append([3 + (seq[0] * 7919 + j * 104729) % 500 for j in range(w)])
                    workers.append(url)
            c0 = _cpu(core)
            await _batch(client, prompts, n, workers)
            return _cpu(core) - c0

        async def main() -> None:
            async with fleet.client() as client:
                await run(client, 8, 32, 16, True)  # warm-up
                for _ in range(passes):
                    for b, w in grid:
                        for mode in ("alone", "both"):
                            both = mode == "both"
                            cpu1 = await run(client, b, w, n1, both)
                            cpu2 = await run(client, b, w, n2, both)
                            # the same prefill in both runs: the difference is n2 - n1 steps
                            per_point.setdefault((b, w, mode), []).append((cpu2 - cpu1) / (n2 - n1))
                        print(f"decode B={b} W={w}: alone "
                              f"{1e3 * per_point[(b, w, 'alone')][-1]:.3f}, both "
                              f"{1e3 * per_point[(b, w, 'both')][-1]:.3f} ms/step", flush=True)

        asyncio.run(main())
    rows = [{"batch": b, "width": w, "kv_tokens": b * (w + (n1 + n2) / 2),
             "alone_s": statistics.median(per_point[(b, w, "alone")]),
             "both_s": statistics.median(per_point[(b, w, "both")]),
             "passes": {m: per_point[(b, w, m)] for m in ("alone", "both")}} for b, w in grid]
    base, slope = fit_ptl(rows, batches, "alone_s")
    interference = float(np.median([r["both_s"] / r["alone_s"] for r in rows])) - 1.0
    return {"batch_sizes": list(batches), "ptl_s": base, "kv_s_per_token_by_batch": slope,
            "interference": max(0.0, interference), "points": rows, "new_tokens": [n1, n2]}


# -- 2. prefill -----------------------------------------------------------------------------------
def measure_prefill(model_path: str, rows_list=PREFILL_ROWS, widths=PREFILL_WIDTHS,
                    reps: int = 5) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from rlkit.rollout.engines.builtin.batched_decoder import BatchedDecoder
    from rlkit.rollout.engines.builtin.requests import DecodeParams, DecodeRequest

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    vocab = model.get_input_embeddings().weight.shape[0]
    points = []
    for r in rows_list:
        for w in widths:
            if r * w > MAX_PREFILL_TOKENS:
                continue
            times = []
            for rep in range(reps):
                d = BatchedDecoder(model, eos_token_ids=set(), max_running_requests=256,
                                   context_length=1 << 20)
                reqs = [DecodeRequest(rid=f"p{rep}-{i}", input_ids=[3 + (i * 31 + j) % (vocab - 3)
                                                                    for j in range(w)],
                                      params=DecodeParams(max_new_tokens=1 << 20, ignore_eos=True))
                        for i in range(r)]
                with torch.inference_mode():
                    c0 = time.thread_time()
                    d._prefill(reqs)
                    times.append(time.thread_time() - c0)
            points.append({"rows": r, "width": w, "cpu_s": statistics.median(times)})
            print(f"prefill R={r} W={w}: {1e3 * points[-1]['cpu_s']:.2f} ms", flush=True)
    a = np.array([[1.0, p["rows"] * p["width"], p["rows"] * p["width"] ** 2] for p in points])
    y = np.array([p["cpu_s"] for p in points])
    coef = _nonneg_lstsq(a, y, 1.0 / np.sqrt(y))
    return {"prefill_s_per_forward": coef[0], "prefill_s_per_token": coef[1],
            "prefill_s_per_token_sq": coef[2], "points": points}


def _nonneg_lstsq(a: np.ndarray, y: np.ndarray, w: np.ndarray) -> list[float]:
    """Weighted least squares with non-negative coefficients (tiny active set)."""
    active = list(range(a.shape[1]))
    while True:
        coef = np.zeros(a.shape[1])
        sol, *_ = np.linalg.lstsq(a[:, active] * w[:, None], y * w, rcond=None)
        coef[active] = sol
        if (sol >= 0).all():
            return [float(c) for c in coef]
        active.pop(int(np.argmin(sol)))


# -- 3. serving stack -------------------------------------------------------------------------------
def fit_ptl(rows: list[dict[str, Any]], batches: Sequence[int], key: str) -> tuple[list[float], list[float]]:
    """Per batch size, step time = PTL + slope x KV tokens (least squares over the contexts
    measured): the profile's ptl_s and kv_s_per_token_by_batch. The slope is floored at 0 and
    PTL at half the fastest step (a noisy fit must not predict free steps)."""
    base, slope = [], []
    for b in batches:
        pts = [r for r in rows if r["batch"] == b]
        x = np.array([r["kv_tokens"] for r in pts])
        y = np.array([r[key] for r in pts])
        k, c = np.polyfit(x, y, 1)
        slope.append(max(float(k), 0.0))
        base.append(max(float(c), 0.5 * float(y.min())))
    return base, slope


async def measure_control(client: Any, url: str, running_s: float) -> dict[str, Any]:
    """What the client's control calls cost on one engine: a control round trip (each abort
    poll is one) and abort_all on 32 requests that have run for `running_s`."""
    from rlkit.rollout.http.client import ABORT_POLL_FIRST_S, EngineClient

    ctl = []
    for _ in range(40):
        t0 = time.perf_counter()
        await client.worker_load(url)
        ctl.append(time.perf_counter() - t0)
    aborts = []
    for _ in range(5):
        task = asyncio.create_task(_batch(client, [[13 + i] * 24 for i in range(32)], 4000))
        await asyncio.sleep(running_s)
        t0 = time.perf_counter()
        await client.abort_all()
        aborts.append(time.perf_counter() - t0)
        await task
    return {"control_rtt_s": statistics.median(ctl), "abort_all_s": aborts,
            "abort_poll_s": [ABORT_POLL_FIRST_S, EngineClient(url).abort_poll_interval_s]}


def measure_serving(model_path: str, stream_interval: int = 8) -> dict[str, Any]:
    import urllib.request

    import psutil

    from rlkit.rollout.engines.config import EngineConfig, RouterConfig
    from rlkit.rollout.engines.fleet import EngineFleet

    cfg = EngineConfig(num_engines=1, cpu_threads=1, max_running_requests=256,
                       stream_interval=stream_interval)
    out: dict[str, Any] = {}
    with EngineFleet(model_path, cfg, RouterConfig()) as fleet:
        http = psutil.Process(fleet.engines[0].pid)
        procs = {"core": _core_process(http), "http": http,
                 "router": psutil.Process(fleet.router.process.pid), "client": psutil.Process()}
        url = fleet.worker_urls[0]

        def cpu() -> dict[str, float]:
            return {k: _cpu(p) for k, p in procs.items()}

        def stats() -> dict[str, Any]:
            with urllib.request.urlopen(f"{url}/rlkit/decode_stats?reset=1", timeout=60) as r:
                return json.loads(r.read())

        async def main() -> None:
            async with fleet.client() as client:
                await _batch(client, [[5] * 24] * 8, 16)  # warm-up
                # per request: bursts of 1-token requests (one chunk each: the final one)
                per_req = []
                for _ in range(3):
                    c0 = cpu()
                    await _batch(client, [[7 + i % 100] * 24 for i in range(256)], 1)
                    c1 = cpu()
                    per_req.append(sum(c1[k] - c0[k] for k in ("http", "router", "client")) / 256)
                out["request_cpu_s"] = statistics.median(per_req)
                # per chunk: 32 requests x 1024 tokens
                per_chunk = []
                for _ in range(2):
                    c0 = cpu()
                    await _batch(client, [[9 + i] * 24 for i in range(32)], 1024)
                    c1 = cpu()
                    chunks = 32 * -(-1024 // stream_interval)
                    serving = sum(c1[k] - c0[k] for k in ("http", "router", "client"))
                    per_chunk.append((serving - 32 * out["request_cpu_s"]) / chunks)
                out["chunk_cpu_s"] = statistics.median(per_chunk)
                # request round trip, minus the engine's prefill
                stats()
                rtts = [await _batch(client, [[11] * 24], 1) for _ in range(40)]
                pre = stats()["prefill"]
                out["request_latency_s"] = max(
                    0.0, statistics.median(rtts) - pre["seconds"] / max(1, pre["forwards"]))
                out.update(await measure_control(client, url, running_s=0.3))
                out["stream_interval"] = stream_interval

        asyncio.run(main())
    return out


# -- the profile ------------------------------------------------------------------------------------
def put_fits(data: dict[str, Any], decode: dict[str, Any] | None, prefill: dict[str, Any] | None) -> None:
    """The simulator's fitted fields from a decode and a prefill measurement (either None:
    kept as they are), for the CPU profile here and the GPU one (tools/gpu/measure_profile.py)."""
    if decode is not None:
        data["batch_sizes"] = decode["batch_sizes"]
        data["ptl_s"] = decode["ptl_s"]
        data["kv_s_per_token_by_batch"] = decode["kv_s_per_token_by_batch"]
        data["kv_s_per_token"] = float(np.median(decode["kv_s_per_token_by_batch"]))
    if prefill is not None:
        for k in ("prefill_s_per_forward", "prefill_s_per_token", "prefill_s_per_token_sq"):
            data[k] = prefill[k]
        data["max_prefill_tokens"] = MAX_PREFILL_TOKENS


def update_profile(path: Path, decode: dict[str, Any] | None, prefill: dict[str, Any] | None,
                   serving: dict[str, Any] | None, command: str) -> dict[str, Any]:
    data = json.loads(path.read_text()) if path.exists() else {}
    measured = data.setdefault("measured_hf", {})
    conditions = {"command": command, "date": time.strftime("%Y-%m-%d"),
                  "cpu_count": os.cpu_count(), "machine": platform.machine(),
                  "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
                  "torch_threads": 1, "timing": "engine-core process CPU time (decode), thread "
                  "CPU time (prefill), process CPU times and wall clock (serving)"}
    put_fits(data, decode, prefill)
    if decode is not None:
        data.pop("measured", None)  # `rlkit bench engine`'s raw steps: not what ptl_s now is
        data["max_running_requests"] = max(decode["batch_sizes"])
        data.setdefault("serving", {})["cpu_interference"] = decode["interference"]
        measured["decode"] = {"points": decode["points"], "new_tokens": decode["new_tokens"],
                              **conditions}
    if prefill is not None:
        measured["prefill"] = {"points": prefill["points"], **conditions}
    if serving is not None:
        data["serving"] = {
            **data.get("serving", {}),
            "cpu_cores": os.cpu_count(),
            "chunk_cpu_s": serving["chunk_cpu_s"],
            "stream_interval": serving["stream_interval"],
            "request_latency_s": serving["request_latency_s"],
            "control_rtt_s": serving["control_rtt_s"],
            "abort_poll_s": serving["abort_poll_s"],
        }
        measured["serving"] = {"request_cpu_s": serving["request_cpu_s"],
                               "abort_all_s": serving["abort_all_s"], **conditions}
    data["kv_layout"] = "padded"
    data["source"] = (
        "hf engine on this CPU: decode-loop CPU per step in a fleet of two engines behind "
        "sglang-router and EngineClient, prefill forwards of BatchedDecoder in thread CPU time, "
        "serving-stack CPU and round trips through the real server: `python -m "
        "rlkit.sim.measure_hf` (see its docstring); names and batch sizes as `rlkit bench "
        "engine` writes them")
    data.setdefault("name", path.stem)
    data.setdefault("device", f"cpu ({platform.machine()}, {os.cpu_count()} cores)")
    data.setdefault("model", "tiny")
    path.write_text(json.dumps(data, indent=2) + "\n")
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="demo model name or HF folder")
    p.add_argument("--profile", default="docs/profiles/cpu-tiny-t1.json")
    p.add_argument("--only", default="decode,prefill,serving",
                   help="comma-separated parts to measure (the others are kept)")
    args = p.parse_args(argv)
    import torch

    from rlkit.rollout.demo_models import resolve_model_path

    torch.set_num_threads(1)
    path = resolve_model_path(args.model)
    parts = set(args.only.split(","))
    decode = measure_decode(path) if "decode" in parts else None
    prefill = measure_prefill(path) if "prefill" in parts else None
    serving = measure_serving(path) if "serving" in parts else None
    if serving is not None:
        print(json.dumps(serving, indent=1))
    command = "python -m rlkit.sim.measure_hf " + " ".join(argv or [])
    update_profile(Path(args.profile), decode, prefill, serving, command.strip())
    print(f"updated {args.profile}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
