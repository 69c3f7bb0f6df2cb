"""Helpers of the engine-layer tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "sglang"

# Logprobs reported by an engine vs a teacher-forced forward of the same weights: float32 on
# CPU, batched (padded) vs unbatched matmuls differ by rounding only.
LOGPROB_TOLERANCE = 1e-4


def fixture_json(name: str):
    return json.loads((FIXTURES / name).read_text())


def fixture_text(name: str) -> str:
    return (FIXTURES / name).read_text()


def teacher_forced_logprobs(model, prompt: Sequence[int], response: Sequence[int],
                            temperature: float = 1.0) -> list[float]:
    """log_softmax(logits / T) of each response token given everything before it: what SGLang
    (and so the hf engine) reports for sampled tokens."""
    import torch

    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    t = temperature if temperature > 1e-6 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)
    return lp.gather(1, torch.tensor(list(response))[:, None])[:, 0].tolist()
