"""GPU-like engine profiles derived from published figures: a calibrated roofline.

Published inputs (each cited in the profile's "source" field and docs/simulation.md):
- GPU: HBM capacity and bandwidth, dense tensor-core FLOP/s (NVIDIA H100 SXM and H200 SXM
  datasheets);
- model: the architecture in the model's published config.json (layers, hidden size, heads,
  KV heads, head dim, MLP size, vocabulary);
- calibration: NVIDIA's published TensorRT-LLM maximum-throughput table for Llama-3.1-8B FP8
  on H100 and H200 (docs/source/performance/perf-overview.md), from which the efficiencies
  below are fitted by simulating that benchmark on the simulated engine (calibrate.py).

One decode step of B requests holding K KV tokens, on an engine of `tp` GPUs:

    t(B, K) = t_step + t_comm
              + max(weight_bytes / (tp * BW * eff_bw),  B * 2 * P / (tp * FLOPS * eff_flops))
              + K * kv_bytes_per_token / (tp * BW * eff_bw)

(weights are streamed once per step, or the matmuls are compute-bound at large B; attention
reads the whole KV cache every step). Prefilling a context of n tokens costs
(2 P n + 2 layers heads head_dim n^2) / (tp * FLOPS * eff_prefill): the matmuls, plus causal
attention (QK^T and PV over half the n x n scores), which at 16k tokens adds about 60% for
Qwen3-4B (a resumed partial rollout re-prefills its whole context).
KV capacity follows SGLang's rule: `mem_fraction_static` of GPU memory holds weights + KV pool.
The result is written in the shared profile format, with ptl_s tabulated over batch sizes and
the K term as `kv_s_per_token`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlkit.rollout.engines.profile import EngineProfile

BATCH_GRID = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


@dataclass(frozen=True)
class GpuSpec:
    name: str
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    flops_bf16: float  # dense
    flops_fp8: float  # dense
    source: str


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    source: str

    @property
    def layer_params(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate  # gated MLP: gate, up, down
        return self.layers * (attn + mlp)

    @property
    def matmul_params(self) -> int:
        """Parameters every decoded token multiplies by (layers and the LM head)."""
        return self.layer_params + self.hidden * self.vocab

    @property
    def total_params(self) -> int:
        embed = self.hidden * self.vocab
        return self.matmul_params + (0 if self.tied_embeddings else embed)

    def kv_bytes_per_token(self, kv_dtype_bytes: float) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * kv_dtype_bytes


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of the datasheet figures, and fixed per-step costs."""

    bw: float = 0.8
    flops: float = 0.5
    prefill: float = 0.5
    step_s: float = 0.0005  # scheduler, sampling, kernel launches per decode step
    allreduce_s: float = 12e-6  # one small all-reduce over NVLink (two per layer under TP)
    source: str = "assumed"


# Datasheet figures (dense, i.e. without 2:4 sparsity).
H100_SXM = GpuSpec("H100 SXM 80GB", 80e9, 3.35e12, 989e12, 1979e12,
                   "NVIDIA H100 Tensor Core GPU datasheet (SXM: 80 GB HBM3, 3.35 TB/s, "
                   "989 TFLOPS BF16 / 1,979 TFLOPS FP8 dense)")
H200_SXM = GpuSpec("H200 SXM 141GB", 141e9, 4.8e12, 989e12, 1979e12,
                   "NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e, 4.8 TB/s, "
                   "989 TFLOPS BF16 / 1,979 TFLOPS FP8 dense)")

# Architectures from the models' published config.json on the Hugging Face hub.
QWEN3_4B = ModelSpec("Qwen3-4B", 2560, 36, 32, 8, 128, 9728, 151936, True,
                     "Qwen/Qwen3-4B config.json")
QWEN25_7B = ModelSpec("Qwen2.5-7B", 3584, 28, 28, 4, 128, 18944, 152064, False,
                      "Qwen/Qwen2.5-7B config.json")
QWEN25_32B = ModelSpec("Qwen2.5-32B", 5120, 64, 40, 8, 128, 27648, 152064, False,
                       "Qwen/Qwen2.5-32B config.json")
LLAMA31_8B = ModelSpec("Llama-3.1-8B", 4096, 32, 32, 8, 128, 14336, 128256, False,
                       "meta-llama/Llama-3.1-8B config.json")


def derive_profile(
    model: ModelSpec,
    gpu: GpuSpec,
    *,
    tp: int = 1,
    weight_bytes: float = 2.0,
    kv_bytes: float = 2.0,
    fp8_compute: bool = False,
    mem_fraction_static: float = 0.85,
    kv_capacity_tokens: int | None = None,
    max_running_requests: int = 1024,
    eff: Efficiency = Efficiency(),
    name: str | None = None,
    note: str = "",
) -> EngineProfile:
    """A GPU-like profile for `model` served on `tp` GPUs of kind `gpu` (see module doc)."""
    flops = (gpu.flops_fp8 if fp8_compute else gpu.flops_bf16) * tp
    bw = gpu.hbm_bw * tp
    weights_s = model.matmul_params * weight_bytes / (bw * eff.bw)
    per_seq_s = 2 * model.matmul_params / (flops * eff.flops)
    fixed = eff.step_s + (2 * model.layers * eff.allreduce_s if tp > 1 else 0.0)
    ptl = tuple(fixed + max(weights_s, b * per_seq_s) for b in BATCH_GRID)
    kv_per_tok = model.kv_bytes_per_token(kv_bytes)
    if kv_capacity_tokens is None:
        pool = tp * gpu.hbm_bytes * mem_fraction_static - model.total_params * weight_bytes
        if pool <= 0:
            raise ValueError(f"{model.name} does not fit {tp} x {gpu.name} at "
                             f"mem_fraction_static={mem_fraction_static}")
        kv_capacity_tokens = int(pool / kv_per_tok)
    dtype = "fp8" if weight_bytes == 1 else "bf16"
    source = (
        f"Roofline derived from published figures: {gpu.source}; {model.source} "
        f"({model.matmul_params / 1e9:.2f}B matmul params, {kv_per_tok / 1024:.0f} KiB KV per "
        f"token at {kv_bytes:g} B); efficiencies bw={eff.bw:.3f}, flops={eff.flops:.3f}, "
        f"prefill={eff.prefill:.3f}, step overhead {eff.step_s * 1e3:.2f} ms "
        f"({eff.source}); TP={tp}"
        + (f", all-reduce {eff.allreduce_s * 1e6:.0f} us x 2 per layer" if tp > 1 else "")
        + f"; KV pool = {mem_fraction_static:g} x GPU memory - weights. {note}".rstrip()
    )
    return EngineProfile(
        name=name or f"{gpu.name.split()[0].lower()}-{model.name.lower()}-{dtype}-tp{tp}",
        source=source,
        device=f"{tp} x {gpu.name}",
        model=f"{model.name} ({dtype})",
        batch_sizes=BATCH_GRID,
        ptl_s=ptl,
        prefill_s_per_token=2 * model.matmul_params / (flops * eff.prefill),
        prefill_s_per_token_sq=2 * model.layers * model.heads * model.head_dim
        / (flops * eff.prefill),
        kv_s_per_token=kv_per_tok / (bw * eff.bw),
        kv_capacity_tokens=kv_capacity_tokens,
        max_running_requests=max_running_requests,
        extra={"derivation": {
            "model": model.name, "gpu": gpu.name, "tp": tp, "weight_bytes": weight_bytes,
            "kv_bytes": kv_bytes, "fp8_compute": fp8_compute,
            "mem_fraction_static": mem_fraction_static,
            "efficiency": {"bw": eff.bw, "flops": eff.flops, "prefill": eff.prefill,
                           "step_s": eff.step_s, "allreduce_s": eff.allreduce_s},
        }},
    )
