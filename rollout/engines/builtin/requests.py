"""What one generation request is, shared by the HTTP process and the engine core.

Plain dataclasses with no torch import, so the HTTP process of the hf engine stays light (it never
imports torch or a model) and requests pickle across the pipe to the core.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from rlkit.rollout.http.protocol import FinishReason


@dataclass
class DecodeParams:
    """Validated per-request generation parameters (what the decoder needs of SamplingParams)."""

    max_new_tokens: int
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None


@dataclass(eq=False)
class DecodeRequest:
    """One generation. The decoder thread is the only writer of the output fields; readers on
    other threads see whole appends (list.append is atomic under the GIL) and must read
    `finish_reason` before the outputs to see a consistent final state."""

    rid: str
    input_ids: list[int]
    params: DecodeParams
    stream: bool = False
    # SGLang's logprob_start_len: >= 0 scores the input tokens after that position at prefill
    # (what a resumed partial rollout asks to re-score its parked tokens under new weights)
    logprob_start_len: int = -1
    lora: str | None = None  # the loaded LoRA adapter it runs under (None: the base model)
    input_logprobs: list[float | None] | None = None  # set once, by the first prefill
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[str] = field(default_factory=list)  # weights that produced each token
    weight_version: str = "0"  # version of the weights that produced the latest token
    finish_reason: FinishReason | None = None
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    retractions: int = 0
    # decoder-private
    _rng: random.Random | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
