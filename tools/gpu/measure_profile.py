"""Measure the simulator's profile of rlkit's built-in hf engine on a CUDA GPU (docs/gpu.md).

    python3 tools/gpu/measure_profile.py --model smollm2 --out docs/profiles/h100-smollm2-t1.json

The GPU counterpart of `python -m rlkit.sim.measure_hf` (which measures CPU engines in CPU
time): on a GPU the engine's cost is wall time, and its engines do not share cores (16 of
them for 2 engines), so the profile has no `cpu_cores` and the simulator treats the engines as
independent devices. It writes the same keys:

1. Decode (`batch_sizes`, `ptl_s`, `kv_s_per_token_by_batch`, `kv_s_per_token`): a fleet of two
   hf engine servers on the GPU behind sglang-router, driven by EngineClient as a rollout is
   (streamed, stream interval 8). For each batch size B and prompt width W, B requests of W
   tokens pinned to engine 0 generate N1 and then N2 tokens (`ignore_eos`); the wall-time
   difference / (N2 - N1) is one whole decode-loop iteration (model step, sampling, progress
   reports, the serving stack streaming alongside), prefill cancelled out. Per B, a
   least-squares line over the widths in the KV tokens read gives the step at zero context and
   the cost per KV token. The engine's own per-step clock (`/rlkit/decode_stats`, median) is
   kept beside it. A few points also run with engine 1 decoding the same load at the same
   time (two engines sharing one GPU): `measured_gpu.decode.shared_gpu_slowdown`.
2. Prefill (`prefill_s_per_forward`, `prefill_s_per_token`, `prefill_s_per_token_sq`):
   `BatchedDecoder._prefill` (one left-padded forward, KV moved into the batch, first token
   sampled) on R rows of W tokens, wall time between CUDA synchronisations, median of reps;
   weighted non-negative least squares of `fixed + a R W + b R W^2` (measure_hf's fit).
3. Serving (`serving`): `request_latency_s` (round trip of a streamed 1-token request minus
   one prefill forward), `control_rtt_s` (GET /v1/loads), the client's abort poll back-off,
   `stream_interval`; `abort_all` on 32 running requests is timed as is (kept for comparison).

`--only decode,prefill,serving` re-measures parts and keeps the rest of an existing file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
DECODE_WIDTHS = (32, 512, 1024)
SHARED_POINTS = ((8, 512), (32, 512), (64, 32))
PREFILL_ROWS = (1, 2, 4, 8, 16)
PREFILL_WIDTHS = (32, 128, 256, 512, 1024, 2048)
MAX_PREFILL_TOKENS = 8192  # EngineConfig.max_prefill_tokens


def _prompts(b: int, w: int, seed: int, vocab: int) -> list[list[int]]:
    return [[3 + (seed * 7919 + i * 104729 + j * 31) % (vocab - 3) for j in range(w)] for i in range(b)]


def _decode_stats(url: str) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/rlkit/decode_stats?reset=1", timeout=60) as r:
        return json.loads(r.read())


def measure_decode(model_path: str, vocab: int, batches=DECODE_BATCHES, widths=DECODE_WIDTHS,
                   n1: int = 16, n2: int = 80, shared=SHARED_POINTS, device: str = "cuda") -> dict[str, Any]:
    from rlkit.rollout.engines.config import EngineConfig, RouterConfig
    from rlkit.rollout.engines.fleet import EngineFleet
    from rlkit.sim.measure_hf import _batch, fit_ptl

    cfg = EngineConfig(num_engines=2, cpu_threads=1, max_running_requests=256, device=device)
    rows: list[dict[str, Any]] = []
    shared_rows: list[dict[str, Any]] = []
    with EngineFleet(model_path, cfg, RouterConfig()) as fleet:
        urls = fleet.worker_urls
        seq = [0]

        async def timed(client: Any, b: int, w: int, n: int, engines: int) -> float:
            prompts, workers = [], []
            for url in urls[:engines]:
                seq[0] += 1
                prompts += _prompts(b, w, seq[0], vocab)
                workers += [url] * b
            return await _batch(client, prompts, n, workers)

        async def main() -> None:
            async with fleet.client() as client:
                for b in (1, 8, 64):  # warm-up: kernels, allocator, KV buffers
                    await timed(client, b, 64, 8, 2)
                for b in batches:
                    for w in widths:
                        t1 = await timed(client, b, w, n1, 1)
                        _decode_stats(urls[0])
                        t2 = await timed(client, b, w, n2, 1)
                        st = _decode_stats(urls[0])
                        at_b = next((r for r in st["decode"] if r["batch_size"] == b), None)
                        step = (t2 - t1) / (n2 - n1)
                        rows.append({"batch": b, "width": w, "kv_tokens": b * (w + (n1 + n2) / 2),
                                     "step_s": step, "t_n1_s": t1, "t_n2_s": t2,
                                     "engine_median_step_s": at_b and at_b["median_seconds"]})
                        print(f"decode B={b} W={w}: {1e3 * step:.2f} ms/step (engine clock "
                              f"{1e3 * (at_b['median_seconds'] if at_b else float('nan')):.2f})",
                              flush=True)
                for b, w in shared:
                    alone = [(await timed(client, b, w, n2, 1) - await timed(client, b, w, n1, 1))
                             / (n2 - n1)]
                    both = [(await timed(client, b, w, n2, 2) - await timed(client, b, w, n1, 2))
                            / (n2 - n1)]
                    shared_rows.append({"batch": b, "width": w, "alone_s": min(alone),
                                        "both_s": min(both)})
                    print(f"shared GPU B={b} W={w}: alone {1e3 * min(alone):.2f}, both "
                          f"{1e3 * min(both):.2f} ms/step", flush=True)

        asyncio.run(main())
    base, slope = fit_ptl(rows, batches, "step_s")
    slowdown = [r["both_s"] / r["alone_s"] - 1.0 for r in shared_rows]
    return {"batch_sizes": list(batches), "ptl_s": base, "kv_s_per_token_by_batch": slope,
            "points": rows, "new_tokens": [n1, n2], "shared_gpu": shared_rows,
            "shared_gpu_slowdown": float(np.median(slowdown)) if slowdown else None}


def measure_prefill(model_path: str, rows_list=PREFILL_ROWS, widths=PREFILL_WIDTHS,
                    reps: int = 5, device: str = "cuda") -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from rlkit.rollout.engines.builtin.batched_decoder import BatchedDecoder
    from rlkit.rollout.engines.builtin.requests import DecodeParams, DecodeRequest
    from rlkit.sim.measure_hf import _nonneg_lstsq

    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the engine's auto dtype
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype,
                                                 attn_implementation="sdpa").to(device).eval()

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()
    vocab = model.get_input_embeddings().weight.shape[0]

    def once(r: int, w: int, tag: str) -> float:
        d = BatchedDecoder(model, eos_token_ids=set(), max_running_requests=256, context_length=1 << 20)
        reqs = [DecodeRequest(rid=f"{tag}-{i}", input_ids=[3 + (i * 31 + j) % (vocab - 3) for j in range(w)],
                              params=DecodeParams(max_new_tokens=1 << 20, ignore_eos=True))
                for i in range(r)]
        with torch.inference_mode():
            sync()
            t0 = time.perf_counter()
            d._prefill(reqs)
            sync()
            return time.perf_counter() - t0

    for r, w in ((1, 32), (4, 512), (8, 1024)):  # warm-up
        once(r, w, "warm")
    points = []
    for r in rows_list:
        for w in widths:
            if r * w > MAX_PREFILL_TOKENS:
                continue
            times = [once(r, w, f"p{rep}") for rep in range(reps)]
            points.append({"rows": r, "width": w, "wall_s": statistics.median(times)})
            print(f"prefill R={r} W={w}: {1e3 * points[-1]['wall_s']:.2f} ms", flush=True)
    a = np.array([[1.0, p["rows"] * p["width"], p["rows"] * p["width"] ** 2] for p in points])
    y = np.array([p["wall_s"] for p in points])
    coef = _nonneg_lstsq(a, y, 1.0 / np.sqrt(y))
    fit = a @ np.array(coef)
    return {"prefill_s_per_forward": coef[0], "prefill_s_per_token": coef[1],
            "prefill_s_per_token_sq": coef[2], "points": points,
            "fit_max_rel_error": float(np.max(np.abs(fit - y) / y))}


def measure_serving(model_path: str, prefill_1x24_s: float, stream_interval: int = 8,
                    device: str = "cuda") -> dict[str, Any]:
    from rlkit.rollout.engines.config import EngineConfig, RouterConfig
    from rlkit.rollout.engines.fleet import EngineFleet
    from rlkit.sim.measure_hf import _batch, measure_control

    cfg = EngineConfig(num_engines=1, cpu_threads=1, max_running_requests=256,
                       stream_interval=stream_interval, device=device)
    out: dict[str, Any] = {}
    with EngineFleet(model_path, cfg, RouterConfig()) as fleet:
        url = fleet.worker_urls[0]

        async def main() -> None:
            async with fleet.client() as client:
                await _batch(client, [[5] * 24] * 8, 16)  # warm-up
                rtts = [await _batch(client, [[11] * 24], 1) for _ in range(40)]
                out["request_rtt_s"] = statistics.median(rtts)
                out["request_latency_s"] = max(0.0, out["request_rtt_s"] - prefill_1x24_s)
                out.update(await measure_control(client, url, running_s=0.5))
                out["stream_interval"] = stream_interval

        asyncio.run(main())
    return out


def write_profile(path: Path, model: str, decode, prefill, serving, command: str) -> dict[str, Any]:
    import torch

    from rlkit.bench.engine import device_tag
    from rlkit.sim.measure_hf import put_fits

    data = json.loads(path.read_text()) if path.exists() else {}
    measured = data.setdefault("measured_gpu", {})
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (script check only)"
    cond = {"command": command, "date": time.strftime("%Y-%m-%d"), "gpu": gpu,
            "torch": torch.__version__, "cuda": torch.version.cuda, "cpu_count": os.cpu_count(),
            "timing": "wall clock (decode: client-side difference of two lengths; prefill: "
                      "between CUDA synchronisations; serving: round trips)"}
    put_fits(data, decode, prefill)
    if decode is not None:
        data["max_running_requests"] = 256
        measured["decode"] = {k: decode[k] for k in ("points", "new_tokens", "shared_gpu",
                                                     "shared_gpu_slowdown")} | cond
    if prefill is not None:
        measured["prefill"] = {"points": prefill["points"],
                               "fit_max_rel_error": prefill["fit_max_rel_error"]} | cond
    if serving is not None:
        data["serving"] = {
            "stream_interval": serving["stream_interval"],
            "request_latency_s": serving["request_latency_s"],
            "control_rtt_s": serving["control_rtt_s"],
            "abort_poll_s": serving["abort_poll_s"],
        }
        measured["serving"] = {k: serving[k] for k in ("request_rtt_s", "abort_all_s")} | cond
    data["kv_layout"] = "padded"
    data.setdefault("prefill_s_per_token", 0.0)
    data["name"] = path.stem
    data["device"] = f"{gpu} (1 GPU, {os.cpu_count()} CPU cores; engines share the GPU, not cores)"
    data["model"] = model
    data["source"] = (
        f"hf engine (rlkit.rollout.engines.builtin.hf_server) on one {gpu}, bfloat16, 1 torch thread per "
        "engine: decode-loop wall time per step of engine 0 in a fleet of two behind "
        "sglang-router and EngineClient, prefill forwards of BatchedDecoder timed between CUDA "
        "synchronisations, request and control round trips through the real server: `python3 "
        "tools/gpu/measure_profile.py` (see its docstring); the engines are independent devices "
        f"for the simulator (no cpu_cores). Device tag {device_tag()}.")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="demo model name or HF folder")
    p.add_argument("--out", required=True, help="profile JSON (merged into if it exists)")
    p.add_argument("--only", default="decode,prefill,serving")
    p.add_argument("--batches", default=",".join(map(str, DECODE_BATCHES)))
    p.add_argument("--widths", default=",".join(map(str, DECODE_WIDTHS)))
    p.add_argument("--prefill-rows", default=",".join(map(str, PREFILL_ROWS)))
    p.add_argument("--prefill-widths", default=",".join(map(str, PREFILL_WIDTHS)))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu only to check this script on a machine without a GPU")
    args = p.parse_args(argv)
    from rlkit.rollout.demo_models import resolve_model_path

    path = resolve_model_path(args.model)
    vocab = int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])
    parts = set(args.only.split(","))
    t0 = time.perf_counter()
    ints = lambda text: tuple(int(x) for x in text.split(",") if x)  # noqa: E731
    command = "python3 tools/gpu/measure_profile.py " + " ".join(argv if argv is not None else sys.argv[1:])
    name = Path(args.model).name
    # each part is written as soon as it is measured: a run stopped by a time limit keeps them
    data: dict[str, Any] = {}
    prefill = None
    if "prefill" in parts:
        prefill = measure_prefill(path, ints(args.prefill_rows), ints(args.prefill_widths), device=args.device)
        data = write_profile(Path(args.out), name, None, prefill, None, command)
    if "decode" in parts:
        decode = measure_decode(path, vocab, ints(args.batches), ints(args.widths), device=args.device)
        data = write_profile(Path(args.out), name, decode, None, None, command)
    if "serving" in parts:
        if prefill is None and Path(args.out).exists():  # the prefill model of an earlier run
            earlier = json.loads(Path(args.out).read_text())
            prefill = earlier if "prefill_s_per_forward" in earlier else None
        one = prefill["prefill_s_per_forward"] + 24 * prefill["prefill_s_per_token"] \
            + 24 * 24 * prefill["prefill_s_per_token_sq"] if prefill else 0.0
        serving = measure_serving(path, one, device=args.device)
        print(json.dumps(serving, indent=1))
        data = write_profile(Path(args.out), name, None, None, serving, command)
    print(json.dumps({k: v for k, v in data.items() if k != "measured_gpu"}, indent=1))
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
