"""Calibrate the roofline's efficiencies against a published benchmark, by simulating it.

NVIDIA publishes TensorRT-LLM's maximum output throughput for Llama-3.1-8B (FP8) on one H100
and one H200 for ten input/output length pairs (TensorRT-LLM docs/source/performance/
perf-overview.md, "Throughput Measurements": `trtllm-bench throughput`, requests of fixed
lengths all queued at once, KV cache at 0.90-0.95 of free memory, default capacity scheduler
GUARANTEED_NO_EVICT which reserves a request's full length at admission).

`calibrate()` simulates that benchmark on one simulated engine with a roofline profile
(roofline.py) and fits the efficiencies to the H100 column by coordinate search on the
log-error; the H200 column is held out and reported as a check. SGLang's decode speed for
dense models of this size is on par with TensorRT-LLM's, so the fitted efficiencies are used
for the SGLang-served Qwen profiles (an assumption, stated in each profile).

Run `python -m rlkit.sim.calibrate [--refit] [--write]` to print the simulated table against
the published one (refitting first with --refit) and, with --write, regenerate the packaged
GPU profiles (rollout/engines/profiles/).
"""

from __future__ import annotations

import argparse
import asyncio
import math
from dataclasses import replace
from pathlib import Path

from rlkit.buffers.sample import Sample
from rlkit.rollout.config import SamplingConfig
from rlkit.sim.clock import run_virtual
from rlkit.sim.engine import SimConfig, SimEngines
from importlib import resources

from rlkit.rollout.engines.profile import PROFILE_PACKAGE, EngineProfile, save_profile
from rlkit.sim.roofline import (
    H100_SXM, H200_SXM, LLAMA31_8B, QWEN3_4B, QWEN25_7B, QWEN25_32B, Efficiency, GpuSpec,
    derive_profile,
)

PUBLISHED_SOURCE = (
    "NVIDIA TensorRT-LLM performance overview (docs/source/performance/perf-overview.md, "
    "commit 00f37686), Llama 3.1 8B FP8, TP1, total output tokens/s"
)
# (input, output) -> output tokens/s, Llama-3.1-8B FP8, TP1.
PUBLISHED_H100 = {
    (128, 128): 28312, (128, 2048): 22714, (128, 4096): 14325, (500, 2000): 17660,
    (1000, 1000): 15220, (1000, 2000): 13899, (2048, 128): 3450, (2048, 2048): 9305,
    (5000, 500): 3459, (20000, 2000): 1351,
}
PUBLISHED_H200 = {
    (128, 128): 27911, (128, 2048): 26221, (128, 4096): 18027, (500, 2000): 20770,
    (1000, 1000): 17744, (1000, 2000): 16828, (2048, 128): 3538, (2048, 2048): 12194,
    (5000, 500): 3902, (20000, 2000): 1804,
}
# Every point is fitted: the prefill cost includes attention, quadratic in the context,
# which dominates 20000/2000 (it was left out before the profiles modelled it).
FIT_POINTS = list(PUBLISHED_H100)
REQUESTS = 1500  # per point (the published runs use 1,000-30,000)
TRT_MAX_BATCH = 2048  # trtllm-bench pytorch backend default max_batch_size
TRT_KV_FRACTION = 0.925  # "0.95 ... fall back to 0.90"
TRT_RESERVED_BYTES = 4e9  # activations, CUDA graphs, runtime (assumed)

# The result of `calibrate()` (python -m rlkit.sim.calibrate --refit reproduces it; about
# six minutes on two cores). The packaged profiles are derived with it.
FITTED = Efficiency(
    bw=0.9, flops=0.4, prefill=0.5, step_s=0.0005,
    source="fitted to " + PUBLISHED_SOURCE + ", H100 column, rms log-error 0.048; H200 column "
           "held out: -7% to +15%",
)


def trt_profile(gpu: GpuSpec, eff: Efficiency) -> EngineProfile:
    """Llama-3.1-8B FP8 (FP8 weights, KV and matmuls) on one `gpu`, TensorRT-LLM style."""
    lm = LLAMA31_8B
    weights = lm.total_params * 1.0
    kv_cap = int(TRT_KV_FRACTION * (gpu.hbm_bytes - weights - TRT_RESERVED_BYTES)
                 / lm.kv_bytes_per_token(1.0))
    return derive_profile(lm, gpu, weight_bytes=1.0, kv_bytes=1.0, fp8_compute=True,
                          kv_capacity_tokens=kv_cap, max_running_requests=TRT_MAX_BATCH, eff=eff)


def simulate_throughput(profile: EngineProfile, isl: int, osl: int,
                        requests: int = REQUESTS) -> float:
    """Output tokens/s of one engine given `requests` identical requests queued at t=0."""
    cfg = SimConfig(1, profile, reserve_ratio=1.0, reserve_clip_tokens=1 << 40,
                    stream_spans=False)
    sampling = SamplingConfig(max_new_tokens=osl, ignore_eos=True)
    prompt = [1] * isl

    async def main() -> float:
        engines = SimEngines(cfg)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        samples = [Sample(i, i, prompt) for i in range(requests)]
        await asyncio.gather(*(engines.generate(s, sampling, max_new_tokens=osl, version=0)
                               for s in samples))
        elapsed = loop.time() - t0
        await engines.aclose()
        return requests * osl / elapsed

    return run_virtual(main)


def log_error(gpu: GpuSpec, eff: Efficiency, published: dict, points) -> float:
    prof = trt_profile(gpu, eff)
    errs = [math.log(simulate_throughput(prof, i, o) / published[(i, o)]) for i, o in points]
    return math.sqrt(sum(e * e for e in errs) / len(errs))


def calibrate(rounds: int = 2, verbose: bool = True) -> Efficiency:
    """Coordinate search of the efficiencies against the H100 column."""
    eff = Efficiency(bw=0.8, flops=0.5, prefill=0.5, step_s=0.0005, source="fit")
    grids = {
        "bw": [0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9],
        "flops": [0.3, 0.4, 0.5, 0.6, 0.7, 0.8],
        "prefill": [0.3, 0.4, 0.5, 0.6, 0.7, 0.8],
        "step_s": [0.0, 0.0005, 0.001, 0.002, 0.004],
    }
    best = log_error(H100_SXM, eff, PUBLISHED_H100, FIT_POINTS)
    for _ in range(rounds):
        for name, values in grids.items():
            for v in values:
                cand = replace(eff, **{name: v})
                err = log_error(H100_SXM, cand, PUBLISHED_H100, FIT_POINTS)
                if err < best - 1e-9:
                    best, eff = err, cand
            if verbose:
                print(f"  {name}: {getattr(eff, name)}  rms log-error {best:.3f}")
    return replace(eff, source=f"fitted to {PUBLISHED_SOURCE}, H100 column, rms log-error "
                                f"{best:.3f}")


def report(eff: Efficiency) -> str:
    lines = ["| ISL/OSL | H100 published | H100 simulated | H200 published (held out) | "
             "H200 simulated |", "|---|---:|---:|---:|---:|"]
    p100, p200 = trt_profile(H100_SXM, eff), trt_profile(H200_SXM, eff)
    for i, o in PUBLISHED_H100:
        s100, s200 = simulate_throughput(p100, i, o), simulate_throughput(p200, i, o)
        lines.append(f"| {i}/{o} | {PUBLISHED_H100[(i, o)]:,} | {s100:,.0f} "
                     f"({s100 / PUBLISHED_H100[(i, o)] - 1:+.0%}) | {PUBLISHED_H200[(i, o)]:,} | "
                     f"{s200:,.0f} ({s200 / PUBLISHED_H200[(i, o)] - 1:+.0%}) |")
    return "\n".join(lines)


def packaged_profiles(eff: Efficiency) -> list[EngineProfile]:
    """The GPU-like profiles shipped in rollout/engines/profiles (SGLang-served, bf16)."""
    note = ("Efficiencies transferred from TensorRT-LLM to SGLang (assumption: comparable "
            "decode speed for dense models of this size).")
    return [
        derive_profile(QWEN3_4B, H100_SXM, tp=1, mem_fraction_static=0.85, eff=eff,
                       name="h100-qwen3-4b-tp1", note=note),
        # APRIL's set-up: 8 GPUs colocated, engines of 2 GPUs, mem_fraction_static 0.6.
        derive_profile(QWEN3_4B, H100_SXM, tp=2, mem_fraction_static=0.6, eff=eff,
                       name="h100-qwen3-4b-tp2-april", note=note),
        derive_profile(QWEN3_4B, H200_SXM, tp=1, mem_fraction_static=0.85, eff=eff,
                       name="h200-qwen3-4b-tp1", note=note),
        derive_profile(QWEN25_7B, H100_SXM, tp=1, mem_fraction_static=0.85, eff=eff,
                       name="h100-qwen2.5-7b-tp1", note=note),
        derive_profile(QWEN25_32B, H100_SXM, tp=4, mem_fraction_static=0.85, eff=eff,
                       name="h100-qwen2.5-32b-tp4", note=note),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refit", action="store_true",
                        help="fit the efficiencies again (else report and use FITTED)")
    parser.add_argument("--write", action="store_true", help="regenerate packaged profiles")
    args = parser.parse_args(argv)
    eff = calibrate() if args.refit else FITTED
    print(eff)
    print(report(eff))
    if args.write:
        out = Path(resources.files(PROFILE_PACKAGE))  # the packaged profiles, beside the runtime
        out.mkdir(exist_ok=True)
        for p in packaged_profiles(eff):
            save_profile(p, out / f"{p.name}.json")
            print("wrote", out / f"{p.name}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
