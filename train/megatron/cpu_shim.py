"""The one place where megatron-core 0.16 is adapted to run on CPU (gloo, no TE, no apex).

megatron-core assumes CUDA in two ways that matter for the local (non-TE) GPT layers:

1. It asks ``torch.cuda.current_device()`` for the device of the RoPE frequencies, the attention
   score buffer (``get_global_memory_buffer``) and the DDP gradient buffers. On a CPU-only torch
   that call raises. The shim makes it return ``"cpu"``, which every one of those call sites
   accepts as a ``device=`` argument.
2. Its RNG tracker seeds CUDA generators (``model_parallel_cuda_manual_seed``). The shim installs
   the inference tracker instead, which forks nothing; with dropout 0 no random numbers are drawn
   inside the model.

What still fails on CPU and is therefore avoided rather than shimmed (see docs/facts.md):
``get_megatron_optimizer`` and the distributed optimizer (hard-coded ``device='cuda'``), the
pipeline schedules from ``get_forward_backward_func`` (also for PP=1) and
``get_default_causal_mask`` (we always pass our own attention mask). The CPU path calls the
model's forward/backward directly and steps a torch AdamW.

``apply_cpu_shim`` is called only when the trainer's device is CPU; on CUDA nothing is patched.
"""

from __future__ import annotations

import torch

_applied = False


def _cpu_current_device() -> str:
    return "cpu"


def apply_cpu_shim() -> None:
    """Patch torch.cuda.current_device and reset megatron's RNG tracker. Idempotent."""
    global _applied
    if torch.cuda.is_available():
        raise RuntimeError(
            "apply_cpu_shim: CUDA is available in this process; the CPU shim must not be applied "
            "where megatron can use the GPU (set train.device=cuda or leave it on auto)"
        )
    if not _applied:
        torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
        _applied = True
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
