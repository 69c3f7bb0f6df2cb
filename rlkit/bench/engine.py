"""`rlkit bench engine`: output tokens/s of the built-in engine through the real router, beside
plain `model.generate` on the same batch, in the same run; and the engine's PTL(BS) profile.

For each model and concurrency C, interleaved for `--rounds` rounds:
- generate: `model.generate` on C identical-length prompts in this process (sampling at
  temperature 1, no top-k/top-p, exactly N new tokens, no EOS);
- engine: C concurrent EngineClient.generate calls through sglang-router to one hf engine
  server (another process), streamed like the RolloutManager streams, `ignore_eos` and
  `max_new_tokens=N` so every request makes exactly N tokens (trace replay).
Both sides use the same torch thread count; while one side runs the other is idle. Tokens/s is
C x N over the wall time of the whole batch (first request sent to last token received), so the
router, HTTP, SSE parsing and `Sample.append` are included on the engine side.

On a CUDA machine (`--device auto` finds one, or `--device cuda`) both sides run on the GPU in
bfloat16 (the engine's own default there) and the profile is named after the GPU
(`h100-<model>-t1.json`, ...) instead of `cpu-<model>-t1.json`.

The profile pass then runs B in (1, 2, 4, ...) requests and reads the engine's own per-step
timings (GET /rlkit/decode_stats) to write PTL(BS) - seconds per decode step at batch size B -
in the simulator's EngineProfile format (rollout/engines/profile.py), plus the per-token prefill
cost and a KV-context slope from a second pass at a longer context.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlkit.bench.report import add_out_argument, out_folder, write_report

DEFAULT_NEW_TOKENS = {"tiny": 128, "tiny-llama": 128, "smollm2": 32}


@dataclass
class Measurement:
    model: str
    concurrency: int
    new_tokens: int
    generate_tok_s: list[float] = field(default_factory=list)
    engine_tok_s: list[float] = field(default_factory=list)
    load_avg: list[float] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return statistics.mean(self.engine_tok_s) / statistics.mean(self.generate_tok_s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="tiny,smollm2", help="comma-separated demo models or paths")
    parser.add_argument("--concurrency", default="1,8,16,32,64",
                        help="comma-separated levels ('' to write only the profile)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="tokens per request (default: tiny 128, smollm2 32)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repetitions per level")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="both sides' device (auto: cuda when available); bfloat16 on cuda, "
                        "float32 on cpu")
    parser.add_argument("--no-stream", action="store_true", help="non-streaming /generate")
    parser.add_argument("--stream-interval", type=int, default=None,
                        help="tokens per streamed chunk (default: EngineConfig's, 8; SGLang's is 1)")
    parser.add_argument("--profile-batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--profile-dir", default=None,
                        help="where PTL profiles are written (default: the --out folder; '' to "
                        "skip the profile pass). Not "
                        "docs/profiles by default: the committed profiles also carry prefill and "
                        "serving costs measured by `python -m rlkit.sim.measure_hf` "
                        "(docs/simulation.md), which this pass would drop")
    add_out_argument(parser, "engine")


def run(args: argparse.Namespace) -> int:
    import torch

    out = out_folder(args.out)
    if args.profile_dir is None:
        args.profile_dir = str(out)
    torch.set_num_threads(args.threads)
    results: list[Measurement] = []
    profiles: list[str] = []
    levels = [int(x) for x in args.concurrency.split(",") if x]
    for model in [m for m in args.models.split(",") if m]:
        n = args.new_tokens or DEFAULT_NEW_TOKENS.get(model, 64)
        rows, profile_path = bench_model(model, levels, n, args)
        results += rows
        if profile_path:
            profiles.append(profile_path)
        print(render_table([r for r in rows]), flush=True)
    from rlkit.rollout.engines.config import EngineConfig

    conditions = load_conditions(args.threads) | device_conditions(resolve_device(args.device)) | {
        "stream": not args.no_stream,
        "stream_interval": args.stream_interval or EngineConfig().stream_interval,
        "engines": 1, "prompt_len": args.prompt_len,
    }
    report = {
        "command": "rlkit bench engine " + " ".join(_argv_of(args)),
        "conditions": conditions,
        "results": [asdict(r) | {"ratio": r.ratio} for r in results],
        "profiles": profiles,
    }
    table = render_table(results)
    print("\n" + table)
    print(f"\nload conditions: {json.dumps(report['conditions'])}")
    for p in profiles:
        print(f"PTL profile: {p}")
    write_report(out, "engine", report, table)
    return 0


def _argv_of(args: argparse.Namespace) -> list[str]:
    out = [f"--models {args.models}", f"--concurrency {args.concurrency}",
           f"--prompt-len {args.prompt_len}", f"--rounds {args.rounds}", f"--threads {args.threads}"]
    if getattr(args, "device", "auto") != "auto":
        out.append(f"--device {args.device}")
    if args.new_tokens:
        out.append(f"--new-tokens {args.new_tokens}")
    if args.no_stream:
        out.append("--no-stream")
    if args.stream_interval:
        out.append(f"--stream-interval {args.stream_interval}")
    return out


def load_conditions(threads: int) -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "load_avg_1m_5m_15m": [round(x, 2) for x in os.getloadavg()],
        "torch_threads_per_side": threads,
        "machine": platform.machine(),
        "python": platform.python_version(),
    }


def resolve_device(name: str = "auto") -> str:
    """'cuda' or 'cpu' (auto: cuda when torch sees a GPU)."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    return name


@functools.lru_cache(maxsize=None)
def device_tag(device: str = "auto") -> str:
    """The profile-name prefix of this machine: 'cpu', or the GPU's model in lower case
    ('h100', 'h200', 'a100', ...; 'cuda' for a name without a recognisable model)."""
    import re

    if resolve_device(device) != "cuda":
        return "cpu"
    import torch

    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", torch.cuda.get_device_name(0).upper())
    return m.group(1).lower() if m else "cuda"


def device_conditions(device: str) -> dict[str, Any]:
    if device != "cuda":
        return {"device": "cpu"}
    import torch

    return {"device": "cuda", "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__, "cuda": torch.version.cuda}


def render_table(rows: list[Measurement]) -> str:
    lines = ["| model | concurrency | new tokens | generate tok/s | engine via router tok/s | engine / generate | load avg |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        g, e = statistics.mean(r.generate_tok_s), statistics.mean(r.engine_tok_s)
        lines.append(f"| {r.model} | {r.concurrency} | {r.new_tokens} | {g:,.0f} | {e:,.0f} | "
                     f"{r.ratio:.2f} | {statistics.mean(r.load_avg):.2f} |")
    return "\n".join(lines)


# -- one model ----------------------------------------------------------------------------------
def bench_model(model_name: str, levels: list[int], n: int, args: argparse.Namespace) -> tuple[list[Measurement], str | None]:
    import torch
    from transformers import AutoModelForCausalLM

    from rlkit.rollout.demo_models import resolve_model_path
    from rlkit.rollout.engines.config import EngineConfig, RouterConfig
    from rlkit.rollout.engines.fleet import EngineFleet

    device = resolve_device(getattr(args, "device", "auto"))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the engine's auto dtype
    path = resolve_model_path(model_name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                 attn_implementation="sdpa").to(device).eval()
    vocab = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    max_c = max(levels + [int(x) for x in args.profile_batch_sizes.split(",") if x])
    prompts = torch.randint(10, vocab - 10, (max_c, args.prompt_len), generator=g)

    engine = EngineConfig(num_engines=1, cpu_threads=args.threads, max_running_requests=max_c,
                          startup_timeout_s=600, device=device)
    if args.stream_interval:
        engine = engine.model_copy(update={"stream_interval": args.stream_interval})
    rows = []
    with EngineFleet(path, engine, RouterConfig()) as fleet:
        for c in levels:
            m = Measurement(model_name, c, n)
            batch = prompts[:c]
            # warm both sides at this batch size (allocator, thread pools, KV buffers)
            plain_generate(model, batch, min(n, 8))
            asyncio.run(engine_generate(fleet, batch.tolist(), min(n, 8), not args.no_stream))
            for _ in range(args.rounds):
                m.load_avg.append(os.getloadavg()[0])
                m.generate_tok_s.append(c * n / plain_generate(model, batch, n))
                m.engine_tok_s.append(c * n / asyncio.run(
                    engine_generate(fleet, batch.tolist(), n, not args.no_stream)))
            print(f"{model_name} C={c}: generate {statistics.mean(m.generate_tok_s):,.0f} tok/s, "
                  f"engine {statistics.mean(m.engine_tok_s):,.0f} tok/s, ratio {m.ratio:.2f}",
                  flush=True)
            rows.append(m)
        profile_path = None
        if args.profile_dir:
            profile_path = write_profile(fleet, model_name, prompts.tolist(), n, args)
    return rows, profile_path


def plain_generate(model: Any, prompts: Any, n: int) -> float:
    """Seconds for HF generate to sample exactly n tokens for every prompt."""
    import torch

    device = next(model.parameters()).device
    prompts = prompts.to(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n,
                       min_new_tokens=n, do_sample=True, temperature=1.0, top_k=None, top_p=None,
                       eos_token_id=None, pad_token_id=0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


async def engine_generate(fleet: Any, prompts: list[list[int]], n: int, stream: bool) -> float:
    """Seconds for the engine, through the router, to generate exactly n tokens per prompt."""
    from rlkit.buffers.sample import Sample
    from rlkit.rollout.config import SamplingConfig

    sampling = SamplingConfig(max_new_tokens=n, ignore_eos=True, temperature=1.0)
    async with fleet.client(stream=stream) as client:
        samples = [Sample(index=i, group_id=i, prompt_ids=p) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        await asyncio.gather(*(client.generate(s, sampling, max_new_tokens=n, version=0)
                               for s in samples))
        seconds = time.perf_counter() - t0
    made = sum(len(s.response_ids) for s in samples)
    if made != n * len(prompts):
        raise RuntimeError(f"engine made {made} tokens, expected {n * len(prompts)}")
    return seconds


# -- the PTL(BS) profile -------------------------------------------------------------------------
def _decode_stats(url: str, reset: bool = False) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/rlkit/decode_stats?reset={int(reset)}", timeout=60) as r:
        return json.loads(r.read())


def measure_ptl(fleet: Any, prompts: list[list[int]], sizes: list[int], n: int) -> tuple[list[float], list[float], float]:
    """For each batch size B: B requests of n tokens in lockstep; the median engine-side step
    time at exactly B rows (robust to spikes from other processes) and the mean context."""
    url = fleet.worker_urls[0]
    ptl, ctx = [], []
    prefill_s = prefill_tokens = 0.0
    for b in sizes:
        _decode_stats(url, reset=True)
        asyncio.run(engine_generate(fleet, prompts[:b], n, stream=True))
        stats = _decode_stats(url, reset=True)
        row = next((r for r in stats["decode"] if r["batch_size"] == b), None)
        if row is None:
            raise RuntimeError(f"no decode step ran at batch size {b}")
        ptl.append(row["median_seconds"])
        ctx.append(row["mean_context_tokens"])
        prefill_s += stats["prefill"]["seconds"]
        prefill_tokens += stats["prefill"]["tokens"]
    return ptl, ctx, prefill_s / max(1.0, prefill_tokens)


def write_profile(fleet: Any, model_name: str, prompts: list[list[int]], n: int,
                  args: argparse.Namespace) -> str:
    from rlkit.rollout.engines.profile import EngineProfile, save_profile

    sizes = [int(x) for x in args.profile_batch_sizes.split(",") if x]
    ptl, ctx, prefill = measure_ptl(fleet, prompts, sizes, n)
    # KV slope: the same batch sizes with a 4x longer prompt; seconds per extra context token.
    long_prompts = [p * 4 for p in prompts]
    ptl_long, ctx_long, _ = measure_ptl(fleet, long_prompts, sizes, n)
    slopes = [(pl - ps) / (cl - cs) for ps, pl, cs, cl in zip(ptl, ptl_long, ctx, ctx_long) if cl > cs]
    kv_slope = max(0.0, statistics.median(slopes)) if slopes else 0.0
    # ptl_s is reported at zero context: the measured step minus the context term.
    base = [max(p - kv_slope * c, 0.5 * p) for p, c in zip(ptl, ctx)]
    label = Path(model_name).name or model_name  # a demo name, or a folder's name
    device = resolve_device(getattr(args, "device", "auto"))
    if device == "cuda":
        import torch

        where = f"bfloat16 on {torch.cuda.get_device_name(0)} ({os.cpu_count()} CPU cores)"
        device_text = f"{torch.cuda.get_device_name(0)} (1 GPU; {os.cpu_count()} CPU cores)"
    else:
        where = f"float32, {os.cpu_count()}-core CPU"
        device_text = f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    profile = EngineProfile(
        name=f"{device_tag(device)}-{label}-t{args.threads}",
        source=(f"rlkit bench engine: hf engine (rlkit.rollout.engines.builtin.hf_server), {args.threads} torch "
                f"thread(s), {where}, load avg "
                f"{os.getloadavg()[0]:.2f}; ptl_s = median decode-step seconds at each batch size "
                f"(prompt {args.prompt_len} tokens, {n} new) minus kv_s_per_token x context; "
                f"kv slope from a 4x-longer-prompt pass"),
        device=device_text,
        model=label,
        batch_sizes=tuple(sizes),
        ptl_s=tuple(base),
        prefill_s_per_token=prefill,
        kv_s_per_token=kv_slope,
        max_running_requests=max(sizes),
        extra={"measured": {"ptl_s_at_context": ptl, "mean_context_tokens": ctx,
                            "ptl_s_long_context": ptl_long, "mean_context_tokens_long": ctx_long}},
    )
    out = Path(args.profile_dir) / f"{profile.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, out)
    return str(out)
